# Tessera's wire schema: every control-plane message between drivers, the scheduler and
# workers. One frame carries one Envelope; messages that come in numbers (tasks, results,
# frees) carry lists, so one frame moves a whole batch.
#
# Evolution rules: never renumber or retype a field; add new fields and union members with
# new ordinals at the end. Bump kProtocolVersion (core/rpc/wire.h) for incompatible changes.
@0xae6831ea8b7958cf;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("tessera::proto");

# ---- shared pieces ----

struct TensorMeta {
  shape @0 :List(Int64);
  dtype @1 :UInt8;        # tessera::DType
  deviceKind @2 :UInt8;   # tessera::DeviceKind
  deviceIndex @3 :Int16;
}

struct Attr {
  name @0 :Text;
  value :union {
    int @1 :Int64;
    float @2 :Float64;
    text @3 :Text;
    ints @4 :List(Int64);
  }
}

struct Error {
  code @0 :UInt8;         # tessera::StatusCode; 0 (OK) never travels
  message @1 :Text;
}

struct ObjectDecl {
  id @0 :UInt64;
  name @1 :Text;
  meta @2 :TensorMeta;
  role @3 :UInt8;         # tessera::ObjectRole
}

struct Donation {
  input @0 :UInt16;
  output @1 :UInt16;
}

struct Task {
  id @0 :UInt64;
  name @1 :Text;
  layer @2 :Text;
  op @3 :Text;
  attrs @4 :List(Attr);
  inputs @5 :List(UInt64);
  outputs @6 :List(ObjectDecl);
  pinnedWorker @7 :UInt64;     # 0: the scheduler decides
  priority @8 :Int32;
  memoryEstimate @9 :Int64;
  donations @10 :List(Donation);
  after @11 :List(UInt64);     # control edges: task ids that must end before this one starts
  deviceKind @12 :UInt8;       # tessera::DeviceKind the task runs on (its worker's CPU or GPU)
}

# Where an object can be pulled from: the holder's id and data-plane address.
struct Source {
  object @0 :UInt64;
  holder @1 :UInt64;
  address @2 :Text;
  bytes @3 :Int64;
}

# ---- joining and liveness ----

enum Role {
  worker @0;
  driver @1;
  admin @2;               # tessera status / stop
}

struct Hello {
  protocolVersion @0 :UInt32;
  role @1 :Role;
  token @2 :Text;
  hostname @3 :Text;
  pid @4 :Int32;
  dataAddress @5 :Text;   # where peers pull this process's objects
  cpuThreads @6 :Int32;
  hostCapacity @7 :Int64; # bytes of the host tier
  gpu @8 :Text;           # the GPU a worker owns (its description); empty for a CPU worker
  cpus @9 :Text;          # the CPUs the process may run on ("0-3,8": core/cpu_set.h); empty: unknown
}

struct Welcome {
  id @0 :UInt64;          # the worker's or driver's id in this cluster
  heartbeatIntervalMs @1 :UInt32;
  sessionDir @2 :Text;
}

struct Heartbeat {
  hostUsed @0 :Int64;
  hostCapacity @1 :Int64;
  spilledBytes @2 :Int64;
  tasksRunning @3 :Int32;
  tasksDone @4 :Int64;       # cumulative: tasks finished here (registered graphs' and submitted)
  bytesPulled @5 :Int64;     # data plane, cumulative: bytes this worker pulled from peers
  pullMicros @6 :Int64;      # ... and the time those pulls took (start to last byte)
  bytesServed @7 :Int64;     # bytes peers pulled from this worker
  waits @8 :WaitState;       # what the worker runs or waits for now (tessera status --waits)
  spilledTotal @9 :Int64;    # cumulative: bytes its object store wrote to disk (spilledBytes: now)
  cpuSeconds @10 :Float64;   # cumulative: CPU time of the worker process (user + system)
  cpuUtilization @11 :Float32;  # cores it kept busy over the last heartbeat interval
  objects @12 :Int64;        # objects in its store now
  deviceBytes @13 :Int64;    # bytes of them in the device tier (a GPU worker's)
  restores @14 :Int64;       # cumulative: objects its store read back from disk
  gpu @15 :GpuUse;           # a GPU worker's device figures (core/gpu_use.h); unset: none
}

struct GpuUse {
  utilization @0 :Float32;   # 0..1: the part of the last sample period a kernel was running
  memoryUsed @1 :Int64;      # bytes in use on the device, every process's
  memoryTotal @2 :Int64;
}

# A worker's own view of what it runs or waits for, as of its heartbeat (worker/wait_state.h).
struct WaitState {
  running @0 :List(Text);    # tasks running now ("graph.instance/task", or a task's name)
  awaited @1 :List(AwaitedObject);  # objects a graph run waits for
  collective @2 :CollectiveWait;  # the member in progress on the collective stream, if any
  instance @3 :Text;         # the graph instance in progress ("graph.instance"); empty: none
}

struct AwaitedObject {
  name @0 :Text;             # "graph.instance/object"
  producer @1 :UInt64;       # the worker producing it; 0: a bound input (pulled)
}

struct CollectiveWait {
  task @0 :Text;             # empty: none in progress
  op @1 :Text;
  collective @2 :Int64;      # the collective's id (its `collective` attribute)
  group @3 :UInt64;          # the scheduler's group key
  rank @4 :Int32;
  size @5 :Int32;
  forming @6 :Bool;          # waiting for the group's rendezvous (CollectiveJoin) to complete
  sinceMicros @7 :Int64;     # how long it has been in progress
}

# ---- dynamic tasks and objects ----

struct SubmitTasks { tasks @0 :List(Task); }

# DispatchedTask, DispatchTasks, TaskResult and TasksFinished are retired (kept for the numbering):
# a submitted task now runs as an instance of a one-task graph (GraphPart, RunGraph,
# InstanceFinished), like every other piece of work.
struct DispatchedTask {
  task @0 :Task;
  sources @1 :List(Source);         # inputs to pull from other processes
  inlineInputs @2 :List(SealedObject);  # small inputs, carried in the message
  inputMetas @3 :List(TensorMeta);  # one per task input, in order
}
struct DispatchTasks { tasks @0 :List(DispatchedTask); }

struct SealedObject {
  id @0 :UInt64;
  bytes @1 :Int64;
  inline @2 :Data;             # the contents, when small enough to travel with the message
}

struct TaskResult {
  task @0 :UInt64;
  error @1 :Error;             # absent on success
  outputs @2 :List(SealedObject);
}
struct TasksFinished { results @0 :List(TaskResult); }

# A driver registers objects it holds (Put) with the scheduler.
struct PutObjects {
  objects @0 :List(ObjectDecl);
  inline @1 :List(Data);       # per object: the contents if small, else empty
}

# Reference counting: a driver's ObjectRefs pin objects; the scheduler frees at zero.
struct ReleaseObjects { ids @0 :List(UInt64); }
struct FreeObjects { ids @0 :List(UInt64); }

# A driver waits for objects: the scheduler answers (once each) when they are sealed or lost.
struct WatchObjects { ids @0 :List(UInt64); }
struct ObjectState {
  id @0 :UInt64;
  source @1 :Source;           # where to pull it
  inline @2 :Data;
  error @3 :Error;             # lost or failed
}
struct ObjectsReady { objects @0 :List(ObjectState); }

# ---- registered graphs ----

struct RegisterGraph {
  graphId @0 :UInt64;
  objects @1 :List(ObjectDecl);   # every object of the graph, dense: index i has id i+1
  tasks @2 :List(Task);           # ids are graph-local (1-based)
  outputs @3 :List(UInt64);       # graph-local object ids returned to the driver
  plugins @4 :List(Plugin);       # the plugins its workers must have loaded (name and sha256
                                  # only; the driver sent each one's library before: LoadPlugin)
}

# The scheduler's placement of a registered graph, sent once to each worker that runs a part.
struct GraphPart {
  graphId @0 :UInt64;
  objects @1 :List(ObjectDecl);
  tasks @2 :List(Task);           # every task of the graph (graph-local ids)
  taskWorkers @3 :List(UInt64);   # per graph task: the worker that runs it
  workerAddresses @4 :List(Source);  # holder = worker id, address = its data plane
  outputs @5 :List(UInt64);
  plugins @6 :List(Plugin);       # as RegisterGraph's: the worker runs the part only with each
                                  # of them loaded (the scheduler sent their libraries before)
}

# A plugin (ops/plugin.h): a shared library of ops and kernels. As a LoadPlugin message, with its
# library: driver -> scheduler before the first graph naming it, scheduler -> worker before the
# first part naming it. In RegisterGraph and GraphPart: name and sha256 only.
struct Plugin {
  name @0 :Text;
  sha256 @1 :Text;                # of the library's bytes, 64 lowercase hex digits
  library @2 :Data;
}

struct Binding {
  object @0 :UInt64;     # graph-local object id of a graph input
  source @1 :Source;     # the cluster object bound to it and where it lives
  takeOver @2 :Bool;     # driver -> scheduler: the driver hands its reference to the instance
                         # (it releases it with the run, whatever becomes of the run);
                         # scheduler -> worker: the instance is the object's last user here:
                         # the worker moves it out of its store, so the run may update it in
                         # place
}

struct RunGraph {
  graphId @0 :UInt64;
  instance @1 :UInt64;
  inputs @2 :List(Binding);
  outputIds @3 :List(UInt64);          # cluster object ids for the graph's outputs, in order
  inlineInputs @4 :List(SealedObject); # scheduler -> worker: small bound inputs (id: graph-local)
  taskNames @5 :List(Text);            # per graph task: this instance's name for it (a submitted
                                       # task's own name); empty: the names in the part
  collectiveBases @6 :List(CollectiveBase);  # per worker with collective members in this instance
  collectiveIds @7 :List(Int64);       # per graph task: this instance's collective id for a
                                       # member (a submitted collective's own); empty: the part's
}

# Every collective member a worker runs has one position in that worker's order of its
# channel's collectives (core/collective_task.h): the part gives each member its position among
# the instance's members on its worker and channel; the instance adds the worker's base there.
struct CollectiveBase {
  worker @0 :UInt64;
  base @1 :Int64;
  channel @2 :UInt8;
}

struct InstanceFinished {
  graphId @0 :UInt64;
  instance @1 :UInt64;
  error @2 :Error;
  outputs @3 :List(SealedObject);  # graph outputs this worker produced, as cluster objects
  report @4 :RunReport;
  spans @5 :InstanceSpans;         # where this worker's time went (absent on failure)
  # On failure: the objects this worker took over from the run's bindings (RunGraph's takeOver)
  # that no task had updated in place, put back into its store under their cluster ids.
  restored @6 :List(UInt64);
}

# scheduler -> driver, before the failure of a run's outputs: objects the driver handed to the
# run (RunGraph's takeOver) that came back unchanged; the driver holds a reference to each again.
struct HandedBack {
  graphId @0 :UInt64;
  instance @1 :UInt64;
  ids @2 :List(UInt64);
}

# scheduler -> worker: these placed graphs will not run again here; drop their parts.
struct ForgetGraphs { graphIds @0 :List(UInt64); }

# One worker's spans of one graph instance (core/timeline.h WorkerSpans), packed (PackSpans:
# about 6 bytes a span; ids of the graph's tasks and objects, not names, since the scheduler has
# the graph). Times are microseconds of the system clock since the Unix epoch.
struct InstanceSpans {
  packed @0 :Data;
}

# A worker's figures for one instance of a graph (worker/role_meter.h).
struct RunReport {
  graphId @0 :UInt64;
  instance @1 :UInt64;
  rolePeaks @2 :List(Int64);      # peak bytes per object role (core/graph.h ObjectRole order)
  modelStatePeak @3 :Int64;       # parameters + gradients + optimizer state
  transientPeak @4 :Int64;        # gathered parameters + gradient buckets
  allocatorPeak @5 :Int64;        # the worker allocator's peak: store and executor share it
  collectiveBytesSent @6 :Int64;  # sent by this worker's collective members
  pushedBytes @7 :Int64;          # objects pushed to other workers
  wallMicros @8 :Int64;
  totalPeak @9 :Int64;            # every role together (the memory model's prediction)
  totalWithScratchPeak @10 :Int64;  # the same with the running kernels' scratch on top
}

# ---- collectives: forming a group's communicator, and its failures ----
# The scheduler is every collective group's rendezvous and watcher (see
# scheduler/collective_groups.h and worker/collective_engine.h).

struct CollectiveJoin {          # worker -> scheduler: this member's part of an exchange round
  group @0 :UInt64;
  epoch @1 :UInt32;              # how many times this worker has formed the group's communicator
  round @2 :UInt32;
  rank @3 :Int32;
  size @4 :Int32;
  blob @5 :Data;                 # e.g. a UCX worker address
}

struct CollectivePeers {         # scheduler -> members: every member's blob, in rank order
  group @0 :UInt64;
  epoch @1 :UInt32;
  round @2 :UInt32;
  blobs @3 :List(Data);
}

struct CollectiveFailed {        # worker -> scheduler: what a member found (a peer silent, ...)
  group @0 :UInt64;
  error @1 :Error;
  silentMs @2 :Int64;            # how long the peer it blames had been silent
  silentPeer @3 :Int32 = -1;     # the rank (in the group) of the peer it blames; -1: none
  epoch @4 :UInt32;              # the formation it failed in (reports about an older one are
                                 # ignored)
}

struct CollectiveAbort {         # scheduler -> members: the group's verdict; its collectives fail
  group @0 :UInt64;
  error @1 :Error;
  epoch @2 :UInt32;              # the formation it is about: a member that formed the group
                                 # again since ignores it
}

# ---- administration ----

struct WorkerStatus {
  id @0 :UInt64;
  hostname @1 :Text;
  pid @2 :Int32;
  alive @3 :Bool;
  heartbeat @4 :Heartbeat;
  dataAddress @5 :Text;
  tasksQueued @6 :Int32;
  lastRun @7 :RunReport;           # the worker's latest finished graph instance
  waits @8 :Text;                  # what it runs or waits for, explained (scheduler/waits.h)
  blockedOn @9 :List(UInt64);      # the workers it waits for that have not answered
  gpu @10 :Text;                   # the GPU it owns; empty for a CPU worker
  cpus @11 :Text;                  # the CPUs it may run on (Hello.cpus)
}

struct ClusterStatus {
  workers @0 :List(WorkerStatus);
  drivers @1 :Int32;
  objects @2 :Int64;
  tasksQueued @3 :Int64;
  tasksRunning @4 :Int64;
  tasksDone @5 :Int64;       # submitted tasks finished, and registered graphs' tasks run
  sessionDir @6 :Text;
}

# ---- traces ----

struct TimelineRequest {         # driver or admin -> scheduler
  lastInstances @0 :Int32;       # the latest this many graph instances the scheduler keeps
  graphId @1 :UInt64;            # only instances of this graph; 0: any
}

struct TimelineProcess {
  worker @0 :UInt64;
  hostname @1 :Text;
  pid @2 :Int32;
}

struct TimelineSpan {            # core/timeline.h TimelineSpan
  worker @0 :UInt64;
  stream @1 :Int16;              # compute slot (>= 0); -1 transfer; -2 collective
  name @2 :Text;
  layer @3 :Text;
  op @4 :Text;
  kind @5 :UInt8;                # tessera::SpanKind
  startMicros @6 :Int64;
  endMicros @7 :Int64;
  bytes @8 :Int64;
  graphId @9 :UInt64;
  instance @10 :UInt64;
}

struct Timeline {                # scheduler -> driver or admin: the answer to TimelineRequest
  processes @0 :List(TimelineProcess);
  spans @1 :List(TimelineSpan);
}

# driver -> scheduler, one-way: the job's figures after a training step (the dashboard's plots
# and /metrics). Non-finite or absent figures are sent as NaN.
struct JobProgress {
  job @0 :Text;                  # the program's name for the run, e.g. "train_gpt2"
  step @1 :Int64;
  loss @2 :Float64;
  stepMs @3 :Float64;
  tokensPerSecond @4 :Float64;   # NaN when the job counts samples instead
  samplesPerSecond @5 :Float64;  # NaN when the job counts tokens instead
  validationLoss @6 :Float64 = nan;  # evaluated after this step; NaN when not
  plan @7 :Text;                 # the job's plan, when new or changed; empty otherwise
}

struct Empty {}

struct Envelope {
  requestId @0 :UInt64;    # echoed by the reply; 0 for one-way messages
  body :union {
    hello @1 :Hello;
    welcome @2 :Welcome;
    refused @3 :Error;
    heartbeat @4 :Heartbeat;
    submitTasks @5 :SubmitTasks;
    dispatchTasks @6 :DispatchTasks;
    tasksFinished @7 :TasksFinished;
    putObjects @8 :PutObjects;
    releaseObjects @9 :ReleaseObjects;
    freeObjects @10 :FreeObjects;
    watchObjects @11 :WatchObjects;
    objectsReady @12 :ObjectsReady;
    registerGraph @13 :RegisterGraph;
    graphPart @14 :GraphPart;
    runGraph @15 :RunGraph;
    instanceFinished @16 :InstanceFinished;
    statusRequest @17 :Empty;
    statusReply @18 :ClusterStatus;
    shutdown @19 :Empty;
    reply @20 :Error;      # generic acknowledgement: OK when absent code, else the error
    cancelInstance @21 :InstanceFinished;  # scheduler -> worker: stop this instance (error says why)
    collectiveJoin @22 :CollectiveJoin;
    collectivePeers @23 :CollectivePeers;
    collectiveFailed @24 :CollectiveFailed;
    collectiveAbort @25 :CollectiveAbort;
    keepalive @26 :Empty;  # scheduler -> worker, every heartbeat interval: it is still there
    timelineRequest @27 :TimelineRequest;
    timelineReply @28 :Timeline;
    jobProgress @29 :JobProgress;  # driver -> scheduler: a training step's figures
    forgetGraphs @30 :ForgetGraphs;
    loadPlugin @31 :Plugin;  # driver -> scheduler -> worker: a plugin's library (one-way)
    handedBack @32 :HandedBack;  # scheduler -> driver: handed-over objects a failed run kept
  }
}

// Cluster: the driver's handle on a Tessera cluster (the public API of driver programs).
//
//   auto cluster = Cluster::StartLocal({.cpu_workers = 2});    // or Cluster::Connect("host:6380")
//   ObjectRef x = *(*cluster)->Put(tensor);
//   ObjectRef y = (*(*cluster)->Submit("gelu_forward", {x}))[0];
//   Tensor result = *(*cluster)->Get(y);
//
// Objects: Put places a tensor in the cluster (small ones travel inline with the control
// messages; larger ones stay in this process and workers pull them over the data plane).
// Submit returns references to a task's outputs at once; their shapes are inferred here, so a
// shape mistake is reported by Submit, naming the op and the shapes. Get waits for an object and
// fetches it; Wait waits for several without fetching. An ObjectRef keeps its object alive in
// the cluster; when the last copy of a reference is destroyed the object is released (freed on
// the workers once no task needs it).
//
// Local clusters: StartLocal runs a scheduler and N worker processes (CPU workers, or GPU workers
// with LocalClusterOptions::gpu_workers) on this machine (the
// `tessera` binary: LocalClusterOptions::tessera_binary, $TESSERA_BINARY, $TESSERA_BIN_DIR, next to
// this executable, the installed SDK's bin directory, the configured install prefix's, then
// $PATH) in a session directory
// (launcher/session.h: the same as `tessera start` makes), waits until all workers joined, and
// stops them when the Cluster is destroyed. The children are also killed if this process dies,
// so a crashing driver leaves nothing behind; one that dies while the driver runs on (a worker
// killed or crashed) is reaped within a fraction of a second (launcher/process.h's ChildReaper),
// not left a zombie until the driver exits.
//
// Thread safety: every method may be called from any thread. Errors never hang: waits take a
// timeout, and a dead worker's objects come back as errors naming the worker.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/attrs.h"
#include "core/gpu_use.h"
#include "core/graph.h"
#include "core/ids.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/timeline.h"

namespace tessera {

class ChildReaper;
namespace detail {
class ClusterClient;
}  // namespace detail

// A reference to an object in the cluster. Cheap to copy; see the header comment for lifetime.
class ObjectRef {
 public:
  ObjectRef() = default;
  ObjectId id() const;
  const TensorMeta& meta() const;
  bool valid() const { return state_ != nullptr; }
  // Whether this reference was handed to a run (Cluster::RunGraphHandingOver) and has not come
  // back: the driver no longer holds the object it names.
  bool handed_over() const;

 private:
  friend class detail::ClusterClient;
  struct State;
  explicit ObjectRef(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

// A graph registered with the cluster: its tasks are placed once, and each RunGraph of it costs a
// few messages per involved worker, however many tasks it has.
class GraphHandle {
 public:
  GraphHandle() = default;
  uint64_t id() const { return id_; }
  const Graph& graph() const { return *graph_; }
  bool valid() const { return graph_ != nullptr; }

 private:
  friend class detail::ClusterClient;
  uint64_t id_ = 0;
  std::shared_ptr<const Graph> graph_;
};

struct ConnectOptions {
  std::string token;  // the cluster token; when empty, read from token_file
  // Default: $TESSERA_TOKEN_FILE, else the latest session's (launcher/session.h: under
  // $TESSERA_TEMP_DIR, else /tmp/tessera-<user>).
  std::string token_file;
  int timeout_ms = 5000;
  // When nothing answers (a scheduler restarting under its supervisor): keep trying this long.
  int retry_ms = 0;
  // Where this driver serves its Puts to workers. Empty: the data_host setting, else the
  // address this host uses to reach the scheduler (rpc::LocalHostToward).
  std::string data_host;
  bool admin = false;  // join as an administrator (status, stop) rather than a driver
};

struct LocalClusterOptions {
  int cpu_workers = 2;
  // GPU workers instead of CPU workers (when > 0; cpu_workers is then not used): worker i owns
  // GPU i % (the GPUs `gpus` names: "all", or a list "0,1"), so several workers may share one
  // GPU. Each opens its GPU with an allocator cap of gpu_memory_gib (0: the GPU's memory).
  int gpu_workers = 0;
  std::string gpus = "all";
  double gpu_memory_gib = 0;
  int threads_per_worker = 0;  // 0: the machine's cores divided among the workers
  // Each worker bound to cores of its own (core/cpu_set.h AssignCores: worker i the threads'
  // worth of CPUs from position i * threads of this process's CPUs, wrapping around when the
  // workers outnumber them), as DeepSpeed's --bind_cores_to_rank; else the system moves them.
  bool bind_cores = false;
  int64_t host_capacity_bytes = int64_t{4} << 30;  // per worker; beyond it objects spill to disk
  // Per worker, the allocator's cap on its host memory (tasks and objects together: `tessera
  // worker --host-cap-gib`); 0: none. Plans for these workers fit with --host-memory-gib below it.
  double host_cap_gib = 0;
  // Default: a new directory under the session root (temp_dir, else the temp_dir setting
  // $TESSERA_TEMP_DIR, else /tmp/tessera-<user>), linked as its session_latest while the cluster
  // runs, so `tessera status`, `timeline` and `logs` find it.
  std::string session_dir;
  std::string temp_dir;
  std::string tessera_binary;  // default: FindTesseraBinary's search (launcher/session.h)
  int start_timeout_ms = 20'000;
};

struct SubmitOptions {
  std::string name;        // default: the op name and a sequence number
  WorkerId pinned_worker;  // invalid: the scheduler decides
  int32_t priority = 0;
};

// A worker's figures for one graph instance (worker/role_meter.h says what they mean).
struct RunFigures {
  uint64_t graph = 0;  // GraphHandle::id()
  uint64_t instance = 0;
  std::vector<int64_t> role_peaks;      // peak bytes per ObjectRole
  int64_t model_state_peak = 0;         // parameters + gradients + optimizer state
  int64_t transient_peak = 0;           // gathered parameters + gradient buckets
  int64_t total_peak = 0;               // every role together (planner/memory_model.h predicts it)
  int64_t total_with_scratch_peak = 0;  // the same with the running kernels' scratch on top
  int64_t allocator_peak = 0;           // the worker allocator's peak (store and executor: one)
  int64_t collective_bytes_sent = 0;
  int64_t pushed_bytes = 0;
  double wall_ms = 0;
  int64_t peak(ObjectRole role) const {
    const auto r = static_cast<size_t>(role);
    return r < role_peaks.size() ? role_peaks[r] : 0;
  }
};

struct WorkerInfo {
  WorkerId id;
  std::string hostname;
  int pid = 0;
  bool alive = false;
  std::string data_address;
  std::string gpu;  // the GPU it owns (a GPU worker); empty for a CPU worker
  // The CPUs it may run on ("0-3,8": core/cpu_set.h); empty: it did not say. Workers on one host
  // whose sets overlap share those cores (CoreGroupsOf, training/plan_calibration.h).
  std::string cpus;
  int64_t host_used_bytes = 0;
  int64_t host_capacity_bytes = 0;
  int64_t spilled_bytes = 0;        // on disk now
  int64_t spilled_total_bytes = 0;  // written to disk so far
  int tasks_running = 0;            // graph instances running here
  int64_t tasks_done = 0;           // tasks finished here (registered graphs' and submitted)
  int64_t bytes_pulled = 0;         // data plane, cumulative
  int64_t pull_micros = 0;
  int64_t bytes_served = 0;
  double cpu_seconds = 0;         // CPU time of the worker process so far
  double cpu_utilization = 0;     // cores it kept busy over its last heartbeat interval
  std::optional<GpuUse> gpu_use;  // its GPU's utilisation and memory (a GPU worker); none: unknown
  int64_t objects = 0;            // in its object store now
  int64_t device_bytes = 0;       // of the store's, in the device tier
  int64_t restores = 0;           // objects read back from disk so far
  RunFigures last_run;            // the latest graph instance it finished
  // What it runs or waits for, explained by the scheduler (see WorkerWait), and the workers it
  // waits for that are silent or absent.
  std::string waits;
  std::vector<WorkerId> blocked_on;
};

// Who waits on what (Cluster::Waits, `tessera status --waits`): one per worker, the scheduler's
// explanation of its latest heartbeat report combined with what the scheduler knows (liveness:
// a worker silent for two heartbeat intervals is "not responding"; which members joined a
// collective group's rendezvous). Examples of `text`: "runs 1.3/h.0.forward",
// "waits in collective 7/all_reduce (rank 0 of 2, task ar0, 1.7 s so far) for worker3, which
// has not answered for 1.6 s", "not responding (last heartbeat 1500 ms ago); it said: idle".
struct WorkerWait {
  WorkerId worker;
  std::string hostname;
  int pid = 0;
  bool alive = false;
  std::string text;
  std::vector<WorkerId> blocked_on;  // the workers it waits for that are silent or absent
};
// "worker2 (host:1234): <text>".
std::string FormatWait(const WorkerWait& wait);

struct ClusterInfo {
  std::vector<WorkerInfo> workers;
  int alive_workers() const {
    int alive = 0;
    for (const WorkerInfo& worker : workers) alive += worker.alive;
    return alive;
  }
  int drivers = 0;
  int64_t objects = 0;
  int64_t tasks_queued = 0;
  int64_t tasks_running = 0;
  int64_t tasks_done = 0;  // submitted tasks and registered graphs' tasks finished
  std::string session_dir;
};

// A training step's figures, reported to the scheduler (Cluster::ReportProgress) for its
// dashboard and /metrics. Figures a job does not have stay NaN.
struct JobProgress {
  std::string job;  // the program's name for the run, e.g. "train_gpt2"
  int64_t step = 0;
  double loss = std::numeric_limits<double>::quiet_NaN();
  double step_ms = std::numeric_limits<double>::quiet_NaN();
  double tokens_per_second = std::numeric_limits<double>::quiet_NaN();
  double samples_per_second = std::numeric_limits<double>::quiet_NaN();
  double validation_loss = std::numeric_limits<double>::quiet_NaN();  // evaluated after the step
  std::string plan;  // the plan, when it is new or changed (the scheduler keeps the last one)
};

class Cluster {
 public:
  // Unavailable when nothing answers at `address` (within options.retry_ms), or the scheduler
  // refuses the token.
  static Result<std::unique_ptr<Cluster>> Connect(const std::string& address,
                                                  const ConnectOptions& options = {});
  static Result<std::unique_ptr<Cluster>> StartLocal(const LocalClusterOptions& options = {});
  ~Cluster();

  Result<ObjectRef> Put(const Tensor& value);
  Result<std::vector<ObjectRef>> Submit(const std::string& op, const std::vector<ObjectRef>& inputs,
                                        const Attrs& attrs = {}, const SubmitOptions& options = {});
  // Waits up to timeout_ms (negative: no limit) and returns the object's contents.
  Result<Tensor> Get(const ObjectRef& ref, int timeout_ms = -1);
  Status Wait(const std::vector<ObjectRef>& refs, int timeout_ms = -1);

  // Registers `graph`; tasks may be pinned to workers (TaskSpec::pinned_worker, ids from Info()).
  // Errors (an infeasible pin, no worker alive) come back here.
  Result<GraphHandle> RegisterGraph(const Graph& graph);
  // Runs one instance. `inputs` binds every graph input (its id in the graph) to an object of
  // the same meta; the result maps each graph output's id to a reference, at once (Get or Wait
  // on them). An error of the run shows up on the outputs.
  Result<std::map<ObjectId, ObjectRef>> RunGraph(const GraphHandle& graph,
                                                 const std::map<ObjectId, ObjectRef>& inputs);
  // The same, handing the instance every input that `inputs` holds this driver's only
  // reference to: the driver lets go of it with the run, so that a worker holding it may let the
  // run update it in place (a model's state: the optimizer's update then needs no second copy).
  // Such an input is gone once the run succeeds, or fails after a task updated it in place; one
  // that a failed run left unchanged comes back to this driver before the outputs fail (its
  // ObjectRef::handed_over() is false again once a Wait on them has returned the error). The
  // others stay as they were. `handed_over` (may be null) receives the graph ids of the inputs
  // handed over. Nothing is handed over when this returns an error.
  Result<std::map<ObjectId, ObjectRef>> RunGraphHandingOver(
      const GraphHandle& graph, const std::map<ObjectId, ObjectRef>& inputs,
      std::vector<ObjectId>* handed_over);

  Result<ClusterInfo> Info();
  // Every worker's wait, explained (WorkerWait), in id order. Answered from the scheduler's
  // state at once (no worker is asked), so it works while workers hang.
  Result<std::vector<WorkerWait>> Waits();
  // The spans of the latest `last_instances` graph instances the scheduler kept (setting
  // trace_instances; <= 0: all it kept), of `graph` only when non-zero (GraphHandle::id()),
  // oldest first: every task, collective member and push on every worker (core/timeline.h).
  // Asked for one graph, the answer waits until no instance of it is running. TimedOut when the
  // scheduler does not answer within 30 s.
  Result<tessera::Timeline> Timeline(int last_instances, uint64_t graph = 0);
  // Asks the scheduler to stop the cluster (its workers exit too).
  Status Shutdown();
  // Tells the scheduler how the job is doing after a step (one-way, no round trip; the
  // scheduler keeps a bounded history per job for its dashboard). The connection's error when
  // it is gone; nothing else can fail.
  Status ReportProgress(const JobProgress& progress);

  // False once the connection to the scheduler is gone (it died, stopped answering, or shut
  // down): every call then fails with the reason. A restarted scheduler needs a new Connect.
  bool connected() const;
  const std::string& address() const { return address_; }
  const std::string& session_dir() const { return session_dir_; }
  // The dashboard of a local cluster (StartLocal), with its token: "http://HOST:PORT/?token=...";
  // empty for a connected cluster (`tessera start --head` prints that one) or without one.
  const std::string& dashboard_url() const { return dashboard_url_; }
  // Processes this Cluster started (StartLocal) that have not exited: the scheduler first, then
  // the workers.
  std::vector<pid_t> local_processes() const;
  // A local cluster (StartLocal): starts `count` more workers like the first ones and waits
  // until they joined (replacements for lost ones). InvalidArgument on a connected cluster.
  Status AddLocalWorkers(int count);

 private:
  Cluster() = default;
  std::shared_ptr<detail::ClusterClient> client_;
  std::string address_;
  std::string session_dir_;
  std::unique_ptr<ChildReaper> children_;  // a local cluster's processes; null for a connected one
  // StartLocal's: how workers were started, and the scheduler's local address.
  LocalClusterOptions local_options_;
  std::vector<int> local_gpus_;  // the GPUs a local cluster's GPU workers use; empty: CPU ones
  std::string local_address_;
  std::string dashboard_url_;
  int started_workers_ = 0;
  // The session root whose session_latest this local cluster linked (empty: none), and what it
  // linked before (restored when this cluster stops, if that one still runs).
  std::string latest_root_;
  std::string previous_latest_;
};

}  // namespace tessera

#include "core/rpc/wire_limits.h"

#include <array>
#include <utility>

#include <fmt/format.h>

#include "core/rpc/wire.h"
#include "core/timeline.h"

namespace tessera::rpc {

namespace {

constexpr std::string_view kTasksSetting = "TESSERA_WIRE_MAX_TASKS";
constexpr std::string_view kObjectsSetting = "TESSERA_WIRE_MAX_OBJECTS";
constexpr std::string_view kGroupSetting = "TESSERA_WIRE_MAX_GROUP_SIZE";
constexpr std::string_view kTensorSetting = "TESSERA_WIRE_MAX_TENSOR_BYTES";
constexpr std::string_view kAttrSetting = "TESSERA_WIRE_MAX_ATTR_BYTES";
constexpr std::string_view kNameSetting = "TESSERA_WIRE_MAX_NAME_BYTES";

// The checks of one message, with the limits at hand. Each returns the first field over its
// limit.
class Checker {
 public:
  explicit Checker(const WireLimits& limits) : limits_(limits) {}

  Status Tasks(std::string_view field, uint64_t count) const {
    return CheckCount(field, count, limits_.max_tasks, kTasksSetting);
  }
  Status Objects(std::string_view field, uint64_t count) const {
    return CheckCount(field, count, limits_.max_objects, kObjectsSetting);
  }
  Status Name(std::string_view field, capnp::Text::Reader text) const {
    return CheckBytes(field, text.size(), limits_.max_name_bytes, kNameSetting);
  }
  Status Blob(std::string_view field, size_t bytes) const {
    return CheckBytes(field, bytes, limits_.max_attr_bytes, kAttrSetting);
  }
  Status Error(std::string_view field, proto::Error::Reader error) const {
    return Blob(field, error.getMessage().size());
  }
  Status Source(std::string_view field, proto::Source::Reader source) const {
    return Name(field, source.getAddress());
  }

  Status Heartbeat(proto::Heartbeat::Reader heartbeat) const;
  Status PutObjects(proto::PutObjects::Reader put) const;
  Status ObjectsReady(proto::ObjectsReady::Reader ready) const;
  Status RegisterGraph(proto::RegisterGraph::Reader graph) const;
  Status GraphPart(proto::GraphPart::Reader part) const;
  Status RunGraph(proto::RunGraph::Reader run) const;
  Status InstanceFinished(proto::InstanceFinished::Reader finished) const;
  Status StatusReply(proto::ClusterStatus::Reader status) const;
  Status Timeline(proto::Timeline::Reader timeline) const;
  Status CollectivePeers(proto::CollectivePeers::Reader peers) const;
  Status Tasks(std::string_view field, capnp::List<proto::Task>::Reader tasks) const;
  Status Decls(std::string_view field, capnp::List<proto::ObjectDecl>::Reader decls) const;
  Status Hello(proto::Hello::Reader hello) const;
  Status Plugin(std::string_view field, proto::Plugin::Reader plugin) const;
  Status Plugins(std::string_view field, capnp::List<proto::Plugin>::Reader plugins) const;

 private:
  const WireLimits& limits_;
};

Status Checker::Hello(proto::Hello::Reader hello) const {
  TESSERA_RETURN_IF_ERROR(Name("Hello.token", hello.getToken()));
  TESSERA_RETURN_IF_ERROR(Name("Hello.hostname", hello.getHostname()));
  TESSERA_RETURN_IF_ERROR(Name("Hello.dataAddress", hello.getDataAddress()));
  TESSERA_RETURN_IF_ERROR(
      CheckByteFigure("Hello.hostCapacity", hello.getHostCapacity(), limits_.max_host_bytes));
  TESSERA_RETURN_IF_ERROR(Name("Hello.gpu", hello.getGpu()));
  return Name("Hello.cpus", hello.getCpus());
}

Status Checker::Heartbeat(proto::Heartbeat::Reader heartbeat) const {
  // The scheduler computes a worker's free memory from these (capacity - used - committed).
  TESSERA_RETURN_IF_ERROR(
      CheckByteFigure("Heartbeat.hostUsed", heartbeat.getHostUsed(), limits_.max_host_bytes));
  TESSERA_RETURN_IF_ERROR(CheckByteFigure("Heartbeat.hostCapacity", heartbeat.getHostCapacity(),
                                          limits_.max_host_bytes));
  TESSERA_RETURN_IF_ERROR(CheckByteFigure("Heartbeat.spilledBytes", heartbeat.getSpilledBytes(),
                                          limits_.max_host_bytes));
  TESSERA_RETURN_IF_ERROR(
      CheckByteFigure("Heartbeat.deviceBytes", heartbeat.getDeviceBytes(), limits_.max_host_bytes));
  const proto::WaitState::Reader waits = heartbeat.getWaits();
  TESSERA_RETURN_IF_ERROR(Tasks("Heartbeat.waits.running", waits.getRunning().size()));
  for (capnp::Text::Reader name : waits.getRunning()) {
    TESSERA_RETURN_IF_ERROR(Name("Heartbeat.waits.running[]", name));
  }
  TESSERA_RETURN_IF_ERROR(Objects("Heartbeat.waits.awaited", waits.getAwaited().size()));
  for (proto::AwaitedObject::Reader object : waits.getAwaited()) {
    TESSERA_RETURN_IF_ERROR(Name("Heartbeat.waits.awaited[].name", object.getName()));
  }
  const proto::CollectiveWait::Reader collective = waits.getCollective();
  TESSERA_RETURN_IF_ERROR(Name("Heartbeat.waits.collective.task", collective.getTask()));
  TESSERA_RETURN_IF_ERROR(Name("Heartbeat.waits.collective.op", collective.getOp()));
  return Name("Heartbeat.waits.instance", waits.getInstance());
}

Status Checker::Tasks(std::string_view field, capnp::List<proto::Task>::Reader tasks) const {
  TESSERA_RETURN_IF_ERROR(Tasks(field, tasks.size()));
  for (proto::Task::Reader task : tasks) {
    TESSERA_RETURN_IF_ERROR(CheckTask(task, limits_).WithContext(field));
  }
  return Status::Ok();
}

Status Checker::Decls(std::string_view field, capnp::List<proto::ObjectDecl>::Reader decls) const {
  TESSERA_RETURN_IF_ERROR(Objects(field, decls.size()));
  for (proto::ObjectDecl::Reader decl : decls) {
    TESSERA_RETURN_IF_ERROR(CheckObjectDecl(decl, limits_).WithContext(field));
  }
  return Status::Ok();
}

Status Checker::PutObjects(proto::PutObjects::Reader put) const {
  TESSERA_RETURN_IF_ERROR(Decls("PutObjects.objects", put.getObjects()));
  return Objects("PutObjects.inline", put.getInline().size());
}

Status Checker::ObjectsReady(proto::ObjectsReady::Reader ready) const {
  TESSERA_RETURN_IF_ERROR(Objects("ObjectsReady.objects", ready.getObjects().size()));
  for (proto::ObjectState::Reader state : ready.getObjects()) {
    TESSERA_RETURN_IF_ERROR(Source("ObjectsReady.objects[].source.address", state.getSource()));
    TESSERA_RETURN_IF_ERROR(Error("ObjectsReady.objects[].error.message", state.getError()));
  }
  return Status::Ok();
}

Status Checker::Plugin(std::string_view field, proto::Plugin::Reader plugin) const {
  TESSERA_RETURN_IF_ERROR(Name(fmt::format("{}.name", field), plugin.getName()));
  TESSERA_RETURN_IF_ERROR(Name(fmt::format("{}.sha256", field), plugin.getSha256()));
  return Blob(fmt::format("{}.library", field), plugin.getLibrary().size());
}

Status Checker::Plugins(std::string_view field, capnp::List<proto::Plugin>::Reader plugins) const {
  // A graph names a handful; a thousand is already absurd (each is a loaded shared library).
  TESSERA_RETURN_IF_ERROR(CheckCount(field, plugins.size(), 1024));
  for (proto::Plugin::Reader plugin : plugins) {
    TESSERA_RETURN_IF_ERROR(Plugin(fmt::format("{}[]", field), plugin));
  }
  return Status::Ok();
}

Status Checker::RegisterGraph(proto::RegisterGraph::Reader graph) const {
  TESSERA_RETURN_IF_ERROR(Plugins("RegisterGraph.plugins", graph.getPlugins()));
  TESSERA_RETURN_IF_ERROR(Decls("RegisterGraph.objects", graph.getObjects()));
  TESSERA_RETURN_IF_ERROR(Tasks("RegisterGraph.tasks", graph.getTasks()));
  return Objects("RegisterGraph.outputs", graph.getOutputs().size());
}

Status Checker::GraphPart(proto::GraphPart::Reader part) const {
  TESSERA_RETURN_IF_ERROR(Plugins("GraphPart.plugins", part.getPlugins()));
  TESSERA_RETURN_IF_ERROR(Decls("GraphPart.objects", part.getObjects()));
  TESSERA_RETURN_IF_ERROR(Tasks("GraphPart.tasks", part.getTasks()));
  TESSERA_RETURN_IF_ERROR(Tasks("GraphPart.taskWorkers", part.getTaskWorkers().size()));
  TESSERA_RETURN_IF_ERROR(Tasks("GraphPart.workerAddresses", part.getWorkerAddresses().size()));
  for (proto::Source::Reader source : part.getWorkerAddresses()) {
    TESSERA_RETURN_IF_ERROR(Source("GraphPart.workerAddresses[].address", source));
  }
  return Objects("GraphPart.outputs", part.getOutputs().size());
}

Status Checker::RunGraph(proto::RunGraph::Reader run) const {
  TESSERA_RETURN_IF_ERROR(Objects("RunGraph.inputs", run.getInputs().size()));
  for (proto::Binding::Reader binding : run.getInputs()) {
    TESSERA_RETURN_IF_ERROR(Source("RunGraph.inputs[].source.address", binding.getSource()));
  }
  TESSERA_RETURN_IF_ERROR(Objects("RunGraph.outputIds", run.getOutputIds().size()));
  TESSERA_RETURN_IF_ERROR(Objects("RunGraph.inlineInputs", run.getInlineInputs().size()));
  TESSERA_RETURN_IF_ERROR(Tasks("RunGraph.taskNames", run.getTaskNames().size()));
  for (capnp::Text::Reader name : run.getTaskNames()) {
    TESSERA_RETURN_IF_ERROR(Name("RunGraph.taskNames[]", name));
  }
  TESSERA_RETURN_IF_ERROR(Tasks("RunGraph.collectiveBases", run.getCollectiveBases().size()));
  return Tasks("RunGraph.collectiveIds", run.getCollectiveIds().size());
}

Status Checker::InstanceFinished(proto::InstanceFinished::Reader finished) const {
  TESSERA_RETURN_IF_ERROR(Error("InstanceFinished.error.message", finished.getError()));
  TESSERA_RETURN_IF_ERROR(Objects("InstanceFinished.outputs", finished.getOutputs().size()));
  TESSERA_RETURN_IF_ERROR(Objects("InstanceFinished.restored", finished.getRestored().size()));
  TESSERA_RETURN_IF_ERROR(CheckCount("InstanceFinished.report.rolePeaks",
                                     finished.getReport().getRolePeaks().size(),
                                     limits_.max_role_peaks));
  if (!finished.hasSpans()) return Status::Ok();
  TESSERA_ASSIGN_OR_RETURN(const PackedSpanCounts spans,
                           CountPackedSpans(PackedSpansOf(finished.getSpans())));
  TESSERA_RETURN_IF_ERROR(Objects("InstanceFinished.spans.tasks", spans.tasks));
  return Objects("InstanceFinished.spans.pushes", spans.pushes);
}

Status Checker::StatusReply(proto::ClusterStatus::Reader status) const {
  TESSERA_RETURN_IF_ERROR(Objects("ClusterStatus.workers", status.getWorkers().size()));
  for (proto::WorkerStatus::Reader worker : status.getWorkers()) {
    TESSERA_RETURN_IF_ERROR(Name("ClusterStatus.workers[].hostname", worker.getHostname()));
    TESSERA_RETURN_IF_ERROR(Name("ClusterStatus.workers[].dataAddress", worker.getDataAddress()));
    TESSERA_RETURN_IF_ERROR(Name("ClusterStatus.workers[].gpu", worker.getGpu()));
    TESSERA_RETURN_IF_ERROR(Name("ClusterStatus.workers[].cpus", worker.getCpus()));
    TESSERA_RETURN_IF_ERROR(Blob("ClusterStatus.workers[].waits", worker.getWaits().size()));
    TESSERA_RETURN_IF_ERROR(
        Objects("ClusterStatus.workers[].blockedOn", worker.getBlockedOn().size()));
    TESSERA_RETURN_IF_ERROR(CheckCount("ClusterStatus.workers[].lastRun.rolePeaks",
                                       worker.getLastRun().getRolePeaks().size(),
                                       limits_.max_role_peaks));
  }
  return Name("ClusterStatus.sessionDir", status.getSessionDir());
}

Status Checker::Timeline(proto::Timeline::Reader timeline) const {
  TESSERA_RETURN_IF_ERROR(Objects("Timeline.processes", timeline.getProcesses().size()));
  for (proto::TimelineProcess::Reader process : timeline.getProcesses()) {
    TESSERA_RETURN_IF_ERROR(Name("Timeline.processes[].hostname", process.getHostname()));
  }
  TESSERA_RETURN_IF_ERROR(Objects("Timeline.spans", timeline.getSpans().size()));
  for (proto::TimelineSpan::Reader span : timeline.getSpans()) {
    TESSERA_RETURN_IF_ERROR(Name("Timeline.spans[].name", span.getName()));
    TESSERA_RETURN_IF_ERROR(Name("Timeline.spans[].layer", span.getLayer()));
    TESSERA_RETURN_IF_ERROR(Name("Timeline.spans[].op", span.getOp()));
  }
  return Status::Ok();
}

Status Checker::CollectivePeers(proto::CollectivePeers::Reader peers) const {
  TESSERA_RETURN_IF_ERROR(CheckCount("CollectivePeers.blobs", peers.getBlobs().size(),
                                     limits_.max_group_size, kGroupSetting));
  for (capnp::Data::Reader blob : peers.getBlobs()) {
    TESSERA_RETURN_IF_ERROR(Blob("CollectivePeers.blobs[]", blob.size()));
  }
  return Status::Ok();
}

}  // namespace

WireLimits WireLimits::FromSettings(const Settings& settings) {
  WireLimits limits;
  limits.max_tasks = settings.wire_max_tasks;
  limits.max_objects = settings.wire_max_objects;
  limits.max_group_size = settings.wire_max_group_size;
  limits.max_tensor_bytes = settings.wire_max_tensor_bytes;
  limits.max_attr_bytes = settings.wire_max_attr_bytes;
  limits.max_name_bytes = settings.wire_max_name_bytes;
  return limits;
}

Status WireLimits::Check() const {
  const std::array<std::pair<int64_t, std::string_view>, 6> limits{
      {{max_tasks, kTasksSetting},
       {max_objects, kObjectsSetting},
       {max_group_size, kGroupSetting},
       {max_tensor_bytes, kTensorSetting},
       {max_attr_bytes, kAttrSetting},
       {max_name_bytes, kNameSetting}}};
  for (const auto& [value, setting] : limits) {
    if (value <= 0) return InvalidArgument("{} is {}: a limit must be positive", setting, value);
  }
  if (max_group_size > kMaxCollectiveGroupSize) {
    return InvalidArgument("{} is {}, above the most any cluster holds ({})", kGroupSetting,
                           max_group_size, kMaxCollectiveGroupSize);
  }
  return Status::Ok();
}

Status CheckCount(std::string_view field, uint64_t count, int64_t limit, std::string_view setting) {
  if (count <= static_cast<uint64_t>(limit)) return Status::Ok();
  return InvalidArgument("{} has {} entries, more than the limit of {}{}", field, count, limit,
                         setting.empty() ? std::string() : fmt::format(" ({})", setting));
}

Status CheckBytes(std::string_view field, uint64_t bytes, int64_t limit, std::string_view setting) {
  if (bytes <= static_cast<uint64_t>(limit)) return Status::Ok();
  return InvalidArgument("{} is {} bytes long, more than the limit of {}{}", field, bytes, limit,
                         setting.empty() ? std::string() : fmt::format(" ({})", setting));
}

Status CheckByteFigure(std::string_view field, int64_t value, int64_t limit) {
  if (value >= 0 && value <= limit) return Status::Ok();
  return InvalidArgument("{} is {} bytes, outside [0, {}]", field, value, limit);
}

Status CheckObjectDecl(proto::ObjectDecl::Reader decl, const WireLimits& limits) {
  TESSERA_RETURN_IF_ERROR(
      CheckBytes("object name", decl.getName().size(), limits.max_name_bytes, kNameSetting));
  return CheckCount("tensor shape", decl.getMeta().getShape().size(), limits.max_tensor_rank);
}

Status CheckTask(proto::Task::Reader task, const WireLimits& limits) {
  const Checker check(limits);
  TESSERA_RETURN_IF_ERROR(check.Name("task name", task.getName()));
  TESSERA_RETURN_IF_ERROR(check.Name("task layer", task.getLayer()));
  TESSERA_RETURN_IF_ERROR(check.Name("task op", task.getOp()));
  const auto attrs = task.getAttrs();
  TESSERA_RETURN_IF_ERROR(CheckCount("task attrs", attrs.size(), limits.max_attrs));
  for (proto::Attr::Reader attr : attrs) {
    TESSERA_RETURN_IF_ERROR(check.Name("attribute name", attr.getName()));
    const auto value = attr.getValue();
    if (value.isText()) {
      TESSERA_RETURN_IF_ERROR(check.Blob("text attribute", value.getText().size()));
    } else if (value.isInts()) {
      TESSERA_RETURN_IF_ERROR(CheckCount("ints attribute", value.getInts().size(),
                                         limits.max_attr_bytes / 8, kAttrSetting));
    }
  }
  TESSERA_RETURN_IF_ERROR(check.Objects("task inputs", task.getInputs().size()));
  TESSERA_RETURN_IF_ERROR(check.Decls("task outputs", task.getOutputs()));
  TESSERA_RETURN_IF_ERROR(check.Objects("task donations", task.getDonations().size()));
  return check.Tasks("task after", task.getAfter().size());
}

Status CheckEnvelope(proto::Envelope::Reader message, const WireLimits& limits) {
  using Body = proto::Envelope::Body;
  const Checker check(limits);
  const Body::Reader body = message.getBody();
  switch (body.which()) {
    case Body::HELLO:
      return check.Hello(body.getHello());
    case Body::WELCOME:
      return check.Name("Welcome.sessionDir", body.getWelcome().getSessionDir());
    case Body::REFUSED:
      return check.Error("Refused.message", body.getRefused());
    case Body::REPLY:
      return check.Error("Reply.message", body.getReply());
    case Body::HEARTBEAT:
      return check.Heartbeat(body.getHeartbeat());
    case Body::SUBMIT_TASKS:
      return check.Tasks("SubmitTasks.tasks", body.getSubmitTasks().getTasks());
    case Body::PUT_OBJECTS:
      return check.PutObjects(body.getPutObjects());
    case Body::RELEASE_OBJECTS:
      return check.Objects("ReleaseObjects.ids", body.getReleaseObjects().getIds().size());
    case Body::FREE_OBJECTS:
      return check.Objects("FreeObjects.ids", body.getFreeObjects().getIds().size());
    case Body::WATCH_OBJECTS:
      return check.Objects("WatchObjects.ids", body.getWatchObjects().getIds().size());
    case Body::OBJECTS_READY:
      return check.ObjectsReady(body.getObjectsReady());
    case Body::REGISTER_GRAPH:
      return check.RegisterGraph(body.getRegisterGraph());
    case Body::GRAPH_PART:
      return check.GraphPart(body.getGraphPart());
    case Body::RUN_GRAPH:
      return check.RunGraph(body.getRunGraph());
    case Body::INSTANCE_FINISHED:
      return check.InstanceFinished(body.getInstanceFinished());
    case Body::CANCEL_INSTANCE:
      return check.InstanceFinished(body.getCancelInstance());
    case Body::STATUS_REPLY:
      return check.StatusReply(body.getStatusReply());
    case Body::COLLECTIVE_JOIN:
      return check.Blob("CollectiveJoin.blob", body.getCollectiveJoin().getBlob().size());
    case Body::COLLECTIVE_PEERS:
      return check.CollectivePeers(body.getCollectivePeers());
    case Body::COLLECTIVE_FAILED: {
      const proto::CollectiveFailed::Reader failed = body.getCollectiveFailed();
      // Subtracted from the scheduler's clock (a negative one counts as none).
      if (failed.getSilentMs() > limits.max_millis) {
        return InvalidArgument("CollectiveFailed.silentMs is {} ms, more than the limit of {}",
                               failed.getSilentMs(), limits.max_millis);
      }
      return check.Error("CollectiveFailed.error.message", failed.getError());
    }
    case Body::COLLECTIVE_ABORT:
      return check.Error("CollectiveAbort.error.message", body.getCollectiveAbort().getError());
    case Body::TIMELINE_REPLY:
      return check.Timeline(body.getTimelineReply());
    case Body::JOB_PROGRESS:
      TESSERA_RETURN_IF_ERROR(check.Name("JobProgress.job", body.getJobProgress().getJob()));
      return check.Name("JobProgress.plan", body.getJobProgress().getPlan());
    case Body::FORGET_GRAPHS:
      return check.Objects("ForgetGraphs.graphIds", body.getForgetGraphs().getGraphIds().size());
    case Body::LOAD_PLUGIN:
      return check.Plugin("LoadPlugin", body.getLoadPlugin());
    case Body::HANDED_BACK:
      return check.Objects("HandedBack.ids", body.getHandedBack().getIds().size());
    default:
      // Numbers only, or nothing (StatusRequest, Shutdown, Keepalive, TimelineRequest); retired
      // kinds nobody reads (DispatchTasks, TasksFinished); a kind newer than this build, which
      // its receiver refuses.
      return Status::Ok();
  }
}

}  // namespace tessera::rpc

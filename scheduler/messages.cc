#include "scheduler/messages.h"

#include <algorithm>

#include <capnp/message.h>

#include "core/rpc/frame.h"
#include "core/rpc/wire.h"

namespace tessera {

namespace {

capnp::Data::Reader Bytes(std::string_view data) {
  return capnp::Data::Reader(reinterpret_cast<const kj::byte*>(data.data()), data.size());
}

capnp::Text::Reader Text(std::string_view text) {
  return capnp::Text::Reader(text.data(), text.size());
}

template <typename T>
unsigned Size(const T& items) {
  return static_cast<unsigned>(items.size());
}

// The body of a new envelope (request id 0: not an answer).
proto::Envelope::Body::Builder Body(capnp::MessageBuilder& message, uint64_t request_id = 0) {
  auto envelope = message.initRoot<proto::Envelope>();
  envelope.setRequestId(request_id);
  return envelope.initBody();
}

// List elements, one ToWire each (FillList: the list is initialised with the items' size).
void ToWire(const ObjectSource& source, proto::Source::Builder out);
void ToWire(const InlineObject& object, proto::SealedObject::Builder out);
void ToWire(const ObjectReport& object, proto::ObjectState::Builder out);
void ToWire(const Participant* worker, proto::WorkerStatus::Builder out);

template <typename T, typename ListBuilder>
void FillList(std::span<const T> items, ListBuilder out) {
  for (unsigned i = 0; i < items.size(); ++i) ToWire(items[i], out[i]);
}

void ToWire(const ObjectSource& source, proto::Source::Builder out) {
  out.setObject(source.object.value());
  out.setBytes(source.bytes);
  if (source.holder.valid()) {
    out.setHolder(source.holder.value());
    out.setAddress(Text(source.address));
  }
}

void ToWire(const InlineObject& object, proto::SealedObject::Builder out) {
  out.setId(object.id);
  out.setBytes(static_cast<int64_t>(object.data.size()));
  out.setInline(Bytes(object.data));
}

void ToWire(const ObjectReport& object, proto::ObjectState::Builder out) {
  out.setId(object.id.value());
  if (!object.error.ok()) {
    rpc::ToWire(object.error, out.initError());
    return;
  }
  ToWire(object.source, out.initSource());
  if (!object.inline_data.empty()) out.setInline(Bytes(object.inline_data));
}

void ToWire(const Participant* worker, proto::WorkerStatus::Builder out) {
  const Participant& p = *worker;
  out.setId(p.id.value());
  out.setHostname(p.hostname);
  out.setPid(p.pid);
  out.setAlive(p.alive);
  out.setDataAddress(p.data_address);
  out.setGpu(p.gpu);
  out.setCpus(p.cpus);
  out.setTasksQueued(p.tasks_in_flight);
  auto hb = out.initHeartbeat();
  hb.setHostUsed(p.host_used);
  hb.setHostCapacity(p.host_capacity);
  hb.setSpilledBytes(p.spilled_bytes);
  hb.setSpilledTotal(p.spilled_total);
  hb.setTasksRunning(p.tasks_in_flight);
  hb.setTasksDone(p.tasks_done);
  hb.setBytesPulled(p.bytes_pulled);
  hb.setPullMicros(p.pull_micros);
  hb.setBytesServed(p.bytes_served);
  hb.setCpuSeconds(p.cpu_seconds);
  hb.setCpuUtilization(static_cast<float>(p.cpu_utilization));
  hb.setObjects(p.objects);
  hb.setDeviceBytes(p.device_bytes);
  hb.setRestores(p.restores);
  if (p.gpu_use) {
    auto gpu = hb.initGpu();
    gpu.setUtilization(static_cast<float>(p.gpu_use->utilization));
    gpu.setMemoryUsed(p.gpu_use->memory_used);
    gpu.setMemoryTotal(p.gpu_use->memory_total);
  }
  if (p.last_run != nullptr) out.setLastRun(p.last_run->getRoot<proto::RunReport>().asReader());
}

template <typename Tag>
void SetIds(std::span<const Id<Tag>> ids, capnp::List<uint64_t>::Builder out) {
  for (unsigned i = 0; i < ids.size(); ++i) out.set(i, ids[i].value());
}

}  // namespace

ObjectSource SourceOf(const ObjectEntry& object, const ParticipantTable& participants) {
  if (object.holders.empty()) return ObjectSource{object.spec.id, object.spec.meta.bytes(), {}, {}};
  return SourceOf(object, participants, object.holders.front());
}

ObjectSource SourceOf(const ObjectEntry& object, const ParticipantTable& participants,
                      WorkerId holder) {
  return ObjectSource{object.spec.id, object.spec.meta.bytes(), holder,
                      participants.DataAddress(holder)};
}

void SendRefused(Outbox& outbox, WorkerId to, uint64_t request_id, const Status& reason) {
  rpc::ScopedMessageBuilder message;
  rpc::ToWire(reason, Body(message, request_id).initRefused());
  outbox.Send(to, message);
}

void SendWelcome(Outbox& outbox, WorkerId to, uint32_t heartbeat_interval_ms,
                 std::string_view session_dir) {
  rpc::ScopedMessageBuilder message;
  auto welcome = Body(message).initWelcome();
  welcome.setId(to.value());
  welcome.setHeartbeatIntervalMs(heartbeat_interval_ms);
  welcome.setSessionDir(Text(session_dir));
  outbox.Send(to, message);
}

void SendReply(Outbox& outbox, WorkerId to, uint64_t request_id, const Status& status) {
  rpc::ScopedMessageBuilder message;
  auto reply = Body(message, request_id).initReply();
  if (!status.ok()) rpc::ToWire(status, reply);
  outbox.Send(to, message);
}

void SendStatusReply(Outbox& outbox, WorkerId to, uint64_t request_id,
                     const StatusSummary& summary) {
  rpc::ScopedMessageBuilder message;
  auto status = Body(message, request_id).initStatusReply();
  auto workers = status.initWorkers(Size(summary.workers));
  FillList<const Participant*>(summary.workers, workers);
  for (size_t i = 0; i < summary.waits.size() && i < summary.workers.size(); ++i) {
    const WorkerWaitLine& line = summary.waits[i];
    auto out = workers[static_cast<unsigned>(i)];
    out.setWaits(Text(line.text));
    auto blocked = out.initBlockedOn(Size(line.blocked_on));
    for (size_t b = 0; b < line.blocked_on.size(); ++b) {
      blocked.set(static_cast<unsigned>(b), line.blocked_on[b].value());
    }
  }
  status.setDrivers(summary.drivers);
  status.setObjects(static_cast<int64_t>(summary.objects));
  status.setTasksQueued(summary.tasks.waiting);
  status.setTasksRunning(summary.tasks.running);
  status.setTasksDone(summary.tasks.done);
  status.setSessionDir(Text(summary.session_dir));
  outbox.Send(to, message);
}

void SendShutdown(Outbox& outbox, WorkerId to) {
  rpc::ScopedMessageBuilder message;
  Body(message).initShutdown();
  outbox.Send(to, message);
}

void SendTimelineReply(Outbox& outbox, WorkerId to, uint64_t request_id, const Timeline& timeline) {
  rpc::ScopedMessageBuilder message;
  rpc::ToWire(timeline, Body(message, request_id).initTimelineReply());
  outbox.Send(to, message);
}

void SendKeepalive(Outbox& outbox, WorkerId to) {
  rpc::ScopedMessageBuilder message;
  Body(message).initKeepalive();
  outbox.Send(to, message);
}

void SendObjectsReady(Outbox& outbox, WorkerId to, std::span<const ObjectReport> objects) {
  rpc::ScopedMessageBuilder message;
  FillList(objects, Body(message).initObjectsReady().initObjects(Size(objects)));
  outbox.Send(to, message);
}

void SendFreeObjects(Outbox& outbox, WorkerId to, std::span<const ObjectId> ids) {
  rpc::ScopedMessageBuilder message;
  SetIds(ids, Body(message).initFreeObjects().initIds(Size(ids)));
  outbox.Send(to, message);
}

void SendHandedBack(Outbox& outbox, WorkerId to, uint64_t graph_id, uint64_t instance,
                    std::span<const ObjectId> ids) {
  rpc::ScopedMessageBuilder message;
  auto out = Body(message).initHandedBack();
  out.setGraphId(graph_id);
  out.setInstance(instance);
  SetIds(ids, out.initIds(Size(ids)));
  outbox.Send(to, message);
}

void SendGraphPart(Outbox& outbox, std::span<const WorkerId> to, const GraphPart& part) {
  rpc::ScopedMessageBuilder message;
  auto out = Body(message).initGraphPart();
  out.setGraphId(part.graph_id);
  auto objects = out.initObjects(Size(part.objects));
  for (unsigned i = 0; i < part.objects.size(); ++i) rpc::ToWire(part.objects[i], objects[i]);
  auto tasks = out.initTasks(Size(part.tasks));
  for (unsigned i = 0; i < part.tasks.size(); ++i) {
    const TaskSpec& spec = part.tasks[i];
    std::vector<ObjectSpec> outputs;
    outputs.reserve(spec.outputs.size());
    for (ObjectId output : spec.outputs) outputs.push_back(part.objects[output.value() - 1]);
    rpc::ToWire(spec, outputs, tasks[i]);
  }
  SetIds(part.task_workers, out.initTaskWorkers(Size(part.task_workers)));
  auto addresses = out.initWorkerAddresses(Size(part.worker_addresses));
  for (unsigned i = 0; i < part.worker_addresses.size(); ++i) {
    addresses[i].setHolder(part.worker_addresses[i].first.value());
    addresses[i].setAddress(Text(part.worker_addresses[i].second));
  }
  SetIds(part.outputs, out.initOutputs(Size(part.outputs)));
  auto plugins = out.initPlugins(Size(part.plugins));
  for (unsigned i = 0; i < part.plugins.size(); ++i) {
    plugins[i].setName(Text(part.plugins[i].name));
    plugins[i].setSha256(Text(part.plugins[i].sha256));
  }
  for (WorkerId worker : to) outbox.Send(worker, message);
}

void SendLoadPlugin(Outbox& outbox, WorkerId to, const PluginRef& plugin,
                    std::string_view library) {
  rpc::ScopedMessageBuilder message;
  auto out = Body(message).initLoadPlugin();
  out.setName(Text(plugin.name));
  out.setSha256(Text(plugin.sha256));
  out.setLibrary(
      capnp::Data::Reader(reinterpret_cast<const capnp::byte*>(library.data()), library.size()));
  outbox.Send(to, message);
}

void SendRunGraph(Outbox& outbox, std::span<const WorkerId> to, const GraphRun& run) {
  rpc::ScopedMessageBuilder message;
  auto out = Body(message).initRunGraph();
  out.setGraphId(run.graph_id);
  out.setInstance(run.instance);
  SetIds(run.output_ids, out.initOutputIds(Size(run.output_ids)));
  auto inputs = out.initInputs(Size(run.inputs));
  for (unsigned i = 0; i < run.inputs.size(); ++i) {
    inputs[i].setObject(run.inputs[i].first);
    ToWire(run.inputs[i].second, inputs[i].initSource());
    inputs[i].setTakeOver(std::find(run.take_over.begin(), run.take_over.end(),
                                    run.inputs[i].first) != run.take_over.end());
  }
  FillList<InlineObject>(run.inline_inputs, out.initInlineInputs(Size(run.inline_inputs)));
  if (!run.task_names.empty()) {
    auto names = out.initTaskNames(Size(run.task_names));
    for (unsigned i = 0; i < run.task_names.size(); ++i) names.set(i, Text(run.task_names[i]));
  }
  if (!run.collective_ids.empty()) {
    auto ids = out.initCollectiveIds(Size(run.collective_ids));
    for (unsigned i = 0; i < run.collective_ids.size(); ++i) ids.set(i, run.collective_ids[i]);
  }
  auto bases = out.initCollectiveBases(Size(run.collective_bases));
  for (unsigned i = 0; i < run.collective_bases.size(); ++i) {
    bases[i].setWorker(run.collective_bases[i].worker.value());
    bases[i].setChannel(static_cast<uint8_t>(run.collective_bases[i].channel));
    bases[i].setBase(run.collective_bases[i].base);
  }
  for (WorkerId worker : to) outbox.Send(worker, message);
}

void SendCancelInstance(Outbox& outbox, WorkerId to, uint64_t graph_id, uint64_t instance,
                        const Status& error) {
  rpc::ScopedMessageBuilder message;
  auto cancel = Body(message).initCancelInstance();
  cancel.setGraphId(graph_id);
  cancel.setInstance(instance);
  rpc::ToWire(error, cancel.initError());
  outbox.Send(to, message);
}

void SendForgetGraphs(Outbox& outbox, WorkerId to, std::span<const uint64_t> graph_ids) {
  rpc::ScopedMessageBuilder message;
  auto ids = Body(message).initForgetGraphs().initGraphIds(Size(graph_ids));
  for (unsigned i = 0; i < graph_ids.size(); ++i) ids.set(i, graph_ids[i]);
  outbox.Send(to, message);
}

}  // namespace tessera

#include "worker/graph_runner_part.h"

#include <algorithm>

namespace tessera {

Status GraphRunner::Part::Build(uint64_t self, proto::GraphPart::Reader wire,
                                const InProcessExecutor& executor, const rpc::WireLimits& limits) {
  TESSERA_ASSIGN_OR_RETURN(const Placement placement, Read(wire, limits));
  TESSERA_RETURN_IF_ERROR(FindProducers(placement));
  TESSERA_RETURN_IF_ERROR(AddTasks(self, placement));
  TESSERA_RETURN_IF_ERROR(AddOutputs(self));
  TESSERA_ASSIGN_OR_RETURN(PreparedGraph graph, executor.Prepare(local));
  prepared = std::make_unique<PreparedGraph>(std::move(graph));
  return Status::Ok();
}

Result<GraphRunner::Part::Placement> GraphRunner::Part::Read(proto::GraphPart::Reader wire,
                                                             const rpc::WireLimits& limits) {
  for (proto::ObjectDecl::Reader decl : wire.getObjects()) {
    TESSERA_ASSIGN_OR_RETURN(ObjectSpec object, rpc::FromWire(decl, limits));
    objects.push_back(std::move(object));
  }
  for (uint64_t output : wire.getOutputs()) outputs.push_back(ObjectId(output));
  Placement placement;
  for (proto::Source::Reader source : wire.getWorkerAddresses()) {
    placement.addresses[source.getHolder()] = rpc::ToString(source.getAddress());
    worker_of_address[rpc::ToString(source.getAddress())] = source.getHolder();
  }
  for (proto::Task::Reader task : wire.getTasks()) {
    TESSERA_ASSIGN_OR_RETURN(rpc::WireTask parsed, rpc::FromWire(task, limits));
    placement.tasks.push_back(std::move(parsed));
  }
  const auto task_workers = wire.getTaskWorkers();
  if (task_workers.size() != placement.tasks.size()) {
    return InvalidArgument("graph part {} places {} of {} tasks", id, task_workers.size(),
                           placement.tasks.size());
  }
  placement.task_workers.reserve(task_workers.size());
  for (uint64_t worker : task_workers) placement.task_workers.push_back(worker);
  return placement;
}

Status GraphRunner::Part::FindProducers(const Placement& placement) {
  local_of.assign(objects.size(), ObjectId());
  producer_worker.assign(objects.size(), 0);
  for (size_t t = 0; t < placement.tasks.size(); ++t) {
    for (ObjectId output : placement.tasks[t].spec.outputs) {
      if (!Declares(output)) return InvalidArgument("graph part {}: bad output id", id);
      producer_worker[output.value() - 1] = placement.task_workers[t];
    }
  }
  return Status::Ok();
}

Status GraphRunner::Part::AddTasks(uint64_t self, const Placement& placement) {
  const size_t num_tasks = placement.tasks.size();
  // Graph task index -> this worker's local id (control edges name tasks by id).
  std::vector<TaskId> local_task(num_tasks);
  int local_tasks = 0;
  for (size_t t = 0; t < num_tasks; ++t) {
    if (placement.task_workers[t] == self) local_task[t] = TaskId(++local_tasks);
  }
  for (size_t t = 0; t < num_tasks; ++t) {
    const TaskSpec& spec = placement.tasks[t].spec;
    const uint64_t worker = placement.task_workers[t];
    if (worker == self) {
      TESSERA_RETURN_IF_ERROR(AddLocalTask(t, spec, local_task));
      continue;
    }
    auto address = placement.addresses.find(worker);
    TESSERA_RETURN_IF_ERROR(AddExports(
        self, spec, address == placement.addresses.end() ? std::string() : address->second));
  }
  return Status::Ok();
}

Status GraphRunner::Part::AddLocalTask(size_t t, const TaskSpec& spec,
                                       const std::vector<TaskId>& local_task) {
  TaskSpec mine = spec;
  for (ObjectId& input : mine.inputs) {
    if (!Declares(input)) return InvalidArgument("graph part {}: bad input id", id);
    input = Localize(input);
  }
  for (ObjectId& output : mine.outputs) output = Localize(output);
  for (TaskId& earlier : mine.after) {
    const uint64_t index = earlier.value();
    if (index == 0 || index > local_task.size() || !local_task[index - 1].valid()) {
      return InvalidArgument("graph part {}: task '{}' is after a task not placed here", id,
                             spec.name);
    }
    earlier = local_task[index - 1];
  }
  mine.pinned_worker = WorkerId();
  local.AddTask(std::move(mine));
  graph_task_of.push_back(spec.id.valid() ? spec.id.value() : t + 1);
  return Status::Ok();
}

Status GraphRunner::Part::AddExports(uint64_t self, const TaskSpec& spec,
                                     const std::string& address) {
  for (ObjectId input : spec.inputs) {
    if (!Declares(input)) return InvalidArgument("graph part {}: bad input id", id);
    if (producer_worker[input.value() - 1] != self) continue;
    std::vector<std::string>& consumers = exports[Localize(input)];
    if (std::find(consumers.begin(), consumers.end(), address) == consumers.end()) {
      consumers.push_back(address);
    }
  }
  return Status::Ok();
}

Status GraphRunner::Part::AddOutputs(uint64_t self) {
  for (const ObjectSpec& object : local.objects()) {
    if (!object.producer.valid()) external.push_back(object.id);
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    const ObjectId output = outputs[i];
    if (!Declares(output)) return InvalidArgument("graph part {}: bad output id", id);
    if (producer_worker[output.value() - 1] == self) {
      const ObjectId mapped = Localize(output);
      local.MarkOutput(mapped);
      produced_outputs.emplace_back(mapped, i);
    }
  }
  for (const TaskSpec& task : local.tasks()) {
    engine_member.push_back(IsEngineMember(task));
    if (engine_member.back()) collective_places.push_back(PlaceOf(task, {}));
  }
  return Status::Ok();
}

ObjectId GraphRunner::Part::Localize(ObjectId graph_id) {
  ObjectId& mapped = local_of[graph_id.value() - 1];
  if (!mapped.valid()) {
    const ObjectSpec& spec = objects[graph_id.value() - 1];
    mapped = local.AddObject(spec.name, spec.meta, spec.role);
    graph_of.push_back(graph_id);
  }
  return mapped;
}

}  // namespace tessera

#include "scheduler/task_table.h"

#include <algorithm>

#include "core/logging.h"

namespace tessera {

TaskTable::TaskTable(int max_attempts, ObjectDirectory* objects, ParticipantTable* participants,
                     GraphRegistry* graphs, InstanceTable* instances)
    : max_attempts_(max_attempts),
      objects_(objects),
      participants_(participants),
      graphs_(graphs),
      instances_(instances) {}

TaskCounts TaskTable::counts() const {
  TaskCounts counts;
  for (const auto& [id, task] : tasks_) {
    counts.waiting += task.state == TaskState::kWaiting;
    counts.running += task.state == TaskState::kRunning;
  }
  counts.done = done_;
  return counts;
}

Status TaskTable::Submit(WorkerId driver, rpc::WireTask task) {
  if (!task.spec.id.valid() || tasks_.contains(task.spec.id)) {
    return InvalidArgument("task id {} is invalid or already in use", task.spec.id.ToString());
  }
  for (size_t j = 0; j < task.outputs.size(); ++j) {
    const ObjectId output = task.outputs[j].id;
    if (!output.valid() || objects_->contains(output) ||
        std::any_of(task.outputs.begin(), task.outputs.begin() + static_cast<ptrdiff_t>(j),
                    [&](const ObjectSpec& earlier) { return earlier.id == output; })) {
      return InvalidArgument("task '{}' declares output {} whose id is invalid or in use",
                             task.spec.name, output.ToString());
    }
  }
  const TaskId id = task.spec.id;
  TaskEntry& entry = tasks_[id];
  entry.spec = std::move(task.spec);
  entry.outputs = std::move(task.outputs);
  entry.driver = driver;
  for (const ObjectSpec& output : entry.outputs) objects_->Declare(output, driver);
  Status input_error;
  for (ObjectId input : entry.spec.inputs) {
    const ObjectEntry* object = objects_->Find(input);
    if (object == nullptr) {
      input_error = NotFound(
          "task '{}' reads {}, which the scheduler does not know (never "
          "created, or already freed)",
          entry.spec.name, input.ToString());
      break;
    }
    if (!object->error.ok()) {
      input_error = object->error;
      break;
    }
  }
  if (!input_error.ok()) {
    FailTask(entry, input_error);
    return Status::Ok();
  }
  // A collective member cannot run again alone: its outputs are not rebuilt.
  if (!entry.spec.attrs.Has(kCollectiveAttr)) lineage_.Record(entry.spec, entry.outputs, driver);
  AwaitInputs(entry);
  return Status::Ok();
}

void TaskTable::AwaitInputs(TaskEntry& task) {
  task.uses_counted = true;
  task.unresolved = 0;
  for (ObjectId input : task.spec.inputs) {
    objects_->AddUse(input);
    if (!objects_->at(input).sealed) {
      ++task.unresolved;
      objects_->AddWaiter(input, task.spec.id);
    }
  }
  if (task.unresolved == 0) MakeReady(task.spec.id);
}

Status TaskTable::Rebuild(ObjectId object, const std::string& why) {
  LineageEntry* lineage = lineage_.ProducerOf(object);
  if (lineage == nullptr) {
    return Unavailable(
        "it has no lineage to rebuild it from (a driver's Put, or an output of a registered graph "
        "or of a collective)");
  }
  const TaskId id = lineage->spec.id;
  if (tasks_.contains(id)) return Status::Ok();  // its task is running again already
  if (lineage->rebuilds >= max_attempts_) {
    return Unavailable("its task '{}' was run again {} times already", lineage->spec.name,
                       lineage->rebuilds);
  }
  ++lineage->rebuilds;
  // Copies: rebuilding inputs below may add lineage entries' references, never erase entries,
  // but the task keeps its own copy of its spec anyway.
  const TaskSpec spec = lineage->spec;
  const std::vector<ObjectSpec> outputs = lineage->outputs;
  const WorkerId driver = lineage->driver;
  const int rebuilds = lineage->rebuilds;
  // Inputs: sealed with a live copy, or being made; lost or freed ones are rebuilt first.
  for (ObjectId input : spec.inputs) {
    const ObjectEntry* in = objects_->Find(input);
    if (in != nullptr && !in->error.ok()) {
      return in->error.WithContext(fmt::format("input {} of task '{}'", in->spec.name, spec.name));
    }
    const bool available =
        in != nullptr && (!in->sealed || !in->holders.empty() || !in->inline_data.empty());
    if (!available) {
      TESSERA_RETURN_IF_ERROR(
          Rebuild(input, fmt::format("{}, needed to rebuild it, was gone too", input.ToString()))
              .WithContext(
                  fmt::format("rebuilding input {} of task '{}'", input.ToString(), spec.name)));
    }
  }
  // Outputs: waited for again.
  for (const ObjectSpec& output : outputs) {
    const ObjectEntry* existing = objects_->Find(output.id);
    if (existing == nullptr) {
      objects_->Revive(output);
      lineage_.OutputRevived(output.id);
    } else if (existing->sealed && existing->holders.empty() && existing->inline_data.empty()) {
      objects_->Unseal(output.id);
    }
  }
  GetLogger("scheduler")
      ->info("rebuilding {} from its lineage: task '{}' runs again ({} of at most {})",
             object.ToString(), spec.name, rebuilds, max_attempts_);
  TaskEntry& task = tasks_[id];
  task.spec = spec;
  task.outputs = outputs;
  task.driver = driver;
  // A pin to a worker that died cannot hold: the task runs wherever placement puts it.
  if (const Participant* pinned = participants_->Find(spec.pinned_worker);
      spec.pinned_worker.valid() && (pinned == nullptr || !pinned->alive)) {
    task.spec.pinned_worker = WorkerId();
  }
  task.rebuilding = fmt::format("{}; running task '{}' again to rebuild it failed", why, spec.name);
  AwaitInputs(task);
  return Status::Ok();
}

bool TaskTable::WaitAgainForRebuiltInputs(TaskEntry& task) {
  // (Called once the task's instance has ended.)
  if (task.attempts >= max_attempts_ || task.spec.attrs.Has(kCollectiveAttr)) return false;
  std::vector<ObjectId> awaited;
  for (ObjectId input : task.spec.inputs) {
    const ObjectEntry* in = objects_->Find(input);
    if (in == nullptr || !in->error.ok()) return false;
    if (!in->sealed) awaited.push_back(input);
  }
  if (awaited.empty()) return false;
  task.state = TaskState::kWaiting;
  task.unresolved = static_cast<int>(awaited.size());
  for (ObjectId input : awaited) objects_->AddWaiter(input, task.spec.id);
  GetLogger("scheduler")
      ->info("task '{}' waits for {} input(s) being rebuilt", task.spec.name, awaited.size());
  return true;
}

std::vector<std::pair<ObjectId, ObjectId>> TaskTable::TemplateInputs(
    const std::vector<TaskId>& tasks) const {
  // As GraphRegistry's templates number them: per task, its distinct inputs in order, then its
  // outputs.
  std::vector<std::pair<ObjectId, ObjectId>> inputs;
  uint64_t next = 0;
  for (TaskId id : tasks) {
    const TaskEntry& task = tasks_.at(id);
    const size_t first = inputs.size();
    for (ObjectId input : task.spec.inputs) {
      const bool seen = std::any_of(inputs.begin() + static_cast<ptrdiff_t>(first), inputs.end(),
                                    [&](const auto& pair) { return pair.second == input; });
      if (!seen) inputs.emplace_back(ObjectId(++next), input);
    }
    next += task.outputs.size();
  }
  return inputs;
}

PlacementView TaskTable::ViewFor(const std::vector<TaskId>& tasks) const {
  PlacementView view;
  view.workers = participants_->WorkerLoads();
  for (const auto& [local, input] : TemplateInputs(tasks)) {
    const ObjectEntry& object = objects_->at(input);
    auto& holders = view.input_holders[local];
    for (WorkerId holder : object.holders) holders.emplace_back(holder, object.spec.meta.bytes());
  }
  return view;
}

void TaskTable::MakeReady(TaskId id) {
  TaskEntry& task = tasks_.at(id);
  Result<std::optional<CollectiveMembership>> membership = CollectiveOf(task.spec);
  if (!membership.ok()) {
    FailTask(task, membership.status());
    return;
  }
  const std::optional<CollectiveMembership>& member = *membership;
  if (member.has_value() && member->group_size > 1) {
    ReadyMember(task, *member);
    return;
  }
  Start({id});
}

void TaskTable::ReadyMember(TaskEntry& task, const CollectiveMembership& membership) {
  Result<std::vector<TaskId>> ready =
      gangs_.MemberReady(task.driver, membership, task.spec.id, task.spec.name);
  if (!ready.ok()) {
    FailTask(task, ready.status());
    return;
  }
  if (ready->empty()) return;  // siblings still waiting
  Start(*ready);               // every member is ready: on distinct workers, together
}

void TaskTable::Start(const std::vector<TaskId>& ids) {
  std::vector<const TaskSpec*> specs;
  std::vector<std::vector<TensorMeta>> input_metas;
  std::vector<const std::vector<ObjectSpec>*> outputs;
  for (TaskId id : ids) {
    const TaskEntry& task = tasks_.at(id);
    specs.push_back(&task.spec);
    outputs.push_back(&task.outputs);
    std::vector<TensorMeta>& metas = input_metas.emplace_back();
    for (ObjectId input : task.spec.inputs) metas.push_back(objects_->at(input).spec.meta);
  }
  const bool collective = ids.size() > 1;
  Result<uint64_t> made = collective
                              ? graphs_->CollectiveTemplate(specs, input_metas, outputs)
                              : graphs_->TaskTemplate(*specs[0], input_metas[0], *outputs[0]);
  Result<PlacedGraph*> placed =
      made.ok() ? graphs_->Place(*made, ViewFor(ids)) : Result<PlacedGraph*>(made.status());
  if (!placed.ok()) {
    const Status why =
        collective ? placed.status().WithContext(
                         fmt::format("placing collective {} ({} members need distinct workers)",
                                     specs[0]->attrs.GetInt(kCollectiveAttr, 0), ids.size()))
                   : placed.status().WithContext(fmt::format("placing task '{}'", specs[0]->name));
    for (TaskId id : ids) {
      auto it = tasks_.find(id);
      if (it != tasks_.end()) FailTask(it->second, why);
    }
    return;
  }
  PlacedGraph& graph = **placed;
  InstanceStart start{.graph = &graph, .instance = ids[0].value(), .observer = this};
  for (const auto& [local, input] : TemplateInputs(ids)) {
    start.bindings.emplace_back(local.value(), &objects_->at(input));
  }
  for (size_t t = 0; t < ids.size(); ++t) {
    TaskEntry& task = tasks_.at(ids[t]);
    start.driver = task.driver;
    for (const ObjectSpec& output : task.outputs) start.outputs.push_back(output.id);
    start.task_names.push_back(task.spec.name);
    if (collective) start.collective_ids.push_back(task.spec.attrs.GetInt(kCollectiveAttr, 0));
    task.state = TaskState::kRunning;
    ++task.attempts;
    task.worker = graph.task_worker[t];
    task.graph = graph.id;
    task.instance = start.instance;
    participants_->AddLoad(task.worker, task.spec.memory_estimate_bytes);
  }
  instances_of_[start.instance] = ids;
  instances_->Start(std::move(start));
}

void TaskTable::LeaveWorker(TaskEntry& task) {
  participants_->RemoveLoad(task.worker, task.spec.memory_estimate_bytes);
  task.state = TaskState::kWaiting;
}

void TaskTable::InstanceEnded(uint64_t instance, WorkerId worker, const Status& error) {
  auto found = instances_of_.find(instance);
  if (found == instances_of_.end()) return;
  const std::vector<TaskId> ids = std::move(found->second);
  instances_of_.erase(found);
  for (TaskId id : ids) {
    auto it = tasks_.find(id);
    if (it == tasks_.end() || it->second.state != TaskState::kRunning) continue;
    TaskEntry& task = it->second;
    LeaveWorker(task);
    if (error.ok()) {
      Completed(task);
      continue;
    }
    // It failed because an input vanished with its holder mid-run, and that input is being made
    // again: it waits for it instead.
    if (WaitAgainForRebuiltInputs(task)) continue;
    FailTask(task, worker.valid()
                       ? error.WithContext(fmt::format("on {}", participants_->Describe(worker)))
                       : error);
  }
}

void TaskTable::Completed(TaskEntry& task) {
  task.state = TaskState::kDone;
  ++done_;
  const std::vector<ObjectId> inputs = task.spec.inputs;
  tasks_.erase(task.spec.id);
  for (ObjectId input : inputs) objects_->ReleaseUse(input);
}

void TaskTable::FailTask(TaskEntry& task, const Status& cause) {
  const Status error = task.rebuilding.empty() ? cause : cause.WithContext(task.rebuilding);
  GetLogger("scheduler")->warn("task '{}' failed: {}", task.spec.name, error.ToString());
  std::vector<TaskId> siblings;  // of a collective member whose instance runs
  if (task.state == TaskState::kRunning) {
    // Ended here, not by its instance: the instance goes too.
    if (auto found = instances_of_.find(task.instance); found != instances_of_.end()) {
      siblings = std::move(found->second);
      instances_of_.erase(found);
    }
    instances_->Abandon(task.graph, task.instance, error);
    LeaveWorker(task);
  }
  task.state = TaskState::kFailed;
  const TaskSpec spec = task.spec;
  const WorkerId driver = task.driver;
  const bool started = task.instance != 0;
  const std::vector<ObjectSpec> outputs = task.outputs;
  const bool counted = task.uses_counted;
  tasks_.erase(spec.id);
  for (const ObjectSpec& output : outputs) {
    const ObjectEntry* object = objects_->Find(output.id);
    if (object != nullptr && !object->finished()) objects_->Fail(output.id, error);
  }
  if (counted) {
    for (ObjectId input : spec.inputs) {
      objects_->RemoveWaiter(input, spec.id);
      objects_->ReleaseUse(input);
    }
  }
  MemberFailed(spec, driver, started, siblings, error);
}

void TaskTable::MemberFailed(const TaskSpec& task, WorkerId driver, bool started,
                             const std::vector<TaskId>& running_siblings, const Status& error) {
  Result<std::optional<CollectiveMembership>> membership = CollectiveOf(task);
  if (!membership.ok()) return;
  const std::optional<CollectiveMembership>& member = *membership;
  if (!member.has_value() || member->group_size < 2) return;
  const Status why = error.WithContext(
      fmt::format("member '{}' of collective {} failed", task.name, member->collective));
  if (started) {
    // Its instance was abandoned (the members' workers cancel it): its siblings end with it.
    for (TaskId id : running_siblings) {
      auto it = tasks_.find(id);
      if (id != task.id && it != tasks_.end() && it->second.state == TaskState::kRunning) {
        FailTask(it->second, why);
      }
    }
    return;
  }
  for (TaskId id : gangs_.MemberFailed(driver, *member, task.id, why)) {
    auto it = tasks_.find(id);
    if (it != tasks_.end()) FailTask(it->second, why);
  }
}

void TaskTable::InputSealed(TaskId id) {
  auto it = tasks_.find(id);
  if (it != tasks_.end() && it->second.state == TaskState::kWaiting &&
      --it->second.unresolved == 0) {
    MakeReady(id);
  }
}

void TaskTable::InputFailed(TaskId id, const ObjectSpec& object, const Status& error) {
  auto it = tasks_.find(id);
  if (it != tasks_.end() && it->second.state == TaskState::kWaiting) {
    FailTask(it->second, error.WithContext(fmt::format("input {} of task '{}'", object.name,
                                                       it->second.spec.name)));
  }
}

void TaskTable::WorkerDied(WorkerId worker, const std::string& who, const Status& reason) {
  std::vector<TaskId> in_flight;
  for (const auto& [id, task] : tasks_) {
    if (task.state == TaskState::kRunning && task.worker == worker) in_flight.push_back(id);
  }
  for (TaskId id : in_flight) {
    auto it = tasks_.find(id);
    if (it == tasks_.end() || it->second.state != TaskState::kRunning) continue;  // a sibling's
    TaskEntry& task = it->second;
    std::vector<std::string> missing;
    for (ObjectId input : task.spec.inputs) {
      const ObjectEntry* object = objects_->Find(input);
      if (object == nullptr || !object->sealed) {
        missing.push_back(object == nullptr ? input.ToString() : object->spec.name);
      }
    }
    const Status died = Unavailable(
        "task '{}' was running on {}, which died ({}); {}", task.spec.name, who, reason.message(),
        missing.empty() ? fmt::format("it already ran {} times", task.attempts)
                        : fmt::format("lost inputs: {}", fmt::join(missing, ", ")));
    // A collective member cannot move: its group is the workers it ran on.
    if (task.spec.attrs.Has(kCollectiveAttr)) {
      FailTask(task, died);
      continue;
    }
    instances_of_.erase(task.instance);
    instances_->Abandon(task.graph, task.instance, died);
    LeaveWorker(task);
    if (!missing.empty() && WaitAgainForRebuiltInputs(task)) continue;
    if (missing.empty() && task.attempts < max_attempts_) {
      GetLogger("scheduler")->info("retrying task '{}' after {} died", task.spec.name, who);
      MakeReady(id);
    } else {
      FailTask(task, died);
    }
  }
}

}  // namespace tessera

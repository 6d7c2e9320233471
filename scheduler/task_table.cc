#include "scheduler/task_table.h"

#include <algorithm>

#include "core/logging.h"

namespace tessera {

TaskTable::TaskTable(int max_attempts, ObjectDirectory* objects, ParticipantTable* participants,
                     CollectiveGroups* groups)
    : max_attempts_(max_attempts),
      objects_(objects),
      participants_(participants),
      groups_(groups) {}

TaskCounts TaskTable::counts() const {
  TaskCounts counts;
  for (const auto& [id, task] : tasks_) {
    counts.waiting += task.state == TaskState::kWaiting;
    counts.running += task.state == TaskState::kDispatched;
  }
  counts.done = done_;
  return counts;
}

Status TaskTable::Submit(WorkerId driver, rpc::WireTask task) {
  if (!task.spec.id.valid() || tasks_.contains(task.spec.id)) {
    return InvalidArgument("task id {} is invalid or already in use", task.spec.id.ToString());
  }
  for (const ObjectSpec& output : task.outputs) {
    if (!output.id.valid() || objects_->contains(output.id)) {
      return InvalidArgument("task '{}' declares output {} whose id is invalid or in use",
                             task.spec.name, output.id.ToString());
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

TaskDemand TaskTable::DemandOf(const TaskEntry& task) const {
  TaskDemand demand;
  demand.pinned = task.spec.pinned_worker;
  demand.memory_estimate_bytes = task.spec.memory_estimate_bytes;
  for (ObjectId input : task.spec.inputs) {
    const ObjectEntry& object = objects_->at(input);
    for (WorkerId holder : object.holders) {
      demand.local_bytes.emplace_back(holder, object.spec.meta.bytes());
    }
  }
  return demand;
}

void TaskTable::MakeReady(TaskId id) {
  TaskEntry& task = tasks_.at(id);
  Result<std::optional<CollectiveMembership>> membership = CollectiveOf(task.spec);
  if (!membership.ok()) {
    FailTask(task, membership.status());
    return;
  }
  if (*membership && (*membership)->group_size > 1) {
    ReadyMember(task, **membership);
    return;
  }
  Result<WorkerId> placed = PlaceTask(DemandOf(task), participants_->WorkerLoads());
  if (!placed.ok()) {
    FailTask(task, placed.status().WithContext(fmt::format("placing task '{}'", task.spec.name)));
    return;
  }
  task.worker = *placed;
  Dispatch(task);
}

void TaskTable::ReadyMember(TaskEntry& task, const CollectiveMembership& membership) {
  Result<std::vector<TaskId>> ready =
      gangs_.MemberReady(task.driver, membership, task.spec.id, task.spec.name);
  if (!ready.ok()) {
    FailTask(task, ready.status());
    return;
  }
  if (ready->empty()) return;  // siblings still waiting
  // Every member is ready: place them on distinct workers, together.
  const std::vector<TaskId> members = std::move(*ready);
  std::vector<TaskDemand> demands;
  for (TaskId id : members) demands.push_back(DemandOf(tasks_.at(id)));
  Result<std::vector<WorkerId>> placed =
      PlaceGang(membership.collective, demands, participants_->WorkerLoads());
  if (!placed.ok()) {
    const Status placing = placed.status();
    for (TaskId id : members) {
      auto it = tasks_.find(id);
      if (it != tasks_.end()) FailTask(it->second, placing);
    }
    return;
  }
  const std::vector<WorkerId>& workers = *placed;
  const uint64_t group = groups_->GroupFor(workers);
  for (size_t rank = 0; rank < members.size(); ++rank) {
    TaskEntry& member = tasks_.at(members[rank]);
    member.worker = workers[rank];
    member.spec.attrs.Set(kGroupAttr, static_cast<int64_t>(group));
    member.spec.attrs.Set(kPositionAttr, gangs_.NextPosition(workers[rank]));
    Dispatch(member);
  }
}

void TaskTable::MemberFailed(const TaskSpec& task, WorkerId driver, bool dispatched,
                             const Status& error) {
  Result<std::optional<CollectiveMembership>> membership = CollectiveOf(task);
  if (!membership.ok() || !*membership || (*membership)->group_size < 2) return;
  const Status why = error.WithContext(
      fmt::format("member '{}' of collective {} failed", task.name, (*membership)->collective));
  if (dispatched) {
    // Its siblings were dispatched with it and may be inside the collective: stop them.
    groups_->Abort(static_cast<uint64_t>(task.attrs.GetInt(kGroupAttr, 0)), why);
    return;
  }
  for (TaskId id : gangs_.MemberFailed(driver, **membership, task.id, why)) {
    auto it = tasks_.find(id);
    if (it != tasks_.end()) FailTask(it->second, why);
  }
}

void TaskTable::Dispatch(TaskEntry& task) {
  task.state = TaskState::kDispatched;
  ++task.attempts;
  participants_->AddLoad(task.worker, task.spec.memory_estimate_bytes);
  dispatch_batches_[task.worker].push_back(task.spec.id);
}

void TaskTable::Finished(WorkerId worker, proto::TaskResult::Reader result) {
  auto it = tasks_.find(TaskId(result.getTask()));
  if (it == tasks_.end() || it->second.worker != worker ||
      it->second.state != TaskState::kDispatched) {
    GetLogger("scheduler")
        ->warn("{} reported task {} that it was not running; ignored", worker.ToString(),
               result.getTask());
    return;
  }
  TaskEntry& task = it->second;
  participants_->RemoveLoad(worker, task.spec.memory_estimate_bytes);
  // It failed because an input vanished with its holder mid-run, and that input is being made
  // again: it waits for it instead.
  if (result.hasError() && WaitAgainForRebuiltInputs(task)) return;
  if (result.hasError()) {
    FailTask(task, rpc::FromWire(result.getError())
                       .WithContext(fmt::format("on {}", participants_->Describe(worker))));
    return;
  }
  std::unordered_map<uint64_t, proto::SealedObject::Reader> sealed;
  for (proto::SealedObject::Reader output : result.getOutputs()) {
    sealed.emplace(output.getId(), output);
  }
  for (const ObjectSpec& output : task.outputs) {
    auto found = sealed.find(output.id.value());
    if (found == sealed.end()) {
      objects_->Fail(output.id,
                     Internal("task '{}' finished on {} without producing {}", task.spec.name,
                              participants_->Describe(worker), output.name));
      continue;
    }
    const auto data = found->second.getInline();
    objects_->Seal(output.id, worker, found->second.getBytes(),
                   std::string(reinterpret_cast<const char*>(data.begin()), data.size()));
  }
  task.state = TaskState::kDone;
  ++done_;
  const std::vector<ObjectId> inputs = task.spec.inputs;
  tasks_.erase(it);
  for (ObjectId input : inputs) objects_->ReleaseUse(input);
}

void TaskTable::FailTask(TaskEntry& task, const Status& cause) {
  const Status error = task.rebuilding.empty() ? cause : cause.WithContext(task.rebuilding);
  GetLogger("scheduler")->warn("task '{}' failed: {}", task.spec.name, error.ToString());
  const bool dispatched = task.state == TaskState::kDispatched;
  if (dispatched) participants_->RemoveLoad(task.worker, task.spec.memory_estimate_bytes);
  task.state = TaskState::kFailed;
  const TaskSpec spec = task.spec;
  const WorkerId driver = task.driver;
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
  MemberFailed(spec, driver, dispatched, error);
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
    if (task.state == TaskState::kDispatched && task.worker == worker) in_flight.push_back(id);
  }
  for (TaskId id : in_flight) {
    auto it = tasks_.find(id);
    if (it == tasks_.end()) continue;
    TaskEntry& task = it->second;
    std::vector<std::string> missing;
    for (ObjectId input : task.spec.inputs) {
      const ObjectEntry* object = objects_->Find(input);
      if (object == nullptr || !object->sealed) {
        missing.push_back(object == nullptr ? input.ToString() : object->spec.name);
      }
    }
    // A collective member cannot move: its group is the workers it was dispatched with.
    const bool member = task.spec.attrs.Has(kCollectiveAttr);
    if (!missing.empty() && WaitAgainForRebuiltInputs(task)) continue;
    if (missing.empty() && task.attempts < max_attempts_ && !member) {
      GetLogger("scheduler")->info("retrying task '{}' after {} died", task.spec.name, who);
      task.state = TaskState::kWaiting;
      MakeReady(id);
    } else {
      FailTask(task, Unavailable("task '{}' was running on {}, which died ({}); {}", task.spec.name,
                                 who, reason.message(),
                                 missing.empty()
                                     ? fmt::format("it already ran {} times", task.attempts)
                                     : fmt::format("lost inputs: {}", fmt::join(missing, ", "))));
    }
  }
}

void TaskTable::Flush(Outbox& outbox) {
  for (const auto& [worker, ids] : dispatch_batches_) {
    if (ids.empty()) continue;
    std::vector<TaskDispatch> batch;
    batch.reserve(ids.size());
    for (TaskId id : ids) {
      const TaskEntry& task = tasks_.at(id);
      TaskDispatch& out = batch.emplace_back();
      out.spec = &task.spec;
      out.outputs = &task.outputs;
      for (ObjectId input : task.spec.inputs) {
        const ObjectEntry& object = objects_->at(input);
        out.input_metas.push_back(&object.spec.meta);
        if (std::find(object.holders.begin(), object.holders.end(), worker) !=
            object.holders.end()) {
          continue;  // already there
        }
        if (object.inline_data.empty()) {
          out.sources.push_back(SourceOf(object, *participants_));
        } else {
          out.inline_inputs.push_back(InlineObject{object.spec.id.value(), object.inline_data});
        }
      }
    }
    SendDispatchTasks(outbox, worker, batch);
  }
  dispatch_batches_.clear();
}

}  // namespace tessera

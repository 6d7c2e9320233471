#include "scheduler/scheduler_core.h"

#include <algorithm>

#include "core/collective_task.h"
#include "core/crypto.h"
#include "core/logging.h"
#include "core/rpc/wire.h"

namespace tessera {

namespace {

std::string ToString(capnp::Text::Reader text) { return rpc::ToString(text); }

}  // namespace

SchedulerCore::SchedulerCore(SchedulerOptions options, Outbox* outbox, Now now)
    : options_(std::move(options)),
      outbox_(outbox),
      now_(std::move(now)),
      groups_(outbox, [this](WorkerId worker) { return Describe(worker); }) {}

WorkerId SchedulerCore::Accept() {
  const WorkerId id(next_participant_++);
  Participant participant;
  participant.id = id;
  participant.last_heard = now_();
  participants_.emplace(id, std::move(participant));
  return id;
}

SchedulerCore::Participant* SchedulerCore::Find(WorkerId id) {
  auto it = participants_.find(id);
  return it == participants_.end() ? nullptr : &it->second;
}

std::string SchedulerCore::Describe(WorkerId worker) const {
  auto it = participants_.find(worker);
  if (it == participants_.end()) return worker.ToString();
  return fmt::format("{} (pid {} on {})", worker.ToString(), it->second.pid, it->second.hostname);
}

int SchedulerCore::alive_workers() const {
  int alive = 0;
  for (const auto& [id, p] : participants_) alive += p.role == Role::kWorker && p.alive;
  return alive;
}

void SchedulerCore::Refuse(WorkerId who, uint64_t request_id, const Status& reason) {
  capnp::MallocMessageBuilder message;
  auto envelope = message.initRoot<proto::Envelope>();
  envelope.setRequestId(request_id);
  rpc::ToWire(reason, envelope.initBody().initRefused());
  outbox_->Send(who, message);
  outbox_->Disconnect(who, reason);
}

Status SchedulerCore::Handle(WorkerId from, proto::Envelope::Reader message) {
  Participant* participant = Find(from);
  if (participant == nullptr)
    return Internal("message from unknown participant {}", from.ToString());
  participant->last_heard = now_();
  const auto body = message.getBody();
  Status status;
  if (participant->role == Role::kPending) {
    if (body.which() != proto::Envelope::Body::HELLO) {
      Status refused = Unavailable("the first message must be Hello with the cluster token");
      Refuse(from, message.getRequestId(), refused);
      return refused;
    }
    return OnHello(*participant, body.getHello());
  }
  const Role role = participant->role;
  auto requires_role = [&](Role expected, const char* what) -> Status {
    if (role != expected) {
      return InvalidArgument("{} sent {}, which only a {} may send", from.ToString(), what,
                             expected == Role::kWorker ? "worker" : "driver");
    }
    return Status::Ok();
  };
  switch (body.which()) {
    case proto::Envelope::Body::HEARTBEAT:
      status = requires_role(Role::kWorker, "a heartbeat");
      if (status.ok()) status = OnHeartbeat(*participant, body.getHeartbeat());
      break;
    case proto::Envelope::Body::SUBMIT_TASKS:
      status = requires_role(Role::kDriver, "tasks");
      if (status.ok()) status = OnSubmitTasks(*participant, body.getSubmitTasks());
      break;
    case proto::Envelope::Body::TASKS_FINISHED:
      status = requires_role(Role::kWorker, "task results");
      if (status.ok()) status = OnTasksFinished(*participant, body.getTasksFinished());
      break;
    case proto::Envelope::Body::PUT_OBJECTS:
      status = requires_role(Role::kDriver, "objects");
      if (status.ok()) status = OnPutObjects(*participant, body.getPutObjects());
      break;
    case proto::Envelope::Body::RELEASE_OBJECTS:
      status = requires_role(Role::kDriver, "a release");
      if (status.ok()) status = OnReleaseObjects(*participant, body.getReleaseObjects());
      break;
    case proto::Envelope::Body::WATCH_OBJECTS:
      status = requires_role(Role::kDriver, "a watch");
      if (status.ok()) status = OnWatchObjects(*participant, body.getWatchObjects());
      break;
    case proto::Envelope::Body::STATUS_REQUEST:
      OnStatusRequest(*participant, message.getRequestId());
      break;
    case proto::Envelope::Body::REGISTER_GRAPH:
      status = requires_role(Role::kDriver, "a graph");
      if (status.ok()) {
        status = OnRegisterGraph(*participant, message.getRequestId(), body.getRegisterGraph());
      }
      break;
    case proto::Envelope::Body::RUN_GRAPH:
      status = requires_role(Role::kDriver, "a graph run");
      if (status.ok())
        status = OnRunGraph(*participant, message.getRequestId(), body.getRunGraph());
      break;
    case proto::Envelope::Body::INSTANCE_FINISHED:
      status = requires_role(Role::kWorker, "an instance result");
      if (status.ok()) status = OnInstanceFinished(*participant, body.getInstanceFinished());
      break;
    case proto::Envelope::Body::COLLECTIVE_JOIN:
      status = requires_role(Role::kWorker, "a collective join");
      if (status.ok()) status = groups_.OnJoin(from, body.getCollectiveJoin());
      break;
    case proto::Envelope::Body::COLLECTIVE_FAILED:
      status = requires_role(Role::kWorker, "a collective failure");
      if (status.ok()) status = groups_.OnFailed(from, body.getCollectiveFailed(), now_());
      break;
    case proto::Envelope::Body::SHUTDOWN:
      if (role == Role::kWorker) {
        status = InvalidArgument("a worker may not shut the cluster down");
        break;
      }
      shutdown_requested_ = true;
      GetLogger("scheduler")->info("shutdown requested by {}", from.ToString());
      for (auto& [id, p] : participants_) {
        if (p.role != Role::kWorker || !p.alive) continue;
        capnp::MallocMessageBuilder out;
        out.initRoot<proto::Envelope>().initBody().initShutdown();
        outbox_->Send(id, out);
      }
      break;
    case proto::Envelope::Body::HELLO:
      status = InvalidArgument("{} said Hello twice", from.ToString());
      break;
    default:
      status = InvalidArgument("{} sent a message the scheduler does not accept (kind {})",
                               from.ToString(), static_cast<int>(body.which()));
      break;
  }
  return status;
}

Status SchedulerCore::OnHello(Participant& from, proto::Hello::Reader hello) {
  if (hello.getProtocolVersion() != rpc::kProtocolVersion) {
    Status refused = InvalidArgument("protocol version {} is not the scheduler's {}",
                                     hello.getProtocolVersion(), rpc::kProtocolVersion);
    Refuse(from.id, 0, refused);
    return refused;
  }
  if (!ConstantTimeEquals(ToString(hello.getToken()), options_.token)) {
    Status refused =
        Unavailable("invalid cluster token: pass the token the head printed (or its file {}/token)",
                    options_.session_dir);
    GetLogger("scheduler")
        ->warn("refused {} from pid {} on {}: invalid token", from.id.ToString(), hello.getPid(),
               ToString(hello.getHostname()));
    Refuse(from.id, 0, refused);
    return refused;
  }
  switch (hello.getRole()) {
    case proto::Role::WORKER:
      from.role = Role::kWorker;
      break;
    case proto::Role::DRIVER:
      from.role = Role::kDriver;
      break;
    default:
      from.role = Role::kAdmin;
      break;
  }
  from.hostname = ToString(hello.getHostname());
  from.pid = hello.getPid();
  from.data_address = ToString(hello.getDataAddress());
  from.cpu_threads = hello.getCpuThreads();
  from.host_capacity = hello.getHostCapacity();
  from.alive = true;
  capnp::MallocMessageBuilder message;
  auto welcome = message.initRoot<proto::Envelope>().initBody().initWelcome();
  welcome.setId(from.id.value());
  welcome.setHeartbeatIntervalMs(options_.heartbeat_interval_ms);
  welcome.setSessionDir(options_.session_dir);
  outbox_->Send(from.id, message);
  if (from.role == Role::kWorker) {
    GetLogger("scheduler")
        ->info("{} joined: {} threads, {} MiB host tier, data plane {}", Describe(from.id),
               from.cpu_threads, from.host_capacity >> 20, from.data_address);
  }
  return Status::Ok();
}

Status SchedulerCore::OnHeartbeat(Participant& from, proto::Heartbeat::Reader heartbeat) {
  from.host_used = heartbeat.getHostUsed();
  from.spilled_bytes = heartbeat.getSpilledBytes();
  from.tasks_done = heartbeat.getTasksDone();
  from.bytes_pulled = heartbeat.getBytesPulled();
  from.pull_micros = heartbeat.getPullMicros();
  from.bytes_served = heartbeat.getBytesServed();
  if (heartbeat.getHostCapacity() > 0) from.host_capacity = heartbeat.getHostCapacity();
  return Status::Ok();
}

Status SchedulerCore::OnSubmitTasks(Participant& from, proto::SubmitTasks::Reader submit) {
  for (proto::Task::Reader wire : submit.getTasks()) {
    Result<rpc::WireTask> parsed = rpc::FromWire(wire);
    if (!parsed.ok()) return parsed.status().WithContext("submitted task");
    rpc::WireTask& task = *parsed;
    if (!task.spec.id.valid() || tasks_.contains(task.spec.id)) {
      return InvalidArgument("task id {} is invalid or already in use", task.spec.id.ToString());
    }
    for (const ObjectSpec& output : task.outputs) {
      if (!output.id.valid() || objects_.contains(output.id)) {
        return InvalidArgument("task '{}' declares output {} whose id is invalid or in use",
                               task.spec.name, output.id.ToString());
      }
    }
    const TaskId id = task.spec.id;
    TaskEntry& entry = tasks_[id];
    entry.spec = std::move(task.spec);
    entry.outputs = std::move(task.outputs);
    entry.driver = from.id;
    for (const ObjectSpec& output : entry.outputs) {
      ObjectEntry& object = objects_[output.id];
      object.spec = output;
      object.driver_refs = 1;
      ++from.refs[output.id.value()];
    }
    Status input_error;
    for (ObjectId input : entry.spec.inputs) {
      auto it = objects_.find(input);
      if (it == objects_.end()) {
        input_error = NotFound(
            "task '{}' reads {}, which the scheduler does not know (never "
            "created, or already freed)",
            entry.spec.name, input.ToString());
        break;
      }
      if (!it->second.error.ok()) {
        input_error = it->second.error;
        break;
      }
    }
    if (!input_error.ok()) {
      FailTask(entry, input_error);
      continue;
    }
    entry.uses_counted = true;
    for (ObjectId input : entry.spec.inputs) {
      ObjectEntry& object = objects_.at(input);
      ++object.pending_uses;
      if (!object.sealed) {
        ++entry.unresolved;
        object.waiting_tasks.push_back(id);
      }
    }
    if (entry.unresolved == 0) MakeReady(id);
  }
  return Status::Ok();
}

std::vector<WorkerLoad> SchedulerCore::WorkerLoads() const {
  std::vector<WorkerLoad> loads;
  for (const auto& [id, p] : participants_) {
    if (p.role != Role::kWorker) continue;
    loads.push_back(WorkerLoad{id, p.alive, p.host_capacity - p.host_used - p.committed_bytes,
                               p.tasks_in_flight});
  }
  return loads;
}

void SchedulerCore::MakeReady(TaskId id) {
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
  TaskDemand demand;
  demand.pinned = task.spec.pinned_worker;
  demand.memory_estimate_bytes = task.spec.memory_estimate_bytes;
  for (ObjectId input : task.spec.inputs) {
    const ObjectEntry& object = objects_.at(input);
    for (WorkerId holder : object.holders) {
      demand.local_bytes.emplace_back(holder, object.spec.meta.bytes());
    }
  }
  Result<WorkerId> placed = PlaceTask(demand, WorkerLoads());
  if (!placed.ok()) {
    FailTask(task, placed.status().WithContext(fmt::format("placing task '{}'", task.spec.name)));
    return;
  }
  task.worker = *placed;
  Dispatch(task);
}

void SchedulerCore::ReadyMember(TaskEntry& task, const CollectiveMembership& membership) {
  const auto key = std::make_pair(task.driver, membership.collective);
  PendingCollective& pending = pending_collectives_[key];
  if (pending.group_size == 0) {
    pending.group_size = membership.group_size;
    pending.ready.resize(static_cast<size_t>(membership.group_size));
  }
  if (!pending.failed.ok()) {
    FailTask(task, pending.failed);
    return;
  }
  if (membership.group_size != pending.group_size ||
      pending.ready[static_cast<size_t>(membership.rank)].valid()) {
    FailTask(task, InvalidArgument("task '{}' is rank {} of {} in collective {}, which has {} "
                                   "members and may have that rank taken",
                                   task.spec.name, membership.rank, membership.group_size,
                                   membership.collective, pending.group_size));
    return;
  }
  pending.ready[static_cast<size_t>(membership.rank)] = task.spec.id;
  if (++pending.settled < pending.group_size) return;

  // Every member is ready: place them on distinct workers, together.
  const std::vector<TaskId> members = pending.ready;
  std::vector<WorkerId> workers;
  Status placing;
  for (size_t rank = 0; rank < members.size() && placing.ok(); ++rank) {
    const TaskEntry& member = tasks_.at(members[rank]);
    TaskDemand demand;
    demand.pinned = member.spec.pinned_worker;
    demand.memory_estimate_bytes = member.spec.memory_estimate_bytes;
    for (ObjectId input : member.spec.inputs) {
      for (WorkerId holder : objects_.at(input).holders) {
        demand.local_bytes.emplace_back(holder, objects_.at(input).spec.meta.bytes());
      }
    }
    std::vector<WorkerLoad> loads = WorkerLoads();
    for (WorkerLoad& load : loads) {
      if (std::find(workers.begin(), workers.end(), load.id) != workers.end()) {
        load.alive = false;  // runs another member of this collective
      }
    }
    Result<WorkerId> placed = PlaceTask(demand, loads);
    if (!placed.ok()) {
      placing = placed.status().WithContext(
          fmt::format("placing rank {} of collective {} ({} members need distinct workers)", rank,
                      membership.collective, members.size()));
    } else {
      workers.push_back(*placed);
    }
  }
  pending_collectives_.erase(key);
  if (!placing.ok()) {
    for (TaskId id : members) {
      auto it = tasks_.find(id);
      if (it != tasks_.end()) FailTask(it->second, placing);
    }
    return;
  }
  const uint64_t group = groups_.GroupFor(workers);
  for (size_t rank = 0; rank < members.size(); ++rank) {
    TaskEntry& member = tasks_.at(members[rank]);
    member.worker = workers[rank];
    member.spec.attrs.Set(kGroupAttr, static_cast<int64_t>(group));
    member.spec.attrs.Set(kPositionAttr, dynamic_positions_[workers[rank]]++);
    Dispatch(member);
  }
}

void SchedulerCore::MemberFailed(const TaskSpec& task, WorkerId driver, bool dispatched,
                                 const Status& error) {
  Result<std::optional<CollectiveMembership>> membership = CollectiveOf(task);
  if (!membership.ok() || !*membership || (*membership)->group_size < 2) return;
  const Status why = error.WithContext(
      fmt::format("member '{}' of collective {} failed", task.name, (*membership)->collective));
  if (dispatched) {
    // Its siblings were dispatched with it and may be inside the collective: stop them.
    groups_.Abort(static_cast<uint64_t>(task.attrs.GetInt(kGroupAttr, 0)), why);
    return;
  }
  const auto key = std::make_pair(driver, (*membership)->collective);
  PendingCollective& pending = pending_collectives_[key];
  if (pending.group_size == 0) {
    pending.group_size = (*membership)->group_size;
    pending.ready.resize(static_cast<size_t>(pending.group_size));
  }
  const size_t rank = static_cast<size_t>((*membership)->rank);
  if (rank < pending.ready.size() && pending.ready[rank] == task.id) {
    pending.ready[rank] = TaskId();  // it was counted when it became ready
  } else {
    ++pending.settled;
  }
  if (pending.failed.ok()) pending.failed = why;
  std::vector<TaskId> siblings;
  for (TaskId& id : pending.ready) {
    if (id.valid()) siblings.push_back(std::exchange(id, TaskId()));
  }
  const bool complete = pending.settled >= pending.group_size;
  if (complete) pending_collectives_.erase(key);
  for (TaskId id : siblings) {
    auto it = tasks_.find(id);
    if (it != tasks_.end()) FailTask(it->second, why);
  }
}

void SchedulerCore::Dispatch(TaskEntry& task) {
  Participant& worker = participants_.at(task.worker);
  task.state = TaskState::kDispatched;
  ++task.attempts;
  ++worker.tasks_in_flight;
  worker.committed_bytes += task.spec.memory_estimate_bytes;
  dispatch_batches_[task.worker].push_back(task.spec.id);
}

Status SchedulerCore::OnTasksFinished(Participant& from, proto::TasksFinished::Reader finished) {
  for (proto::TaskResult::Reader result : finished.getResults()) {
    auto it = tasks_.find(TaskId(result.getTask()));
    if (it == tasks_.end() || it->second.worker != from.id ||
        it->second.state != TaskState::kDispatched) {
      GetLogger("scheduler")
          ->warn("{} reported task {} that it was not running; ignored", from.id.ToString(),
                 result.getTask());
      continue;
    }
    TaskEntry& task = it->second;
    --from.tasks_in_flight;
    from.committed_bytes -= task.spec.memory_estimate_bytes;
    if (result.hasError()) {
      FailTask(
          task,
          rpc::FromWire(result.getError()).WithContext(fmt::format("on {}", Describe(from.id))));
      continue;
    }
    std::unordered_map<uint64_t, proto::SealedObject::Reader> sealed;
    for (proto::SealedObject::Reader output : result.getOutputs())
      sealed.emplace(output.getId(), output);
    for (const ObjectSpec& output : task.outputs) {
      ObjectEntry& object = objects_.at(output.id);
      auto found = sealed.find(output.id.value());
      if (found == sealed.end()) {
        FailObject(object, Internal("task '{}' finished on {} without producing {}", task.spec.name,
                                    Describe(from.id), output.name));
        continue;
      }
      const auto data = found->second.getInline();
      SealObject(object, from.id, found->second.getBytes(),
                 std::string(reinterpret_cast<const char*>(data.begin()), data.size()));
    }
    task.state = TaskState::kDone;
    ++tasks_done_;
    const std::vector<ObjectId> inputs = task.spec.inputs;
    tasks_.erase(it);
    for (ObjectId input : inputs) ReleaseUse(input);
  }
  return Status::Ok();
}

void SchedulerCore::SealObject(ObjectEntry& object, WorkerId holder, int64_t bytes,
                               std::string inline_data) {
  object.sealed = true;
  object.holders = {holder};
  object.inline_data = std::move(inline_data);
  if (bytes != object.spec.meta.bytes()) {
    GetLogger("scheduler")
        ->warn("{} sealed with {} bytes, declared {}", object.spec.name, bytes,
               object.spec.meta.bytes());
  }
  for (WorkerId watcher : object.watchers) QueueNotify(watcher, object.spec.id);
  object.watchers.clear();
  const std::vector<TaskId> waiting = std::move(object.waiting_tasks);
  object.waiting_tasks.clear();
  for (TaskId id : waiting) {
    auto it = tasks_.find(id);
    if (it != tasks_.end() && it->second.state == TaskState::kWaiting &&
        --it->second.unresolved == 0) {
      MakeReady(id);
    }
  }
  MaybeFree(object);
}

void SchedulerCore::FailObject(ObjectEntry& object, const Status& error) {
  object.error = error;
  object.sealed = false;
  for (WorkerId watcher : object.watchers) QueueNotify(watcher, object.spec.id);
  object.watchers.clear();
  const std::vector<TaskId> waiting = std::move(object.waiting_tasks);
  object.waiting_tasks.clear();
  for (TaskId id : waiting) {
    auto it = tasks_.find(id);
    if (it != tasks_.end() && it->second.state == TaskState::kWaiting) {
      FailTask(it->second, error.WithContext(fmt::format("input {} of task '{}'", object.spec.name,
                                                         it->second.spec.name)));
    }
  }
  MaybeFree(object);
}

void SchedulerCore::FailTask(TaskEntry& task, const Status& error) {
  GetLogger("scheduler")->warn("task '{}' failed: {}", task.spec.name, error.ToString());
  if (task.state == TaskState::kDispatched) {
    if (Participant* worker = Find(task.worker)) {
      --worker->tasks_in_flight;
      worker->committed_bytes -= task.spec.memory_estimate_bytes;
    }
  }
  const bool dispatched = task.state == TaskState::kDispatched;
  task.state = TaskState::kFailed;
  const TaskId id = task.spec.id;
  const TaskSpec spec = task.spec;
  const WorkerId driver = task.driver;
  const std::vector<ObjectSpec> outputs = task.outputs;
  const std::vector<ObjectId> inputs = task.spec.inputs;
  const bool counted = task.uses_counted;
  tasks_.erase(id);
  for (const ObjectSpec& output : outputs) {
    auto it = objects_.find(output.id);
    if (it != objects_.end() && !it->second.finished()) FailObject(it->second, error);
  }
  if (counted) {
    for (ObjectId input : inputs) {
      auto it = objects_.find(input);
      if (it == objects_.end()) continue;
      auto& waiting = it->second.waiting_tasks;
      waiting.erase(std::remove(waiting.begin(), waiting.end(), id), waiting.end());
      ReleaseUse(input);
    }
  }
  MemberFailed(spec, driver, dispatched, error);
}

void SchedulerCore::ReleaseUse(ObjectId id) {
  auto it = objects_.find(id);
  if (it == objects_.end()) return;
  --it->second.pending_uses;
  MaybeFree(it->second);
}

void SchedulerCore::MaybeFree(ObjectEntry& object) {
  if (!object.finished() || object.driver_refs > 0 || object.pending_uses > 0 ||
      !object.waiting_tasks.empty() || !object.watchers.empty()) {
    return;
  }
  for (WorkerId holder : object.holders) free_batches_[holder].push_back(object.spec.id);
  objects_.erase(object.spec.id);
}

Status SchedulerCore::OnPutObjects(Participant& from, proto::PutObjects::Reader put) {
  const auto inlines = put.getInline();
  unsigned i = 0;
  for (proto::ObjectDecl::Reader decl : put.getObjects()) {
    TESSERA_ASSIGN_OR_RETURN(ObjectSpec spec, rpc::FromWire(decl));
    if (!spec.id.valid() || objects_.contains(spec.id)) {
      return InvalidArgument("put of {} whose id is invalid or in use", spec.id.ToString());
    }
    std::string data;
    if (i < inlines.size()) {
      data.assign(reinterpret_cast<const char*>(inlines[i].begin()), inlines[i].size());
    }
    ++i;
    ObjectEntry& object = objects_[spec.id];
    object.spec = std::move(spec);
    object.driver_refs = 1;
    ++from.refs[object.spec.id.value()];
    object.sealed = true;
    object.holders = {from.id};
    object.inline_data = std::move(data);
  }
  return Status::Ok();
}

Status SchedulerCore::OnReleaseObjects(Participant& from, proto::ReleaseObjects::Reader release) {
  for (uint64_t raw : release.getIds()) {
    auto ref = from.refs.find(raw);
    if (ref == from.refs.end()) continue;  // double release: harmless, ignored
    if (--ref->second == 0) from.refs.erase(ref);
    auto it = objects_.find(ObjectId(raw));
    if (it == objects_.end()) continue;
    --it->second.driver_refs;
    MaybeFree(it->second);
  }
  return Status::Ok();
}

Status SchedulerCore::OnWatchObjects(Participant& from, proto::WatchObjects::Reader watch) {
  for (uint64_t raw : watch.getIds()) {
    auto it = objects_.find(ObjectId(raw));
    if (it == objects_.end() || it->second.finished()) {
      QueueNotify(from.id, ObjectId(raw));
    } else {
      it->second.watchers.push_back(from.id);
    }
  }
  return Status::Ok();
}

void SchedulerCore::QueueNotify(WorkerId driver, ObjectId object) {
  notify_batches_[driver].push_back(object);
}

void SchedulerCore::OnStatusRequest(Participant& from, uint64_t request_id) {
  capnp::MallocMessageBuilder message;
  auto envelope = message.initRoot<proto::Envelope>();
  envelope.setRequestId(request_id);
  auto status = envelope.initBody().initStatusReply();
  int workers = 0, drivers = 0;
  for (const auto& [id, p] : participants_) {
    workers += p.role == Role::kWorker;
    drivers += p.role == Role::kDriver;
  }
  auto list = status.initWorkers(static_cast<unsigned>(workers));
  unsigned i = 0;
  int64_t queued = 0, running = 0;
  for (const auto& [id, task] : tasks_) {
    queued += task.state == TaskState::kWaiting;
    running += task.state == TaskState::kDispatched;
  }
  for (const auto& [id, p] : participants_) {
    if (p.role != Role::kWorker) continue;
    auto w = list[i++];
    w.setId(id.value());
    w.setHostname(p.hostname);
    w.setPid(p.pid);
    w.setAlive(p.alive);
    w.setDataAddress(p.data_address);
    w.setTasksQueued(p.tasks_in_flight);
    auto hb = w.initHeartbeat();
    hb.setHostUsed(p.host_used);
    hb.setHostCapacity(p.host_capacity);
    hb.setSpilledBytes(p.spilled_bytes);
    hb.setTasksRunning(p.tasks_in_flight);
    hb.setTasksDone(p.tasks_done);
    hb.setBytesPulled(p.bytes_pulled);
    hb.setPullMicros(p.pull_micros);
    hb.setBytesServed(p.bytes_served);
    if (p.last_run != nullptr) w.setLastRun(p.last_run->getRoot<proto::RunReport>().asReader());
  }
  status.setDrivers(drivers);
  status.setObjects(static_cast<int64_t>(objects_.size()));
  status.setTasksQueued(queued);
  status.setTasksRunning(running);
  status.setTasksDone(tasks_done_);
  status.setSessionDir(options_.session_dir);
  outbox_->Send(from.id, message);
}

void SchedulerCore::Disconnected(WorkerId who, const Status& reason) {
  Participant* participant = Find(who);
  if (participant == nullptr) return;
  if (participant->role == Role::kWorker && participant->alive) {
    DeclareDead(*participant, reason);
  } else if (participant->role == Role::kDriver) {
    // The driver's references go with it; so do the objects it held (its Puts).
    const auto refs = std::move(participant->refs);
    for (const auto& [raw, count] : refs) {
      auto it = objects_.find(ObjectId(raw));
      if (it == objects_.end()) continue;
      it->second.driver_refs -= count;
      MaybeFree(it->second);
    }
    std::vector<ObjectId> held;
    for (auto& [id, object] : objects_) {
      auto& w = object.watchers;
      w.erase(std::remove(w.begin(), w.end(), who), w.end());
      if (std::find(object.holders.begin(), object.holders.end(), who) != object.holders.end()) {
        held.push_back(id);
      }
    }
    for (ObjectId id : held) {
      auto it = objects_.find(id);
      if (it == objects_.end()) continue;
      auto& holders = it->second.holders;
      holders.erase(std::remove(holders.begin(), holders.end(), who), holders.end());
      if (holders.empty() && it->second.inline_data.empty()) {
        FailObject(it->second,
                   Unavailable("{} was lost: the driver that put it exited", it->second.spec.name));
      }
    }
  }
  participants_.erase(who);
  notify_batches_.erase(who);
  dispatch_batches_.erase(who);
  free_batches_.erase(who);
}

void SchedulerCore::DeclareDead(Participant& worker, const Status& reason) {
  worker.alive = false;
  const std::string who = Describe(worker.id);
  GetLogger("scheduler")->warn("{} is dead: {}", who, reason.ToString());
  // Its collective groups fail at once, naming it, on every other member.
  groups_.WorkerDied(worker.id, reason);
  dispatch_batches_.erase(worker.id);
  free_batches_.erase(worker.id);
  // Objects whose only copy was on the dead worker are lost.
  std::vector<ObjectId> lost;
  for (auto& [id, object] : objects_) {
    auto& holders = object.holders;
    if (std::find(holders.begin(), holders.end(), worker.id) == holders.end()) continue;
    holders.erase(std::remove(holders.begin(), holders.end(), worker.id), holders.end());
    if (holders.empty() && object.sealed && object.inline_data.empty()) lost.push_back(id);
  }
  // Tasks it was running: retry elsewhere when their inputs survive, else fail them.
  std::vector<TaskId> in_flight;
  for (auto& [id, task] : tasks_) {
    if (task.state == TaskState::kDispatched && task.worker == worker.id) in_flight.push_back(id);
  }
  worker.tasks_in_flight = 0;
  worker.committed_bytes = 0;
  std::vector<std::pair<uint64_t, uint64_t>> broken;
  for (auto& [key, instance] : instances_) {
    if (std::find(instance.pending.begin(), instance.pending.end(), worker.id) !=
        instance.pending.end()) {
      broken.push_back(key);
    }
  }
  for (const auto& key : broken) {
    InstanceEntry& instance = instances_.at(key);
    auto& pending = instance.pending;
    pending.erase(std::remove(pending.begin(), pending.end(), worker.id), pending.end());
    FailInstance(instance, worker.id,
                 Unavailable("{} died while running its part of graph {} (instance {}): {}", who,
                             key.first, key.second, reason.message()));
    MaybeFinishInstance(key);
  }
  for (ObjectId id : lost) {
    auto it = objects_.find(id);
    if (it == objects_.end()) continue;
    FailObject(it->second, Unavailable("{} was lost: its only copy was on {}, which died ({})",
                                       it->second.spec.name, who, reason.message()));
  }
  for (TaskId id : in_flight) {
    auto it = tasks_.find(id);
    if (it == tasks_.end()) continue;
    TaskEntry& task = it->second;
    std::vector<std::string> missing;
    for (ObjectId input : task.spec.inputs) {
      auto object = objects_.find(input);
      if (object == objects_.end() || !object->second.sealed) {
        missing.push_back(object == objects_.end() ? input.ToString() : object->second.spec.name);
      }
    }
    // A collective member cannot move: its group is the workers it was dispatched with.
    const bool member = task.spec.attrs.Has(kCollectiveAttr);
    if (missing.empty() && task.attempts < options_.max_task_attempts && !member) {
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

void SchedulerCore::Tick() {
  const Clock::time_point now = now_();
  const auto timeout = std::chrono::milliseconds(options_.heartbeat_timeout_ms);
  std::vector<WorkerId> dead;
  for (auto& [id, p] : participants_) {
    if (p.role == Role::kWorker && p.alive && now - p.last_heard > timeout) dead.push_back(id);
  }
  for (WorkerId id : dead) {
    Status reason = Unavailable("no heartbeat for {} ms", options_.heartbeat_timeout_ms);
    DeclareDead(participants_.at(id), reason);
    outbox_->Disconnect(id, reason);
  }
  groups_.Tick(now);
}

void SchedulerCore::Flush() {
  for (auto& [worker, ids] : dispatch_batches_) {
    if (ids.empty()) continue;
    capnp::MallocMessageBuilder message;
    auto list = message.initRoot<proto::Envelope>().initBody().initDispatchTasks().initTasks(
        static_cast<unsigned>(ids.size()));
    for (unsigned i = 0; i < ids.size(); ++i) {
      const TaskEntry& task = tasks_.at(ids[i]);
      auto out = list[i];
      rpc::ToWire(task.spec, task.outputs, out.initTask());
      std::vector<const ObjectEntry*> remote, inlined;
      for (ObjectId input : task.spec.inputs) {
        const ObjectEntry& object = objects_.at(input);
        if (std::find(object.holders.begin(), object.holders.end(), worker) !=
            object.holders.end()) {
          continue;
        }
        (object.inline_data.empty() ? remote : inlined).push_back(&object);
      }
      auto sources = out.initSources(static_cast<unsigned>(remote.size()));
      for (unsigned j = 0; j < remote.size(); ++j) {
        const ObjectEntry& object = *remote[j];
        const Participant& holder = participants_.at(object.holders.front());
        sources[j].setObject(object.spec.id.value());
        sources[j].setHolder(holder.id.value());
        sources[j].setAddress(holder.data_address);
        sources[j].setBytes(object.spec.meta.bytes());
      }
      auto metas = out.initInputMetas(static_cast<unsigned>(task.spec.inputs.size()));
      for (unsigned j = 0; j < task.spec.inputs.size(); ++j) {
        rpc::ToWire(objects_.at(task.spec.inputs[j]).spec.meta, metas[j]);
      }
      auto inlines = out.initInlineInputs(static_cast<unsigned>(inlined.size()));
      for (unsigned j = 0; j < inlined.size(); ++j) {
        inlines[j].setId(inlined[j]->spec.id.value());
        inlines[j].setBytes(static_cast<int64_t>(inlined[j]->inline_data.size()));
        inlines[j].setInline(
            capnp::Data::Reader(reinterpret_cast<const kj::byte*>(inlined[j]->inline_data.data()),
                                inlined[j]->inline_data.size()));
      }
    }
    outbox_->Send(worker, message);
  }
  dispatch_batches_.clear();

  for (auto& [driver, ids] : notify_batches_) {
    if (ids.empty()) continue;
    capnp::MallocMessageBuilder message;
    auto list = message.initRoot<proto::Envelope>().initBody().initObjectsReady().initObjects(
        static_cast<unsigned>(ids.size()));
    for (unsigned i = 0; i < ids.size(); ++i) {
      auto out = list[i];
      out.setId(ids[i].value());
      auto it = objects_.find(ids[i]);
      if (it == objects_.end()) {
        rpc::ToWire(
            NotFound("{} is unknown to the scheduler (never created, or freed)", ids[i].ToString()),
            out.initError());
        continue;
      }
      const ObjectEntry& object = it->second;
      if (!object.error.ok()) {
        rpc::ToWire(object.error, out.initError());
        continue;
      }
      auto source = out.initSource();
      source.setObject(object.spec.id.value());
      source.setBytes(object.spec.meta.bytes());
      if (!object.holders.empty()) {
        const Participant& holder = participants_.at(object.holders.front());
        source.setHolder(holder.id.value());
        source.setAddress(holder.data_address);
      }
      if (!object.inline_data.empty()) {
        out.setInline(
            capnp::Data::Reader(reinterpret_cast<const kj::byte*>(object.inline_data.data()),
                                object.inline_data.size()));
      }
    }
    outbox_->Send(driver, message);
  }
  notify_batches_.clear();

  for (auto& [holder, ids] : free_batches_) {
    if (ids.empty()) continue;
    Participant* participant = Find(holder);
    if (participant == nullptr || !participant->alive) continue;
    capnp::MallocMessageBuilder message;
    auto list = message.initRoot<proto::Envelope>().initBody().initFreeObjects().initIds(
        static_cast<unsigned>(ids.size()));
    for (unsigned i = 0; i < ids.size(); ++i) list.set(i, ids[i].value());
    outbox_->Send(holder, message);
  }
  free_batches_.clear();
}

void SchedulerCore::Reply(WorkerId to, uint64_t request_id, const Status& status) {
  capnp::MallocMessageBuilder message;
  auto envelope = message.initRoot<proto::Envelope>();
  envelope.setRequestId(request_id);
  auto reply = envelope.initBody().initReply();
  if (!status.ok()) rpc::ToWire(status, reply);
  outbox_->Send(to, message);
}

Status SchedulerCore::OnRegisterGraph(Participant& from, uint64_t request_id,
                                      proto::RegisterGraph::Reader wire) {
  GraphEntry graph;
  graph.id = wire.getGraphId();
  graph.driver = from.id;
  if (graph.id == 0 || graphs_.contains(graph.id)) {
    Reply(from.id, request_id, InvalidArgument("graph id {} is invalid or in use", graph.id));
    return Status::Ok();
  }
  for (proto::ObjectDecl::Reader decl : wire.getObjects()) {
    TESSERA_ASSIGN_OR_RETURN(ObjectSpec object, rpc::FromWire(decl));
    if (object.id != ObjectId(graph.objects.size() + 1)) {
      return InvalidArgument("graph {} object ids must be dense from 1", graph.id);
    }
    graph.objects.push_back(std::move(object));
  }
  const auto known = [&](ObjectId id) { return id.valid() && id.value() <= graph.objects.size(); };
  std::map<int64_t, std::vector<WorkerId>>
      collective_workers;  // collective -> its members' workers
  std::vector<int> load;   // tasks placed per alive worker, for the least-loaded choice
  std::vector<WorkerId> alive;
  for (const auto& [id, p] : participants_) {
    if (p.role == Role::kWorker && p.alive) alive.push_back(id);
  }
  load.assign(alive.size(), 0);
  if (alive.empty()) {
    Reply(from.id, request_id, Unavailable("no worker is alive to run graph {}", graph.id));
    return Status::Ok();
  }
  for (proto::Task::Reader wire_task : wire.getTasks()) {
    TESSERA_ASSIGN_OR_RETURN(rpc::WireTask task, rpc::FromWire(wire_task));
    TaskSpec& spec = task.spec;
    if (spec.id != TaskId(graph.tasks.size() + 1)) {
      return InvalidArgument("graph {} task ids must be dense from 1", graph.id);
    }
    for (ObjectId input : spec.inputs) {
      if (!known(input)) return InvalidArgument("task '{}' reads an unknown object", spec.name);
      // Producers come first (the order GraphBuilder adds tasks in).
      const TaskId producer = graph.objects[input.value() - 1].producer;
      if (producer.valid() && producer.value() > graph.tasks.size()) {
        return InvalidArgument("task '{}' comes before the producer of its input", spec.name);
      }
    }
    for (ObjectId output : spec.outputs) {
      // Producers are not on the wire: they follow from the tasks, each object from at most one.
      if (!known(output) || graph.objects[output.value() - 1].producer.valid()) {
        return InvalidArgument("task '{}' produces an unknown object or one another task produces",
                               spec.name);
      }
      graph.objects[output.value() - 1].producer = spec.id;
    }
    // Placement: pinned; else beside the producer of its largest produced input; else the
    // least loaded worker so far.
    WorkerId place;
    if (spec.pinned_worker.valid()) {
      if (std::find(alive.begin(), alive.end(), spec.pinned_worker) == alive.end()) {
        Reply(from.id, request_id,
              Infeasible("task '{}' is pinned to {}, which is not an alive worker", spec.name,
                         spec.pinned_worker.ToString()));
        return Status::Ok();
      }
      place = spec.pinned_worker;
    } else {
      int64_t best_bytes = -1;
      for (ObjectId input : spec.inputs) {
        const ObjectSpec& object = graph.objects[input.value() - 1];
        if (object.producer.valid() && object.meta.bytes() > best_bytes) {
          best_bytes = object.meta.bytes();
          place = graph.task_worker[object.producer.value() - 1];
        }
      }
      if (!place.valid()) {
        const size_t least =
            static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
        place = alive[least];
      }
    }
    // Members of one collective go to distinct workers.
    Result<std::optional<CollectiveMembership>> membership = CollectiveOf(spec);
    if (!membership.ok()) {
      Reply(from.id, request_id, membership.status());
      return Status::Ok();
    }
    if (*membership) {
      std::vector<WorkerId>& used = collective_workers[(*membership)->collective];
      if (std::find(used.begin(), used.end(), place) != used.end()) {
        if (spec.pinned_worker.valid()) {
          Reply(from.id, request_id,
                Infeasible("task '{}' is pinned to {}, which already runs another member of "
                           "collective {}: members need distinct workers",
                           spec.name, place.ToString(), (*membership)->collective));
          return Status::Ok();
        }
        place = WorkerId();
        int fewest = 0;
        for (size_t w = 0; w < alive.size(); ++w) {
          if (std::find(used.begin(), used.end(), alive[w]) != used.end()) continue;
          if (!place.valid() || load[w] < fewest) {
            place = alive[w];
            fewest = load[w];
          }
        }
        if (!place.valid()) {
          Reply(from.id, request_id,
                Infeasible("collective {} has {} members but only {} workers are alive: start "
                           "more workers or plan a smaller group",
                           (*membership)->collective, (*membership)->group_size, alive.size()));
          return Status::Ok();
        }
      }
      used.push_back(place);
    }
    ++load[static_cast<size_t>(std::find(alive.begin(), alive.end(), place) - alive.begin())];
    graph.task_worker.push_back(place);
    graph.tasks.push_back(std::move(spec));
  }
  Status collectives = AssignCollectives(graph);
  if (!collectives.ok()) {
    Reply(from.id, request_id, collectives);
    return Status::Ok();
  }
  for (uint64_t output : wire.getOutputs()) {
    if (!known(ObjectId(output)))
      return InvalidArgument("graph {} returns an unknown object", graph.id);
    graph.outputs.push_back(ObjectId(output));
  }
  for (const ObjectSpec& object : graph.objects) {
    if (!object.producer.valid()) graph.inputs.push_back(object.id);
  }
  graph.workers = graph.task_worker;
  std::sort(graph.workers.begin(), graph.workers.end());
  graph.workers.erase(std::unique(graph.workers.begin(), graph.workers.end()), graph.workers.end());
  if (graph.workers.empty()) {
    Reply(from.id, request_id, InvalidArgument("graph {} has no tasks", graph.id));
    return Status::Ok();
  }
  // Each involved worker gets its part once.
  for (WorkerId worker : graph.workers) {
    capnp::MallocMessageBuilder message;
    auto part = message.initRoot<proto::Envelope>().initBody().initGraphPart();
    part.setGraphId(graph.id);
    auto objects = part.initObjects(static_cast<unsigned>(graph.objects.size()));
    for (unsigned i = 0; i < graph.objects.size(); ++i) rpc::ToWire(graph.objects[i], objects[i]);
    // Every task goes to every worker: a worker runs those placed on it and needs the others'
    // inputs to know which of its objects to push where.
    auto tasks = part.initTasks(static_cast<unsigned>(graph.tasks.size()));
    for (unsigned i = 0; i < graph.tasks.size(); ++i) {
      const TaskSpec& spec = graph.tasks[i];
      std::vector<ObjectSpec> outputs;
      for (ObjectId output : spec.outputs) outputs.push_back(graph.objects[output.value() - 1]);
      rpc::ToWire(spec, outputs, tasks[i]);
    }
    auto task_worker = part.initTaskWorkers(static_cast<unsigned>(graph.task_worker.size()));
    for (unsigned i = 0; i < graph.task_worker.size(); ++i)
      task_worker.set(i, graph.task_worker[i].value());
    auto addresses = part.initWorkerAddresses(static_cast<unsigned>(graph.workers.size()));
    for (unsigned i = 0; i < graph.workers.size(); ++i) {
      addresses[i].setHolder(graph.workers[i].value());
      addresses[i].setAddress(participants_.at(graph.workers[i]).data_address);
    }
    auto outputs = part.initOutputs(static_cast<unsigned>(graph.outputs.size()));
    for (unsigned i = 0; i < graph.outputs.size(); ++i) outputs.set(i, graph.outputs[i].value());
    outbox_->Send(worker, message);
  }
  GetLogger("scheduler")
      ->info("{} registered graph {}: {} tasks on {} worker(s)", from.id.ToString(), graph.id,
             graph.tasks.size(), graph.workers.size());
  const uint64_t id = graph.id;
  graphs_.emplace(id, std::move(graph));
  Reply(from.id, request_id, Status::Ok());
  return Status::Ok();
}

Status SchedulerCore::AssignCollectives(GraphEntry& graph) {
  TESSERA_RETURN_IF_ERROR(ValidateCollectives(graph.tasks));
  TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> order,
                           OrderCollectives(graph.tasks, [&](ObjectId object) {
                             return graph.objects[object.value() - 1].producer;
                           }));
  std::map<int64_t, std::vector<size_t>> members;  // collective -> task indices by rank
  for (size_t t = 0; t < graph.tasks.size(); ++t) {
    std::optional<CollectiveMembership> membership = *CollectiveOf(graph.tasks[t]);
    if (!membership) continue;
    auto& slots = members[membership->collective];
    slots.resize(static_cast<size_t>(membership->group_size));
    slots[static_cast<size_t>(membership->rank)] = t;
  }
  // Each worker runs its members in the one global order: positions count per worker.
  std::map<WorkerId, int64_t> next_position;
  for (int64_t collective : order) {
    const std::vector<size_t>& slots = members.at(collective);
    std::vector<WorkerId> workers;
    for (size_t t : slots) workers.push_back(graph.task_worker[t]);
    const uint64_t group = groups_.GroupFor(workers);
    for (size_t t : slots) {
      graph.tasks[t].attrs.Set(kGroupAttr, static_cast<int64_t>(group));
      graph.tasks[t].attrs.Set(kPositionAttr, next_position[graph.task_worker[t]]++);
    }
  }
  return Status::Ok();
}

Status SchedulerCore::OnRunGraph(Participant& from, uint64_t request_id,
                                 proto::RunGraph::Reader run) {
  auto it = graphs_.find(run.getGraphId());
  if (it == graphs_.end() || it->second.driver != from.id) {
    Reply(from.id, request_id,
          NotFound("graph {} is not registered by this driver", run.getGraphId()));
    return Status::Ok();
  }
  const GraphEntry& graph = it->second;
  const auto key = std::make_pair(graph.id, run.getInstance());
  if (instances_.contains(key)) {
    return InvalidArgument("instance {} of graph {} is already running", key.second, key.first);
  }
  if (run.getOutputIds().size() != graph.outputs.size()) {
    return InvalidArgument("run of graph {} names {} outputs, the graph has {}", graph.id,
                           run.getOutputIds().size(), graph.outputs.size());
  }
  InstanceEntry instance;
  instance.graph = graph.id;
  instance.instance = run.getInstance();
  instance.driver = from.id;
  // Outputs: new cluster objects, referenced by the driver, sealed where they are produced.
  for (unsigned i = 0; i < graph.outputs.size(); ++i) {
    const ObjectId id(run.getOutputIds()[i]);
    if (!id.valid() || objects_.contains(id)) {
      return InvalidArgument("output id {} of graph {} is invalid or in use", id.ToString(),
                             graph.id);
    }
    ObjectEntry& object = objects_[id];
    object.spec = graph.objects[graph.outputs[i].value() - 1];
    object.spec.id = id;
    object.spec.producer = TaskId();
    object.driver_refs = 1;
    ++from.refs[id.value()];
    instance.outputs.push_back(id);
  }
  // Inputs: every graph input bound to a sealed cluster object of the same meta.
  Status bind_error;
  std::map<uint64_t, const ObjectEntry*> bindings;  // graph-local id -> cluster object
  for (proto::Binding::Reader binding : run.getInputs()) {
    const uint64_t local = binding.getObject();
    auto object = objects_.find(ObjectId(binding.getSource().getObject()));
    if (local == 0 || local > graph.objects.size()) {
      bind_error = InvalidArgument("binding of unknown graph object {}", local);
    } else if (object == objects_.end() || !object->second.finished()) {
      bind_error = InvalidArgument(
          "input '{}' of graph {} is bound to an object that is not "
          "ready (wait for it first)",
          graph.objects[local - 1].name, graph.id);
    } else if (!object->second.error.ok()) {
      bind_error = object->second.error;
    } else if (object->second.spec.meta != graph.objects[local - 1].meta) {
      bind_error = InvalidArgument(
          "input '{}' of graph {} is {} but was bound to {}", graph.objects[local - 1].name,
          graph.id, graph.objects[local - 1].meta.ToString(), object->second.spec.meta.ToString());
    } else {
      bindings[local] = &object->second;
    }
  }
  for (ObjectId input : graph.inputs) {
    if (bind_error.ok() && !bindings.contains(input.value())) {
      bind_error = InvalidArgument("input '{}' of graph {} is not bound",
                                   graph.objects[input.value() - 1].name, graph.id);
    }
  }
  if (!bind_error.ok()) {
    for (ObjectId id : instance.outputs) FailObject(objects_.at(id), bind_error);
    return Status::Ok();
  }
  for (const auto& [local, object] : bindings) {
    instance.bound.push_back(object->spec.id);
    ++objects_.at(object->spec.id).pending_uses;
  }
  instance.pending = graph.workers;
  for (WorkerId worker : graph.workers) {
    capnp::MallocMessageBuilder message;
    auto out = message.initRoot<proto::Envelope>().initBody().initRunGraph();
    out.setGraphId(graph.id);
    out.setInstance(instance.instance);
    auto ids = out.initOutputIds(static_cast<unsigned>(instance.outputs.size()));
    for (unsigned i = 0; i < instance.outputs.size(); ++i) ids.set(i, instance.outputs[i].value());
    std::vector<std::pair<uint64_t, const ObjectEntry*>> remote, inlined;
    for (const auto& binding : bindings) {
      (binding.second->inline_data.empty() ? remote : inlined).push_back(binding);
    }
    auto inputs = out.initInputs(static_cast<unsigned>(remote.size()));
    for (unsigned i = 0; i < remote.size(); ++i) {
      const ObjectEntry& object = *remote[i].second;
      inputs[i].setObject(remote[i].first);
      auto source = inputs[i].initSource();
      source.setObject(object.spec.id.value());
      source.setBytes(object.spec.meta.bytes());
      if (!object.holders.empty()) {
        source.setHolder(object.holders.front().value());
        source.setAddress(participants_.at(object.holders.front()).data_address);
      }
    }
    auto inlines = out.initInlineInputs(static_cast<unsigned>(inlined.size()));
    for (unsigned i = 0; i < inlined.size(); ++i) {
      const std::string& data = inlined[i].second->inline_data;
      inlines[i].setId(inlined[i].first);
      inlines[i].setBytes(static_cast<int64_t>(data.size()));
      inlines[i].setInline(
          capnp::Data::Reader(reinterpret_cast<const kj::byte*>(data.data()), data.size()));
    }
    outbox_->Send(worker, message);
  }
  instances_.emplace(key, std::move(instance));
  return Status::Ok();
}

Status SchedulerCore::OnInstanceFinished(Participant& from,
                                         proto::InstanceFinished::Reader finished) {
  const auto key = std::make_pair(finished.getGraphId(), finished.getInstance());
  if (finished.hasReport()) {
    from.last_run = std::make_unique<capnp::MallocMessageBuilder>();
    from.last_run->setRoot(finished.getReport());
  }
  auto it = instances_.find(key);
  if (it == instances_.end()) return Status::Ok();  // already failed and closed
  InstanceEntry& instance = it->second;
  auto& pending = instance.pending;
  if (std::find(pending.begin(), pending.end(), from.id) == pending.end()) return Status::Ok();
  pending.erase(std::remove(pending.begin(), pending.end(), from.id), pending.end());
  if (finished.hasError()) {
    FailInstance(instance, from.id,
                 rpc::FromWire(finished.getError()).WithContext(Describe(from.id)));
  } else {
    for (proto::SealedObject::Reader output : finished.getOutputs()) {
      const ObjectId id(output.getId());
      if (std::find(instance.outputs.begin(), instance.outputs.end(), id) ==
          instance.outputs.end()) {
        return InvalidArgument("{} sealed {}, which is not an output of the instance",
                               from.id.ToString(), id.ToString());
      }
      const auto data = output.getInline();
      SealObject(objects_.at(id), from.id, output.getBytes(),
                 std::string(reinterpret_cast<const char*>(data.begin()), data.size()));
    }
  }
  MaybeFinishInstance(key);
  return Status::Ok();
}

void SchedulerCore::FailInstance(InstanceEntry& instance, WorkerId skip, const Status& error) {
  if (!instance.error.ok()) return;
  instance.error = error;
  GetLogger("scheduler")
      ->warn("graph {} instance {} failed: {}", instance.graph, instance.instance,
             error.ToString());
  for (WorkerId worker : instance.pending) {
    if (worker == skip) continue;
    capnp::MallocMessageBuilder message;
    auto cancel = message.initRoot<proto::Envelope>().initBody().initCancelInstance();
    cancel.setGraphId(instance.graph);
    cancel.setInstance(instance.instance);
    rpc::ToWire(error, cancel.initError());
    outbox_->Send(worker, message);
  }
}

void SchedulerCore::MaybeFinishInstance(std::pair<uint64_t, uint64_t> key) {
  auto it = instances_.find(key);
  if (it == instances_.end()) return;
  InstanceEntry& instance = it->second;
  if (!instance.pending.empty() && instance.error.ok()) return;
  InstanceEntry done = std::move(instance);
  instances_.erase(it);
  for (ObjectId id : done.outputs) {
    auto object = objects_.find(id);
    if (object == objects_.end() || object->second.finished()) continue;
    FailObject(object->second, done.error.ok() ? Internal("graph {} finished without producing {}",
                                                          done.graph, object->second.spec.name)
                                               : done.error);
  }
  for (ObjectId id : done.bound) ReleaseUse(id);
}

}  // namespace tessera

#include "scheduler/scheduler_core.h"

#include <algorithm>
#include <set>

#include "core/logging.h"
#include "core/rpc/wire.h"
#include "scheduler/messages.h"

namespace tessera {

SchedulerCore::SchedulerCore(SchedulerOptions options, Outbox* outbox, Now now)
    : options_(std::move(options)),
      outbox_(outbox),
      now_(std::move(now)),
      participants_(options_.token, options_.session_dir),
      groups_(outbox, [this](WorkerId worker) { return participants_.Describe(worker); }),
      objects_(&tasks_),
      graphs_(outbox, &participants_, &groups_, options_.allow_plugins),
      instances_(outbox, &objects_, &participants_, &groups_, &graphs_),
      tasks_(options_.max_task_attempts, &objects_, &participants_, &graphs_, &instances_),
      traces_(std::max(1, options_.trace_instances)) {}

WorkerId SchedulerCore::Accept() { return participants_.Accept(now_()); }

bool SchedulerCore::Admitted(WorkerId who) const {
  const Participant* participant = participants_.Find(who);
  return participant != nullptr && participant->role != ParticipantRole::kPending;
}

void SchedulerCore::Refuse(WorkerId who, uint64_t request_id, const Status& reason) {
  SendRefused(*outbox_, who, request_id, reason);
  outbox_->Disconnect(who, reason);
}

Status SchedulerCore::Handle(WorkerId from, proto::Envelope::Reader message) {
  Participant* participant = participants_.Find(from);
  if (participant == nullptr)
    return Internal("message from unknown participant {}", from.ToString());
  participant->last_heard = now_();
  // The validated decoding layer's first half: every list and text within its limit before any
  // part reads the message (the values are checked as FromWire decodes them).
  if (Status checked = rpc::CheckEnvelope(message, options_.limits); !checked.ok()) {
    Refuse(from, message.getRequestId(), checked);
    return checked;
  }
  if (participant->role != ParticipantRole::kPending) {
    Status routed = Route(*participant, message);
    if (!routed.ok()) Refuse(from, message.getRequestId(), routed);
    return routed;
  }
  if (message.getBody().which() != proto::Envelope::Body::HELLO) {
    Status refused = Unavailable("the first message must be Hello with the cluster token");
    Refuse(from, message.getRequestId(), refused);
    return refused;
  }
  return OnHello(*participant, message.getBody().getHello());
}

Status SchedulerCore::Route(Participant& participant, proto::Envelope::Reader message) {
  const WorkerId from = participant.id;
  const ParticipantRole role = participant.role;
  const auto body = message.getBody();
  const uint64_t request_id = message.getRequestId();
  auto requires_role = [&](ParticipantRole expected, const char* what) -> Status {
    if (role != expected) {
      return InvalidArgument("{} sent {}, which only a {} may send", from.ToString(), what,
                             expected == ParticipantRole::kWorker ? "worker" : "driver");
    }
    return Status::Ok();
  };
  switch (body.which()) {
    case proto::Envelope::Body::HEARTBEAT:
      TESSERA_RETURN_IF_ERROR(requires_role(ParticipantRole::kWorker, "a heartbeat"));
      participants_.Heartbeat(participant, body.getHeartbeat());
      return Status::Ok();
    case proto::Envelope::Body::SUBMIT_TASKS:
      TESSERA_RETURN_IF_ERROR(requires_role(ParticipantRole::kDriver, "tasks"));
      return OnSubmitTasks(from, body.getSubmitTasks());
    case proto::Envelope::Body::PUT_OBJECTS:
      TESSERA_RETURN_IF_ERROR(requires_role(ParticipantRole::kDriver, "objects"));
      return OnPutObjects(from, body.getPutObjects());
    case proto::Envelope::Body::RELEASE_OBJECTS:
      TESSERA_RETURN_IF_ERROR(requires_role(ParticipantRole::kDriver, "a release"));
      for (uint64_t id : body.getReleaseObjects().getIds()) objects_.Release(from, ObjectId(id));
      return Status::Ok();
    case proto::Envelope::Body::WATCH_OBJECTS:
      TESSERA_RETURN_IF_ERROR(requires_role(ParticipantRole::kDriver, "a watch"));
      for (uint64_t id : body.getWatchObjects().getIds()) objects_.Watch(from, ObjectId(id));
      return Status::Ok();
    case proto::Envelope::Body::STATUS_REQUEST:
      OnStatusRequest(from, request_id);
      return Status::Ok();
    case proto::Envelope::Body::REGISTER_GRAPH:
      TESSERA_RETURN_IF_ERROR(requires_role(ParticipantRole::kDriver, "a graph"));
      return graphs_.Register(from, request_id, body.getRegisterGraph(), options_.limits);
    case proto::Envelope::Body::RUN_GRAPH:
      TESSERA_RETURN_IF_ERROR(requires_role(ParticipantRole::kDriver, "a graph run"));
      return instances_.RunForDriver(from, request_id, body.getRunGraph());
    case proto::Envelope::Body::INSTANCE_FINISHED:
      TESSERA_RETURN_IF_ERROR(requires_role(ParticipantRole::kWorker, "an instance result"));
      return OnInstanceFinished(participant, body.getInstanceFinished());
    case proto::Envelope::Body::COLLECTIVE_JOIN:
      TESSERA_RETURN_IF_ERROR(requires_role(ParticipantRole::kWorker, "a collective join"));
      return groups_.OnJoin(from, body.getCollectiveJoin());
    case proto::Envelope::Body::COLLECTIVE_FAILED:
      TESSERA_RETURN_IF_ERROR(requires_role(ParticipantRole::kWorker, "a collective failure"));
      return groups_.OnFailed(from, body.getCollectiveFailed(), now_());
    case proto::Envelope::Body::LOAD_PLUGIN:
      TESSERA_RETURN_IF_ERROR(requires_role(ParticipantRole::kDriver, "a plugin"));
      return graphs_.plugins().Add(from, body.getLoadPlugin());
    case proto::Envelope::Body::JOB_PROGRESS:
      TESSERA_RETURN_IF_ERROR(requires_role(ParticipantRole::kDriver, "job progress"));
      jobs_.Record(from, body.getJobProgress(), now_());
      return Status::Ok();
    case proto::Envelope::Body::TIMELINE_REQUEST:
      if (role == ParticipantRole::kWorker) {
        return InvalidArgument(
            "{} sent a timeline request, which only a driver or an "
            "administrator may send",
            from.ToString());
      }
      OnTimelineRequest(from, request_id, body.getTimelineRequest());
      return Status::Ok();
    case proto::Envelope::Body::SHUTDOWN:
      if (role == ParticipantRole::kWorker)
        return InvalidArgument("a worker may not shut the cluster down");
      OnShutdown(from);
      return Status::Ok();
    case proto::Envelope::Body::HELLO:
      return InvalidArgument("{} said Hello twice", from.ToString());
    default:
      return InvalidArgument("{} sent a message the scheduler does not accept (kind {})",
                             from.ToString(), static_cast<int>(body.which()));
  }
}

Status SchedulerCore::OnHello(Participant& from, proto::Hello::Reader hello) {
  Status admitted = participants_.Hello(from, hello);
  if (!admitted.ok()) {
    Refuse(from.id, 0, admitted);
    return admitted;
  }
  SendWelcome(*outbox_, from.id, options_.heartbeat_interval_ms, options_.session_dir);
  if (from.role == ParticipantRole::kWorker) {
    GetLogger("scheduler")
        ->info("{} joined: {} threads, {} MiB host tier, data plane {}{}",
               participants_.Describe(from.id), from.cpu_threads, from.host_capacity >> 20,
               from.data_address, from.gpu.empty() ? "" : ", GPU " + from.gpu);
  }
  return Status::Ok();
}

Status SchedulerCore::OnInstanceFinished(Participant& worker,
                                         proto::InstanceFinished::Reader finished) {
  const uint64_t graph_id = finished.getGraphId();
  const PlacedGraph* graph = graphs_.Find(graph_id);
  // A submitted task's instance is no step: the worker's last run stays its last step's.
  const bool submitted = graph == nullptr || !graph->driver.valid();
  if (finished.hasReport() && !submitted) participants_.RecordRun(worker, finished.getReport());
  if (!submitted && !finished.hasError()) {  // a submitted task counts in the task table
    graph_tasks_done_ +=
        std::count(graph->task_worker.begin(), graph->task_worker.end(), worker.id);
  }
  if (finished.hasSpans() && graph != nullptr) {
    TESSERA_RETURN_IF_ERROR(traces_
                                .RecordPacked(worker.id, graph_id, finished.getInstance(),
                                              rpc::PackedSpansOf(finished.getSpans()),
                                              &graph->tasks, &graph->objects, submitted)
                                .WithContext("spans of an instance"));
  }
  return instances_.Finished(worker.id, finished);
}

Status SchedulerCore::OnSubmitTasks(WorkerId driver, proto::SubmitTasks::Reader submit) {
  // Every task decoded (and checked) before any is submitted: a batch with a bad task changes
  // nothing.
  std::vector<rpc::WireTask> tasks;
  tasks.reserve(submit.getTasks().size());  // within options_.limits.max_tasks (CheckEnvelope)
  for (proto::Task::Reader wire : submit.getTasks()) {
    Result<rpc::WireTask> task = rpc::FromWire(wire, options_.limits);
    if (!task.ok()) return task.status().WithContext("submitted task");
    tasks.push_back(*std::move(task));
  }
  for (rpc::WireTask& task : tasks) TESSERA_RETURN_IF_ERROR(tasks_.Submit(driver, std::move(task)));
  return Status::Ok();
}

Status SchedulerCore::OnPutObjects(WorkerId driver, proto::PutObjects::Reader put) {
  const auto inlines = put.getInline();
  unsigned i = 0;
  for (proto::ObjectDecl::Reader decl : put.getObjects()) {
    TESSERA_ASSIGN_OR_RETURN(ObjectSpec spec, rpc::FromWire(decl, options_.limits));
    if (!spec.id.valid() || objects_.contains(spec.id)) {
      return InvalidArgument("put of {} whose id is invalid or in use", spec.id.ToString());
    }
    std::string data;
    if (i < inlines.size()) {
      data.assign(reinterpret_cast<const char*>(inlines[i].begin()), inlines[i].size());
    }
    ++i;
    objects_.Put(spec, driver, std::move(data));
  }
  return Status::Ok();
}

std::vector<WorkerWaitLine> SchedulerCore::Waits() const {
  const Clock::time_point now = now_();
  std::vector<WorkerWaitInput> inputs;
  for (const auto& [id, p] : participants_.all()) {
    if (p.role != ParticipantRole::kWorker) continue;
    inputs.push_back(WorkerWaitInput{
        .id = id,
        .alive = p.alive,
        .silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - p.last_heard),
        .tasks_in_flight = p.tasks_in_flight,
        .reported = p.waits});
  }
  auto group = [this](uint64_t key) -> std::optional<GroupView> {
    const std::vector<WorkerId>* members = groups_.Members(key);
    if (members == nullptr) return std::nullopt;
    return GroupView{*members, groups_.MissingJoins(key)};
  };
  return ExplainWaits(inputs, group, std::chrono::milliseconds(2 * options_.heartbeat_interval_ms));
}

void SchedulerCore::OnStatusRequest(WorkerId from, uint64_t request_id) {
  StatusSummary summary;
  for (const auto& [id, p] : participants_.all()) {
    if (p.role == ParticipantRole::kWorker) summary.workers.push_back(&p);
    summary.drivers += p.role == ParticipantRole::kDriver;
  }
  // Then the departed ones, dead (their waits are not listed: SendStatusReply pairs waits with
  // the first workers).
  for (const Participant& p : participants_.departed()) summary.workers.push_back(&p);
  summary.waits = Waits();
  summary.objects = objects_.size();
  summary.tasks = task_counts();
  summary.session_dir = options_.session_dir;
  SendStatusReply(*outbox_, from, request_id, summary);
}

void SchedulerCore::OnShutdown(WorkerId from) {
  shutdown_requested_ = true;
  GetLogger("scheduler")->info("shutdown requested by {}", from.ToString());
  for (const auto& [id, p] : participants_.all()) {
    if (p.role == ParticipantRole::kWorker && p.alive) SendShutdown(*outbox_, id);
  }
}

void SchedulerCore::Disconnected(WorkerId who, const Status& reason) {
  Participant* participant = participants_.Find(who);
  if (participant == nullptr) return;
  if (participant->role == ParticipantRole::kWorker && participant->alive) {
    DeclareDead(*participant, reason);
  } else if (participant->role == ParticipantRole::kDriver) {
    // The driver's references go with it; so do the objects it held (its Puts).
    objects_.DriverGone(who);
    jobs_.DriverGone(who);
    graphs_.DriverGone(who);  // its registered graphs go with it
  }
  participants_.Remove(who);
  objects_.DropNotifications(who);
  objects_.DropFrees(who);
}

void SchedulerCore::DeclareDead(Participant& worker, const Status& reason) {
  const WorkerId id = worker.id;
  participants_.MarkDead(worker);
  const std::string who = participants_.Describe(id);
  GetLogger("scheduler")->warn("{} is dead: {}", who, reason.ToString());
  // Its collective groups fail at once, naming it, on every other member.
  groups_.WorkerDied(id, reason);
  objects_.DropFrees(id);
  graphs_.WorkerDied(id);
  // Objects whose only copy was on the dead worker are lost; they fail once its instances have.
  const std::vector<ObjectId> lost = objects_.WorkerGone(id);
  instances_.WorkerDied(id, who, reason);
  for (ObjectId object : lost) {
    const ObjectEntry* entry = objects_.Find(object);
    if (entry == nullptr || !entry->sealed) continue;  // already being rebuilt with a sibling
    const std::string why = fmt::format("{} was lost: its only copy was on {}, which died ({})",
                                        entry->spec.name, who, reason.message());
    const Status rebuilt = tasks_.Rebuild(object, why);
    if (!rebuilt.ok()) objects_.Fail(object, Unavailable("{}; {}", why, rebuilt.message()));
  }
  // Tasks it was running: retried elsewhere when their inputs survive, else failed.
  tasks_.WorkerDied(id, who, reason);
}

void SchedulerCore::Tick() {
  const Clock::time_point now = now_();
  const auto timeout = std::chrono::milliseconds(options_.heartbeat_timeout_ms);
  for (WorkerId id : participants_.Expired(now, timeout)) {
    Status reason = Unavailable("no heartbeat for {} ms", options_.heartbeat_timeout_ms);
    DeclareDead(*participants_.Find(id), reason);
    outbox_->Disconnect(id, reason);
  }
  groups_.Tick(now);
  instances_.Tick(now, timeout);
  if (now - last_keepalive_ >= std::chrono::milliseconds(options_.heartbeat_interval_ms)) {
    last_keepalive_ = now;
    for (const auto& [id, participant] : participants_.all()) {
      if (participant.role != ParticipantRole::kPending && participant.alive) {
        SendKeepalive(*outbox_, id);
      }
    }
  }
}

void SchedulerCore::OnTimelineRequest(WorkerId from, uint64_t request_id,
                                      proto::TimelineRequest::Reader request) {
  timeline_waiters_.push_back(
      TimelineWaiter{from, request_id, request.getLastInstances(), request.getGraphId()});
  AnswerTimelineRequests();
}

std::vector<TimelineSpan> SchedulerCore::RecentSpans(int last) const {
  return traces_.Collect(last, 0, [this](uint64_t graph, uint64_t instance) {
    return instances_.Running(graph, instance);
  });
}

void SchedulerCore::AnswerTimelineRequests() {
  auto running = [this](uint64_t graph, uint64_t instance) {
    return instances_.Running(graph, instance);
  };
  std::erase_if(timeline_waiters_, [&](const TimelineWaiter& waiter) {
    if (participants_.Find(waiter.from) == nullptr) return true;  // gone
    if (waiter.graph != 0 && instances_.Running(waiter.graph, 0)) return false;
    Timeline timeline;
    timeline.spans = traces_.Collect(waiter.last, waiter.graph, running);
    std::set<WorkerId> workers;
    for (const TimelineSpan& span : timeline.spans) workers.insert(span.worker);
    for (WorkerId worker : workers) {
      const Participant* participant = participants_.Find(worker);
      timeline.processes.push_back(
          participant == nullptr
              ? TimelineProcess{worker, "", 0}
              : TimelineProcess{worker, participant->hostname, participant->pid});
    }
    SendTimelineReply(*outbox_, waiter.from, waiter.request_id, timeline);
    return true;
  });
}

void SchedulerCore::Flush() {
  if (!timeline_waiters_.empty()) AnswerTimelineRequests();
  FlushObjects();
}

void SchedulerCore::FlushObjects() {
  for (const auto& [driver, ids] : objects_.TakeNotifications()) {
    if (ids.empty()) continue;
    std::vector<ObjectReport> reports;
    reports.reserve(ids.size());
    for (ObjectId id : ids) {
      ObjectReport& report = reports.emplace_back();
      report.id = id;
      const ObjectEntry* object = objects_.Find(id);
      if (object == nullptr) {
        report.error =
            NotFound("{} is unknown to the scheduler (never created, or freed)", id.ToString());
      } else if (!object->error.ok()) {
        report.error = object->error;
      } else {
        report.source = SourceOf(*object, participants_);
        report.inline_data = object->inline_data;
      }
    }
    SendObjectsReady(*outbox_, driver, reports);
  }
  for (const auto& [holder, ids] : objects_.TakeFrees()) {
    if (ids.empty()) continue;
    const Participant* participant = participants_.Find(holder);
    if (participant == nullptr || !participant->alive) continue;
    SendFreeObjects(*outbox_, holder, ids);
  }
}

}  // namespace tessera

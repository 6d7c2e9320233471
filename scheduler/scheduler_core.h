// SchedulerCore: the scheduler's state machine, free of sockets and threads.
//
// Events come in through Accept / Handle / Disconnected / Tick; messages go out through the
// injected Outbox, so the whole scheduler can be driven by a test without a network
// (scheduler_core_test.cc). SchedulerService is the thin Asio shell that feeds it.
//
// The core is the orchestrator of the scheduler's parts, each with one job:
//   ParticipantTable  (participants.h)      who is connected, in which role; Hello and the
//                                           token; heartbeats, liveness and worker load
//   ObjectDirectory   (object_directory.h)  where each object lives, its size, who references,
//                                           watches or waits for it; frees
//   GraphRegistry     (graph_registry.h)    every graph: drivers' registered graphs (placed
//                                           once) and the templates of submitted tasks and
//                                           dynamic collectives (placed per instance), with
//                                           the parts each worker holds
//   InstanceTable     (instance_table.h)    every running instance of a placed graph: the one
//                                           way work runs on workers
//   TaskTable         (task_table.h)        submitted tasks: readiness, lineage, retries; each
//                                           runs as an instance of its one-task graph; with
//                                           GangTable (gang.h), dynamic collectives run as one
//                                           instance of their members
//   CollectiveGroups  (collective_groups.h) every collective group's rendezvous and watcher
//   TraceStore        (trace_store.h)       the spans of the latest graph instances
//   placement.h, messages.h                 placement (PlaceGraph); every outgoing message
//   JobMetrics        (job_metrics.h)       the jobs' step figures (loss, step time, ...)
//   ExplainWaits      (waits.h)             who waits on what: the workers' reported waits
//                                           explained with liveness and rendezvous (Waits)
// JobMetrics only records, for the dashboard (dashboard/, read through the accessors below).
// The core checks that each message comes from a participant in the role allowed to send it,
// hands it to the part it concerns, and runs the sequences that span parts: a participant
// joining, a worker's death, a driver's departure, a flush of the outgoing batches.
//
// Participants share one id space (WorkerId): a connection gets an id when accepted and must say
// Hello with the cluster's token before anything else; without the token it is refused.
//
// Hostile or broken messages: nothing read off the wire sizes an allocation or indexes a table
// before it is range-checked against options.limits (core/rpc/wire_limits.h: list lengths, texts,
// tensor bytes, group sizes, ...). A message that breaks a limit or the protocol is answered
// with a Refused naming what is wrong, and its sender is disconnected; a message over a limit
// changes nothing (a batch of tasks is decoded whole before any is submitted), and every other
// participant goes on.
//
// Failures: a worker that disconnects or misses heartbeats for heartbeat_timeout_ms is declared
// dead. Its collective groups fail at once; its in-flight tasks are re-dispatched elsewhere when
// all their inputs still exist; objects that lived only on it are lost, and whatever needed them
// fails with an error naming the worker, the task and the lost objects; the graph instances it
// ran a part of fail. Nothing waits forever.
//
// Thread safety: none. One thread (the service's io thread) drives a core.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "core/ids.h"
#include "core/proto/tessera.capnp.h"
#include "core/rpc/wire_limits.h"
#include "core/status.h"
#include "scheduler/collective_groups.h"
#include "scheduler/graph_registry.h"
#include "scheduler/instance_table.h"
#include "scheduler/job_metrics.h"
#include "scheduler/object_directory.h"
#include "scheduler/outbox.h"
#include "scheduler/participants.h"
#include "scheduler/task_table.h"
#include "scheduler/trace_store.h"
#include "scheduler/waits.h"

namespace tessera {

struct SchedulerOptions {
  std::string token;  // what joining processes must present
  uint32_t heartbeat_interval_ms = 500;
  uint32_t heartbeat_timeout_ms = 3000;
  int64_t inline_object_bytes = int64_t{16} * 1024;
  int max_task_attempts = 3;
  std::string session_dir;
  int trace_instances = 16;   // graph instances whose spans are kept (scheduler/trace_store.h)
  rpc::WireLimits limits;     // what one message may hold (core/rpc/wire_limits.h)
  bool allow_plugins = true;  // drivers' plugins accepted (Settings::allow_plugins)
};

class SchedulerCore {
 public:
  using Clock = std::chrono::steady_clock;
  using Now = std::function<Clock::time_point()>;

  SchedulerCore(SchedulerOptions options, Outbox* outbox, Now now);

  // A new connection: returns its participant id. It must send Hello first.
  WorkerId Accept();
  // One message from a participant. Every list and text in it is checked against
  // options.limits first (rpc::CheckEnvelope), then its values as it is decoded (rpc::FromWire).
  // An error is a protocol violation: the core answers the sender with a Refused carrying the
  // reason and asks the outbox to disconnect it; the caller closes the connection (and then
  // calls Disconnected). Every other participant is served as before.
  Status Handle(WorkerId from, proto::Envelope::Reader message);
  // The participant's connection is gone.
  void Disconnected(WorkerId who, const Status& reason);
  // Whether `who` said Hello with the token and was let in (false for unknown ids).
  bool Admitted(WorkerId who) const;
  // Periodic check of heartbeats, and a keepalive to every participant each heartbeat interval
  // (a worker or driver that hears nothing for rpc::SchedulerSilenceLimit takes its scheduler
  // for gone: a stopped process or a vanished host closes no connection). Call every
  // heartbeat_interval_ms or so.
  void Tick();
  // Sends the messages the events so far produced: one per destination and kind. The service
  // calls it once per io-loop turn, so a burst of incoming messages yields few outgoing ones.
  void Flush();

  bool shutdown_requested() const { return shutdown_requested_; }
  // For tests and status.
  int alive_workers() const { return participants_.alive_workers(); }
  size_t num_objects() const { return objects_.size(); }
  size_t num_tasks() const { return tasks_.size(); }
  // Placed graphs held (scheduler/graph_registry.h): registered ones and placed templates.
  size_t num_graphs() const { return graphs_.graphs(); }
  // Read-only views for the dashboard (scheduler/dashboard_view.h), on the core's thread.
  const ParticipantTable& participants() const { return participants_; }
  // The submitted tasks by state; done also counts the tasks of registered graphs' instances that
  // finished on their workers (a training step's tasks), so that it counts the work done.
  TaskCounts task_counts() const {
    TaskCounts counts = tasks_.counts();
    counts.done += graph_tasks_done_;
    return counts;
  }
  const JobMetrics& job_metrics() const { return jobs_; }
  // The spans of the latest `last` graph instances kept (every one kept when <= 0), finished
  // instances only (as a TimelineRequest is answered).
  std::vector<TimelineSpan> RecentSpans(int last) const;
  const std::string& session_dir() const { return options_.session_dir; }
  // Every worker's wait explained (scheduler/waits.h), in id order: its latest report combined
  // with liveness (silent for more than two heartbeat intervals: not responding) and the
  // collective groups' rendezvous.
  std::vector<WorkerWaitLine> Waits() const;

 private:
  // Routes a message from an admitted participant to the part it concerns.
  Status Route(Participant& from, proto::Envelope::Reader message);
  Status OnHello(Participant& from, proto::Hello::Reader hello);
  Status OnSubmitTasks(WorkerId driver, proto::SubmitTasks::Reader submit);
  Status OnPutObjects(WorkerId driver, proto::PutObjects::Reader put);
  Status OnInstanceFinished(Participant& worker, proto::InstanceFinished::Reader finished);
  void OnStatusRequest(WorkerId from, uint64_t request_id);
  // A driver or the CLI asks for the spans of the latest instances. Asked for one graph's, the
  // answer waits until no instance of that graph is running (its last workers' spans may still
  // be on their way); instances always end (a report, a failure or a death), so it never hangs.
  void OnTimelineRequest(WorkerId from, uint64_t request_id,
                         proto::TimelineRequest::Reader request);
  // Answers the timeline requests that no longer wait for a running instance.
  void AnswerTimelineRequests();
  void OnShutdown(WorkerId from);
  // Sends `who` the reason and drops its connection.
  void Refuse(WorkerId who, uint64_t request_id, const Status& reason);
  void DeclareDead(Participant& worker, const Status& reason);
  // Sends the queued ObjectsReady and FreeObjects.
  void FlushObjects();

  const SchedulerOptions options_;
  Outbox* outbox_;
  Now now_;
  ParticipantTable participants_;
  CollectiveGroups groups_;
  // The directory tells the task table about waiting tasks; the table uses the directory.
  ObjectDirectory objects_;
  GraphRegistry graphs_;
  InstanceTable instances_;
  TaskTable tasks_;
  JobMetrics jobs_;
  TraceStore traces_;
  int64_t graph_tasks_done_ = 0;  // registered graphs' tasks, per worker's finished instance
  struct TimelineWaiter {
    WorkerId from;
    uint64_t request_id = 0;
    int last = 0;
    uint64_t graph = 0;
  };
  std::vector<TimelineWaiter> timeline_waiters_;
  bool shutdown_requested_ = false;
  Clock::time_point last_keepalive_{};
};

}  // namespace tessera

// SchedulerCore: the scheduler's state machine, free of sockets and threads.
//
// Everything the scheduler knows lives here: the participants (workers, drivers, admin
// clients), the object directory (where each object lives, its size, who references it, who is
// waiting for it), and the dynamic task table. Events come in through Accept / Handle /
// Disconnected / Tick; messages go out through the injected Outbox, so the whole scheduler can
// be driven by a test without a network (scheduler_core_test.cc). SchedulerService is the thin
// Asio shell that feeds it.
//
// Participants share one id space (WorkerId): a connection gets an id when accepted and must
// say Hello with the cluster's token before anything else; without the token it is refused.
//
// Objects:
//   - created by a driver's Put (held by that driver, sealed at once) or declared as a task's
//     output (held by the worker that ran it once the task finishes);
//   - referenced by the driver that created them until it releases them, and by every task that
//     will read them (pending uses); freed on the holders when both reach zero;
//   - small objects (<= inline_object_bytes) travel inside control messages, larger ones move
//     peer to peer over the data plane: the scheduler only says where they are.
//
// Tasks (dynamic, submitted one by one or in batches): ready when every input is sealed;
// placed by PlaceTask (pinned, else locality within memory, else load); dispatched in one batch
// per worker per Flush; on completion their outputs are sealed and their dependents become
// ready. A failed task fails the tasks that depend on it, with the original error.
//
// Registered graphs: a driver registers a graph once; the scheduler places every task on a worker
// then and there (pinned, else beside the producer of its largest input, else the least loaded
// worker) and sends each worker its part once. Each run of the graph (an instance) costs one
// message per involved worker and one completion from each: O(workers), whatever the number of
// tasks. Objects that cross workers move peer to peer (pushed by their producer); only the
// graph's outputs become cluster objects, sealed where they were produced.
//
// Failures: a worker that disconnects or misses heartbeats for heartbeat_timeout_ms is declared
// dead. Its in-flight tasks are re-dispatched elsewhere when all their inputs still exist;
// objects that lived only on it are lost, and whatever needed them fails with an error naming
// the worker, the task and the lost objects. Nothing waits forever.
//
// Thread safety: none. One thread (the service's io thread) drives a core.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <capnp/message.h>

#include "core/collective_task.h"
#include "core/graph.h"
#include "core/ids.h"
#include "core/proto/tessera.capnp.h"
#include "core/status.h"
#include "scheduler/collective_groups.h"
#include "scheduler/outbox.h"
#include "scheduler/placement.h"

namespace tessera {

struct SchedulerOptions {
  std::string token;  // what joining processes must present
  uint32_t heartbeat_interval_ms = 500;
  uint32_t heartbeat_timeout_ms = 3000;
  int64_t inline_object_bytes = 16 * 1024;
  int max_task_attempts = 3;
  std::string session_dir;
};

class SchedulerCore {
 public:
  using Clock = std::chrono::steady_clock;
  using Now = std::function<Clock::time_point()>;

  SchedulerCore(SchedulerOptions options, Outbox* outbox, Now now);

  // A new connection: returns its participant id. It must send Hello first.
  WorkerId Accept();
  // One message from a participant. An error is a protocol violation: the caller closes the
  // connection (and then calls Disconnected).
  Status Handle(WorkerId from, proto::Envelope::Reader message);
  // The participant's connection is gone.
  void Disconnected(WorkerId who, const Status& reason);
  // Periodic check of heartbeats (call every heartbeat_interval_ms or so).
  void Tick();
  // Sends the messages the events so far produced: one per destination and kind. The service
  // calls it once per io-loop turn, so a burst of incoming messages yields few outgoing ones.
  void Flush();

  bool shutdown_requested() const { return shutdown_requested_; }
  // For tests and status.
  int alive_workers() const;
  size_t num_objects() const { return objects_.size(); }
  size_t num_tasks() const { return tasks_.size(); }

 private:
  enum class Role { kPending, kWorker, kDriver, kAdmin };
  struct Participant {
    WorkerId id;
    Role role = Role::kPending;
    bool alive = true;
    std::string hostname;
    int pid = 0;
    std::string data_address;
    int cpu_threads = 0;
    int64_t host_capacity = 0;
    int64_t host_used = 0;
    int64_t spilled_bytes = 0;
    int64_t tasks_done = 0;
    int64_t bytes_pulled = 0;
    int64_t pull_micros = 0;
    int64_t bytes_served = 0;
    int tasks_in_flight = 0;
    int64_t committed_bytes = 0;
    // The latest InstanceFinished report, copied out of its message (reported in status).
    std::unique_ptr<capnp::MallocMessageBuilder> last_run;
    Clock::time_point last_heard;
    std::unordered_map<uint64_t, int> refs;  // drivers: objects they reference, with counts
  };
  struct ObjectEntry {
    ObjectSpec spec;
    bool sealed = false;
    std::vector<WorkerId> holders;
    std::string inline_data;
    Status error;  // set when the object failed or was lost
    int driver_refs = 0;
    int pending_uses = 0;
    std::vector<WorkerId> watchers;
    std::vector<TaskId> waiting_tasks;
    bool finished() const { return sealed || !error.ok(); }
  };
  enum class TaskState { kWaiting, kDispatched, kDone, kFailed };
  struct GraphEntry {
    uint64_t id = 0;
    WorkerId driver;
    std::vector<ObjectSpec> objects;  // graph-local ids, dense from 1
    std::vector<TaskSpec> tasks;      // graph-local ids, dense from 1
    std::vector<WorkerId> task_worker;
    std::vector<WorkerId> workers;  // involved, ascending
    std::vector<ObjectId> inputs;   // graph-local ids of objects no task produces
    std::vector<ObjectId> outputs;  // graph-local ids returned to the driver
  };
  struct InstanceEntry {
    uint64_t graph = 0;
    uint64_t instance = 0;
    WorkerId driver;
    std::vector<WorkerId> pending;  // workers still running their part
    std::vector<ObjectId> bound;    // cluster objects bound to the inputs (pending uses)
    std::vector<ObjectId> outputs;  // cluster objects for the outputs
    Status error;
  };
  struct TaskEntry {
    TaskSpec spec;
    std::vector<ObjectSpec> outputs;
    WorkerId driver;
    int unresolved = 0;
    TaskState state = TaskState::kWaiting;
    WorkerId worker;
    int attempts = 0;
    bool uses_counted = false;  // its inputs' pending_uses include this task
  };

  // Message handlers.
  Status OnHello(Participant& from, proto::Hello::Reader hello);
  Status OnHeartbeat(Participant& from, proto::Heartbeat::Reader heartbeat);
  Status OnSubmitTasks(Participant& from, proto::SubmitTasks::Reader submit);
  Status OnTasksFinished(Participant& from, proto::TasksFinished::Reader finished);
  Status OnPutObjects(Participant& from, proto::PutObjects::Reader put);
  Status OnReleaseObjects(Participant& from, proto::ReleaseObjects::Reader release);
  Status OnWatchObjects(Participant& from, proto::WatchObjects::Reader watch);
  void OnStatusRequest(Participant& from, uint64_t request_id);
  Status OnRegisterGraph(Participant& from, uint64_t request_id,
                         proto::RegisterGraph::Reader graph);
  Status OnRunGraph(Participant& from, uint64_t request_id, proto::RunGraph::Reader run);
  Status OnInstanceFinished(Participant& from, proto::InstanceFinished::Reader finished);
  // Keys the groups of a placed graph's collectives and gives each member its group and its
  // position on its worker (core/collective_task.h). InvalidArgument for inconsistent members.
  Status AssignCollectives(GraphEntry& graph);
  // Ends an instance once every involved worker reported (or the instance failed).
  void MaybeFinishInstance(std::pair<uint64_t, uint64_t> key);
  void FailInstance(InstanceEntry& instance, WorkerId skip, const Status& error);
  void Reply(WorkerId to, uint64_t request_id, const Status& status);

  // State transitions.
  void MakeReady(TaskId id);
  // A dynamic collective member is ready: once all are, they are placed on distinct workers and
  // dispatched together (gang), with their group and per-worker positions.
  void ReadyMember(TaskEntry& task, const CollectiveMembership& membership);
  // A member failed: its siblings cannot complete; fail them (and abort the group when the
  // member had been dispatched).
  void MemberFailed(const TaskSpec& task, WorkerId driver, bool dispatched, const Status& error);
  void Dispatch(TaskEntry& task);
  void SealObject(ObjectEntry& object, WorkerId holder, int64_t bytes, std::string inline_data);
  void FailObject(ObjectEntry& object, const Status& error);
  void FailTask(TaskEntry& task, const Status& error);
  void ReleaseUse(ObjectId id);
  void MaybeFree(ObjectEntry& object);
  void DeclareDead(Participant& worker, const Status& reason);
  void Refuse(WorkerId who, uint64_t request_id, const Status& reason);

  // Outgoing batches (see Flush).
  void QueueNotify(WorkerId driver, ObjectId object);

  std::vector<WorkerLoad> WorkerLoads() const;
  Participant* Find(WorkerId id);
  std::string Describe(WorkerId worker) const;

  const SchedulerOptions options_;
  Outbox* outbox_;
  Now now_;
  uint64_t next_participant_ = 1;
  std::map<WorkerId, Participant> participants_;
  std::unordered_map<ObjectId, ObjectEntry> objects_;
  std::unordered_map<TaskId, TaskEntry> tasks_;
  std::unordered_map<uint64_t, GraphEntry> graphs_;
  CollectiveGroups groups_;
  // Dynamic collectives waiting for all their members, by (driver, collective id).
  struct PendingCollective {
    int group_size = 0;
    std::vector<TaskId> ready;  // by rank; invalid until that member is ready
    int settled = 0;            // members ready or failed
    Status failed;              // set when one failed: later members fail at once
  };
  std::map<std::pair<WorkerId, int64_t>, PendingCollective> pending_collectives_;
  std::map<WorkerId, int64_t> dynamic_positions_;  // next position of each worker's members
  std::map<std::pair<uint64_t, uint64_t>, InstanceEntry> instances_;
  int64_t tasks_done_ = 0;
  bool shutdown_requested_ = false;

  std::map<WorkerId, std::vector<TaskId>> dispatch_batches_;
  std::map<WorkerId, std::vector<ObjectId>> notify_batches_;
  std::map<WorkerId, std::vector<ObjectId>> free_batches_;
};

}  // namespace tessera

// TaskTable: the dynamic tasks, from submission until they finish or fail.
//
// A task (submitted by a driver, one by one or in batches)
//   - declares its outputs in the object directory (referenced by its driver) and uses its
//     inputs (pending uses, released when it ends);
//   - waits until every input is sealed (the directory tells it: ObjectWaiters);
//   - is then placed by PlaceTask (pinned, else locality within memory, else load) and
//     dispatched; each worker's dispatched tasks go out in one DispatchTasks per Flush;
//   - on completion seals its outputs where it ran, which readies its dependents; on failure
//     fails its outputs with the original error, and so whatever depends on them.
// A member of a dynamic collective (core/collective_task.h) waits for all its siblings
// (GangTable); they are placed on distinct workers (PlaceGang) and dispatched together, with
// their group and per-worker positions. A failed member takes its siblings with it.
// When a worker dies, its tasks in flight are dispatched again elsewhere if their inputs
// survive and attempts remain (collective members never move: their group is the workers they
// were dispatched with); otherwise they fail naming the worker and the lost inputs.
//
// Lineage (scheduler/lineage.h): every submitted task but a collective member is recorded, so
// an output lost with its worker can be made again (Rebuild): its task runs once more, after
// the inputs it needs that are lost or freed are rebuilt the same way, recursively, each task at
// most max_attempts times, and no longer pinned to a worker that died. Tasks that wait for such
// an object, or were running and lost it under their feet, wait for it again instead of failing.
//
// The table charges each dispatch to its worker's load in the ParticipantTable and discharges it
// when the task ends there. Errors: Submit returns InvalidArgument (a protocol violation) for a
// malformed submission; every other failure is a task's, carried by its outputs.
//
// Thread safety: none; the scheduler's io thread drives it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/collective_task.h"
#include "core/graph.h"
#include "core/ids.h"
#include "core/proto/tessera.capnp.h"
#include "core/rpc/wire.h"
#include "core/status.h"
#include "scheduler/collective_groups.h"
#include "scheduler/gang.h"
#include "scheduler/lineage.h"
#include "scheduler/messages.h"
#include "scheduler/object_directory.h"
#include "scheduler/outbox.h"
#include "scheduler/participants.h"
#include "scheduler/placement.h"

namespace tessera {

enum class TaskState { kWaiting, kDispatched, kDone, kFailed };

struct TaskEntry {
  TaskSpec spec;
  std::vector<ObjectSpec> outputs;
  WorkerId driver;
  int unresolved = 0;  // inputs not sealed yet
  TaskState state = TaskState::kWaiting;
  WorkerId worker;
  int attempts = 0;
  bool uses_counted = false;  // its inputs' pending_uses include this task
  std::string rebuilding;     // running again to rebuild a lost object: why (its failures say)
};

class TaskTable final : public ObjectWaiters {
 public:
  // The parts must outlive the table. A task runs at most `max_attempts` times.
  TaskTable(int max_attempts, ObjectDirectory* objects, ParticipantTable* participants,
            CollectiveGroups* groups);

  size_t size() const { return tasks_.size(); }
  TaskCounts counts() const;

  // One task of `driver`'s submission. InvalidArgument for a task id or output id that is
  // invalid or in use (nothing is recorded for that task). A task reading an unknown or failed
  // object fails at once, its outputs carrying the error.
  Status Submit(WorkerId driver, rpc::WireTask task);
  // `worker`'s result for one task: its outputs sealed there, or the task failed naming the
  // worker. A result for a task the worker is not running is logged and ignored.
  void Finished(WorkerId worker, proto::TaskResult::Reader result);
  // `worker` (described as `who`) died of `reason` and is marked dead: its tasks in flight are
  // dispatched elsewhere, wait for inputs being rebuilt, or fail (see above).
  void WorkerDied(WorkerId worker, const std::string& who, const Status& reason);
  // `object`, lost (sealed, no copy left) or needed again after it was freed, is made again by
  // running its task once more (lost or freed inputs first). `why` says how it was lost; a
  // failure of the task run again carries it. An error saying why it cannot be (no lineage, the
  // budget spent, an input failed), for the caller to fail the object with.
  Status Rebuild(ObjectId object, const std::string& why);
  size_t lineage_size() const { return lineage_.size(); }

  // Sends each worker the tasks dispatched to it since the last Flush, in one message.
  void Flush(Outbox& outbox);
  // Forgets what was to be sent to `worker` (it died, or its connection is gone).
  void DropDispatches(WorkerId worker) { dispatch_batches_.erase(worker); }

  // ObjectWaiters (called by the object directory).
  void InputSealed(TaskId task) override;
  void InputFailed(TaskId task, const ObjectSpec& object, const Status& error) override;
  void ObjectFreed(ObjectId object) override { lineage_.OutputFreed(object); }

 private:
  // Every input is sealed: place and dispatch it (a collective member waits for its siblings).
  void MakeReady(TaskId id);
  void ReadyMember(TaskEntry& task, const CollectiveMembership& membership);
  // A member failed: its siblings cannot complete. Aborts its group when it had been dispatched,
  // else fails the ready siblings.
  void MemberFailed(const TaskSpec& task, WorkerId driver, bool dispatched, const Status& error);
  void Dispatch(TaskEntry& task);
  // Ends the task: fails its outputs with `error`, releases its inputs, fails its siblings.
  void FailTask(TaskEntry& task, const Status& error);
  // What placement needs to know of a task: pin, memory, and which workers hold its inputs.
  TaskDemand DemandOf(const TaskEntry& task) const;
  // A dispatched task whose inputs include objects being made again (lost with their holder):
  // back to waiting for them, when attempts remain. False when it should fail instead.
  bool WaitAgainForRebuiltInputs(TaskEntry& task);
  // Uses the task's inputs and waits for those not sealed; dispatches it when none is left.
  void AwaitInputs(TaskEntry& task);

  const int max_attempts_;
  ObjectDirectory* objects_;
  ParticipantTable* participants_;
  CollectiveGroups* groups_;
  std::unordered_map<TaskId, TaskEntry> tasks_;
  GangTable gangs_;
  Lineage lineage_;
  int64_t done_ = 0;
  std::map<WorkerId, std::vector<TaskId>> dispatch_batches_;
};

}  // namespace tessera

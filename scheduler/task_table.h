// TaskTable: the submitted tasks, from submission until they finish or fail.
//
// A submitted task runs the way every piece of work runs: as an instance of a placed graph
// (instance_table.h). The table
//   - declares the task's outputs in the object directory (referenced by its driver) and uses its
//     inputs (pending uses, released when it ends);
//   - waits until every input is sealed (the directory tells it: ObjectWaiters);
//   - then runs it as an instance of its one-task graph (GraphRegistry::TaskTemplate, cached by
//     what the task computes), placed for this instance by PlaceGraph (pinned, else where most of
//     its input bytes are within memory, else the least loaded), the instance id being the
//     task's id;
//   - on the instance's success its outputs are sealed where it ran, which readies its
//     dependents; on failure it fails its outputs with the original error, and so whatever
//     depends on them.
// The members of a dynamic collective (core/collective_task.h) wait for one another (GangTable);
// once all are ready they run as one instance of a graph of the members (CollectiveTemplate), on
// distinct workers, the instance id being rank 0's task id. A failed member takes its siblings
// with it.
// When a worker dies, its tasks in flight run again elsewhere if their inputs survive and
// attempts remain (collective members never move: their group is the workers they ran on);
// otherwise they fail naming the worker and the lost inputs.
//
// Lineage (scheduler/lineage.h): every submitted task but a collective member is recorded, so
// an output lost with its worker can be made again (Rebuild): its task runs once more, after
// the inputs it needs that are lost or freed are rebuilt the same way, recursively, each task at
// most max_attempts times, and no longer pinned to a worker that died. Tasks that wait for such
// an object, or were running and lost it under their feet, wait for it again instead of failing.
//
// The table charges each running task to its worker's load in the ParticipantTable and
// discharges it when the task ends there. Errors: Submit returns InvalidArgument (a protocol
// violation) for a malformed submission; every other failure is a task's, carried by its
// outputs.
//
// Thread safety: none; the scheduler's io thread drives it.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/collective_task.h"
#include "core/graph.h"
#include "core/ids.h"
#include "core/rpc/wire.h"
#include "core/status.h"
#include "scheduler/gang.h"
#include "scheduler/graph_registry.h"
#include "scheduler/instance_table.h"
#include "scheduler/lineage.h"
#include "scheduler/messages.h"
#include "scheduler/object_directory.h"
#include "scheduler/participants.h"

namespace tessera {

enum class TaskState { kWaiting, kRunning, kDone, kFailed };

struct TaskEntry {
  TaskSpec spec;
  std::vector<ObjectSpec> outputs;
  WorkerId driver;
  int unresolved = 0;  // inputs not sealed yet
  TaskState state = TaskState::kWaiting;
  WorkerId worker;        // where its instance runs (kRunning)
  uint64_t graph = 0;     // the placed graph of its instance (kRunning)
  uint64_t instance = 0;  // its instance's id: its own, or its collective's rank 0 task's
  int attempts = 0;
  bool uses_counted = false;  // its inputs' pending_uses include this task
  std::string rebuilding;     // running again to rebuild a lost object: why (its failures say)
};

class TaskTable final : public ObjectWaiters, public InstanceObserver {
 public:
  // The parts must outlive the table. A task runs at most `max_attempts` times.
  TaskTable(int max_attempts, ObjectDirectory* objects, ParticipantTable* participants,
            GraphRegistry* graphs, InstanceTable* instances);

  size_t size() const { return tasks_.size(); }
  TaskCounts counts() const;

  // One task of `driver`'s submission. InvalidArgument for a task id or output id that is
  // invalid or in use (nothing is recorded for that task). A task reading an unknown or failed
  // object fails at once, its outputs carrying the error.
  Status Submit(WorkerId driver, rpc::WireTask task);
  // `worker` (described as `who`) died of `reason` and is marked dead: its tasks in flight run
  // elsewhere, wait for inputs being rebuilt, or fail (see above).
  void WorkerDied(WorkerId worker, const std::string& who, const Status& reason);
  // `object`, lost (sealed, no copy left) or needed again after it was freed, is made again by
  // running its task once more (lost or freed inputs first). `why` says how it was lost; a
  // failure of the task run again carries it. An error saying why it cannot be (no lineage, the
  // budget spent, an input failed), for the caller to fail the object with.
  Status Rebuild(ObjectId object, const std::string& why);
  size_t lineage_size() const { return lineage_.size(); }

  // ObjectWaiters (called by the object directory).
  void InputSealed(TaskId task) override;
  void InputFailed(TaskId task, const ObjectSpec& object, const Status& error) override;
  void ObjectFreed(ObjectId object) override { lineage_.OutputFreed(object); }
  // InstanceObserver (called by the instance table).
  void InstanceEnded(uint64_t instance, WorkerId worker, const Status& error) override;

 private:
  // Every input is sealed: run it (a collective member waits for its siblings).
  void MakeReady(TaskId id);
  void ReadyMember(TaskEntry& task, const CollectiveMembership& membership);
  // A member failed: its siblings cannot complete. Those running with it (`started`: its
  // instance was abandoned) fail with it; before that, the ready ones do, and later ones will.
  void MemberFailed(const TaskSpec& task, WorkerId driver, bool started,
                    const std::vector<TaskId>& running_siblings, const Status& error);
  // Runs a task alone, or a collective's members (by rank) together, as one instance.
  void Start(const std::vector<TaskId>& tasks);
  // The graph-local id of each distinct input of the tasks' template, and its cluster object.
  std::vector<std::pair<ObjectId, ObjectId>> TemplateInputs(const std::vector<TaskId>& tasks) const;
  // What placement needs to know: each worker's load, the holders of the bound inputs.
  PlacementView ViewFor(const std::vector<TaskId>& tasks) const;
  // The task's instance succeeded: its outputs are sealed; it is done.
  void Completed(TaskEntry& task);
  // Ends the task: fails its outputs with `error`, releases its inputs, fails its siblings.
  void FailTask(TaskEntry& task, const Status& error);
  // A running task's instance ended (or was abandoned): it leaves its worker's load and is no
  // longer running.
  void LeaveWorker(TaskEntry& task);
  // A running task whose inputs include objects being made again (lost with their holder):
  // back to waiting for them, when attempts remain. False when it should fail instead.
  bool WaitAgainForRebuiltInputs(TaskEntry& task);
  // Uses the task's inputs and waits for those not sealed; runs it when none is left.
  void AwaitInputs(TaskEntry& task);

  const int max_attempts_;
  ObjectDirectory* objects_;
  ParticipantTable* participants_;
  GraphRegistry* graphs_;
  InstanceTable* instances_;
  std::unordered_map<TaskId, TaskEntry> tasks_;
  // Running instances of this table: instance id -> its tasks (one, or a collective's by rank).
  std::unordered_map<uint64_t, std::vector<TaskId>> instances_of_;
  GangTable gangs_;
  Lineage lineage_;
  int64_t done_ = 0;
};

}  // namespace tessera

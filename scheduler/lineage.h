// Lineage: how each object a dynamic task produced was made, so that an object lost with its
// worker can be made again by running its task once more (Ray calls this lineage
// reconstruction). Objects a driver Put have no lineage and need none: the driver is their only
// holder, so a worker's death never loses them. Outputs of registered graphs have none either:
// a step is recovered as a whole, from the trainer's state (issue "training that survives
// faults").
//
// An entry records a finished-or-running task's spec, its outputs and its driver. It stays as
// long as it could be needed: while one of its outputs is in the object directory, or while the
// entry of a task that reads one of its outputs stays (a chain a -> b -> c whose driver keeps
// only c keeps all three entries, so c can be rebuilt from the start). References count both;
// an entry whose count reaches zero goes, releasing the entries of its inputs in turn.
//
// Each entry counts the times it was rebuilt; the task table refuses past a budget.
//
// Thread safety: none; the scheduler's io thread drives it.
#pragma once

#include <unordered_map>
#include <vector>

#include "core/graph.h"
#include "core/ids.h"

namespace tessera {

struct LineageEntry {
  TaskSpec spec;
  std::vector<ObjectSpec> outputs;
  WorkerId driver;
  int rebuilds = 0;  // times its task ran again for a lost output
  int references = 0;
};

class Lineage {
 public:
  size_t size() const { return entries_.size(); }

  // A task was submitted: its outputs now exist (one reference each), and it references the
  // entries of its inputs' producers.
  void Record(const TaskSpec& spec, const std::vector<ObjectSpec>& outputs, WorkerId driver);
  // The entry of the task that produced `object`, or null (a Put, a graph output, or an object
  // whose lineage was dropped).
  LineageEntry* ProducerOf(ObjectId object);
  // `object`, an output of a recorded task, left the object directory (freed) / entered it again
  // (declared anew to be rebuilt).
  void OutputFreed(ObjectId object);
  void OutputRevived(ObjectId object);

 private:
  void Unref(TaskId task);

  std::unordered_map<TaskId, LineageEntry> entries_;
  std::unordered_map<ObjectId, TaskId> producers_;  // outputs of recorded tasks
};

}  // namespace tessera

// Placement: which worker runs a task. Pure functions: no state, no I/O; tested directly.
//
// PlaceTask: a dynamic task, when it is ready.
//
// Assumptions: every input's size and holders are known (the object directory); each worker
// reports its host-tier capacity and use (heartbeats) and the scheduler tracks the bytes it has
// committed to tasks in flight there.
//
// Algorithm (the architecture guide's rule):
//   1. A task pinned to a worker goes there if that worker is alive; otherwise it is Infeasible
//      (the caller fails the task naming the worker).
//   2. Otherwise, among alive workers whose free host memory fits the task's memory estimate,
//      pick the one holding the most input bytes locally (least data to pull);
//   3. ties go to the least loaded (fewest tasks in flight), then to the lowest id, so the
//      choice is deterministic.
//   4. If no worker fits, pick the alive worker with the most free memory anyway: its store will
//      spill to disk to make room (the object store's policy), which is slower but not wrong.
//
// PlaceGang: the members of one dynamic collective, once all are ready: each by PlaceTask, rank
// by rank, among the workers no lower rank took (members need distinct workers).
//
// PlaceGraph: every task of a registered graph at once, when it is registered, in task order:
//   1. A pinned task goes to its worker, which must be alive (Infeasible otherwise).
//   2. Otherwise it goes beside the producer of its largest input that an earlier task produces
//      (ties: the first such input), so the biggest transfer stays on one worker.
//   3. Otherwise (it reads only graph inputs) to the alive worker running the fewest of the
//      graph's tasks so far (ties: the first in `alive`).
//   4. Members of one collective need distinct workers: a member whose choice already runs a
//      sibling moves to the least loaded alive worker running none (ties: the first); a pinned
//      one cannot move (Infeasible), nor can a collective with more members than alive workers.
#pragma once

#include <cstdint>
#include <vector>

#include "core/graph.h"
#include "core/ids.h"
#include "core/status.h"

namespace tessera {

struct WorkerLoad {
  WorkerId id;
  bool alive = true;
  int64_t free_bytes = 0;  // capacity - used - committed to tasks in flight
  int tasks_in_flight = 0;
};

struct TaskDemand {
  WorkerId pinned;  // invalid: any worker
  int64_t memory_estimate_bytes = 0;
  std::vector<std::pair<WorkerId, int64_t>> local_bytes;  // bytes of inputs each worker holds
};

// Infeasible when the task is pinned to a dead or unknown worker, Unavailable when no worker is
// alive.
Result<WorkerId> PlaceTask(const TaskDemand& demand, const std::vector<WorkerLoad>& workers);

// The worker of each member, by rank. PlaceTask's errors, naming the rank that could not be
// placed and `collective`.
Result<std::vector<WorkerId>> PlaceGang(int64_t collective, const std::vector<TaskDemand>& members,
                                        std::vector<WorkerLoad> workers);

// The worker of each task of `graph`, by task index. Infeasible naming the task or the collective
// (as above); InvalidArgument for a task's inconsistent collective attributes (CollectiveOf);
// Unavailable when `alive` is empty. REQUIRES: `graph` passed Graph::Validate; `alive` holds
// distinct workers.
Result<std::vector<WorkerId>> PlaceGraph(const Graph& graph, const std::vector<WorkerId>& alive);

}  // namespace tessera

// Placement: which worker runs a ready task.
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
// Pure function: no state, no I/O; tested directly.
#pragma once

#include <cstdint>
#include <vector>

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

}  // namespace tessera

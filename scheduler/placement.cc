#include "scheduler/placement.h"

#include <algorithm>

namespace tessera {

Result<WorkerId> PlaceTask(const TaskDemand& demand, const std::vector<WorkerLoad>& workers) {
  if (demand.pinned.valid()) {
    for (const WorkerLoad& worker : workers) {
      if (worker.id == demand.pinned && worker.alive) return worker.id;
    }
    return Infeasible("the task is pinned to {}, which is not alive", demand.pinned.ToString());
  }
  auto local_bytes = [&](WorkerId id) {
    int64_t bytes = 0;
    for (const auto& [holder, n] : demand.local_bytes) {
      if (holder == id) bytes += n;
    }
    return bytes;
  };
  const WorkerLoad* best = nullptr;
  int64_t best_local = -1;
  for (const WorkerLoad& worker : workers) {
    if (!worker.alive || worker.free_bytes < demand.memory_estimate_bytes) continue;
    const int64_t local = local_bytes(worker.id);
    const bool better =
        best == nullptr || local > best_local ||
        (local == best_local &&
         (worker.tasks_in_flight < best->tasks_in_flight ||
          (worker.tasks_in_flight == best->tasks_in_flight && worker.id < best->id)));
    if (better) {
      best = &worker;
      best_local = local;
    }
  }
  if (best != nullptr) return best->id;
  // Nothing fits: the roomiest alive worker, whose store will spill.
  for (const WorkerLoad& worker : workers) {
    if (worker.alive && (best == nullptr || worker.free_bytes > best->free_bytes)) best = &worker;
  }
  if (best == nullptr) return Unavailable("no worker is alive to run the task");
  return best->id;
}

}  // namespace tessera

#include "scheduler/placement.h"

#include <algorithm>
#include <map>
#include <optional>

#include "core/collective_task.h"

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

Result<std::vector<WorkerId>> PlaceGang(int64_t collective, const std::vector<TaskDemand>& members,
                                        std::vector<WorkerLoad> workers) {
  std::vector<WorkerId> placed;
  for (size_t rank = 0; rank < members.size(); ++rank) {
    Result<WorkerId> worker = PlaceTask(members[rank], workers);
    if (!worker.ok()) {
      return worker.status().WithContext(
          fmt::format("placing rank {} of collective {} ({} members need distinct workers)", rank,
                      collective, members.size()));
    }
    placed.push_back(*worker);
    for (WorkerLoad& load : workers) {
      if (load.id == *worker) load.alive = false;  // runs a member of this collective
    }
  }
  return placed;
}

Result<std::vector<WorkerId>> PlaceGraph(const Graph& graph, const std::vector<WorkerId>& alive) {
  if (alive.empty()) return Unavailable("no worker is alive to run the graph");
  std::vector<int> load(alive.size(), 0);  // the graph's tasks placed on each alive worker
  auto runs_one_of = [](const std::vector<WorkerId>& workers, WorkerId worker) {
    return std::find(workers.begin(), workers.end(), worker) != workers.end();
  };
  // The least loaded alive worker outside `taken` (invalid when there is none).
  auto least_loaded = [&](const std::vector<WorkerId>& taken) {
    WorkerId best;
    int fewest = 0;
    for (size_t w = 0; w < alive.size(); ++w) {
      if (runs_one_of(taken, alive[w])) continue;
      if (!best.valid() || load[w] < fewest) {
        best = alive[w];
        fewest = load[w];
      }
    }
    return best;
  };
  std::map<int64_t, std::vector<WorkerId>> collective_workers;
  std::vector<WorkerId> placed;
  placed.reserve(graph.tasks().size());
  for (const TaskSpec& spec : graph.tasks()) {
    WorkerId place;
    if (spec.pinned_worker.valid()) {
      if (!runs_one_of(alive, spec.pinned_worker)) {
        return Infeasible("task '{}' is pinned to {}, which is not an alive worker", spec.name,
                          spec.pinned_worker.ToString());
      }
      place = spec.pinned_worker;
    } else {
      int64_t best_bytes = -1;
      for (ObjectId input : spec.inputs) {
        const ObjectSpec& object = graph.object(input);
        if (object.producer.valid() && object.producer < spec.id &&
            object.meta.bytes() > best_bytes) {
          best_bytes = object.meta.bytes();
          place = placed[object.producer.value() - 1];
        }
      }
      if (!place.valid()) place = least_loaded({});
    }
    TESSERA_ASSIGN_OR_RETURN(std::optional<CollectiveMembership> membership, CollectiveOf(spec));
    if (membership) {
      std::vector<WorkerId>& used = collective_workers[membership->collective];
      if (runs_one_of(used, place)) {
        if (spec.pinned_worker.valid()) {
          return Infeasible(
              "task '{}' is pinned to {}, which already runs another member of collective {}: "
              "members need distinct workers",
              spec.name, place.ToString(), membership->collective);
        }
        place = least_loaded(used);
        if (!place.valid()) {
          return Infeasible(
              "collective {} has {} members but only {} workers are alive: start more workers or "
              "plan a smaller group",
              membership->collective, membership->group_size, alive.size());
        }
      }
      used.push_back(place);
    }
    ++load[static_cast<size_t>(std::find(alive.begin(), alive.end(), place) - alive.begin())];
    placed.push_back(place);
  }
  // A control edge orders two tasks of one worker's run: it cannot reach across workers.
  for (const TaskSpec& spec : graph.tasks()) {
    for (TaskId earlier : spec.after) {
      const WorkerId there = placed[earlier.value() - 1];
      if (there != placed[spec.id.value() - 1]) {
        return Infeasible(
            "task '{}' must start after task '{}', but they are placed on {} and {}: a control "
            "edge needs both tasks on one worker (pin them together)",
            spec.name, graph.task(earlier).name, placed[spec.id.value() - 1].ToString(),
            there.ToString());
      }
    }
  }
  return placed;
}

}  // namespace tessera

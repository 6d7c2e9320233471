#include "scheduler/placement.h"

#include <algorithm>
#include <map>
#include <optional>

#include "core/collective_task.h"

namespace tessera {

namespace {

// One PlaceGraph call: the graph, the candidates and what has been placed so far.
class Placer {
 public:
  Placer(const Graph& graph, const PlacementView& view)
      : graph_(graph), view_(view), graph_load_(view.workers.size(), 0) {}

  Result<std::vector<WorkerId>> Place() {
    if (std::none_of(view_.workers.begin(), view_.workers.end(),
                     [](const WorkerLoad& w) { return w.alive; })) {
      return Unavailable("no worker is alive to run the graph");
    }
    placed_.reserve(graph_.tasks().size());
    for (const TaskSpec& spec : graph_.tasks()) {
      TESSERA_ASSIGN_OR_RETURN(WorkerId place, PlaceTask(spec));
      ++graph_load_[IndexOf(place)];
      placed_.push_back(place);
    }
    TESSERA_RETURN_IF_ERROR(CheckControlEdges());
    return std::move(placed_);
  }

 private:
  Result<WorkerId> PlaceTask(const TaskSpec& spec) {
    WorkerId place;
    if (spec.pinned_worker.valid()) {
      const WorkerLoad* pinned = Find(spec.pinned_worker);
      if (pinned == nullptr || !pinned->alive) {
        return Infeasible("task '{}' is pinned to {}, which is not an alive worker", spec.name,
                          spec.pinned_worker.ToString());
      }
      place = spec.pinned_worker;
    } else {
      place = BesideLargestProducedInput(spec);
      if (!place.valid()) place = Choose(spec, {});
    }
    TESSERA_ASSIGN_OR_RETURN(std::optional<CollectiveMembership> membership, CollectiveOf(spec));
    if (!membership) return place;
    std::vector<WorkerId>& used = collective_workers_[membership->collective];
    if (std::find(used.begin(), used.end(), place) != used.end()) {
      if (spec.pinned_worker.valid()) {
        return Infeasible(
            "task '{}' is pinned to {}, which already runs another member of collective {}: "
            "members need distinct workers",
            spec.name, place.ToString(), membership->collective);
      }
      place = Choose(spec, used);
      if (!place.valid()) {
        return Infeasible(
            "collective {} has {} members but only {} workers are alive: start more workers or "
            "plan a smaller group",
            membership->collective, membership->group_size, AliveCount());
      }
    }
    used.push_back(place);
    return place;
  }

  // The worker of the earlier task producing the task's largest input; invalid when none does.
  WorkerId BesideLargestProducedInput(const TaskSpec& spec) const {
    WorkerId place;
    int64_t best_bytes = -1;
    for (ObjectId input : spec.inputs) {
      const ObjectSpec& object = graph_.object(input);
      if (object.producer.valid() && object.producer < spec.id &&
          object.meta.bytes() > best_bytes) {
        best_bytes = object.meta.bytes();
        place = placed_[object.producer.value() - 1];
      }
    }
    return place;
  }

  // Rule 3 among the alive candidates outside `taken`: invalid when there is none.
  WorkerId Choose(const TaskSpec& spec, const std::vector<WorkerId>& taken) const {
    const WorkerLoad* best = nullptr;
    int64_t best_local = -1;
    for (const WorkerLoad& worker : view_.workers) {
      if (!Eligible(worker, taken) || worker.free_bytes < spec.memory_estimate_bytes) continue;
      const int64_t local = LocalBytes(spec, worker.id);
      if (best == nullptr || local > best_local ||
          (local == best_local && LessLoaded(worker, *best))) {
        best = &worker;
        best_local = local;
      }
    }
    if (best != nullptr) return best->id;
    // Nothing fits: the roomiest, whose store will spill.
    for (const WorkerLoad& worker : view_.workers) {
      if (Eligible(worker, taken) && (best == nullptr || worker.free_bytes > best->free_bytes)) {
        best = &worker;
      }
    }
    return best == nullptr ? WorkerId() : best->id;
  }

  static bool Eligible(const WorkerLoad& worker, const std::vector<WorkerId>& taken) {
    return worker.alive && std::find(taken.begin(), taken.end(), worker.id) == taken.end();
  }

  // Fewer of this graph's tasks, then fewer tasks in flight (ties: the earlier listed).
  bool LessLoaded(const WorkerLoad& a, const WorkerLoad& b) const {
    const int graph_a = graph_load_[IndexOf(a.id)], graph_b = graph_load_[IndexOf(b.id)];
    if (graph_a != graph_b) return graph_a < graph_b;
    return a.tasks_in_flight < b.tasks_in_flight;
  }

  // Bytes of the task's bound inputs that `worker` holds.
  int64_t LocalBytes(const TaskSpec& spec, WorkerId worker) const {
    int64_t bytes = 0;
    for (ObjectId input : spec.inputs) {
      auto holders = view_.input_holders.find(input);
      if (holders == view_.input_holders.end()) continue;
      for (const auto& [holder, n] : holders->second) {
        if (holder == worker) bytes += n;
      }
    }
    return bytes;
  }

  Status CheckControlEdges() const {
    for (const TaskSpec& spec : graph_.tasks()) {
      for (TaskId earlier : spec.after) {
        const WorkerId there = placed_[earlier.value() - 1];
        if (there != placed_[spec.id.value() - 1]) {
          return Infeasible(
              "task '{}' must start after task '{}', but they are placed on {} and {}: a "
              "control edge needs both tasks on one worker (pin them together)",
              spec.name, graph_.task(earlier).name, placed_[spec.id.value() - 1].ToString(),
              there.ToString());
        }
      }
    }
    return Status::Ok();
  }

  const WorkerLoad* Find(WorkerId id) const {
    for (const WorkerLoad& worker : view_.workers) {
      if (worker.id == id) return &worker;
    }
    return nullptr;
  }
  size_t IndexOf(WorkerId id) const { return static_cast<size_t>(Find(id) - view_.workers.data()); }
  size_t AliveCount() const {
    return static_cast<size_t>(std::count_if(view_.workers.begin(), view_.workers.end(),
                                             [](const WorkerLoad& w) { return w.alive; }));
  }

  const Graph& graph_;
  const PlacementView& view_;
  std::vector<int> graph_load_;  // per candidate: the graph's tasks placed there so far
  std::map<int64_t, std::vector<WorkerId>> collective_workers_;
  std::vector<WorkerId> placed_;
};

}  // namespace

Result<std::vector<WorkerId>> PlaceGraph(const Graph& graph, const PlacementView& view) {
  return Placer(graph, view).Place();
}

PlacementView ViewOf(const std::vector<WorkerId>& alive) {
  PlacementView view;
  for (WorkerId id : alive) view.workers.push_back(WorkerLoad{id, true, INT64_MAX, 0});
  return view;
}

}  // namespace tessera

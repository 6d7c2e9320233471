// Placement: which worker runs each task of a graph. One pure function, PlaceGraph, places every
// kind of work: a driver's registered graph (once, when it is registered), a submitted task (a
// one-task graph, each time it becomes ready) and the members of a dynamic collective (a graph
// of its members, once all are ready). No state, no I/O; tested directly.
//
// Assumptions: the caller lists the candidate workers with their load (host-tier bytes free
// after what tasks in flight there committed, tasks in flight); for work placed when it is ready
// it also says which workers hold the cluster objects bound to the graph's inputs (and their
// bytes). A graph placed at registration has no bound inputs yet.
//
// Algorithm (the architecture guide's rule), task by task in task order:
//   1. A pinned task goes to its worker, which must be an alive candidate (Infeasible
//      otherwise, naming the task).
//   2. Otherwise it goes beside the producer of its largest input that an earlier task of the
//      graph produces (ties: the first such input), so the biggest transfer stays on one worker.
//   3. Otherwise (it reads only graph inputs), among alive workers whose free host memory fits
//      the task's memory estimate: the one holding the most bytes of its bound inputs; ties go
//      to the worker running the fewest of this graph's tasks so far, then the fewest tasks in
//      flight, then the first listed. When no worker fits, the alive worker with the most free
//      memory anyway: its store will spill to disk to make room (slower, not wrong).
//   4. Members of one collective need distinct workers: a member whose choice already runs a
//      sibling is placed by rule 3 among the workers running none; a pinned one cannot move
//      (Infeasible), nor can a collective with more members than alive workers.
//   5. A control edge orders two tasks of one worker's run: both ends must share a worker
//      (Infeasible otherwise).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <utility>
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

// What placement knows of the cluster when it places a graph.
struct PlacementView {
  std::vector<WorkerLoad> workers;  // the candidates, in preference order for ties
  // Per graph input (graph-local id): each worker holding the object bound to it, and its bytes.
  // Empty for a graph placed at registration (nothing is bound yet).
  std::unordered_map<ObjectId, std::vector<std::pair<WorkerId, int64_t>>> input_holders;
};

// The worker of each task of `graph`, by task index. Infeasible naming the task or the collective
// (as above); InvalidArgument for a task's inconsistent collective attributes (CollectiveOf);
// Unavailable when no candidate is alive. REQUIRES: `graph` passed Graph::Validate; the
// candidates are distinct workers.
Result<std::vector<WorkerId>> PlaceGraph(const Graph& graph, const PlacementView& view);

// Every candidate alive, nothing bound, no load: how a graph is placed at registration.
PlacementView ViewOf(const std::vector<WorkerId>& alive);

}  // namespace tessera

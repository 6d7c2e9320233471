// Step time prediction: how long a planned step takes on each worker, before it runs, from
// measured layer times (ParallelConfig::layer_op_costs, ProfileLayerTimes) and the op cost model.
//
// The model: a worker's busy time is the sum of its tasks' times (it runs them one after another
// with every core behind each kernel, as a CPU worker does); the step takes the slowest worker's.
// A task's time:
//   * a task of a layer running its forward op (the forward, or a recompute), or the input or
//     weight half of its backward: that layer's measured time of that kind; its whole backward
//     op: the two halves' (a profile splits the backwards that can be). A backward that rebuilds
//     part of what its forward saved (attribute "rebuild") adds the layer's forward time scaled
//     by the cost model's ratio of the rebuild (the op's cost with the attribute less without)
//     to the forward, as the memory plan's solver counts it;
//   * any other task (optimizer updates, gradient accumulation, collectives, copies): the op cost
//     model's estimate (flops + 10 x bytes, as the pipeline cut weighs layers) at a measured rate
//     of such tasks (`other_ms_per_unit`: what a profile's own non-layer tasks took per unit,
//     StepProfile::other_ms_per_unit; they move bytes where the layers multiply, and ran 5-9x
//     faster per unit than the forwards on the development machine), else at the rate the
//     layers' forwards ran: their measured milliseconds per estimated unit;
//   * a copy to or from the disk tier (a CPU worker's swap): the executor's I/O thread runs it
//     beside the compute (what it leaves unhidden is the activation solver's to price), so only
//     the time it takes from the compute: its bytes times MemoryCaps::
//     disk_copy_compute_us_per_byte (`disk_copy_compute_us_per_byte` below).
// Not modelled: waiting on other workers (collectives' transfers, pipeline bubbles) and tasks
// running beside each other on one worker beyond what the profile saw (ProfileLayerTimes counts
// each task its share of the time it ran beside others). So the figure is exact in kind for one
// worker and a lower bound where workers wait on each other; bench_memory measures it against
// the step.
//
// Thread safety: pure functions of their arguments.
#pragma once

#include <vector>

#include "core/graph.h"
#include "core/status.h"
#include "model/model_spec.h"
#include "ops/op_registry.h"
#include "planner/step_graph.h"

namespace tessera {

// One task's time by the model above, and whether its worker's compute runs it (the swap file's
// copies run on the I/O thread beside it: their `ms` is what they take from the compute).
struct TaskTime {
  double ms = 0;
  bool layer = false;    // a layer's forward, recompute or backward (half): measured time
  bool on_disk = false;  // reaches the disk tier (core/disk_tasks.h)
};

// The op cost model's estimate of a task (flops + 10 x bytes: CostUnits), with its attributes.
Result<double> TaskCostUnits(const Graph& graph, const TaskSpec& task, const OpRegistry& registry);

// Per task of `graph` (in its order), its time; `other_ms_per_unit` the rate of the tasks that
// are not a layer's (0: the layers' forwards'). Errors as PredictStepTime's.
Result<std::vector<TaskTime>> EstimateTaskTimes(const Graph& graph, const ModelSpec& model,
                                                const std::vector<OpCosts>& layer_ms,
                                                const OpRegistry& registry,
                                                double disk_copy_compute_us_per_byte = 0,
                                                double other_ms_per_unit = 0);

struct StepTimePrediction {
  double step_ms = 0;             // the slowest worker's busy time
  std::vector<double> worker_ms;  // per worker (MemoryProfile's order: first task's appearance)
  // Of the slowest worker: its layer tasks' time, the other tasks', and the overhead per task
  // times its tasks.
  double layer_ms = 0, other_ms = 0, overhead_ms = 0;
};

// InvalidArgument when layer_ms does not hold one entry per layer of the model, or when the
// layers' forwards were measured as taking no time.
// `task_overhead_ms`: what a step spends per task beyond the tasks' own time (StepProfile::
// TaskOverheadMs), added for every task.
Result<StepTimePrediction> PredictStepTime(const Graph& graph, const ModelSpec& model,
                                           const std::vector<OpCosts>& layer_ms,
                                           const OpRegistry& registry, double task_overhead_ms = 0,
                                           double disk_copy_compute_us_per_byte = 0);

}  // namespace tessera

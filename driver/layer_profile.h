// Balancing pipeline stages by measured layer times.
//
// The planner cuts a model into stages by per-layer costs (ParallelConfig::layer_costs), by
// default the op cost model's estimate. ProfileLayerTimes measures them instead: a short run of
// the model in this process, on one worker at the plan's micro-batch shape, whose trace gives
// each layer's compute time (its forward and backward tasks, split halves included). The inputs
// are zeros (a valid token, class and volume for any model: the times of dense kernels do not
// depend on the values), so the profile needs no data.
#pragma once

#include <vector>

#include "core/status.h"
#include "core/timeline.h"
#include "worker/in_process_executor.h"
#include "zero/model.h"
#include "zero/step_graph.h"

namespace tessera {

// Per layer of `model`, the milliseconds its tasks (forward, backward, backward halves) ran in
// `timeline`, over `steps` steps: the mean per step. Spans of other layers and of no layer
// (optimizer, collectives) are left out. InvalidArgument if steps < 1.
Result<std::vector<double>> LayerTimesFromTimeline(const ModelSpec& model, const Timeline& timeline,
                                                   int steps);

struct LayerProfileOptions {
  int warmup_steps = 1;  // untimed (first-touch allocation, caches)
  int steps = 2;         // timed
};

// Runs the model in this process at the micro-batch shape of `plan` (its batch over its data
// ranks and micro-batches, its seq_len, device and optimizer; one worker, no pipeline), and
// returns LayerTimesFromTimeline of the timed steps. Errors name what failed ("profiling the
// layers: ...").
Result<std::vector<double>> ProfileLayerTimes(const ModelSpec& model, const TrainingPlan& plan,
                                              const ExecutorOptions& executor,
                                              const LayerProfileOptions& options = {});

}  // namespace tessera

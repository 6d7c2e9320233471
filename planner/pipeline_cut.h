// Pipeline cuts: which contiguous chunk of the layers each pipeline stage runs.
//
// A plan of P = pipeline_stages stages and V = virtual_stages chunks per stage cuts the model's
// layers, in forward order, into P x V contiguous chunks minimising the largest chunk's cost;
// chunk c runs on stage c % P. A layer's cost is ParallelConfig::layer_costs when given, else the
// sum of its measured forward, backward and weight times (layer_op_costs), else the op cost
// model's estimate of its forward at one micro-batch's shapes (EstimateLayerCosts). The planner's
// cut pass (planner/plan_passes.h) records the result in StepGraph::layer_chunk / layer_stage.
//
// Thread safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "model/model_spec.h"
#include "ops/op_registry.h"
#include "planner/training_plan.h"

namespace tessera {

// Per layer, the cost model's estimate of its forward at `rows` rows (flops plus ten per byte
// moved; only the ratios matter).
Result<std::vector<double>> EstimateLayerCosts(const ModelSpec& model, int64_t rows,
                                               int64_t seq_len, const OpRegistry& registry);
// Layers (in forward order) into `chunks` contiguous chunks minimizing the largest chunk's cost;
// per layer, its chunk. REQUIRES: 1 <= chunks <= costs.size().
std::vector<int> BalancedChunks(const std::vector<double>& costs, int chunks);
// Per layer, its chunk under the plan: parallel.chunk_layers when given, else balanced by
// parallel.layer_costs, else by the estimate. All zero without a pipeline. InvalidArgument when
// chunk_layers does not give P x V chunks of at least one layer each, adding up to the layers.
Result<std::vector<int>> CutIntoChunks(const ModelSpec& model, const TrainingPlan& plan,
                                       const OpRegistry& registry);

// The cuts worth trying for `chunks` chunks of layers of these costs: the balanced one
// (BalancedChunks) first, then the other contiguous cuts whose largest chunk costs at most
// (1 + slack) x the balanced one's, cheapest largest chunk first (ties: fewer layers in the
// earlier chunks, which hold more micro-batches in flight), at most `most` in all. Each cut as
// per-chunk layer counts (ParallelConfig::chunk_layers). REQUIRES: 1 <= chunks <= costs.size().
std::vector<std::vector<int>> NearBalancedCuts(const std::vector<double>& costs, int chunks,
                                               double slack, int most);

}  // namespace tessera

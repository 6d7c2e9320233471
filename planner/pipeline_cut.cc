// The pipeline cut: layer costs, the balanced partition, and the cut pass.
#include "planner/pipeline_cut.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "planner/plan_passes.h"
#include "planner/step_graph.h"

namespace tessera {

Result<std::vector<double>> EstimateLayerCosts(const ModelSpec& model, int64_t rows,
                                               int64_t seq_len, const OpRegistry& registry) {
  TESSERA_ASSIGN_OR_RETURN(ForwardGraph forward, PlanEvalLoss(model, rows, seq_len, registry));
  std::map<std::string, double> by_layer;
  for (const TaskSpec& task : forward.graph.tasks()) {
    std::vector<TensorMeta> inputs;
    inputs.reserve(task.inputs.size());
    for (ObjectId input : task.inputs) inputs.push_back(forward.graph.object(input).meta);
    TESSERA_ASSIGN_OR_RETURN(OpCost cost, registry.Cost(task.op, inputs, task.attrs));
    // Seconds on a machine doing 10 flops per byte moved; only the ratios matter.
    by_layer[task.layer] += CostUnits(cost);
  }
  std::vector<double> costs;
  costs.reserve(model.layers.size());
  for (const LayerSpec& layer : model.layers) costs.push_back(by_layer[layer.name]);
  return costs;
}

std::vector<int> BalancedChunks(const std::vector<double>& costs, int chunks) {
  const size_t n = costs.size();
  const size_t c = static_cast<size_t>(chunks);
  std::vector<double> prefix(n + 1, 0);
  for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + std::max(costs[i], 0.0);
  // best[j][i]: the smallest possible largest chunk cutting layers [0, i) into j chunks; cut
  // from[j][i] where the last of them starts.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(c + 1, std::vector<double>(n + 1, kInf));
  std::vector<std::vector<size_t>> from(c + 1, std::vector<size_t>(n + 1, 0));
  best[0][0] = 0;
  for (size_t j = 1; j <= c; ++j) {
    for (size_t i = j; i <= n; ++i) {
      for (size_t k = j - 1; k < i; ++k) {
        const double largest = std::max(best[j - 1][k], prefix[i] - prefix[k]);
        if (largest < best[j][i]) {  // ties: the earliest cut, so later chunks stay small
          best[j][i] = largest;
          from[j][i] = k;
        }
      }
    }
  }
  std::vector<int> chunk_of(n, 0);
  size_t end = n;
  for (size_t j = c; j > 0; --j) {
    const size_t begin = from[j][end];
    for (size_t l = begin; l < end; ++l) chunk_of[l] = static_cast<int>(j - 1);
    end = begin;
  }
  return chunk_of;
}

std::vector<std::vector<int>> NearBalancedCuts(const std::vector<double>& costs, int chunks,
                                               double slack, int most) {
  const std::vector<int> balanced = BalancedChunks(costs, chunks);
  std::vector<int> counts(static_cast<size_t>(chunks), 0);
  for (int chunk : balanced) ++counts[static_cast<size_t>(chunk)];
  std::vector<double> prefix(costs.size() + 1, 0);
  for (size_t i = 0; i < costs.size(); ++i) prefix[i + 1] = prefix[i] + std::max(costs[i], 0.0);
  double largest = 0;
  for (size_t c = 0, begin = 0; c < counts.size(); begin += static_cast<size_t>(counts[c]), ++c) {
    largest = std::max(largest, prefix[begin + static_cast<size_t>(counts[c])] - prefix[begin]);
  }
  const double bound = largest * (1 + slack) * (1 + 1e-12);
  // Every composition of the layers into `chunks` parts within the bound (depth first, pruned
  // by it), with its largest chunk; a bounded number of visits keeps deep models cheap.
  std::vector<std::pair<double, std::vector<int>>> found;
  std::vector<int> current;
  int64_t visits = 0;
  constexpr int64_t kMostVisits = 200000;
  const size_t n = costs.size();
  std::function<void(size_t, double)> visit = [&](size_t begin, double worst) {
    if (++visits > kMostVisits) return;
    const size_t left = static_cast<size_t>(chunks) - current.size();
    if (left == 1) {
      const double last = prefix[n] - prefix[begin];
      if (last > bound) return;
      current.push_back(static_cast<int>(n - begin));
      found.emplace_back(std::max(worst, last), current);
      current.pop_back();
      return;
    }
    for (size_t end = begin + 1; end + (left - 1) <= n; ++end) {
      const double cost = prefix[end] - prefix[begin];
      if (cost > bound) break;
      current.push_back(static_cast<int>(end - begin));
      visit(end, std::max(worst, cost));
      current.pop_back();
    }
  };
  visit(0, 0);
  std::stable_sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
    return std::tie(a.first, a.second) < std::tie(b.first, b.second);
  });
  std::vector<std::vector<int>> cuts = {counts};
  for (auto& [worst, cut] : found) {
    if (static_cast<int>(cuts.size()) >= most) break;
    if (cut != counts) cuts.push_back(std::move(cut));
  }
  return cuts;
}

Result<std::vector<int>> CutIntoChunks(const ModelSpec& model, const TrainingPlan& plan,
                                       const OpRegistry& registry) {
  const ParallelConfig& p = plan.parallel;
  const int chunks = p.pipeline_stages * p.virtual_stages;
  if (!p.chunk_layers.empty()) {
    int64_t total = 0;
    bool positive = true;
    for (int count : p.chunk_layers) {
      total += count;
      positive = positive && count >= 1;
    }
    if (static_cast<int>(p.chunk_layers.size()) != chunks || !positive ||
        total != static_cast<int64_t>(model.layers.size())) {
      return InvalidArgument(
          "--stage-layers {}: give {} counts (one per chunk: {} stages x {} virtual), each at "
          "least 1, adding up to the model's {} layers",
          fmt::join(p.chunk_layers, ","), chunks, p.pipeline_stages, p.virtual_stages,
          model.layers.size());
    }
    std::vector<int> chunk_of;
    chunk_of.reserve(model.layers.size());
    for (int c = 0; c < chunks; ++c) {
      chunk_of.insert(chunk_of.end(), static_cast<size_t>(p.chunk_layers[static_cast<size_t>(c)]),
                      c);
    }
    return chunk_of;
  }
  if (chunks <= 1) return std::vector<int>(model.layers.size(), 0);
  std::vector<double> costs = p.layer_costs;
  if (costs.empty()) {
    for (const OpCosts& op : p.layer_op_costs) {
      costs.push_back(op.forward + op.backward + op.weight);
    }
  }
  if (costs.empty()) {
    TESSERA_ASSIGN_OR_RETURN(costs, EstimateLayerCosts(model, p.MicroBatchRows(plan.batch),
                                                       p.RankSeqLen(plan.seq_len), registry));
  }
  return BalancedChunks(costs, chunks);
}

Status CutPipelinePass(PlanState& state) {
  const ParallelConfig& p = state.parallel;
  const ModelSpec& model = state.model;
  TESSERA_ASSIGN_OR_RETURN(std::vector<int> chunks,
                           CutIntoChunks(model, state.plan, state.registry));
  if (p.pipeline_stages > 1 && state.sharding->ShardsUpdate()) {
    // The policy shards each stage's state over its ranks: a stage without parameters has
    // nothing to shard (and no optimizer work), which is a cut to change, not to run.
    for (int stage = 0; stage < p.pipeline_stages; ++stage) {
      int64_t numel = 0;
      for (size_t l = 0; l < model.layers.size(); ++l) {
        if (chunks[l] % p.pipeline_stages == stage) numel += model.layers[l].params.numel();
      }
      if (numel == 0) {
        return InvalidArgument(
            "pipeline stage {} holds no parameters, but ZeRO stage {} shards each stage's "
            "parameters over its {} ranks: use fewer pipeline stages, give the layers costs "
            "that move the cut, or use --zero-stage 0",
            stage, p.zero_stage, p.data_parallel);
      }
    }
  }
  state.step.layer_chunk = std::move(chunks);
  for (size_t l = 0; l < model.layers.size(); ++l) {
    state.step.layer_stage.push_back(state.step.layer_chunk[l] % state.num_stages);
    state.stage_of_name[model.layers[l].name] = state.step.layer_stage.back();
  }
  return Status::Ok();
}

}  // namespace tessera

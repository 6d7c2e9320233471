// The schedule pass: a pipeline schedule (planner/pipeline_schedule.h) as task order. On each
// worker, its layers' forward and backward tasks are chained by control edges in the order
// ScheduleOrder gives its stage (a chunk's forwards in layer order, its backwards in reverse).
// Everything else (gradient sums, reductions, gathers, the optimizer) follows its data.
//
// The settle_reductions pass (ParallelConfig::settle_reductions): each reduction of one
// micro-batch's gradients before the rank's next layer task in its stage's order (the schedule's,
// else the micro-batches one after another), so a rank never computes on with a bucket of its
// waiting for its peers.
#include <algorithm>
#include <optional>
#include <unordered_map>

#include "planner/plan_passes.h"

namespace tessera {

namespace {

// The mean cost of one chunk's F, B (input halves and whole backwards) and W (weight halves)
// for one micro-batch (every layer's over the chunks): measured (ParallelConfig::layer_op_costs),
// else from the op cost model at the tasks' shapes (rank 0, micro-batch 0; in the units of
// EstimateLayerCosts, unit costs when the model cannot price an op).
OpCosts ChunkOpCosts(const PlanState& state, size_t chunk_count) {
  const RankState& rank = state.ranks[0];
  const Graph& graph = state.builder.graph();
  const ParallelConfig& p = state.parallel;
  OpCosts total{0, 0, 0};
  for (size_t l = 0; l < state.num_layers; ++l) {
    if (!p.layer_op_costs.empty()) {  // measured
      // A layer whose backward runs whole (the memory plan's whole_backward) has no W: its B
      // does that work too.
      const bool whole = !rank.weight_task[l][0].valid();
      total.forward += p.layer_op_costs[l].forward;
      total.backward += p.layer_op_costs[l].backward + (whole ? p.layer_op_costs[l].weight : 0);
      total.weight += whole ? 0 : p.layer_op_costs[l].weight;
      continue;
    }
    for (auto [tasks, sum] : {std::pair{&rank.forward_task, &total.forward},
                              std::pair{&rank.backward_task, &total.backward},
                              std::pair{&rank.weight_task, &total.weight}}) {
      const TaskId id = (*tasks)[l][0];
      if (!id.valid()) continue;
      const TaskSpec& task = graph.task(id);
      std::vector<TensorMeta> inputs;
      inputs.reserve(task.inputs.size());
      for (ObjectId input : task.inputs) inputs.push_back(graph.object(input).meta);
      Result<OpCost> cost = state.registry.Cost(task.op, inputs, task.attrs);
      if (!cost.ok()) return OpCosts{1, 1, 1};
      *sum += CostUnits(*cost);
    }
  }
  const double chunks = static_cast<double>(chunk_count);
  return OpCosts{total.forward / chunks, total.backward / chunks, total.weight / chunks};
}

// Rank r's layer tasks of one stage in `order` (each chunk's forwards in layer order, its
// backwards in reverse, a recomputation just before its backward).
std::vector<TaskId> StageTasks(const RankState& rank, const std::vector<PipelineOp>& order,
                               const std::vector<std::vector<size_t>>& chunk_layers) {
  std::vector<TaskId> tasks_in_order;
  auto chain = [&](TaskId task) {
    if (task.valid()) tasks_in_order.push_back(task);
  };
  for (const PipelineOp& op : order) {
    const std::vector<size_t>& layers = chunk_layers[static_cast<size_t>(op.chunk)];
    const size_t micro = static_cast<size_t>(op.micro);
    if (op.kind == PipelineOp::Kind::kForward) {
      for (size_t l : layers) chain(rank.forward_task[l][micro]);
    } else {
      const bool weight = op.kind == PipelineOp::Kind::kWeight;
      const auto& tasks = weight ? rank.weight_task : rank.backward_task;
      for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
        if (!weight) chain(rank.recompute_task[*it][micro]);  // the forward again, just before
        chain(tasks[*it][micro]);
      }
    }
  }
  return tasks_in_order;
}

// Rank r's tasks of one stage chained in `order`.
void ChainStage(PlanState& state, const RankState& rank, const std::vector<PipelineOp>& order,
                const std::vector<std::vector<size_t>>& chunk_layers) {
  const std::vector<TaskId> tasks = StageTasks(rank, order, chunk_layers);
  for (size_t i = 1; i < tasks.size(); ++i) state.builder.AddControlEdge(tasks[i - 1], tasks[i]);
}

// Each chunk's layers, in layer order (the cut's).
std::vector<std::vector<size_t>> ChunkLayers(const PlanState& state) {
  std::vector<std::vector<size_t>> chunk_layers(
      static_cast<size_t>(state.num_stages * state.parallel.virtual_stages));
  for (size_t l = 0; l < state.num_layers; ++l) {
    chunk_layers[static_cast<size_t>(state.step.layer_chunk[l])].push_back(l);
  }
  return chunk_layers;
}

}  // namespace

Status OrderSchedulePass(PlanState& state) {
  const ParallelConfig& p = state.parallel;
  if (state.num_stages == 1 && p.virtual_stages == 1) return Status::Ok();
  const std::vector<std::vector<size_t>> chunk_layers = ChunkLayers(state);
  StepGraph& step = state.step;
  if (SplitsBackward(p.schedule)) step.schedule_costs = ChunkOpCosts(state, chunk_layers.size());
  step.schedule_order = ScheduleOrder(p.schedule, state.num_stages, state.num_micro_batches,
                                      p.virtual_stages, step.schedule_costs);
  for (int r = 0; r < state.num_ranks; ++r) {
    for (const std::vector<PipelineOp>& order : step.schedule_order) {
      ChainStage(state, state.ranks[static_cast<size_t>(r)], order, chunk_layers);
    }
  }
  return Status::Ok();
}

Status SettleReductionsPass(PlanState& state) {
  if (!state.parallel.settle_reductions || state.micro_batch_reductions.empty()) {
    return Status::Ok();
  }
  const std::vector<std::vector<size_t>> chunk_layers = ChunkLayers(state);
  // Each stage's order: the schedule's in a pipeline; else the micro-batches one after another,
  // each one's forward then its backward (what the executor's priorities run).
  std::vector<std::vector<PipelineOp>> orders = state.step.schedule_order;
  if (orders.empty()) {
    std::vector<PipelineOp>& order = orders.emplace_back();
    for (int k = 0; k < state.num_micro_batches; ++k) {
      order.push_back(PipelineOp{PipelineOp::Kind::kForward, 0, k});
      order.push_back(PipelineOp{PipelineOp::Kind::kBackward, 0, k});
      order.push_back(PipelineOp{PipelineOp::Kind::kWeight, 0, k});
    }
  }
  for (int r = 0; r < state.num_ranks; ++r) {
    const RankState& rank = state.ranks[static_cast<size_t>(r)];
    for (const std::vector<PipelineOp>& order : orders) {
      const std::vector<TaskId> tasks = StageTasks(rank, order, chunk_layers);
      std::unordered_map<uint64_t, size_t> position;
      for (size_t i = 0; i < tasks.size(); ++i) position.emplace(tasks[i].value(), i);
      for (const PlanState::MicroBatchReduction& reduction : state.micro_batch_reductions) {
        if (reduction.rank != r) continue;
        const auto micro = static_cast<size_t>(reduction.micro);
        // The last of this stage's tasks that made a gradient the reduction reads: the weight
        // half, else the whole backward.
        std::optional<size_t> last;
        for (size_t l : reduction.groups) {
          const TaskId made = rank.weight_task[l][micro].valid() ? rank.weight_task[l][micro]
                                                                 : rank.backward_task[l][micro];
          const auto at = position.find(made.value());
          if (at != position.end()) last = std::max(last.value_or(0), at->second);
        }
        if (last && *last + 1 < tasks.size()) {
          state.builder.AddControlEdge(reduction.task, tasks[*last + 1]);
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace tessera

// The schedule pass: a pipeline schedule (planner/pipeline_schedule.h) as task order. On each
// worker, its layers' forward and backward tasks are chained by control edges in the order
// ScheduleOrder gives its stage (a chunk's forwards in layer order, its backwards in reverse).
// Everything else (gradient sums, reductions, gathers, the optimizer) follows its data.
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

// Rank r's tasks of one stage chained in `order`.
void ChainStage(PlanState& state, const RankState& rank, const std::vector<PipelineOp>& order,
                const std::vector<std::vector<size_t>>& chunk_layers) {
  TaskId previous;
  auto chain = [&](TaskId task) {
    if (!task.valid()) return;
    if (previous.valid()) state.builder.AddControlEdge(previous, task);
    previous = task;
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
}

}  // namespace

Status OrderSchedulePass(PlanState& state) {
  const ParallelConfig& p = state.parallel;
  if (state.num_stages == 1 && p.virtual_stages == 1) return Status::Ok();
  std::vector<std::vector<size_t>> chunk_layers(
      static_cast<size_t>(state.num_stages * p.virtual_stages));
  for (size_t l = 0; l < state.num_layers; ++l) {
    chunk_layers[static_cast<size_t>(state.step.layer_chunk[l])].push_back(l);
  }
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

}  // namespace tessera

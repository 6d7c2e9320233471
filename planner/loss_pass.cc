// The loss pass: the mean loss over the global batch. Each rank's micro-batch losses (each a
// mean over its rows) are summed and scaled by 1 / (ranks x micro-batches) on the loss layer's
// stage, then summed over the data-parallel ranks (all-reduce); rank 0's is the graph's output.
// Tensor ranks compute the same loss (the split layers' sums are all-reduced before the loss
// layer reads them), so each tensor rank's data-parallel ranks sum theirs.
#include "planner/plan_passes.h"

namespace tessera {

Status AddLossPass(PlanState& state) {
  const int splits = state.num_data_ranks * state.num_micro_batches;
  for (int r = 0; r < state.num_ranks; ++r) {
    const RankState& rank = state.ranks[static_cast<size_t>(r)];
    ObjectId loss = rank.losses[0];
    if (splits > 1) {
      TESSERA_ASSIGN_OR_RETURN(
          auto sum, state.builder.AddTask(
                        state.Name(r, "loss/sum"), "sum_scalars", rank.losses,
                        Attrs{{"scale", 1.0 / static_cast<double>(splits)}},
                        state.OnStage(r, state.LossStage(), "", kOptimizerPriority,
                                      {state.Name(r, "loss_part")}, {ObjectRole::kOutput})));
      loss = sum[0];
    }
    if (state.num_data_ranks > 1) {
      TESSERA_ASSIGN_OR_RETURN(
          auto total,
          state.builder.AddTask(state.Name(r, "loss/all_reduce"), "all_reduce", {loss},
                                state.DataCollective("loss", r).Set("reduce", "sum"),
                                state.OnStage(r, state.LossStage(), "", kOptimizerPriority,
                                              {state.Name(r, "loss")}, {ObjectRole::kOutput})));
      loss = total[0];
    }
    if (r == 0) state.step.loss = loss;
  }
  state.builder.MarkOutput(state.step.loss);
  return Status::Ok();
}

}  // namespace tessera

// The reductions pass: what the sharding policy reduces only after every rank's whole backward
// (ZeRO-1's reduce-scatters), then each rank's final gradients recorded in StepGraph::grads.
#include "planner/plan_passes.h"

namespace tessera {

Status ReduceGradientsPass(PlanState& state) {
  TESSERA_RETURN_IF_ERROR(state.sharding->ReduceAfterBackward(state));
  for (int r = 0; r < state.num_ranks; ++r) {
    const RankState& rank = state.ranks[static_cast<size_t>(r)];
    for (size_t l = 0; l < state.num_layers; ++l) {
      if (!state.HasParams(l)) continue;
      state.step.grads.push_back(GradientObject{state.UpdatePiece(l, r), rank.grad[l]});
    }
  }
  return Status::Ok();
}

}  // namespace tessera

// The clipping pass: global-norm clipping. Each worker sums the squares of the gradient pieces
// it holds. Sharded gradients (the sharding policy's ShardsUpdate): the sums of every worker
// (every rank of every stage) are all-reduced. Replicated ones: every rank holds all of its
// stages' gradients, so the sums of one rank's stages are all-reduced among them (nothing to
// reduce on one worker). Each stage's worker gets its own clipping factor.
#include <algorithm>
#include <vector>

#include <fmt/format.h>

#include "core/collective_task.h"

#include "planner/plan_passes.h"

namespace tessera {

namespace {

// Tensor parallelism: what rank r counts of layer l's gradient piece (attribute "ranges" of
// sum_of_squares, in the piece's elements), so that each element of the whole model's gradient
// is counted once: tensor rank 0 counts all of it, the others their slices but not the
// replicated slots (every tensor rank holds the same gradient of those). Empty: all of it.
std::vector<int64_t> CountedRanges(const PlanState& state, int r, size_t l) {
  const LayerSpec& layer = state.model.layers[l];
  if (state.TensorRank(r) == 0 || !layer.tensor_parallel) return {};
  const GroupPiece piece = state.UpdatePiece(l, r);
  const int64_t end = piece.begin + piece.numel;
  std::vector<int64_t> ranges;
  bool all = true;
  int64_t covered_to = piece.begin;
  const auto& slots = layer.params.slots();
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t first = std::max(slots[i].offset, piece.begin);
    const int64_t last = std::min(slots[i].offset + slots[i].shape.numel(), end);
    if (first >= last) continue;
    if (layer.tensor_parallel->slots[i].replicated()) {
      all = false;
      continue;
    }
    all = all && first == covered_to;
    covered_to = last;
    ranges.push_back(first - piece.begin);
    ranges.push_back(last - piece.begin);
  }
  if (all && covered_to == end) return {};
  if (ranges.empty()) ranges = {0, 0};
  return ranges;
}

// The squares of the gradients rank r's worker of stage s holds: per group (clip_scale sums
// them) or, where several workers hold parts of the gradients, their all-reduced sum.
Result<std::vector<ObjectId>> SquaredNorms(PlanState& state, int r, int s) {
  RankState& rank = state.ranks[static_cast<size_t>(r)];
  std::vector<ObjectId> sums;
  // Under parameter offload a gradient goes to the host as soon as it is complete: its square
  // is summed at once too, so that the device frees it then, not after the whole backward.
  for (size_t l = 0; l < state.num_layers; ++l) {
    if (!state.HasParams(l) || state.StageOf(l) != s) continue;
    const int32_t priority = state.HostParams(l) ? kBackwardPriority + 1 : kOptimizerPriority;
    Attrs attrs;
    if (std::vector<int64_t> ranges = CountedRanges(state, r, l); !ranges.empty()) {
      attrs.Set("ranges", std::move(ranges));
    }
    TESSERA_ASSIGN_OR_RETURN(
        auto sum, state.builder.AddTask(state.Name(r, state.LayerName(l) + "/grad_norm"),
                                        "sum_of_squares", {rank.grad[l]}, std::move(attrs),
                                        state.On(r, state.LayerName(l), priority)));
    sums.push_back(sum[0]);
  }
  if (sums.empty()) {  // a stage without parameters adds nothing
    TESSERA_ASSIGN_OR_RETURN(
        sums,
        state.builder.AddTask(state.Name(r, state.Staged(s, "grad_norm/none")), "constant", {},
                              Attrs{{"value", 0.0}}, state.OnStage(r, s, "", kOptimizerPriority)));
  }
  // Sharded: every worker's sums. Else each data-parallel rank holds all the gradients of its
  // tensor ranks' slices: theirs over its stages.
  const bool sharded = state.sharding->ShardsUpdate();
  const int members =
      sharded ? state.num_ranks * state.num_stages : state.tensor_parallel * state.num_stages;
  if (members == 1) return sums;
  TESSERA_ASSIGN_OR_RETURN(
      auto local,
      state.builder.AddTask(state.Name(r, state.Staged(s, "grad_norm/sum")), "sum_scalars", sums,
                            {}, state.OnStage(r, s, "", kOptimizerPriority)));
  const std::string collective =
      sharded ? std::string("grad_norm") : fmt::format("grad_norm@rank{}", state.DataRank(r));
  const int member =
      sharded ? s * state.num_ranks + r : s * state.tensor_parallel + state.TensorRank(r);
  TESSERA_ASSIGN_OR_RETURN(
      auto total, state.builder.AddTask(state.Name(r, state.Staged(s, "grad_norm/all_reduce")),
                                        "all_reduce", {local[0]},
                                        Attrs{{kCollectiveAttr, state.CollectiveId(collective)},
                                              {kRankAttr, int64_t{member}},
                                              {kGroupSizeAttr, int64_t{members}},
                                              {"reduce", "sum"}},
                                        state.OnStage(r, s, "", kOptimizerPriority)));
  return std::vector<ObjectId>{total[0]};
}

}  // namespace

Status ClipGradientsPass(PlanState& state) {
  const double max_norm = state.plan.optimizer.max_grad_norm;
  const Attrs clip_attrs{{"max_norm", max_norm}};
  for (int r = 0; r < state.num_ranks; ++r) {
    RankState& rank = state.ranks[static_cast<size_t>(r)];
    rank.clip.assign(static_cast<size_t>(state.num_stages), ObjectId());
    for (int s = 0; s < state.num_stages; ++s) {
      TESSERA_ASSIGN_OR_RETURN(std::vector<ObjectId> squares, SquaredNorms(state, r, s));
      TESSERA_ASSIGN_OR_RETURN(
          auto clip, state.builder.AddTask(
                         state.Name(r, state.Staged(s, "clip")), "clip_scale", squares, clip_attrs,
                         state.OnStage(r, s, "", kOptimizerPriority,
                                       {state.Name(r, state.Staged(s, "clip_scale")),
                                        state.Name(r, state.Staged(s, "grad_norm"))},
                                       {ObjectRole::kOutput, ObjectRole::kOutput})));
      rank.clip[static_cast<size_t>(s)] = clip[0];
      if (max_norm <= 0) {
        // Clipping off: the factor is 1, known now, so each update waits only for its own
        // gradient and runs during the remaining backward (the norm is still reported).
        TESSERA_ASSIGN_OR_RETURN(
            auto one,
            state.builder.AddTask(state.Name(r, state.Staged(s, "clip_off")), "constant", {},
                                  Attrs{{"value", 1.0}},
                                  state.OnOptimizerDevice(state.OnStage(
                                      r, s, "", kOptimizerPriority,
                                      {state.Name(r, state.Staged(s, "clip_scale_one"))}))));
        rank.clip[static_cast<size_t>(s)] = one[0];
      }
      if (r == 0 && s == 0) {
        state.step.grad_norm = clip[1];
        state.builder.MarkOutput(state.step.grad_norm);
      }
    }
  }
  return Status::Ok();
}

}  // namespace tessera

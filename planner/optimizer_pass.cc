// The optimizer pass: per rank, per group it holds, the update (AdamW or SGD, in place) of the
// piece the sharding policy gives it, then what makes the next step's parameters of it: the
// upload of the host master piece (offload), and the policy's gather of the updated shards.
//
// The update writes its target in place: the host master piece under a host update, else the
// parameters. Where the target and the optimizer state are pieces of different sizes (a shard
// of the state inside full parameters: ZeRO-1/2), AdamW addresses the parameters at
// param_offset; where both are the same shard, element_offset places the shard in the group
// (decay ranges stay in group coordinates).
#include "ops/flat_layout.h"
#include "planner/plan_passes.h"

namespace tessera {

namespace {

// After layer l's update on rank r: the next step's parameters, marked as graph outputs.
Status FinishUpdate(PlanState& state, int r, size_t l) {
  const RankState& rank = state.ranks[static_cast<size_t>(r)];
  const ShardingPolicy& sharding = *state.sharding;
  StateObject& param = state.step.state[rank.param[l]];
  if (rank.master[l] != kNoState) {
    const StateObject& master = state.step.state[rank.master[l]];
    state.builder.MarkOutput(master.output);
    TESSERA_ASSIGN_OR_RETURN(param.output, UploadParameters(state, r, l, master.output));
    if (sharding.GathersUpdatedParameters()) {
      TESSERA_ASSIGN_OR_RETURN(param.output, sharding.GatherUpdatedParameters(
                                                 state, r, l, param.output, /*in_place=*/false));
    }
  } else if (sharding.GathersUpdatedParameters()) {
    // Every rank updated its shard inside its full copy: exchange the shards in place.
    TESSERA_ASSIGN_OR_RETURN(param.output, sharding.GatherUpdatedParameters(
                                               state, r, l, param.output, /*in_place=*/true));
  }
  state.builder.MarkOutput(param.output);
  return Status::Ok();
}

// Layer l's AdamW update on rank r; returns the task.
Result<TaskId> AddAdamW(PlanState& state, int r, size_t l, StateObject& target) {
  const RankState& rank = state.ranks[static_cast<size_t>(r)];
  const OptimizerConfig& o = state.plan.optimizer;
  const std::string& layer = state.LayerName(l);
  const int64_t full = state.step.group_numel[l];
  StateObject& exp_avg = state.step.state[rank.exp_avg[l]];
  StateObject& exp_avg_sq = state.step.state[rank.exp_avg_sq[l]];
  Attrs attrs{{"beta1", o.beta1},
              {"beta2", o.beta2},
              {"eps", o.eps},
              {"weight_decay", o.weight_decay},
              {"decay_ranges", state.model.layers[l].params.DecayRanges()}};
  const bool state_shard = exp_avg.piece.numel != full;
  const bool target_shard = target.piece.numel != full;
  if (state_shard && !target_shard) attrs.Set("param_offset", exp_avg.piece.begin);
  if (state_shard && target_shard) attrs.Set("element_offset", exp_avg.piece.begin);
  const std::string target_name = std::string(".") + StateKindName(target.kind);
  const std::string state_suffix = state_shard ? "[shard]" : "";
  TESSERA_ASSIGN_OR_RETURN(
      auto updated,
      state.builder.AddTask(
          state.Name(r, layer + "/adamw"), "adamw",
          {target.input, rank.update_grad[l], exp_avg.input, exp_avg_sq.input,
           rank.update_clip[static_cast<size_t>(state.StageOf(l))], state.step.lr, state.step.step},
          std::move(attrs),
          state.OnOptimizerDevice(
              r, layer,
              {state.Name(r, layer + target_name + (target_shard ? "[shard]" : "") + ".next"),
               state.Name(r, layer + ".exp_avg" + state_suffix + ".next"),
               state.Name(r, layer + ".exp_avg_sq" + state_suffix + ".next")},
              {ObjectRole::kParameter, ObjectRole::kOptimizerState, ObjectRole::kOptimizerState})));
  target.output = updated[0];
  exp_avg.output = updated[1];
  exp_avg_sq.output = updated[2];
  state.builder.MarkOutput(exp_avg.output);
  state.builder.MarkOutput(exp_avg_sq.output);
  return state.ProducerOf(updated[0]);
}

// Layer l's SGD update on rank r; returns the task.
Result<TaskId> AddSgd(PlanState& state, int r, size_t l, StateObject& target) {
  const RankState& rank = state.ranks[static_cast<size_t>(r)];
  const std::string& layer = state.LayerName(l);
  TESSERA_ASSIGN_OR_RETURN(
      auto updated,
      state.builder.AddTask(
          state.Name(r, layer + "/sgd"), "sgd",
          {target.input, rank.update_grad[l],
           rank.update_clip[static_cast<size_t>(state.StageOf(l))], state.step.lr},
          Attrs{{"weight_decay", state.plan.optimizer.weight_decay}},
          state.OnOptimizerDevice(
              r, layer, {state.Name(r, layer + "." + StateKindName(target.kind) + ".next")},
              {ObjectRole::kParameter})));
  target.output = updated[0];
  return state.ProducerOf(updated[0]);
}

Status UpdateRank(PlanState& state, int r) {
  const RankState& rank = state.ranks[static_cast<size_t>(r)];
  // Per stage (one worker): the update tasks so far, in layer order.
  std::vector<std::vector<TaskId>> stage_updates(static_cast<size_t>(state.num_stages));
  for (size_t l = 0; l < state.num_layers; ++l) {
    if (!state.HasParams(l)) continue;
    std::vector<TaskId>& updates = stage_updates[static_cast<size_t>(state.StageOf(l))];
    LimitDownloadsInFlight(state, r, l, updates);
    StateObject& target =
        state.step.state[rank.master[l] != kNoState ? rank.master[l] : rank.param[l]];
    TESSERA_ASSIGN_OR_RETURN(
        TaskId update, state.adamw ? AddAdamW(state, r, l, target) : AddSgd(state, r, l, target));
    updates.push_back(update);
    TESSERA_RETURN_IF_ERROR(FinishUpdate(state, r, l));
  }
  return Status::Ok();
}

}  // namespace

Status UpdateOptimizerPass(PlanState& state) {
  for (int r = 0; r < state.num_ranks; ++r) TESSERA_RETURN_IF_ERROR(UpdateRank(state, r));
  return Status::Ok();
}

}  // namespace tessera

// The optimizer pass: per rank, per group it holds, the update (AdamW, 1-bit or 0/1 Adam or SGD, in
// place) of the piece the sharding policy gives it, then what makes the next step's parameters of
// it: the upload of the host master piece (offload), and the policy's gather of the updated shards.
//
// The update writes its target in place: the host master piece under a host update, else the
// parameters. Where the target and the optimizer state are pieces of different sizes (a shard
// of the state inside full parameters: ZeRO-1/2), AdamW addresses the parameters at
// param_offset; where both are the same shard, element_offset places the shard in the group
// (decay ranges stay in group coordinates).
#include "core/collective_task.h"
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

// An update's outputs (the target, then both moments) as the next step's state; returns the
// update's task.
Result<TaskId> TakeMomentsUpdate(PlanState& state, const std::vector<ObjectId>& updated,
                                 StateObject& target, StateObject& exp_avg,
                                 StateObject& exp_avg_sq) {
  target.output = updated[0];
  exp_avg.output = updated[1];
  exp_avg_sq.output = updated[2];
  state.builder.MarkOutput(exp_avg.output);
  state.builder.MarkOutput(exp_avg_sq.output);
  return state.ProducerOf(updated[0]);
}

// Where an update's piece of state (`state_piece`) sits in its target's: a shard of the state
// inside full parameters (ZeRO-1/2) is addressed at param_offset; a shard of both at once is
// placed in the group by element_offset (decay ranges stay in group coordinates). Returns
// whether the state piece is a shard.
bool SetShardOffsets(Attrs& attrs, const StateObject& state_piece, const StateObject& target,
                     int64_t group_numel) {
  const bool state_shard = state_piece.piece.numel != group_numel;
  const bool target_shard = target.piece.numel != group_numel;
  if (state_shard && !target_shard) attrs.Set("param_offset", state_piece.piece.begin);
  if (state_shard && target_shard) attrs.Set("element_offset", state_piece.piece.begin);
  return state_shard;
}

// An update's hyper-parameters (AdamW's and 1-bit Adam's) and layer l's weight-decayed elements.
Attrs AdamAttrs(const PlanState& state, size_t l) {
  const OptimizerConfig& o = state.plan.optimizer;
  return Attrs{{"beta1", o.beta1},
               {"beta2", o.beta2},
               {"eps", o.eps},
               {"weight_decay", o.weight_decay},
               {"decay_ranges", state.model.layers[l].params.DecayRanges()}};
}

// Layer l's AdamW update on rank r; returns the task.
Result<TaskId> AddAdamW(PlanState& state, int r, size_t l, StateObject& target) {
  const RankState& rank = state.ranks[static_cast<size_t>(r)];
  const std::string& layer = state.LayerName(l);
  const int64_t full = state.step.group_numel[l];
  StateObject& exp_avg = state.step.state[rank.exp_avg[l]];
  StateObject& exp_avg_sq = state.step.state[rank.exp_avg_sq[l]];
  Attrs attrs = AdamAttrs(state, l);
  const bool state_shard = SetShardOffsets(attrs, exp_avg, target, full);
  const bool target_shard = target.piece.numel != full;
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
  return TakeMomentsUpdate(state, updated, target, exp_avg, exp_avg_sq);
}

// Layer l's `x` on rank r averaged over the data ranks by a compressed all-reduce with the
// rank's error buffers (their next values taken as this step's): the average, as `averaged`.
Result<ObjectId> AddCompressedAllReduce(PlanState& state, int r, size_t l, ObjectId x,
                                        const std::string& averaged) {
  const RankState& rank = state.ranks[static_cast<size_t>(r)];
  const std::string& layer = state.LayerName(l);
  StateObject& worker_error = state.step.state[rank.worker_error[l]];
  StateObject& server_error = state.step.state[rank.server_error[l]];
  const std::string name = layer + "/compressed_all_reduce";
  TESSERA_ASSIGN_OR_RETURN(
      auto reduced,
      state.builder.AddTask(
          state.Name(r, name), "compressed_all_reduce", {x, worker_error.input, server_error.input},
          state.DataCollective(name, r).Set(kCompressedCountAttr,
                                            state.model.layers[l].params.numel()),
          state.OnOptimizerDevice(
              r, layer,
              {state.Name(r, layer + averaged), state.Name(r, layer + ".worker_error.next"),
               state.Name(r, layer + ".server_error.next")},
              {ObjectRole::kOptimizerState, ObjectRole::kOptimizerState,
               ObjectRole::kOptimizerState})));
  worker_error.output = reduced[1];
  server_error.output = reduced[2];
  state.builder.MarkOutput(worker_error.output);
  state.builder.MarkOutput(server_error.output);
  return reduced[0];
}

// What every 1-bit Adam update of layer l on rank r addresses: its moments, its attributes
// (shard offsets set) and the names of the updated target and of the variance's piece.
struct OneBitUpdate {
  OneBitUpdate(PlanState& state, int r, size_t l, const StateObject& target)
      : rank(state.ranks[static_cast<size_t>(r)]),
        layer(state.LayerName(l)),
        exp_avg(state.step.state[rank.exp_avg[l]]),
        exp_avg_sq(state.step.state[rank.exp_avg_sq[l]]),
        attrs(AdamAttrs(state, l)),
        next(std::string(".") + StateKindName(target.kind) + ".next"),
        shard(SetShardOffsets(attrs, exp_avg_sq, target, state.step.group_numel[l]) ? "[shard]"
                                                                                    : ""),
        clip(rank.update_clip[static_cast<size_t>(state.StageOf(l))]) {}
  const RankState& rank;
  const std::string& layer;
  StateObject& exp_avg;
  StateObject& exp_avg_sq;
  Attrs attrs;
  const std::string next;
  const std::string shard;  // "[shard]" when the moments are a shard of the group
  const ObjectId clip;
};

// Layer l's 1-bit Adam warm-up update on rank r (0/1 Adam's variance step too): onebit_adam on
// the (reduced) gradient, of the rank's shard under ZeRO-1/2; returns the task.
Result<TaskId> AddOneBitAdamWarmup(PlanState& state, int r, size_t l, StateObject& target) {
  OneBitUpdate u(state, r, l, target);
  TESSERA_ASSIGN_OR_RETURN(
      auto updated,
      state.builder.AddTask(
          state.Name(r, u.layer + "/onebit_adam"), "onebit_adam",
          {target.input, u.rank.update_grad[l], u.exp_avg.input, u.exp_avg_sq.input, u.clip,
           state.step.lr},
          std::move(u.attrs),
          state.OnOptimizerDevice(
              r, u.layer,
              {state.Name(r, u.layer + u.next),
               state.Name(r, u.layer + ".exp_avg" + u.shard + ".next"),
               state.Name(r, u.layer + ".exp_avg_sq" + u.shard + ".next")},
              {ObjectRole::kParameter, ObjectRole::kOptimizerState, ObjectRole::kOptimizerState})));
  return TakeMomentsUpdate(state, updated, target, u.exp_avg, u.exp_avg_sq);
}

// Layer l's 1-bit Adam update on rank r; returns the task (the last of several in the
// compressed phase). The warm-up: AddOneBitAdamWarmup. The compressed phase: this rank's whole
// momentum from its own gradient, averaged over the data ranks by a compressed all-reduce with
// the rank's error buffers (none on one rank), then the update with the frozen variance (of the
// rank's shard under ZeRO-1/2; the sharding policy then gathers the updated shards).
Result<TaskId> AddOneBitAdam(PlanState& state, int r, size_t l, StateObject& target) {
  if (!state.plan.optimizer.compressed_phase) return AddOneBitAdamWarmup(state, r, l, target);
  OneBitUpdate u(state, r, l, target);
  TESSERA_ASSIGN_OR_RETURN(
      auto momentum,
      state.builder.AddTask(
          state.Name(r, u.layer + "/onebit_adam_momentum"), "onebit_adam_momentum",
          {u.exp_avg.input, u.rank.update_grad[l], u.clip},
          Attrs{{"beta1", state.plan.optimizer.beta1}},
          state.OnOptimizerDevice(r, u.layer, {state.Name(r, u.layer + ".exp_avg.local")},
                                  {ObjectRole::kOptimizerState})));
  ObjectId averaged = momentum[0];
  if (state.error_feedback) {
    TESSERA_ASSIGN_OR_RETURN(averaged,
                             AddCompressedAllReduce(state, r, l, averaged, ".exp_avg.next"));
  }
  TESSERA_ASSIGN_OR_RETURN(
      auto updated,
      state.builder.AddTask(
          state.Name(r, u.layer + "/onebit_adam_frozen"), "onebit_adam_frozen",
          {target.input, averaged, u.exp_avg_sq.input, state.step.lr}, std::move(u.attrs),
          state.OnOptimizerDevice(r, u.layer,
                                  {state.Name(r, u.layer + u.next),
                                   state.Name(r, u.layer + ".exp_avg_sq" + u.shard + ".next")},
                                  {ObjectRole::kParameter, ObjectRole::kOptimizerState})));
  return TakeMomentsUpdate(state, {updated[0], averaged, updated[1]}, target, u.exp_avg,
                           u.exp_avg_sq);
}

// Layer l's 0/1 Adam update on rank r, of the step OptimizerConfig::zero_one_step says
// (planner/zero_one_adam.h); returns the task (the last of several). Data parallelism only
// (validation): every rank updates its whole group.
//   variance:            AddOneBitAdamWarmup on the all-reduced gradient;
//   compressed-gradient: the rank's gradient times its clipping factor, averaged by the
//                        compressed all-reduce (several ranks), then zero_one_adam_compressed;
//   local:               zero_one_adam_local on the rank's own gradient;
//   sync:                zero_one_adam_local with sync, the ranks' moves since the interval's
//                        start averaged by the compressed all-reduce (several ranks), then
//                        zero_one_adam_sync.
Result<TaskId> AddZeroOneAdam(PlanState& state, int r, size_t l, StateObject& target) {
  using Step = OptimizerConfig::ZeroOneStep;
  if (state.zero_one_step == Step::kVariance) return AddOneBitAdamWarmup(state, r, l, target);
  // Whole groups (validation): u.attrs sets no shard offsets.
  const OneBitUpdate u(state, r, l, target);
  const std::string& layer = u.layer;
  const std::vector<ObjectRole> moments_roles = {
      ObjectRole::kParameter, ObjectRole::kOptimizerState, ObjectRole::kOptimizerState,
      ObjectRole::kOptimizerState};
  if (state.zero_one_step == Step::kCompressedGradient) {
    ObjectId grad = u.rank.update_grad[l];
    if (state.plan.optimizer.max_grad_norm > 0) {
      TESSERA_ASSIGN_OR_RETURN(
          auto clipped,
          state.builder.AddTask(
              state.Name(r, layer + "/clip_gradient"), "scale", {grad, u.clip}, {},
              state.OnOptimizerDevice(r, layer, {state.Name(r, layer + ".grad.clipped")},
                                      {ObjectRole::kGradient})));
      grad = clipped[0];
    }
    if (state.error_feedback) {
      TESSERA_ASSIGN_OR_RETURN(grad, AddCompressedAllReduce(state, r, l, grad, ".grad.averaged"));
    }
    TESSERA_ASSIGN_OR_RETURN(
        auto updated,
        state.builder.AddTask(
            state.Name(r, layer + "/zero_one_adam_compressed"), "zero_one_adam_compressed",
            {target.input, grad, u.exp_avg.input, u.exp_avg_sq.input, state.step.lr}, u.attrs,
            state.OnOptimizerDevice(
                r, layer,
                {state.Name(r, layer + u.next), state.Name(r, layer + ".exp_avg.next"),
                 state.Name(r, layer + ".exp_avg_sq.next")},
                {moments_roles.begin(), moments_roles.end() - 1})));
    return TakeMomentsUpdate(state, updated, target, u.exp_avg, u.exp_avg_sq);
  }
  StateObject& interval_start = state.step.state[u.rank.interval_start[l]];
  const bool sync = state.zero_one_step == Step::kSync;
  const std::string local_suffix = sync ? ".local" : ".next";
  TESSERA_ASSIGN_OR_RETURN(
      auto local, state.builder.AddTask(
                      state.Name(r, layer + "/zero_one_adam_local"), "zero_one_adam_local",
                      {target.input, u.rank.update_grad[l], u.exp_avg.input, u.exp_avg_sq.input,
                       interval_start.input, u.clip, state.step.lr},
                      Attrs(u.attrs).Set("sync", int64_t{sync ? 1 : 0}),
                      state.OnOptimizerDevice(
                          r, layer,
                          {state.Name(r, layer + "." + StateKindName(target.kind) + local_suffix),
                           state.Name(r, layer + ".exp_avg" + local_suffix),
                           state.Name(r, layer + ".exp_avg_sq" + local_suffix),
                           state.Name(r, layer + ".interval_start" + local_suffix)},
                          moments_roles)));
  std::vector<ObjectId> updated = local;
  if (sync) {
    ObjectId averaged = local[3];
    if (state.error_feedback) {
      TESSERA_ASSIGN_OR_RETURN(
          averaged, AddCompressedAllReduce(state, r, l, averaged, ".interval_start.averaged"));
    }
    TESSERA_ASSIGN_OR_RETURN(
        updated, state.builder.AddTask(
                     state.Name(r, layer + "/zero_one_adam_sync"), "zero_one_adam_sync",
                     {local[0], local[1], local[2], averaged, state.step.lr_sum}, u.attrs,
                     state.OnOptimizerDevice(
                         r, layer,
                         {state.Name(r, layer + u.next), state.Name(r, layer + ".exp_avg.next"),
                          state.Name(r, layer + ".exp_avg_sq.next"),
                          state.Name(r, layer + ".interval_start.next")},
                         moments_roles)));
  }
  interval_start.output = updated[3];
  state.builder.MarkOutput(interval_start.output);
  return TakeMomentsUpdate(state, updated, target, u.exp_avg, u.exp_avg_sq);
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
    TESSERA_ASSIGN_OR_RETURN(TaskId update, state.onebit_adam ? AddOneBitAdam(state, r, l, target)
                                            : state.zero_one_adam
                                                ? AddZeroOneAdam(state, r, l, target)
                                            : state.adam_moments ? AddAdamW(state, r, l, target)
                                                                 : AddSgd(state, r, l, target));
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

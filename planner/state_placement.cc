// The state placement pass: the step's inputs and the model state each rank holds, as the
// sharding policy places it.
#include <fmt/format.h>

#include "core/sign_compression.h"
#include "ops/flat_layout.h"
#include "planner/plan_passes.h"

namespace tessera {

namespace {

// Adds a state input for `piece` of layer `piece.layer` on rank `piece.rank`; returns its index
// in StepGraph::state. A piece smaller than the group is a shard: "<layer>.<kind>[shard]".
size_t AddState(PlanState& state, StateKind kind, const GroupPiece& piece, ObjectRole role,
                Device device) {
  std::string name = fmt::format("{}.{}", state.LayerName(piece.layer), StateKindName(kind));
  if (piece.numel != state.step.group_numel[piece.layer]) name += "[shard]";
  StateObject object{.kind = kind, .piece = piece};
  object.input = state.builder.AddInput(state.Name(piece.rank, name),
                                        TensorMeta{Shape{piece.numel}, DType::kF32, device}, role);
  state.step.state.push_back(object);
  return state.step.state.size() - 1;
}

// Rank r's piece of layer l's group that is all of it.
GroupPiece WholeGroup(const PlanState& state, size_t l, int r) {
  return GroupPiece{.layer = l, .rank = r, .begin = 0, .numel = state.step.group_numel[l]};
}

// Rank r's parameters, host master copy (host update) and Adam moments of every group.
void PlaceRankState(PlanState& state, int r) {
  RankState& rank = state.ranks[static_cast<size_t>(r)];
  for (auto* list : {&rank.param, &rank.master, &rank.exp_avg, &rank.exp_avg_sq}) {
    list->assign(state.num_layers, kNoState);
  }
  for (size_t l = 0; l < state.num_layers; ++l) {
    if (!state.HasParams(l)) continue;
    const GroupPiece update = state.UpdatePiece(l, r);
    // Under parameter offload the parameters are the host's and the update's target: the piece
    // a rank keeps is the piece it updates (validation refuses the stages where they differ).
    rank.param[l] =
        AddState(state, StateKind::kParameter, state.ParameterPiece(l, r), ObjectRole::kParameter,
                 state.HostParams(l) ? Device::Cpu() : state.plan.device);
    if (state.host_update && !state.HostParams(l)) {
      rank.master[l] = AddState(state, StateKind::kMasterParameter, update, ObjectRole::kParameter,
                                Device::Cpu());
    }
    if (state.adam_moments) {
      // 1-bit Adam's compressed phase: each rank's momentum is whole (its own gradient's, then
      // the ranks' compressed average), whatever piece it updates.
      rank.exp_avg[l] = AddState(state, StateKind::kExpAvg,
                                 state.compressed_momentum ? WholeGroup(state, l, r) : update,
                                 ObjectRole::kOptimizerState, state.OptimizerDevice());
      rank.exp_avg_sq[l] = AddState(state, StateKind::kExpAvgSq, update,
                                    ObjectRole::kOptimizerState, state.OptimizerDevice());
    }
  }
}

// The per-layer and per-micro-batch lists later passes fill.
void SizeRankState(PlanState& state, RankState& rank) {
  const size_t layers = state.num_layers;
  rank.grad.assign(layers, ObjectId());
  rank.gathered.assign(layers, ObjectId());
  rank.forward_task.assign(layers,
                           std::vector<TaskId>(static_cast<size_t>(state.num_micro_batches)));
  rank.backward_task = rank.forward_task;
  rank.weight_task = rank.forward_task;
  rank.recompute_task = rank.forward_task;
}

}  // namespace

Status PlaceStatePass(PlanState& state) {
  StepGraph& step = state.step;
  const ShardingPolicy& sharding = *state.sharding;
  step.parallel = state.parallel;
  step.micro_batch_rows = state.parallel.MicroBatchRows(state.plan.batch);
  step.gather_once_per_step = sharding.GathersOncePerStep();
  step.gather_reason = sharding.GatherReason();
  // Buckets matter only where gradients are reduced over ranks.
  if (state.num_ranks > 1) step.buckets = ChooseGradientBuckets(state.parallel);
  for (const LayerSpec& layer : state.model.layers) {
    step.group_numel.push_back(PaddedNumel(layer.params.numel(), sharding.GroupMultiple()));
  }
  // Model inputs: per rank, per micro-batch, per input.
  step.inputs.resize(state.model.inputs.size());
  for (int r = 0; r < state.num_ranks; ++r) {
    for (int k = 0; k < state.num_micro_batches; ++k) {
      for (size_t i = 0; i < state.model.inputs.size(); ++i) {
        const ModelInput& input = state.model.inputs[i];
        step.inputs[i].push_back(state.builder.AddInput(
            state.Name(r, state.Micro(k, input.name)),
            input.Meta(step.micro_batch_rows, state.parallel.RankSeqLen(state.plan.seq_len),
                       state.plan.device),
            ObjectRole::kInput));
      }
    }
  }
  step.lr = state.builder.AddInput("lr", TensorMeta{Shape{}, DType::kF32, state.OptimizerDevice()},
                                   ObjectRole::kInput);
  step.step = state.builder.AddInput(
      "step", TensorMeta{Shape{}, DType::kI64, state.OptimizerDevice()}, ObjectRole::kInput);
  if (state.zero_one_adam && state.zero_one_step == OptimizerConfig::ZeroOneStep::kSync) {
    step.lr_sum = state.builder.AddInput(
        "lr_sum", TensorMeta{Shape{}, DType::kF32, state.OptimizerDevice()}, ObjectRole::kInput);
  }
  state.ranks.resize(static_cast<size_t>(state.num_ranks));
  for (int r = 0; r < state.num_ranks; ++r) {
    PlaceRankState(state, r);
    SizeRankState(state, state.ranks[static_cast<size_t>(r)]);
  }
  // 1-bit Adam's compressed phase: every rank's error buffers last, so the warm-up step's state
  // list is this one's with each momentum made whole (the trainer gathers the momentum's shards
  // and starts the errors at zero when it switches). A rank's worker error is as long as its
  // momentum; its server error is its chunk of the group's own elements (under ZeRO, its shard).
  for (int r = 0; r < state.num_ranks && state.error_feedback; ++r) {
    RankState& rank = state.ranks[static_cast<size_t>(r)];
    rank.worker_error.assign(state.num_layers, kNoState);
    rank.server_error.assign(state.num_layers, kNoState);
    for (size_t l = 0; l < state.num_layers; ++l) {
      if (!state.HasParams(l)) continue;
      rank.worker_error[l] = AddState(state, StateKind::kWorkerError, WholeGroup(state, l, r),
                                      ObjectRole::kOptimizerState, state.OptimizerDevice());
      const GroupPiece chunk{
          .layer = l,
          .rank = r,
          .begin = 0,
          .numel = SignChunkElements(state.model.layers[l].params.numel(), state.num_data_ranks)};
      rank.server_error[l] = AddState(state, StateKind::kServerError, chunk,
                                      ObjectRole::kOptimizerState, state.OptimizerDevice());
    }
  }
  // 0/1 Adam's local and sync steps: each rank's parameters at the last sync, whole groups.
  for (int r = 0; r < state.num_ranks && state.takes_local_steps; ++r) {
    RankState& rank = state.ranks[static_cast<size_t>(r)];
    rank.interval_start.assign(state.num_layers, kNoState);
    for (size_t l = 0; l < state.num_layers; ++l) {
      if (!state.HasParams(l)) continue;
      rank.interval_start[l] = AddState(state, StateKind::kIntervalStart, WholeGroup(state, l, r),
                                        ObjectRole::kOptimizerState, state.OptimizerDevice());
    }
  }
  return Status::Ok();
}

}  // namespace tessera

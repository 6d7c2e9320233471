// Offload (ZeRO-Offload) on GPU workers: the update runs on the host, over the host master copy
// and Adam moments that state placement put there. This file adds what moves: each final
// gradient (piece) and the clipping factor down to the host, and each updated master piece back
// up to the GPU as the next step's parameters. On CPU workers (or without offload) the update
// reads the gradients and factors where they are, and nothing is added.
//
// With clipping, a layer's gradient goes down only once the clipping factor exists (every
// gradient is complete then, on the GPU), and at most kGradientsInFlight layers ahead of the
// update that consumes it (LimitDownloadsInFlight): the host holds the optimizer's state and a
// few layers' gradients, not a second copy of every gradient. What that costs is the overlap of
// the downloads with the backward pass, small next to the host's update (ZeRO-Offload's step is
// bound by the host and the link, not the GPU).
//
// Under parameter offload (PlanState::HostParams) the device is the scarce tier: each streamed
// layer's gradient goes down as soon as it is complete, whatever the clipping, and the host holds
// it until its update (the host holds the model state anyway). The parameters' uploads are the
// sharding policy's (UsableParams); nothing is uploaded after the update, which writes the host
// parameters in place. A layer whose parameters stay on the device (ParallelConfig::
// resident_params) is ZeRO-Offload's, as above.
#include "planner/plan_passes.h"

namespace tessera {

namespace {

constexpr size_t kGradientsInFlight = 3;

// Rank r's clipping factors, per stage, copied to the host (the constant 1 without clipping is
// already there).
Status DownloadClipping(PlanState& state, int r) {
  RankState& rank = state.ranks[static_cast<size_t>(r)];
  if (state.plan.optimizer.max_grad_norm <= 0) {
    rank.update_clip = rank.clip;
    return Status::Ok();
  }
  rank.update_clip.assign(static_cast<size_t>(state.num_stages), ObjectId());
  for (int s = 0; s < state.num_stages; ++s) {
    TESSERA_ASSIGN_OR_RETURN(
        auto clip,
        state.builder.AddTask(state.Name(r, state.Staged(s, "clip_to_host")), "copy",
                              {rank.clip[static_cast<size_t>(s)]}, {},
                              state.OnOptimizerDevice(state.OnStage(
                                  r, s, "", kOptimizerPriority,
                                  {state.Name(r, state.Staged(s, "clip_scale.host"))}))));
    rank.update_clip[static_cast<size_t>(s)] = clip[0];
  }
  return Status::Ok();
}

// Rank r's final gradient of every group copied to the host, after the clipping factor.
Status DownloadGradients(PlanState& state, int r) {
  RankState& rank = state.ranks[static_cast<size_t>(r)];
  rank.update_grad.assign(state.num_layers, ObjectId());
  for (size_t l = 0; l < state.num_layers; ++l) {
    if (!state.HasParams(l)) continue;
    const std::string& layer = state.LayerName(l);
    TaskOptions options = state.On(r, layer, kBackwardPriority + 1,
                                   {state.Name(r, layer + ".grad.host")}, {ObjectRole::kGradient});
    options.device_kind = DeviceKind::kCpu;
    TESSERA_ASSIGN_OR_RETURN(auto host,
                             state.builder.AddTask(state.Name(r, layer + "/grad_to_host"), "copy",
                                                   {rank.grad[l]}, {}, std::move(options)));
    rank.update_grad[l] = host[0];
    if (state.plan.optimizer.max_grad_norm > 0 && !state.HostParams(l)) {
      const ObjectId clip = rank.update_clip[static_cast<size_t>(state.StageOf(l))];
      state.builder.AddControlEdge(state.ProducerOf(clip), state.ProducerOf(host[0]));
    }
  }
  return Status::Ok();
}

}  // namespace

Status OffloadDownloadsPass(PlanState& state) {
  for (int r = 0; r < state.num_ranks; ++r) {
    RankState& rank = state.ranks[static_cast<size_t>(r)];
    if (!state.host_update) {
      rank.update_grad = rank.grad;
      rank.update_clip = rank.clip;
      continue;
    }
    TESSERA_RETURN_IF_ERROR(DownloadClipping(state, r));
    TESSERA_RETURN_IF_ERROR(DownloadGradients(state, r));
  }
  return Status::Ok();
}

void LimitDownloadsInFlight(PlanState& state, int r, size_t l,
                            const std::vector<TaskId>& stage_updates) {
  if (!state.host_update || state.HostParams(l) || stage_updates.size() < kGradientsInFlight) {
    return;
  }
  const RankState& rank = state.ranks[static_cast<size_t>(r)];
  state.builder.AddControlEdge(stage_updates[stage_updates.size() - kGradientsInFlight],
                               state.ProducerOf(rank.update_grad[l]));
}

Result<ObjectId> UploadParameters(PlanState& state, int r, size_t l, ObjectId master) {
  const RankState& rank = state.ranks[static_cast<size_t>(r)];
  const std::string& layer = state.LayerName(l);
  const bool shard = state.step.state[rank.master[l]].piece.numel != state.step.group_numel[l];
  // Gathered after (stages 1-2): the uploaded shard is not yet the next step's parameters.
  const bool gathered = state.sharding->GathersUpdatedParameters();
  const std::string name = layer + ".params" + (shard ? "[shard]" : "") + (gathered ? "" : ".next");
  TESSERA_ASSIGN_OR_RETURN(
      auto uploaded,
      state.builder.AddTask(
          state.Name(r, layer + "/params_to_device"), "copy", {master}, {},
          state.On(r, layer, kOptimizerPriority, {state.Name(r, name)}, {ObjectRole::kParameter})));
  return uploaded[0];
}

}  // namespace tessera

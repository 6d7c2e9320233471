// The four sharding policies, one class per stage. The collectives they share (a gradient
// reduce-scatter, the gather of updated shards) are the helpers above them; ZeRO-1 and ZeRO-2,
// which differ only in when gradients are reduce-scattered, share ShardedUpdatePolicy's answers.
#include "planner/sharding_policy.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include <fmt/format.h>

#include "core/collective_task.h"
#include "planner/plan_state.h"

namespace tessera {

namespace {

GroupPiece FullPiece(size_t l, int r, int64_t group_numel) {
  return GroupPiece{l, r, 0, group_numel};
}

// Shard r of a group padded to a multiple of the ranks.
GroupPiece ShardPiece(size_t l, int r, int64_t group_numel, int ranks) {
  const int64_t shard = group_numel / ranks;
  return GroupPiece{l, r, r * shard, shard};
}

// The parameters rank r keeps of `group` between steps (this step's value).
ObjectId HeldParams(const PlanState& state, int r, size_t group) {
  return state.step.state[state.ranks[static_cast<size_t>(r)].param[group]].input;
}

// What a use of parameters is named for: the loss layer's reads, and a tied group's, are named
// for their reader (the loss layer's serve its backward too: it follows at once).
std::string ForwardUseName(const PlanState& state, const ParamUse& use) {
  const LayerSpec& reader = state.model.layers[use.reader];
  const std::string when = reader.loss || use.group != use.reader ? reader.name : "forward";
  return state.Micro(use.micro, when);
}
std::string BackwardUseName(const PlanState& state, const ParamUse& use) {
  const std::string when =
      use.group == use.reader ? "backward" : state.LayerName(use.reader) + "_backward";
  return state.Micro(use.micro, when);
}

// The parameters rank r holds of the use's group, where the use can read them. Under parameter
// offload (PlanState::HostParams) they live in the host tier, and the use reads a copy on the
// device made for it ("<group>/upload_<when>", a transient parameter freed after its readers, on
// the group's stage as a ZeRO-3 gather) once `use.after` exists there: at most prefetch_layers
// layers' copies are made ahead of their use. Otherwise what is held.
Result<ObjectId> UsableParams(PlanState& state, const ParamUse& use, const std::string& when) {
  const ObjectId held = HeldParams(state, use.rank, use.group);
  if (!state.HostParams(use.group)) return held;
  const std::string& group = state.LayerName(use.group);
  const std::string name = fmt::format("{}/upload_{}", group, when);
  TESSERA_ASSIGN_OR_RETURN(auto uploaded,
                           state.builder.AddTask(state.Name(use.rank, name), "copy", {held}, {},
                                                 state.On(use.rank, group, kForwardPriority + 1,
                                                          {state.Name(use.rank, name + ":params")},
                                                          {ObjectRole::kGatheredParameter})));
  if (use.after.valid() && state.ProducedOnStage(use.after, state.StageOf(use.group))) {
    state.builder.AddControlEdge(state.ProducerOf(use.after), state.ProducerOf(uploaded[0]));
  }
  return uploaded[0];
}

// A gradient reduce-scatter's or parameter gather's attributes, block-quantized where the plan
// asks (ParallelConfig::quantize_bits: ZeRO-3 only, validation says).
Attrs QuantizedWhenAsked(const PlanState& state, Attrs attrs) {
  if (state.parallel.quantize_bits > 0) {
    attrs.Set(kQuantizeBitsAttr, int64_t{state.parallel.quantize_bits});
  }
  return attrs;
}

// Rank r's member of the reduce-scatter of layer l's full gradient from micro-batch k: its
// shard of the sum over the ranks.
Result<ObjectId> ReduceScatterMicroBatch(PlanState& state, int r, int k, size_t l, ObjectId full) {
  const std::string& layer = state.LayerName(l);
  const std::string name = state.Micro(k, layer + "/reduce_scatter");
  TESSERA_ASSIGN_OR_RETURN(
      auto shard, state.builder.AddTask(
                      state.Name(r, name), "reduce_scatter", {full},
                      QuantizedWhenAsked(state, state.DataCollective(name, r).Set("reduce", "sum")),
                      state.On(r, layer, kBackwardPriority + 1,
                               {state.Name(r, state.Micro(k, layer + ".grad[shard]"))},
                               {ObjectRole::kGradient})));
  state.micro_batch_reductions.push_back({r, k, state.ProducerOf(shard[0]), {l}});
  return shard[0];
}

// Rank r's member of the gather of layer l's updated parameter shards (`op`: all_gather, or
// all_gather_in_place inside the full parameters); returns "<layer>.params<suffix>".
Result<ObjectId> GatherShards(PlanState& state, int r, size_t l, const char* op, ObjectId input,
                              const char* suffix) {
  const std::string& layer = state.LayerName(l);
  const std::string name = layer + "/all_gather";
  TESSERA_ASSIGN_OR_RETURN(
      auto gathered,
      state.builder.AddTask(
          state.Name(r, name), op, {input}, state.DataCollective(name, r),
          state.On(r, layer, kOptimizerPriority, {state.Name(r, layer + ".params" + suffix)},
                   {ObjectRole::kParameter})));
  return gathered[0];
}

// Stages 1-2: every rank's updated shard all-gathered into the full parameters, in place inside
// the parameters the update wrote its shard into, or from the shard uploaded from the host.
Result<ObjectId> GatherUpdatedShards(PlanState& state, int r, size_t l, ObjectId params,
                                     bool in_place) {
  return in_place ? GatherShards(state, r, l, "all_gather_in_place", params, ".gathered")
                  : GatherShards(state, r, l, "all_gather", params, ".next");
}

// Rank r's member of one collective `op` over a bucket of groups: their gradients packed (shard
// by shard over `shards`: 1 for an all-reduce, the ranks for a reduce-scatter), reduced, and split
// into one object per group named "<layer><suffix>" (with micro-batch k's suffix when k >= 0).
Result<std::vector<ObjectId>> FusedReduction(PlanState& state, int r, int k,
                                             const std::vector<size_t>& groups,
                                             const std::vector<ObjectId>& grads, const char* op,
                                             int64_t shards, const char* suffix) {
  const auto micro = [&](const std::string& name) { return k >= 0 ? state.Micro(k, name) : name; };
  const std::string& first = state.LayerName(groups.front());
  const std::string bucket = first + "~" + state.LayerName(groups.back());
  const int32_t priority = kBackwardPriority + 1;
  TESSERA_ASSIGN_OR_RETURN(
      auto packed,
      state.builder.AddTask(state.Name(r, micro(bucket + "/pack")), "pack_shards", grads,
                            Attrs{{"ranks", shards}},
                            state.On(r, first, priority, {state.Name(r, micro(bucket + ".grads"))},
                                     {ObjectRole::kGradientBucket})));
  const std::string name = micro(bucket + "/" + op);
  Attrs attrs = state.DataCollective(name, r).Set("reduce", "sum");
  if (shards > 1) attrs = QuantizedWhenAsked(state, std::move(attrs));  // a reduce-scatter
  TESSERA_ASSIGN_OR_RETURN(
      auto reduced,
      state.builder.AddTask(
          state.Name(r, name), op, {packed[0]}, std::move(attrs),
          state.On(r, first, priority, {state.Name(r, micro(bucket + ".grads_reduced"))},
                   {ObjectRole::kGradientBucket})));
  if (k >= 0) state.micro_batch_reductions.push_back({r, k, state.ProducerOf(reduced[0]), groups});
  std::vector<int64_t> sizes;
  std::vector<std::string> names;
  for (size_t i = 0; i < groups.size(); ++i) {
    sizes.push_back(state.builder.graph().object(grads[i]).meta.numel() / shards);
    names.push_back(state.Name(r, micro(state.LayerName(groups[i]) + suffix)));
  }
  std::vector<ObjectRole> roles(groups.size(), ObjectRole::kGradient);
  TESSERA_ASSIGN_OR_RETURN(
      auto pieces,
      state.builder.AddTask(state.Name(r, micro(bucket + "/split")), "split", {reduced[0]},
                            Attrs{{"sizes", sizes}}, state.On(r, first, priority, names, roles)));
  if (r == 0) ++state.step.fused_reductions;
  return pieces;
}

// Stages 2-3: micro-batch k's reduce-scatter of a bucket of groups' full gradients.
Result<std::vector<ObjectId>> ReduceScatterBucket(PlanState& state, int r, int k,
                                                  const std::vector<size_t>& groups,
                                                  const std::vector<ObjectId>& fulls, int ranks) {
  if (groups.size() == 1) {
    TESSERA_ASSIGN_OR_RETURN(ObjectId shard,
                             ReduceScatterMicroBatch(state, r, k, groups[0], fulls[0]));
    return std::vector<ObjectId>{shard};
  }
  return FusedReduction(state, r, k, groups, fulls, "reduce_scatter", ranks, ".grad[shard]");
}

// Stage 0 (and any stage over one rank): every rank holds and updates everything; each layer's
// accumulated gradient is all-reduced as soon as its last micro-batch's backward is done.
class DataParallelPolicy final : public ShardingPolicy {
 public:
  explicit DataParallelPolicy(int ranks) : ranks_(ranks) {}

  std::string_view name() const override { return "data parallel"; }
  int64_t GroupMultiple() const override { return 1; }
  GroupPiece ParameterPiece(size_t l, int r, int64_t numel) const override {
    return FullPiece(l, r, numel);
  }
  GroupPiece UpdatePiece(size_t l, int r, int64_t numel) const override {
    return FullPiece(l, r, numel);
  }
  bool ShardsUpdate() const override { return false; }
  Result<ObjectId> ForwardParams(PlanState& state, const ParamUse& use) const override {
    return UsableParams(state, use, ForwardUseName(state, use));
  }
  // What the forward read (the parameters held), or under parameter offload a copy again (the
  // forward's was freed).
  Result<ObjectId> BackwardParams(PlanState& state, const ParamUse& use, ObjectId) const override {
    return UsableParams(state, use, BackwardUseName(state, use));
  }
  ObjectRole FullGradientRole() const override { return ObjectRole::kGradient; }
  Result<ObjectId> ReduceMicroBatchGradient(PlanState&, int, int, size_t,
                                            ObjectId full) const override {
    return full;
  }
  Result<ObjectId> ReduceAccumulatedGradient(PlanState& state, int r, size_t l,
                                             ObjectId grad) const override {
    if (ranks_ == 1) return grad;
    const std::string& layer = state.LayerName(l);
    const std::string name = layer + "/all_reduce";
    TESSERA_ASSIGN_OR_RETURN(
        auto reduced, state.builder.AddTask(state.Name(r, name), "all_reduce", {grad},
                                            state.DataCollective(name, r).Set("reduce", "sum"),
                                            state.On(r, layer, kBackwardPriority + 1,
                                                     {state.Name(r, layer + ".grad_reduced")},
                                                     {ObjectRole::kGradient})));
    return reduced[0];
  }
  Result<std::vector<ObjectId>> ReduceAccumulatedGradients(
      PlanState& state, int r, const std::vector<size_t>& groups,
      const std::vector<ObjectId>& grads) const override {
    if (ranks_ == 1 || groups.size() == 1) {
      return ShardingPolicy::ReduceAccumulatedGradients(state, r, groups, grads);
    }
    return FusedReduction(state, r, /*k=*/-1, groups, grads, "all_reduce", 1, ".grad_reduced");
  }
  Status ReduceAfterBackward(PlanState&) const override { return Status::Ok(); }
  bool GathersUpdatedParameters() const override { return false; }
  Result<ObjectId> GatherUpdatedParameters(PlanState&, int, size_t, ObjectId params,
                                           bool) const override {
    return params;
  }

 private:
  const int ranks_;
};

// Stages 1-2: parameters replicated (held whole between steps, used as held), the update
// sharded (rank r updates shard r of each group inside its full parameters), and the updated
// shards all-gathered. The stages differ in when the gradients are reduce-scattered.
class ShardedUpdatePolicy : public ShardingPolicy {
 public:
  ShardedUpdatePolicy(int ranks, int64_t group_multiple)
      : ranks_(ranks), group_multiple_(group_multiple) {}

  int64_t GroupMultiple() const final { return group_multiple_; }
  GroupPiece ParameterPiece(size_t l, int r, int64_t numel) const final {
    return FullPiece(l, r, numel);
  }
  GroupPiece UpdatePiece(size_t l, int r, int64_t numel) const final {
    return ShardPiece(l, r, numel, ranks_);
  }
  bool ShardsUpdate() const override { return true; }
  Result<ObjectId> ForwardParams(PlanState& state, const ParamUse& use) const final {
    return HeldParams(state, use.rank, use.group);
  }
  Result<ObjectId> BackwardParams(PlanState&, const ParamUse&,
                                  ObjectId forward_params) const final {
    return forward_params;
  }
  Result<ObjectId> ReduceAccumulatedGradient(PlanState&, int, size_t, ObjectId grad) const final {
    return grad;
  }
  bool GathersUpdatedParameters() const final { return true; }
  Result<ObjectId> GatherUpdatedParameters(PlanState& state, int r, size_t l, ObjectId params,
                                           bool in_place) const final {
    return GatherUpdatedShards(state, r, l, params, in_place);
  }

 protected:
  int ranks() const { return ranks_; }

 private:
  const int ranks_;
  const int64_t group_multiple_;
};

// ZeRO-1: optimizer state sharded. The full gradients are accumulated through the whole
// backward, then each is reduce-scattered (smallest group first, so the peak stays at the full
// gradients plus one small shard); rank r updates shard r inside its full parameters, which are
// then all-gathered in place.
class Zero1Policy final : public ShardedUpdatePolicy {
 public:
  using ShardedUpdatePolicy::ShardedUpdatePolicy;

  std::string_view name() const override { return "ZeRO-1"; }
  ObjectRole FullGradientRole() const override { return ObjectRole::kGradient; }
  Result<ObjectId> ReduceMicroBatchGradient(PlanState&, int, int, size_t,
                                            ObjectId full) const override {
    return full;
  }
  // Each reduce-scatter waits for the last gradient of its layer's stage (after the stage's
  // whole backward) as a second input.
  Status ReduceAfterBackward(PlanState& state) const override {
    std::vector<size_t> order(state.num_layers);
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return state.step.group_numel[a] < state.step.group_numel[b];
    });
    for (size_t l : order) {
      if (!state.HasParams(l)) continue;
      const std::string& layer = state.LayerName(l);
      const std::string name = layer + "/reduce_scatter";
      for (int r = 0; r < state.num_ranks; ++r) {
        RankState& rank = state.ranks[static_cast<size_t>(r)];
        std::vector<ObjectId> inputs{rank.grad[l]};
        const size_t last = state.last_gradient[static_cast<size_t>(state.StageOf(l))];
        if (l != last) inputs.push_back(rank.grad[last]);
        TESSERA_ASSIGN_OR_RETURN(
            auto shard,
            state.builder.AddTask(
                state.Name(r, name), "reduce_scatter", std::move(inputs),
                state.DataCollective(name, r).Set("reduce", "sum"),
                state.On(r, layer, kOptimizerPriority + 1, {state.Name(r, layer + ".grad[shard]")},
                         {ObjectRole::kGradient})));
        rank.grad[l] = shard[0];
      }
    }
    return Status::Ok();
  }
};

// ZeRO-2: as ZeRO-1, but each micro-batch's full gradient of a layer is reduce-scattered as soon
// as its backward is done (a transient bucket) and only the shards are accumulated and kept.
class Zero2Policy final : public ShardedUpdatePolicy {
 public:
  using ShardedUpdatePolicy::ShardedUpdatePolicy;

  std::string_view name() const override { return "ZeRO-2"; }
  ObjectRole FullGradientRole() const override { return ObjectRole::kGradientBucket; }
  Result<ObjectId> ReduceMicroBatchGradient(PlanState& state, int r, int k, size_t l,
                                            ObjectId full) const override {
    return ReduceScatterMicroBatch(state, r, k, l, full);
  }
  Result<std::vector<ObjectId>> ReduceMicroBatchGradients(
      PlanState& state, int r, int k, const std::vector<size_t>& groups,
      const std::vector<ObjectId>& fulls) const override {
    return ReduceScatterBucket(state, r, k, groups, fulls, ranks());
  }
  Status ReduceAfterBackward(PlanState&) const override { return Status::Ok(); }
};

// Stages 1-2 in 1-bit Adam's compressed phase (OptimizerConfig::compressed_phase): no gradient
// is reduced. Each rank keeps its own gradients whole (what its momentum, averaged by a
// compressed all-reduce in the optimizer pass, is made of) and clips them by their own norm, as
// data parallelism does in that phase; the update stays sharded (rank r applies the averaged
// momentum to shard r of its parameters with its shard of the frozen variance) and the updated
// shards are all-gathered. Its name is the stage's.
class CompressedMomentumPolicy final : public ShardedUpdatePolicy {
 public:
  CompressedMomentumPolicy(int ranks, int64_t group_multiple, std::string_view name)
      : ShardedUpdatePolicy(ranks, group_multiple), name_(name) {}

  std::string_view name() const override { return name_; }
  bool ShardsUpdate() const override { return false; }
  ObjectRole FullGradientRole() const override { return ObjectRole::kGradient; }
  Result<ObjectId> ReduceMicroBatchGradient(PlanState&, int, int, size_t,
                                            ObjectId full) const override {
    return full;
  }
  Status ReduceAfterBackward(PlanState&) const override { return Status::Ok(); }

 private:
  const std::string_view name_;
};

// ZeRO-3: parameters sharded too. Each use of a group's parameters all-gathers the shards first
// (prefetch_layers ahead of the use, by a control edge), per micro-batch or once per step
// (GatherPolicy); gradients as ZeRO-2; each rank's update writes its shard, nothing to gather.
class Zero3Policy final : public ShardingPolicy {
 public:
  explicit Zero3Policy(const ParallelConfig& parallel) : ranks_(parallel.data_parallel) {
    ChooseGathers(parallel);
  }

  std::string_view name() const override { return "ZeRO-3"; }
  int64_t GroupMultiple() const override { return ranks_; }
  GroupPiece ParameterPiece(size_t l, int r, int64_t numel) const override {
    return ShardPiece(l, r, numel, ranks_);
  }
  GroupPiece UpdatePiece(size_t l, int r, int64_t numel) const override {
    return ShardPiece(l, r, numel, ranks_);
  }
  bool ShardsUpdate() const override { return true; }
  bool GathersOncePerStep() const override { return once_per_step_; }
  std::string GatherReason() const override { return reason_; }

  Result<ObjectId> ForwardParams(PlanState& state, const ParamUse& use) const override {
    return Gathered(state, use, ForwardUseName(state, use));
  }
  Result<ObjectId> BackwardParams(PlanState& state, const ParamUse& use, ObjectId) const override {
    return Gathered(state, use, BackwardUseName(state, use));
  }
  ObjectRole FullGradientRole() const override { return ObjectRole::kGradientBucket; }
  Result<ObjectId> ReduceMicroBatchGradient(PlanState& state, int r, int k, size_t l,
                                            ObjectId full) const override {
    return ReduceScatterMicroBatch(state, r, k, l, full);
  }
  Result<std::vector<ObjectId>> ReduceMicroBatchGradients(
      PlanState& state, int r, int k, const std::vector<size_t>& groups,
      const std::vector<ObjectId>& fulls) const override {
    return ReduceScatterBucket(state, r, k, groups, fulls, ranks_);
  }
  Result<ObjectId> ReduceAccumulatedGradient(PlanState&, int, size_t,
                                             ObjectId grad) const override {
    return grad;
  }
  Status ReduceAfterBackward(PlanState&) const override { return Status::Ok(); }
  bool GathersUpdatedParameters() const override { return false; }
  Result<ObjectId> GatherUpdatedParameters(PlanState&, int, size_t, ObjectId params,
                                           bool) const override {
    return params;
  }

 private:
  // The gathered parameters for a use: the step's gather of the group (made at its first use)
  // when gathering once per step, else a gather of its own named "<group>/gather_<when>".
  Result<ObjectId> Gathered(PlanState& state, const ParamUse& use, const std::string& when) const {
    if (!once_per_step_) return Gather(state, use, when);
    ObjectId& gathered = state.ranks[static_cast<size_t>(use.rank)].gathered[use.group];
    if (!gathered.valid()) {
      TESSERA_ASSIGN_OR_RETURN(gathered, Gather(state, use, "step"));
    }
    return gathered;
  }

  // Rank r's member of the all-gather of the group's shards (uploaded first under parameter
  // offload), on the group's stage.
  Result<ObjectId> Gather(PlanState& state, const ParamUse& use, const std::string& when) const {
    const int r = use.rank;
    const size_t l = use.group;
    TESSERA_ASSIGN_OR_RETURN(ObjectId held, UsableParams(state, use, when));
    const std::string name = fmt::format("{}/gather_{}", state.LayerName(l), when);
    // On a channel of their own: a gather never waits behind a gradient's reduce-scatter, so the
    // backward pass's gathers are prefetched like the forward's (core/collective_task.h).
    TESSERA_ASSIGN_OR_RETURN(
        auto gathered,
        state.builder.AddTask(
            state.Name(r, name), "all_gather", {held},
            QuantizedWhenAsked(
                state, state.DataCollective(name, r).Set(kChannelAttr, int64_t{kGatherChannel})),
            state.On(r, state.LayerName(l), kForwardPriority + 1, {state.Name(r, name + ":params")},
                     {ObjectRole::kGatheredParameter})));
    // Prefetched once `use.after` is made, by a control edge, not by reading it: a collective
    // holds what it reads until every member has come, so an activation read only to order the
    // gather would stay live past its last real reader, which then could not take its buffer
    // over (an in-place backward copies instead, one activation more than the memory model
    // counts). Only among tasks of the layer's own stage: one of another stage would tie this
    // stage's collective order to that stage's progress.
    if (use.after.valid() && state.ProducedOnStage(use.after, state.StageOf(l))) {
      state.builder.AddControlEdge(state.ProducerOf(use.after), state.ProducerOf(gathered[0]));
    }
    return gathered[0];
  }

  // With several micro-batches per rank: gather each layer once per step (its stage's
  // parameters stay gathered while the micro-batches run), or before every use.
  void ChooseGathers(const ParallelConfig& p) {
    const int micro_batches = p.micro_batches;
    const int stages = p.pipeline_stages;
    if (micro_batches == 1) return;
    // Per micro-batch: one gather before each forward and each backward; per step: one.
    const int64_t gathers_saved = int64_t{2} * micro_batches - 1;
    switch (p.gather) {
      case GatherPolicy::kOncePerStep:
        once_per_step_ = true;
        reason_ = fmt::format("asked for (--gather step): {} fewer gathers per layer per step",
                              gathers_saved);
        break;
      case GatherPolicy::kPerMicroBatch:
        reason_ =
            "asked for (--gather micro-batch): only prefetch_layers layers' "
            "parameters are gathered at a time";
        break;
      case GatherPolicy::kAuto:
        once_per_step_ = stages > 1;
        reason_ =
            stages > 1
                ? fmt::format(
                      "a pipeline stage holds 1/{} of the layers, so its gathered parameters stay "
                      "while its {} micro-batches run: {} fewer gathers per layer per step",
                      stages, micro_batches, gathers_saved)
                : fmt::format(
                      "without a pipeline, gathering once per step would hold every layer's "
                      "parameters at once; per micro-batch keeps ZeRO-3's bound of "
                      "prefetch_layers gathered layers (--gather step saves {} gathers per layer)",
                      gathers_saved);
        break;
    }
  }

  const int ranks_;
  bool once_per_step_ = false;
  std::string reason_;
};

}  // namespace

Result<std::vector<ObjectId>> ShardingPolicy::ReduceMicroBatchGradients(
    PlanState& state, int r, int k, const std::vector<size_t>& groups,
    const std::vector<ObjectId>& fulls) const {
  std::vector<ObjectId> reduced;
  for (size_t i = 0; i < groups.size(); ++i) {
    TESSERA_ASSIGN_OR_RETURN(ObjectId one,
                             ReduceMicroBatchGradient(state, r, k, groups[i], fulls[i]));
    reduced.push_back(one);
  }
  return reduced;
}

Result<std::vector<ObjectId>> ShardingPolicy::ReduceAccumulatedGradients(
    PlanState& state, int r, const std::vector<size_t>& groups,
    const std::vector<ObjectId>& grads) const {
  std::vector<ObjectId> reduced;
  for (size_t i = 0; i < groups.size(); ++i) {
    TESSERA_ASSIGN_OR_RETURN(ObjectId one,
                             ReduceAccumulatedGradient(state, r, groups[i], grads[i]));
    reduced.push_back(one);
  }
  return reduced;
}

Status CheckZeroStage(int zero_stage) {
  if (zero_stage < 0 || zero_stage > 3) {
    return InvalidArgument(
        "ZeRO stage {} does not exist: use 0 (data parallel), 1 (optimizer state sharded), 2 "
        "(+ gradients sharded) or 3 (+ parameters sharded)",
        zero_stage);
  }
  return Status::Ok();
}

bool ShardsOptimizerState(const ParallelConfig& parallel) {
  return parallel.zero_stage >= 1 && parallel.data_parallel > 1;
}

bool UpdatesTheParametersItKeeps(const ParallelConfig& parallel) {
  return !ShardsOptimizerState(parallel) || parallel.zero_stage == 3;
}

Result<std::unique_ptr<ShardingPolicy>> MakeShardingPolicy(const ParallelConfig& parallel,
                                                           const OptimizerConfig& optimizer) {
  TESSERA_RETURN_IF_ERROR(CheckZeroStage(parallel.zero_stage));
  const int ranks = parallel.data_parallel;
  // 1-bit Adam: shards of whole 32-bit words of signs, each rank's its chunk of the momentum's
  // compressed all-reduce (SignChunkElements of the group's own elements over the ranks).
  const bool onebit = optimizer.kind == OptimizerConfig::Kind::kOneBitAdam;
  const int64_t multiple = onebit ? int64_t{32} * ranks : ranks;
  std::unique_ptr<ShardingPolicy> policy;
  if (ranks <= 1 || parallel.zero_stage == 0) {
    policy = std::make_unique<DataParallelPolicy>(ranks);
  } else if (onebit && optimizer.compressed_phase && parallel.zero_stage <= 2) {
    policy = std::make_unique<CompressedMomentumPolicy>(
        ranks, multiple, parallel.zero_stage == 1 ? "ZeRO-1" : "ZeRO-2");
  } else if (parallel.zero_stage == 1) {
    policy = std::make_unique<Zero1Policy>(ranks, multiple);
  } else if (parallel.zero_stage == 2) {
    policy = std::make_unique<Zero2Policy>(ranks, multiple);
  } else {
    policy = std::make_unique<Zero3Policy>(parallel);
  }
  return policy;
}

}  // namespace tessera

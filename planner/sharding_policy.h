// Sharding policies: what each ZeRO stage does, each stage in one place.
//
// The planner's passes (planner/plan_passes.h) build the same tasks for every ZeRO stage; where
// stages differ they ask the plan's ShardingPolicy, one implementation per stage:
//
//   stage  parameters        a micro-batch's gradient     after the backward   after the update
//   0      full on each rank accumulated; all-reduced     -                    -
//                            after the last micro-batch
//   1      full              accumulated in full          reduce-scatter each  all-gather in place
//                                                         (smallest first)
//   2      full              reduce-scattered at once     -                    all-gather in place
//                            (a transient bucket); the
//                            shards accumulated
//   3      shard; gathered   as 2                         -                    -
//          before each use
//
// Stages 1-3 hold the optimizer state (and the final gradient) of shard r of every group on rank
// r, and pad every group to a multiple of the ranks so that shards are equal. With one rank
// there is nothing to shard: every stage plans as data parallel over one rank.
//
// 1-bit Adam (OptimizerConfig::Kind::kOneBitAdam) with stage 1 or 2: its warm-up plans as the
// stage does; in its compressed phase no gradient is reduced (each rank's momentum, whole, is
// averaged by a compressed all-reduce whose chunks are the shards), the update stays sharded and
// the updated shards are gathered as above.
//
// A policy is made once per plan (MakeShardingPolicy) and holds only the plan's settings; the
// methods that add tasks (collectives) add them through the PlanState they are given and keep
// what later calls need there (RankState::gathered). No pass outside this file and its .cc tests
// the ZeRO stage: a new sharding scheme is a new policy, not more `if`s in the passes.
//
// Internal to planner/. Thread safety: const methods; a policy may be shared, the PlanState it
// is given may not.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/graph.h"
#include "core/status.h"
#include "planner/step_graph.h"
#include "planner/training_plan.h"

namespace tessera {

struct PlanState;

// One use of a group's parameters: by layer `reader`'s forward or backward on rank `rank` in
// micro-batch `micro`.
struct ParamUse {
  int rank = 0;
  int micro = 0;
  size_t reader = 0;  // the layer whose task reads the parameters
  size_t group = 0;   // the layer whose group it reads (the reader's own, or a tied one)
  bool backward = false;
  // The object a gather for this use waits for (ParallelConfig::prefetch_layers: the activation,
  // or its gradient, entering the layer that many layers before the reader; invalid: none).
  ObjectId after;
};

class ShardingPolicy {
 public:
  virtual ~ShardingPolicy() = default;

  // "data parallel", "ZeRO-1", "ZeRO-2", "ZeRO-3" (for messages).
  virtual std::string_view name() const = 0;

  // --- Which state pieces a rank holds (state placement) ---
  // Every group is padded to a multiple of this: 1, or the ranks when ranks hold shards.
  virtual int64_t GroupMultiple() const = 0;
  // The piece of layer l's (padded) group of `group_numel` elements that rank r keeps its
  // parameters of between steps.
  virtual GroupPiece ParameterPiece(size_t l, int r, int64_t group_numel) const = 0;
  // The piece rank r updates: that of its optimizer state (Adam moments; the host master copy
  // under offload) and of its final gradient.
  virtual GroupPiece UpdatePiece(size_t l, int r, int64_t group_numel) const = 0;
  // Whether ranks hold shards of the final gradients (the global norm then sums every worker's)
  // and of the optimizer state (a pipeline stage without parameters cannot be sharded).
  virtual bool ShardsUpdate() const = 0;

  // --- Reading parameters (the forward/backward expansion) ---
  // ZeRO-3 with several micro-batches: whether each layer's parameters are gathered once per
  // step, and why (StepGraph::gather_once_per_step / gather_reason; empty: no such choice).
  virtual bool GathersOncePerStep() const { return false; }
  virtual std::string GatherReason() const { return {}; }
  // The parameters a forward task reads: the rank's state, or (ZeRO-3) a gather of every
  // rank's shard, added to the graph here.
  virtual Result<ObjectId> ForwardParams(PlanState& state, const ParamUse& use) const = 0;
  // The parameters a backward task reads, `forward_params` being what its forward read: the
  // same object, or (ZeRO-3) a gather again.
  virtual Result<ObjectId> BackwardParams(PlanState& state, const ParamUse& use,
                                          ObjectId forward_params) const = 0;

  // --- Gradients ---
  // The role of a micro-batch's full gradient of a group: kGradientBucket when it is only on
  // its way to a reduce-scatter, else kGradient.
  virtual ObjectRole FullGradientRole() const = 0;
  // Rank r's full gradient of group l from micro-batch k: what is accumulated over the
  // micro-batches (the full gradient itself, or its reduce-scattered shard).
  virtual Result<ObjectId> ReduceMicroBatchGradient(PlanState& state, int r, int k, size_t l,
                                                    ObjectId full) const = 0;
  // Rank r's gradient of group l accumulated over every micro-batch: the gradient to keep
  // (itself, or all-reduced over the ranks).
  virtual Result<ObjectId> ReduceAccumulatedGradient(PlanState& state, int r, size_t l,
                                                     ObjectId grad) const = 0;
  // After every rank's backward (the reductions pass): reductions that wait for the whole
  // backward; they replace RankState::grad.
  virtual Status ReduceAfterBackward(PlanState& state) const = 0;

  // --- Gradient buckets (ParallelConfig::bucket_bytes) ---
  // The two reductions above for a bucket of groups of one stage, in the order the backward
  // completed them; one object per group. A policy whose reduction is a collective makes one
  // collective of the bucket (its gradients packed, reduced, split back; StepGraph::
  // fused_reductions counts them); a bucket of one group, or a reduction that is not a
  // collective, is the one-group form per group.
  virtual Result<std::vector<ObjectId>> ReduceMicroBatchGradients(
      PlanState& state, int r, int k, const std::vector<size_t>& groups,
      const std::vector<ObjectId>& fulls) const;
  virtual Result<std::vector<ObjectId>> ReduceAccumulatedGradients(
      PlanState& state, int r, const std::vector<size_t>& groups,
      const std::vector<ObjectId>& grads) const;

  // --- After the update (the optimizer pass) ---
  // Whether each rank's updated shard is all-gathered into the full parameters.
  virtual bool GathersUpdatedParameters() const = 0;
  // Rank r's member of that gather for layer l: in place inside the full parameters the update
  // wrote its shard into (`in_place`), or from an uploaded shard. Returns the next step's
  // parameters. REQUIRES: GathersUpdatedParameters().
  virtual Result<ObjectId> GatherUpdatedParameters(PlanState& state, int r, size_t l,
                                                   ObjectId params, bool in_place) const = 0;
};

// InvalidArgument naming the stages when `zero_stage` is not 0..3.
Status CheckZeroStage(int zero_stage);
// Whether the plan's ranks hold shards of the optimizer state (ZeRO >= 1 over several ranks).
bool ShardsOptimizerState(const ParallelConfig& parallel);
// Whether each rank updates exactly the piece of the parameters it keeps (not ZeRO-1/2 over
// several ranks, whose updated shards are gathered into full copies): what parameter offload,
// whose update writes the kept parameters in place, needs.
bool UpdatesTheParametersItKeeps(const ParallelConfig& parallel);
// The policy of the plan's ZeRO stage (data parallel over one rank whatever the stage) for its
// optimizer: under 1-bit Adam, stages 1-2 pad each group to whole 32-bit words of signs a rank
// (a rank's shard is its chunk of the compressed all-reduce: its server error lives with its
// shard of the state) and, in the compressed phase, reduce no gradient (each rank's momentum is
// averaged instead). InvalidArgument as CheckZeroStage.
Result<std::unique_ptr<ShardingPolicy>> MakeShardingPolicy(const ParallelConfig& parallel,
                                                           const OptimizerConfig& optimizer);

}  // namespace tessera

// The plan state: everything the planner's passes share while they build one step graph.
//
// PlanTrainingStep (planner/step_graph.cc) makes one PlanState and runs the passes of
// planner/plan_passes.h over it in order; each pass reads what earlier passes left here and adds
// tasks and objects through `builder`. The state is explicit so that a pass can be tested on its
// own (run the passes before it, then look at what it adds) and a new pass can see exactly what
// it may read or change:
//   step         the StepGraph being filled: the cut, the state objects, the gradients, the
//                schedule; its graph comes from `builder` at the end
//   ranks        per rank, the objects and tasks passes hand on to later ones (RankState)
//   sharding     the ZeRO stage's policy (planner/sharding_policy.h): the passes' only view of
//                the stage
//   builder      the graph so far; task and object ids follow the order passes add them, which
//                the golden plans (tests/unit/plan_golden_test.cc) pin
// and the naming and placement conventions every pass follows (Name, Micro, Staged, On...).
//
// Internal to planner/ (not installed). Thread safety: one PlanState per planning call, used by
// one thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/graph.h"
#include "core/status.h"
#include "model/model_spec.h"
#include "ops/graph_builder.h"
#include "ops/op_registry.h"
#include "planner/activation_solver.h"
#include "planner/sharding_policy.h"
#include "planner/step_graph.h"

namespace tessera {

// Priorities among ready tasks: finish backward work before starting more forward work (what
// yields 1F1B in pipelines), and keep optimizer updates behind both. Collectives and copies of
// a phase run one above its tasks (kForwardPriority + 1 for ZeRO-3's gathers, ...).
inline constexpr int32_t kForwardPriority = 1;
inline constexpr int32_t kBackwardPriority = 2;
inline constexpr int32_t kOptimizerPriority = 0;

// An index into StepGraph::state for a layer without that kind of state (no parameters, no
// host master, SGD's moments).
inline constexpr size_t kNoState = ~size_t{0};

// What one rank's passes hand on to later passes. Per-layer vectors are indexed by layer.
struct RankState {
  // Indices into StepGraph::state of this rank's parameters, Adam moments and (host update)
  // master parameters; kNoState where the layer has none. Written by state placement.
  std::vector<size_t> param, exp_avg, exp_avg_sq, master;
  // 1-bit Adam's compressed phase: the error buffers of each group's compressed all-reduce
  // (placed after every rank's other state, so the warm-up's state is a prefix of this phase's);
  // 0/1 Adam's compressed-gradient and sync steps likewise.
  std::vector<size_t> worker_error, server_error;
  // 0/1 Adam's local and sync steps: the parameters at the last sync.
  std::vector<size_t> interval_start;
  // The gradient: accumulated over micro-batches by the expansion (full or shard, as the
  // sharding policy reduces it), final after the reductions pass.
  std::vector<ObjectId> grad;
  std::vector<ObjectId> losses;  // per micro-batch (expansion)
  std::vector<ObjectId> clip;    // per stage: the clipping factor on that stage's worker
  // What the update reads: the final gradient and the clipping factor where the update runs
  // (the offload pass's host copies under a host update, else `grad` and `clip`).
  std::vector<ObjectId> update_grad;
  std::vector<ObjectId> update_clip;  // per stage
  // ZeRO-3 gathered once per step: per layer, its gathered parameters (invalid: not yet).
  std::vector<ObjectId> gathered;
  // Per layer and micro-batch: the forward and backward tasks (for the schedule's order).
  // A split backward's tasks: backward_task is its input half, weight_task its weight half;
  // recompute_task the forward again before the backward (memory plan), else invalid.
  std::vector<std::vector<TaskId>> forward_task, backward_task, weight_task, recompute_task;
};

struct PlanState {
  // REQUIRES: the arguments outlive the state.
  PlanState(const ModelSpec& model, const TrainingPlan& plan, const OpRegistry& registry);
  ~PlanState();

  const ModelSpec& model;
  const TrainingPlan& plan;
  const ParallelConfig& parallel;
  const OpRegistry& registry;
  const int num_ranks;          // parallel.ranks_per_stage(): data-parallel x tensor-parallel
  const int num_data_ranks;     // parallel.data_parallel (N: what ZeRO shards over)
  const int tensor_parallel;    // parallel.tensor_parallel (T)
  const int num_micro_batches;  // parallel.micro_batches
  const int num_stages;         // parallel.pipeline_stages
  const size_t num_layers;
  const bool adam_moments;  // AdamW or 1-bit Adam: exp_avg and exp_avg_sq per group
  const bool onebit_adam;   // 1-bit Adam (OptimizerConfig::Kind::kOneBitAdam)
  // 1-bit Adam's compressed phase on several data ranks: the gradients stay unreduced and each
  // rank's momentum is averaged by a compressed all-reduce, with its error buffers as state.
  const bool compressed_momentum;
  // 0/1 Adam (OptimizerConfig::Kind::kZeroOneAdam): the step planned (plan.optimizer's
  // zero_one_step) and what it needs.
  const bool zero_one_adam;
  const OptimizerConfig::ZeroOneStep zero_one_step;
  // The gradients are all-reduced (sharding policy) before the update: all but 1-bit Adam's
  // compressed phase and 0/1 Adam's steps other than its variance steps.
  const bool reduces_gradients;
  // Each rank keeps error buffers for compressed all-reduces (several data ranks, in 1-bit
  // Adam's compressed phase or 0/1 Adam's compressed-gradient and sync steps).
  const bool error_feedback;
  const bool takes_local_steps;  // 0/1 Adam's local and sync steps
  // Offload on GPU workers: the update and its state live in the host tier (on CPU workers that
  // is where everything already is, and offload changes nothing).
  const bool host_update;
  // Parameter offload on GPU workers (OffloadMode::kParameters): the parameters live in the host
  // tier too, are the update's target (no master copy) and are copied up for each use; except
  // the layers ParallelConfig::resident_params keeps on the device (HostParams).
  const bool host_params;

  std::unique_ptr<ShardingPolicy> sharding;  // set by the validation pass
  GraphBuilder builder;
  StepGraph step;
  std::vector<RankState> ranks;              // per rank (state placement on)
  std::map<std::string, int> stage_of_name;  // layer name -> pipeline stage (the cut)
  // Per stage: the group whose gradient is complete last there (the expansion).
  std::vector<size_t> last_gradient;
  // The memory plan's choice per layer (planner/memory_plan.cc, before the passes run): a
  // recomputed layer's backward reads its forward run again (the expansion). Empty: keep all.
  std::vector<ActivationDecision> activation_choices;
  // Each rank's micro-batches one after another (the memory plan, with several micro-batches
  // and no pipeline): a micro-batch's first forward waits for the previous one's backward, so
  // one micro-batch's activations are live at a time instead of every one's forwards running
  // as soon as they are ready.
  bool serialize_micro_batches = false;

  // --- Names ---
  // "rank1/h.0.params" with several ranks; "h.0.params" on one.
  std::string Name(int r, const std::string& name) const;
  // "h.0/forward@1" with several micro-batches; "h.0/forward" with one.
  std::string Micro(int k, const std::string& name) const;
  // "stage1/clip" in a pipeline; "clip" otherwise (per-worker tasks of the step).
  std::string Staged(int s, const std::string& name) const;
  const std::string& LayerName(size_t l) const { return model.layers[l].name; }

  // --- Placement ---
  int StageOf(size_t l) const { return step.layer_stage[l]; }
  int LossStage() const { return step.layer_stage[num_layers - 1]; }
  // Layers without parameters (a pooling layer) have no group: no state, gradient or update.
  bool HasParams(size_t l) const { return step.group_numel[l] > 0; }
  // Whether layer l's parameters live in the host tier (parameter offload, and not resident).
  bool HostParams(size_t l) const {
    return host_params && !(l < parallel.resident_params.size() && parallel.resident_params[l]);
  }
  // The piece of layer l's group rank r keeps its parameters of, and updates (the sharding
  // policy's, over the data-parallel ranks of r's tensor rank).
  GroupPiece ParameterPiece(size_t l, int r) const;
  GroupPiece UpdatePiece(size_t l, int r) const;
  // Where the optimizer's state, lr and step live and its update runs.
  Device OptimizerDevice() const { return host_update ? Device::Cpu() : plan.device; }
  // A task of rank r in stage s, on its worker and the plan's device.
  TaskOptions OnStage(int r, int s, const std::string& layer, int32_t priority,
                      std::vector<std::string> output_names = {},
                      std::vector<ObjectRole> output_roles = {}) const;
  // A task of rank r for `layer` (a layer's name): on the worker of its stage.
  TaskOptions On(int r, const std::string& layer, int32_t priority,
                 std::vector<std::string> output_names = {},
                 std::vector<ObjectRole> output_roles = {}) const;
  // A task of the optimizer step: optimizer priority, on the host under a host update.
  TaskOptions OnOptimizerDevice(TaskOptions options) const;
  TaskOptions OnOptimizerDevice(int r, const std::string& layer,
                                std::vector<std::string> output_names = {},
                                std::vector<ObjectRole> output_roles = {}) const;

  // --- Graph helpers ---
  TaskId ProducerOf(ObjectId id) const { return builder.graph().object(id).producer; }
  // Whether a task of a layer of stage s produced `id`.
  bool ProducedOnStage(ObjectId id, int s) const;
  // Rank r's coordinates (ParallelConfig::DataRankOf, TensorRankOf).
  int DataRank(int r) const { return parallel.DataRankOf(r); }
  int TensorRank(int r) const { return parallel.TensorRankOf(r); }
  // One collective id per name: every rank's member of "h.0/gather_forward@1" shares it; ids
  // count from 1 in the order names are first asked for.
  int64_t CollectiveId(const std::string& name);
  // The attributes of rank r's member of collective `name` over the stage's data-parallel ranks
  // of its tensor rank (one collective per tensor rank: "tp1/<name>" under tensor parallelism).
  Attrs DataCollective(const std::string& name, int r);
  // ... over the tensor ranks of rank r's data-parallel rank ("dp1/<name>" with several), on the
  // channel of its own (kTensorChannel): the activations' all-reduces do not queue behind the
  // gradients' reductions.
  Attrs TensorCollective(const std::string& name, int r);
  // ... over the sequence ranks of rank r's group ("sp<g>/<name>", sequence parallelism), on the
  // activations' channel too.
  Attrs SequenceCollective(const std::string& name, int r);
  // The sum of `parts` on rank r's worker of stage s, added in place into the first in order
  // ("<name>/sum<i>" tasks); invalid when there are none.
  Result<ObjectId> Sum(int r, int s, const std::string& name, const std::vector<ObjectId>& parts);

  std::map<std::string, int64_t> collective_ids;  // CollectiveId's
  // Every reduction of one micro-batch's gradients (ZeRO-2/3's reduce-scatters, fused or of one
  // group): its rank, micro-batch, task and the groups it reduces (the settle_reductions pass).
  struct MicroBatchReduction {
    int rank = 0;
    int micro = 0;
    TaskId task;
    std::vector<size_t> groups;
  };
  std::vector<MicroBatchReduction> micro_batch_reductions;
};

}  // namespace tessera

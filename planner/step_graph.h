// Planners: a model description plus a plan -> the step graph, with placements. The public
// entry point of planner/: what drivers, the trainer and tests include.
//
// PlanTrainingStep builds one training step of any ModelSpec (model/model_spec.h: each layer a
// forward and a backward task wired by its LayerSpec) as a graph of layer-sized tasks over objects.
// For GPT-2 (model/gpt2.h's BuildGpt2, fused layers), on one worker:
//
//   embedding/forward ─► h.0/forward ─► … ─► h.{L-1}/forward ─► head/forward (loss, dlogits)
//                                                                  │
//   embedding/backward ◄─ h.0/backward ◄─ … ◄─ h.{L-1}/backward ◄─ head/backward
//        │ (adds the tied classifier's wte gradient, donated in place)
//        ▼
//   <layer>/grad_norm (one per parameter group) ─► clip ─► <layer>/adamw (one per group)
//
// Objects: per layer a flat parameter group (role kParameter), its gradient (kGradient), and
// for AdamW two moment buffers (kOptimizerState); per step the batch's tokens and targets, the
// learning rate and the step number (kInput). The updated state is the graph's output and
// becomes the next step's input (the trainer rebinds it). Each block's forward keeps one "saved"
// object for its backward; the block backward works in place on the incoming gradient, and each
// AdamW task updates its state in place (donation).
//
// How the graph is built: a pipeline of passes over one plan state (planner/plan_passes.h lists
// them in order: validation, the pipeline cut, state placement, the forward/backward expansion
// per rank and micro-batch, the reductions after the backward, the loss, clipping, the offload
// downloads, the optimizer update, the pipeline schedule's order). What differs between ZeRO
// stages is one ShardingPolicy per stage (planner/sharding_policy.h); the passes ask it and never
// test the stage.
//
// Data parallelism and ZeRO are placements of the same tasks (ParallelConfig; the table in
// docs/architecture.md). With data_parallel ranks, each rank r runs the forward and backward of
// its rows of the batch on its worker (workers[r]), in micro_batches micro-batches whose
// gradients are accumulated in place; then, per stage:
//   0  every rank holds the whole state; each layer's gradient is all-reduced as soon as its
//      backward is done; every rank updates everything.
//   1  parameters replicated, optimizer state sharded: after the whole backward each gradient
//      is reduce-scattered, rank r updates shard r of every group (AdamW with param_offset,
//      in place inside the full parameter), then the group is all-gathered in place.
//   2  as 1, but each layer's gradient is reduce-scattered as soon as its backward is done and
//      the full gradient freed (the "bucket"): only gradient shards persist.
//   3  parameters sharded too: each layer's parameters are all-gathered just before its forward
//      (and again before its backward), prefetch_layers ahead of use, and freed after use.
// Stages >= 1 pad each group to a multiple of the ranks (attribute param_multiple): shards are
// equal. Gradient clipping uses the global norm: each rank's shard norms are summed and
// all-reduced. The loss is the mean over every rank and micro-batch (all-reduced; rank 0's is the
// output).
// Devices: TrainingPlan::device is where the workers compute (the CPU, or each worker's own GPU);
// tasks run and objects live there unless offloaded.
// Offload (optimizer), ZeRO-Offload: the fp32 master copy of each rank's parameter piece (its
// shard at stages >= 1, the whole group at stage 0) and its Adam moments live in the host tier
// (StateKind::kMasterParameter, kExpAvg, kExpAvgSq on Device::Cpu()), and the update is a CPU
// task. Each layer's final gradient (piece) is copied to the host as soon as it is reduced
// (stage 2-3: during the backward of earlier layers), the clipping factor follows it, and the
// updated master piece is copied back to the GPU (then all-gathered at stages 1-2). Every
// transfer is a "copy" task. On CPU workers the host tier is where everything already lives:
// no copies and no separate master, so the offloaded plan is the plain one.
//
// Thread safety: the planners are pure functions of their arguments (the registry is only read);
// a StepGraph is plain data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/graph.h"
#include "core/ids.h"
#include "core/status.h"
#include "model/model_spec.h"
#include "ops/op_registry.h"
#include "planner/activation_solver.h"
#include "planner/memory_model.h"
#include "planner/pipeline_cut.h"
#include "planner/pipeline_schedule.h"
#include "planner/training_plan.h"

namespace tessera {

// kMasterParameter: the host-tier fp32 copy of a parameter piece under offload on GPU workers
// (holds the same values as the parameters between steps; checkpoints keep the parameters).
// kWorkerError, kServerError: 1-bit Adam's compressed phase, the error feedback of each rank's
// compressed all-reduce of a group's momentum (its piece: the whole group for the worker's; for
// the server's, SignChunkElements(group, data ranks) elements from 0, the rank's chunk); 0/1
// Adam's too (of the gradients, then of the accumulated updates).
// kIntervalStart: 0/1 Adam's local steps, the parameters at the last sync (the whole group, the
// same on every rank), where a sync starts from.
enum class StateKind : uint8_t {
  kParameter,
  kExpAvg,
  kExpAvgSq,
  kMasterParameter,
  kWorkerError,
  kServerError,
  kIntervalStart
};
const char* StateKindName(StateKind kind);

// Where a piece of a layer's group lives: elements [begin, begin + numel) of the (padded)
// group, on rank `rank`. Replicated state has one full piece per rank.
struct GroupPiece {
  size_t layer = 0;
  int rank = 0;
  int64_t begin = 0;
  int64_t numel = 0;
};

// One object of model state: this step's value (input) and the next step's (output).
struct StateObject {
  StateKind kind = StateKind::kParameter;
  GroupPiece piece;
  ObjectId input, output;
};

// A final (reduced) gradient object: after the reduction, before clipping.
struct GradientObject {
  GroupPiece piece;
  ObjectId id;
};

// What the memory plan decided (TrainingPlan::memory): the capped tier, its cap and the
// activations' cap (from the budget), the largest worker's predicted peaks of both keeping every
// activation and with the choices, and per layer what happens to what its forward saves for its
// backward (empty: all kept: nothing was capped or the plan fits as it is).
struct MemoryDecision {
  MemoryTier tier = MemoryTier::kHost;
  int64_t cap_bytes = 0;             // the tier's; 0: uncapped
  int64_t activation_cap_bytes = 0;  // 0: uncapped
  int64_t uncapped_peak_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t uncapped_activation_peak_bytes = 0;
  int64_t activation_peak_bytes = 0;
  std::vector<ActivationDecision> activations;
  // What the activation choices add to the step as the solver predicts it (its time units:
  // microseconds when the layers were measured, else the op cost model's), summed over the
  // chains; 0 when every activation is kept, infinite when the plan fell back to recomputing
  // every layer without the solver.
  double activation_overhead = 0;
  std::string reason;  // for --explain-memory
};

struct StepGraph {
  Graph graph;
  ParallelConfig parallel;
  int64_t micro_batch_rows = 0;  // ParallelConfig::MicroBatchRows of the plan's batch
  // Per layer: its pipeline chunk and stage (all 0 without a pipeline).
  std::vector<int> layer_chunk, layer_stage;
  // Pipelines: per stage, the order its forward, backward (and weight) tasks are chained in
  // (ScheduleOrder); for zb-h1, the op cost model's F, B and W per chunk that ordered it.
  std::vector<std::vector<PipelineOp>> schedule_order;
  OpCosts schedule_costs{1, 1, 1};
  // ZeRO-3 with several micro-batches: whether each layer is gathered once per step, and why.
  bool gather_once_per_step = false;
  std::string gather_reason;
  // Gradient buckets (ChooseGradientBuckets; none over one rank): their size, why, and how many
  // collectives of several groups rank 0 of each stage makes over the micro-batches.
  BucketChoice buckets;
  int fused_reductions = 0;
  // Where a piece of state lives: the worker of its rank in its layer's stage, and that
  // worker's index in parallel.workers.
  int WorkerIndexOf(const GroupPiece& piece) const {
    const int stage = layer_stage.empty() ? 0 : layer_stage[piece.layer];
    return stage * parallel.ranks_per_stage() + piece.rank;
  }
  WorkerId WorkerOf(const GroupPiece& piece) const {
    return parallel.workers.empty() ? WorkerId()
                                    : parallel.workers[static_cast<size_t>(WorkerIndexOf(piece))];
  }
  // Per model input, per rank and micro-batch (index rank * micro_batches + micro): rows
  // [index * micro_batch_rows, (index + 1) * micro_batch_rows) of the global batch.
  std::vector<std::vector<ObjectId>> inputs;
  ObjectId lr;      // f32 scalar
  ObjectId step;    // i64 scalar, 1-based (AdamW bias correction)
  ObjectId lr_sum;  // f32 scalar: 0/1 Adam's sync step only, the interval's learning rates summed
  ObjectId loss;    // f32 scalar: mean cross-entropy over the global batch
  ObjectId grad_norm;  // f32 scalar: global gradient norm before clipping
  // Per rank and micro-batch (as `inputs`), on the loss layer's stage: what the loss layer reads
  // first, the model's prediction of those rows (a U-Net's logits; under spatial or sequence
  // parallelism the rank's part of them). StepForward's prediction targets.
  std::vector<ObjectId> predictions;
  std::vector<int64_t> group_numel;  // per layer: elements of a full (padded) group
  std::vector<StateObject> state;
  std::vector<GradientObject> grads;
  MemoryDecision memory;
};

// One training step of `model` under `plan`, every task's shapes inferred with `registry`.
// Refused (InvalidArgument, or Infeasible for a zero-bubble schedule no layer can split) with
// what to change: a plan TrainingPlan::Validate refuses, several ranks or stages without
// workers, a pipeline stage holding no parameters when its state is sharded, a layer's wiring
// (an output no layer reads, a group whose gradient no backward returns) or a shape, naming the
// layer and task. Under memory caps (TrainingPlan::memory) the step is planned to fit
// (StepGraph::memory), or refused (Infeasible) with the predicted peak, what is live at it, the
// least the activations can be brought to, and what to change.
Result<StepGraph> PlanTrainingStep(const ModelSpec& model, const TrainingPlan& plan,
                                   const OpRegistry& registry);

// Pipeline cuts (EstimateLayerCosts, BalancedChunks, CutIntoChunks): planner/pipeline_cut.h.

// The forward part of a training step on the step's own placement: evaluation and prediction of a
// model as it trains (in slabs, split over tensor ranks, pipelined, its parameters sharded),
// without gathering it onto one worker. Its tasks are the step's, on the same workers: those the
// result needs (the step's loss, or StepGraph::predictions) with what they read, and every member
// of each collective among them. The step's order among them stays (control edges through tasks
// left out become edges from what those waited for), so a micro-batch's activations are live
// when the step's would be and no longer. The result of a run equals the step's for the same
// inputs and state, to the bit.
struct StepForward {
  Graph graph;
  // As StepGraph::inputs (per model input, per rank and micro-batch): the input in `graph`,
  // invalid where the forward part does not read it (the labels, when predicting).
  std::vector<std::vector<ObjectId>> inputs;
  // Per StepGraph::state object: its input in `graph`, invalid where unread (optimizer state).
  std::vector<ObjectId> state;
  ObjectId loss;                      // ForwardResult::kLoss: the step's loss
  std::vector<ObjectId> predictions;  // kPredictions: per StepGraph::predictions entry
};
enum class ForwardResult : uint8_t { kLoss, kPredictions };
// InvalidArgument for predictions of a model whose loss layer reads no layer.
Result<StepForward> PlanStepForward(const StepGraph& step, ForwardResult result);

// Forward-only graphs (evaluation and sampling).
struct ForwardGraph {
  Graph graph;
  std::vector<ObjectId> inputs;  // per model input; label inputs invalid when predicting
  ObjectId result;               // loss (f32 scalar) or logits (f32 [B, T, V])
  std::vector<ObjectId> params;  // one per model layer, model order (invalid: no parameters)
};

// Mean loss of a batch, no gradients. Parameter groups padded to a multiple of
// `param_multiple` (as a ZeRO step graph's group_numel). Tasks run and objects live on `device`
// (TrainingPlan::device: a GPU trainer evaluates on its GPU).
Result<ForwardGraph> PlanEvalLoss(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                  const OpRegistry& registry, int64_t param_multiple = 1,
                                  Device device = Device::Cpu());
// The model's prediction for a batch (label inputs not fed): the loss layer's predict_op
// (GPT-2's logits, for sampling), else what the loss layer reads first (a U-Net's logits).
Result<ForwardGraph> PlanLogits(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                const OpRegistry& registry, int64_t param_multiple = 1,
                                Device device = Device::Cpu());

}  // namespace tessera

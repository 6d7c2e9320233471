// The planner's passes: PlanTrainingStep is the passes of TrainingPasses(), run in order over one
// PlanState (planner/plan_state.h), then the graph built.
//
// Each pass is a function of the plan state, in its own file, and says below what it reads and
// what it adds or changes. Task and object ids follow the order tasks are added, so the order of
// the passes (and of ranks and layers inside them) is part of the plan: the golden plans
// (tests/unit/plan_golden_test.cc) pin it.
//
//   validate           plan_validation.cc     reads the plan and the model; sets
//                                             state.sharding (the ZeRO stage's policy)
//   cut                pipeline_cut.cc        reads the plan's costs; sets step.layer_chunk,
//                                             layer_stage and state.stage_of_name
//   place_state        state_placement.cc     asks the policy's pieces; adds the model inputs,
//                                             lr, step and state objects; sets step.group_numel,
//                                             the gather choice, the gradient bucket size
//                                             (step.buckets), ranks[r].param / exp_avg...
//   expand_layers      layer_expansion.cc     asks the policy how parameters are read and
//                                             micro-batch gradients reduced (a bucket of groups
//                                             at a time: one collective each); adds every
//                                             rank's forwards and backwards per micro-batch;
//                                             sets ranks[r].grad, losses, *_task,
//                                             last_gradient, step.fused_reductions
//   reduce_gradients   gradient_reduction.cc  asks the policy's reductions after the backward;
//                                             sets step.grads
//   add_loss           loss_pass.cc           reads ranks[r].losses; sets step.loss
//   clip_gradients     clipping_pass.cc       reads ranks[r].grad; sets ranks[r].clip and
//                                             step.grad_norm
//   offload_downloads  offload_pass.cc        reads grad and clip; adds the host copies (host
//                                             update); sets ranks[r].update_grad / update_clip
//   update_optimizer   optimizer_pass.cc      reads update_*, the state; adds the updates, the
//                                             uploads (offload_pass.cc) and the policy's gathers;
//                                             sets the state objects' outputs
//   order_schedule     schedule_pass.cc       reads ranks[r].*_task; adds control edges in the
//                                             pipeline's order; sets step.schedule_*
//   settle_reductions  schedule_pass.cc       reads micro_batch_reductions, *_task and
//                                             step.schedule_order; adds control edges: each
//                                             micro-batch's reduction before the rank's next
//                                             layer task (ParallelConfig::settle_reductions)
//
// Where the passes to come go, and what they would touch:
//   * The memory plan (memory_plan.cc) is not a pass but a loop around them: under memory caps
//     it runs the passes, predicts the step (memory_model.h), asks the activation solver which
//     layers to recompute, and runs them again with PlanState::activation_choices, which the
//     expansion obeys (a "<layer>/recompute" task feeding the backward). Swap copies are to
//     come there too.
//   * A tensor/sequence-parallel pass runs before place_state: it splits layers over a second
//     group of ranks (a mesh axis beside data_parallel), so state placement gives each piece a
//     second coordinate and the expansion adds the layers' collectives (all-reduce or
//     all-gather/reduce-scatter of activations); the ShardingPolicy then shards what the tensor
//     split leaves. It changes step.state's pieces, the workers' layout and the names' prefix.
//   * A gradient-compression pass wraps the sharding policy's reductions (a decorator of
//     ShardingPolicy over ReduceMicroBatchGradient / ReduceAccumulatedGradient /
//     ReduceAfterBackward): compress before the collective, decompress after, keeping an error
//     feedback buffer per group as a new kind of state (place_state adds it).
//
// Internal to planner/. Thread safety: passes run on one thread over one state.
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "planner/plan_state.h"

namespace tessera {

// The plan: TrainingPlan::Validate, workers for every rank, then the ZeRO stage's policy.
Status ValidatePlanPass(PlanState& state);
// The pipeline cut (CutIntoChunks) and each layer's stage; refuses a stage without parameters
// when the policy shards each stage's state.
Status CutPipelinePass(PlanState& state);
// Model inputs per rank and micro-batch, lr and step, and the state objects each rank holds.
Status PlaceStatePass(PlanState& state);
// Every rank's forward and backward tasks per micro-batch (split backwards included), the
// gradient sums, and each micro-batch's gradient as the sharding policy reduces it.
Status ExpandLayersPass(PlanState& state);
// The sharding policy's reductions after the whole backward; records StepGraph::grads.
Status ReduceGradientsPass(PlanState& state);
// The loss over the global batch (StepGraph::loss).
Status AddLossPass(PlanState& state);
// Global-norm clipping: per-stage clipping factors (StepGraph::grad_norm).
Status ClipGradientsPass(PlanState& state);
// Offload on GPU workers: gradients and clipping factors down to the host.
Status OffloadDownloadsPass(PlanState& state);
// The optimizer update of every group each rank holds, and what follows it.
Status UpdateOptimizerPass(PlanState& state);
// Pipelines: each worker's forwards and backwards chained in the schedule's order.
Status OrderSchedulePass(PlanState& state);
// Under ParallelConfig::settle_reductions: each micro-batch's gradient reduction before the
// rank's next layer task.
Status SettleReductionsPass(PlanState& state);

// Offload's part of the update (offload_pass.cc), called by the optimizer pass per rank and
// layer. Before the update of layer l: its download waits for the update kGradientsInFlight
// layers back on the same worker (`stage_updates`: that worker's updates so far, in order).
void LimitDownloadsInFlight(PlanState& state, int r, size_t l,
                            const std::vector<TaskId>& stage_updates);
// After it: the updated master piece copied back to the device as the next step's parameters
// (to be gathered when the policy gathers updated shards). Returns the uploaded object.
Result<ObjectId> UploadParameters(PlanState& state, int r, size_t l, ObjectId master);

// The passes once, with the given activation choices (PlanState::activation_choices), and per
// rank, layer and micro-batch the forward and backward tasks (RankState's), for the memory plan.
struct PlannedPasses {
  StepGraph step;
  std::vector<std::vector<std::vector<TaskId>>> forward_task, backward_task;
};
Result<PlannedPasses> RunTrainingPasses(const ModelSpec& model, const TrainingPlan& plan,
                                        const OpRegistry& registry,
                                        std::vector<ActivationDecision> activation_choices,
                                        bool serialize_micro_batches = false);
// PlanTrainingStep under memory caps (memory_plan.cc): the plan with every activation kept if
// it fits, else with the activation solver's choices, verified by the memory model.
Result<StepGraph> PlanWithinMemory(const ModelSpec& model, const TrainingPlan& plan,
                                   const OpRegistry& registry);

struct PlanPass {
  std::string_view name;
  Status (*run)(PlanState& state);
};

// The passes of a training step, in order.
const std::vector<PlanPass>& TrainingPasses();

}  // namespace tessera

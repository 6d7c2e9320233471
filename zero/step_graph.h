// Planners: a model description plus a plan -> the step graph.
//
// PlanTrainingStep builds one training step of a GPT-2 ModelSpec as a graph of layer-sized
// tasks over objects:
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
// learning rate and the step number (kInput). The updated parameters and moments are graph
// outputs that become the next step's inputs (the trainer rebinds them). Each block's forward
// keeps one "saved" object for its backward; the block backward works in place on the incoming
// gradient (donation), and each AdamW task updates its group in place (donation).
//
// This is the single-worker plan: every task on one worker. Data parallelism and ZeRO are
// other placements of the same tasks and objects (a later planner).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/graph.h"
#include "core/status.h"
#include "ops/op_registry.h"
#include "zero/model.h"

namespace tessera {

struct OptimizerConfig {
  enum class Kind { kAdamW, kSgd };
  Kind kind = Kind::kAdamW;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;   // on matrices only (FlatLayout::DecayRanges)
  double max_grad_norm = 1.0;  // global-norm clipping; <= 0 disables it
};

struct TrainingPlan {
  int64_t batch = 8;
  int64_t seq_len = 64;
  OptimizerConfig optimizer;

  // InvalidArgument naming the field and what to change (e.g. seq_len above max_seq_len).
  Status Validate(const ModelSpec& model) const;
};

// The step graph's objects per parameter group (one group per model layer).
struct ParameterGroupObjects {
  std::string layer;
  int64_t numel = 0;
  ObjectId param, exp_avg, exp_avg_sq;  // inputs; the moments are invalid for SGD
  ObjectId grad;
  ObjectId next_param, next_exp_avg, next_exp_avg_sq;  // outputs, fed back next step
};

struct StepGraph {
  Graph graph;
  ObjectId tokens, targets;                   // i32 [B, T]
  ObjectId lr;                                // f32 scalar
  ObjectId step;                              // i64 scalar, 1-based (AdamW bias correction)
  ObjectId loss;                              // f32 scalar: mean cross-entropy
  ObjectId grad_norm;                         // f32 scalar: global gradient norm before clipping
  std::vector<ParameterGroupObjects> groups;  // model layer order
};

Result<StepGraph> PlanTrainingStep(const ModelSpec& model, const TrainingPlan& plan,
                                   const OpRegistry& registry);

// Forward-only graphs (evaluation and sampling).
struct ForwardGraph {
  Graph graph;
  ObjectId tokens;
  ObjectId targets;              // invalid for the logits graph
  ObjectId result;               // loss (f32 scalar) or logits (f32 [B, T, V])
  std::vector<ObjectId> params;  // one per model layer, model order
};

// Mean loss of a batch, no gradients.
Result<ForwardGraph> PlanEvalLoss(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                  const OpRegistry& registry);
// Logits of a batch (for sampling).
Result<ForwardGraph> PlanLogits(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                const OpRegistry& registry);

}  // namespace tessera

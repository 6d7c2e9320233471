#include "zero/step_graph.h"

#include "ops/graph_builder.h"

namespace tessera {

namespace {

// Priorities among ready tasks: finish backward work before starting more forward work (what
// yields 1F1B in pipelines), and keep optimizer updates behind both.
constexpr int32_t kForwardPriority = 1;
constexpr int32_t kBackwardPriority = 2;
constexpr int32_t kOptimizerPriority = 0;

TensorMeta F32(Shape shape) { return TensorMeta{std::move(shape), DType::kF32, Device::Cpu()}; }

Attrs Gpt2Attrs(const Gpt2Config& c) {
  return Attrs{{"channels", c.channels},
               {"heads", c.heads},
               {"vocab", c.vocab},
               {"max_seq_len", c.max_seq_len}};
}

TaskOptions Options(const std::string& layer, int32_t priority,
                    std::vector<std::string> output_names = {},
                    std::vector<ObjectRole> output_roles = {}) {
  TaskOptions options;
  options.layer = layer;
  options.priority = priority;
  options.output_names = std::move(output_names);
  options.output_roles = std::move(output_roles);
  return options;
}

// The forward pass shared by every graph: embedding and blocks. Returns the activation entering
// each block (block_inputs[l]) and each block's saved object, and the final activation.
struct ForwardPass {
  std::vector<ObjectId> block_inputs;
  std::vector<ObjectId> saved;
  ObjectId final_x;
};

Result<ForwardPass> AddForward(GraphBuilder& builder, const ModelSpec& model, ObjectId tokens,
                               const std::vector<ObjectId>& params) {
  const Attrs attrs = Gpt2Attrs(model.config);
  ForwardPass pass;
  TESSERA_ASSIGN_OR_RETURN(
      auto embedded,
      builder.AddTask("embedding/forward", "gpt2_embedding_forward", {tokens, params[0]}, attrs,
                      Options("embedding", kForwardPriority)));
  ObjectId x = embedded[0];
  for (size_t l = 1; l + 1 < model.layers.size(); ++l) {
    const std::string& name = model.layers[l].name;
    TESSERA_ASSIGN_OR_RETURN(
        auto outputs, builder.AddTask(name + "/forward", "gpt2_block_forward", {x, params[l]},
                                      attrs, Options(name, kForwardPriority)));
    pass.block_inputs.push_back(x);
    pass.saved.push_back(outputs[1]);
    x = outputs[0];
  }
  pass.final_x = x;
  return pass;
}

Status CheckShapeOfBatch(const ModelSpec& model, int64_t batch, int64_t seq_len) {
  TESSERA_RETURN_IF_ERROR(model.config.Validate());
  if (batch <= 0) return InvalidArgument("batch must be positive, got {}", batch);
  if (seq_len <= 0 || seq_len > model.config.max_seq_len) {
    return InvalidArgument("seq_len {} must be in [1, {}] (the model's max_seq_len)", seq_len,
                           model.config.max_seq_len);
  }
  if (model.layers.size() < 2 || model.layers.front().kind != LayerKind::kEmbedding ||
      model.layers.back().kind != LayerKind::kHead) {
    return InvalidArgument("model must start with an embedding layer and end with a head");
  }
  return Status::Ok();
}

std::vector<ObjectId> AddParameterInputs(GraphBuilder& builder, const ModelSpec& model,
                                         ObjectRole role = ObjectRole::kParameter) {
  std::vector<ObjectId> params;
  for (const LayerSpec& layer : model.layers) {
    params.push_back(builder.AddInput(layer.name + ".params", F32({layer.params.numel()}), role));
  }
  return params;
}

}  // namespace

Status TrainingPlan::Validate(const ModelSpec& model) const {
  TESSERA_RETURN_IF_ERROR(CheckShapeOfBatch(model, batch, seq_len));
  const OptimizerConfig& o = optimizer;
  if (o.kind == OptimizerConfig::Kind::kAdamW &&
      (o.beta1 < 0 || o.beta1 >= 1 || o.beta2 < 0 || o.beta2 >= 1 || o.eps <= 0)) {
    return InvalidArgument("AdamW needs 0 <= beta1, beta2 < 1 and eps > 0 (got {}, {}, {})",
                           o.beta1, o.beta2, o.eps);
  }
  if (o.weight_decay < 0) {
    return InvalidArgument("weight_decay must be >= 0, got {}", o.weight_decay);
  }
  return Status::Ok();
}

Result<StepGraph> PlanTrainingStep(const ModelSpec& model, const TrainingPlan& plan,
                                   const OpRegistry& registry) {
  TESSERA_RETURN_IF_ERROR(plan.Validate(model));
  const Gpt2Config& config = model.config;
  const bool adamw = plan.optimizer.kind == OptimizerConfig::Kind::kAdamW;
  const size_t num_layers = model.layers.size();
  GraphBuilder builder(registry);
  StepGraph step;

  const TensorMeta token_meta{Shape{plan.batch, plan.seq_len}, DType::kI32, Device::Cpu()};
  step.tokens = builder.AddInput("tokens", token_meta, ObjectRole::kInput);
  step.targets = builder.AddInput("targets", token_meta, ObjectRole::kInput);
  step.lr = builder.AddInput("lr", F32(Shape{}), ObjectRole::kInput);
  step.step =
      builder.AddInput("step", TensorMeta{Shape{}, DType::kI64, Device::Cpu()}, ObjectRole::kInput);
  std::vector<ObjectId> params = AddParameterInputs(builder, model);
  step.groups.resize(num_layers);
  for (size_t l = 0; l < num_layers; ++l) {
    ParameterGroupObjects& group = step.groups[l];
    group.layer = model.layers[l].name;
    group.numel = model.layers[l].params.numel();
    group.param = params[l];
    if (adamw) {
      const TensorMeta meta = F32({group.numel});
      group.exp_avg = builder.AddInput(group.layer + ".exp_avg", meta, ObjectRole::kOptimizerState);
      group.exp_avg_sq =
          builder.AddInput(group.layer + ".exp_avg_sq", meta, ObjectRole::kOptimizerState);
    }
  }

  // Forward.
  TESSERA_ASSIGN_OR_RETURN(ForwardPass forward, AddForward(builder, model, step.tokens, params));
  const Attrs attrs = Gpt2Attrs(config);
  const std::string& head = model.layers.back().name;
  const std::string& embedding = model.layers.front().name;
  TESSERA_ASSIGN_OR_RETURN(
      auto head_out,
      builder.AddTask(head + "/forward", "gpt2_head_forward",
                      {forward.final_x, params.back(), params.front(), step.targets}, attrs,
                      Options(head, kForwardPriority, {"loss", head + "/forward:saved"},
                              {ObjectRole::kOutput, ObjectRole::kActivation})));
  step.loss = head_out[0];

  // Backward.
  TESSERA_ASSIGN_OR_RETURN(
      auto head_grads,
      builder.AddTask(
          head + "/backward", "gpt2_head_backward",
          {forward.final_x, head_out[1], params.back(), params.front()}, attrs,
          Options(head, kBackwardPriority,
                  {head + "/backward:dx", head + ".grad", embedding + ".grad_from_head"},
                  {ObjectRole::kActivation, ObjectRole::kGradient, ObjectRole::kGradient})));
  ObjectId dx = head_grads[0];
  step.groups.back().grad = head_grads[1];
  for (size_t l = num_layers - 2; l >= 1; --l) {
    const std::string& name = model.layers[l].name;
    TESSERA_ASSIGN_OR_RETURN(
        auto grads,
        builder.AddTask(name + "/backward", "gpt2_block_backward",
                        {dx, forward.block_inputs[l - 1], forward.saved[l - 1], params[l]}, attrs,
                        Options(name, kBackwardPriority, {name + "/backward:dx", name + ".grad"},
                                {ObjectRole::kActivation, ObjectRole::kGradient})));
    dx = grads[0];
    step.groups[l].grad = grads[1];
  }
  TESSERA_ASSIGN_OR_RETURN(
      auto embedding_grad,
      builder.AddTask(
          embedding + "/backward", "gpt2_embedding_backward", {dx, step.tokens, head_grads[2]},
          attrs,
          Options(embedding, kBackwardPriority, {embedding + ".grad"}, {ObjectRole::kGradient})));
  step.groups.front().grad = embedding_grad[0];

  // Global gradient norm and clipping factor.
  std::vector<ObjectId> sums;
  for (const ParameterGroupObjects& group : step.groups) {
    TESSERA_ASSIGN_OR_RETURN(
        auto sum, builder.AddTask(group.layer + "/grad_norm", "sum_of_squares", {group.grad}, {},
                                  Options(group.layer, kOptimizerPriority)));
    sums.push_back(sum[0]);
  }
  TESSERA_ASSIGN_OR_RETURN(
      auto clip,
      builder.AddTask("clip", "clip_scale", sums, Attrs{{"max_norm", plan.optimizer.max_grad_norm}},
                      Options("", kOptimizerPriority, {"clip_scale", "grad_norm"},
                              {ObjectRole::kOutput, ObjectRole::kOutput})));
  step.grad_norm = clip[1];

  // Optimizer: one task per parameter group, updating it in place.
  for (size_t l = 0; l < num_layers; ++l) {
    ParameterGroupObjects& group = step.groups[l];
    const FlatLayout& layout = model.layers[l].params;
    const std::string next = group.layer + ".params.next";
    if (adamw) {
      Attrs optimizer_attrs{{"beta1", plan.optimizer.beta1},
                            {"beta2", plan.optimizer.beta2},
                            {"eps", plan.optimizer.eps},
                            {"weight_decay", plan.optimizer.weight_decay},
                            {"decay_ranges", layout.DecayRanges()}};
      TESSERA_ASSIGN_OR_RETURN(
          auto updated,
          builder.AddTask(
              group.layer + "/adamw", "adamw",
              {group.param, group.grad, group.exp_avg, group.exp_avg_sq, clip[0], step.lr,
               step.step},
              std::move(optimizer_attrs),
              Options(group.layer, kOptimizerPriority,
                      {next, group.layer + ".exp_avg.next", group.layer + ".exp_avg_sq.next"},
                      {ObjectRole::kParameter, ObjectRole::kOptimizerState,
                       ObjectRole::kOptimizerState})));
      group.next_param = updated[0];
      group.next_exp_avg = updated[1];
      group.next_exp_avg_sq = updated[2];
      builder.MarkOutput(updated[1]);
      builder.MarkOutput(updated[2]);
    } else {
      TESSERA_ASSIGN_OR_RETURN(
          auto updated,
          builder.AddTask(
              group.layer + "/sgd", "sgd", {group.param, group.grad, clip[0], step.lr},
              Attrs{{"weight_decay", plan.optimizer.weight_decay}},
              Options(group.layer, kOptimizerPriority, {next}, {ObjectRole::kParameter})));
      group.next_param = updated[0];
    }
    builder.MarkOutput(group.next_param);
  }
  builder.MarkOutput(step.loss);
  builder.MarkOutput(step.grad_norm);
  TESSERA_ASSIGN_OR_RETURN(step.graph, builder.Build());
  return step;
}

namespace {

Result<ForwardGraph> PlanForward(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                 const OpRegistry& registry, bool logits) {
  TESSERA_RETURN_IF_ERROR(CheckShapeOfBatch(model, batch, seq_len));
  GraphBuilder builder(registry);
  ForwardGraph result;
  const TensorMeta token_meta{Shape{batch, seq_len}, DType::kI32, Device::Cpu()};
  result.tokens = builder.AddInput("tokens", token_meta, ObjectRole::kInput);
  if (!logits) result.targets = builder.AddInput("targets", token_meta, ObjectRole::kInput);
  result.params = AddParameterInputs(builder, model);
  TESSERA_ASSIGN_OR_RETURN(ForwardPass forward,
                           AddForward(builder, model, result.tokens, result.params));
  const Attrs attrs = Gpt2Attrs(model.config);
  const std::string& head = model.layers.back().name;
  if (logits) {
    TESSERA_ASSIGN_OR_RETURN(
        auto out, builder.AddTask(head + "/logits", "gpt2_head_logits",
                                  {forward.final_x, result.params.back(), result.params.front()},
                                  attrs, Options(head, kForwardPriority, {"logits"})));
    result.result = out[0];
  } else {
    TESSERA_ASSIGN_OR_RETURN(
        auto out,
        builder.AddTask(
            head + "/forward", "gpt2_head_forward",
            {forward.final_x, result.params.back(), result.params.front(), result.targets}, attrs,
            Options(head, kForwardPriority, {"loss"}, {ObjectRole::kOutput})));
    result.result = out[0];
  }
  builder.MarkOutput(result.result);
  TESSERA_ASSIGN_OR_RETURN(result.graph, builder.Build());
  return result;
}

}  // namespace

Result<ForwardGraph> PlanEvalLoss(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                  const OpRegistry& registry) {
  return PlanForward(model, batch, seq_len, registry, /*logits=*/false);
}

Result<ForwardGraph> PlanLogits(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                const OpRegistry& registry) {
  return PlanForward(model, batch, seq_len, registry, /*logits=*/true);
}

}  // namespace tessera

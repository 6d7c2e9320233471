#include "driver/gpt2_trainer.h"

#include <cmath>
#include <cstring>
#include <random>

#include "ops/cpu/cpu_kernels.h"

namespace tessera {

namespace {

TensorMeta F32(int64_t n) { return TensorMeta{Shape{n}, DType::kF32, Device::Cpu()}; }

// Prefix of a layer's parameter names: "" for the embedding and head, "h.<l>." for blocks.
std::string NamePrefix(const LayerSpec& layer) {
  return layer.kind == LayerKind::kBlock ? layer.name + "." : "";
}

}  // namespace

Gpt2Trainer::Gpt2Trainer(ModelSpec model, TrainingPlan plan, std::unique_ptr<OpRegistry> registry,
                         std::unique_ptr<InProcessExecutor> executor)
    : model_(std::move(model)),
      plan_(std::move(plan)),
      registry_(std::move(registry)),
      executor_(std::move(executor)) {}

Result<std::unique_ptr<Gpt2Trainer>> Gpt2Trainer::Create(const Gpt2Config& config,
                                                         const TrainingPlan& plan,
                                                         const ExecutorOptions& executor_options) {
  TESSERA_RETURN_IF_ERROR(config.Validate());
  ModelSpec model = DescribeGpt2(config);
  TESSERA_RETURN_IF_ERROR(plan.Validate(model));
  TESSERA_ASSIGN_OR_RETURN(OpRegistry registry, MakeCpuOpRegistry());
  auto owned_registry = std::make_unique<OpRegistry>(std::move(registry));
  auto executor = std::make_unique<InProcessExecutor>(*owned_registry, executor_options);
  std::unique_ptr<Gpt2Trainer> trainer(
      new Gpt2Trainer(std::move(model), plan, std::move(owned_registry), std::move(executor)));
  TESSERA_RETURN_IF_ERROR(trainer->PrepareStepGraph());

  TESSERA_ASSIGN_OR_RETURN(trainer->eval_graph_, PlanEvalLoss(trainer->model_, plan.batch,
                                                              plan.seq_len, *trainer->registry_));
  TESSERA_ASSIGN_OR_RETURN(PreparedGraph eval,
                           trainer->executor_->Prepare(trainer->eval_graph_.graph));
  trainer->prepared_eval_ = std::make_unique<PreparedGraph>(std::move(eval));

  const bool adamw = plan.optimizer.kind == OptimizerConfig::Kind::kAdamW;
  for (const LayerSpec& layer : trainer->model_.layers) {
    const auto& allocator = trainer->executor_->allocator();
    TESSERA_ASSIGN_OR_RETURN(Tensor param, Tensor::Zeros(F32(layer.params.numel()), allocator));
    trainer->params_.push_back(std::move(param));
    if (adamw) {
      TESSERA_ASSIGN_OR_RETURN(Tensor m, Tensor::Zeros(F32(layer.params.numel()), allocator));
      TESSERA_ASSIGN_OR_RETURN(Tensor v, Tensor::Zeros(F32(layer.params.numel()), allocator));
      trainer->exp_avg_.push_back(std::move(m));
      trainer->exp_avg_sq_.push_back(std::move(v));
    }
  }
  return trainer;
}

Status Gpt2Trainer::PrepareStepGraph() {
  TESSERA_ASSIGN_OR_RETURN(step_graph_, PlanTrainingStep(model_, plan_, *registry_));
  if (keep_gradients_) {
    for (const ParameterGroupObjects& group : step_graph_.groups) {
      step_graph_.graph.MarkOutput(group.grad);
    }
  }
  TESSERA_ASSIGN_OR_RETURN(PreparedGraph prepared, executor_->Prepare(step_graph_.graph));
  prepared_step_ = std::make_unique<PreparedGraph>(std::move(prepared));
  return Status::Ok();
}

Status Gpt2Trainer::SetKeepGradients(bool keep) {
  keep_gradients_ = keep;
  last_grads_.clear();
  return PrepareStepGraph();
}

void Gpt2Trainer::InitializeParameters(uint64_t seed) {
  std::mt19937_64 rng(seed);
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(model_.config.layers));
  for (size_t g = 0; g < model_.layers.size(); ++g) {
    float* data = params_[g].data<float>();
    for (const FlatSlot& slot : model_.layers[g].params.slots()) {
      float* begin = data + slot.offset;
      const int64_t n = slot.shape.numel();
      const bool is_gain = slot.name.ends_with("_w") && slot.shape.rank() == 1;
      if (slot.shape.rank() == 2) {
        const bool residual = slot.name == "proj_w" || slot.name == "fcproj_w";
        std::normal_distribution<float> normal(0.0f,
                                               static_cast<float>(residual ? residual_std : 0.02));
        for (int64_t i = 0; i < n; ++i) begin[i] = normal(rng);
      } else {
        std::fill(begin, begin + n, is_gain ? 1.0f : 0.0f);
      }
    }
  }
  for (Tensor& t : exp_avg_) std::memset(t.raw_data(), 0, static_cast<size_t>(t.bytes()));
  for (Tensor& t : exp_avg_sq_) std::memset(t.raw_data(), 0, static_cast<size_t>(t.bytes()));
  steps_taken_ = 0;
}

Result<Gpt2Trainer::ParameterRef> Gpt2Trainer::FindParameter(const std::string& name) const {
  for (size_t g = 0; g < model_.layers.size(); ++g) {
    const LayerSpec& layer = model_.layers[g];
    const std::string prefix = NamePrefix(layer);
    if (!name.starts_with(prefix)) continue;
    Result<const FlatSlot*> slot = layer.params.Find(name.substr(prefix.size()));
    if (slot.ok()) return ParameterRef{g, *slot};
  }
  return InvalidArgument("the model has no parameter named '{}'", name);
}

std::vector<std::string> Gpt2Trainer::ParameterNames() const {
  std::vector<std::string> names;
  for (const LayerSpec& layer : model_.layers) {
    for (const FlatSlot& slot : layer.params.slots())
      names.push_back(NamePrefix(layer) + slot.name);
  }
  return names;
}

Status Gpt2Trainer::SetParameter(const std::string& name, const std::vector<float>& values,
                                 const Shape& shape) {
  TESSERA_ASSIGN_OR_RETURN(ParameterRef ref, FindParameter(name));
  if (shape != ref.slot->shape || static_cast<int64_t>(values.size()) != shape.numel()) {
    return InvalidArgument("parameter '{}' has shape {} in the model but {} ({} values) was given",
                           name, ref.slot->shape.ToString(), shape.ToString(), values.size());
  }
  std::memcpy(params_[ref.group].data<float>() + ref.slot->offset, values.data(),
              values.size() * sizeof(float));
  return Status::Ok();
}

Result<std::vector<float>> Gpt2Trainer::GetParameter(const std::string& name) const {
  TESSERA_ASSIGN_OR_RETURN(ParameterRef ref, FindParameter(name));
  const float* begin = params_[ref.group].data<float>() + ref.slot->offset;
  return std::vector<float>(begin, begin + ref.slot->shape.numel());
}

Result<std::vector<float>> Gpt2Trainer::GetGradient(const std::string& name) const {
  TESSERA_ASSIGN_OR_RETURN(ParameterRef ref, FindParameter(name));
  if (last_grads_.empty()) {
    return InvalidArgument("no gradients kept: call set_keep_gradients(true), then Step");
  }
  const float* begin = last_grads_[ref.group].data<float>() + ref.slot->offset;
  return std::vector<float>(begin, begin + ref.slot->shape.numel());
}

Result<Tensor> Gpt2Trainer::Scalar(DType dtype, double value) const {
  TESSERA_ASSIGN_OR_RETURN(
      Tensor t, Tensor::Empty(TensorMeta{Shape{}, dtype, Device::Cpu()}, executor_->allocator()));
  if (dtype == DType::kI64) {
    *t.data<int64_t>() = static_cast<int64_t>(value);
  } else {
    *t.data<float>() = static_cast<float>(value);
  }
  return t;
}

Result<Tensor> Gpt2Trainer::Tokens(const std::vector<int32_t>& tokens, int64_t batch,
                                   int64_t seq_len) const {
  if (static_cast<int64_t>(tokens.size()) != batch * seq_len) {
    return InvalidArgument("batch has {} tokens but [{}, {}] needs {}", tokens.size(), batch,
                           seq_len, batch * seq_len);
  }
  TESSERA_ASSIGN_OR_RETURN(
      Tensor t, Tensor::Empty(TensorMeta{Shape{batch, seq_len}, DType::kI32, Device::Cpu()},
                              executor_->allocator()));
  std::memcpy(t.raw_data(), tokens.data(), tokens.size() * sizeof(int32_t));
  return t;
}

Result<StepReport> Gpt2Trainer::Step(const std::vector<int32_t>& tokens,
                                     const std::vector<int32_t>& targets, float lr) {
  TESSERA_RETURN_IF_ERROR(CheckTokenRange(tokens, "token"));
  TESSERA_RETURN_IF_ERROR(CheckTokenRange(targets, "target"));
  const int64_t step_number = steps_taken_ + 1;
  ObjectMap inputs;
  TESSERA_ASSIGN_OR_RETURN(inputs[step_graph_.tokens], Tokens(tokens, plan_.batch, plan_.seq_len));
  TESSERA_ASSIGN_OR_RETURN(inputs[step_graph_.targets],
                           Tokens(targets, plan_.batch, plan_.seq_len));
  TESSERA_ASSIGN_OR_RETURN(inputs[step_graph_.lr], Scalar(DType::kF32, lr));
  TESSERA_ASSIGN_OR_RETURN(inputs[step_graph_.step],
                           Scalar(DType::kI64, static_cast<double>(step_number)));
  // Move the state in so the optimizer updates it in place; it comes back as outputs. If the
  // run fails before the optimizer touched a group, the executor hands that group back.
  for (size_t g = 0; g < step_graph_.groups.size(); ++g) {
    const ParameterGroupObjects& group = step_graph_.groups[g];
    inputs[group.param] = std::move(params_[g]);
    if (group.exp_avg.valid()) {
      inputs[group.exp_avg] = std::move(exp_avg_[g]);
      inputs[group.exp_avg_sq] = std::move(exp_avg_sq_[g]);
    }
  }
  ObjectMap intact;
  Result<RunResult> run = executor_->Run(*prepared_step_, std::move(inputs), &intact);
  if (!run.ok()) return RecoverState(run.status(), intact);
  ObjectMap& outputs = run->outputs;
  last_grads_.clear();
  for (size_t g = 0; g < step_graph_.groups.size(); ++g) {
    const ParameterGroupObjects& group = step_graph_.groups[g];
    params_[g] = std::move(outputs[group.next_param]);
    if (group.exp_avg.valid()) {
      exp_avg_[g] = std::move(outputs[group.next_exp_avg]);
      exp_avg_sq_[g] = std::move(outputs[group.next_exp_avg_sq]);
    }
    if (keep_gradients_) last_grads_.push_back(std::move(outputs[group.grad]));
  }
  steps_taken_ = step_number;
  StepReport report;
  report.step = step_number;
  report.loss = *outputs[step_graph_.loss].data<float>();
  report.grad_norm = *outputs[step_graph_.grad_norm].data<float>();
  report.step_ms = run->stats.wall_ms;
  report.peak_bytes = run->stats.peak_bytes;
  return report;
}

Status Gpt2Trainer::RecoverState(const Status& error, ObjectMap& intact) {
  std::vector<std::string> lost;
  for (size_t g = 0; g < step_graph_.groups.size(); ++g) {
    const ParameterGroupObjects& group = step_graph_.groups[g];
    auto take = [&](ObjectId id, Tensor& slot) {
      auto it = intact.find(id);
      if (it != intact.end()) {
        slot = std::move(it->second);
      } else {
        lost.push_back(step_graph_.graph.object(id).name);
      }
    };
    take(group.param, params_[g]);
    if (group.exp_avg.valid()) {
      take(group.exp_avg, exp_avg_[g]);
      take(group.exp_avg_sq, exp_avg_sq_[g]);
    }
  }
  if (lost.empty()) return error;  // state unchanged; the step can be retried
  return DataLoss(
      "{}; the step failed after the optimizer had updated {} object(s) in place "
      "(e.g. '{}'): restore the model from a checkpoint",
      error.ToString(), lost.size(), lost.front());
}

Status Gpt2Trainer::CheckTokenRange(const std::vector<int32_t>& tokens, const char* what) const {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= model_.config.vocab) {
      return InvalidArgument(
          "{} id {} at index {} is outside the vocabulary [0, {}); use a "
          "larger --vocab or other data",
          what, tokens[i], i, model_.config.vocab);
    }
  }
  return Status::Ok();
}

Result<float> Gpt2Trainer::EvalLoss(const std::vector<int32_t>& tokens,
                                    const std::vector<int32_t>& targets) {
  ObjectMap inputs;
  TESSERA_ASSIGN_OR_RETURN(inputs[eval_graph_.tokens], Tokens(tokens, plan_.batch, plan_.seq_len));
  TESSERA_ASSIGN_OR_RETURN(inputs[eval_graph_.targets],
                           Tokens(targets, plan_.batch, plan_.seq_len));
  for (size_t g = 0; g < params_.size(); ++g) inputs[eval_graph_.params[g]] = params_[g];
  TESSERA_ASSIGN_OR_RETURN(RunResult run, executor_->Run(*prepared_eval_, std::move(inputs)));
  return *run.outputs[eval_graph_.result].data<float>();
}

Result<std::vector<float>> Gpt2Trainer::Logits(const std::vector<int32_t>& tokens, int64_t batch,
                                               int64_t seq_len) {
  const auto key = std::make_pair(batch, seq_len);
  auto it = logits_graphs_.find(key);
  if (it == logits_graphs_.end()) {
    TESSERA_ASSIGN_OR_RETURN(ForwardGraph graph, PlanLogits(model_, batch, seq_len, *registry_));
    TESSERA_ASSIGN_OR_RETURN(PreparedGraph prepared, executor_->Prepare(graph.graph));
    it = logits_graphs_.emplace(key, std::make_pair(std::move(graph), std::move(prepared))).first;
  }
  const ForwardGraph& graph = it->second.first;
  ObjectMap inputs;
  TESSERA_ASSIGN_OR_RETURN(inputs[graph.tokens], Tokens(tokens, batch, seq_len));
  for (size_t g = 0; g < params_.size(); ++g) inputs[graph.params[g]] = params_[g];
  TESSERA_ASSIGN_OR_RETURN(RunResult run, executor_->Run(it->second.second, std::move(inputs)));
  const Tensor& logits = run.outputs[graph.result];
  const float* data = logits.data<float>();
  return std::vector<float>(data, data + logits.numel());
}

int64_t Gpt2Trainer::ParameterBytes() const {
  int64_t bytes = 0;
  for (const Tensor& t : params_) bytes += t.bytes();
  return bytes;
}

int64_t Gpt2Trainer::OptimizerStateBytes() const {
  int64_t bytes = 0;
  for (const Tensor& t : exp_avg_) bytes += t.bytes();
  for (const Tensor& t : exp_avg_sq_) bytes += t.bytes();
  return bytes;
}

}  // namespace tessera

#include "zero/step_graph.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "core/collective_task.h"
#include "ops/flat_layout.h"
#include "ops/graph_builder.h"
#include "ops/standard_ops.h"

namespace tessera {

namespace {

// Priorities among ready tasks: finish backward work before starting more forward work (what
// yields 1F1B in pipelines), and keep optimizer updates behind both.
constexpr int32_t kForwardPriority = 1;
constexpr int32_t kBackwardPriority = 2;
constexpr int32_t kOptimizerPriority = 0;

TensorMeta F32(Shape shape, Device device = Device::Cpu()) {
  return TensorMeta{std::move(shape), DType::kF32, device};
}

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
                               const std::vector<ObjectId>& params, const Attrs& attrs) {
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
                                         int64_t param_multiple) {
  std::vector<ObjectId> params;
  for (const LayerSpec& layer : model.layers) {
    params.push_back(builder.AddInput(layer.name + ".params",
                                      F32({PaddedNumel(layer.params.numel(), param_multiple)}),
                                      ObjectRole::kParameter));
  }
  return params;
}

}  // namespace

int64_t ParallelConfig::PaddedGroup(int64_t numel) const {
  return PaddedNumel(numel, sharded_optimizer() ? data_parallel : 1);
}

std::string ParallelConfig::ToString() const {
  return fmt::format("data_parallel={} zero_stage={} offload={} grad_accum={}", data_parallel,
                     zero_stage, offload == OffloadMode::kOptimizer ? "optimizer" : "none",
                     grad_accum);
}

Result<OffloadMode> ParseOffload(std::string_view text) {
  if (text == "none") return OffloadMode::kNone;
  if (text == "optimizer") return OffloadMode::kOptimizer;
  return InvalidArgument("offload '{}' is not one of: none, optimizer", text);
}

const char* StateKindName(StateKind kind) {
  switch (kind) {
    case StateKind::kParameter:
      return "params";
    case StateKind::kExpAvg:
      return "exp_avg";
    case StateKind::kExpAvgSq:
      return "exp_avg_sq";
    case StateKind::kMasterParameter:
      return "master_params";
  }
  return "?";
}

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
  const ParallelConfig& p = parallel;
  if (p.zero_stage < 0 || p.zero_stage > 3) {
    return InvalidArgument(
        "ZeRO stage {} does not exist: use 0 (data parallel), 1 (optimizer state sharded), 2 "
        "(+ gradients sharded) or 3 (+ parameters sharded)",
        p.zero_stage);
  }
  if (p.data_parallel < 1) {
    return InvalidArgument("data_parallel (--workers) must be >= 1, got {}", p.data_parallel);
  }
  if (p.grad_accum < 1) {
    return InvalidArgument("grad_accum must be >= 1, got {}", p.grad_accum);
  }
  if (p.prefetch_layers < 0) {
    return InvalidArgument("prefetch_layers must be >= 0, got {}", p.prefetch_layers);
  }
  if (o.kind == OptimizerConfig::Kind::kSgd && p.zero_stage >= 1 && p.data_parallel > 1) {
    return InvalidArgument("SGD has no optimizer state to shard: use ZeRO stage 0 or AdamW");
  }
  const int64_t splits = int64_t{p.data_parallel} * p.grad_accum;
  if (batch % splits != 0) {
    return InvalidArgument(
        "the batch of {} rows does not split evenly over {} worker(s) x {} micro-batch(es): use "
        "a batch that is a multiple of {} (e.g. {}), or change --workers / --grad-accum",
        batch, p.data_parallel, p.grad_accum, splits, (batch / splits + 1) * splits);
  }
  if (!p.workers.empty() && static_cast<int>(p.workers.size()) != p.data_parallel) {
    return InvalidArgument("{} worker(s) given for {} data-parallel ranks", p.workers.size(),
                           p.data_parallel);
  }
  return Status::Ok();
}

namespace {

// Builds the step graph of a TrainingPlan; see the header comment for what each stage places
// where. Ranks are numbered 0..N-1; rank r's tasks are pinned to parallel.workers[r].
class StepPlanner {
 public:
  StepPlanner(const ModelSpec& model, const TrainingPlan& plan, const OpRegistry& registry)
      : model_(model),
        plan_(plan),
        p_(plan.parallel),
        n_(plan.parallel.data_parallel),
        k_(plan.parallel.grad_accum),
        layers_(model.layers.size()),
        adamw_(plan.optimizer.kind == OptimizerConfig::Kind::kAdamW),
        offload_(plan.parallel.offload == OffloadMode::kOptimizer && !plan.device.is_cpu()),
        builder_(registry) {
    layer_attrs_ = Gpt2Attrs(model.config);
    if (p_.sharded_optimizer()) layer_attrs_.Set(kParamMultipleAttr, int64_t{n_});
  }

  Result<StepGraph> Build() {
    step_.parallel = p_;
    step_.micro_batch = p_.micro_batch(plan_.batch);
    for (const LayerSpec& layer : model_.layers) {
      step_.group_numel.push_back(p_.PaddedGroup(layer.params.numel()));
    }
    AddInputs();
    for (int r = 0; r < n_; ++r) TESSERA_RETURN_IF_ERROR(AddRank(r));
    TESSERA_RETURN_IF_ERROR(AddReductionsAfterBackward());
    RecordGradients();
    TESSERA_RETURN_IF_ERROR(AddLoss());
    TESSERA_RETURN_IF_ERROR(AddClipping());
    TESSERA_RETURN_IF_ERROR(AddDownloads());
    for (int r = 0; r < n_; ++r) TESSERA_RETURN_IF_ERROR(AddOptimizer(r));
    TESSERA_ASSIGN_OR_RETURN(step_.graph, builder_.Build());
    return std::move(step_);
  }

 private:
  // Per-rank objects while the graph is being built.
  struct Rank {
    // Per layer: indices into step_.state of this rank's parameters, Adam moments and (offload
    // on GPU workers) host master parameters.
    std::vector<size_t> param, exp_avg, exp_avg_sq, master;
    std::vector<ObjectId> grad;  // per layer: the accumulated gradient (full or shard)
    // Offload on GPU workers: the final gradient and the clipping factor, copied to the host.
    std::vector<ObjectId> host_grad;
    ObjectId host_clip;
    std::vector<ObjectId> losses;  // per micro-batch
    ObjectId clip;
  };

  // "rank1/h.0.params" with several ranks; "h.0.params" on one.
  std::string Name(int r, const std::string& name) const {
    return n_ > 1 ? fmt::format("rank{}/{}", r, name) : name;
  }
  std::string Micro(int k, const std::string& name) const {
    return k_ > 1 ? fmt::format("{}@{}", name, k) : name;
  }
  TaskOptions On(int r, const std::string& layer, int32_t priority,
                 std::vector<std::string> output_names = {},
                 std::vector<ObjectRole> output_roles = {}) const {
    TaskOptions options =
        Options(layer, priority, std::move(output_names), std::move(output_roles));
    if (!p_.workers.empty()) options.pinned_worker = p_.workers[static_cast<size_t>(r)];
    options.device_kind = plan_.device.kind;
    return options;
  }
  // A task of the optimizer step: on the host when offloaded, else with the rest.
  TaskOptions OnOptimizerDevice(int r, const std::string& layer,
                                std::vector<std::string> output_names = {},
                                std::vector<ObjectRole> output_roles = {}) const {
    TaskOptions options =
        On(r, layer, kOptimizerPriority, std::move(output_names), std::move(output_roles));
    if (offload_) options.device_kind = DeviceKind::kCpu;
    return options;
  }
  Device OptimizerDevice() const { return offload_ ? Device::Cpu() : plan_.device; }
  Attrs Collective(int64_t id, int r) const {
    return Attrs{{kCollectiveAttr, id}, {kRankAttr, int64_t{r}}, {kGroupSizeAttr, int64_t{n_}}};
  }
  int64_t Shard(size_t l) const { return step_.group_numel[l] / n_; }
  const std::string& LayerName(size_t l) const { return model_.layers[l].name; }

  void AddInputs() {
    const TensorMeta tokens{Shape{step_.micro_batch, plan_.seq_len}, DType::kI32, plan_.device};
    for (int r = 0; r < n_; ++r) {
      for (int k = 0; k < k_; ++k) {
        step_.tokens.push_back(
            builder_.AddInput(Name(r, Micro(k, "tokens")), tokens, ObjectRole::kInput));
        step_.targets.push_back(
            builder_.AddInput(Name(r, Micro(k, "targets")), tokens, ObjectRole::kInput));
      }
    }
    step_.lr = builder_.AddInput("lr", F32(Shape{}, OptimizerDevice()), ObjectRole::kInput);
    step_.step = builder_.AddInput("step", TensorMeta{Shape{}, DType::kI64, OptimizerDevice()},
                                   ObjectRole::kInput);
    ranks_.resize(static_cast<size_t>(n_));
    for (int r = 0; r < n_; ++r) {
      Rank& rank = ranks_[static_cast<size_t>(r)];
      for (size_t l = 0; l < layers_; ++l) {
        const int64_t full = step_.group_numel[l];
        const int64_t shard = p_.sharded_optimizer() ? Shard(l) : full;
        const int64_t begin = p_.sharded_optimizer() ? r * shard : 0;
        const int64_t param_numel = p_.sharded_parameters() ? shard : full;
        const int64_t param_begin = p_.sharded_parameters() ? begin : 0;
        rank.param.push_back(AddState(StateKind::kParameter, r, l, param_begin, param_numel,
                                      ObjectRole::kParameter, plan_.device));
        if (offload_) {
          rank.master.push_back(AddState(StateKind::kMasterParameter, r, l, begin, shard,
                                         ObjectRole::kParameter, Device::Cpu()));
        }
        if (adamw_) {
          rank.exp_avg.push_back(AddState(StateKind::kExpAvg, r, l, begin, shard,
                                          ObjectRole::kOptimizerState, OptimizerDevice()));
          rank.exp_avg_sq.push_back(AddState(StateKind::kExpAvgSq, r, l, begin, shard,
                                             ObjectRole::kOptimizerState, OptimizerDevice()));
        }
      }
    }
  }

  // Adds a state input; returns its index in step_.state.
  size_t AddState(StateKind kind, int r, size_t l, int64_t begin, int64_t numel, ObjectRole role,
                  Device device) {
    std::string name = fmt::format("{}.{}", LayerName(l), StateKindName(kind));
    if (p_.sharded_optimizer() && numel != step_.group_numel[l]) name += "[shard]";
    StateObject object{.kind = kind, .piece = GroupPiece{l, r, begin, numel}};
    object.input = builder_.AddInput(Name(r, name), F32({numel}, device), role);
    step_.state.push_back(object);
    return step_.state.size() - 1;
  }

  // The parameters layer l's ops read on rank r: the state itself, or (ZeRO-3) a gather of
  // every rank's shard, ordered after `after` (prefetch: not before that object exists).
  Result<ObjectId> LayerParams(int r, size_t l, const std::string& when, ObjectId after) {
    Rank& rank = ranks_[static_cast<size_t>(r)];
    const ObjectId param = step_.state[rank.param[l]].input;
    if (!p_.sharded_parameters()) return param;
    std::vector<ObjectId> inputs{param};
    if (after.valid()) inputs.push_back(after);
    const std::string name = fmt::format("{}/gather_{}", LayerName(l), when);
    TESSERA_ASSIGN_OR_RETURN(
        auto gathered,
        builder_.AddTask(Name(r, name), "all_gather", std::move(inputs),
                         Collective(CollectiveId(name), r),
                         On(r, LayerName(l), kForwardPriority + 1, {Name(r, name + ":params")},
                            {ObjectRole::kGatheredParameter})));
    return gathered[0];
  }

  // One collective id per (name): every rank's member of "h.0/gather_forward@1" shares it.
  int64_t CollectiveId(const std::string& name) {
    auto [it, inserted] = collective_ids_.emplace(name, collective_ids_.size() + 1);
    return it->second;
  }

  ObjectRole FullGradientRole() const {
    return p_.zero_stage >= 2 && n_ > 1 ? ObjectRole::kGradientBucket : ObjectRole::kGradient;
  }

  Status AddRank(int r) {
    Rank& rank = ranks_[static_cast<size_t>(r)];
    rank.grad.assign(layers_, ObjectId());
    for (int k = 0; k < k_; ++k) TESSERA_RETURN_IF_ERROR(AddMicroBatch(r, k));
    return Status::Ok();
  }

  Status AddMicroBatch(int r, int k) {
    Rank& rank = ranks_[static_cast<size_t>(r)];
    const size_t index = static_cast<size_t>(r * k_ + k);
    const ObjectId tokens = step_.tokens[index], targets = step_.targets[index];
    const size_t head = layers_ - 1;
    const auto task = [&](size_t l, const char* what) {
      return Name(r, Micro(k, LayerName(l) + "/" + what));
    };
    const auto object = [&](const std::string& name) { return Name(r, Micro(k, name)); };
    const int prefetch = p_.prefetch_layers;

    // Forward. act[l] is the activation entering layer l (act[0]: none, tokens instead).
    std::vector<ObjectId> act(layers_), saved(layers_);
    std::vector<ObjectId> params(layers_);
    for (size_t l = 0; l < head; ++l) {
      const ObjectId after =
          l >= static_cast<size_t>(prefetch) + 1 ? act[l - prefetch] : ObjectId();
      TESSERA_ASSIGN_OR_RETURN(params[l], LayerParams(r, l, Micro(k, "forward"), after));
      if (l == 0) {
        TESSERA_ASSIGN_OR_RETURN(
            auto x,
            builder_.AddTask(task(l, "forward"), "gpt2_embedding_forward", {tokens, params[l]},
                             layer_attrs_, On(r, LayerName(l), kForwardPriority)));
        act[1] = x[0];
      } else {
        TESSERA_ASSIGN_OR_RETURN(
            auto y, builder_.AddTask(task(l, "forward"), "gpt2_block_forward", {act[l], params[l]},
                                     layer_attrs_, On(r, LayerName(l), kForwardPriority)));
        act[l + 1] = y[0];
        saved[l] = y[1];
      }
    }
    // The head reads its own parameters and the (tied) embedding's, in forward and backward:
    // with ZeRO-3 both are gathered once for the two.
    const ObjectId head_after =
        head >= static_cast<size_t>(prefetch) + 1 ? act[head - prefetch] : ObjectId();
    TESSERA_ASSIGN_OR_RETURN(ObjectId head_params,
                             LayerParams(r, head, Micro(k, "head"), head_after));
    TESSERA_ASSIGN_OR_RETURN(ObjectId tied, LayerParams(r, 0, Micro(k, "head"), head_after));
    Attrs head_attrs = layer_attrs_;
    const double grad_scale = 1.0 / static_cast<double>(n_ * k_);
    if (n_ * k_ > 1) head_attrs.Set("grad_scale", grad_scale);
    TESSERA_ASSIGN_OR_RETURN(auto head_out,
                             builder_.AddTask(task(head, "forward"), "gpt2_head_forward",
                                              {act[head], head_params, tied, targets}, head_attrs,
                                              On(r, LayerName(head), kForwardPriority,
                                                 {object(n_ * k_ > 1 ? "micro_loss" : "loss"),
                                                  object(LayerName(head) + "/forward:saved")},
                                                 {ObjectRole::kOutput, ObjectRole::kActivation})));
    rank.losses.push_back(head_out[0]);

    // Backward.
    const std::string embedding = LayerName(0);
    TESSERA_ASSIGN_OR_RETURN(
        auto head_grads,
        builder_.AddTask(
            task(head, "backward"), "gpt2_head_backward",
            {act[head], head_out[1], head_params, tied}, layer_attrs_,
            On(r, LayerName(head), kBackwardPriority,
               {object(LayerName(head) + "/backward:dx"), object(LayerName(head) + ".grad"),
                object(embedding + ".grad_from_head")},
               {ObjectRole::kActivation, FullGradientRole(), FullGradientRole()})));
    TESSERA_RETURN_IF_ERROR(AddGradient(r, k, head, head_grads[1]));
    // dy[l]: the gradient entering block l's backward.
    std::vector<ObjectId> dy(layers_);
    dy[head - 1] = head_grads[0];
    for (size_t l = head - 1; l >= 1; --l) {
      ObjectId after = head_out[1];
      if (l + prefetch < head) after = dy[l + prefetch];
      ObjectId block_params = params[l];
      if (p_.sharded_parameters()) {
        TESSERA_ASSIGN_OR_RETURN(block_params, LayerParams(r, l, Micro(k, "backward"), after));
      }
      TESSERA_ASSIGN_OR_RETURN(
          auto grads, builder_.AddTask(task(l, "backward"), "gpt2_block_backward",
                                       {dy[l], act[l], saved[l], block_params}, layer_attrs_,
                                       On(r, LayerName(l), kBackwardPriority,
                                          {object(LayerName(l) + "/backward:dx"),
                                           object(LayerName(l) + ".grad")},
                                          {ObjectRole::kActivation, FullGradientRole()})));
      dy[l - 1] = grads[0];
      TESSERA_RETURN_IF_ERROR(AddGradient(r, k, l, grads[1]));
    }
    TESSERA_ASSIGN_OR_RETURN(
        auto embedding_grad,
        builder_.AddTask(task(0, "backward"), "gpt2_embedding_backward",
                         {dy[0], tokens, head_grads[2]}, layer_attrs_,
                         On(r, embedding, kBackwardPriority, {object(embedding + ".grad")},
                            {FullGradientRole()})));
    return AddGradient(r, k, 0, embedding_grad[0]);
  }

  // A micro-batch's full gradient of layer l on rank r: reduced now (stage 0: all-reduce on the
  // last micro-batch; stages 2-3: reduce-scatter every micro-batch) or later (stage 1), and
  // accumulated in place over micro-batches.
  Status AddGradient(int r, int k, size_t l, ObjectId full) {
    Rank& rank = ranks_[static_cast<size_t>(r)];
    const std::string& layer = LayerName(l);
    ObjectId grad = full;
    if (n_ > 1 && p_.zero_stage >= 2) {
      const std::string name = Micro(k, layer + "/reduce_scatter");
      TESSERA_ASSIGN_OR_RETURN(
          auto shard, builder_.AddTask(Name(r, name), "reduce_scatter", {full},
                                       Collective(CollectiveId(name), r).Set("reduce", "sum"),
                                       On(r, layer, kBackwardPriority + 1,
                                          {Name(r, Micro(k, layer + ".grad[shard]"))},
                                          {ObjectRole::kGradient})));
      grad = shard[0];
    }
    if (k > 0) {
      TESSERA_ASSIGN_OR_RETURN(
          auto sum,
          builder_.AddTask(Name(r, Micro(k, layer + "/accumulate")), "accumulate",
                           {rank.grad[l], grad}, {},
                           On(r, layer, kBackwardPriority, {Name(r, Micro(k, layer + ".grad_sum"))},
                              {ObjectRole::kGradient})));
      grad = sum[0];
    }
    rank.grad[l] = grad;
    if (k + 1 == k_ && n_ > 1 && p_.zero_stage == 0) {
      const std::string name = layer + "/all_reduce";
      TESSERA_ASSIGN_OR_RETURN(
          auto reduced,
          builder_.AddTask(Name(r, name), "all_reduce", {grad},
                           Collective(CollectiveId(name), r).Set("reduce", "sum"),
                           On(r, layer, kBackwardPriority + 1, {Name(r, layer + ".grad_reduced")},
                              {ObjectRole::kGradient})));
      rank.grad[l] = reduced[0];
    }
    return Status::Ok();
  }

  // ZeRO-1: every gradient is reduce-scattered once the whole backward is done (the last
  // gradient, the embedding's, exists), smallest group first so the peak stays at the full
  // gradients plus one small shard.
  Status AddReductionsAfterBackward() {
    if (n_ == 1 || p_.zero_stage != 1) return Status::Ok();
    std::vector<size_t> order(layers_);
    for (size_t l = 0; l < layers_; ++l) order[l] = l;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return step_.group_numel[a] < step_.group_numel[b];
    });
    for (size_t l : order) {
      const std::string name = LayerName(l) + "/reduce_scatter";
      for (int r = 0; r < n_; ++r) {
        Rank& rank = ranks_[static_cast<size_t>(r)];
        std::vector<ObjectId> inputs{rank.grad[l]};
        if (l != 0) inputs.push_back(rank.grad[0]);  // after the whole backward
        TESSERA_ASSIGN_OR_RETURN(
            auto shard, builder_.AddTask(
                            Name(r, name), "reduce_scatter", std::move(inputs),
                            Collective(CollectiveId(name), r).Set("reduce", "sum"),
                            On(r, LayerName(l), kOptimizerPriority + 1,
                               {Name(r, LayerName(l) + ".grad[shard]")}, {ObjectRole::kGradient})));
        rank.grad[l] = shard[0];
      }
    }
    return Status::Ok();
  }

  void RecordGradients() {
    for (int r = 0; r < n_; ++r) {
      for (size_t l = 0; l < layers_; ++l) {
        const bool sharded = n_ > 1 && p_.zero_stage >= 1;
        const int64_t numel = sharded ? Shard(l) : step_.group_numel[l];
        step_.grads.push_back(GradientObject{GroupPiece{l, r, sharded ? r * numel : 0, numel},
                                             ranks_[static_cast<size_t>(r)].grad[l]});
      }
    }
  }

  // The loss over the global batch: each rank's micro-batch losses (each a mean over its rows)
  // summed and scaled by 1/(N*K), then summed over ranks.
  Status AddLoss() {
    for (int r = 0; r < n_; ++r) {
      Rank& rank = ranks_[static_cast<size_t>(r)];
      ObjectId loss = rank.losses[0];
      if (n_ * k_ > 1) {
        TESSERA_ASSIGN_OR_RETURN(
            auto sum, builder_.AddTask(Name(r, "loss/sum"), "sum_scalars", rank.losses,
                                       Attrs{{"scale", 1.0 / static_cast<double>(n_ * k_)}},
                                       On(r, "", kOptimizerPriority, {Name(r, "loss_part")},
                                          {ObjectRole::kOutput})));
        loss = sum[0];
      }
      if (n_ > 1) {
        TESSERA_ASSIGN_OR_RETURN(
            auto total, builder_.AddTask(Name(r, "loss/all_reduce"), "all_reduce", {loss},
                                         Collective(CollectiveId("loss"), r).Set("reduce", "sum"),
                                         On(r, "", kOptimizerPriority, {Name(r, "loss")},
                                            {ObjectRole::kOutput})));
        loss = total[0];
      }
      if (r == 0) step_.loss = loss;
    }
    builder_.MarkOutput(step_.loss);
    return Status::Ok();
  }

  // Global-norm clipping. Replicated gradients (one rank, or stage 0): every rank sums the
  // squares of every group. Sharded: each rank sums its shards, and the sums are all-reduced.
  Status AddClipping() {
    const bool sharded = n_ > 1 && p_.zero_stage >= 1;
    const Attrs clip_attrs{{"max_norm", plan_.optimizer.max_grad_norm}};
    for (int r = 0; r < n_; ++r) {
      Rank& rank = ranks_[static_cast<size_t>(r)];
      std::vector<ObjectId> sums;
      for (size_t l = 0; l < layers_; ++l) {
        TESSERA_ASSIGN_OR_RETURN(
            auto sum,
            builder_.AddTask(Name(r, LayerName(l) + "/grad_norm"), "sum_of_squares", {rank.grad[l]},
                             {}, On(r, LayerName(l), kOptimizerPriority)));
        sums.push_back(sum[0]);
      }
      if (sharded) {
        TESSERA_ASSIGN_OR_RETURN(auto local,
                                 builder_.AddTask(Name(r, "grad_norm/sum"), "sum_scalars", sums, {},
                                                  On(r, "", kOptimizerPriority)));
        TESSERA_ASSIGN_OR_RETURN(
            auto total,
            builder_.AddTask(Name(r, "grad_norm/all_reduce"), "all_reduce", {local[0]},
                             Collective(CollectiveId("grad_norm"), r).Set("reduce", "sum"),
                             On(r, "", kOptimizerPriority)));
        sums = {total[0]};
      }
      TESSERA_ASSIGN_OR_RETURN(auto clip,
                               builder_.AddTask(Name(r, "clip"), "clip_scale", sums, clip_attrs,
                                                On(r, "", kOptimizerPriority,
                                                   {Name(r, "clip_scale"), Name(r, "grad_norm")},
                                                   {ObjectRole::kOutput, ObjectRole::kOutput})));
      rank.clip = clip[0];
      if (plan_.optimizer.max_grad_norm <= 0) {
        // Clipping off: the factor is 1, known now, so each update waits only for its own
        // gradient and runs during the remaining backward (the norm is still reported).
        TESSERA_ASSIGN_OR_RETURN(
            auto one, builder_.AddTask(Name(r, "clip_off"), "constant", {}, Attrs{{"value", 1.0}},
                                       OnOptimizerDevice(r, "", {Name(r, "clip_scale_one")})));
        rank.clip = one[0];
      }
      if (r == 0) {
        step_.grad_norm = clip[1];
        builder_.MarkOutput(step_.grad_norm);
      }
    }
    return Status::Ok();
  }

  // Offload on GPU workers: each final gradient (piece) and the clipping factor are copied to
  // the host as soon as they exist; a layer's copy waits for nothing but its own reduction.
  Status AddDownloads() {
    if (!offload_) return Status::Ok();
    for (int r = 0; r < n_; ++r) {
      Rank& rank = ranks_[static_cast<size_t>(r)];
      for (size_t l = 0; l < layers_; ++l) {
        const std::string& layer = LayerName(l);
        TaskOptions options = On(r, layer, kBackwardPriority + 1, {Name(r, layer + ".grad.host")},
                                 {ObjectRole::kGradient});
        options.device_kind = DeviceKind::kCpu;
        TESSERA_ASSIGN_OR_RETURN(
            auto host, builder_.AddTask(Name(r, layer + "/grad_to_host"), "copy", {rank.grad[l]},
                                        {}, std::move(options)));
        rank.host_grad.push_back(host[0]);
      }
      if (plan_.optimizer.max_grad_norm <= 0) {
        rank.host_clip = rank.clip;  // the constant 1, already on the host
        continue;
      }
      TESSERA_ASSIGN_OR_RETURN(
          auto clip, builder_.AddTask(Name(r, "clip_to_host"), "copy", {rank.clip}, {},
                                      OnOptimizerDevice(r, "", {Name(r, "clip_scale.host")})));
      rank.host_clip = clip[0];
    }
    return Status::Ok();
  }

  Status AddOptimizer(int r) {
    Rank& rank = ranks_[static_cast<size_t>(r)];
    const ObjectId clip = offload_ ? rank.host_clip : rank.clip;
    for (size_t l = 0; l < layers_; ++l) {
      const std::string& layer = LayerName(l);
      StateObject& param = step_.state[rank.param[l]];
      // The parameters the update writes: the host master piece (offload) or the parameters.
      StateObject& target = offload_ ? step_.state[rank.master[l]] : param;
      const ObjectId grad = offload_ ? rank.host_grad[l] : rank.grad[l];
      const std::string target_name = offload_ ? ".master_params" : ".params";
      const FlatLayout& layout = model_.layers[l].params;
      if (!adamw_) {
        TESSERA_ASSIGN_OR_RETURN(
            auto updated,
            builder_.AddTask(Name(r, layer + "/sgd"), "sgd", {target.input, grad, clip, step_.lr},
                             Attrs{{"weight_decay", plan_.optimizer.weight_decay}},
                             OnOptimizerDevice(r, layer, {Name(r, layer + target_name + ".next")},
                                               {ObjectRole::kParameter})));
        target.output = updated[0];
        TESSERA_RETURN_IF_ERROR(AddParameterUpload(r, l));
        continue;
      }
      StateObject& exp_avg = step_.state[rank.exp_avg[l]];
      StateObject& exp_avg_sq = step_.state[rank.exp_avg_sq[l]];
      Attrs attrs{{"beta1", plan_.optimizer.beta1},
                  {"beta2", plan_.optimizer.beta2},
                  {"eps", plan_.optimizer.eps},
                  {"weight_decay", plan_.optimizer.weight_decay},
                  {"decay_ranges", layout.DecayRanges()}};
      // The updated piece is a shard inside full parameters (stages 1-2), or the piece itself
      // (a parameter shard at stage 3, or an offloaded master piece), at element `begin`.
      const bool piece_is_target = p_.sharded_parameters() || offload_;
      const bool shard_in_full = p_.sharded_optimizer() && !piece_is_target;
      if (shard_in_full) attrs.Set("param_offset", exp_avg.piece.begin);
      if (p_.sharded_optimizer() && piece_is_target) {
        attrs.Set("element_offset", exp_avg.piece.begin);
      }
      const std::string suffix = p_.sharded_optimizer() ? "[shard]" : "";
      TESSERA_ASSIGN_OR_RETURN(
          auto updated,
          builder_.AddTask(
              Name(r, layer + "/adamw"), "adamw",
              {target.input, grad, exp_avg.input, exp_avg_sq.input, clip, step_.lr, step_.step},
              std::move(attrs),
              OnOptimizerDevice(
                  r, layer,
                  {Name(r, layer + target_name + (piece_is_target ? suffix : "") + ".next"),
                   Name(r, layer + ".exp_avg" + suffix + ".next"),
                   Name(r, layer + ".exp_avg_sq" + suffix + ".next")},
                  {ObjectRole::kParameter, ObjectRole::kOptimizerState,
                   ObjectRole::kOptimizerState})));
      target.output = updated[0];
      exp_avg.output = updated[1];
      exp_avg_sq.output = updated[2];
      builder_.MarkOutput(exp_avg.output);
      builder_.MarkOutput(exp_avg_sq.output);
      if (shard_in_full) {
        // Every rank updated its shard inside its full copy: exchange the shards in place.
        TESSERA_ASSIGN_OR_RETURN(
            param.output, GatherShards(r, l, "all_gather_in_place", param.output, ".gathered"));
      }
      TESSERA_RETURN_IF_ERROR(AddParameterUpload(r, l));
    }
    return Status::Ok();
  }

  // Offload: the updated master piece goes back to the GPU as the next step's parameters (at
  // stages 1-2 every rank's uploaded shard is all-gathered into the full parameters).
  // Everything else: the update wrote the parameters themselves.
  Status AddParameterUpload(int r, size_t l) {
    Rank& rank = ranks_[static_cast<size_t>(r)];
    StateObject& param = step_.state[rank.param[l]];
    if (offload_) {
      StateObject& master = step_.state[rank.master[l]];
      builder_.MarkOutput(master.output);
      const std::string& layer = LayerName(l);
      const bool gather = p_.sharded_optimizer() && !p_.sharded_parameters();
      const std::string uploaded_name =
          layer + ".params" + (p_.sharded_optimizer() ? "[shard]" : "") + (gather ? "" : ".next");
      TESSERA_ASSIGN_OR_RETURN(
          auto uploaded,
          builder_.AddTask(Name(r, layer + "/params_to_device"), "copy", {master.output}, {},
                           On(r, layer, kOptimizerPriority, {Name(r, uploaded_name)},
                              {ObjectRole::kParameter})));
      param.output = uploaded[0];
      if (gather) {
        TESSERA_ASSIGN_OR_RETURN(param.output,
                                 GatherShards(r, l, "all_gather", param.output, ".next"));
      }
    }
    builder_.MarkOutput(param.output);
    return Status::Ok();
  }

  // Rank r's member of the gather of layer l's updated parameter shards (`op`: all_gather, or
  // all_gather_in_place inside the full parameters); returns "<layer>.params<suffix>".
  Result<ObjectId> GatherShards(int r, size_t l, const char* op, ObjectId input,
                                const char* suffix) {
    const std::string& layer = LayerName(l);
    const std::string name = layer + "/all_gather";
    TESSERA_ASSIGN_OR_RETURN(
        auto gathered,
        builder_.AddTask(Name(r, name), op, {input}, Collective(CollectiveId(name), r),
                         On(r, layer, kOptimizerPriority, {Name(r, layer + ".params" + suffix)},
                            {ObjectRole::kParameter})));
    return gathered[0];
  }

  const ModelSpec& model_;
  const TrainingPlan& plan_;
  const ParallelConfig& p_;
  const int n_, k_;
  const size_t layers_;
  const bool adamw_;
  const bool offload_;  // offload to the host tier of GPU workers (a no-op on CPU workers)
  GraphBuilder builder_;
  Attrs layer_attrs_;
  StepGraph step_;
  std::vector<Rank> ranks_;
  std::map<std::string, int64_t> collective_ids_;
};

}  // namespace

Result<StepGraph> PlanTrainingStep(const ModelSpec& model, const TrainingPlan& plan,
                                   const OpRegistry& registry) {
  TESSERA_RETURN_IF_ERROR(plan.Validate(model));
  const ParallelConfig& p = plan.parallel;
  if (p.workers.empty() && p.data_parallel > 1) {
    return InvalidArgument(
        "{} data-parallel ranks need a worker each: run on a cluster with at least {} workers",
        p.data_parallel, p.data_parallel);
  }
  return StepPlanner(model, plan, registry).Build();
}

namespace {

Result<ForwardGraph> PlanForward(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                 const OpRegistry& registry, int64_t param_multiple, bool logits) {
  if (param_multiple < 1) return InvalidArgument("param_multiple must be >= 1");
  TESSERA_RETURN_IF_ERROR(CheckShapeOfBatch(model, batch, seq_len));
  GraphBuilder builder(registry);
  ForwardGraph result;
  const TensorMeta token_meta{Shape{batch, seq_len}, DType::kI32, Device::Cpu()};
  result.tokens = builder.AddInput("tokens", token_meta, ObjectRole::kInput);
  if (!logits) result.targets = builder.AddInput("targets", token_meta, ObjectRole::kInput);
  result.params = AddParameterInputs(builder, model, param_multiple);
  Attrs attrs = Gpt2Attrs(model.config);
  if (param_multiple > 1) attrs.Set(kParamMultipleAttr, param_multiple);
  TESSERA_ASSIGN_OR_RETURN(ForwardPass forward,
                           AddForward(builder, model, result.tokens, result.params, attrs));
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
                                  const OpRegistry& registry, int64_t param_multiple) {
  return PlanForward(model, batch, seq_len, registry, param_multiple, /*logits=*/false);
}

Result<ForwardGraph> PlanLogits(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                const OpRegistry& registry, int64_t param_multiple) {
  return PlanForward(model, batch, seq_len, registry, param_multiple, /*logits=*/true);
}

}  // namespace tessera

#include "planner/step_graph.h"

#include <algorithm>
#include <limits>
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

Status CheckShapeOfBatch(const ModelSpec& model, int64_t batch, int64_t seq_len) {
  TESSERA_RETURN_IF_ERROR(model.Validate());
  if (batch <= 0) return InvalidArgument("batch must be positive, got {}", batch);
  for (const ModelInput& input : model.inputs) {
    if (input.shape.rank() < 1 || (input.sequence && input.shape.rank() < 2)) {
      return InvalidArgument("model input '{}' has shape {}: it needs a batch dimension{}",
                             input.name, input.shape.ToString(),
                             input.sequence ? " and a sequence dimension" : "");
    }
    if (input.sequence && (seq_len <= 0 || seq_len > input.shape[1])) {
      return InvalidArgument("seq_len {} must be in [1, {}] (the model's max_seq_len)", seq_len,
                             input.shape[1]);
    }
  }
  return Status::Ok();
}

std::vector<ObjectId> AddParameterInputs(GraphBuilder& builder, const ModelSpec& model,
                                         int64_t param_multiple, Device device = Device::Cpu()) {
  std::vector<ObjectId> params;
  for (const LayerSpec& layer : model.layers) {
    // A layer without parameters has no group (invalid id).
    params.push_back(
        layer.params.numel() == 0
            ? ObjectId()
            : builder.AddInput(layer.name + ".params",
                               F32({PaddedNumel(layer.params.numel(), param_multiple)}, device),
                               ObjectRole::kParameter));
  }
  return params;
}

// Whether a zero-bubble schedule runs layer l's backward as two tasks: the layer has the two
// halves, it returns an input gradient (the half worth running early) and parameter gradients
// (the half that can wait), and no other layer's backward adds to one of the parameter
// gradients it returns (kGradientSoFar: GPT-2's embedding reads the tied classifier's wte
// gradient, which the weight half would make only at the end).
bool SplitsLayerBackward(const ModelSpec& model, size_t l) {
  const LayerSpec& layer = model.layers[l];
  if (layer.backward_input_op.empty()) return false;
  bool input_gradient = false, param_gradient = false;
  for (size_t target : layer.backward_outputs) {
    const LayerArg& arg = layer.forward_args[target];
    if (arg.kind == LayerArg::Kind::kActivation) {
      input_gradient = true;
      continue;
    }
    param_gradient = true;
    for (size_t other = 0; other < model.layers.size(); ++other) {
      const LayerSpec& reader = model.layers[other];
      if (other == l) continue;
      for (const BackwardArg& back : reader.backward_args) {
        if (back.kind == BackwardArg::Kind::kGradientSoFar &&
            reader.forward_args[back.index].index == arg.index) {
          return false;
        }
      }
    }
  }
  return input_gradient && param_gradient;
}

// A layer's attributes in a graph whose groups are padded to a multiple of `param_multiple`.
Attrs LayerAttrs(const LayerSpec& layer, int64_t param_multiple) {
  Attrs attrs = layer.attrs;
  if (param_multiple > 1) attrs.Set(kParamMultipleAttr, param_multiple);
  return attrs;
}

}  // namespace

int64_t ParallelConfig::PaddedGroup(int64_t numel) const {
  return PaddedNumel(numel, sharded_optimizer() ? data_parallel : 1);
}

std::string ParallelConfig::ToString() const {
  std::string text = fmt::format(
      "data_parallel={} zero_stage={} offload={} grad_accum={}", data_parallel, zero_stage,
      offload == OffloadMode::kOptimizer ? "optimizer" : "none", grad_accum);
  if (pipeline_stages > 1 || virtual_stages > 1) {
    text += fmt::format(" pipeline_stages={} schedule={}", pipeline_stages, ScheduleName(schedule));
    if (virtual_stages > 1) text += fmt::format(" virtual_stages={}", virtual_stages);
  }
  return text;
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
  if (p.pipeline_stages < 1) {
    return InvalidArgument("pipeline stages must be >= 1, got {}", p.pipeline_stages);
  }
  if (p.pipeline_stages > 1 || p.virtual_stages > 1) {
    TESSERA_RETURN_IF_ERROR(
        CheckSchedule(p.schedule, p.pipeline_stages, p.grad_accum, p.virtual_stages));
    const size_t chunks = static_cast<size_t>(p.pipeline_stages * p.virtual_stages);
    if (chunks > model.layers.size()) {
      return InvalidArgument(
          "{} pipeline stage(s) x {} virtual stage(s) cut the model into {} chunks, but model "
          "'{}' has {} layers: use at most {} stages",
          p.pipeline_stages, p.virtual_stages, chunks, model.name, model.layers.size(),
          model.layers.size() / static_cast<size_t>(p.virtual_stages));
    }
    if (SplitsBackward(p.schedule)) {
      bool any = false;
      for (size_t l = 0; l < model.layers.size(); ++l) any |= SplitsLayerBackward(model, l);
      if (!any) {
        return Infeasible(
            "schedule {} splits each backward into input and weight gradients, but no layer of "
            "model '{}' has a split backward (one that returns input gradients): use --schedule "
            "1f1b, interleaved or gpipe",
            ScheduleName(p.schedule), model.name);
      }
    }
  }
  if (!p.layer_costs.empty() && p.layer_costs.size() != model.layers.size()) {
    return InvalidArgument("{} layer costs given for a model of {} layers", p.layer_costs.size(),
                           model.layers.size());
  }
  if (!p.layer_op_costs.empty() && p.layer_op_costs.size() != model.layers.size()) {
    return InvalidArgument("{} layer op costs given for a model of {} layers",
                           p.layer_op_costs.size(), model.layers.size());
  }
  if (!p.workers.empty() && static_cast<int>(p.workers.size()) != p.num_workers()) {
    if (p.pipeline_stages > 1) {
      return InvalidArgument(
          "{} worker(s) given for {} pipeline stages x {} data-parallel ranks: a pipeline needs "
          "P x D = {} workers",
          p.workers.size(), p.pipeline_stages, p.data_parallel, p.num_workers());
    }
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
  StepPlanner(const ModelSpec& model, const TrainingPlan& plan, const OpRegistry& registry,
              std::vector<int> layer_chunk)
      : model_(model),
        plan_(plan),
        p_(plan.parallel),
        n_(plan.parallel.data_parallel),
        k_(plan.parallel.grad_accum),
        layers_(model.layers.size()),
        stages_(plan.parallel.pipeline_stages),
        adamw_(plan.optimizer.kind == OptimizerConfig::Kind::kAdamW),
        registry_(registry),
        offload_(plan.parallel.offload == OffloadMode::kOptimizer && !plan.device.is_cpu()),
        builder_(registry) {
    const int64_t multiple = p_.sharded_optimizer() ? n_ : 1;
    for (const LayerSpec& layer : model.layers) {
      layer_attrs_.push_back(LayerAttrs(layer, multiple));
    }
    step_.layer_chunk = std::move(layer_chunk);
    for (size_t l = 0; l < layers_; ++l) {
      step_.layer_stage.push_back(step_.layer_chunk[l] % stages_);
      stage_of_name_[model.layers[l].name] = step_.layer_stage.back();
    }
    const bool zero_bubble = SplitsBackward(p_.schedule) && (stages_ > 1 || p_.virtual_stages > 1);
    for (size_t l = 0; l < layers_; ++l) {
      split_.push_back((zero_bubble || p_.split_backwards) && SplitsLayerBackward(model, l));
    }
    // The layers reading each group; its gradient is complete after the first one's backward.
    readers_.resize(layers_);
    for (size_t l = 0; l < layers_; ++l) {
      for (const LayerArg& arg : model.layers[l].forward_args) {
        if (arg.kind == LayerArg::Kind::kParams) readers_[arg.index].push_back(l);
      }
    }
  }

  Result<StepGraph> Build() {
    step_.parallel = p_;
    step_.micro_batch = p_.micro_batch(plan_.batch);
    ChooseGatherPolicy();
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
    if (stages_ > 1 || p_.virtual_stages > 1) AddScheduleOrder();
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
    std::vector<ObjectId> host_clip;  // per stage
    std::vector<ObjectId> losses;     // per micro-batch
    std::vector<ObjectId> clip;       // per stage: the clipping factor on that stage's worker
    // ZeRO-3 gathered once per step: per layer, its gathered parameters (invalid: not yet).
    std::vector<ObjectId> gathered;
    // Per layer and micro-batch: the forward and backward tasks (for the schedule's order).
    // A split backward's tasks: backward_task is its input half, weight_task its weight half.
    std::vector<std::vector<TaskId>> forward_task, backward_task, weight_task;
  };

  // "rank1/h.0.params" with several ranks; "h.0.params" on one.
  std::string Name(int r, const std::string& name) const {
    return n_ > 1 ? fmt::format("rank{}/{}", r, name) : name;
  }
  std::string Micro(int k, const std::string& name) const {
    return k_ > 1 ? fmt::format("{}@{}", name, k) : name;
  }
  // "stage1/clip" in a pipeline; "clip" otherwise (per-worker tasks of the step).
  std::string Staged(int s, const std::string& name) const {
    return stages_ > 1 ? fmt::format("stage{}/{}", s, name) : name;
  }
  // A task of rank r in stage s, on its worker.
  TaskOptions OnStage(int r, int s, const std::string& layer, int32_t priority,
                      std::vector<std::string> output_names = {},
                      std::vector<ObjectRole> output_roles = {}) const {
    TaskOptions options =
        Options(layer, priority, std::move(output_names), std::move(output_roles));
    options.pinned_worker = p_.WorkerOf(r, s);
    options.device_kind = plan_.device.kind;
    return options;
  }
  // A task of rank r for `layer` (a layer's name): on the worker of its stage.
  TaskOptions On(int r, const std::string& layer, int32_t priority,
                 std::vector<std::string> output_names = {},
                 std::vector<ObjectRole> output_roles = {}) const {
    return OnStage(r, stage_of_name_.at(layer), layer, priority, std::move(output_names),
                   std::move(output_roles));
  }
  // A task of the optimizer step: on the host when offloaded, else with the rest.
  TaskOptions OnOptimizerDevice(TaskOptions options) const {
    options.priority = kOptimizerPriority;
    if (offload_) options.device_kind = DeviceKind::kCpu;
    return options;
  }
  TaskOptions OnOptimizerDevice(int r, const std::string& layer,
                                std::vector<std::string> output_names = {},
                                std::vector<ObjectRole> output_roles = {}) const {
    return OnOptimizerDevice(
        On(r, layer, kOptimizerPriority, std::move(output_names), std::move(output_roles)));
  }
  int StageOf(size_t l) const { return step_.layer_stage[l]; }
  int LossStage() const { return step_.layer_stage[layers_ - 1]; }
  Device OptimizerDevice() const { return offload_ ? Device::Cpu() : plan_.device; }
  Attrs Collective(int64_t id, int r) const {
    return Attrs{{kCollectiveAttr, id}, {kRankAttr, int64_t{r}}, {kGroupSizeAttr, int64_t{n_}}};
  }
  int64_t Shard(size_t l) const { return step_.group_numel[l] / n_; }
  // Layers without parameters (a pooling layer) have no group: no state, gradient or update.
  bool HasParams(size_t l) const { return step_.group_numel[l] > 0; }
  static constexpr size_t kNoState = ~size_t{0};
  const std::string& LayerName(size_t l) const { return model_.layers[l].name; }

  void AddInputs() {
    step_.inputs.resize(model_.inputs.size());
    for (int r = 0; r < n_; ++r) {
      for (int k = 0; k < k_; ++k) {
        for (size_t i = 0; i < model_.inputs.size(); ++i) {
          const ModelInput& input = model_.inputs[i];
          step_.inputs[i].push_back(builder_.AddInput(
              Name(r, Micro(k, input.name)),
              input.Meta(step_.micro_batch, plan_.seq_len, plan_.device), ObjectRole::kInput));
        }
      }
    }
    step_.lr = builder_.AddInput("lr", F32(Shape{}, OptimizerDevice()), ObjectRole::kInput);
    step_.step = builder_.AddInput("step", TensorMeta{Shape{}, DType::kI64, OptimizerDevice()},
                                   ObjectRole::kInput);
    ranks_.resize(static_cast<size_t>(n_));
    for (int r = 0; r < n_; ++r) {
      Rank& rank = ranks_[static_cast<size_t>(r)];
      for (size_t l = 0; l < layers_; ++l) {
        if (!HasParams(l)) {  // keeps rank.param etc. indexed by layer
          for (auto* list : {&rank.param, &rank.master, &rank.exp_avg, &rank.exp_avg_sq}) {
            list->push_back(kNoState);
          }
          continue;
        }
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
    if (step_.gather_once_per_step) {
      if (rank.gathered[l].valid()) return rank.gathered[l];
      TESSERA_ASSIGN_OR_RETURN(rank.gathered[l], GatherForUse(r, l, "step", param, after));
      return rank.gathered[l];
    }
    return GatherForUse(r, l, when, param, after);
  }

  // Rank r's member of the all-gather of layer l's parameter shards, on the layer's stage.
  Result<ObjectId> GatherForUse(int r, size_t l, const std::string& when, ObjectId param,
                                ObjectId after) {
    std::vector<ObjectId> inputs{param};
    // Prefetch order only among tasks of the layer's own stage: an activation of another stage
    // would be pushed here just to order the gather, and would tie this stage's collective
    // order to another stage's progress.
    if (after.valid() && ProducedOnStage(after, StageOf(l))) inputs.push_back(after);
    const std::string name = fmt::format("{}/gather_{}", LayerName(l), when);
    TESSERA_ASSIGN_OR_RETURN(
        auto gathered,
        builder_.AddTask(Name(r, name), "all_gather", std::move(inputs),
                         Collective(CollectiveId(name), r),
                         On(r, LayerName(l), kForwardPriority + 1, {Name(r, name + ":params")},
                            {ObjectRole::kGatheredParameter})));
    return gathered[0];
  }

  // ZeRO-3 with several micro-batches per rank: gather each layer once per step (its stage's
  // parameters stay gathered while the micro-batches run), or before every use.
  void ChooseGatherPolicy() {
    if (!p_.sharded_parameters() || k_ == 1) return;
    // Per micro-batch: one gather before each forward and each backward; per step: one.
    const int64_t gathers_saved = int64_t{2} * k_ - 1;
    switch (p_.gather) {
      case GatherPolicy::kOncePerStep:
        step_.gather_once_per_step = true;
        step_.gather_reason = "asked for (--gather step)";
        break;
      case GatherPolicy::kPerMicroBatch:
        step_.gather_reason =
            "asked for (--gather micro-batch): only prefetch_layers layers' "
            "parameters are gathered at a time";
        break;
      case GatherPolicy::kAuto:
        step_.gather_once_per_step = stages_ > 1;
        step_.gather_reason =
            stages_ > 1
                ? fmt::format(
                      "a pipeline stage holds 1/{} of the layers, so its gathered parameters stay "
                      "while its {} micro-batches run: {} fewer gathers per layer per step",
                      stages_, k_, gathers_saved)
                : fmt::format(
                      "without a pipeline, gathering once per step would hold every layer's "
                      "parameters at once; per micro-batch keeps ZeRO-3's bound of "
                      "prefetch_layers gathered layers (--gather step saves {} gathers per layer)",
                      gathers_saved);
        break;
    }
    if (step_.gather_once_per_step && p_.gather == GatherPolicy::kOncePerStep) {
      step_.gather_reason += fmt::format(": {} fewer gathers per layer per step", gathers_saved);
    }
  }

  // The pipeline schedule as task order: on each worker, its layers' forward and backward
  // tasks chained by control edges in the order ScheduleOrder gives its stage (a chunk's
  // forwards in layer order, its backwards in reverse). Everything else (gradient sums,
  // reductions, gathers, the optimizer) follows its data.
  void AddScheduleOrder() {
    const int virtual_stages = p_.virtual_stages;
    std::vector<std::vector<size_t>> chunk_layers(static_cast<size_t>(stages_ * virtual_stages));
    for (size_t l = 0; l < layers_; ++l) {
      chunk_layers[static_cast<size_t>(step_.layer_chunk[l])].push_back(l);
    }
    if (SplitsBackward(p_.schedule)) step_.schedule_costs = ChunkOpCosts(chunk_layers.size());
    step_.schedule_order =
        ScheduleOrder(p_.schedule, stages_, k_, virtual_stages, step_.schedule_costs);
    const auto& orders = step_.schedule_order;
    for (int r = 0; r < n_; ++r) {
      const Rank& rank = ranks_[static_cast<size_t>(r)];
      for (const std::vector<PipelineOp>& order : orders) {
        TaskId previous;
        auto chain = [&](TaskId task) {
          if (!task.valid()) return;
          if (previous.valid()) builder_.AddControlEdge(previous, task);
          previous = task;
        };
        for (const PipelineOp& op : order) {
          const std::vector<size_t>& layers = chunk_layers[static_cast<size_t>(op.chunk)];
          const size_t micro = static_cast<size_t>(op.micro);
          if (op.kind == PipelineOp::Kind::kForward) {
            for (size_t l : layers) chain(rank.forward_task[l][micro]);
          } else {
            const auto& tasks =
                op.kind == PipelineOp::Kind::kWeight ? rank.weight_task : rank.backward_task;
            for (auto it = layers.rbegin(); it != layers.rend(); ++it) chain(tasks[*it][micro]);
          }
        }
      }
    }
  }

  // The mean cost of one chunk's F, B (input halves and whole backwards) and W (weight halves)
  // for one micro-batch (every layer's over the chunks): measured (ParallelConfig::layer_op_costs),
  // else from the op cost model at the tasks' shapes (rank 0, micro-batch 0; in the units of
  // EstimateLayerCosts, unit costs when the model cannot price an op).
  OpCosts ChunkOpCosts(size_t chunk_count) const {
    const Rank& rank = ranks_[0];
    const Graph& graph = builder_.graph();
    OpCosts total{0, 0, 0};
    for (size_t l = 0; l < layers_; ++l) {
      if (!p_.layer_op_costs.empty()) {  // measured
        total.forward += p_.layer_op_costs[l].forward;
        total.backward += p_.layer_op_costs[l].backward;
        total.weight += p_.layer_op_costs[l].weight;
        continue;
      }
      for (auto [tasks, sum] : {std::pair{&rank.forward_task, &total.forward},
                                std::pair{&rank.backward_task, &total.backward},
                                std::pair{&rank.weight_task, &total.weight}}) {
        const TaskId id = (*tasks)[l][0];
        if (!id.valid()) continue;
        const TaskSpec& task = graph.task(id);
        std::vector<TensorMeta> inputs;
        for (ObjectId input : task.inputs) inputs.push_back(graph.object(input).meta);
        Result<OpCost> cost = registry_.Cost(task.op, inputs, task.attrs);
        if (!cost.ok()) return OpCosts{1, 1, 1};
        *sum += cost->flops + 10 * cost->bytes;
      }
    }
    const double chunks = static_cast<double>(chunk_count);
    return OpCosts{total.forward / chunks, total.backward / chunks, total.weight / chunks};
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
    rank.gathered.assign(layers_, ObjectId());
    rank.forward_task.assign(layers_, std::vector<TaskId>(static_cast<size_t>(k_)));
    rank.backward_task = rank.forward_task;
    rank.weight_task = rank.forward_task;
    for (int k = 0; k < k_; ++k) TESSERA_RETURN_IF_ERROR(AddMicroBatch(r, k));
    return Status::Ok();
  }

  Status AddMicroBatch(int r, int k) {
    const size_t index = static_cast<size_t>(r * k_ + k);
    const size_t loss_layer = layers_ - 1;
    const auto task = [&](size_t l, const char* what) {
      return Name(r, Micro(k, LayerName(l) + "/" + what));
    };
    const auto object = [&](const std::string& name) { return Name(r, Micro(k, name)); };
    const size_t prefetch = static_cast<size_t>(p_.prefetch_layers);
    using Arg = LayerArg::Kind;

    // Forward. args[l]: the objects layer l's forward reads; outputs[l]: what it returns.
    std::vector<std::vector<ObjectId>> args(layers_), outputs(layers_);
    // The first activation each layer reads: ZeRO-3 gathers wait for the one `prefetch` layers
    // back, so at most that many layers' parameters are gathered ahead of use.
    std::vector<ObjectId> entering(layers_);
    for (size_t l = 0; l < layers_; ++l) {
      const LayerSpec& layer = model_.layers[l];
      for (const LayerArg& arg : layer.forward_args) {
        if (arg.kind == Arg::kActivation) {
          entering[l] = outputs[arg.index][static_cast<size_t>(arg.output)];
          break;
        }
      }
      const ObjectId after = l >= prefetch + 1 ? entering[l - prefetch] : ObjectId();
      for (const LayerArg& arg : layer.forward_args) {
        switch (arg.kind) {
          case Arg::kModelInput:
            args[l].push_back(step_.inputs[arg.index][index]);
            break;
          case Arg::kActivation:
            args[l].push_back(outputs[arg.index][static_cast<size_t>(arg.output)]);
            break;
          case Arg::kParams: {
            // The loss layer's gathers serve its backward too (it follows at once).
            const std::string when = layer.loss || arg.index != l ? layer.name : "forward";
            TESSERA_ASSIGN_OR_RETURN(ObjectId params,
                                     LayerParams(r, arg.index, Micro(k, when), after));
            args[l].push_back(params);
            break;
          }
        }
      }
      std::vector<std::string> names;
      std::vector<ObjectRole> roles;
      if (layer.loss) {
        names = {object(n_ * k_ > 1 ? "micro_loss" : "loss")};
        roles = {ObjectRole::kOutput};
      }
      TESSERA_ASSIGN_OR_RETURN(
          outputs[l], builder_.AddTask(
                          task(l, "forward"), layer.forward_op, args[l], AttrsOf(l),
                          On(r, layer.name, kForwardPriority, std::move(names), std::move(roles))));
      Rank& rank = ranks_[static_cast<size_t>(r)];
      rank.forward_task[l][static_cast<size_t>(k)] = ProducerOf(outputs[l][0]);
      if (layer.loss) rank.losses.push_back(outputs[l][0]);
    }

    // Backward, last layer first. output_grads[l][o]: the parts of the gradient of layer l's
    // output o (one per layer reading it); param_grads[g]: the parts of group g's gradient so
    // far. Parts are summed in place in the order they were made.
    std::vector<std::vector<std::vector<ObjectId>>> output_grads(layers_);
    for (size_t l = 0; l < layers_; ++l) {
      output_grads[l].resize(static_cast<size_t>(model_.layers[l].activations));
    }
    std::vector<std::vector<ObjectId>> param_grads(layers_);
    std::vector<ObjectId> entering_grad(layers_);  // the gradient of layer l's output 0
    for (size_t l = layers_; l-- > 0;) {
      const LayerSpec& layer = model_.layers[l];
      std::vector<ObjectId> dy(output_grads[l].size());
      if (!layer.loss) {
        for (size_t o = 0; o < dy.size(); ++o) {
          TESSERA_ASSIGN_OR_RETURN(
              dy[o],
              Sum(r, StageOf(l), object(fmt::format("{}.d{}", layer.name, o)), output_grads[l][o]));
        }
        if (!dy.empty()) entering_grad[l] = dy[0];
      }
      ObjectId after = outputs[loss_layer].back();
      if (l + prefetch < loss_layer) after = entering_grad[l + prefetch];
      // The backward's arguments, and which half of a split backward reads each.
      std::vector<ObjectId> inputs, input_half, weight_half;
      for (const BackwardArg& arg : layer.backward_args) {
        ObjectId read;
        switch (arg.kind) {
          case BackwardArg::Kind::kOutputGradient:
            if (!dy[arg.index].valid()) {
              return InvalidArgument(
                  "output {} of layer '{}' is read by no layer, so it has no gradient: read it "
                  "or drop it",
                  arg.index, layer.name);
            }
            read = dy[arg.index];
            break;
          case BackwardArg::Kind::kForwardArg: {
            const LayerArg& forward = layer.forward_args[arg.index];
            read = args[l][arg.index];
            if (forward.kind == Arg::kParams && p_.sharded_parameters() && !layer.loss) {
              const std::string when = forward.index == l ? "backward" : layer.name + "_backward";
              TESSERA_ASSIGN_OR_RETURN(read, LayerParams(r, forward.index, Micro(k, when), after));
            }
            break;
          }
          case BackwardArg::Kind::kForwardOutput:
            read = outputs[l][arg.index];
            break;
          case BackwardArg::Kind::kGradientSoFar: {
            const size_t group = layer.forward_args[arg.index].index;
            if (param_grads[group].empty()) {
              return InvalidArgument(
                  "layer '{}' adds to the gradient of '{}', but no layer after it made one",
                  layer.name, LayerName(group));
            }
            TESSERA_ASSIGN_OR_RETURN(
                read, Sum(r, StageOf(group), object(LayerName(group) + ".grad_parts"),
                          param_grads[group]));
            param_grads[group].clear();
            break;
          }
        }
        inputs.push_back(read);
        if (arg.kind != BackwardArg::Kind::kGradientSoFar) input_half.push_back(read);
        if (arg.kind != BackwardArg::Kind::kOutputGradient) weight_half.push_back(read);
      }
      // The outputs' names and roles, in backward_outputs' order; which are input gradients.
      std::vector<std::string> names;
      std::vector<ObjectRole> roles;
      std::vector<bool> is_input;
      int dx = 0;
      for (size_t target : layer.backward_outputs) {
        const LayerArg& forward = layer.forward_args[target];
        is_input.push_back(forward.kind == Arg::kActivation);
        if (is_input.back()) {
          names.push_back(object(layer.name + "/backward:dx" + (dx > 0 ? std::to_string(dx) : "")));
          roles.push_back(ObjectRole::kActivation);
          ++dx;
        } else {
          names.push_back(object(forward.index == l
                                     ? layer.name + ".grad"
                                     : LayerName(forward.index) + ".grad_from_" + layer.name));
          roles.push_back(FullGradientRole());
        }
      }
      Rank& rank = ranks_[static_cast<size_t>(r)];
      std::vector<ObjectId> grads;  // in backward_outputs' order
      if (!split_[l]) {
        TESSERA_ASSIGN_OR_RETURN(
            grads, builder_.AddTask(
                       task(l, "backward"), layer.backward_op, std::move(inputs), AttrsOf(l),
                       On(r, layer.name, kBackwardPriority, std::move(names), std::move(roles))));
        if (!grads.empty()) rank.backward_task[l][static_cast<size_t>(k)] = ProducerOf(grads[0]);
      } else {
        // The input half returns the input gradients and a stash; the weight half, reading the
        // stash first, the parameter gradients.
        std::vector<std::string> half_names[2];
        std::vector<ObjectRole> half_roles[2];
        for (size_t j = 0; j < names.size(); ++j) {
          half_names[is_input[j] ? 0 : 1].push_back(names[j]);
          half_roles[is_input[j] ? 0 : 1].push_back(roles[j]);
        }
        const size_t input_grads = half_names[0].size();
        half_names[0].push_back(object(layer.name + "/backward_input:stash"));
        half_roles[0].push_back(ObjectRole::kActivation);
        TESSERA_ASSIGN_OR_RETURN(
            auto b, builder_.AddTask(task(l, "backward_input"), layer.backward_input_op,
                                     std::move(input_half), AttrsOf(l),
                                     On(r, layer.name, kBackwardPriority, std::move(half_names[0]),
                                        std::move(half_roles[0]))));
        weight_half.insert(weight_half.begin(), b.back());
        const size_t param_grads_out = half_names[1].size();
        TESSERA_ASSIGN_OR_RETURN(
            auto w, builder_.AddTask(task(l, "backward_weight"), layer.backward_weight_op,
                                     std::move(weight_half), AttrsOf(l),
                                     On(r, layer.name, kBackwardPriority, std::move(half_names[1]),
                                        std::move(half_roles[1]))));
        if (b.size() != input_grads + 1 || w.size() != param_grads_out) {
          return InvalidArgument(
              "layer '{}': ops '{}' and '{}' return {} and {} outputs, but the layer's backward "
              "has {} input gradient(s) (and a stash) and {} parameter gradient(s)",
              layer.name, layer.backward_input_op, layer.backward_weight_op, b.size(), w.size(),
              input_grads, param_grads_out);
        }
        rank.backward_task[l][static_cast<size_t>(k)] = ProducerOf(b[0]);
        if (!w.empty()) rank.weight_task[l][static_cast<size_t>(k)] = ProducerOf(w[0]);
        size_t next_input = 0, next_param = 0;
        for (bool input : is_input) grads.push_back(input ? b[next_input++] : w[next_param++]);
      }
      for (size_t j = 0; j < grads.size() && j < layer.backward_outputs.size(); ++j) {
        const LayerArg& forward = layer.forward_args[layer.backward_outputs[j]];
        if (forward.kind == Arg::kActivation) {
          output_grads[forward.index][static_cast<size_t>(forward.output)].push_back(grads[j]);
        } else {
          param_grads[forward.index].push_back(grads[j]);
        }
      }
      // Groups whose first reader is this layer have every part of their gradient now.
      for (size_t group = 0; group < layers_; ++group) {
        if (readers_[group].empty() || readers_[group].front() != l) continue;
        TESSERA_ASSIGN_OR_RETURN(
            ObjectId full,
            Sum(r, StageOf(group), object(LayerName(group) + ".grad_parts"), param_grads[group]));
        if (!full.valid()) {
          return InvalidArgument("no layer's backward returns a gradient of the parameters of '{}'",
                                 LayerName(group));
        }
        TESSERA_RETURN_IF_ERROR(AddGradient(r, k, group, full));
        last_gradient_[static_cast<size_t>(StageOf(group))] = group;
      }
    }
    return Status::Ok();
  }

  // The layer's attributes; the loss layer's carry grad_scale (1/(N*K): the loss is a mean over
  // every rank's micro-batches).
  Attrs AttrsOf(size_t l) const {
    Attrs attrs = layer_attrs_[l];
    if (model_.layers[l].loss && n_ * k_ > 1) {
      attrs.Set("grad_scale", 1.0 / static_cast<double>(n_ * k_));
    }
    return attrs;
  }

  TaskId ProducerOf(ObjectId id) const { return builder_.graph().object(id).producer; }
  bool ProducedOnStage(ObjectId id, int s) const {
    const TaskId producer = ProducerOf(id);
    if (!producer.valid()) return false;
    const std::string& layer = builder_.graph().task(producer).layer;
    auto it = stage_of_name_.find(layer);
    return it != stage_of_name_.end() && it->second == s;
  }

  // The sum of `parts` on rank r's worker of stage s, added in place into the first in order;
  // invalid when there are none.
  Result<ObjectId> Sum(int r, int s, const std::string& name, const std::vector<ObjectId>& parts) {
    if (parts.empty()) return ObjectId();
    ObjectId sum = parts[0];
    for (size_t i = 1; i < parts.size(); ++i) {
      TESSERA_ASSIGN_OR_RETURN(
          auto added,
          builder_.AddTask(
              fmt::format("{}/sum{}", name, i), "accumulate", {sum, parts[i]}, {},
              OnStage(r, s, "", kBackwardPriority, {fmt::format("{}:sum{}", name, i)})));
      sum = added[0];
    }
    return sum;
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
      if (!HasParams(l)) continue;
      const std::string name = LayerName(l) + "/reduce_scatter";
      for (int r = 0; r < n_; ++r) {
        Rank& rank = ranks_[static_cast<size_t>(r)];
        std::vector<ObjectId> inputs{rank.grad[l]};
        const size_t last = last_gradient_[static_cast<size_t>(StageOf(l))];
        if (l != last) inputs.push_back(rank.grad[last]);  // after the stage's backward
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
        if (!HasParams(l)) continue;
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
                                       OnStage(r, LossStage(), "", kOptimizerPriority,
                                               {Name(r, "loss_part")}, {ObjectRole::kOutput})));
        loss = sum[0];
      }
      if (n_ > 1) {
        TESSERA_ASSIGN_OR_RETURN(
            auto total, builder_.AddTask(Name(r, "loss/all_reduce"), "all_reduce", {loss},
                                         Collective(CollectiveId("loss"), r).Set("reduce", "sum"),
                                         OnStage(r, LossStage(), "", kOptimizerPriority,
                                                 {Name(r, "loss")}, {ObjectRole::kOutput})));
        loss = total[0];
      }
      if (r == 0) step_.loss = loss;
    }
    builder_.MarkOutput(step_.loss);
    return Status::Ok();
  }

  // Global-norm clipping. Each worker sums the squares of the gradient pieces it holds. Sharded
  // gradients (ZeRO >= 1 over several ranks): the sums of every worker are all-reduced.
  // Replicated ones: every rank holds all of its stages' gradients, so the sums of one rank's
  // stages are all-reduced among them (nothing to reduce on one worker).
  Status AddClipping() {
    const bool sharded = n_ > 1 && p_.zero_stage >= 1;
    const Attrs clip_attrs{{"max_norm", plan_.optimizer.max_grad_norm}};
    for (int r = 0; r < n_; ++r) {
      Rank& rank = ranks_[static_cast<size_t>(r)];
      rank.clip.assign(static_cast<size_t>(stages_), ObjectId());
      for (int s = 0; s < stages_; ++s) {
        std::vector<ObjectId> sums;
        for (size_t l = 0; l < layers_; ++l) {
          if (!HasParams(l) || StageOf(l) != s) continue;
          TESSERA_ASSIGN_OR_RETURN(
              auto sum,
              builder_.AddTask(Name(r, LayerName(l) + "/grad_norm"), "sum_of_squares",
                               {rank.grad[l]}, {}, On(r, LayerName(l), kOptimizerPriority)));
          sums.push_back(sum[0]);
        }
        if (sums.empty()) {  // a stage without parameters adds nothing
          TESSERA_ASSIGN_OR_RETURN(
              sums, builder_.AddTask(Name(r, Staged(s, "grad_norm/none")), "constant", {},
                                     Attrs{{"value", 0.0}}, OnStage(r, s, "", kOptimizerPriority)));
        }
        const int members = sharded ? n_ * stages_ : stages_;
        if (members > 1) {
          TESSERA_ASSIGN_OR_RETURN(
              auto local, builder_.AddTask(Name(r, Staged(s, "grad_norm/sum")), "sum_scalars", sums,
                                           {}, OnStage(r, s, "", kOptimizerPriority)));
          const std::string collective =
              sharded ? std::string("grad_norm") : fmt::format("grad_norm@rank{}", r);
          const int member = sharded ? s * n_ + r : s;
          TESSERA_ASSIGN_OR_RETURN(
              auto total,
              builder_.AddTask(Name(r, Staged(s, "grad_norm/all_reduce")), "all_reduce", {local[0]},
                               Attrs{{kCollectiveAttr, CollectiveId(collective)},
                                     {kRankAttr, int64_t{member}},
                                     {kGroupSizeAttr, int64_t{members}},
                                     {"reduce", "sum"}},
                               OnStage(r, s, "", kOptimizerPriority)));
          sums = {total[0]};
        }
        TESSERA_ASSIGN_OR_RETURN(
            auto clip, builder_.AddTask(Name(r, Staged(s, "clip")), "clip_scale", sums, clip_attrs,
                                        OnStage(r, s, "", kOptimizerPriority,
                                                {Name(r, Staged(s, "clip_scale")),
                                                 Name(r, Staged(s, "grad_norm"))},
                                                {ObjectRole::kOutput, ObjectRole::kOutput})));
        rank.clip[static_cast<size_t>(s)] = clip[0];
        if (plan_.optimizer.max_grad_norm <= 0) {
          // Clipping off: the factor is 1, known now, so each update waits only for its own
          // gradient and runs during the remaining backward (the norm is still reported).
          TESSERA_ASSIGN_OR_RETURN(
              auto one, builder_.AddTask(
                            Name(r, Staged(s, "clip_off")), "constant", {}, Attrs{{"value", 1.0}},
                            OnOptimizerDevice(OnStage(r, s, "", kOptimizerPriority,
                                                      {Name(r, Staged(s, "clip_scale_one"))}))));
          rank.clip[static_cast<size_t>(s)] = one[0];
        }
        if (r == 0 && s == 0) {
          step_.grad_norm = clip[1];
          builder_.MarkOutput(step_.grad_norm);
        }
      }
    }
    return Status::Ok();
  }

  // Offload on GPU workers: each final gradient (piece) and the clipping factor are copied to
  // the host. With clipping, a layer's gradient goes down only once the clipping factor exists
  // (every gradient is complete then, on the GPU), and at most kGradientsInFlight layers ahead
  // of the update that consumes them (AddOptimizer's control edges): the host holds the
  // optimizer's state and a few layers' gradients, not a second copy of every gradient. What
  // that costs is the overlap of the downloads with the backward pass, small next to the
  // host's update (ZeRO-Offload's step is bound by the host and the link, not the GPU).
  static constexpr size_t kGradientsInFlight = 3;

  Status AddDownloads() {
    if (!offload_) return Status::Ok();
    for (int r = 0; r < n_; ++r) {
      Rank& rank = ranks_[static_cast<size_t>(r)];
      if (plan_.optimizer.max_grad_norm <= 0) {
        rank.host_clip = rank.clip;  // the constant 1, already on the host
      } else {
        rank.host_clip.assign(static_cast<size_t>(stages_), ObjectId());
        for (int s = 0; s < stages_; ++s) {
          TESSERA_ASSIGN_OR_RETURN(
              auto clip, builder_.AddTask(
                             Name(r, Staged(s, "clip_to_host")), "copy",
                             {rank.clip[static_cast<size_t>(s)]}, {},
                             OnOptimizerDevice(OnStage(r, s, "", kOptimizerPriority,
                                                       {Name(r, Staged(s, "clip_scale.host"))}))));
          rank.host_clip[static_cast<size_t>(s)] = clip[0];
        }
      }
      for (size_t l = 0; l < layers_; ++l) {
        if (!HasParams(l)) {
          rank.host_grad.push_back(ObjectId());
          continue;
        }
        const std::string& layer = LayerName(l);
        TaskOptions options = On(r, layer, kBackwardPriority + 1, {Name(r, layer + ".grad.host")},
                                 {ObjectRole::kGradient});
        options.device_kind = DeviceKind::kCpu;
        TESSERA_ASSIGN_OR_RETURN(
            auto host, builder_.AddTask(Name(r, layer + "/grad_to_host"), "copy", {rank.grad[l]},
                                        {}, std::move(options)));
        rank.host_grad.push_back(host[0]);
        if (plan_.optimizer.max_grad_norm > 0) {
          builder_.AddControlEdge(
              builder_.graph().object(rank.host_clip[static_cast<size_t>(StageOf(l))]).producer,
              Producer(host[0]));
        }
      }
    }
    return Status::Ok();
  }

  TaskId Producer(ObjectId id) const { return builder_.graph().object(id).producer; }

  Status AddOptimizer(int r) {
    Rank& rank = ranks_[static_cast<size_t>(r)];
    // Offload: per stage (one worker's host), the update tasks so far, in layer order.
    std::vector<std::vector<TaskId>> stage_updates(static_cast<size_t>(stages_));
    for (size_t l = 0; l < layers_; ++l) {
      if (!HasParams(l)) continue;
      std::vector<TaskId>& updates = stage_updates[static_cast<size_t>(StageOf(l))];
      if (offload_ && updates.size() >= kGradientsInFlight) {
        // This layer's gradient goes down once the update kGradientsInFlight layers back (on
        // the same worker) ended.
        builder_.AddControlEdge(updates[updates.size() - kGradientsInFlight],
                                Producer(rank.host_grad[l]));
      }
      const ObjectId clip =
          (offload_ ? rank.host_clip : rank.clip)[static_cast<size_t>(StageOf(l))];
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
        updates.push_back(Producer(updated[0]));
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
      updates.push_back(Producer(updated[0]));
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
  const int stages_;  // pipeline stages
  const bool adamw_;
  const OpRegistry& registry_;
  const bool offload_;  // offload to the host tier of GPU workers (a no-op on CPU workers)
  GraphBuilder builder_;
  std::vector<Attrs> layer_attrs_;            // per layer
  std::vector<std::vector<size_t>> readers_;  // per group: the layers whose forward reads it
  std::vector<bool> split_;  // per layer: its backward runs as two tasks (SplitsLayerBackward)
  // Per stage: the group whose gradient is complete last there.
  std::vector<size_t> last_gradient_ = std::vector<size_t>(static_cast<size_t>(stages_), 0);
  std::map<std::string, int> stage_of_name_;  // layer name -> pipeline stage
  StepGraph step_;
  std::vector<Rank> ranks_;
  std::map<std::string, int64_t> collective_ids_;
};

}  // namespace

Result<std::vector<double>> EstimateLayerCosts(const ModelSpec& model, int64_t rows,
                                               int64_t seq_len, const OpRegistry& registry) {
  TESSERA_ASSIGN_OR_RETURN(ForwardGraph forward, PlanEvalLoss(model, rows, seq_len, registry));
  std::map<std::string, double> by_layer;
  for (const TaskSpec& task : forward.graph.tasks()) {
    std::vector<TensorMeta> inputs;
    for (ObjectId input : task.inputs) inputs.push_back(forward.graph.object(input).meta);
    TESSERA_ASSIGN_OR_RETURN(OpCost cost, registry.Cost(task.op, inputs, task.attrs));
    // Seconds on a machine doing 10 flops per byte moved; only the ratios matter.
    by_layer[task.layer] += cost.flops + 10 * cost.bytes;
  }
  std::vector<double> costs;
  for (const LayerSpec& layer : model.layers) costs.push_back(by_layer[layer.name]);
  return costs;
}

std::vector<int> BalancedChunks(const std::vector<double>& costs, int chunks) {
  const size_t n = costs.size();
  const size_t c = static_cast<size_t>(chunks);
  std::vector<double> prefix(n + 1, 0);
  for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + std::max(costs[i], 0.0);
  // best[j][i]: the smallest possible largest chunk cutting layers [0, i) into j chunks; cut
  // from[j][i] where the last of them starts.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(c + 1, std::vector<double>(n + 1, kInf));
  std::vector<std::vector<size_t>> from(c + 1, std::vector<size_t>(n + 1, 0));
  best[0][0] = 0;
  for (size_t j = 1; j <= c; ++j) {
    for (size_t i = j; i <= n; ++i) {
      for (size_t k = j - 1; k < i; ++k) {
        const double largest = std::max(best[j - 1][k], prefix[i] - prefix[k]);
        if (largest < best[j][i]) {  // ties: the earliest cut, so later chunks stay small
          best[j][i] = largest;
          from[j][i] = k;
        }
      }
    }
  }
  std::vector<int> chunk_of(n, 0);
  size_t end = n;
  for (size_t j = c; j > 0; --j) {
    const size_t begin = from[j][end];
    for (size_t l = begin; l < end; ++l) chunk_of[l] = static_cast<int>(j - 1);
    end = begin;
  }
  return chunk_of;
}

Result<std::vector<int>> CutIntoChunks(const ModelSpec& model, const TrainingPlan& plan,
                                       const OpRegistry& registry) {
  const ParallelConfig& p = plan.parallel;
  const int chunks = p.pipeline_stages * p.virtual_stages;
  if (chunks <= 1) return std::vector<int>(model.layers.size(), 0);
  std::vector<double> costs = p.layer_costs;
  if (costs.empty()) {
    for (const OpCosts& op : p.layer_op_costs) {
      costs.push_back(op.forward + op.backward + op.weight);
    }
  }
  if (costs.empty()) {
    TESSERA_ASSIGN_OR_RETURN(
        costs, EstimateLayerCosts(model, p.micro_batch(plan.batch), plan.seq_len, registry));
  }
  return BalancedChunks(costs, chunks);
}

Result<StepGraph> PlanTrainingStep(const ModelSpec& model, const TrainingPlan& plan,
                                   const OpRegistry& registry) {
  TESSERA_RETURN_IF_ERROR(plan.Validate(model));
  const ParallelConfig& p = plan.parallel;
  if (p.workers.empty() && p.num_workers() > 1) {
    return InvalidArgument(
        "{} data-parallel ranks x {} pipeline stages need a worker each: run on a cluster with "
        "at least {} workers",
        p.data_parallel, p.pipeline_stages, p.num_workers());
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<int> chunks, CutIntoChunks(model, plan, registry));
  if (p.pipeline_stages > 1 && p.sharded_optimizer()) {
    // ZeRO shards each stage's parameters over its ranks: a stage without any has nothing to
    // shard (and no optimizer work), which is a cut to change, not to run.
    for (int stage = 0; stage < p.pipeline_stages; ++stage) {
      int64_t numel = 0;
      for (size_t l = 0; l < model.layers.size(); ++l) {
        if (chunks[l] % p.pipeline_stages == stage) numel += model.layers[l].params.numel();
      }
      if (numel == 0) {
        return InvalidArgument(
            "pipeline stage {} holds no parameters, but ZeRO stage {} shards each stage's "
            "parameters over its {} ranks: use fewer pipeline stages, give the layers costs "
            "that move the cut, or use --zero-stage 0",
            stage, p.zero_stage, p.data_parallel);
      }
    }
  }
  return StepPlanner(model, plan, registry, std::move(chunks)).Build();
}

namespace {

Result<ForwardGraph> PlanForward(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                 const OpRegistry& registry, int64_t param_multiple, bool predict,
                                 Device device) {
  if (param_multiple < 1) return InvalidArgument("param_multiple must be >= 1");
  TESSERA_RETURN_IF_ERROR(CheckShapeOfBatch(model, batch, seq_len));
  TESSERA_ASSIGN_OR_RETURN(const size_t loss_layer, model.LossLayer());
  const LayerSpec& loss = model.layers[loss_layer];
  // Without a prediction op, the prediction is what the loss layer reads first (the logits).
  const LayerArg* predicted = nullptr;
  for (const LayerArg& arg : loss.forward_args) {
    if (arg.kind == LayerArg::Kind::kActivation && predicted == nullptr) predicted = &arg;
  }
  if (predict && loss.predict_op.empty() && predicted == nullptr) {
    return InvalidArgument("model '{}' cannot predict: its loss layer '{}' reads no layer",
                           model.name, loss.name);
  }
  GraphBuilder builder(registry);
  ForwardGraph result;
  for (const ModelInput& input : model.inputs) {
    result.inputs.push_back(
        input.label && predict
            ? ObjectId()
            : builder.AddInput(input.name, input.Meta(batch, seq_len, device), ObjectRole::kInput));
  }
  result.params = AddParameterInputs(builder, model, param_multiple, device);
  std::vector<std::vector<ObjectId>> outputs(model.layers.size());
  for (size_t l = 0; l < model.layers.size(); ++l) {
    const LayerSpec& layer = model.layers[l];
    const bool predicting = predict && l == loss_layer;
    if (predicting && layer.predict_op.empty()) {
      outputs[l] = {outputs[predicted->index][static_cast<size_t>(predicted->output)]};
      break;
    }
    std::vector<ObjectId> args;
    for (const LayerArg& arg : layer.forward_args) {
      switch (arg.kind) {
        case LayerArg::Kind::kModelInput:
          if (!predicting || !model.inputs[arg.index].label) {
            args.push_back(result.inputs[arg.index]);
          }
          break;
        case LayerArg::Kind::kActivation:
          args.push_back(outputs[arg.index][static_cast<size_t>(arg.output)]);
          break;
        case LayerArg::Kind::kParams:
          args.push_back(result.params[arg.index]);
          break;
      }
    }
    std::vector<std::string> names;
    std::vector<ObjectRole> roles;
    if (l == loss_layer) {
      names = {predicting ? "logits" : "loss"};
      if (!predicting) roles = {ObjectRole::kOutput};
    }
    TaskOptions options = Options(layer.name, kForwardPriority, std::move(names), std::move(roles));
    options.device_kind = device.kind;
    TESSERA_ASSIGN_OR_RETURN(
        outputs[l],
        builder.AddTask(layer.name + (predicting ? "/logits" : "/forward"),
                        predicting ? layer.predict_op : layer.forward_op, std::move(args),
                        LayerAttrs(layer, param_multiple), std::move(options)));
  }
  result.result = outputs[loss_layer][0];
  builder.MarkOutput(result.result);
  TESSERA_ASSIGN_OR_RETURN(result.graph, builder.Build());
  return result;
}

}  // namespace

Result<ForwardGraph> PlanEvalLoss(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                  const OpRegistry& registry, int64_t param_multiple,
                                  Device device) {
  return PlanForward(model, batch, seq_len, registry, param_multiple, /*logits=*/false, device);
}

Result<ForwardGraph> PlanLogits(const ModelSpec& model, int64_t batch, int64_t seq_len,
                                const OpRegistry& registry, int64_t param_multiple, Device device) {
  return PlanForward(model, batch, seq_len, registry, param_multiple, /*logits=*/true, device);
}

}  // namespace tessera

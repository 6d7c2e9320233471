#include "training/trainer.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <span>
#include <tuple>

#include <tbb/parallel_for.h>

#include "core/allocator.h"
#include "core/logging.h"
#include "ops/graph_builder.h"
#include "ops/standard_ops.h"
#include "training/collective_link.h"

namespace tessera {

namespace {

TensorMeta F32(int64_t n) { return TensorMeta{Shape{n}, DType::kF32, Device::Cpu()}; }

// SplitMix64: a well-mixed 64-bit value from any other (the generator seeds below).
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Host memory is filled and copied in chunks of 2^20 floats on every core: the first touch of a
// model's state (the kernel zeroing fresh pages) is most of its initialisation, and it scales
// with threads.
constexpr int64_t kFillChunk = int64_t{1} << 20;

void ParallelFill(float* values, int64_t n, float value) {
  tbb::parallel_for(int64_t{0}, (n + kFillChunk - 1) / kFillChunk, [&](int64_t chunk) {
    std::fill(values + chunk * kFillChunk, values + std::min(n, (chunk + 1) * kFillChunk), value);
  });
}

void ParallelCopy(float* dst, const float* src, int64_t n) {
  tbb::parallel_for(int64_t{0}, (n + kFillChunk - 1) / kFillChunk, [&](int64_t chunk) {
    const int64_t begin = chunk * kFillChunk, end = std::min(n, (chunk + 1) * kFillChunk);
    std::memcpy(dst + begin, src + begin, static_cast<size_t>(end - begin) * sizeof(float));
  });
}

// Fills values[0, n) as `init` says. Random values are drawn in chunks of 2^20, each from its
// own generator seeded by (stream, chunk), in parallel: the same values on any number of threads,
// and a multi-billion-parameter model initialises in seconds rather than minutes.
void InitializeSlot(const ParamInit& init, uint64_t stream, float* values, int64_t n) {
  if (init.kind == ParamInit::Kind::kZeros || init.kind == ParamInit::Kind::kOnes) {
    ParallelFill(values, n, init.kind == ParamInit::Kind::kOnes ? 1.0f : 0.0f);
    return;
  }
  constexpr int64_t kChunk = int64_t{1} << 20;  // the random streams' chunks (fixed: seeds)
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  tbb::parallel_for(int64_t{0}, chunks, [&](int64_t chunk) {
    std::mt19937_64 rng(Mix(stream ^ Mix(static_cast<uint64_t>(chunk))));
    float* begin = values + chunk * kChunk;
    float* end = values + std::min(n, (chunk + 1) * kChunk);
    const float scale = static_cast<float>(init.scale);
    if (init.kind == ParamInit::Kind::kNormal) {
      std::normal_distribution<float> normal(0.0f, scale);
      for (float* v = begin; v != end; ++v) *v = normal(rng);
    } else {
      std::uniform_real_distribution<float> uniform(-scale, scale);
      for (float* v = begin; v != end; ++v) *v = uniform(rng);
    }
  });
}

}  // namespace

Trainer::Trainer(ModelSpec model, ModelSpec split, TrainingPlan plan,
                 std::unique_ptr<OpRegistry> registry, std::unique_ptr<GraphBackend> backend)
    : model_(std::move(model)),
      split_(std::move(split)),
      plan_(std::move(plan)),
      registry_(std::move(registry)),
      backend_(std::move(backend)) {}

Result<std::unique_ptr<Trainer>> Trainer::Create(ModelSpec model, const TrainingPlan& plan,
                                                 const ExecutorOptions& executor_options) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<GraphBackend> backend,
                           MakeInProcessBackend(executor_options));
  return Create(std::move(model), plan, std::move(backend));
}

namespace {

double GiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 30); }

// Gradient buckets sized from the link (ParallelConfig::bucket_bytes auto) over workers whose link
// nobody gave: measured on the first stage's ranks (every stage's are alike). A failed
// measurement is not a failed plan: the planner's default link stands, and the log says why.
void MeasureLinkForBuckets(GraphBackend& backend, TrainingPlan& plan) {
  ParallelConfig& p = plan.parallel;
  if (p.data_parallel < 2 || p.bucket_bytes != kAutoBucketBytes || p.link.measured() ||
      p.workers.empty()) {
    return;
  }
  const std::vector<WorkerId> ranks(p.workers.begin(), p.workers.begin() + p.data_parallel);
  Result<CollectiveLink> link = MeasureCollectiveLink(backend, ranks, plan.device);
  if (!link.ok()) {
    GetLogger("trainer")->warn("{}; gradient buckets are sized for an assumed link instead",
                               link.status().ToString());
    return;
  }
  p.link = *link;
}

}  // namespace

Result<std::unique_ptr<Trainer>> Trainer::Create(ModelSpec model, const TrainingPlan& plan,
                                                 std::unique_ptr<GraphBackend> backend) {
  TESSERA_RETURN_IF_ERROR(model.Validate());
  TrainingPlan placed = plan;
  const int ranks = plan.parallel.num_workers();
  if (ranks > 1 && placed.parallel.workers.empty()) {
    const std::vector<WorkerId> workers = backend->workers();
    if (static_cast<int>(workers.size()) < ranks) {
      return InvalidArgument(
          "the plan has {} data-parallel x {} tensor-parallel ranks x {} pipeline stages but {} "
          "has {} worker(s): start at least {} workers or use fewer ranks",
          plan.parallel.data_parallel, plan.parallel.tensor_parallel, plan.parallel.pipeline_stages,
          backend->Describe(), workers.size(), ranks);
    }
    placed.parallel.workers.assign(workers.begin(), workers.begin() + ranks);
  }
  TESSERA_ASSIGN_OR_RETURN(
      ModelSpec split,
      model.PlannedFor(plan.parallel.tensor_parallel, plan.parallel.sequence_parallel,
                       plan.parallel.shard_sequence, plan.parallel.sequence_attention));
  TESSERA_RETURN_IF_ERROR(placed.Validate(split));
  MeasureLinkForBuckets(*backend, placed);
  auto registry = std::make_unique<OpRegistry>();
  TESSERA_RETURN_IF_ERROR(RegisterStandardOps(*registry));
  std::unique_ptr<Trainer> trainer(new Trainer(std::move(model), std::move(split), placed,
                                               std::move(registry), std::move(backend)));
  TESSERA_RETURN_IF_ERROR(trainer->MapSlices());
  TESSERA_RETURN_IF_ERROR(trainer->PrepareStepGraph());
  TESSERA_RETURN_IF_ERROR(trainer->CheckHostMemory());
  if (const int64_t cap = trainer->plan_.memory.host_bytes; cap > 0) {
    // The plan fits the host tier under the cap; from here the allocator holds it there.
    trainer->backend_->CapHostMemory(
        cap, fmt::format("the plan's host-memory cap, --host-memory-gib {:.6g}", GiB(cap)));
  }
  TESSERA_RETURN_IF_ERROR(trainer->AllocateState(std::nullopt));
  return trainer;
}

namespace {

// What a step needs in host memory besides its state, at least: every input it is fed (the
// batch, all micro-batches' rows at once, built on the host by the driver) and its largest host
// intermediate. A lower bound (other intermediates live beside the largest), so a step it
// refuses could never have run.
struct StepFootprint {
  int64_t inputs = 0;
  int64_t largest = 0;
  std::string largest_name;
};

StepFootprint FootprintOf(const Graph& graph) {
  StepFootprint footprint;
  for (const ObjectSpec& object : graph.objects()) {
    if (object.role == ObjectRole::kInput) {
      footprint.inputs += object.meta.bytes();
    } else if (object.role == ObjectRole::kActivation && object.meta.device.is_cpu() &&
               object.meta.bytes() > footprint.largest) {
      footprint.largest = object.meta.bytes();
      footprint.largest_name = object.name;
    }
  }
  return footprint;
}

}  // namespace

Status Trainer::CheckHostMemory() const {
  const StepFootprint step = FootprintOf(step_graph_.graph);
  // Whatever runs the step, this process builds every batch and stages each parameter group
  // whole (initialising, loading or reading it: a buffer and a piece's copy).
  int64_t largest_group = 0;
  for (int64_t numel : step_graph_.group_numel) largest_group = std::max(largest_group, numel);
  const int64_t staging = 2 * largest_group * static_cast<int64_t>(sizeof(float));
  if (const int64_t here = AvailableHostMemoryBytes(); here > 0 && step.inputs + staging > here) {
    return ResourceExhausted(
        "this process needs {:.1f} GiB for a step's inputs (a batch of {} rows x {} positions) "
        "and {:.1f} GiB to stage the largest parameter group, but this machine has {:.1f} GiB of "
        "memory available: lower the batch (--batch) or the sequence length (--seq-len), or "
        "train a smaller model",
        GiB(step.inputs), plan_.batch, plan_.seq_len, GiB(staging), GiB(here));
  }
  const int64_t available = backend_->host_memory_bytes();
  if (available <= 0) return Status::Ok();  // a cluster: each worker's store checks its own
  std::map<StateKind, int64_t> host_bytes;
  int64_t total = 0;
  for (const StateObject& object : step_graph_.state) {
    const TensorMeta& meta = step_graph_.graph.object(object.input).meta;
    if (!meta.device.is_cpu()) continue;
    host_bytes[object.kind] += meta.bytes();
    total += meta.bytes();
  }
  std::string parts;
  for (const auto& [kind, bytes] : host_bytes) {
    parts +=
        fmt::format("{}{} {:.1f} GiB", parts.empty() ? "" : ", ", StateKindName(kind), GiB(bytes));
  }
  if (total > available) {
    return ResourceExhausted(
        "the plan keeps {:.1f} GiB of training state in this process's host memory ({}) but "
        "{:.1f} GiB is available: train a smaller model, keep the optimizer on the GPU "
        "(no --offload), or spread the state over more workers (ZeRO on a cluster)",
        GiB(total), parts, GiB(available));
  }
  if (const int64_t needed = total + step.inputs + step.largest; needed > available) {
    return ResourceExhausted(
        "a step needs at least {:.1f} GiB of host memory in this process ({:.1f} GiB of training "
        "state, {:.1f} GiB of inputs for a batch of {} rows x {} positions, {:.1f} GiB for its "
        "largest intermediate '{}') but {:.1f} GiB is available: lower the batch (--batch) or the "
        "sequence length (--seq-len), or split the batch into micro-batches (--micro-batches)",
        GiB(needed), GiB(total), GiB(step.inputs), plan_.batch, plan_.seq_len, GiB(step.largest),
        step.largest_name, GiB(available));
  }
  return Status::Ok();
}

Status Trainer::PrepareStepGraph() {
  // 0/1 Adam: the sync step's graph holds every kind's state; the others are planned when run.
  if (plan_.optimizer.kind == OptimizerConfig::Kind::kZeroOneAdam) {
    plan_.optimizer.zero_one_step = OptimizerConfig::ZeroOneStep::kSync;
    zero_one_steps_.clear();
    if (!zero_one_) zero_one_.emplace(plan_.optimizer);
  }
  TESSERA_ASSIGN_OR_RETURN(step_graph_, PlanTrainingStep(split_, plan_, *registry_));
  if (keep_gradients_) {
    for (const GradientObject& grad : step_graph_.grads) step_graph_.graph.MarkOutput(grad.id);
  }
  TESSERA_ASSIGN_OR_RETURN(step_handle_, backend_->Register(step_graph_.graph));
  placed_forwards_.clear();
  return Status::Ok();
}

Result<Trainer::KindStep*> Trainer::ZeroOneStepGraph(OptimizerConfig::ZeroOneStep kind) {
  auto found = zero_one_steps_.find(kind);
  if (found != zero_one_steps_.end()) return &found->second;
  TrainingPlan plan = plan_;
  plan.optimizer.zero_one_step = kind;
  KindStep step;
  TESSERA_ASSIGN_OR_RETURN(step.graph, PlanTrainingStep(split_, plan, *registry_));
  if (keep_gradients_) {
    for (const GradientObject& grad : step.graph.grads) step.graph.graph.MarkOutput(grad.id);
  }
  // Each state object is the sync step's object of the same kind and piece.
  const auto key = [](const StateObject& o) {
    return std::make_tuple(o.kind, o.piece.layer, o.piece.rank, o.piece.begin, o.piece.numel);
  };
  std::map<decltype(key(StateObject{})), size_t> sync_index;
  for (size_t i = 0; i < step_graph_.state.size(); ++i) sync_index[key(step_graph_.state[i])] = i;
  for (const StateObject& object : step.graph.state) {
    auto it = sync_index.find(key(object));
    if (it == sync_index.end()) {
      return Internal("0/1 Adam's {} step holds state '{}' that its sync step does not",
                      ZeroOneStepName(kind), step.graph.graph.object(object.input).name);
    }
    step.state_index.push_back(it->second);
  }
  TESSERA_ASSIGN_OR_RETURN(step.handle, backend_->Register(step.graph.graph));
  return &zero_one_steps_.emplace(kind, std::move(step)).first->second;
}

Status Trainer::ZeroStateOf(StateKind kind) {
  for (size_t i = 0; i < step_graph_.state.size(); ++i) {
    if (step_graph_.state[i].kind != kind) continue;
    TESSERA_RETURN_IF_ERROR(WriteStateObject(
        i, std::vector<float>(static_cast<size_t>(step_graph_.state[i].piece.numel), 0.0f)));
  }
  return Status::Ok();
}

void Trainer::set_steps_taken(int64_t steps) {
  steps_taken_ = steps;
  if (zero_one_) {
    // Checkpoints are taken at synchronised steps only: nothing of an interval is under way.
    zero_one_ = ZeroOneAdamSchedule::After(plan_.optimizer, steps);
    lr_sum_ = 0;
    interval_starts_stale_ = true;
  }
}

Status Trainer::StartIntervalsAtTheParameters() {
  std::map<std::pair<size_t, int>, size_t> params;  // by layer and rank
  for (size_t i = 0; i < step_graph_.state.size(); ++i) {
    const StateObject& object = step_graph_.state[i];
    if (object.kind == StateKind::kParameter) params[{object.piece.layer, object.piece.rank}] = i;
  }
  for (size_t i = 0; i < step_graph_.state.size(); ++i) {
    const StateObject& object = step_graph_.state[i];
    if (object.kind != StateKind::kIntervalStart) continue;
    auto param = params.find({object.piece.layer, object.piece.rank});
    if (param == params.end()) {
      return Internal("0/1 Adam's interval start of layer {} rank {} has no parameters",
                      object.piece.layer, object.piece.rank);
    }
    TESSERA_ASSIGN_OR_RETURN(Tensor values, DownloadState(param->second));
    TESSERA_RETURN_IF_ERROR(WriteStateObject(
        i, std::span<const float>(values.data<float>(), static_cast<size_t>(values.numel()))));
  }
  interval_starts_stale_ = false;
  return Status::Ok();
}

bool Trainer::parameters_synchronized() const { return !zero_one_ || zero_one_->synchronized(); }

int64_t Trainer::NextSynchronizedStep() const {
  if (!zero_one_ || zero_one_->synchronized()) return steps_taken_;
  ZeroOneAdamSchedule ahead = *zero_one_;
  while (ahead.Next() != OptimizerConfig::ZeroOneStep::kSync) ahead.Advance();
  return ahead.steps_taken() + 1;
}

Status Trainer::SetKeepGradients(bool keep) {
  keep_gradients_ = keep;
  last_grads_.clear();
  return PrepareStepGraph();
}

Status Trainer::InitializeParameters(uint64_t seed) { return AllocateState(seed); }

int64_t Trainer::ParamMultiple() const {
  // Under tensor or sequence parallelism the forward-only graphs read whole groups, gathered
  // unpadded.
  if (split_.rewritten()) return 1;
  return plan_.parallel.sharded_optimizer() ? plan_.parallel.data_parallel : 1;
}

int64_t Trainer::GroupNumel(size_t layer) const {
  return split_.rewritten() ? model_.layers[layer].params.numel() : step_graph_.group_numel[layer];
}

Status Trainer::MapSlices() {
  slices_.clear();
  if (!split_.rewritten()) return Status::Ok();
  const int64_t ranks = plan_.parallel.tensor_parallel;
  slices_.resize(model_.layers.size());
  for (size_t l = 0; l < model_.layers.size(); ++l) {
    slices_[l].resize(model_.layers[l].params.slots().size());
  }
  std::vector<std::vector<bool>> found(model_.layers.size());
  for (size_t l = 0; l < model_.layers.size(); ++l) found[l].assign(slices_[l].size(), false);
  for (size_t p = 0; p < split_.layers.size(); ++p) {
    const LayerSpec& planned = split_.layers[p];
    if (!planned.tensor_parallel && split_.tensor_parallel > 1) {
      return Internal("layer '{}' of model '{}' split over {} ranks does not say how it splits",
                      planned.name, model_.name, ranks);
    }
    const auto& slots = planned.params.slots();
    for (size_t s = 0; s < slots.size(); ++s) {
      const std::string name = planned.ParamPrefix() + slots[s].name;
      TESSERA_ASSIGN_OR_RETURN(ParameterRef whole, FindParameter(name));
      // Sequence parallelism keeps every parameter whole (replicated).
      const SlotSplit split =
          planned.tensor_parallel ? planned.tensor_parallel->slots[s] : SlotSplit{};
      std::vector<int64_t> dims = whole.slot->shape.dims();
      if (!split.replicated()) dims[static_cast<size_t>(split.dim)] /= ranks;
      if (Shape(dims) != slots[s].shape) {
        return Internal(
            "model '{}' split over {} ranks gives parameter '{}' shape {}, not a slice of {}",
            model_.name, ranks, name, slots[s].shape.ToString(), whole.slot->shape.ToString());
      }
      const size_t index =
          static_cast<size_t>(whole.slot - model_.layers[whole.group].params.slots().data());
      if (found[whole.group][index]) {
        return Internal("model '{}' split over {} ranks holds parameter '{}' twice", model_.name,
                        ranks, name);
      }
      found[whole.group][index] = true;
      slices_[whole.group][index] = SliceOfSlot{p, &slots[s], split};
    }
  }
  for (size_t l = 0; l < found.size(); ++l) {
    for (size_t s = 0; s < found[l].size(); ++s) {
      if (!found[l][s]) {
        return Internal("model '{}' split over {} ranks lacks parameter '{}{}'", model_.name, ranks,
                        model_.layers[l].ParamPrefix(), model_.layers[l].params.slots()[s].name);
      }
    }
  }
  return Status::Ok();
}

void Trainer::CopySlice(const SliceOfSlot& slice, const FlatSlot& whole_slot, int t,
                        const float* from, float* to, bool to_slice) const {
  const Shape& shape = whole_slot.shape;
  if (slice.split.replicated()) {
    std::memcpy(to, from, static_cast<size_t>(shape.numel()) * sizeof(float));
    return;
  }
  // The whole tensor as [outer, blocks, ranks, part x inner]; the slice is [outer, blocks, part
  // x inner].
  const int64_t ranks = plan_.parallel.tensor_parallel;
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < slice.split.dim; ++d) outer *= shape[d];
  for (int d = slice.split.dim + 1; d < shape.rank(); ++d) inner *= shape[d];
  const int64_t blocks = slice.split.blocks;
  const int64_t chunk = shape[slice.split.dim] / (blocks * ranks) * inner;
  for (int64_t o = 0; o < outer * blocks; ++o) {
    const int64_t whole_at = (o * ranks + t) * chunk;
    const int64_t slice_at = o * chunk;
    if (to_slice) {
      std::memcpy(to + slice_at, from + whole_at, static_cast<size_t>(chunk) * sizeof(float));
    } else {
      std::memcpy(to + whole_at, from + slice_at, static_cast<size_t>(chunk) * sizeof(float));
    }
  }
}

Result<std::vector<float>> Trainer::GatherWholeGroup(size_t layer, const PlannedGroupReader& read) {
  if (!split_.rewritten()) return read(layer, -1);  // the group is planned whole
  const LayerSpec& whole = model_.layers[layer];
  std::vector<float> group(static_cast<size_t>(whole.params.numel()), 0.0f);
  std::map<std::pair<size_t, int>, std::vector<float>> planned;  // read once each
  const auto& slots = whole.params.slots();
  for (size_t s = 0; s < slots.size(); ++s) {
    const SliceOfSlot& slice = slices_[layer][s];
    const int ranks = slice.split.replicated() ? 1 : plan_.parallel.tensor_parallel;
    for (int t = 0; t < ranks; ++t) {
      auto it = planned.find({slice.layer, t});
      if (it == planned.end()) {
        TESSERA_ASSIGN_OR_RETURN(std::vector<float> values, read(slice.layer, t));
        it = planned.emplace(std::make_pair(slice.layer, t), std::move(values)).first;
      }
      CopySlice(slice, slots[s], t, it->second.data() + slice.slot->offset,
                group.data() + slots[s].offset, /*to_slice=*/false);
    }
  }
  return group;
}

Status Trainer::AllocateState(std::optional<uint64_t> seed) {
  const bool adamw = plan_.optimizer.has_moments();
  // Fresh state starts 1-bit Adam's warm-up again.
  if (plan_.optimizer.compressed_phase) {
    plan_.optimizer.compressed_phase = false;
    TESSERA_RETURN_IF_ERROR(PrepareStepGraph());
  }
  // Values already allocated (the zeros Create allocates) are written in place: a model's state
  // is faulted in once, not twice.
  state_.resize(step_graph_.state.size());
  full_params_.clear();
  if (split_.rewritten()) return AllocateSplitState(seed);
  // One staging buffer for every layer's group (not a fresh one each: freed and faulted again).
  int64_t largest = 0;
  for (int64_t numel : step_graph_.group_numel) largest = std::max(largest, numel);
  std::vector<float> staging(static_cast<size_t>(std::max<int64_t>(largest, 0)));
  for (size_t l = 0; l < model_.layers.size(); ++l) {
    std::span<float> values(staging.data(), static_cast<size_t>(step_graph_.group_numel[l]));
    InitializeGroup(l, seed, values);
    TESSERA_RETURN_IF_ERROR(WriteGroup(l, StateKind::kParameter, values));
    if (adamw) {
      ParallelFill(values.data(), static_cast<int64_t>(values.size()), 0.0f);
      TESSERA_RETURN_IF_ERROR(WriteGroup(l, StateKind::kExpAvg, values));
      TESSERA_RETURN_IF_ERROR(WriteGroup(l, StateKind::kExpAvgSq, values));
    }
  }
  // 0/1 Adam starts its schedule again, its error buffers at zero (and its interval starts at
  // the parameters, before its first local step).
  for (StateKind kind : {StateKind::kWorkerError, StateKind::kServerError}) {
    TESSERA_RETURN_IF_ERROR(ZeroStateOf(kind));
  }
  set_steps_taken(0);
  return Status::Ok();
}

void Trainer::InitializeGroup(size_t l, std::optional<uint64_t> seed,
                              std::span<float> values) const {
  const LayerSpec& layer = model_.layers[l];
  ParallelFill(values.data(), static_cast<int64_t>(values.size()), 0.0f);
  // A layer without ParamInit (or no seed) starts at zero (the fill above); the padding stays.
  const std::vector<FlatSlot>& slots = layer.params.slots();
  for (size_t s = 0; s < layer.init.size() && seed.has_value(); ++s) {
    // Each slot draws from its own stream of the seed.
    const uint64_t stream = Mix(Mix(Mix(*seed) ^ static_cast<uint64_t>(l)) ^ s);
    InitializeSlot(layer.init[s], stream, values.data() + slots[s].offset, slots[s].shape.numel());
  }
}

Status Trainer::AllocateSplitState(std::optional<uint64_t> seed) {
  // The whole model's groups as a run without tensor parallelism draws them, cut into each
  // tensor rank's split groups.
  const int ranks = plan_.parallel.tensor_parallel;
  std::vector<std::vector<std::vector<float>>> planned(split_.layers.size());
  for (size_t p = 0; p < split_.layers.size(); ++p) {
    planned[p].assign(static_cast<size_t>(ranks),
                      std::vector<float>(static_cast<size_t>(step_graph_.group_numel[p]), 0.0f));
  }
  for (size_t l = 0; l < model_.layers.size() && seed.has_value(); ++l) {
    std::vector<float> whole(static_cast<size_t>(model_.layers[l].params.numel()));
    InitializeGroup(l, seed, whole);
    const auto& slots = model_.layers[l].params.slots();
    for (size_t s = 0; s < slots.size(); ++s) {
      const SliceOfSlot& slice = slices_[l][s];
      for (int t = 0; t < ranks; ++t) {
        CopySlice(slice, slots[s], t, whole.data() + slots[s].offset,
                  planned[slice.layer][static_cast<size_t>(t)].data() + slice.slot->offset,
                  /*to_slice=*/true);
      }
    }
  }
  const bool adamw = plan_.optimizer.has_moments();
  for (size_t p = 0; p < split_.layers.size(); ++p) {
    if (step_graph_.group_numel[p] == 0) continue;
    for (int t = 0; t < ranks; ++t) {
      std::vector<float>& values = planned[p][static_cast<size_t>(t)];
      TESSERA_RETURN_IF_ERROR(WritePlannedGroup(p, t, StateKind::kParameter, values));
      if (!adamw) continue;
      std::fill(values.begin(), values.end(), 0.0f);
      TESSERA_RETURN_IF_ERROR(WritePlannedGroup(p, t, StateKind::kExpAvg, values));
      TESSERA_RETURN_IF_ERROR(WritePlannedGroup(p, t, StateKind::kExpAvgSq, values));
    }
  }
  steps_taken_ = 0;
  return Status::Ok();
}

Status Trainer::WriteGroup(size_t layer, StateKind kind, std::span<const float> values) {
  if (static_cast<int64_t>(values.size()) != GroupNumel(layer)) {
    return InvalidArgument("group {} of layer '{}' has {} elements, {} given", StateKindName(kind),
                           model_.layers[layer].name, GroupNumel(layer), values.size());
  }
  if (kind == StateKind::kParameter) interval_starts_stale_ = true;  // 0/1 Adam's
  if (!split_.rewritten()) return WritePlannedGroup(layer, -1, kind, values);
  // Each split group holding a slot of the layer, read, changed and written back.
  const auto& slots = model_.layers[layer].params.slots();
  std::set<std::pair<size_t, int>> done;
  for (size_t s = 0; s < slots.size(); ++s) {
    for (int t = 0; t < plan_.parallel.tensor_parallel; ++t) {
      const size_t planned = slices_[layer][s].layer;
      if (!done.insert({planned, t}).second) continue;
      TESSERA_ASSIGN_OR_RETURN(std::vector<float> group, ReadPlannedGroup(planned, t, kind));
      for (size_t u = 0; u < slots.size(); ++u) {
        const SliceOfSlot& slice = slices_[layer][u];
        if (slice.layer != planned) continue;
        CopySlice(slice, slots[u], t, values.data() + slots[u].offset,
                  group.data() + slice.slot->offset, /*to_slice=*/true);
      }
      TESSERA_RETURN_IF_ERROR(WritePlannedGroup(planned, t, kind, group));
    }
  }
  return Status::Ok();
}

Status Trainer::WritePlannedGroup(size_t layer, int t, StateKind kind,
                                  std::span<const float> values) {
  if (static_cast<int64_t>(values.size()) != step_graph_.group_numel[layer]) {
    return InvalidArgument("group {} of layer '{}' has {} elements, {} given", StateKindName(kind),
                           split_.layers[layer].name, step_graph_.group_numel[layer],
                           values.size());
  }
  // Parameters are also written to the offloaded master copies, which hold the same values.
  const auto written = [kind](StateKind object_kind) {
    return object_kind == kind ||
           (kind == StateKind::kParameter && object_kind == StateKind::kMasterParameter);
  };
  for (size_t i = 0; i < step_graph_.state.size(); ++i) {
    const StateObject& object = step_graph_.state[i];
    if (object.piece.layer != layer || !written(object.kind)) continue;
    if (t >= 0 && plan_.parallel.TensorRankOf(object.piece.rank) != t) continue;
    TESSERA_RETURN_IF_ERROR(
        WriteStateObject(i, values.subspan(static_cast<size_t>(object.piece.begin),
                                           static_cast<size_t>(object.piece.numel))));
  }
  if (kind == StateKind::kParameter) full_params_.clear();
  return Status::Ok();
}

namespace {

// Assembles a group from pieces (replicated copies or disjoint shards): each element comes from
// the first piece, in the order given, that covers it; the rest of the pieces are not fetched.
template <typename Fetch>
Result<std::vector<float>> Assemble(int64_t numel, const std::vector<GroupPiece>& pieces,
                                    Fetch fetch) {
  std::vector<float> group(static_cast<size_t>(numel), 0.0f);
  std::vector<std::pair<int64_t, int64_t>> taken;
  int64_t covered = 0;
  for (size_t i = 0; i < pieces.size() && covered < numel; ++i) {
    const GroupPiece& piece = pieces[i];
    const int64_t end = piece.begin + piece.numel;
    const bool redundant = std::any_of(taken.begin(), taken.end(), [&](const auto& range) {
      return range.first <= piece.begin && end <= range.second;
    });
    if (redundant) continue;
    TESSERA_ASSIGN_OR_RETURN(Tensor tensor, fetch(i));
    std::memcpy(group.data() + piece.begin, tensor.raw_data(), static_cast<size_t>(tensor.bytes()));
    taken.emplace_back(piece.begin, end);
    covered += piece.numel;
  }
  return group;
}

}  // namespace

Result<std::vector<float>> Trainer::ReadGroup(size_t layer, StateKind kind) {
  return GatherWholeGroup(
      layer, [&](size_t planned, int t) { return ReadPlannedGroup(planned, t, kind); });
}

Result<std::vector<float>> Trainer::AssembleOfTensorRank(
    size_t layer, int t, const char* what, size_t count,
    const std::function<const GroupPiece*(size_t)>& piece_of, const std::vector<Value>& values) {
  std::vector<GroupPiece> pieces;
  std::vector<size_t> index;
  for (size_t i = 0; i < count; ++i) {
    const GroupPiece* piece = piece_of(i);
    if (piece == nullptr || piece->layer != layer) continue;
    if (t >= 0 && plan_.parallel.TensorRankOf(piece->rank) != t) continue;
    pieces.push_back(*piece);
    index.push_back(i);
  }
  if (pieces.empty()) {
    return NotFound("the plan holds no {} for layer '{}'", what, split_.layers[layer].name);
  }
  return Assemble(step_graph_.group_numel[layer], pieces,
                  [&](size_t i) { return backend_->Download(values[index[i]]); });
}

Result<std::vector<float>> Trainer::ReadPlannedGroup(size_t layer, int t, StateKind kind) {
  return AssembleOfTensorRank(
      layer, t, StateKindName(kind), step_graph_.state.size(),
      [&](size_t i) {
        const StateObject& object = step_graph_.state[i];
        return object.kind == kind ? &object.piece : nullptr;
      },
      state_);
}

Result<std::vector<Value>> Trainer::FullParameters() {
  std::vector<Value> params(model_.layers.size());
  if (!plan_.parallel.sharded_parameters() && !split_.rewritten()) {
    // Every rank holds whole groups: rank 0's serve.
    for (size_t i = 0; i < step_graph_.state.size(); ++i) {
      const StateObject& object = step_graph_.state[i];
      if (object.kind == StateKind::kParameter && object.piece.rank == 0) {
        params[object.piece.layer] = state_[i];
      }
    }
    return params;
  }
  if (full_params_.empty()) {
    for (size_t l = 0; l < model_.layers.size(); ++l) {
      if (GroupNumel(l) == 0) {  // no parameters
        full_params_.emplace_back();
        continue;
      }
      TESSERA_ASSIGN_OR_RETURN(std::vector<float> group, ReadGroup(l, StateKind::kParameter));
      TESSERA_ASSIGN_OR_RETURN(Tensor tensor, Tensor::Empty(F32(static_cast<int64_t>(group.size())),
                                                            backend_->allocator()));
      std::memcpy(tensor.raw_data(), group.data(), group.size() * sizeof(float));
      TESSERA_ASSIGN_OR_RETURN(Value value, backend_->Upload(std::move(tensor)));
      full_params_.push_back(std::move(value));
    }
  }
  return full_params_;
}

Result<Trainer::ParameterRef> Trainer::FindParameter(const std::string& name) const {
  for (size_t g = 0; g < model_.layers.size(); ++g) {
    const LayerSpec& layer = model_.layers[g];
    const std::string prefix = layer.ParamPrefix();
    if (!name.starts_with(prefix)) continue;
    Result<const FlatSlot*> slot = layer.params.Find(name.substr(prefix.size()));
    if (slot.ok()) return ParameterRef{g, *slot};
  }
  return InvalidArgument("the model has no parameter named '{}'", name);
}

std::vector<std::string> Trainer::ParameterNames() const {
  std::vector<std::string> names;
  for (const LayerSpec& layer : model_.layers) {
    for (const FlatSlot& slot : layer.params.slots())
      names.push_back(layer.ParamPrefix() + slot.name);
  }
  return names;
}

Status Trainer::SetParameter(const std::string& name, const std::vector<float>& values,
                             const Shape& shape) {
  TESSERA_ASSIGN_OR_RETURN(ParameterRef ref, FindParameter(name));
  if (shape != ref.slot->shape || static_cast<int64_t>(values.size()) != shape.numel()) {
    return InvalidArgument("parameter '{}' has shape {} in the model but {} ({} values) was given",
                           name, ref.slot->shape.ToString(), shape.ToString(), values.size());
  }
  // Values are immutable in a cluster: read the group, change it, and store it anew.
  TESSERA_ASSIGN_OR_RETURN(std::vector<float> group, ReadGroup(ref.group, StateKind::kParameter));
  std::copy(values.begin(), values.end(), group.begin() + ref.slot->offset);
  return WriteGroup(ref.group, StateKind::kParameter, group);
}

Result<std::vector<float>> Trainer::GetParameter(const std::string& name) {
  TESSERA_ASSIGN_OR_RETURN(ParameterRef ref, FindParameter(name));
  TESSERA_ASSIGN_OR_RETURN(std::vector<float> group, ReadGroup(ref.group, StateKind::kParameter));
  const auto begin = group.begin() + ref.slot->offset;
  return std::vector<float>(begin, begin + ref.slot->shape.numel());
}

Result<std::vector<float>> Trainer::GetGradient(const std::string& name) {
  TESSERA_ASSIGN_OR_RETURN(ParameterRef ref, FindParameter(name));
  if (last_grads_.empty()) {
    return InvalidArgument("no gradients kept: call SetKeepGradients(true), then Step");
  }
  TESSERA_ASSIGN_OR_RETURN(
      std::vector<float> group, GatherWholeGroup(ref.group, [&](size_t layer, int t) {
        return AssembleOfTensorRank(
            layer, t, "gradient", step_graph_.grads.size(),
            [&](size_t i) { return &step_graph_.grads[i].piece; }, last_grads_);
      }));
  const auto begin = group.begin() + ref.slot->offset;
  return std::vector<float>(begin, begin + ref.slot->shape.numel());
}

Result<Value> Trainer::Scalar(DType dtype, double value) {
  TESSERA_ASSIGN_OR_RETURN(
      Tensor t, Tensor::Empty(TensorMeta{Shape{}, dtype, Device::Cpu()}, backend_->allocator()));
  if (dtype == DType::kI64) {
    *t.data<int64_t>() = static_cast<int64_t>(value);
  } else {
    *t.data<float>() = static_cast<float>(value);
  }
  return backend_->Upload(std::move(t));
}

Status Trainer::CheckBatch(const std::vector<Tensor>& batch, int64_t rows, int64_t seq_len,
                           bool labels) const {
  if (batch.size() != model_.inputs.size()) {
    return InvalidArgument("model '{}' takes {} input(s) per step, {} given", model_.name,
                           model_.inputs.size(), batch.size());
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    const ModelInput& input = model_.inputs[i];
    if (input.label && !labels) continue;
    const TensorMeta want = input.Meta(rows, seq_len);
    if (!batch[i].defined() || batch[i].shape() != want.shape || batch[i].dtype() != want.dtype) {
      return InvalidArgument(
          "input '{}' is {} but the plan needs {} (the batch is dimension 0)", input.name,
          batch[i].defined() ? batch[i].meta().ToString() : "undefined", want.ToString());
    }
  }
  return Status::Ok();
}

Result<Value> Trainer::UploadRows(const Tensor& batch, int64_t first, int64_t rows, int axis,
                                  int64_t first_position, int64_t positions) {
  std::vector<int64_t> dims = batch.shape().dims();
  const int64_t row_bytes = batch.bytes() / dims[0];
  // Each row's part: all of it, or in each of its `runs` blocks along dimension `axis`,
  // positions [first_position, + positions).
  int64_t offset = 0, part = row_bytes, runs = 1, run_bytes = row_bytes;
  if (positions >= 0) {
    for (int d = 1; d < axis; ++d) runs *= dims[static_cast<size_t>(d)];
    run_bytes = row_bytes / runs;
    const int64_t position_bytes = run_bytes / dims[static_cast<size_t>(axis)];
    offset = first_position * position_bytes;
    part = positions * position_bytes;
    dims[static_cast<size_t>(axis)] = positions;
  }
  dims[0] = rows;
  Result<Tensor> made = Tensor::Empty(
      TensorMeta{Shape(std::move(dims)), batch.dtype(), Device::Cpu()}, backend_->allocator());
  if (!made.ok()) return made.status().WithContext("uploading a batch's rows");
  Tensor t = std::move(*made);
  const auto* from = static_cast<const char*>(batch.raw_data()) + first * row_bytes + offset;
  auto* to = static_cast<char*>(t.raw_data());
  if (part == row_bytes) {
    std::memcpy(to, from, static_cast<size_t>(rows * row_bytes));
  } else {
    for (int64_t r = 0; r < rows * runs; ++r) {
      std::memcpy(to + r * part, from + r * run_bytes, static_cast<size_t>(part));
    }
  }
  return backend_->Upload(std::move(t));
}

int Trainer::SplitAxisOf(size_t input) const {
  if (plan_.parallel.sequence_parallel == 1) return 0;
  const int split_axis = split_.inputs[input].split_axis;
  if (split_axis >= 1) return split_axis;
  return model_.inputs[input].sequence ? 1 : 0;
}

Status Trainer::UploadStepInputs(const StepGraph& graph, const std::vector<Tensor>& batch,
                                 const std::vector<std::vector<ObjectId>>& targets,
                                 ValueMap& inputs) {
  // Rank r's micro-batch k takes rows [(g * micro_batches + k) * b, ... + b) of the global
  // batch, g its row group: its data-parallel rank (a data-parallel rank's tensor ranks read the
  // same rows), or under sequence parallelism its group of sequence ranks, each of which takes
  // its 1/P of each sequence input's positions. The micro-batches are the step's: the memory
  // plan may have split the batch into more than the plan asked for.
  const ParallelConfig& p = graph.parallel;
  const int64_t micro = graph.micro_batch_rows;
  const int64_t micro_batches = p.micro_batches;
  for (size_t input = 0; input < targets.size(); ++input) {
    const std::vector<ObjectId>& pieces = targets[input];
    // All of each row, a sequence rank's 1/P of its positions, or a slab's of its depth.
    const int split_axis = SplitAxisOf(input);
    int axis = 1;
    int64_t positions = -1;
    if (split_axis >= 1 && batch[input].defined() && split_axis < batch[input].shape().rank()) {
      axis = split_axis;
      positions = batch[input].shape()[split_axis] / p.sequence_parallel;
    }
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (!pieces[i].valid()) continue;  // not read (a label, when predicting)
      const auto rank = static_cast<int>(static_cast<int64_t>(i) / micro_batches);
      const int64_t slice =
          p.RowGroupOf(rank) * micro_batches + static_cast<int64_t>(i) % micro_batches;
      TESSERA_ASSIGN_OR_RETURN(inputs[pieces[i]],
                               UploadRows(batch[input], slice * micro, micro, axis,
                                          p.SequenceRankOf(rank) * positions, positions));
    }
  }
  return Status::Ok();
}

Status Trainer::EnterCompressedPhase() {
  if (plan_.optimizer.kind != OptimizerConfig::Kind::kOneBitAdam ||
      plan_.optimizer.compressed_phase) {
    return Status::Ok();
  }
  // The compressed phase's state is the warm-up's, then every rank's error buffers (state
  // placement puts them last), which start at zero. Each rank's momentum is whole in it: under
  // ZeRO-1/2 the warm-up's shards of it are gathered into every rank's.
  const std::vector<StateObject> warmup = step_graph_.state;
  std::map<size_t, std::vector<float>> momentum;  // by layer: groups made whole
  for (const StateObject& object : warmup) {
    if (object.kind == StateKind::kExpAvg && !momentum.contains(object.piece.layer) &&
        object.piece.numel != step_graph_.group_numel[object.piece.layer]) {
      TESSERA_ASSIGN_OR_RETURN(momentum[object.piece.layer],
                               ReadGroup(object.piece.layer, StateKind::kExpAvg));
    }
  }
  plan_.optimizer.compressed_phase = true;
  TESSERA_RETURN_IF_ERROR(PrepareStepGraph());
  const std::vector<StateObject>& compressed = step_graph_.state;
  for (size_t i = 0; i < warmup.size(); ++i) {
    if (i >= compressed.size() || compressed[i].kind != warmup[i].kind ||
        compressed[i].piece.layer != warmup[i].piece.layer ||
        compressed[i].piece.rank != warmup[i].piece.rank ||
        (compressed[i].piece.numel != warmup[i].piece.numel &&
         !momentum.contains(compressed[i].piece.layer))) {
      return Internal("1-bit Adam: the compressed phase's state {} is not the warm-up's", i);
    }
  }
  state_.resize(compressed.size());
  for (const auto& [layer, values] : momentum) {
    TESSERA_RETURN_IF_ERROR(WriteGroup(layer, StateKind::kExpAvg, values));
  }
  for (size_t i = warmup.size(); i < compressed.size(); ++i) {
    TESSERA_RETURN_IF_ERROR(WriteStateObject(
        i, std::vector<float>(static_cast<size_t>(compressed[i].piece.numel), 0.0f)));
  }
  GetLogger("trainer")->info(
      "1-bit Adam: after {} warm-up steps the variance is frozen and each rank's momentum is "
      "averaged by a compressed all-reduce ({} error buffers)",
      steps_taken_, compressed.size() - warmup.size());
  return Status::Ok();
}

Status Trainer::WriteStateObject(size_t index, std::span<const float> values) {
  if (index >= step_graph_.state.size()) {
    return InvalidArgument("state object {} of a step holding {}", index, step_graph_.state.size());
  }
  const StateObject& object = step_graph_.state[index];
  if (static_cast<int64_t>(values.size()) != object.piece.numel) {
    return InvalidArgument("state object '{}' has {} elements, {} given",
                           step_graph_.graph.object(object.input).name, object.piece.numel,
                           values.size());
  }
  Tensor& held = state_[index].tensor;  // in process: the value itself
  if (held.defined() && held.meta() == F32(object.piece.numel)) {
    ParallelCopy(held.data<float>(), values.data(), object.piece.numel);  // on the host: in place
    return Status::Ok();
  }
  TESSERA_ASSIGN_OR_RETURN(Tensor piece,
                           Tensor::Empty(F32(object.piece.numel), backend_->allocator()));
  ParallelCopy(piece.data<float>(), values.data(), object.piece.numel);
  state_[index] = Value();  // drop the old value first (in process: frees its buffer)
  TESSERA_ASSIGN_OR_RETURN(
      state_[index],
      backend_->UploadTo(std::move(piece), step_graph_.graph.object(object.input).meta.device));
  return Status::Ok();
}

Result<StepReport> Trainer::Step(const std::vector<Tensor>& batch, float lr) {
  TESSERA_RETURN_IF_ERROR(CheckBatch(batch, plan_.batch, plan_.seq_len, /*labels=*/true));
  // 1-bit Adam past its warm-up (a no-op for other optimizers and once in the phase).
  if (steps_taken_ >= plan_.optimizer.freeze_step) {
    TESSERA_RETURN_IF_ERROR(EnterCompressedPhase());
  }
  // 0/1 Adam: the schedule's kind of step (its sync step is step_graph_).
  using ZeroOneStep = OptimizerConfig::ZeroOneStep;
  const StepGraph* graph = &step_graph_;
  int handle = step_handle_;
  static const std::vector<size_t> kSameState;
  const std::vector<size_t>* index = &kSameState;
  ZeroOneStep kind = ZeroOneStep::kSync;
  if (zero_one_) {
    kind = zero_one_->Next();
    if (kind != ZeroOneStep::kSync) {
      TESSERA_ASSIGN_OR_RETURN(KindStep * planned, ZeroOneStepGraph(kind));
      graph = &planned->graph;
      handle = planned->handle;
      index = &planned->state_index;
    }
    // Local steps start from the parameters as they are (after the variance's freezing, a
    // checkpoint's load or written parameters).
    if (kind == ZeroOneStep::kLocal || kind == ZeroOneStep::kSync) {
      if (interval_starts_stale_) TESSERA_RETURN_IF_ERROR(StartIntervalsAtTheParameters());
    }
    // The first step past the variance's freezing: the error buffers, so far the gradients',
    // start again at zero for the ranks' moves (DeepSpeed's ZeroOneAdam does the same).
    if (zero_one_->steps_taken() == plan_.optimizer.var_freeze_step) {
      TESSERA_RETURN_IF_ERROR(ZeroStateOf(StateKind::kWorkerError));
      TESSERA_RETURN_IF_ERROR(ZeroStateOf(StateKind::kServerError));
      GetLogger("trainer")->info(
          "0/1 Adam: the variance is frozen after step {}; local steps from here, the ranks "
          "synchronised every {} step(s) (up to {})",
          plan_.optimizer.var_freeze_step, zero_one_->local_step_interval(),
          plan_.optimizer.local_step_clipper);
    }
  }
  const auto state_at = [index](size_t i) { return index->empty() ? i : (*index)[i]; };
  const int64_t step_number = steps_taken_ + 1;
  const auto start = std::chrono::steady_clock::now();
  ValueMap inputs;
  TESSERA_RETURN_IF_ERROR(UploadStepInputs(*graph, batch, graph->inputs, inputs));
  TESSERA_ASSIGN_OR_RETURN(inputs[graph->lr], Scalar(DType::kF32, lr));
  TESSERA_ASSIGN_OR_RETURN(inputs[graph->step],
                           Scalar(DType::kI64, static_cast<double>(step_number)));
  if (graph->lr_sum.valid()) {
    TESSERA_ASSIGN_OR_RETURN(inputs[graph->lr_sum], Scalar(DType::kF32, lr_sum_ + lr));
  }
  // Move the state in so the optimizer can update it in place; it comes back as outputs. If the
  // run fails before the optimizer touched an object, the backend hands that object back.
  full_params_.clear();
  for (size_t i = 0; i < graph->state.size(); ++i) {
    inputs[graph->state[i].input] = std::move(state_[state_at(i)]);
  }
  ValueMap intact;
  Result<ValueMap> run = backend_->Run(handle, std::move(inputs), &intact);
  if (!run.ok()) return RecoverState(run.status(), intact, *graph, *index);
  ValueMap& outputs = *run;
  for (size_t i = 0; i < graph->state.size(); ++i) {
    state_[state_at(i)] = std::move(outputs[graph->state[i].output]);
  }
  last_grads_.clear();
  if (keep_gradients_) {
    for (const GradientObject& grad : graph->grads) {
      last_grads_.push_back(std::move(outputs[grad.id]));
    }
  }
  steps_taken_ = step_number;
  if (zero_one_) {
    zero_one_->Advance();
    lr_sum_ = kind == ZeroOneStep::kLocal ? lr_sum_ + lr : 0.0f;
  }
  TESSERA_ASSIGN_OR_RETURN(Tensor loss, backend_->Download(outputs[graph->loss]));
  TESSERA_ASSIGN_OR_RETURN(Tensor grad_norm, backend_->Download(outputs[graph->grad_norm]));
  StepReport report;
  report.step = step_number;
  report.loss = *loss.data<float>();
  report.grad_norm = *grad_norm.data<float>();
  report.step_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  report.peak_bytes = backend_->last_peak_bytes();
  report.device_peak_bytes = backend_->last_device_peak_bytes();
  const std::vector<WorkerId>& workers = plan_.parallel.workers;
  if (!workers.empty() || backend_->workers().empty()) {
    TESSERA_ASSIGN_OR_RETURN(auto figures, backend_->LastRunFigures(handle, workers));
    for (size_t r = 0; r < figures.size(); ++r) {
      report.ranks.push_back(
          RankFigures{static_cast<int>(r), figures[r].first, std::move(figures[r].second)});
    }
  }
  return report;
}

Status Trainer::RecoverState(const Status& error, ValueMap& intact, const StepGraph& graph,
                             const std::vector<size_t>& index) {
  std::vector<std::string> lost;
  for (size_t i = 0; i < graph.state.size(); ++i) {
    const ObjectId id = graph.state[i].input;
    auto it = intact.find(id);
    if (it != intact.end()) {
      state_[index.empty() ? i : index[i]] = std::move(it->second);
    } else {
      lost.push_back(graph.graph.object(id).name);
    }
  }
  if (lost.empty()) return error;  // state unchanged; the step can be retried
  return DataLoss(
      "{}; the step failed after {} state object(s) were handed to it to update in place "
      "(e.g. '{}'), so they are lost: restore the model from a checkpoint",
      error.ToString(), lost.size(), lost.front());
}

Result<const Trainer::PlacedForward*> Trainer::PlacedForwardOf(ForwardResult result) {
  auto it = placed_forwards_.find(result);
  if (it == placed_forwards_.end()) {
    PlacedForward placed;
    TESSERA_ASSIGN_OR_RETURN(placed.forward, PlanStepForward(step_graph_, result));
    TESSERA_ASSIGN_OR_RETURN(placed.handle, backend_->Register(placed.forward.graph));
    it = placed_forwards_.emplace(result, std::move(placed)).first;
  }
  return &it->second;
}

Result<ValueMap> Trainer::RunPlaced(const PlacedForward& placed, const std::vector<Tensor>& batch) {
  ValueMap inputs;
  TESSERA_RETURN_IF_ERROR(UploadStepInputs(step_graph_, batch, placed.forward.inputs, inputs));
  // The state is read, not moved: it stays the trainer's (PlanStepForward leaves no task that
  // may take over its buffers).
  for (size_t i = 0; i < placed.forward.state.size(); ++i) {
    if (placed.forward.state[i].valid()) inputs[placed.forward.state[i]] = state_[i];
  }
  return backend_->Run(placed.handle, std::move(inputs));
}

Result<float> Trainer::EvalLoss(const std::vector<Tensor>& batch) {
  TESSERA_RETURN_IF_ERROR(CheckBatch(batch, plan_.batch, plan_.seq_len, /*labels=*/true));
  TESSERA_ASSIGN_OR_RETURN(const PlacedForward* placed, PlacedForwardOf(ForwardResult::kLoss));
  TESSERA_ASSIGN_OR_RETURN(ValueMap outputs, RunPlaced(*placed, batch));
  TESSERA_ASSIGN_OR_RETURN(Tensor loss, backend_->Download(outputs[placed->forward.loss]));
  return *loss.data<float>();
}

Result<Tensor> Trainer::PredictPlaced(const std::vector<Tensor>& batch, int64_t rows) {
  TESSERA_ASSIGN_OR_RETURN(const PlacedForward* placed,
                           PlacedForwardOf(ForwardResult::kPredictions));
  const ParallelConfig& p = step_graph_.parallel;
  const int64_t micro = step_graph_.micro_batch_rows;
  const int64_t micro_batches = p.micro_batches;
  // The prediction splits along the axis of the first split input (a slab's depth, a sequence
  // rank's positions): each rank's part is its rows and 1/S of that axis.
  int axis = 0;
  for (size_t i = 0; i < model_.inputs.size() && axis == 0; ++i) {
    if (!model_.inputs[i].label) axis = SplitAxisOf(i);
  }
  // Every rank's part has the shape the step planned: its micro-batch's rows, each `runs`
  // blocks of `run_bytes`, each block 1/`parts` of the whole's along `axis`.
  const TensorMeta& part_meta =
      placed->forward.graph.object(placed->forward.predictions.front()).meta;
  std::vector<int64_t> dims = part_meta.shape.dims();
  int64_t runs = 1, parts = 1;
  if (axis >= 1 && axis < static_cast<int>(dims.size())) {
    parts = p.sequence_parallel;
    for (int d = 1; d < axis; ++d) runs *= dims[static_cast<size_t>(d)];
    dims[static_cast<size_t>(axis)] *= parts;
  }
  const int64_t run_bytes = part_meta.bytes() / micro / runs;
  dims[0] = rows;
  TESSERA_ASSIGN_OR_RETURN(Tensor whole, Tensor::Empty(TensorMeta{Shape(std::move(dims)),
                                                                  part_meta.dtype, Device::Cpu()},
                                                       SharedHostAllocator()));
  auto* to = static_cast<char*>(whole.raw_data());
  for (int64_t first = 0; first < rows; first += plan_.batch) {
    std::vector<Tensor> chunk;
    if (first > 0 || rows != plan_.batch) {
      TESSERA_ASSIGN_OR_RETURN(chunk, ChunkOfRows(batch, first, rows));
    }
    TESSERA_ASSIGN_OR_RETURN(ValueMap outputs, RunPlaced(*placed, chunk.empty() ? batch : chunk));
    // Each rank's part (tensor rank 0's of a tensor group, which all hold the same) to its rows
    // and its 1/S along `axis`.
    for (size_t i = 0; i < placed->forward.predictions.size(); ++i) {
      const auto rank = static_cast<int>(static_cast<int64_t>(i) / micro_batches);
      if (p.TensorRankOf(rank) != 0) continue;
      TESSERA_ASSIGN_OR_RETURN(Tensor part,
                               backend_->Download(outputs[placed->forward.predictions[i]]));
      if (part.shape() != part_meta.shape) {
        return Internal("rank {}'s prediction is {}; the step planned {}", rank,
                        part.meta().ToString(), part_meta.ToString());
      }
      // Rows [first + slice * micro, + micro) of the whole, those within `rows`.
      const int64_t slice =
          p.RowGroupOf(rank) * micro_batches + static_cast<int64_t>(i) % micro_batches;
      const int64_t piece_first = first + slice * micro;
      const int64_t piece_rows = std::min(micro, rows - piece_first);
      const int64_t slab = parts > 1 ? p.SequenceRankOf(rank) : 0;
      const auto* from = static_cast<const char*>(part.raw_data());
      for (int64_t r = 0; r < piece_rows * runs; ++r) {
        std::memcpy(to + ((piece_first * runs + r) * parts + slab) * run_bytes,
                    from + r * run_bytes, static_cast<size_t>(run_bytes));
      }
    }
  }
  return whole;
}

Result<std::vector<Tensor>> Trainer::ChunkOfRows(const std::vector<Tensor>& batch, int64_t first,
                                                 int64_t rows) const {
  const int64_t taken = std::min(plan_.batch, rows - first);
  std::vector<Tensor> chunk(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    if (model_.inputs[i].label || !batch[i].defined()) continue;
    std::vector<int64_t> dims = batch[i].shape().dims();
    const int64_t row_bytes = batch[i].bytes() / dims[0];
    dims[0] = plan_.batch;
    TESSERA_ASSIGN_OR_RETURN(
        chunk[i], Tensor::Empty(TensorMeta{Shape(std::move(dims)), batch[i].dtype(), Device::Cpu()},
                                SharedHostAllocator()));
    auto* to = static_cast<char*>(chunk[i].raw_data());
    std::memcpy(to, static_cast<const char*>(batch[i].raw_data()) + first * row_bytes,
                static_cast<size_t>(taken * row_bytes));
    std::memset(to + taken * row_bytes, 0, static_cast<size_t>((plan_.batch - taken) * row_bytes));
  }
  return chunk;
}

Result<Tensor> Trainer::Predict(const std::vector<Tensor>& batch) {
  // The batch's rows and seq_len: those of its first (non-label) input, and of its first
  // sequence input; the plan's seq_len when none is one.
  int64_t rows = -1, seq_len = plan_.seq_len;
  bool sequence_seen = false;
  for (size_t i = 0; i < batch.size() && i < model_.inputs.size(); ++i) {
    const ModelInput& input = model_.inputs[i];
    if (input.label || !batch[i].defined() || batch[i].shape().rank() < 1) continue;
    if (rows < 0) rows = batch[i].shape()[0];
    if (input.sequence && !sequence_seen && batch[i].shape().rank() >= 2) {
      seq_len = batch[i].shape()[1];
      sequence_seen = true;
      if (seq_len < 1 || seq_len > input.shape[1]) {
        return InvalidArgument("input '{}' has {} positions; the model takes 1 to {}", input.name,
                               seq_len, input.shape[1]);
      }
    }
  }
  if (rows < 1) rows = plan_.batch;  // CheckBatch names the missing input
  TESSERA_RETURN_IF_ERROR(CheckBatch(batch, rows, seq_len, /*labels=*/false));
  // On the step's placement where the prediction is what the loss reads (not a predict_op of its
  // own) and the positions are the step's.
  TESSERA_ASSIGN_OR_RETURN(const size_t loss_layer, model_.LossLayer());
  if (model_.layers[loss_layer].predict_op.empty() && seq_len == plan_.seq_len) {
    return PredictPlaced(batch, rows);
  }
  TESSERA_ASSIGN_OR_RETURN(const PlannedForward* graph, PredictionGraph(rows, seq_len));
  return RunForward(graph->graph, graph->handle, batch);
}

Result<const Trainer::PlannedForward*> Trainer::PredictionGraph(int64_t batch, int64_t seq_len) {
  const auto key = std::make_pair(batch, seq_len);
  auto it = prediction_graphs_.find(key);
  if (it == prediction_graphs_.end()) {
    TESSERA_ASSIGN_OR_RETURN(ForwardGraph graph, PlanLogits(model_, batch, seq_len, *registry_,
                                                            ParamMultiple(), plan_.device));
    TESSERA_ASSIGN_OR_RETURN(int handle, backend_->Register(graph.graph));
    it = prediction_graphs_.emplace(key, PlannedForward{std::move(graph), handle}).first;
  }
  return &it->second;
}

Result<Tensor> Trainer::RunForward(const ForwardGraph& graph, int handle,
                                   const std::vector<Tensor>& batch) {
  ValueMap inputs;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!graph.inputs[i].valid()) continue;  // a label, when predicting
    TESSERA_ASSIGN_OR_RETURN(inputs[graph.inputs[i]], UploadRows(batch[i], 0, batch[i].shape()[0]));
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<Value> params, FullParameters());
  for (size_t g = 0; g < params.size(); ++g) {
    if (graph.params[g].valid()) inputs[graph.params[g]] = params[g];
  }
  TESSERA_ASSIGN_OR_RETURN(ValueMap outputs, backend_->Run(handle, std::move(inputs)));
  return backend_->Download(outputs[graph.result]);
}

Result<std::vector<Value>> Trainer::RunStateTasks(const std::string& op,
                                                  const std::vector<size_t>& indices,
                                                  const std::vector<StateTask>& tasks) {
  if (indices.size() != tasks.size()) {
    return InvalidArgument("{} of {} state objects: {} tasks given", op, indices.size(),
                           tasks.size());
  }
  // The graph is planned and registered once per op, objects, pins and attributes.
  std::string key = op;
  for (size_t i = 0; i < indices.size(); ++i) {
    key += fmt::format("|{}@{}:{}", indices[i], tasks[i].worker.value(), tasks[i].path);
  }
  auto it = state_task_graphs_.find(key);
  if (it == state_task_graphs_.end()) {
    GraphBuilder builder(*registry_);
    StateTaskGraph made;
    for (size_t i = 0; i < indices.size(); ++i) {
      if (indices[i] >= step_graph_.state.size()) {
        return InvalidArgument("{}: no state object {}", op, indices[i]);
      }
      const StateObject& object = step_graph_.state[indices[i]];
      const ObjectSpec& spec = step_graph_.graph.object(object.input);
      // One input per state object, however many tasks read it.
      auto [input, added] = made.inputs.try_emplace(indices[i]);
      if (added) input->second = builder.AddInput(spec.name, spec.meta, spec.role);
      TaskOptions options;
      options.layer = split_.layers[object.piece.layer].name;
      options.device_kind = spec.meta.device.kind;
      options.pinned_worker = tasks[i].worker;
      options.output_names = {fmt::format("{}:{}{}", spec.name, op, i)};
      options.output_roles = {ObjectRole::kOutput};
      Attrs attrs;
      if (!tasks[i].path.empty()) attrs.Set("path", tasks[i].path);
      TESSERA_ASSIGN_OR_RETURN(auto output,
                               builder.AddTask(fmt::format("{}/{}/{}", op, spec.name, i), op,
                                               {input->second}, attrs, std::move(options)));
      made.outputs.push_back(output[0]);
      builder.MarkOutput(output[0]);
    }
    TESSERA_ASSIGN_OR_RETURN(Graph graph, builder.Build());
    TESSERA_ASSIGN_OR_RETURN(made.handle, backend_->Register(graph));
    it = state_task_graphs_.emplace(key, std::move(made)).first;
  }
  const StateTaskGraph& graph = it->second;
  ValueMap inputs;
  for (const auto& [index, input] : graph.inputs) inputs[input] = state_.at(index);
  TESSERA_ASSIGN_OR_RETURN(ValueMap outputs, backend_->Run(graph.handle, std::move(inputs)));
  std::vector<Value> values;
  values.reserve(graph.outputs.size());
  for (ObjectId id : graph.outputs) values.push_back(std::move(outputs[id]));
  return values;
}

WorkerId Trainer::PlanWorker(int index) const {
  return plan_.parallel.workers.empty() ? WorkerId()
                                        : plan_.parallel.workers[static_cast<size_t>(index)];
}

Result<std::vector<Trainer::FileReceipt>> Trainer::WriteState(
    const std::vector<size_t>& indices, const std::vector<std::string>& paths) {
  if (indices.size() != paths.size()) {
    return InvalidArgument("WriteState: {} state objects but {} paths", indices.size(),
                           paths.size());
  }
  std::vector<StateTask> tasks;
  for (size_t i = 0; i < indices.size(); ++i) {
    if (indices[i] >= step_graph_.state.size()) {
      return InvalidArgument("WriteState: no state object {}", indices[i]);
    }
    tasks.push_back({step_graph_.WorkerOf(step_graph_.state[indices[i]].piece), paths[i]});
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<Value> outputs, RunStateTasks("write_file", indices, tasks));
  std::vector<FileReceipt> receipts;
  for (const Value& output : outputs) {
    TESSERA_ASSIGN_OR_RETURN(Tensor receipt, backend_->Download(output));
    receipts.push_back(FileReceipt{receipt.data<int64_t>()[0],
                                   std::bit_cast<uint64_t>(receipt.data<int64_t>()[1])});
  }
  return receipts;
}

Result<std::vector<Value>> Trainer::CopyState(const std::vector<size_t>& indices,
                                              const std::vector<WorkerId>& workers) {
  if (indices.size() != workers.size()) {
    return InvalidArgument("CopyState: {} state objects but {} workers", indices.size(),
                           workers.size());
  }
  std::vector<StateTask> tasks;
  tasks.reserve(workers.size());
  for (WorkerId worker : workers) tasks.push_back({worker, ""});
  return RunStateTasks("copy", indices, tasks);
}

int64_t Trainer::ParameterBytes() const { return 4 * model_.NumParameters(); }

int64_t Trainer::OptimizerStateBytes() const {
  const int64_t params = model_.NumParameters();
  int64_t bytes = plan_.optimizer.has_moments() ? 8 * params : 0;
  // 1-bit Adam's compressed phase: each rank's worker error (a group's length) and server error
  // (its chunk of it), about 4 (1 + 1/N) bytes a parameter.
  const int ranks = plan_.parallel.data_parallel;
  if (plan_.optimizer.compressed_phase && ranks > 1) bytes += 4 * params + 4 * params / ranks;
  return bytes;
}

}  // namespace tessera

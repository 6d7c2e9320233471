// The memory plan: a step planned under per-worker caps (TrainingPlan::memory).
//
// 1. Plan the step keeping every activation and predict each worker's memory
//    (planner/memory_model.h). If the capped tier's peak fits, that is the plan.
// 2. Otherwise, per worker, describe its chain to the activation solver
//    (planner/activation_solver.h): per layer, the bytes its forward makes that only its
//    backward reads (what it saves; the loss layer's are kept, its backward following its
//    forward at once), its forward and backward times (measured layer_op_costs, else the op cost
//    model's estimate and twice it), and the bytes live besides every saved object while its
//    forward and its backward run (the largest over micro-batches), and the partial keeps its
//    forward op offers (PartialKeeps: OpDef::rebuild_options). Layers any worker recomputes
//    are recomputed on every rank (the ranks run the same chain).
//    With several micro-batches, each rank's run one after another first (PlanState::
//    serialize_micro_batches): if that fits, nothing is recomputed.
// 3. Plan again with those choices (the expansion adds the recomputes) and predict again: the
//    model, not the solver's simpler view, has the last word. If a worker still exceeds the cap,
//    solve again with the cap lowered by the excess and by the room the solver's choices left
//    unused (else it would choose the same again; a few rounds).
// Across workers a plan fits when each worker's predicted peak plus the largest object one worker
// pushes to another, once per micro-batch a worker may hold in flight (a pipeline's; else once),
// is under the cap. The model counts a push from the earliest it can arrive, and its sender's
// allocator waits for a push's lent buffer rather than pass the cap (core/allocator.h); the room
// is a margin kept from before both, for what the model does not see.
// 4. When even the least activations (every layer recomputed) do not fit, the plan changes on
//    its own and steps 1-4 run again for the changed plan under the same caps: a GPU plan whose
//    device cap is too small for its model state moves the parameters to the host
//    (OffloadMode::kParameters: copied up for each use, prefetch_layers ahead; gradients down as
//    they complete; the update on the host), keeping the largest layers' on the device that fit
//    without more activation overhead than their uploads would leave unhidden
//    (KeepLargestParametersResident); else (or where that is not
//    enough: the changed plan changes again) a plan whose rows split runs each rank's batch as
//    twice the micro-batches (each activation in proportion to the rows).
// A cap nothing fits under is refused with the figures: the peak keeping everything and what is
// live at it, the peak recomputing every layer, and what to change.
//
// Swapping (with measured layer times; GPU workers given the host link's bandwidth, CPU workers
// a swap file's): a swapped layer's saved activations (whole, or the part a partial keep saves)
// are copied one tier down after its forward and back one layer ahead of its backward (the
// expansion's swap_out / swap_in copies); on CPU workers each byte copied also costs the
// compute time MemoryCaps::disk_copy_compute_us_per_byte says.
//
// Pipelines (schedules that do not split backwards): each rank's layers on each stage worker are
// a chain of their own, what they keep held as many times as the stage holds micro-batches in
// flight (ActivationLayer::kept_copies, from the worker's order: 1F1B's P - s); the schedule
// runs a recompute just before its backward (schedule_pass.cc). The memory model checks the
// interleaved result as above.
// Split backwards (zero-bubble schedules: --schedule zb-h1): what a layer saves, and its input
// half's stash, wait for its deferred weight half, which recomputing does not move. Under a cap
// the split plan exceeds, every layer's backward runs whole first (ActivationDecision::
// whole_backward; the schedule's order otherwise the same: ZB-H1's W ops of those layers become
// part of their B), the steps above run on that plan, and then the layers kept whole get their
// halves back, last layer first, while the plan still fits (ResplitWhileItFits).
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "ops/standard_ops.h"
#include "planner/model_facts.h"
#include "planner/plan_passes.h"

namespace tessera {
namespace {

constexpr int kVerifyRounds = 4;

int64_t CapOf(const TrainingPlan& plan, MemoryTier tier) {
  return tier == MemoryTier::kDevice ? plan.memory.device_bytes : plan.memory.host_bytes;
}

const char* CapFlag(MemoryTier tier) {
  return tier == MemoryTier::kDevice ? "--device-memory-gib" : "--host-memory-gib";
}

std::string Mib(int64_t bytes) {
  return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / (1 << 20));
}

// Bytes live in `tier` while each task of a worker's order runs: every object and the task's
// kernel scratch, or only activations; less the objects in `without`.
std::vector<int64_t> LiveDuring(const WorkerMemory& memory, MemoryTier tier, bool activations_only,
                                const std::set<ObjectId>& without = {}) {
  const size_t size = memory.order.tasks.size();
  std::vector<int64_t> delta(size + 1, 0);
  for (const ObjectLifetime& life : memory.objects) {
    if (life.tier != tier || without.contains(life.object)) continue;
    if (activations_only && life.role != ObjectRole::kActivation) continue;
    const int end = std::min(life.last_live(), static_cast<int>(size) - 1);
    const int first = std::max(life.first, 0);
    if (end < first) continue;
    delta[static_cast<size_t>(first)] += life.bytes;
    delta[static_cast<size_t>(end) + 1] -= life.bytes;
  }
  std::vector<int64_t> live(size, 0);
  int64_t running = 0;
  for (size_t p = 0; p < size; ++p) {
    live[p] = running += delta[p];
    if (!activations_only) live[p] += memory.scratch[p][static_cast<size_t>(tier)];
  }
  return live;
}

// The largest over the workers of a tier's peak and of its activations' peak, and which worker
// has the tier's.
struct Peaks {
  int64_t total = 0, activations = 0;
  size_t worker = 0;
  // The largest object one worker pushes to another (any role; an activation): the caps leave
  // room for it (the margin above).
  int64_t pushed = 0, pushed_activation = 0;
};

Peaks PeaksOf(const MemoryProfile& profile, MemoryTier tier) {
  Peaks peaks;
  for (size_t w = 0; w < profile.workers.size(); ++w) {
    const int64_t total = profile.workers[w].peaks[static_cast<size_t>(tier)].bytes;
    if (total > peaks.total) {
      peaks.total = total;
      peaks.worker = w;
    }
    for (int64_t bytes : LiveDuring(profile.workers[w], tier, /*activations_only=*/true)) {
      peaks.activations = std::max(peaks.activations, bytes);
    }
    for (const ObjectLifetime& life : profile.workers[w].objects) {
      if (!life.received || life.tier != tier) continue;
      peaks.pushed = std::max(peaks.pushed, life.bytes);
      if (life.role == ObjectRole::kActivation) {
        peaks.pushed_activation = std::max(peaks.pushed_activation, life.bytes);
      }
    }
  }
  return peaks;
}

// The caps in force: the tier's, and the activations' (from the budget); 0: none.
struct Caps {
  int64_t total = 0, activations = 0;
  // How many pushes a worker may have left late at once: one per micro-batch it holds in flight
  // (a pipeline's first stage: up to its stages times virtual stages, at most the micro-batches).
  int64_t late_pushes = 1;
  // Whether `peaks`, with room for late pushes, is under both caps.
  bool Fit(const Peaks& peaks) const {
    return (total == 0 || peaks.total + late_pushes * peaks.pushed <= total) &&
           (activations == 0 ||
            peaks.activations + late_pushes * peaks.pushed_activation <= activations);
  }
  // How far `peaks`, with room for late pushes, is over the tighter cap.
  int64_t Excess(const Peaks& peaks) const {
    int64_t excess = 0;
    if (total > 0) excess = std::max(excess, peaks.total + late_pushes * peaks.pushed - total);
    if (activations > 0) {
      excess =
          std::max(excess, peaks.activations + late_pushes * peaks.pushed_activation - activations);
    }
    return excess;
  }
};

// "parameter 1.00 MiB, activation 3.00 MiB, ..." live at a tier's peak.
std::string LiveByRole(const TierPeak& peak) {
  std::string text;
  for (size_t role = 0; role < kObjectRoles; ++role) {
    if (peak.by_role[role] == 0) continue;
    text += fmt::format("{}{} {}", text.empty() ? "" : ", ",
                        ObjectRoleName(static_cast<ObjectRole>(role)), Mib(peak.by_role[role]));
  }
  return text;
}

// Per layer, its forward and backward times as the solver sees them.
Result<std::vector<OpCosts>> LayerTimes(const ModelSpec& model, const TrainingPlan& plan,
                                        const OpRegistry& registry) {
  if (!plan.parallel.layer_op_costs.empty()) {
    std::vector<OpCosts> micros = plan.parallel.layer_op_costs;  // measured in milliseconds
    for (OpCosts& c : micros) c = OpCosts{1e3 * c.forward, 1e3 * c.backward, 1e3 * c.weight};
    return micros;
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<double> forward,
                           EstimateLayerCosts(model, plan.parallel.MicroBatchRows(plan.batch),
                                              plan.parallel.RankSeqLen(plan.seq_len), registry));
  std::vector<OpCosts> costs;
  costs.reserve(forward.size());
  for (double f : forward) costs.push_back(OpCosts{f, 2 * f, 0});
  return costs;
}

// The partial keeps a layer's forward op offers (OpDef::rebuild_options): per option, the bytes
// its outputs in `saved` then hold (inferred with the attribute set), and the time to rebuild the
// rest, the layer's forward time scaled by the op cost model's ratio of the two.
Result<std::vector<PartialKeep>> PartialKeeps(const Graph& graph, const OpRegistry& registry,
                                              TaskId forward, const std::vector<ObjectId>& saved,
                                              const ActivationLayer& layer) {
  const TaskSpec& task = graph.task(forward);
  TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry.Find(task.op));
  std::vector<PartialKeep> keeps;
  if (def->rebuild_options.empty() || !def->rebuild_cost) return keeps;
  std::vector<TensorMeta> inputs;
  inputs.reserve(task.inputs.size());
  for (ObjectId input : task.inputs) inputs.push_back(graph.object(input).meta);
  TESSERA_ASSIGN_OR_RETURN(OpCost whole, registry.Cost(task.op, inputs, task.attrs));
  for (const std::string& option : def->rebuild_options) {
    Attrs attrs = task.attrs;
    attrs.Set(kRebuildAttr, option);
    Result<std::vector<TensorMeta>> outputs = registry.InferShapes(task.op, inputs, attrs);
    if (!outputs.ok()) continue;  // not on these shapes or this device (bf16 activations)
    PartialKeep keep{.rebuild = option};
    for (size_t i = 0; i < task.outputs.size() && i < outputs->size(); ++i) {
      if (std::find(saved.begin(), saved.end(), task.outputs[i]) != saved.end()) {
        keep.kept_bytes += (*outputs)[i].bytes();
      }
    }
    if (keep.kept_bytes >= layer.saved_bytes) continue;
    TESSERA_ASSIGN_OR_RETURN(OpCost rebuild, def->rebuild_cost(registry, inputs, attrs));
    keep.rebuild_us =
        CostUnits(whole) > 0 ? layer.forward_us * CostUnits(rebuild) / CostUnits(whole) : 0;
    keeps.push_back(std::move(keep));
  }
  return keeps;
}

// One worker's chain as the solver sees it.
struct Chain {
  ActivationProblem problem;
  std::vector<size_t> layers;  // problem index -> model layer
};

// The tasks reading each object (by id - 1).
std::vector<std::vector<TaskId>> ReadersOf(const Graph& graph) {
  std::vector<std::vector<TaskId>> readers(graph.objects().size());
  for (const TaskSpec& task : graph.tasks()) {
    for (ObjectId input : task.inputs) readers[input.value() - 1].push_back(task.id);
  }
  return readers;
}

// `readers`: ReadersOf(planned's graph); `lowered`: bytes the solver is to leave free besides (the
// memory model saw more than it). An empty chain when the rank runs no layer on the worker.
Result<Chain> DescribeChain(const ModelSpec& model, const TrainingPlan& plan,
                            const OpRegistry& registry, const PlannedPasses& planned,
                            const std::vector<std::vector<TaskId>>& readers,
                            const WorkerMemory& memory, size_t rank, MemoryTier tier,
                            const Caps& caps, int64_t lowered, const std::vector<OpCosts>& times) {
  const Graph& graph = planned.step.graph;
  const auto& forward = planned.forward_task[rank];
  const auto& backward = planned.backward_task[rank];
  std::map<TaskId, int> position;
  for (size_t p = 0; p < memory.order.tasks.size(); ++p) {
    position[memory.order.tasks[p]] = static_cast<int>(p);
  }
  if (std::none_of(forward.begin(), forward.end(), [&](const std::vector<TaskId>& tasks) {
        return !tasks.empty() && position.contains(tasks[0]);
      })) {
    return Chain{};
  }
  const size_t micro_batches = forward.empty() ? 0 : forward[0].size();
  // What each layer's forward saves (per micro-batch), and every saved object on this worker.
  std::vector<std::vector<ObjectId>> saved_of(model.layers.size());
  std::set<ObjectId> saved;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    for (size_t k = 0; k < micro_batches; ++k) {
      const TaskId f = forward[l][k], b = backward[l][k];
      if (!f.valid() || !b.valid()) continue;
      for (ObjectId output : graph.task(f).outputs) {
        const std::vector<TaskId>& by = readers[output.value() - 1];
        if (!by.empty() && std::all_of(by.begin(), by.end(), [&](TaskId t) { return t == b; })) {
          if (k == 0) saved_of[l].push_back(output);
          saved.insert(output);
        }
      }
    }
  }
  // The bytes live besides every saved object while each task runs, as the solver's one cap
  // sees them: under both caps, the activations' base is raised by how much tighter their cap
  // is, so that base + kept <= cap holds exactly when both constraints do.
  const std::vector<int64_t> all = LiveDuring(memory, tier, false, saved);
  const std::vector<int64_t> activations = LiveDuring(memory, tier, true, saved);
  const int64_t cap = caps.total > 0 ? caps.total : caps.activations;
  auto base_at = [&](TaskId task) -> int64_t {
    auto it = position.find(task);
    if (it == position.end()) return 0;
    const auto p = static_cast<size_t>(it->second);
    int64_t base = caps.total > 0 ? all[p] : 0;
    if (caps.activations > 0) base = std::max(base, activations[p] + cap - caps.activations);
    return std::max<int64_t>(base + lowered, 0);
  };
  // The micro-batches in flight on this worker at most (a pipeline stage's: 1F1B keeps up to
  // P - s of them; one after another: one): what a layer keeps is held that many times over.
  size_t first_here = model.layers.size();
  for (size_t l = 0; l < model.layers.size() && first_here == model.layers.size(); ++l) {
    if (!forward[l].empty() && position.contains(forward[l][0])) first_here = l;
  }
  int64_t in_flight = 1;
  if (first_here < model.layers.size()) {
    std::set<TaskId> starts(forward[first_here].begin(), forward[first_here].end());
    std::set<TaskId> ends(backward[first_here].begin(), backward[first_here].end());
    int64_t running = 0;
    for (TaskId task : memory.order.tasks) {
      if (starts.contains(task)) in_flight = std::max(in_flight, ++running);
      if (ends.contains(task)) --running;
    }
  }
  Chain chain;
  chain.problem.cap_bytes = cap;
  chain.problem.cap_counts_scratch = caps.total > 0;
  // Swapping needs somewhere to swap to (a GPU's host, a CPU worker's swap file), the link's
  // bandwidth, and times in microseconds.
  chain.problem.link_bytes_per_us = plan.SwapLinkBytesPerUs();
  chain.problem.copy_compute_us_per_byte =
      plan.device.is_cpu() ? plan.memory.disk_copy_compute_us_per_byte : 0;
  chain.problem.allow_swap =
      chain.problem.link_bytes_per_us > 0 && !plan.parallel.layer_op_costs.empty();
  for (size_t l = 0; l < model.layers.size(); ++l) {
    // The loss layer's backward follows its forward at once: kept, but its memory counts.
    if (saved_of[l].empty() && !model.layers[l].loss) continue;
    if (forward[l].empty() || !position.contains(forward[l][0])) continue;  // another stage's
    ActivationLayer layer;
    layer.must_keep = model.layers[l].loss;
    for (ObjectId id : saved_of[l]) layer.saved_bytes += graph.object(id).meta.bytes();
    for (ObjectId id : graph.task(forward[l][0]).outputs) {
      if (std::find(saved_of[l].begin(), saved_of[l].end(), id) == saved_of[l].end()) {
        layer.recompute_bytes += graph.object(id).meta.bytes();
      }
    }
    layer.kept_copies = in_flight;
    layer.forward_us = times[l].forward;
    layer.backward_us = times[l].backward + times[l].weight;
    if (!layer.must_keep) {  // split backwards run whole under a cap: rebuilding is theirs
      TESSERA_ASSIGN_OR_RETURN(layer.partial_keeps,
                               PartialKeeps(graph, registry, forward[l][0], saved_of[l], layer));
    }
    int64_t base_forward = 0, base_backward = 0;
    for (size_t k = 0; k < micro_batches; ++k) {
      base_forward = std::max(base_forward, base_at(forward[l][k]));
      base_backward = std::max(base_backward, base_at(backward[l][k]));
    }
    chain.problem.layers.push_back(layer);
    chain.problem.base_forward_bytes.push_back(base_forward);
    chain.problem.base_backward_bytes.push_back(base_backward);
    chain.layers.push_back(l);
  }
  return chain;
}

// Whether the plan's micro-batches may run one after another: several, and no pipeline (whose
// schedule interleaves them).
bool SerializesMicroBatches(const TrainingPlan& plan) {
  const ParallelConfig& p = plan.parallel;
  return p.micro_batches > 1 && p.pipeline_stages == 1 && p.virtual_stages == 1;
}

// Whether the memory plan may move a GPU plan's parameters to the host (OffloadMode::
// kParameters) when nothing else fits: not already, and where each rank updates the parameters
// it keeps (what parameter offload needs: plan_validation.cc refuses the rest).
bool StreamsParametersIfNeeded(const TrainingPlan& plan) {
  const ParallelConfig& p = plan.parallel;
  return !plan.device.is_cpu() && p.offload != OffloadMode::kParameters &&
         UpdatesTheParametersItKeeps(p);
}

Result<StepGraph> Fit(const ModelSpec& model, const TrainingPlan& plan, const OpRegistry& registry,
                      bool suggest, int64_t activation_cap);

// What streaming layer l's parameters costs a step beyond what compute hides, in the solver's
// microseconds: per micro-batch, a copy up for its forward, beside the forward of the layer
// before, and one for its backward, beside the backward of the layer after, each taking the
// piece's bytes over the host link. Zero without the link's bandwidth and measured layer times
// (the solver's times are then the cost model's units, not microseconds).
double ExposedUploadUs(const ModelSpec& model, const TrainingPlan& plan, const StepGraph& step,
                       size_t l) {
  const std::vector<OpCosts>& ms = plan.parallel.layer_op_costs;
  const double link = plan.memory.host_link_bytes_per_us;
  if (ms.empty() || link <= 0) return 0;
  // Under ZeRO-3 a rank uploads its shard (groups are padded to a multiple of the ranks).
  const int64_t pieces = plan.parallel.zero_stage == 3 ? plan.parallel.data_parallel : 1;
  const int64_t piece_bytes = step.group_numel[l] / pieces * int64_t{sizeof(float)};
  const double upload_us = static_cast<double>(piece_bytes) / link;
  const double before_us = l > 0 ? 1e3 * ms[l - 1].forward : 0;
  const double after_us =
      l + 1 < model.layers.size() ? 1e3 * (ms[l + 1].backward + ms[l + 1].weight) : 0;
  return plan.parallel.micro_batches *
         (std::max(0.0, upload_us - before_us) + std::max(0.0, upload_us - after_us));
}

// Under parameter offload fitted as `step` (every layer's parameters streamed), the layers whose
// parameters may stay on the device instead (ParallelConfig::resident_params): the largest k
// groups, k the most that still fit with no more predicted activation overhead than streaming
// all, less the upload time the k layers' copies would not hide (ExposedUploadUs: without a
// measured link, none; copies the compute hides cost less than recomputing). Found by
// bisection on k (each more resident layer leaves less room). Replaces `step` with the plan
// chosen; returns k.
size_t KeepLargestParametersResident(const ModelSpec& model, const OpRegistry& registry,
                                     int64_t activation_cap, const TrainingPlan& streamed,
                                     StepGraph& step) {
  std::vector<size_t> order;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    if (model.layers[l].params.numel() > 0) order.push_back(l);
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return model.layers[a].params.numel() > model.layers[b].params.numel();
  });
  const double overhead = step.memory.activation_overhead;
  const auto fits_with = [&](size_t k) -> std::optional<StepGraph> {
    TrainingPlan plan = streamed;
    plan.parallel.resident_params.assign(model.layers.size(), false);
    double saved_us = 0;  // the uploads the resident layers no longer wait for
    for (size_t i = 0; i < k; ++i) {
      plan.parallel.resident_params[order[i]] = true;
      saved_us += ExposedUploadUs(model, streamed, step, order[i]);
    }
    Result<StepGraph> fitted = Fit(model, plan, registry, /*suggest=*/false, activation_cap);
    if (!fitted.ok() ||
        fitted->memory.activation_overhead > (overhead + saved_us) * (1 + 1e-9) + 1e-9) {
      return std::nullopt;
    }
    return std::move(*fitted);
  };
  size_t low = 0, high = order.size();  // low fits (streaming all), high + 1 is too many
  // The state of every group resident is the plan that did not fit: at most all but one.
  if (high > 0) --high;
  std::optional<StepGraph> best;
  while (low < high) {
    const size_t mid = low + (high - low + 1) / 2;
    std::optional<StepGraph> fitted = fits_with(mid);
    if (fitted.has_value()) {
      low = mid;
      best = std::move(fitted);
    } else {
      high = mid - 1;
    }
  }
  if (best.has_value()) step = std::move(*best);
  return low;
}

// Forward: changes to a plan that fit under its tier cap, cheapest first.
std::string WhatWouldFit(const ModelSpec& model, const TrainingPlan& plan,
                         const OpRegistry& registry);

// Whether the memory plan may split each rank's batch into twice the micro-batches when nothing
// else fits: the rows split. A pipeline holds as many micro-batches in flight either way (1F1B's
// P - s; a zero-bubble schedule's, its backwards run whole), each of half the rows.
bool SplitsMicroBatchesIfNeeded(const TrainingPlan& plan) {
  return plan.parallel.MicroBatchRows(plan.batch) % 2 == 0;
}

// A plan the memory plan changed on its own (`how`), fitted under the caller's caps (its
// activation cap already the caller's): its decision reports the caller's uncapped figures, and
// its reason says what changed and why first.
StepGraph Changed(StepGraph step, const std::string& how, int64_t uncapped_total,
                  int64_t uncapped_activations) {
  MemoryDecision& memory = step.memory;
  memory.reason = how + "; " + memory.reason;
  memory.uncapped_peak_bytes = uncapped_total;
  memory.uncapped_activation_peak_bytes = uncapped_activations;
  return step;
}

// Under split backwards, gives the layers kept whole (kKeep with whole_backward) their halves
// back, the last layer first, each while the plan still fits the caps (re-planned and predicted
// again each time): a split layer holds what it saved, and its stash, until its deferred weight
// half runs. `choices`, `planned` and `peaks` become the plan's; returns what it did, for the
// decision's reason.
Result<std::string> ResplitWhileItFits(const ModelSpec& model, const TrainingPlan& plan,
                                       const OpRegistry& registry, const Caps& caps,
                                       MemoryTier tier, bool serialize,
                                       std::vector<ActivationDecision>& choices,
                                       PlannedPasses& planned, Peaks& peaks) {
  int whole = 0, splittable = 0;
  for (size_t l = model.layers.size(); l-- > 0;) {
    if (!choices[l].whole_backward || !SplitsLayerBackward(model, l)) continue;
    ++splittable;
    if (choices[l].choice != ActivationChoice::kKeep) {
      ++whole;
      continue;
    }
    std::vector<ActivationDecision> tried = choices;
    tried[l].whole_backward = false;
    TESSERA_ASSIGN_OR_RETURN(PlannedPasses replanned,
                             RunTrainingPasses(model, plan, registry, tried, serialize));
    TESSERA_ASSIGN_OR_RETURN(MemoryProfile profile, PredictMemory(replanned.step.graph));
    const Peaks split = PeaksOf(profile, tier);
    if (!caps.Fit(split)) {
      ++whole;
      continue;
    }
    choices = std::move(tried);
    planned = std::move(replanned);
    peaks = split;
  }
  return fmt::format(
      "{} of {} layers' backwards run whole (what they save freed with their input gradients, "
      "not kept for a deferred weight half)",
      whole, splittable);
}

// The least the plan holds without a swap link: every layer recomputed, keeping the least part
// its op offers where the shapes allow it (else all of it recomputed).
struct LeastPlan {
  PlannedPasses passes;
  std::vector<ActivationDecision> decisions;
  bool kept_parts = false;
  Peaks peaks;
};

Result<LeastPlan> PlanTheLeast(const ModelSpec& model, const TrainingPlan& plan,
                               const OpRegistry& registry, MemoryTier tier, bool splits,
                               bool serialize) {
  std::vector<ActivationDecision> all(
      model.layers.size(),
      ActivationDecision{.choice = ActivationChoice::kRecompute, .whole_backward = splits});
  std::vector<ActivationDecision> least_parts = all;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    if (model.layers[l].loss) continue;
    Result<const OpDef*> def = registry.Find(model.layers[l].forward_op);
    if (def.ok() && !(*def)->rebuild_options.empty()) {
      least_parts[l].rebuild = (*def)->rebuild_options.back();  // least kept last
    }
  }
  LeastPlan least;
  Result<PlannedPasses> parts = RunTrainingPasses(model, plan, registry, least_parts, serialize);
  least.kept_parts = parts.ok();
  if (!least.kept_parts) parts = RunTrainingPasses(model, plan, registry, all, serialize);
  TESSERA_ASSIGN_OR_RETURN(least.passes, std::move(parts));
  TESSERA_ASSIGN_OR_RETURN(MemoryProfile profile, PredictMemory(least.passes.step.graph));
  least.peaks = PeaksOf(profile, tier);
  least.decisions = least.kept_parts ? std::move(least_parts) : std::move(all);
  return least;
}

// The memory plan; `suggest`: a refusal tries other plans that would fit (WhatWouldFit).
// `activation_cap`: the activations' cap in bytes when a plan changed on its own is fitted
// (the caller's budget, of its own uncapped activations); 0: from the plan's budget.
Result<StepGraph> Fit(const ModelSpec& model, const TrainingPlan& plan, const OpRegistry& registry,
                      bool suggest, int64_t activation_cap = 0) {
  const MemoryTier tier = TierOf(plan.device);
  Caps caps;
  caps.total = CapOf(plan, tier);
  const ParallelConfig& parallel = plan.parallel;
  if (parallel.pipeline_stages * parallel.virtual_stages > 1) {
    caps.late_pushes = std::min<int64_t>(
        parallel.micro_batches, int64_t{parallel.pipeline_stages} * parallel.virtual_stages);
  }
  const bool splits = parallel.split_backwards || SplitsBackward(parallel.schedule);
  if (plan.memory.recompute_all) {
    std::vector<ActivationDecision> all(
        model.layers.size(),
        ActivationDecision{.choice = ActivationChoice::kRecompute, .whole_backward = splits});
    TESSERA_ASSIGN_OR_RETURN(
        PlannedPasses recomputed,
        RunTrainingPasses(model, plan, registry, all, SerializesMicroBatches(plan)));
    TESSERA_ASSIGN_OR_RETURN(MemoryProfile profile, PredictMemory(recomputed.step.graph));
    const Peaks peaks = PeaksOf(profile, tier);
    if (caps.total > 0 && peaks.total > caps.total) {
      return Infeasible("recomputing every layer the step needs {} on the {} tier, over {}'s {}",
                        Mib(peaks.total), MemoryTierName(tier), CapFlag(tier), Mib(caps.total));
    }
    MemoryDecision& decision = recomputed.step.memory;
    decision.tier = tier;
    decision.cap_bytes = caps.total;
    decision.peak_bytes = peaks.total;
    decision.activation_peak_bytes = peaks.activations;
    decision.activations = std::move(all);
    decision.reason = fmt::format(
        "every layer recomputed (asked for): predicted peak {} "
        "(activations {})",
        Mib(peaks.total), Mib(peaks.activations));
    return std::move(recomputed.step);
  }
  TESSERA_ASSIGN_OR_RETURN(PlannedPasses planned, RunTrainingPasses(model, plan, registry, {}));
  if (caps.total == 0 && plan.memory.activation_budget == 0 && activation_cap == 0) {
    return std::move(planned.step);
  }
  TESSERA_ASSIGN_OR_RETURN(MemoryProfile profile, PredictMemory(planned.step.graph));
  const Peaks uncapped = PeaksOf(profile, tier);
  if (activation_cap > 0) {
    caps.activations = activation_cap;
  } else if (plan.memory.activation_budget > 0) {
    caps.activations =
        std::max<int64_t>(1, static_cast<int64_t>(plan.memory.activation_budget *
                                                  static_cast<double>(uncapped.activations)));
  }
  MemoryDecision decision;
  decision.tier = tier;
  decision.cap_bytes = caps.total;
  decision.activation_cap_bytes = caps.activations;
  decision.uncapped_peak_bytes = decision.peak_bytes = uncapped.total;
  decision.uncapped_activation_peak_bytes = decision.activation_peak_bytes = uncapped.activations;
  const std::string limits = fmt::format(
      "{}{}{}", caps.total > 0 ? fmt::format("the cap {}", Mib(caps.total)) : "",
      caps.total > 0 && caps.activations > 0 ? " and " : "",
      caps.activations == 0 ? ""
      : activation_cap > 0  ? fmt::format("the activations' cap {}", Mib(caps.activations))
                            : fmt::format("the activation budget {:.0f}% ({} of {})",
                                          100 * plan.memory.activation_budget, Mib(caps.activations),
                                          Mib(uncapped.activations)));
  if (caps.Fit(uncapped)) {
    decision.reason = fmt::format("every activation kept: the predicted peak {} fits {}",
                                  Mib(uncapped.total), limits);
    planned.step.memory = std::move(decision);
    return std::move(planned.step);
  }
  // Written before `profile` may be replaced (micro-batches one after another, below).
  const std::string over = fmt::format(
      "the step needs {} on the {} tier of a worker ({} live at the peak; activations peak at "
      "{}) but {}{}{}",
      Mib(uncapped.total), MemoryTierName(tier),
      LiveByRole(profile.workers[uncapped.worker].peaks[static_cast<size_t>(tier)]),
      Mib(uncapped.activations),
      caps.total > 0 ? fmt::format("{} caps it at {}", CapFlag(tier), Mib(caps.total)) : "",
      caps.total > 0 && caps.activations > 0 ? " and " : "",
      caps.activations > 0 ? fmt::format("the activation budget allows {} ({:.0f}%)",
                                         Mib(caps.activations), 100 * plan.memory.activation_budget)
                           : "");
  const ParallelConfig& p = plan.parallel;
  const bool serialize = SerializesMicroBatches(plan);
  // Each layer's starting choice: kept. Under split backwards (zero-bubble schedules) what a
  // layer saves, and its input half's stash, wait for its deferred weight half, which
  // recomputing does not move: under a cap that the split plan exceeds, every backward runs
  // whole first (the schedule's order otherwise the same), and the layers kept whole get their
  // halves back afterwards while the plan still fits (ResplitWhileItFits).
  std::vector<ActivationDecision> start(model.layers.size(),
                                        ActivationDecision{.whole_backward = splits});
  if (splits) {
    TESSERA_ASSIGN_OR_RETURN(planned, RunTrainingPasses(model, plan, registry, start, serialize));
    TESSERA_ASSIGN_OR_RETURN(profile, PredictMemory(planned.step.graph));
    Peaks whole = PeaksOf(profile, tier);
    if (caps.Fit(whole)) {
      TESSERA_ASSIGN_OR_RETURN(
          const std::string halves,
          ResplitWhileItFits(model, plan, registry, caps, tier, serialize, start, planned, whole));
      decision.peak_bytes = whole.total;
      decision.activation_peak_bytes = whole.activations;
      decision.activations = start;
      decision.reason = fmt::format(
          "every activation kept, {}: predicted peak {} (activations {}) "
          "under {}; as planned: {} (activations {})",
          halves, Mib(decision.peak_bytes), Mib(decision.activation_peak_bytes), limits,
          Mib(uncapped.total), Mib(uncapped.activations));
      planned.step.memory = std::move(decision);
      return std::move(planned.step);
    }
  }
  // Several micro-batches and no pipeline: one after another first (what accumulating gradients
  // is for; as planned, every micro-batch's forwards run as soon as they are ready). A
  // pipeline's schedule keeps its micro-batches in flight. (Split backwards were tried so above.)
  if (serialize && !splits) {
    TESSERA_ASSIGN_OR_RETURN(planned, RunTrainingPasses(model, plan, registry, {}, serialize));
    TESSERA_ASSIGN_OR_RETURN(profile, PredictMemory(planned.step.graph));
    const Peaks serialized = PeaksOf(profile, tier);
    if (caps.Fit(serialized)) {
      decision.peak_bytes = serialized.total;
      decision.activation_peak_bytes = serialized.activations;
      decision.reason = fmt::format(
          "micro-batches one after another, every activation kept: predicted peak {} "
          "(activations {}) under {}; as planned: {} (activations {})",
          Mib(serialized.total), Mib(serialized.activations), limits, Mib(uncapped.total),
          Mib(uncapped.activations));
      planned.step.memory = std::move(decision);
      return std::move(planned.step);
    }
  }
  // What is left when even the least plan is over the caps.
  const auto nothing_fits = [&](const LeastPlan& least) -> Result<StepGraph> {
    // What the plan may change on its own when nothing fits as asked. The device cannot hold the
    // model state beside the least activations: on GPU workers, the state goes to the host and
    // each layer's parameters come up for their use (Harmony's and ZeRO-Infinity's way), first:
    // copies the compute hides cost nothing, and a GPU's kernels lose speed on smaller
    // micro-batches. Every activation is in proportion to a micro-batch's rows: the batch split
    // into twice the micro-batches (run one after another, or as many in flight in a pipeline;
    // gradient accumulation: the same gradients but for the order of their sums) holds about
    // half.
    const bool stream = tier == MemoryTier::kDevice && caps.total > 0 &&
                        least.peaks.total > caps.total && StreamsParametersIfNeeded(plan) &&
                        !plan.memory.fixed_dimensions;
    const auto try_streaming = [&]() -> Result<StepGraph> {
      TrainingPlan streamed = plan;
      streamed.parallel.offload = OffloadMode::kParameters;
      TESSERA_ASSIGN_OR_RETURN(StepGraph step,
                               Fit(model, streamed, registry, /*suggest=*/false, caps.activations));
      const size_t kept =
          KeepLargestParametersResident(model, registry, caps.activations, streamed, step);
      size_t groups = 0;
      for (int64_t numel : step.group_numel) groups += numel > 0;
      return Changed(
          std::move(step),
          fmt::format("the parameters of {} of {} layers streamed from the host (--offload "
                      "parameters: copied up for each forward and backward, the gradient copied "
                      "down, the update on the host; the other {} stay on the device, the largest "
                      "that fit without recomputing more than their copies would leave "
                      "unhidden), as {} is too small for the model state "
                      "on the device otherwise (the least it needs so: {})",
                      groups - kept, groups, kept, CapFlag(tier), Mib(least.peaks.total)),
          uncapped.total, uncapped.activations);
    };
    const auto try_splitting = [&]() -> Result<StepGraph> {
      TrainingPlan split = plan;
      split.parallel.micro_batches *= 2;
      // Measured layer times are a micro-batch's: half the rows take about half the time.
      for (OpCosts& ms : split.parallel.layer_op_costs) {
        ms = OpCosts{ms.forward / 2, ms.backward / 2, ms.weight / 2};
      }
      TESSERA_ASSIGN_OR_RETURN(StepGraph step,
                               Fit(model, split, registry, /*suggest=*/false, caps.activations));
      return Changed(
          std::move(step),
          fmt::format("each rank's batch split into {} micro-batches of {} rows (was {} "
                      "of {}), as recomputing every layer{} still needs {} (activations "
                      "{})",
                      split.parallel.micro_batches, split.parallel.MicroBatchRows(plan.batch),
                      p.micro_batches, p.MicroBatchRows(plan.batch),
                      least.kept_parts ? " keeping the least part" : "", Mib(least.peaks.total),
                      Mib(least.peaks.activations)),
          uncapped.total, uncapped.activations);
    };
    if (stream) {
      if (Result<StepGraph> step = try_streaming(); step.ok()) return step;
    }
    if (SplitsMicroBatchesIfNeeded(plan) && !plan.memory.fixed_dimensions) {
      if (Result<StepGraph> step = try_splitting(); step.ok()) return step;
    }
    std::string advice;
    if (caps.activations > 0 && least.peaks.activations > caps.activations) {
      advice =
          fmt::format("; the activation budget needs to be at least {:.0f}%",
                      std::ceil(100.0 * static_cast<double>(least.peaks.activations) /
                                static_cast<double>(std::max<int64_t>(uncapped.activations, 1))));
    }
    if (caps.total > 0 && least.peaks.total > caps.total) {
      const std::string fits = suggest ? WhatWouldFit(model, plan, registry) : "";
      advice += fits.empty() ? fmt::format("; {} needs to be at least {}", CapFlag(tier),
                                           Mib(least.peaks.total))
                             : "; " + fits;
    }
    return Infeasible(
        "{}; recomputing every layer's activations{} it still needs {} (activations {}){}", over,
        least.kept_parts ? " (keeping the least part)" : "", Mib(least.peaks.total),
        Mib(least.peaks.activations), advice);
  };
  // Without a swap link nothing holds less than the least plan: one over the caps so is past
  // what the solver can choose (its rounds are not spent on it), and only what the plan may
  // change on its own (nothing_fits) is left.
  std::optional<LeastPlan> least;
  if (plan.SwapLinkBytesPerUs() <= 0) {
    TESSERA_ASSIGN_OR_RETURN(least, PlanTheLeast(model, plan, registry, tier, splits, serialize));
    if (!caps.Fit(least->peaks)) return nothing_fits(*least);
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<OpCosts> times, LayerTimes(model, plan, registry));
  const std::vector<std::vector<TaskId>> readers = ReadersOf(planned.step.graph);
  int64_t lowered = 0;
  for (int round = 0; round < kVerifyRounds; ++round) {
    std::vector<ActivationDecision> choices = start;
    bool solved_all = true;
    double overhead = 0;  // the solver's predicted time of the choices, over keeping everything
    // The least room any chain's solution left under its cap, as the solver saw it.
    int64_t slack = std::numeric_limits<int64_t>::max();
    // Per rank, a chain per worker it runs layers on (a pipeline's stages; else one).
    for (size_t rank = 0; rank < planned.forward_task.size() && solved_all; ++rank) {
      for (const WorkerMemory& memory : profile.workers) {
        TESSERA_ASSIGN_OR_RETURN(
            Chain chain, DescribeChain(model, plan, registry, planned, readers, memory, rank, tier,
                                       caps, lowered, times));
        if (chain.layers.empty()) continue;
        Result<ActivationPlan> solved = SolveActivations(chain.problem);
        if (!solved.ok()) {
          solved_all = false;
          break;
        }
        slack = std::min(slack, chain.problem.cap_bytes - solved->peak_bytes);
        for (size_t i = 0; i < chain.layers.size(); ++i) {
          if (solved->decisions[i].choice != ActivationChoice::kKeep) {
            choices[chain.layers[i]] = solved->decisions[i];
            choices[chain.layers[i]].whole_backward = splits;
          }
        }
        overhead += solved->step_us -
                    EvaluateActivationPlan(chain.problem,
                                           std::vector<ActivationDecision>(chain.layers.size()))
                        .step_us;
      }
    }
    if (!solved_all) break;
    TESSERA_ASSIGN_OR_RETURN(PlannedPasses replanned,
                             RunTrainingPasses(model, plan, registry, choices, serialize));
    TESSERA_ASSIGN_OR_RETURN(MemoryProfile checked, PredictMemory(replanned.step.graph));
    Peaks peaks = PeaksOf(checked, tier);
    if (caps.Fit(peaks)) {
      std::string halves;
      if (splits) {
        TESSERA_ASSIGN_OR_RETURN(halves, ResplitWhileItFits(model, plan, registry, caps, tier,
                                                            serialize, choices, replanned, peaks));
        halves.insert(0, "; ");
      }
      decision.peak_bytes = peaks.total;
      decision.activation_peak_bytes = peaks.activations;
      std::vector<std::string> names;
      names.reserve(model.layers.size());
      for (const LayerSpec& layer : model.layers) names.push_back(layer.name);
      ActivationPlan described;
      described.decisions = choices;
      decision.reason = fmt::format(
          "{}predicted peak {} (activations {}) under {}; every activation kept: {} (activations "
          "{}); {}{}",
          serialize ? "micro-batches one after another, " : "", Mib(peaks.total),
          Mib(peaks.activations), limits, Mib(uncapped.total), Mib(uncapped.activations),
          DescribeActivationPlan(described, names), halves);
      decision.activations = std::move(choices);
      decision.activation_overhead = overhead;
      replanned.step.memory = std::move(decision);
      return std::move(replanned.step);
    }
    // The model saw more than the solver: leave that much free, below what the solver's choices
    // took (room they left unused would leave the same choices).
    lowered += caps.Excess(peaks) +
               (slack == std::numeric_limits<int64_t>::max() ? 0 : std::max<int64_t>(slack, 0));
  }
  // Nothing fits: how far recomputing every layer gets.
  if (!least) {
    TESSERA_ASSIGN_OR_RETURN(least, PlanTheLeast(model, plan, registry, tier, splits, serialize));
  }
  if (caps.Fit(least->peaks)) {
    // The solver's view missed by a little (its rounds spent) where holding the least fits.
    decision.peak_bytes = least->peaks.total;
    decision.activation_peak_bytes = least->peaks.activations;
    decision.activations = least->decisions;
    decision.activation_overhead = std::numeric_limits<double>::infinity();
    decision.reason = fmt::format(
        "{}every layer recomputed{}{}: predicted peak {} (activations {}) under {}; every "
        "activation kept: {} (activations {})",
        serialize ? "micro-batches one after another, " : "",
        least->kept_parts ? ", keeping the least part" : "",
        splits ? ", its backward whole (not split in halves)" : "", Mib(least->peaks.total),
        Mib(least->peaks.activations), limits, Mib(uncapped.total), Mib(uncapped.activations));
    least->passes.step.memory = std::move(decision);
    return std::move(least->passes.step);
  }
  return nothing_fits(*least);
}

std::string WhatWouldFit(const ModelSpec& model, const TrainingPlan& plan,
                         const OpRegistry& registry) {
  struct Change {
    std::string what;
    TrainingPlan plan;
  };
  std::vector<Change> changes;
  const ParallelConfig& p = plan.parallel;
  // In order of what they cost: nothing more to buy, then communication, then machines.
  if (p.MicroBatchRows(plan.batch) % 2 == 0 && p.pipeline_stages == 1) {
    Change change{fmt::format("--micro-batches {}", 2 * p.micro_batches), plan};
    change.plan.parallel.micro_batches *= 2;
    changes.push_back(std::move(change));
  }
  if (!plan.device.is_cpu() && p.offload == OffloadMode::kNone) {
    Change change{"--offload optimizer", plan};
    change.plan.parallel.offload = OffloadMode::kOptimizer;
    changes.push_back(std::move(change));
  }
  if (p.data_parallel > 1 && p.zero_stage < 3) {
    Change change{"--zero-stage 3", plan};
    change.plan.parallel.zero_stage = 3;
    changes.push_back(std::move(change));
  }
  if (p.pipeline_stages == 1 &&
      plan.batch % (int64_t{2} * p.data_parallel * p.micro_batches) == 0) {
    const int workers = 2 * p.data_parallel;
    Change change{fmt::format("--workers {} --zero-stage 3", workers), plan};
    change.plan.parallel.data_parallel = workers;
    change.plan.parallel.zero_stage = 3;
    change.plan.parallel.workers.clear();
    for (int w = 0; w < workers; ++w) {
      change.plan.parallel.workers.push_back(WorkerId(static_cast<uint64_t>(w) + 1));
    }
    changes.push_back(std::move(change));
  }
  const MemoryTier tier = TierOf(plan.device);
  std::string fits;
  for (Change& change : changes) {
    change.plan.memory.activation_budget = 0;  // a share of another plan's peak: not comparable
    Result<StepGraph> step = Fit(model, change.plan, registry, /*suggest=*/false);
    if (!step.ok()) continue;
    int64_t peak = step->memory.peak_bytes;
    if (peak == 0) {  // fits without a decision: predict it for the figure
      Result<MemoryProfile> profile = PredictMemory(step->graph);
      if (profile.ok()) peak = PeaksOf(*profile, tier).total;
    }
    fits +=
        fmt::format("{}{} (predicted peak {})", fits.empty() ? "" : ", ", change.what, Mib(peak));
  }
  return fits.empty() ? "" : "plans that would fit, cheapest first: " + fits;
}

}  // namespace

Result<StepGraph> PlanWithinMemory(const ModelSpec& model, const TrainingPlan& plan,
                                   const OpRegistry& registry) {
  return Fit(model, plan, registry, /*suggest=*/!plan.memory.fixed_dimensions);
}

}  // namespace tessera

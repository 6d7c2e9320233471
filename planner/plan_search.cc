#include "planner/plan_search.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <thread>
#include <tuple>
#include <variant>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "planner/pipeline_cut.h"
#include "planner/step_graph.h"
#include "planner/step_time.h"

namespace tessera {
namespace {

std::string MibText(int64_t bytes) {
  return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20));
}

bool AnyLayerSplits(const ModelSpec& model) {
  return std::any_of(model.layers.begin(), model.layers.end(),
                     [](const LayerSpec& layer) { return !layer.backward_input_op.empty(); });
}

int64_t CapOf(const TrainingPlan& plan) {
  return plan.device.is_cpu() ? plan.memory.host_bytes : plan.memory.device_bytes;
}

std::array<int64_t, kMemoryTiers> LargestPeaks(const MemoryProfile& profile) {
  std::array<int64_t, kMemoryTiers> peaks{};
  for (const WorkerMemory& worker : profile.workers) {
    for (size_t tier = 0; tier < kMemoryTiers; ++tier) {
      peaks[tier] = std::max(peaks[tier], worker.peaks[tier].bytes);
    }
  }
  return peaks;
}

// The cuts of `chunks` chunks a search tries (empty: the balanced cut): the given one; else the
// balanced one and, with a calibration, the near-balanced ones by the layers' times at `rows`.
// None when the given cut has another number of chunks.
std::vector<std::vector<int>> Cuts(const ModelSpec& model, const SearchSpace& space,
                                   const Calibration* calibration, int chunks, int64_t rows) {
  if (!space.chunk_layers.empty()) {
    if (static_cast<int>(space.chunk_layers.size()) != chunks) return {};
    return {space.chunk_layers};
  }
  if (chunks <= 1 || calibration == nullptr || space.cuts <= 1) return {{}};
  const Result<std::vector<OpCosts>> times = LayerTimesOf(*calibration, model, rows);
  if (!times.ok()) return {{}};
  std::vector<double> costs;
  costs.reserve(times->size());
  for (const OpCosts& op : *times) costs.push_back(op.forward + op.backward + op.weight);
  std::vector<std::vector<int>> cuts = NearBalancedCuts(costs, chunks, space.cut_slack, space.cuts);
  cuts.front().clear();  // the balanced cut: the planner's own, from the same times
  return cuts;
}

// Its ranks on `workers` in order where there are enough of them (the calibrated workers, whose
// ids the groups of shared cores name), else on placeholder ids 1, 2, ...
TrainingPlan CandidatePlan(const TrainingPlan& base, const PlanChoice& choice,
                           const std::vector<WorkerId>& workers) {
  TrainingPlan plan = base;
  ParallelConfig& p = plan.parallel;
  p.data_parallel = choice.data_parallel * choice.slabs;
  p.tensor_parallel = choice.tensor_parallel;
  p.shard_sequence = choice.shard_sequence;
  if (choice.slabs > 1) {
    p.sequence_parallel = choice.slabs;
    p.sequence_attention = SequenceAttention::kHalo;
  }
  p.pipeline_stages = choice.pipeline_stages;
  p.virtual_stages = choice.virtual_stages;
  p.micro_batches = choice.micro_batches;
  p.zero_stage = choice.zero_stage;
  p.schedule = choice.schedule;
  p.offload = choice.offload;
  p.chunk_layers = choice.chunk_layers;
  p.settle_reductions = choice.settle_reductions;
  // Quantized collectives asked for are ZeRO-3's: its candidates quantize, the others cannot.
  if (p.zero_stage != 3 || p.data_parallel < 2) p.quantize_bits = 0;
  p.resident_params.clear();
  p.layer_costs.clear();
  p.split_backwards = false;
  p.workers.clear();
  plan.memory.fixed_dimensions = true;
  const bool named = static_cast<int>(workers.size()) >= choice.workers();
  for (int w = 0; w < choice.workers(); ++w) {
    p.workers.push_back(named ? workers[static_cast<size_t>(w)]
                              : WorkerId(static_cast<uint64_t>(w + 1)));
  }
  return plan;
}

using Outcome = std::variant<RankedPlan, RefusedPlan>;

// How far a refused plan stays over its tier's cap with every activation recomputed (its peak
// so planned without a cap; 0 when it cannot be planned).
int64_t Shortfall(const ModelSpec& model, const TrainingPlan& plan, const OpRegistry& registry) {
  TrainingPlan least = plan;
  least.memory.device_bytes = 0;
  least.memory.host_bytes = 0;
  least.memory.activation_budget = 0;
  least.memory.recompute_all = true;
  Result<StepGraph> step = PlanTrainingStep(model, least, registry);
  // The memory plan predicted it (the largest worker's peak on the plan's compute tier).
  return step.ok() ? std::max<int64_t>(0, step->memory.peak_bytes - CapOf(plan)) : 0;
}

Result<Outcome> Evaluate(const ModelSpec& model, const TrainingPlan& base,
                         const Calibration& calibration, const PlanChoice& choice,
                         const OpRegistry& registry) {
  // Workers bound to cores: the simulation shares each group's cores among the ranks on its
  // workers, so the ranks go where the calibration's probes ran, as the plan will run.
  static const std::vector<WorkerId> kPlaceholders;
  TrainingPlan plan = CandidatePlan(
      base, choice, calibration.sharing.groups.empty() ? kPlaceholders : calibration.probe_workers);
  ParallelConfig& p = plan.parallel;
  const int64_t rows = p.MicroBatchRows(plan.batch);
  TESSERA_ASSIGN_OR_RETURN(p.layer_op_costs, LayerTimesOf(calibration, model, rows));
  p.task_overhead_ms = calibration.task_overhead_ms;
  if (calibration.links.collective.measured()) p.link = calibration.links.collective;
  // The memory prune: the memory plan refuses a plan over the cap before its solver searches one
  // (without a swap link, when every activation recomputed is over it too); the shortfall is
  // planned only for the refused.
  Result<StepGraph> step = PlanTrainingStep(model, plan, registry);
  if (!step.ok()) {
    RefusedPlan refused{choice, step.status().message(), 0, TierOf(plan.device)};
    if (step.status().code() == StatusCode::kInfeasible && CapOf(plan) > 0) {
      refused.shortfall_bytes = Shortfall(model, plan, registry);
    }
    return Outcome(std::move(refused));
  }
  TESSERA_ASSIGN_OR_RETURN(SimulatedStep simulated,
                           SimulatePlannedStep(*step, model, plan.memory, calibration, registry));
  // The peaks in the order the simulated step ends its tasks: collectives and copies on the
  // lanes beside the compute keep their inputs while they take their time (the executor's
  // untimed order, which the memory plan fits by, finishes them at once), and what another worker
  // sends arrives at its time (a stage whose neighbour runs ahead holds what piles up): the
  // expected peaks. The plan is checked against the cap by the larger of the two orders'.
  TESSERA_ASSIGN_OR_RETURN(MemoryProfile memory, PredictMemory(step->graph));
  std::array<int64_t, kMemoryTiers> peaks = LargestPeaks(memory);
  std::array<int64_t, kMemoryTiers> expected = peaks;
  const auto tier = static_cast<size_t>(TierOf(plan.device));
  const int64_t untimed_peak = peaks[tier];
  int64_t timed_peak = 0;
  if (Result<MemoryProfile> timed = PredictTimedMemory(step->graph, simulated); timed.ok()) {
    expected = LargestPeaks(*timed);
    timed_peak = expected[tier];
    for (size_t t = 0; t < kMemoryTiers; ++t) peaks[t] = std::max(peaks[t], expected[t]);
  }
  const int64_t cap = CapOf(plan);
  if (cap > 0 && peaks[tier] > cap) {
    return Outcome(RefusedPlan{
        choice,
        fmt::format("fits the cap in the executor's order, but with its collectives and copies "
                    "taking their time it peaks at {} on the {} tier, over the cap of {}",
                    MibText(peaks[tier]), MemoryTierName(TierOf(plan.device)), MibText(cap)),
        peaks[tier] - cap, TierOf(plan.device)});
  }
  RankedPlan ranked;
  ranked.choice = choice;
  ranked.parallel = step->parallel;
  ranked.parallel.workers.clear();
  ranked.step_ms = simulated.step_ms;
  ranked.critical = simulated.workers[simulated.critical];
  ranked.bottleneck = simulated.bottleneck;
  ranked.peak_bytes = peaks;
  ranked.expected_peak_bytes = expected;
  ranked.untimed_peak_bytes = untimed_peak;
  ranked.timed_peak_bytes = timed_peak;
  const std::vector<ActivationDecision>& decisions = step->memory.activations;
  ranked.recomputed_layers = CountChoice(decisions, ActivationChoice::kRecompute);
  ranked.swapped_layers = CountChoice(decisions, ActivationChoice::kSwap);
  ranked.partly_kept_layers = CountChoice(decisions, ActivationChoice::kKeepPart);
  ranked.memory_reason = step->memory.reason;
  return Outcome(std::move(ranked));
}

std::string NoPlanFits(const ModelSpec& model, const TrainingPlan& base, const SearchSpace& space,
                       const std::vector<RefusedPlan>& refused) {
  const RefusedPlan* closest = nullptr;
  for (const RefusedPlan& r : refused) {
    if (r.shortfall_bytes <= 0) continue;
    if (closest == nullptr || r.shortfall_bytes < closest->shortfall_bytes) closest = &r;
  }
  const std::string workers =
      fmt::format("{} worker{}{}", space.workers, space.workers == 1 ? "" : "s",
                  space.fewer_workers ? " or fewer" : "");
  if (closest == nullptr) {
    return fmt::format(
        "no plan of the model ({} layers, batch {}) runs on {}: {} plans "
        "considered, each refused{}",
        model.layers.size(), base.batch, workers, refused.size(),
        refused.empty() ? "" : "; the first: " + refused.front().reason);
  }
  const bool cpu = base.device.is_cpu();
  const int64_t cap = CapOf(base);
  const int64_t need = cap + closest->shortfall_bytes;
  // The cap that would fit it, rounded up at four significant figures of GiB.
  const double gib = static_cast<double>(need) / (1 << 30);
  const double unit = std::pow(10.0, std::floor(std::log10(gib)) - 3);
  std::string fixes = fmt::format("{} {:.4g} or more ({} a worker)",
                                  cpu ? "--host-memory-gib" : "--device-memory-gib",
                                  std::ceil(gib / unit) * unit, MibText(need));
  fixes += ", more workers (ZeRO-3 and pipelines split the model state over them)";
  if (cpu && base.memory.disk_link_bytes_per_us <= 0) {
    fixes += ", a swap file (--swap-dir) for the activations";
  }
  if (!cpu && base.memory.host_link_bytes_per_us <= 0) {
    fixes += ", the host link (--host-link-gbps) so activations can be swapped to the host";
  }
  fixes += fmt::format(", or a smaller --batch than {}", base.batch);
  return fmt::format(
      "no plan fits {} under the {} tier's cap of {} a worker: of {} plans, the closest, {} "
      "({}), stays {} over it at the least (every activation recomputed, or its collectives "
      "timed); to fix it: {}",
      workers, MemoryTierName(closest->tier), MibText(cap), refused.size(), closest->choice.Name(),
      closest->choice.Flags(), MibText(closest->shortfall_bytes), fixes);
}

}  // namespace

Result<SimulatedStep> SimulatePlannedStep(const StepGraph& step, const ModelSpec& model,
                                          const MemoryCaps& disk, const Calibration& calibration,
                                          const OpRegistry& registry) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<OpCosts> layer_ms,
                           LayerTimesOf(calibration, model, step.micro_batch_rows));
  TESSERA_ASSIGN_OR_RETURN(
      std::vector<TaskTime> times,
      EstimateTaskTimes(step.graph, model, layer_ms, registry, disk.disk_copy_compute_us_per_byte,
                        calibration.other_ms_per_unit));
  for (TaskTime& time : times) time.ms *= calibration.compute_scale;
  StepLinks links = calibration.links;
  if (links.disk_bytes_per_us <= 0) links.disk_bytes_per_us = disk.disk_link_bytes_per_us;
  TESSERA_ASSIGN_OR_RETURN(
      SimulatedStep simulated,
      SimulateStep(step.graph, times, links, calibration.task_overhead_ms, calibration.sharing));
  simulated.step_ms += StepOverheadMs(calibration, step.graph);
  return simulated;
}

WorkerLoad WorkerLoadOf(const Graph& graph) {
  std::map<WorkerId, int64_t> tasks;
  WorkerLoad load;
  for (const TaskSpec& task : graph.tasks()) {
    load.most_tasks = std::max(load.most_tasks, ++tasks[task.pinned_worker]);
  }
  load.workers = static_cast<int64_t>(tasks.size());
  return load;
}

double StepOverheadMs(const Calibration& calibration, const Graph& graph) {
  if (calibration.step_overhead_per_worker_ms <= 0 && calibration.step_overhead_per_task_ms <= 0) {
    return calibration.step_overhead_ms;
  }
  const WorkerLoad load = WorkerLoadOf(graph);
  return calibration.step_overhead_ms +
         calibration.step_overhead_per_worker_ms *
             static_cast<double>(std::max<int64_t>(0, load.workers - 1)) +
         calibration.step_overhead_per_task_ms * static_cast<double>(load.most_tasks);
}

namespace {

// Per layer, its times at `rows` rows (> 0; a fraction is a share of each sequence's rows) from
// those measured at other counts (LayerTimesAt's way).
std::vector<OpCosts> Interpolate(const std::vector<LayerTimesAtRows>& measured, double rows) {
  const LayerTimesAtRows* below = nullptr;
  const LayerTimesAtRows* above = nullptr;
  for (const LayerTimesAtRows& at : measured) {
    const auto r = static_cast<double>(at.rows);
    if (r == rows) return at.layer_ms;
    if (r < rows && (below == nullptr || at.rows > below->rows)) below = &at;
    if (r > rows && (above == nullptr || at.rows < above->rows)) above = &at;
  }
  const auto blend = [](const OpCosts& a, const OpCosts& b, double t) {
    return OpCosts{a.forward + t * (b.forward - a.forward),
                   a.backward + t * (b.backward - a.backward),
                   a.weight + t * (b.weight - a.weight)};
  };
  std::vector<OpCosts> ms;
  if (below != nullptr && above != nullptr) {
    const double t =
        (rows - static_cast<double>(below->rows)) / static_cast<double>(above->rows - below->rows);
    for (size_t l = 0; l < below->layer_ms.size() && l < above->layer_ms.size(); ++l) {
      ms.push_back(blend(below->layer_ms[l], above->layer_ms[l], t));
    }
    return ms;
  }
  const LayerTimesAtRows& nearest = below != nullptr ? *below : *above;
  const double scale = rows / static_cast<double>(nearest.rows);
  for (const OpCosts& c : nearest.layer_ms) {
    ms.push_back(OpCosts{c.forward * scale, c.backward * scale, c.weight * scale});
  }
  return ms;
}

}  // namespace

const TensorSplitTimes* Calibration::SplitTimes(int tensor_parallel, int slabs) const {
  for (const TensorSplitTimes& split : tensor_splits) {
    if (split.tensor_parallel == tensor_parallel && split.slabs == slabs && !split.layers.empty()) {
      return &split;
    }
  }
  return nullptr;
}

Result<std::vector<OpCosts>> LayerTimesAt(const Calibration& calibration, int64_t rows) {
  if (calibration.layers.empty()) {
    return InvalidArgument("no layer times were measured (calibrate the cluster first)");
  }
  if (rows < 1) return InvalidArgument("layer times at {} rows: rows must be at least 1", rows);
  return Interpolate(calibration.layers, static_cast<double>(rows));
}

Result<std::vector<OpCosts>> LayerTimesOf(const Calibration& calibration, const ModelSpec& model,
                                          int64_t rows) {
  const int t = model.tensor_parallel;
  const int slabs = model.slabs();
  std::vector<OpCosts> ms;
  // Sharding sequences: the sequence-sharded layers' times at rows / T of the tensor split's (a
  // rank's 1/T of each sequence is as many elements; per-row work, so per-op costs are kept).
  std::vector<OpCosts> on_shard;
  if (t <= 1 && slabs == 1) {
    TESSERA_ASSIGN_OR_RETURN(ms, LayerTimesAt(calibration, rows));
  } else {
    if (rows < 1) return InvalidArgument("layer times at {} rows: rows must be at least 1", rows);
    const TensorSplitTimes* split = calibration.SplitTimes(t, slabs);
    if (split == nullptr) {
      return InvalidArgument(
          "no layer times of a rank of {} were measured (calibrate with it in the search)",
          slabs > 1 ? fmt::format("{} slabs", slabs) : fmt::format("{} tensor-parallel ranks", t));
    }
    ms = Interpolate(split->layers, static_cast<double>(rows));
    if (model.shards_sequence) on_shard = Interpolate(split->layers, static_cast<double>(rows) / t);
  }
  if (ms.size() != model.layers.size()) {
    return InvalidArgument(
        "the calibration holds {} layer times for {} tensor rank(s) but model '{}' has {} "
        "layers there: calibrate again for this model",
        ms.size(), t, model.name, model.layers.size());
  }
  for (size_t l = 0; l < ms.size() && l < on_shard.size(); ++l) {
    const std::optional<TensorParallelLayer>& split = model.layers[l].tensor_parallel;
    if (split && split->sequence_sharded) ms[l] = on_shard[l];
  }
  return ms;
}

std::string PlanChoice::Name() const {
  std::string name =
      tensor_parallel > 1 ? fmt::format("D{} x T{}{} x P{}", data_parallel, tensor_parallel,
                                        shard_sequence ? " SP" : "", pipeline_stages)
      : slabs > 1         ? fmt::format("D{} x S{} x P{}", data_parallel, slabs, pipeline_stages)
                          : fmt::format("D{} x P{}", data_parallel, pipeline_stages);
  if (pipeline_stages > 1) name += fmt::format(" {}", ScheduleName(schedule));
  if (virtual_stages > 1) name += fmt::format(" V{}", virtual_stages);
  name += fmt::format(" M{}", micro_batches);
  if (!chunk_layers.empty()) name += fmt::format(" cut {}", fmt::join(chunk_layers, "+"));
  if (data_parallel * slabs > 1) name += fmt::format(" ZeRO-{}", zero_stage);
  if (offload != OffloadMode::kNone) name += fmt::format(" offload {}", OffloadModeName(offload));
  return name;
}

std::string PlanChoice::Flags() const {
  // One worker: this process (a driver's default), so no --workers.
  std::string flags = workers() > 1 ? fmt::format("--workers {}", workers()) : std::string();
  if (pipeline_stages > 1) {
    flags +=
        fmt::format(" --pipeline-stages {} --schedule {}", pipeline_stages, ScheduleName(schedule));
  }
  if (virtual_stages > 1) flags += fmt::format(" --virtual-stages {}", virtual_stages);
  if (tensor_parallel > 1) flags += fmt::format(" --tensor-parallel {}", tensor_parallel);
  if (shard_sequence) flags += " --sequence-parallel megatron";
  if (slabs > 1) flags += fmt::format(" --spatial-parallel {}", slabs);
  if (!chunk_layers.empty())
    flags += fmt::format(" --stage-layers {}", fmt::join(chunk_layers, ","));
  flags += fmt::format("{}--micro-batches {}", flags.empty() ? "" : " ", micro_batches);
  if (data_parallel * slabs > 1) flags += fmt::format(" --zero-stage {}", zero_stage);
  if (offload != OffloadMode::kNone)
    flags += fmt::format(" --offload {}", OffloadModeName(offload));
  if (settle_reductions) flags += " --settle-reductions";
  return flags;
}

namespace {

// The candidates of one planned model (its degree and sharding), appended in the search's order.
void AppendCandidates(const PlannedModel& planned, const TrainingPlan& base,
                      const SearchSpace& space, const Calibration* calibration,
                      std::vector<PlanChoice>& candidates) {
  const ModelSpec& model = planned.model;
  const int t = planned.tensor_parallel, s = planned.slabs;
  const int layers = static_cast<int>(model.layers.size());
  const bool splits = AnyLayerSplits(model);
  // Workers that share a machine: each micro-batch's reductions settled before the next compute
  // (ParallelConfig::settle_reductions), where a plan reduces per micro-batch.
  const bool settle = calibration != nullptr && calibration->sharing.capacity > 0;
  int max_stages = std::min(space.workers / (t * s), layers);
  if (space.max_pipeline_stages > 0) max_stages = std::min(max_stages, space.max_pipeline_stages);
  const std::vector<OffloadMode> offloads =
      base.device.is_cpu() ? std::vector<OffloadMode>{OffloadMode::kNone}
                           : std::vector<OffloadMode>{OffloadMode::kNone, OffloadMode::kOptimizer,
                                                      OffloadMode::kParameters};
  const auto has = [&space](PipelineSchedule schedule) {
    return std::find(space.schedules.begin(), space.schedules.end(), schedule) !=
           space.schedules.end();
  };
  for (int stages = 1; stages <= max_stages; ++stages) {
    if (space.pipeline_stages > 0 && stages != space.pipeline_stages) continue;
    for (int ranks = 1; ranks * s * t * stages <= space.workers; ++ranks) {
      if (!space.fewer_workers && ranks * s * t * stages != space.workers) continue;
      if (base.batch % ranks != 0) continue;
      const int64_t rank_rows = base.batch / ranks;
      const int max_micro = space.micro_batches > 0 ? space.micro_batches : space.max_micro_batches;
      for (int micro = 1; micro <= max_micro && micro <= rank_rows; ++micro) {
        if (rank_rows % micro != 0) continue;
        if (space.micro_batches > 0 && micro != space.micro_batches) continue;
        // (schedule, virtual stages) pairs this shape allows.
        std::vector<std::pair<PipelineSchedule, int>> orders;
        if (stages == 1) {
          orders.emplace_back(PipelineSchedule::k1F1B, 1);
        } else {
          if (has(PipelineSchedule::kGPipe)) orders.emplace_back(PipelineSchedule::kGPipe, 1);
          if (has(PipelineSchedule::k1F1B) && micro >= stages) {
            orders.emplace_back(PipelineSchedule::k1F1B, 1);
          }
          if (has(PipelineSchedule::kInterleaved) && micro % stages == 0 && 2 * stages <= layers) {
            orders.emplace_back(PipelineSchedule::kInterleaved, 2);
          }
          if (has(PipelineSchedule::kZbH1) && splits && micro >= stages) {
            orders.emplace_back(PipelineSchedule::kZbH1, 1);
          }
        }
        const std::vector<int> zeros = ranks * s == 1 ? std::vector<int>{0} : space.zero_stages;
        for (const auto& [schedule, virtual_stages] : orders) {
          if (space.virtual_stages > 0 && virtual_stages != space.virtual_stages) continue;
          const std::vector<std::vector<int>> cuts =
              Cuts(model, space, calibration, stages * virtual_stages, rank_rows / micro);
          for (const std::vector<int>& cut : cuts) {
            for (int zero : zeros) {
              for (OffloadMode offload : offloads) {
                candidates.push_back(PlanChoice{
                    ranks, stages, virtual_stages, micro, zero, schedule, offload, cut, t,
                    planned.shard_sequence, settle && ranks * s > 1 && zero >= 2 && micro > 1, s});
              }
            }
          }
        }
      }
    }
  }
}

// With a calibration, only the degrees it has layer times for (a degree the space gives is
// never left out: its plans then say what is missing).
std::vector<PlanChoice> CandidatesOf(const std::vector<PlannedModel>& models,
                                     const TrainingPlan& base, const SearchSpace& space,
                                     const Calibration* calibration) {
  std::vector<PlanChoice> candidates;
  for (const PlannedModel& planned : models) {
    const bool given = planned.slabs > 1 ? !space.slabs.empty() : !space.tensor_parallel.empty();
    if (calibration != nullptr && !given && (planned.tensor_parallel > 1 || planned.slabs > 1) &&
        calibration->SplitTimes(planned.tensor_parallel, planned.slabs) == nullptr) {
      continue;
    }
    AppendCandidates(planned, base, space, calibration, candidates);
  }
  return candidates;
}

}  // namespace

Result<std::vector<PlannedModel>> PlannedModels(const ModelSpec& model, const TrainingPlan& base,
                                                const SearchSpace& space,
                                                std::vector<std::string>* left_out) {
  const auto leave_out = [left_out](const std::string& split, std::string_view why) {
    if (left_out != nullptr) left_out->push_back(fmt::format("{}: {}", split, why));
  };
  const bool given = !space.tensor_parallel.empty();
  std::vector<int> degrees = space.tensor_parallel;
  if (!given) {
    for (int t = 1; t <= space.workers; ++t) {
      if (space.fewer_workers || space.workers % t == 0) degrees.push_back(t);
    }
  }
  std::vector<PlannedModel> models;
  for (int t : degrees) {
    if (t < 1 || t > std::max(space.workers, 1) ||
        (!space.fewer_workers && space.workers % t != 0)) {
      return InvalidArgument(
          "tensor-parallel degree {} for a plan of {} worker(s): give a degree from 1 to the "
          "workers that divides them (D x T x P workers)",
          t, space.workers);
    }
    if (t == 1) {
      models.push_back(PlannedModel{1, false, model});
      continue;
    }
    if (!base.device.is_cpu()) {
      // The split layers' ops have CPU kernels only (architecture.md, "Tensor parallelism").
      if (given) {
        return InvalidArgument(
            "tensor-parallel degree {}: tensor parallelism runs on CPU workers only so far; plan "
            "GPU workers with --tensor-parallel 1",
            t);
      }
      leave_out(fmt::format("T{}", t), "tensor parallelism runs on CPU workers only so far");
      continue;
    }
    for (bool shard : {false, true}) {
      if (std::find(space.shard_sequence.begin(), space.shard_sequence.end(), shard) ==
          space.shard_sequence.end()) {
        continue;
      }
      if (shard && !given && (!model.split_sharding_sequence || base.seq_len % t != 0)) continue;
      Result<ModelSpec> split = model.PlannedFor(t, 1, shard);
      if (!split.ok()) {
        // A given degree must split; its sharded variant too only when nothing else is asked.
        const bool only_sharded =
            std::find(space.shard_sequence.begin(), space.shard_sequence.end(), false) ==
            space.shard_sequence.end();
        if (given && (!shard || only_sharded)) {
          return split.status().WithContext(fmt::format("planning T = {}", t));
        }
        leave_out(fmt::format("T{}{}", t, shard ? " SP" : ""), split.status().message());
        continue;
      }
      models.push_back(PlannedModel{t, shard, *std::move(split)});
    }
  }
  // Slabs (spatial parallelism): the model's volumes split along their depth, on CPU workers;
  // not with tensor parallelism, so not searched when the degrees given leave out 1.
  const bool slabs_given = !space.slabs.empty();
  const bool whole_model_searched = std::find(degrees.begin(), degrees.end(), 1) != degrees.end();
  std::vector<int> slab_counts = space.slabs;
  if (!slabs_given && whole_model_searched && model.split_into_slabs) {
    if (!base.device.is_cpu()) {
      if (space.workers > 1) {
        leave_out("slabs", "spatial parallelism runs on CPU workers only so far");
      }
    } else {
      for (int s = 2; s <= space.workers; ++s) {
        if (space.fewer_workers || space.workers % s == 0) slab_counts.push_back(s);
      }
    }
  }
  for (int s : slab_counts) {
    if (s == 1) continue;  // the whole model, above
    if (s < 1 || s > std::max(space.workers, 1) ||
        (!space.fewer_workers && space.workers % s != 0)) {
      return InvalidArgument(
          "{} slabs for a plan of {} worker(s): give a count from 1 to the workers that divides "
          "them (D x S x P workers)",
          s, space.workers);
    }
    if (!base.device.is_cpu()) {
      return InvalidArgument(
          "{} slabs: spatial parallelism runs on CPU workers only so far; plan GPU workers with "
          "--spatial-parallel 1",
          s);
    }
    Result<ModelSpec> split = model.PlannedFor(1, s, false, SequenceAttention::kHalo);
    if (!split.ok()) {
      if (slabs_given) return split.status().WithContext(fmt::format("planning S = {}", s));
      leave_out(fmt::format("S{}", s), split.status().message());
      continue;
    }
    models.push_back(PlannedModel{1, false, *std::move(split), s});
  }
  // Slab counts given without 1: only plans of those.
  if (slabs_given && std::find(slab_counts.begin(), slab_counts.end(), 1) == slab_counts.end()) {
    std::erase_if(models, [](const PlannedModel& planned) { return planned.slabs == 1; });
  }
  return models;
}

std::vector<PlanChoice> EnumerateCandidates(const ModelSpec& model, const TrainingPlan& base,
                                            const SearchSpace& space,
                                            const Calibration* calibration) {
  Result<std::vector<PlannedModel>> models = PlannedModels(model, base, space);
  if (!models.ok()) return {};
  return CandidatesOf(*models, base, space, calibration);
}

Result<PlanSearchResult> PlanSearch(const ModelSpec& model, const TrainingPlan& base,
                                    const SearchSpace& space, const Calibration& calibration,
                                    const OpRegistry& registry) {
  if (space.workers < 1) {
    return InvalidArgument("plan search over {} workers: give at least one", space.workers);
  }
  if (calibration.layers.empty()) {
    return InvalidArgument(
        "plan search: the calibration holds no layer times (profile the layers first)");
  }
  const auto started = std::chrono::steady_clock::now();
  std::vector<std::string> left_out;
  TESSERA_ASSIGN_OR_RETURN(const std::vector<PlannedModel> models,
                           PlannedModels(model, base, space, &left_out));
  const std::vector<PlanChoice> candidates = CandidatesOf(models, base, space, &calibration);
  std::vector<Result<Outcome>> outcomes(candidates.size(),
                                        Result<Outcome>(Internal("the candidate was not planned")));
  const auto planned_for = [&models](const PlanChoice& choice) -> const ModelSpec& {
    for (const PlannedModel& planned : models) {
      if (planned.tensor_parallel == choice.tensor_parallel &&
          planned.shard_sequence == choice.shard_sequence && planned.slabs == choice.slabs) {
        return planned.model;
      }
    }
    return models.front().model;  // not reached: every candidate is of one of the models
  };
  std::atomic<size_t> next{0};
  const auto work = [&] {
    for (size_t i = next++; i < candidates.size(); i = next++) {
      outcomes[i] =
          Evaluate(planned_for(candidates[i]), base, calibration, candidates[i], registry);
    }
  };
  const int threads = std::clamp(space.threads, 1, 64);
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& thread : pool) thread.join();

  PlanSearchResult result;
  result.left_out = std::move(left_out);
  result.considered = static_cast<int>(candidates.size());
  std::vector<size_t> order;  // enumeration index of each ranked plan
  for (size_t i = 0; i < outcomes.size(); ++i) {
    Result<Outcome>& outcome = outcomes[i];
    if (!outcome.ok()) {
      return outcome.status().WithContext(fmt::format("plan search, {}", candidates[i].Name()));
    }
    if (auto* ranked = std::get_if<RankedPlan>(&*outcome)) {
      result.ranked.push_back(std::move(*ranked));
      order.push_back(i);
    } else {
      result.refused.push_back(std::get<RefusedPlan>(std::move(*outcome)));
    }
  }
  const auto tier = static_cast<size_t>(TierOf(base.device));
  std::vector<size_t> rank(result.ranked.size());
  for (size_t i = 0; i < rank.size(); ++i) rank[i] = i;
  std::stable_sort(rank.begin(), rank.end(), [&](size_t a, size_t b) {
    const RankedPlan& x = result.ranked[a];
    const RankedPlan& y = result.ranked[b];
    return std::make_tuple(x.step_ms, x.peak_bytes[tier], x.choice.workers(), order[a]) <
           std::make_tuple(y.step_ms, y.peak_bytes[tier], y.choice.workers(), order[b]);
  });
  std::vector<RankedPlan> sorted;
  sorted.reserve(rank.size());
  for (size_t i : rank) sorted.push_back(std::move(result.ranked[i]));
  result.ranked = std::move(sorted);
  result.search_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
  if (result.ranked.empty())
    return Infeasible("{}", NoPlanFits(model, base, space, result.refused));
  return result;
}

std::string DescribeSearch(const PlanSearchResult& result, int top) {
  std::string text = fmt::format("{:>3}  {:<44} {:>10}  {:<40} {:>11} {:>11} {:>10}  {}\n", "#",
                                 "plan", "step (ms)", "critical worker: compute/bubble/comm/swap",
                                 "host peak", "device peak", "disk peak", "memory plan");
  const int shown = std::min<int>(top, static_cast<int>(result.ranked.size()));
  for (int i = 0; i < shown; ++i) {
    const RankedPlan& r = result.ranked[static_cast<size_t>(i)];
    const SimulatedWorker& c = r.critical;
    const double end = std::max(c.end_ms, 1e-12);
    const std::string parts = fmt::format(
        "{:.0f}/{:.0f}/{:.0f}/{:.0f}% ({})", 100 * c.compute_ms / end, 100 * c.bubble_ms / end,
        100 * c.communication_ms / end, 100 * c.swap_ms / end, BottleneckName(r.bottleneck));
    std::string memory = "keeps every activation";
    if (r.recomputed_layers + r.swapped_layers + r.partly_kept_layers > 0) {
      memory = fmt::format("recomputes {}, swaps {}, keeps part of {} layers", r.recomputed_layers,
                           r.swapped_layers, r.partly_kept_layers);
    }
    const auto peak = [&r](MemoryTier tier) {
      const int64_t bytes = r.expected_peak_bytes[static_cast<size_t>(tier)];
      return bytes == 0 ? std::string("-") : MibText(bytes);
    };
    text += fmt::format("{:>3}  {:<44} {:>10.2f}  {:<40} {:>11} {:>11} {:>10}  {}\n", i + 1,
                        r.choice.Name(), r.step_ms, parts, peak(MemoryTier::kHost),
                        peak(MemoryTier::kDevice), peak(MemoryTier::kDisk), memory);
  }
  int by_memory = 0;
  for (const RefusedPlan& r : result.refused) by_memory += r.shortfall_bytes > 0 ? 1 : 0;
  text += fmt::format(
      "{} plans considered: {} fit and were timed, {} refused ({} over the memory cap); searched "
      "in {:.0f} ms\n",
      result.considered, result.ranked.size(), result.refused.size(), by_memory, result.search_ms);
  text +=
      "peaks: as the simulated step holds them; a plan also fits its cap in the executor's "
      "untimed order (every task a unit of time), which can hold more\n";
  for (const std::string& why : result.left_out) text += fmt::format("not searched: {}\n", why);
  return text;
}

}  // namespace tessera

#include "training/plan_calibration.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/cpu_set.h"
#include "core/statistics.h"
#include "ops/standard_ops.h"
#include "planner/step_graph.h"
#include "training/collective_link.h"
#include "training/layer_profile.h"
#include "training/trainer.h"

namespace tessera {
namespace {

using nlohmann::json;

// What the figures are measured by, in the cache key: a cache of an older method is measured
// again (2: in rounds, the push link measured directly; 3: the rate of the tasks that are no
// layer's measured; 4: the push link after the sender's work, and the probes' collectives copying
// once above 8 KiB where workers outnumber the cores; 5: a probe per tensor group size; 6: and
// one sharding sequences; 7: and one per slab count; 8: and a pipeline over every worker; 9: and
// a pipeline of each kind of group; 10: what a step takes outside its tasks measured on each
// probe's timeline, a constant plus a cost per task; 11: and a probe of ZeRO-3 ranks; 12: and a
// cost per worker).
constexpr int kCalibrationMethod = 12;

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown-host";
  return name;
}

json LinkJson(const CollectiveLink& link) {
  return json{{"latency_us", link.latency_us}, {"bytes_per_us", link.bytes_per_us}};
}

CollectiveLink LinkFrom(const json& j) {
  return CollectiveLink{j.at("latency_us").get<double>(), j.at("bytes_per_us").get<double>()};
}

json GroupLatencyJson(const std::vector<StepLinks::GroupLatency>& groups) {
  json array = json::array();
  for (const StepLinks::GroupLatency& group : groups) {
    array.push_back({{"members", group.members}, {"latency_us", group.latency_us}});
  }
  return array;
}

std::vector<StepLinks::GroupLatency> GroupLatencyFrom(const json& array) {
  std::vector<StepLinks::GroupLatency> groups;
  for (const json& group : array) {
    groups.push_back({group.at("members").get<int>(), group.at("latency_us").get<double>()});
  }
  return groups;
}

// A kind of group's wait by its name in the cache ("all_reduce", "sequence_shard", "exchange").
constexpr std::array<std::pair<StepLinks::GroupWait, const char*>, 3> kGroupWaitNames = {{
    {StepLinks::GroupWait::kAllReduce, "all_reduce"},
    {StepLinks::GroupWait::kSequenceShard, "sequence_shard"},
    {StepLinks::GroupWait::kExchange, "exchange"},
}};

json StagedLatencyJson(const std::vector<StepLinks::StagedLatency>& entries) {
  json array = json::array();
  for (const StepLinks::StagedLatency& entry : entries) {
    const char* wait = "all_reduce";
    for (const auto& [kind, name] : kGroupWaitNames) {
      if (kind == entry.wait) wait = name;
    }
    array.push_back({{"wait", wait}, {"members", entry.members}, {"latency_us", entry.latency_us}});
  }
  return array;
}

std::vector<StepLinks::StagedLatency> StagedLatencyFrom(const json& array) {
  std::vector<StepLinks::StagedLatency> entries;
  for (const json& entry : array) {
    const std::string wait = entry.at("wait").get<std::string>();
    const auto* kind = std::find_if(kGroupWaitNames.begin(), kGroupWaitNames.end(),
                                    [&wait](const auto& named) { return wait == named.second; });
    if (kind == kGroupWaitNames.end()) {
      throw std::invalid_argument("staged_latency: unknown wait '" + wait + "'");
    }
    entries.push_back(
        {kind->first, entry.at("members").get<int>(), entry.at("latency_us").get<double>()});
  }
  return entries;
}

json LayersJson(const std::vector<LayerTimesAtRows>& layers) {
  json all = json::array();
  for (const LayerTimesAtRows& at : layers) {
    json ms = json::array();
    for (const OpCosts& c : at.layer_ms) ms.push_back({c.forward, c.backward, c.weight});
    all.push_back({{"rows", at.rows}, {"layer_ms", ms}});
  }
  return all;
}

std::vector<LayerTimesAtRows> LayersFrom(const json& all) {
  std::vector<LayerTimesAtRows> layers;
  for (const json& at : all) {
    LayerTimesAtRows rows{at.at("rows").get<int64_t>(), {}};
    for (const json& ms : at.at("layer_ms")) {
      rows.layer_ms.push_back(
          OpCosts{ms.at(0).get<double>(), ms.at(1).get<double>(), ms.at(2).get<double>()});
    }
    layers.push_back(std::move(rows));
  }
  return layers;
}

}  // namespace

std::vector<int64_t> CandidateRows(const ModelSpec& model, const TrainingPlan& base,
                                   const SearchSpace& space) {
  std::set<int64_t> rows;
  for (const PlanChoice& c : EnumerateCandidates(model, base, space)) {
    if (c.tensor_parallel > 1 || c.slabs > 1) continue;
    rows.insert(base.batch / (int64_t{c.data_parallel} * c.micro_batches));
  }
  return {rows.begin(), rows.end()};
}

std::vector<TensorSplitRows> CandidateTensorSplitRows(const ModelSpec& model,
                                                      const TrainingPlan& base,
                                                      const SearchSpace& space) {
  std::map<std::pair<int, int>, std::set<int64_t>> rows;  // by (S, T): tensor splits first
  for (const PlanChoice& c : EnumerateCandidates(model, base, space)) {
    if (c.tensor_parallel < 2 && c.slabs < 2) continue;
    rows[{c.slabs, c.tensor_parallel}].insert(base.batch /
                                              (int64_t{c.data_parallel} * c.micro_batches));
  }
  std::vector<TensorSplitRows> splits;
  splits.reserve(rows.size());
  for (const auto& [split, counts] : rows) {
    splits.push_back(TensorSplitRows{split.second, {counts.begin(), counts.end()}, split.first});
  }
  return splits;
}

namespace {

// A probe's steps: the median step time, and the median of what each step took outside its tasks
// (its time less its timeline's TaskSpanMs; negative when the backend keeps no timeline).
struct ProbeMeasure {
  double ms = 0;
  double outside_ms = -1;
};

// The steps of `plan` (its workers bound) on a new backend: zeros at a zero learning rate, two
// untimed steps then `steps`.
Result<ProbeMeasure> MeasureProbeSteps(const ModelSpec& model, const TrainingPlan& plan,
                                       const BackendFactory& make_backend, int steps) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<GraphBackend> backend, make_backend());
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                           Trainer::Create(model, plan, std::move(backend)));
  std::vector<Tensor> batch;
  batch.reserve(model.inputs.size());
  for (const ModelInput& input : model.inputs) {
    TESSERA_ASSIGN_OR_RETURN(
        Tensor zeros, Tensor::Zeros(input.Meta(plan.batch, plan.seq_len), SharedHostAllocator()));
    batch.push_back(std::move(zeros));
  }
  // Two untimed steps (communicators, the allocators' caches), then the median of the rest.
  std::vector<double> ms, outside;
  bool timed = true;
  for (int step = 0; step < 2 + steps; ++step) {
    TESSERA_ASSIGN_OR_RETURN(StepReport report, trainer->Step(batch, 0.0f));
    if (step < 2) continue;
    ms.push_back(report.step_ms);
    if (!timed) continue;
    const Result<Timeline> timeline = trainer->StepTimeline(1);
    const double span = timeline.ok() ? TaskSpanMs(*timeline) : 0;
    timed = span > 0;
    if (timed) outside.push_back(std::max(0.0, report.step_ms - span));
  }
  ProbeMeasure measure{Median(std::move(ms))};
  if (timed && !outside.empty()) measure.outside_ms = Median(std::move(outside));
  return measure;
}

// The order round `round` of `rounds` takes `count` measurements in: rotated by its share of
// them, so no measurement always runs first or after the same one.
std::vector<size_t> RoundOrder(size_t count, int round, int rounds) {
  std::vector<size_t> order(count);
  const size_t start = count * static_cast<size_t>(round) / static_cast<size_t>(rounds);
  for (size_t i = 0; i < count; ++i) order[i] = (start + i) % count;
  return order;
}

// A probe step: its plan, its rounds' step times (failed: the first error) and what their steps
// took outside their tasks (ProbeMeasure; empty when a round's backend kept no timeline).
struct ProbeStep {
  std::string what;
  TrainingPlan plan;
  std::vector<double> ms;
  Status failed;
  std::vector<double> outside_ms;
  bool ok() const { return failed.ok() && !ms.empty(); }
  double median() const { return Median(ms); }
  bool timed() const { return ok() && outside_ms.size() == ms.size(); }
};

// Every probe in `rounds` rounds (each in RoundOrder), so that what moves a machine's speed for
// a while (another process, the host of a virtual machine) moves one round of a probe, not the
// probe.
void MeasureProbes(const ModelSpec& model, std::vector<ProbeStep>& probes, int rounds, int steps,
                   const BackendFactory& make_backend) {
  for (int q = 0; q < rounds; ++q) {
    for (size_t i : RoundOrder(probes.size(), q, rounds)) {
      ProbeStep& probe = probes[i];
      if (!probe.failed.ok()) continue;
      Result<ProbeMeasure> measure = MeasureProbeSteps(model, probe.plan, make_backend, steps);
      if (measure.ok()) {
        probe.ms.push_back(measure->ms);
        if (measure->outside_ms >= 0) probe.outside_ms.push_back(measure->outside_ms);
      } else {
        probe.failed = measure.status();
      }
    }
  }
}

// The simulated step of `plan` on `calibration`.
Result<SimulatedStep> Simulated(const ModelSpec& model, const TrainingPlan& plan,
                                const Calibration& calibration, const OpRegistry& registry) {
  TESSERA_ASSIGN_OR_RETURN(StepGraph step, PlanTrainingStep(model, plan, registry));
  return SimulatePlannedStep(step, model, plan.memory, calibration, registry);
}

// Its simulated step's time (what the fits bisect on).
Result<double> SimulatedMs(const ModelSpec& model, const TrainingPlan& plan,
                           const Calibration& calibration, const OpRegistry& registry) {
  TESSERA_ASSIGN_OR_RETURN(SimulatedStep step, Simulated(model, plan, calibration, registry));
  return step.step_ms;
}

// The value in [lo, hi] at which `simulated(value)`, a simulated step in ms that grows with the
// value (`grows`) or shrinks with it, gives `measured`: bisected `rounds` times.
Result<double> FitByBisection(double lo, double hi, int rounds, bool grows, double measured,
                              const std::function<Result<double>(double)>& simulated) {
  for (int i = 0; i < rounds; ++i) {
    const double mid = (lo + hi) / 2;
    TESSERA_ASSIGN_OR_RETURN(const double ms, simulated(mid));
    ((ms < measured) == grows ? lo : hi) = mid;
  }
  return (lo + hi) / 2;
}

// What a probe's collectives or pushes wait while the workers share the machine: `latency`
// (which `simulated_ms` reads) bisected from `idle` up until the simulated step gives
// `measured`; set to `otherwise` when the step simulated at `idle` is no faster than measured.
// Returns the step simulated at `idle`.
Result<double> FitWaitAboveIdle(double idle, double otherwise, double measured, double& latency,
                                const std::function<Result<double>()>& simulated_ms) {
  const auto simulated_at = [&](double latency_us) -> Result<double> {
    latency = latency_us;
    return simulated_ms();
  };
  TESSERA_ASSIGN_OR_RETURN(const double at_idle, simulated_at(idle));
  if (measured <= at_idle) {
    latency = otherwise;
    return at_idle;
  }
  TESSERA_ASSIGN_OR_RETURN(const double fit,
                           FitByBisection(idle, 1e5, 40, /*grows=*/true, measured, simulated_at));
  latency = fit;
  return at_idle;
}

// Micro-batches of one row each for a batch of `rows`, at most 16 (the most that divides).
int OneRowMicroBatches(int64_t rows) {
  auto micro_batches = static_cast<int>(std::min<int64_t>(rows, 16));
  while (rows % micro_batches != 0) --micro_batches;
  return micro_batches;
}

// When one rank of the whole model cannot run on one worker (a volume beyond a worker's cap), the
// compute scale comes from the model in slabs over the most workers it splits into, every
// worker computing at once: its step over its simulated step (no per-step constant; the
// workers' sharing of the machine folded into the scale, which the slab plans of that many
// workers see as measured). Leaves the defaults when the model has no such split or its probe
// fails too.
Status FitTheSlabProbe(const ModelSpec& model, const TrainingPlan& one,
                       const CalibrationRequest& request, const BackendFactory& make_backend,
                       const std::function<void(const std::string&)>& say,
                       const OpRegistry& registry, Calibration& calibration) {
  const auto n = static_cast<int>(request.workers.size());
  int slabs = 1;
  for (const TensorSplitTimes& split : calibration.tensor_splits) {
    if (split.slabs > slabs && split.slabs <= n) slabs = split.slabs;
  }
  if (slabs < 2) return Status::Ok();
  TrainingPlan plan = one;
  plan.parallel.data_parallel = slabs;
  plan.parallel.sequence_parallel = slabs;
  plan.parallel.sequence_attention = SequenceAttention::kHalo;
  plan.parallel.workers.assign(request.workers.begin(), request.workers.begin() + slabs);
  plan.parallel.link = calibration.links.collective;
  std::vector<ProbeStep> probes = {
      {fmt::format("{} slabs on {} workers", slabs, slabs), plan, {}, {}}};
  MeasureProbes(model, probes, std::max(1, request.rounds), request.probe_steps, make_backend);
  if (!probes[0].ok()) {
    ++calibration.probes_failed;
    say(fmt::format("{}: the probe step failed ({}); the compute scale stays 1", probes[0].what,
                    probes[0].failed.ToString()));
    return Status::Ok();
  }
  TESSERA_ASSIGN_OR_RETURN(ModelSpec split,
                           model.PlannedFor(1, slabs, false, SequenceAttention::kHalo));
  TESSERA_ASSIGN_OR_RETURN(SimulatedStep simulated, Simulated(split, plan, calibration, registry));
  const double measured = probes[0].median();
  if (simulated.step_ms <= 0) return Status::Ok();
  calibration.compute_scale = measured / simulated.step_ms;
  say(fmt::format(
      "{} at {} row(s): {:.2f} ms a step against {:.2f} ms of profiled work: the "
      "workers compute at {:.2f}x the profile's times (one rank of the whole model "
      "does not fit a worker, so this is what the scale is fitted on)",
      probes[0].what, plan.batch, measured, simulated.step_ms, calibration.compute_scale));
  return Status::Ok();
}

// A fitted wait's line: "<probe>: <its step>, within the simulated <at the base figure>:
// <kept>" where the probe's step was no slower than simulated at the base figure (which it then
// keeps), else "<probe>: <its step> against <at the base figure> simulated <with>: <fitted>".
std::string FittedWaitLine(const ProbeStep& probe, double simulated_ms, bool kept,
                           const std::string& with, const std::string& kept_text,
                           const std::string& fitted_text) {
  if (kept) {
    return fmt::format("{}: {:.2f} ms a step, within the simulated {:.2f} ms: {}", probe.what,
                       probe.median(), simulated_ms, kept_text);
  }
  return fmt::format("{}: {:.2f} ms a step against {:.2f} ms simulated {}: {}", probe.what,
                     probe.median(), simulated_ms, with, fitted_text);
}

// The probe steps on the workers (see the header), measured together in rounds, and what each
// fits: the compute scale and per-step overhead (one rank on one worker at two row counts), the
// compute sharing (every worker a data-parallel rank) and the collective latency among workers
// sharing the machine (tensor-parallel pairs). A probe the workers cannot run (a worker's memory
// cap below an uncapped probe step) leaves its figures at their defaults, and says so.
Status FitTheProbes(const ModelSpec& model, const TrainingPlan& base,
                    const CalibrationRequest& request, const BackendFactory& make_backend,
                    const std::function<void(const std::string&)>& say, Calibration& calibration) {
  OpRegistry registry;
  TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry));
  calibration.sharing.groups = request.core_groups;  // the capacity fitted below is theirs
  const auto n = static_cast<int>(request.workers.size());
  // Rows of one rank of the widest data-parallel plan (the base batch over the workers, when it
  // splits), else the fewest profiled.
  const int64_t rows = base.batch % n == 0 ? base.batch / n : request.rows.front();
  TrainingPlan one = base;
  one.batch = rows;
  one.parallel = ParallelConfig{};
  // A 1-bit Adam plan's probes time its warm-up step (the first ones it runs), not its switch.
  one.optimizer.freeze_step = std::numeric_limits<int>::max();
  one.parallel.workers = {request.workers.front()};
  one.memory = base.memory;  // planned under the caps the workers hold, as the plans will be
  // One rank on one worker at two row counts: the worker's step is a scale of the profiled work
  // (its kernels may run faster or slower there than in this process) plus a constant per step.
  TrainingPlan other = one;
  other.batch = rows >= 2 && n == 1 ? rows / 2 : rows * 2;
  std::vector<ProbeStep> probes = {{"one rank on one worker", one, {}, {}},
                                   {"one rank on one worker", other, {}, {}}};
  constexpr size_t kNone = SIZE_MAX;
  size_t all_at = kNone;
  if (n >= 2) {
    // Every worker a data-parallel rank at once.
    TrainingPlan all = one;
    all.batch = rows * n;
    all.parallel.data_parallel = n;
    all.parallel.workers = request.workers;
    all.parallel.link = calibration.links.collective;
    all_at = probes.size();
    probes.push_back({fmt::format("{} ranks at once", n), all, {}, {}});
  }
  // Every worker a stage of one pipeline (1F1B, micro-batches of one row, up to 16): each stage
  // hands objects to the next at every micro-batch, and its reader must be scheduled before it
  // starts, so the step fits what a pushed object waits while the workers share the machine
  // (StepLinks::shared_push_latency_us).
  size_t pipeline_at = kNone;
  if (n >= 2 && calibration.links.point_to_point.measured() &&
      model.layers.size() >= static_cast<size_t>(n)) {
    TrainingPlan pipeline = one;
    pipeline.batch = rows * n;
    pipeline.parallel.pipeline_stages = n;
    pipeline.parallel.schedule = PipelineSchedule::k1F1B;
    pipeline.parallel.micro_batches = OneRowMicroBatches(pipeline.batch);
    pipeline.parallel.workers = request.workers;
    pipeline.parallel.link = calibration.links.collective;
    pipeline_at = probes.size();
    probes.push_back({fmt::format("a pipeline of {} stages, {} micro-batches", n,
                                  pipeline.parallel.micro_batches),
                      pipeline,
                      {},
                      {}});
  }
  // Per tensor degree T calibrated that divides the workers: every worker a rank of n/T groups
  // of T tensor ranks at once, whose step waits on two all-reduces a layer pair each way, at one
  // row a micro-batch (up to 16 micro-batches): the most collectives a step's compute, so that
  // what a collective of T members waits, not the compute model's error, is what the step's
  // time fits (T = 2: the link's latency; more: StepLinks::group_latency).
  // Where the model shards sequences (Megatron-LM's sequence parallelism), the same groups
  // sharding them: what their reduce-scatters and all-gathers wait
  // (StepLinks::sequence_shard_latency), fitted with the all-reduces' latency fixed. Per slab
  // count S calibrated that divides the workers, every worker a slab of n/S volumes split into S
  // at once, at one row a micro-batch: what their halo passes and exchanged statistics wait
  // (StepLinks::exchange_latency; a convolution's or a norm's compute between exchanges that
  // pass to one neighbour, where a tensor rank's all-reduce waits for every peer).
  // Where the workers make two stages or more of such groups, the same groups as the stages of
  // one pipeline (1F1B, micro-batches of one row): what their collectives wait inside a
  // pipeline (StepLinks::staged_latency), fitted with the groups' own figures fixed; for tensor
  // ranks and slabs, not for groups sharding sequences (whose pipelines of one-row micro-batches
  // fitted a wait that put sequence-sharded pipelines of 4-row micro-batches 40% slow, where
  // their groups' own figure is within 12%).
  using Waiter = StepLinks::GroupWait;
  struct GroupProbe {
    int members = 0;
    Waiter waiter = Waiter::kAllReduce;
    size_t at = kNone;
    ModelSpec split;
    size_t staged_at = kNone;  // the pipeline of such groups, where there is one
  };
  std::vector<GroupProbe> groups;
  // The pipeline of `n / members` stages, each a group as `side_by_side` (the group probe's plan)
  // has them, for the group probe just added.
  const auto add_staged = [&](const TrainingPlan& side_by_side, const std::string& groups_are) {
    GroupProbe& group = groups.back();
    const int stages = n / group.members;
    if (stages < 2 || model.layers.size() < static_cast<size_t>(stages) ||
        !calibration.links.point_to_point.measured()) {
      return;
    }
    TrainingPlan staged = side_by_side;
    staged.parallel.data_parallel = side_by_side.parallel.data_parallel / stages;
    staged.parallel.pipeline_stages = stages;
    staged.parallel.schedule = PipelineSchedule::k1F1B;
    staged.parallel.micro_batches = OneRowMicroBatches(staged.batch);
    group.staged_at = probes.size();
    probes.push_back({fmt::format("a pipeline of {} stages of {}, {} micro-batches", stages,
                                  groups_are, staged.parallel.micro_batches),
                      staged,
                      {},
                      {}});
  };
  if (calibration.links.collective.measured()) {
    for (const TensorSplitTimes& times : calibration.tensor_splits) {
      const int s = times.slabs;
      if (s >= 2 && n % s == 0) {
        Result<ModelSpec> split = model.PlannedFor(1, s, false, SequenceAttention::kHalo);
        if (!split.ok()) continue;
        TrainingPlan slabs = one;
        slabs.batch = one.batch * (n / s);
        slabs.parallel.data_parallel = n;
        slabs.parallel.sequence_parallel = s;
        slabs.parallel.sequence_attention = SequenceAttention::kHalo;
        slabs.parallel.micro_batches = OneRowMicroBatches(one.batch);
        slabs.parallel.workers = request.workers;
        slabs.parallel.link = calibration.links.collective;
        groups.push_back(GroupProbe{s, Waiter::kExchange, probes.size(), *std::move(split)});
        probes.push_back({fmt::format("{} volume(s) in {} slabs at once, {} micro-batches", n / s,
                                      s, slabs.parallel.micro_batches),
                          slabs,
                          {},
                          {}});
        add_staged(slabs, fmt::format("{} slabs", s));
        continue;
      }
      const int t = times.tensor_parallel;
      if (t < 2 || n % t != 0) continue;
      for (const bool shard : {false, true}) {
        if (shard && base.seq_len % t != 0) continue;
        Result<ModelSpec> split = model.PlannedFor(t, 1, shard);
        if (!split.ok()) continue;
        TrainingPlan group = one;
        group.batch = one.batch * (n / t);
        group.parallel.data_parallel = n / t;
        group.parallel.tensor_parallel = t;
        group.parallel.shard_sequence = shard;
        group.parallel.micro_batches = OneRowMicroBatches(one.batch);
        group.parallel.workers = request.workers;
        group.parallel.link = calibration.links.collective;
        groups.push_back(GroupProbe{t, shard ? Waiter::kSequenceShard : Waiter::kAllReduce,
                                    probes.size(), *std::move(split)});
        probes.push_back(
            {fmt::format("{}{}, {} micro-batches",
                         t == 2 ? fmt::format("{} tensor-parallel pairs at once", n / t)
                                : fmt::format("{} group(s) of {} tensor ranks at once", n / t, t),
                         shard ? " sharding sequences" : "", group.parallel.micro_batches),
             group,
             {},
             {}});
        if (!shard) add_staged(group, fmt::format("{} tensor ranks", t));
      }
    }
    std::sort(groups.begin(), groups.end(), [](const GroupProbe& a, const GroupProbe& b) {
      return std::tie(a.members, a.waiter) < std::tie(b.members, b.waiter);
    });
  }
  // Every worker a ZeRO-3 rank at once, at one row a micro-batch (each layer's parameters
  // gathered before its forward and its backward of every micro-batch, beside the compute of the
  // layer before): what a gather of n waits while the workers share the machine (StepLinks::
  // gather_latency), fitted last with every other figure fixed. Last in the list, so that a
  // recording made before it was probed refits without it.
  size_t gather_at = kNone;
  if (n >= 2 && calibration.links.collective.measured()) {
    TrainingPlan zero = one;
    zero.batch = rows * n;
    zero.parallel.data_parallel = n;
    zero.parallel.zero_stage = 3;
    zero.parallel.micro_batches = OneRowMicroBatches(rows);
    // As the search plans ZeRO-3 where workers share cores (EnumerateCandidates settles each
    // micro-batch's reductions on a machine whose workers share it; bound in groups, they do).
    zero.parallel.settle_reductions =
        zero.parallel.micro_batches > 1 && !request.core_groups.empty();
    zero.parallel.workers = request.workers;
    zero.parallel.link = calibration.links.collective;
    gather_at = probes.size();
    probes.push_back(
        {fmt::format("{} ZeRO-3 ranks at once, {} micro-batches", n, zero.parallel.micro_batches),
         zero,
         {},
         {}});
  }
  const int rounds = std::max(1, request.rounds);
  if (calibration.probe_steps.empty()) {
    MeasureProbes(model, probes, rounds, request.probe_steps, make_backend);
    calibration.probe_workers = request.workers;
    for (const ProbeStep& probe : probes) {
      calibration.probe_steps.push_back({probe.what, probe.ok() ? probe.ms : std::vector<double>{},
                                         probe.timed() ? probe.outside_ms : std::vector<double>{}});
    }
  } else {  // fitted again on what was measured before (RefitCalibration)
    if (gather_at == probes.size() - 1 && calibration.probe_steps.size() == gather_at) {
      probes.pop_back();  // recorded before the gathers were probed: their wait stays the link's
      gather_at = kNone;
    }
    if (calibration.probe_steps.size() != probes.size()) {
      return InvalidArgument(
          "refitting: the calibration recorded {} probe steps where this model and request make "
          "{}; calibrate again",
          calibration.probe_steps.size(), probes.size());
    }
    for (size_t i = 0; i < probes.size(); ++i) {
      const Calibration::ProbeRecord& recorded = calibration.probe_steps[i];
      if (recorded.what != probes[i].what) {
        return InvalidArgument(
            "refitting: probe {} was '{}' when measured, '{}' now; calibrate again", i + 1,
            recorded.what, probes[i].what);
      }
      probes[i].ms = recorded.ms;
      probes[i].outside_ms = recorded.outside_ms;
      if (recorded.ms.empty()) probes[i].failed = Unavailable("it failed when measured");
    }
  }
  for (const ProbeStep& probe : probes) calibration.probes_failed += probe.ok() ? 0 : 1;
  say(
      fmt::format("{} probe steps on the workers, {} round(s) each (a step's time: the median of "
                  "its rounds')",
                  probes.size(), rounds));
  const auto measured = [&](size_t at) -> const ProbeStep* {
    if (at == kNone) return nullptr;
    const ProbeStep& probe = probes[at];
    if (!probe.ok()) {
      say(fmt::format("{}: the probe step failed ({}); its figures are not fitted", probe.what,
                      probe.failed.ToString()));
      return nullptr;
    }
    return &probe;
  };
  const ProbeStep* probed_one = measured(0);
  const ProbeStep* probed_other = measured(1);
  if (probed_one == nullptr || probed_other == nullptr) {
    if (!make_backend) {
      return InvalidArgument(
          "refitting: one rank's probes failed when measured, and their slab fallback is not "
          "recorded; calibrate again");
    }
    return FitTheSlabProbe(model, one, request, make_backend, say, registry, calibration);
  }
  const double measured_one = probed_one->median(), measured_other = probed_other->median();
  TESSERA_ASSIGN_OR_RETURN(SimulatedStep simulated_one,
                           Simulated(model, one, calibration, registry));
  TESSERA_ASSIGN_OR_RETURN(SimulatedStep simulated_other,
                           Simulated(model, other, calibration, registry));
  const double a = simulated_one.step_ms, b = simulated_other.step_ms;
  // What a step takes outside its tasks (its inputs sent, the instance started on each worker,
  // their reports collected), as the probes' timelines measured it: a constant, a cost per
  // worker past the first (each is started and reports) and a cost per task of the worker that
  // runs the most (a worker readies and retires each), fitted over every probe's median: the
  // cost per task the median slope between probes on as many workers (FitSharedSlope), the
  // constant the one-worker probes' intercept, the cost per worker from the intercept of the
  // probes on the most workers (on 2 cores the U-Net's probes of 4 workers and ~30 tasks took
  // 1.2-1.3 ms outside them, one worker's 0.5-0.6). The one rank's steps less theirs are then its
  // work: the scale. Without timelines (a recording made before they were kept), the one rank's
  // two steps fit a scale and a constant.
  std::vector<GroupedPoint> outside;  // by workers: (most tasks on a worker, ms)
  if (probed_one->timed() && probed_other->timed()) {
    const auto model_of = [&](size_t at) -> const ModelSpec& {
      for (const GroupProbe& group : groups) {
        if (group.at == at || group.staged_at == at) return group.split;
      }
      return model;
    };
    for (size_t i = 0; i < probes.size(); ++i) {
      if (!probes[i].timed()) continue;
      TESSERA_ASSIGN_OR_RETURN(StepGraph step,
                               PlanTrainingStep(model_of(i), probes[i].plan, registry));
      const WorkerLoad load = WorkerLoadOf(step.graph);
      outside.push_back({static_cast<int>(load.workers), static_cast<double>(load.most_tasks),
                         Median(probes[i].outside_ms)});
    }
  }
  if (!outside.empty()) {
    // Of the one rank's simulated steps, what the tasks' overhead takes (every task at no time,
    // nothing a step yet): the compute scale is the rest's.
    const double unscaled = calibration.compute_scale;
    calibration.compute_scale = 0;
    TESSERA_ASSIGN_OR_RETURN(const SimulatedStep overhead_one,
                             Simulated(model, one, calibration, registry));
    TESSERA_ASSIGN_OR_RETURN(const SimulatedStep overhead_other,
                             Simulated(model, other, calibration, registry));
    calibration.compute_scale = unscaled;
    const double per_task = overhead_one.step_ms + overhead_other.step_ms;
    const SharedSlope fit = FitSharedSlope(outside);
    const auto& [fewest_workers, alone] = *fit.intercepts.begin();
    const auto& [most_workers, together] = *fit.intercepts.rbegin();
    const double per_worker =
        most_workers > fewest_workers
            ? std::max(0.0, (together - alone) / static_cast<double>(most_workers - fewest_workers))
            : 0.0;
    calibration.step_overhead_per_worker_ms = per_worker;
    // The constant is one worker's (the fewest probed are one, unless their probes failed).
    calibration.step_overhead_ms =
        std::max(0.0, alone - per_worker * static_cast<double>(fewest_workers - 1));
    calibration.step_overhead_per_task_ms = fit.slope;
    const double one_outside = Median(probed_one->outside_ms);
    const double other_outside = Median(probed_other->outside_ms);
    const double work = a + b - per_task;  // the profiled work, > 0 (the layers take time)
    const double measured_work = measured_one - one_outside + measured_other - other_outside;
    if (work > 0 && measured_work > per_task) {
      calibration.compute_scale = (measured_work - per_task) / work;
    }
    const auto [fewest, most] =
        std::minmax_element(outside.begin(), outside.end(),
                            [](const GroupedPoint& p, const GroupedPoint& q) { return p.x < q.x; });
    say(fmt::format(
        "outside its tasks a step takes {:.2f} ms + {:.2f} ms a worker past the first + {:.2f} us "
        "a task of the worker running the most ({} probes' timelines: {:.2f} ms at {:.0f} tasks "
        "to {:.2f} ms at {:.0f})",
        calibration.step_overhead_ms, calibration.step_overhead_per_worker_ms,
        1e3 * calibration.step_overhead_per_task_ms, outside.size(), fewest->y, fewest->x, most->y,
        most->x));
    say(fmt::format(
        "one rank on one worker at {} and {} rows: {:.2f} and {:.2f} ms a step, {:.2f} "
        "and {:.2f} of it its tasks', against {:.2f} and {:.2f} ms of profiled work: "
        "the worker computes at {:.2f}x the profile's times",
        one.batch, other.batch, measured_one, measured_other, measured_one - one_outside,
        measured_other - other_outside, a, b, calibration.compute_scale));
  } else {
    double scale = b != a ? (measured_other - measured_one) / (b - a) : 0;
    double constant = measured_one - scale * a;
    if (scale <= 0 || constant < 0) {  // noise: no constant, the scale of both together
      scale = (measured_one + measured_other) / (a + b);
      constant = 0;
    }
    calibration.compute_scale = scale;
    calibration.step_overhead_ms = constant;
    say(fmt::format(
        "one rank on one worker at {} and {} rows: {:.2f} and {:.2f} ms a step against {:.2f} and "
        "{:.2f} ms of profiled work: the worker computes at {:.2f}x the profile's times, plus "
        "{:.2f} ms a step",
        one.batch, other.batch, measured_one, measured_other, a, b, scale, constant));
  }
  // The sharing (all ranks) and what a collective waits among busy workers (each group probe) are
  // fitted in turn until none moves: each probe's step depends on all (the ranks' all-reduces
  // wait the latency; the groups compute while sharing the machine). A group's step depends on
  // its own latency far more than the ranks' does, so the turns converge.
  const ProbeStep* probed_all = measured(all_at);
  const double idle = calibration.links.collective.latency_us;
  // Every group probe measured, with where its fitted latency goes: the link's for pairs, else
  // its entry of StepLinks::group_latency (each made first, at the idle latency).
  struct Fitted {
    const GroupProbe* group;
    const ProbeStep* probe;
    const ProbeStep* staged;  // its pipeline of such groups, where one was measured
  };
  std::vector<Fitted> fitted;
  calibration.links.group_latency.clear();
  calibration.links.sequence_shard_latency.clear();
  calibration.links.exchange_latency.clear();
  calibration.links.staged_latency.clear();
  const auto entries_of = [&](const GroupProbe& group) -> std::vector<StepLinks::GroupLatency>& {
    switch (group.waiter) {
      case Waiter::kSequenceShard:
        return calibration.links.sequence_shard_latency;
      case Waiter::kExchange:
        return calibration.links.exchange_latency;
      case Waiter::kAllReduce:
        break;
    }
    return calibration.links.group_latency;
  };
  for (const GroupProbe& group : groups) {
    const ProbeStep* probe = measured(group.at);
    if (probe == nullptr) continue;
    const ProbeStep* staged = measured(group.staged_at);
    fitted.push_back({&group, probe, staged});
    if (group.waiter != Waiter::kAllReduce || group.members > 2) {
      entries_of(group).push_back({group.members, idle});
    }
    if (staged != nullptr) {
      calibration.links.staged_latency.push_back({group.waiter, group.members, idle});
    }
  }
  const auto staged_latency_of = [&](const GroupProbe& group) -> double& {
    for (StepLinks::StagedLatency& entry : calibration.links.staged_latency) {
      if (entry.wait == group.waiter && entry.members == group.members) return entry.latency_us;
    }
    TESSERA_CHECK(false, "no staged latency entry for a group of {}", group.members);
    return calibration.links.staged_latency.front().latency_us;
  };
  const auto latency_of = [&](const GroupProbe& group) -> double& {
    for (StepLinks::GroupLatency& entry : entries_of(group)) {
      if (entry.members == group.members) return entry.latency_us;
    }
    return calibration.links.collective.latency_us;  // pairs' all-reduces: the link's
  };
  double alone_ms = 0;
  std::vector<double> at_idle_ms(fitted.size(), 0);
  const auto fit_sharing = [&]() -> Status {
    calibration.sharing.capacity = 0;
    TESSERA_ASSIGN_OR_RETURN(SimulatedStep alone,
                             Simulated(model, probed_all->plan, calibration, registry));
    alone_ms = alone.step_ms;
    if (probed_all->median() <= alone_ms * 1.05) return Status::Ok();
    // The simulated step shrinks as the capacity grows: bisect for the measured one.
    TESSERA_ASSIGN_OR_RETURN(
        const double capacity,
        FitByBisection(0.05, n, 30, /*grows=*/false, probed_all->median(), [&](double room) {
          calibration.sharing.capacity = room;
          return SimulatedMs(model, probed_all->plan, calibration, registry);
        }));
    calibration.sharing.capacity = capacity;
    return Status::Ok();
  };
  // What a collective of the group's members waits beyond its bytes while the workers share the
  // machine (peers that must be scheduled first), bisected so the simulation gives the group
  // probe's measured step; the idle link's when that step is no slower than simulated with it.
  const auto fit_latency = [&](size_t i) -> Status {
    const GroupProbe& group = *fitted[i].group;
    const ProbeStep& probe = *fitted[i].probe;
    TESSERA_ASSIGN_OR_RETURN(at_idle_ms[i],
                             FitWaitAboveIdle(idle, idle, probe.median(), latency_of(group), [&] {
                               return SimulatedMs(group.split, probe.plan, calibration, registry);
                             }));
    return Status::Ok();
  };
  // What a pushed object waits while the workers share the machine (a reader to be scheduled),
  // bisected so the simulation gives the pipeline probe's step; point_to_point's (0) when that
  // step is no slower than simulated with it.
  const ProbeStep* probed_pipeline = measured(pipeline_at);
  calibration.links.shared_push_latency_us = 0;
  double pipeline_at_idle_ms = 0;
  const auto fit_push = [&]() -> Status {
    TESSERA_ASSIGN_OR_RETURN(
        pipeline_at_idle_ms,
        FitWaitAboveIdle(calibration.links.point_to_point.latency_us, 0, probed_pipeline->median(),
                         calibration.links.shared_push_latency_us, [&] {
                           return SimulatedMs(model, probed_pipeline->plan, calibration, registry);
                         }));
    return Status::Ok();
  };
  for (int turn = 0; turn < 6; ++turn) {
    std::vector<double> before = {calibration.sharing.capacity,
                                  calibration.links.shared_push_latency_us};
    for (const Fitted& f : fitted) before.push_back(latency_of(*f.group));
    if (probed_all != nullptr) TESSERA_RETURN_IF_ERROR(fit_sharing());
    for (size_t i = 0; i < fitted.size(); ++i) TESSERA_RETURN_IF_ERROR(fit_latency(i));
    if (probed_pipeline != nullptr) TESSERA_RETURN_IF_ERROR(fit_push());
    std::vector<double> after = {calibration.sharing.capacity,
                                 calibration.links.shared_push_latency_us};
    for (const Fitted& f : fitted) after.push_back(latency_of(*f.group));
    bool moved = false;
    for (size_t i = 0; i < before.size(); ++i) {
      moved = moved || std::abs(after[i] - before[i]) > 0.01 * std::max(std::abs(before[i]), 1e-9);
    }
    if (turn > 0 && !moved) break;
  }
  // Inside a pipeline, with every other figure fixed: what each kind of group's collectives wait
  // there, bisected from the figure the groups side by side gave (which it keeps when the
  // pipeline's step is no slower than simulated with it). No other probe has such a group.
  std::vector<double> staged_at_side_ms(fitted.size(), 0);
  for (size_t i = 0; i < fitted.size(); ++i) {
    if (fitted[i].staged == nullptr) continue;
    const GroupProbe& group = *fitted[i].group;
    const ProbeStep& staged = *fitted[i].staged;
    const double side_by_side = latency_of(group);
    TESSERA_ASSIGN_OR_RETURN(
        staged_at_side_ms[i],
        FitWaitAboveIdle(
            side_by_side, side_by_side, staged.median(), staged_latency_of(group),
            [&] { return SimulatedMs(group.split, staged.plan, calibration, registry); }));
  }
  // With every other figure fixed: what a ZeRO-3 gather of n waits, bisected from what a
  // collective of n waits otherwise (kept when the probe's step is no slower than simulated
  // with that). No other probe gathers parameters.
  const ProbeStep* probed_gather = measured(gather_at);
  calibration.links.gather_latency.clear();
  double gather_base = 0, gather_at_base_ms = 0;
  if (probed_gather != nullptr) {
    gather_base = calibration.links.LatencyUs(n);
    calibration.links.gather_latency.push_back({n, gather_base});
    TESSERA_ASSIGN_OR_RETURN(
        gather_at_base_ms,
        FitWaitAboveIdle(gather_base, gather_base, probed_gather->median(),
                         calibration.links.gather_latency.back().latency_us, [&] {
                           return SimulatedMs(model, probed_gather->plan, calibration, registry);
                         }));
  }
  if (probed_all != nullptr) {
    if (calibration.sharing.capacity <= 0) {
      say(fmt::format(
          "{}: {:.2f} ms a step, as simulated with a worker's compute to itself ({:.2f} ms)",
          probed_all->what, probed_all->median(), alone_ms));
    } else {
      say(fmt::format(
          "{}: {:.2f} ms a step against {:.2f} ms with a worker's compute to itself: "
          "the workers share a machine, room for {:.2f} of them at full speed",
          probed_all->what, probed_all->median(), alone_ms, calibration.sharing.capacity));
    }
  }
  if (probed_pipeline != nullptr) {
    const double idle_push = calibration.links.point_to_point.latency_us;
    say(FittedWaitLine(
        *probed_pipeline, pipeline_at_idle_ms, calibration.links.shared_push_latency_us <= 0,
        "with the idle link",
        fmt::format("an object pushed between workers waits the idle link's latency, {:.0f} us",
                    idle_push),
        fmt::format("an object pushed between workers waits {:.0f} us for its reader when the "
                    "workers share the machine ({:.0f} us idle)",
                    calibration.links.shared_push_latency_us, idle_push)));
  }
  for (size_t i = 0; i < fitted.size(); ++i) {
    const GroupProbe& group = *fitted[i].group;
    const ProbeStep& probe = *fitted[i].probe;
    const double latency = latency_of(group);
    const char* waiter = "a collective";
    if (group.waiter == Waiter::kSequenceShard) waiter = "a reduce-scatter or all-gather";
    if (group.waiter == Waiter::kExchange) waiter = "a halo or statistics exchange";
    say(FittedWaitLine(
        probe, at_idle_ms[i], latency == idle, "with the idle link",
        fmt::format("{} of {} waits its idle latency, {:.0f} us", waiter, group.members, idle),
        fmt::format("{} of {} waits {:.0f} us for its peers when the workers share the machine "
                    "({:.0f} us idle)",
                    waiter, group.members, latency, idle)));
    if (fitted[i].staged == nullptr) continue;
    const double inside = staged_latency_of(group);
    say(FittedWaitLine(
        *fitted[i].staged, staged_at_side_ms[i], inside == latency, "with the groups' side by side",
        fmt::format("inside a pipeline {} of {} waits as its groups side by side do, {:.0f} us",
                    waiter, group.members, latency),
        fmt::format("inside a pipeline {} of {} waits {:.0f} us for its peers ({:.0f} us side "
                    "by side)",
                    waiter, group.members, inside, latency)));
  }
  if (probed_gather != nullptr) {
    const double gather = calibration.links.gather_latency.back().latency_us;
    say(FittedWaitLine(
        *probed_gather, gather_at_base_ms, gather == gather_base, "with a collective's wait",
        fmt::format("a parameter gather of {} waits as any collective of {}, {:.0f} us", n, n,
                    gather_base),
        fmt::format("a parameter gather of {} waits {:.0f} us for its peers beside the compute "
                    "when the workers share the machine ({:.0f} us otherwise)",
                    n, gather, gather_base)));
    if (gather == gather_base) calibration.links.gather_latency.clear();
  }
  return Status::Ok();
}

}  // namespace

Result<Calibration> Calibrate(const ModelSpec& model, const TrainingPlan& base,
                              const CalibrationRequest& request, const ExecutorOptions& executor,
                              const BackendFactory& make_backend,
                              const std::function<void(const std::string&)>& progress) {
  if (request.rows.empty()) {
    return InvalidArgument("calibrating: no micro-batch row counts to profile the layers at");
  }
  const auto say = [&progress](const std::string& line) {
    if (progress) progress(line);
  };
  Calibration calibration;
  LayerProfileOptions options;
  options.split_backwards = true;
  options.steps = std::max(1, request.profile_steps);
  // Every shape to profile: the whole model's at each row count, then one rank of each tensor
  // split at its row counts (split: -1 for the whole model, else its index in the request).
  struct ProfiledShape {
    const ModelSpec* model;
    int64_t rows;
    int split;
    std::vector<StepProfile> rounds;
  };
  std::vector<ModelSpec> ranks;  // one rank of each split (ModelSpec::OneRankView)
  ranks.reserve(request.tensor_splits.size());
  const auto split_label = [](const TensorSplitRows& split) {
    return split.slabs > 1 ? fmt::format("layers of one of {} slabs", split.slabs)
                           : fmt::format("layers of one of {} tensor ranks", split.tensor_parallel);
  };
  for (const TensorSplitRows& split : request.tensor_splits) {
    Result<ModelSpec> rank = split.slabs > 1
                                 ? model.PlannedFor(1, split.slabs, false, SequenceAttention::kHalo)
                                 : model.PlannedFor(split.tensor_parallel, 1);
    if (rank.ok()) rank = rank->OneRankView();
    if (!rank.ok()) return rank.status().WithContext("calibrating the " + split_label(split));
    ranks.push_back(*std::move(rank));
  }
  std::vector<ProfiledShape> shapes;
  size_t count = request.rows.size();
  for (const TensorSplitRows& split : request.tensor_splits) count += split.rows.size();
  shapes.reserve(count);
  for (int64_t rows : request.rows) shapes.push_back(ProfiledShape{&model, rows, -1, {}});
  for (size_t i = 0; i < request.tensor_splits.size(); ++i) {
    for (int64_t rows : request.tensor_splits[i].rows) {
      shapes.push_back(ProfiledShape{&ranks[i], rows, static_cast<int>(i), {}});
    }
  }
  const auto label_of = [&](const ProfiledShape& shape) {
    return shape.split < 0 ? std::string("layers")
                           : split_label(request.tensor_splits[static_cast<size_t>(shape.split)]);
  };
  // In rounds (RoundOrder), each figure the median of its rounds': what moves the machine's speed
  // for a while moves one round of a shape, not the shape, nor one shape against the next.
  const int rounds = std::max(1, request.rounds);
  for (int q = 0; q < rounds; ++q) {
    for (size_t i : RoundOrder(shapes.size(), q, rounds)) {
      ProfiledShape& shape = shapes[i];
      TrainingPlan plan = base;
      plan.batch = shape.rows;
      plan.parallel = ParallelConfig{};
      plan.memory = MemoryCaps{};
      Result<StepProfile> profile = ProfileStep(*shape.model, plan, executor, options);
      if (!profile.ok()) {
        return profile.status().WithContext(
            fmt::format("calibrating the {} at {} rows", label_of(shape), shape.rows));
      }
      shape.rounds.push_back(*std::move(profile));
    }
  }
  std::vector<double> overheads, other_rates;
  calibration.tensor_splits.resize(request.tensor_splits.size());
  for (size_t i = 0; i < request.tensor_splits.size(); ++i) {
    calibration.tensor_splits[i].tensor_parallel = request.tensor_splits[i].tensor_parallel;
    calibration.tensor_splits[i].slabs = request.tensor_splits[i].slabs;
  }
  for (const ProfiledShape& shape : shapes) {
    LayerTimesAtRows times{shape.rows, shape.rounds.front().layer_ms};
    double step_layers = 0;
    for (size_t l = 0; l < times.layer_ms.size(); ++l) {
      std::vector<double> forward, backward, weight;
      for (const StepProfile& round : shape.rounds) {
        forward.push_back(round.layer_ms[l].forward);
        backward.push_back(round.layer_ms[l].backward);
        weight.push_back(round.layer_ms[l].weight);
      }
      OpCosts& ms = times.layer_ms[l];
      // A layer too fast to time still costs something.
      ms.forward = std::max(Median(forward), 1e-3);
      ms.backward = std::max(Median(backward), 1e-3);
      ms.weight = Median(weight);
      step_layers += ms.forward + ms.backward + ms.weight;
    }
    say(fmt::format("{} at {} rows a micro-batch: {:.1f} ms forward + backward", label_of(shape),
                    shape.rows, step_layers));
    if (shape.split < 0) {
      for (const StepProfile& round : shape.rounds) {
        overheads.push_back(round.TaskOverheadMs());
        if (round.other_ms_per_unit > 0) other_rates.push_back(round.other_ms_per_unit);
      }
      calibration.layers.push_back(std::move(times));
    } else {
      calibration.tensor_splits[static_cast<size_t>(shape.split)].layers.push_back(
          std::move(times));
    }
  }
  calibration.task_overhead_ms = Median(overheads);
  if (!other_rates.empty()) {
    calibration.other_ms_per_unit = Median(other_rates);
    say(
        fmt::format("tasks of no layer (optimizer updates, gradient norms): {:.3g} ps per unit of "
                    "the op cost model's estimate",
                    calibration.other_ms_per_unit * 1e9));
  }
  if (!make_backend || request.workers.empty()) return calibration;
  if (request.workers.size() >= 2) {
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<GraphBackend> backend, make_backend());
    // A link measured in every round: each figure the median of its rounds'.
    const auto median_link = [rounds](const auto& measure) -> Result<CollectiveLink> {
      std::vector<double> latencies, bandwidths;
      for (int q = 0; q < rounds; ++q) {
        TESSERA_ASSIGN_OR_RETURN(CollectiveLink measured, measure());
        latencies.push_back(measured.latency_us);
        bandwidths.push_back(measured.bytes_per_us);
      }
      return CollectiveLink{Median(latencies), Median(bandwidths)};
    };
    TESSERA_ASSIGN_OR_RETURN(const CollectiveLink link, median_link([&] {
                               return MeasureCollectiveLink(*backend, request.workers, base.device);
                             }));
    calibration.links.collective = link;
    calibration.measured_collective = link;
    calibration.links.collective_group = static_cast<int>(request.workers.size());
    say(fmt::format("collectives among {} workers: {:.0f} us + {:.2f} GB/s (all-reduce)",
                    request.workers.size(), link.latency_us, link.bytes_per_us / 1e3));
    // The push link between the first two workers: what a pipeline's objects take.
    TESSERA_ASSIGN_OR_RETURN(calibration.links.point_to_point, median_link([&] {
                               return MeasurePushLink(*backend, request.workers[0],
                                                      request.workers[1], base.device);
                             }));
    say(fmt::format("an object pushed between two workers: {:.0f} us + {:.2f} GB/s",
                    calibration.links.point_to_point.latency_us,
                    calibration.links.point_to_point.bytes_per_us / 1e3));
  }
  TESSERA_RETURN_IF_ERROR(FitTheProbes(model, base, request, make_backend, say, calibration)
                              .WithContext("calibrating the workers' steps"));
  return calibration;
}

Result<Calibration> RefitCalibration(const ModelSpec& model, const TrainingPlan& base,
                                     const CalibrationRequest& request, Calibration recorded,
                                     const std::function<void(const std::string&)>& progress) {
  if (recorded.probe_steps.empty()) {
    return InvalidArgument("refitting a calibration that recorded no probe steps");
  }
  CalibrationRequest asked = request;
  if (asked.workers.empty()) asked.workers = recorded.probe_workers;
  if (asked.core_groups.empty()) asked.core_groups = recorded.sharing.groups;
  if (asked.workers.size() < 2) {
    return InvalidArgument("refitting: the request names {} worker(s); probes need two or more",
                           asked.workers.size());
  }
  // Back to the figures as measured where FitTheProbes reads them before fitting them (the
  // one rank's steps are simulated at the default scale and sharing, the groups' at the
  // measured link); the waits it fits it starts from scratch itself.
  const Calibration measured;
  recorded.compute_scale = measured.compute_scale;
  recorded.step_overhead_ms = measured.step_overhead_ms;
  recorded.step_overhead_per_task_ms = measured.step_overhead_per_task_ms;
  recorded.step_overhead_per_worker_ms = measured.step_overhead_per_worker_ms;
  recorded.sharing = measured.sharing;
  recorded.probes_failed = 0;
  if (recorded.measured_collective.measured()) {
    recorded.links.collective = recorded.measured_collective;
  }
  const auto say = [&progress](const std::string& line) {
    if (progress) progress(line);
  };
  TESSERA_RETURN_IF_ERROR(FitTheProbes(model, base, asked, nullptr, say, recorded)
                              .WithContext("refitting the workers' steps"));
  return recorded;
}

std::vector<CoreGroup> CoreGroupsOf(const std::vector<WorkerInfo>& cluster,
                                    const std::vector<WorkerId>& workers) {
  // Each worker's host and CPUs; then groups joined while two on one host share a CPU.
  struct Placed {
    WorkerId id;
    std::string host;
    std::set<int> cpus;
  };
  std::vector<Placed> placed;
  for (const WorkerId id : workers) {
    const auto info = std::find_if(cluster.begin(), cluster.end(),
                                   [&](const WorkerInfo& w) { return w.id == id; });
    if (info == cluster.end() || info->cpus.empty()) return {};
    Result<std::vector<int>> cpus = ParseCpuList(info->cpus);
    if (!cpus.ok()) return {};
    placed.push_back({id, info->hostname, {cpus->begin(), cpus->end()}});
  }
  std::vector<size_t> group(placed.size());
  for (size_t i = 0; i < placed.size(); ++i) group[i] = i;
  const auto root = [&](size_t i) {
    while (group[i] != i) i = group[i];
    return i;
  };
  for (size_t i = 0; i < placed.size(); ++i) {
    for (size_t j = i + 1; j < placed.size(); ++j) {
      if (placed[i].host != placed[j].host) continue;
      const bool overlap = std::any_of(placed[i].cpus.begin(), placed[i].cpus.end(),
                                       [&](int cpu) { return placed[j].cpus.count(cpu) > 0; });
      if (overlap) group[root(j)] = root(i);
    }
  }
  std::map<size_t, std::pair<CoreGroup, std::set<int>>> by_root;  // ordered: deterministic
  for (size_t i = 0; i < placed.size(); ++i) {
    auto& [core_group, cpus] = by_root[root(i)];
    core_group.workers.push_back(placed[i].id);
    cpus.insert(placed[i].cpus.begin(), placed[i].cpus.end());
  }
  if (by_root.size() < 2) return {};
  double all_cores = 0;
  for (const auto& [r, entry] : by_root) all_cores += static_cast<double>(entry.second.size());
  std::vector<CoreGroup> groups;
  for (auto& [r, entry] : by_root) {
    entry.first.share = static_cast<double>(entry.second.size()) / all_cores;
    groups.push_back(std::move(entry.first));
  }
  return groups;
}

std::vector<WorkerId> InterleaveCoreGroups(const std::vector<WorkerId>& workers,
                                           const std::vector<CoreGroup>& groups) {
  if (groups.empty()) return workers;
  std::vector<std::vector<WorkerId>> members(groups.size());
  std::vector<WorkerId> rest;  // in no group: after the interleaved ones
  for (const WorkerId worker : workers) {
    size_t g = 0;
    while (g < groups.size() && std::find(groups[g].workers.begin(), groups[g].workers.end(),
                                          worker) == groups[g].workers.end()) {
      ++g;
    }
    (g < groups.size() ? members[g] : rest).push_back(worker);
  }
  std::vector<WorkerId> interleaved;
  for (size_t i = 0; interleaved.size() + rest.size() < workers.size(); ++i) {
    for (const std::vector<WorkerId>& group : members) {
      if (i < group.size()) interleaved.push_back(group[i]);
    }
  }
  interleaved.insert(interleaved.end(), rest.begin(), rest.end());
  return interleaved;
}

std::string CalibrationKey(const ModelSpec& model, const TrainingPlan& base,
                           const CalibrationRequest& request, int threads) {
  std::string layers;
  for (const LayerSpec& layer : model.layers) {
    layers += fmt::format("{}:{}:{};", layer.name, layer.forward_op, layer.params.numel());
  }
  std::string rows;
  for (int64_t r : request.rows) rows += fmt::format("{},", r);
  std::string splits;
  for (const TensorSplitRows& split : request.tensor_splits) {
    splits += split.slabs > 1 ? fmt::format(" S{} [", split.slabs)
                              : fmt::format(" T{} [", split.tensor_parallel);
    for (int64_t r : split.rows) splits += fmt::format("{},", r);
    splits += "]";
  }
  // Workers bound to cores: how many share each group's cores (not which: ids change).
  std::string cores;
  for (const CoreGroup& group : request.core_groups) {
    cores += fmt::format("{}{}@{:.3f}", cores.empty() ? " cores " : ",", group.workers.size(),
                         group.share);
  }
  return fmt::format(
      "model {:016x} ({} layers) seq {} device {} rows [{}]{} workers {} host {} threads {}{} "
      "method {} rounds {}",
      std::hash<std::string>()(layers), model.layers.size(), base.seq_len, base.device.ToString(),
      rows, splits, request.workers.size(), HostName(), threads, cores, kCalibrationMethod,
      request.rounds);
}

std::string CalibrationPath(const std::string& cache_dir, const std::string& key) {
  return fmt::format("{}/calibration-{:016x}.json", cache_dir, std::hash<std::string>()(key));
}

std::string DefaultCacheDir(const std::string& setting) {
  if (!setting.empty()) return setting;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && xdg[0] != '\0') {
    return std::string(xdg) + "/tessera";
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && home[0] != '\0') {
    return std::string(home) + "/.cache/tessera";
  }
  return "/tmp/tessera/cache";
}

Status SaveCalibration(const std::string& path, const std::string& key,
                       const Calibration& calibration) {
  json splits = json::array();
  for (const TensorSplitTimes& split : calibration.tensor_splits) {
    splits.push_back({{"tensor_parallel", split.tensor_parallel},
                      {"slabs", split.slabs},
                      {"layers", LayersJson(split.layers)}});
  }
  json file = {
      {"key", key},
      {"layers", LayersJson(calibration.layers)},
      {"tensor_splits", splits},
      {"task_overhead_ms", calibration.task_overhead_ms},
      {"other_ms_per_unit", calibration.other_ms_per_unit},
      {"step_overhead_ms", calibration.step_overhead_ms},
      {"step_overhead_per_task_ms", calibration.step_overhead_per_task_ms},
      {"step_overhead_per_worker_ms", calibration.step_overhead_per_worker_ms},
      {"compute_scale", calibration.compute_scale},
      {"collective", LinkJson(calibration.links.collective)},
      {"measured_collective", LinkJson(calibration.measured_collective)},
      {"collective_group", calibration.links.collective_group},
      {"point_to_point", LinkJson(calibration.links.point_to_point)},
      {"shared_push_latency_us", calibration.links.shared_push_latency_us},
      {"group_latency", GroupLatencyJson(calibration.links.group_latency)},
      {"sequence_shard_latency", GroupLatencyJson(calibration.links.sequence_shard_latency)},
      {"exchange_latency", GroupLatencyJson(calibration.links.exchange_latency)},
      {"gather_latency", GroupLatencyJson(calibration.links.gather_latency)},
      {"staged_latency", StagedLatencyJson(calibration.links.staged_latency)},
      {"sharing_capacity", calibration.sharing.capacity}};
  file["core_groups"] = json::array();
  for (const CoreGroup& group : calibration.sharing.groups) {
    json workers = json::array();
    for (const WorkerId worker : group.workers) workers.push_back(worker.value());
    file["core_groups"].push_back({{"workers", workers}, {"share", group.share}});
  }
  file["probe_workers"] = json::array();
  for (const WorkerId worker : calibration.probe_workers) {
    file["probe_workers"].push_back(worker.value());
  }
  file["probe_steps"] = json::array();
  for (const Calibration::ProbeRecord& probe : calibration.probe_steps) {
    file["probe_steps"].push_back(
        {{"what", probe.what}, {"ms", probe.ms}, {"outside_ms", probe.outside_ms}});
  }
  std::error_code error;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), error);
  if (error) {
    return Unavailable("saving the calibration: cannot make the directory of {}: {}", path,
                       error.message());
  }
  return WriteFileAtomically(path, file.dump(1) + "\n").WithContext("saving the calibration");
}

Result<Calibration> LoadCalibration(const std::string& path, const std::string& key) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) {
    return NotFound("no calibration cached at {}", path);
  }
  TESSERA_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path, "calibration file"));
  try {
    const json file = json::parse(text);
    if (!key.empty() && file.at("key").get<std::string>() != key) {
      return InvalidArgument("the calibration at {} is for another setup ({}), not this one", path,
                             file.at("key").get<std::string>());
    }
    Calibration calibration;
    calibration.layers = LayersFrom(file.at("layers"));
    for (const json& split : file.at("tensor_splits")) {
      calibration.tensor_splits.push_back(TensorSplitTimes{split.at("tensor_parallel").get<int>(),
                                                           LayersFrom(split.at("layers")),
                                                           split.value("slabs", 1)});
    }
    calibration.task_overhead_ms = file.at("task_overhead_ms").get<double>();
    calibration.other_ms_per_unit = file.at("other_ms_per_unit").get<double>();
    calibration.step_overhead_ms = file.at("step_overhead_ms").get<double>();
    calibration.step_overhead_per_task_ms = file.value("step_overhead_per_task_ms", 0.0);
    calibration.step_overhead_per_worker_ms = file.value("step_overhead_per_worker_ms", 0.0);
    calibration.compute_scale = file.at("compute_scale").get<double>();
    calibration.links.collective = LinkFrom(file.at("collective"));
    calibration.links.collective_group = file.at("collective_group").get<int>();
    if (file.contains("measured_collective")) {
      calibration.measured_collective = LinkFrom(file.at("measured_collective"));
    }
    calibration.links.point_to_point = LinkFrom(file.at("point_to_point"));
    calibration.links.shared_push_latency_us = file.at("shared_push_latency_us").get<double>();
    calibration.links.group_latency = GroupLatencyFrom(file.at("group_latency"));
    calibration.links.sequence_shard_latency = GroupLatencyFrom(file.at("sequence_shard_latency"));
    calibration.links.exchange_latency = GroupLatencyFrom(file.at("exchange_latency"));
    calibration.links.gather_latency =
        GroupLatencyFrom(file.value("gather_latency", json::array()));
    calibration.links.staged_latency = StagedLatencyFrom(file.at("staged_latency"));
    calibration.sharing.capacity = file.at("sharing_capacity").get<double>();
    for (const json& group : file.value("core_groups", json::array())) {
      CoreGroup& read = calibration.sharing.groups.emplace_back();
      for (const json& worker : group.at("workers"))
        read.workers.emplace_back(worker.get<uint64_t>());
      read.share = group.at("share").get<double>();
    }
    for (const json& worker : file.value("probe_workers", json::array())) {
      calibration.probe_workers.emplace_back(worker.get<uint64_t>());
    }
    for (const json& probe : file.value("probe_steps", json::array())) {
      calibration.probe_steps.push_back({probe.at("what").get<std::string>(),
                                         probe.at("ms").get<std::vector<double>>(),
                                         probe.value("outside_ms", std::vector<double>{})});
    }
    if (calibration.layers.empty())
      return DataLoss("the calibration at {} holds no layer times", path);
    return calibration;
  } catch (const std::exception& e) {  // json's, or an unknown kind of wait
    return DataLoss("the calibration at {} cannot be read ({}); delete it to measure again", path,
                    e.what());
  }
}

}  // namespace tessera

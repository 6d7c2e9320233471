// bench_plan_search: the plan search (planner/plan_search.h) against measured runs.
//
// For each model (a GPT-2 and a 3D U-Net) on a local cluster of --workers CPU workers (one
// thread each unless --threads-per-worker), and each memory cap (--caps: fractions of the
// largest host peak any uncapped plan predicts; 0: uncapped):
//   1. calibrate on the cluster (training/plan_calibration.h: layer times at every micro-batch
//      shape, the collective link, the probe steps) and search, timing the search;
//   2. run a grid of the ranked plans (--grid of them, evenly spaced from the best to the worst,
//      so the search's choice, rank 1, is among them): each trains --warmup + --steps steps of
//      zeros at a zero learning rate (step times and memory do not depend on the values),
//      in --rounds rounds over the grids of every cap together, each in a rotated order (a
//      point's time is the median of its rounds', its peak the largest), since workers sharing
//      cores move a step's time from run to run, and a slow spell of the machine then falls on
//      every cap's points alike;
//   3. print, per plan, the predicted and measured step time (the median) and largest worker's
//      peak (all objects with the running kernels' scratch: RoleMeter's total_with_scratch_peak,
//      the memory model's figure; predicted: the simulated step's, RankedPlan::
//      expected_peak_bytes, with both orders' beside it) and the largest worker allocator's peak
//      in a step (what a worker's cap holds: RoleMeter counts an in-place update the executor
//      had to copy once, the allocator twice), and per model and cap: the search's
//      choice measured against the best and the median grid point, and how many grid points the
//      prediction was within 10% (time) and 3% (peak) of.
// --out DIR writes every grid point as a TSV line (plan_search.tsv) for bench/results, and each
// model's calibration with the probe steps it measured (calibration_<model>.json).
// --replay DIR runs nothing: each model's recorded calibration is fitted again on its recorded
// probe steps (RefitCalibration) with the simulation as built, the search run under each cap
// recorded, and every recorded grid point's new prediction (step time and peak) set against its
// recorded measurement: a change to the simulation judged on runs already made, the machine's
// noise held fixed.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "bench/bench_util.h"
#include "client/cluster.h"
#include "client/graph_backend.h"
#include "core/collective_task.h"
#include "core/version.h"
#include "model/gpt2.h"
#include "model/unet3d.h"
#include "ops/standard_ops.h"
#include "planner/memory_model.h"
#include "planner/plan_search.h"
#include "training/plan_calibration.h"
#include "training/trainer.h"

namespace {

constexpr const char* kProgram = "bench_plan_search";
template <typename T>
T Check(tessera::Result<T> result, const std::string& what) {
  return tessera::bench::Check(kProgram, std::move(result), what);
}
using tessera::bench::Median;

struct Flags {
  std::vector<std::string> models = {"gpt2", "unet3d"};
  int workers = 4;
  int threads_per_worker = 1;
  bool bind_cores = false;  // each worker on cores of its own (LocalClusterOptions::bind_cores)
  std::vector<double> caps = {0, 0.6};
  int grid = 10;
  int steps = 5, warmup = 2;
  int rounds = 1;              // rounds over the grid (--rounds)
  int calibration_rounds = 3;  // CalibrationRequest::rounds
  // GPT-2: blocks, width, heads, sequence length, batch; U-Net: preset and batch.
  int64_t layers = 4, channels = 128, heads = 4, seq_len = 64, gpt2_batch = 16;
  std::string unet_preset = "tiny";
  int64_t unet_batch = 8;
  std::string out;
  // Named plans instead of the grid (PlanChoice::Name: "D4 x P1 M4 ZeRO-3"), each run wherever
  // it ranks.
  std::vector<std::string> plans;
  // Per worker, each role's predicted peak (the executor's order) beside the measured one.
  bool explain = false;
  // Per worker of each run, where the step's time went as simulated and as measured.
  bool explain_time = false;
  // With it, every task of each worker, simulated and measured (--explain-tasks).
  bool explain_tasks = false;
  // Each round calibrated again (one round of every measurement) before its points, and each
  // point also predicted with its round's calibration (--calibrate-each-round).
  bool calibrate_each_round = false;
  std::string replay;  // a directory an earlier --out wrote
  // With --replay: other such directories whose probe steps' rounds join the replayed ones.
  std::vector<std::string> pool_probes;
  // Calibrate again after the grid's rounds and also predict each point on both calibrations'
  // probe rounds pooled.
  bool calibrate_after = false;
};

struct Model {
  std::string name;
  tessera::ModelSpec spec;
  tessera::TrainingPlan base;
};

Model MakeModel(const Flags& f, const std::string& name) {
  Model model{name, {}, {}};
  if (name == "gpt2") {
    model.spec = Check(
        tessera::BuildGpt2(tessera::Gpt2Config{f.layers, f.channels, f.heads, 256, f.seq_len}),
        "GPT-2");
    model.base.batch = f.gpt2_batch;
    model.base.seq_len = f.seq_len;
    return model;
  }
  tessera::OpRegistry registry;
  if (tessera::Status s = tessera::RegisterStandardOps(registry); !s.ok()) {
    tessera::bench::Die(kProgram, s, "ops");
  }
  const tessera::UNet3dConfig config =
      Check(tessera::UNet3dConfig::Preset(f.unet_preset), "--unet-preset");
  model.spec = Check(tessera::BuildUNet3d(config, registry), "U-Net");
  model.base.batch = f.unet_batch;
  model.base.seq_len = 1;
  return model;
}

struct Measured {
  double step_ms = 0;
  int64_t peak_bytes = 0;            // the largest worker's, with kernel scratch
  int64_t allocator_peak_bytes = 0;  // the largest worker allocator's in a step
  double round_predicted_ms = 0;     // simulated on the round's calibration (0: none)
};

double Mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// Issue 26's bounds on a grid point: its predicted step time within 10% of its measured median,
// its predicted peak within 3% of the measured one.
constexpr double kTimeBound = 0.10;
constexpr double kPeakBound = 0.03;
bool WithinTime(double err) { return std::abs(err) <= kTimeBound; }
bool WithinPeak(double err) { return std::abs(err) <= kPeakBound; }
// A predicted peak's error against a measured one (a measured 0 taken as a byte).
double PeakError(int64_t predicted, int64_t measured) {
  return static_cast<double>(predicted) / static_cast<double>(std::max<int64_t>(measured, 1)) - 1;
}

// Per worker of `trainer`'s step: each role's peak and the total with scratch, predicted in the
// executor's untimed order (planner/memory_model.h) and measured in `report`'s step; then, for
// the worker measured furthest above that prediction, its tasks and the objects pushed to it, in
// the order the step's timeline saw them (what arrived while what ran).
void ExplainPeaks(tessera::Trainer& trainer, const tessera::StepReport& report,
                  const std::string& what) {
  const tessera::Graph& graph = trainer.step_graph().graph;
  const tessera::MemoryProfile predicted = Check(tessera::PredictMemory(graph), what);
  std::printf("  %s: per worker, predicted (untimed order) / measured MiB\n", what.c_str());
  const tessera::WorkerMemory* furthest = nullptr;
  int64_t furthest_gap = 0;
  for (const tessera::RankFigures& rank : report.ranks) {
    const auto memory = std::find_if(
        predicted.workers.begin(), predicted.workers.end(),
        [&rank](const tessera::WorkerMemory& m) { return m.order.worker == rank.worker; });
    if (memory == predicted.workers.end()) continue;
    std::string line = fmt::format("  rank {} (worker {}): total {:.3f} / {:.3f}", rank.rank,
                                   rank.worker.value(), Mib(memory->total_with_scratch_peak),
                                   Mib(rank.figures.total_with_scratch_peak));
    for (size_t role = 0; role < tessera::kObjectRoles; ++role) {
      const auto r = static_cast<tessera::ObjectRole>(role);
      if (memory->role_peaks[role] == 0 && rank.figures.peak(r) == 0) continue;
      line += fmt::format(", {} {:.3f} / {:.3f}", tessera::ObjectRoleName(r),
                          Mib(memory->role_peaks[role]), Mib(rank.figures.peak(r)));
    }
    std::printf("%s\n", line.c_str());
    const int64_t gap = rank.figures.total_with_scratch_peak - memory->total_with_scratch_peak;
    if (gap > furthest_gap) {
      furthest_gap = gap;
      furthest = &*memory;
    }
  }
  if (furthest == nullptr) return;
  const tessera::Result<tessera::Timeline> timeline = trainer.StepTimeline(1);
  if (!timeline.ok()) return;
  const tessera::WorkerId worker = furthest->order.worker;
  const std::string to_it = fmt::format(" to worker{}", worker.value());
  std::vector<std::pair<int64_t, std::string>> events;  // microseconds, what
  for (const tessera::TimelineSpan& span : timeline->spans) {
    if (span.worker == worker && span.stream >= 0) {
      events.emplace_back(span.start_us,
                          fmt::format("runs {} ({} us)", span.name, span.end_us - span.start_us));
    } else if (span.stream == tessera::kTransferStream && span.name.ends_with(to_it)) {
      events.emplace_back(span.end_us,
                          "receives " + span.name.substr(5, span.name.size() - 5 - to_it.size()));
    }
  }
  if (events.empty()) return;
  std::sort(events.begin(), events.end());
  std::printf("  worker %llu, %.3f MiB over its untimed prediction: its step as measured (us)\n",
              static_cast<unsigned long long>(worker.value()), Mib(furthest_gap));
  for (const auto& [us, event] : events) {
    std::printf("    %8lld %s\n", static_cast<long long>(us - events.front().first), event.c_str());
  }
}

// The simulated step of a trainer's step graph (SimulatePlannedStep on the calibrated costs), with
// the model its trainer planned (the whole model, or one rank's of a tensor or slab split).
using Simulate = std::function<tessera::Result<tessera::SimulatedStep>(const tessera::StepGraph&,
                                                                       const tessera::ModelSpec&)>;

// A push's span ("push <object> to worker <id>"): the object's name and the receiving worker;
// nullopt for any other span.
std::optional<std::pair<std::string, uint64_t>> PushOf(const tessera::TimelineSpan& span) {
  if (span.stream != tessera::kTransferStream || !span.name.starts_with("push ")) {
    return std::nullopt;
  }
  const size_t to = span.name.rfind(" to worker");
  if (to == std::string::npos) return std::nullopt;
  return std::pair{span.name.substr(5, to - 5), std::stoull(span.name.substr(to + 10))};
}

// The step's collectives by op, members and size: how many, and per collective, simulated /
// measured, its members' arrival spread (the last start after the first) and its time once all
// are there (the last start to the members' median end).
void ExplainCollectives(const tessera::Graph& graph, const tessera::SimulatedStep& simulated,
                        const std::map<std::string, const tessera::TimelineSpan*>& spans) {
  std::map<int64_t, std::vector<size_t>> collectives;  // id -> its members' tasks
  for (size_t t = 0; t < graph.tasks().size(); ++t) {
    const tessera::Result<std::optional<tessera::CollectiveMembership>> member =
        tessera::CollectiveOf(graph.tasks()[t]);
    if (!member.ok()) continue;
    if (const std::optional<tessera::CollectiveMembership>& membership = *member) {
      collectives[membership->collective].push_back(t);
    }
  }
  struct Sums {
    int count = 0, measured = 0;
    double simulated_spread = 0, simulated_after = 0, measured_spread = 0, measured_after = 0;
  };
  std::map<std::tuple<std::string, size_t, int64_t>, Sums> by_kind;  // (op, members, bytes)
  const auto spread_and_after = [](const std::vector<double>& starts, std::vector<double> ends) {
    const auto [first, last] = std::minmax_element(starts.begin(), starts.end());
    std::nth_element(ends.begin(), ends.begin() + static_cast<std::ptrdiff_t>(ends.size() / 2),
                     ends.end());
    return std::pair{*last - *first, ends[ends.size() / 2] - *last};
  };
  for (const auto& [id, members] : collectives) {
    const tessera::TaskSpec& first = graph.tasks()[members.front()];
    int64_t bytes = 0;
    if (!first.inputs.empty()) bytes = graph.object(first.inputs.front()).meta.bytes();
    Sums& sums = by_kind[{first.op, members.size(), bytes}];
    ++sums.count;
    std::vector<double> sim_starts, sim_ends, starts, ends;
    for (size_t t : members) {
      sim_starts.push_back(simulated.start_ms[t]);
      sim_ends.push_back(simulated.end_ms[t]);
      const auto found = spans.find(graph.tasks()[t].name);
      if (found == spans.end()) continue;
      starts.push_back(static_cast<double>(found->second->start_us) / 1e3);
      ends.push_back(static_cast<double>(found->second->end_us) / 1e3);
    }
    const auto [sim_spread, sim_after] = spread_and_after(sim_starts, sim_ends);
    sums.simulated_spread += sim_spread;
    sums.simulated_after += sim_after;
    if (starts.size() != members.size()) continue;
    const auto [spread, after] = spread_and_after(starts, ends);
    ++sums.measured;
    sums.measured_spread += spread;
    sums.measured_after += after;
  }
  for (const auto& [kind, sums] : by_kind) {
    const auto& [op, members, bytes] = kind;
    const double measured = std::max(1, sums.measured);
    std::printf(
        "  %d x %s of %zu, %.1f KiB: per collective, arrival spread %.3f / %.3f ms, once all "
        "there %.3f / %.3f ms\n",
        sums.count, op.c_str(), members, static_cast<double>(bytes) / 1024,
        sums.simulated_spread / sums.count, sums.measured_spread / measured,
        sums.simulated_after / sums.count, sums.measured_after / measured);
  }
}

// The step's pushes between workers, measured: how many and how large, and on average the time
// from the producer's end to the push's start, the push itself, and from its end to the first
// task on the receiving worker that reads it (the link's latency + bytes / bandwidth is what the
// simulation charges for the three together).
void ExplainPushes(const tessera::Graph& graph, const tessera::Timeline& timeline,
                   const std::map<std::string, const tessera::TimelineSpan*>& spans) {
  std::map<std::string, const tessera::ObjectSpec*> objects;
  for (const tessera::ObjectSpec& object : graph.objects()) objects[object.name] = &object;
  int count = 0;
  double bytes = 0, before = 0, during = 0, after = 0;
  for (const tessera::TimelineSpan& span : timeline.spans) {
    const auto push = PushOf(span);
    if (!push) continue;
    const auto& [name, worker] = *push;
    const auto object = objects.find(name);
    if (object == objects.end() || !object->second->producer.valid()) continue;
    const auto made = spans.find(graph.task(object->second->producer).name);
    if (made == spans.end()) continue;
    int64_t read = std::numeric_limits<int64_t>::max();
    for (const tessera::TaskSpec& task : graph.tasks()) {
      if (task.pinned_worker.value() != worker) continue;
      if (std::find(task.inputs.begin(), task.inputs.end(), object->second->id) ==
          task.inputs.end()) {
        continue;
      }
      if (const auto reader = spans.find(task.name); reader != spans.end()) {
        read = std::min(read, reader->second->start_us);
      }
    }
    if (read == std::numeric_limits<int64_t>::max()) continue;
    ++count;
    bytes += static_cast<double>(object->second->meta.bytes());
    before += static_cast<double>(span.start_us - made->second->end_us) / 1e3;
    during += static_cast<double>(span.end_us - span.start_us) / 1e3;
    after += static_cast<double>(read - span.end_us) / 1e3;
  }
  if (count == 0) return;
  std::printf(
      "  %d pushes of %.1f KiB on average: producer's end to the push %.3f ms, the push %.3f ms, "
      "its end to the reader's start %.3f ms\n",
      count, bytes / count / 1024, before / count, during / count, after / count);
}

// Per worker of `trainer`'s last step: its compute tasks' time by kind and when its last task
// ended (from the step's first start), as simulated and as measured in its timeline; its idle
// time; the step's collectives and pushes; then the tasks whose measured time is furthest above
// their simulated time.
void ExplainTime(tessera::Trainer& trainer, const Simulate& simulate, const std::string& what,
                 double last_step_ms, bool every_task) {
  const tessera::StepGraph& step = trainer.step_graph();
  const tessera::Graph& graph = step.graph;
  const tessera::SimulatedStep simulated = Check(simulate(step, trainer.planned_model()), what);
  const tessera::Result<tessera::Timeline> timeline = trainer.StepTimeline(1);
  if (!timeline.ok()) {
    std::printf("  %s: no timeline (%s)\n", what.c_str(), timeline.status().ToString().c_str());
    return;
  }
  std::map<std::string, const tessera::TimelineSpan*> spans;
  int64_t first_us = std::numeric_limits<int64_t>::max();
  for (const tessera::TimelineSpan& span : timeline->spans) {
    if (span.stream == tessera::kTransferStream) continue;
    spans[span.name] = &span;
    first_us = std::min(first_us, span.start_us);
  }
  struct PerWorker {
    std::array<double, tessera::kSpanKinds> simulated_ms{}, measured_ms{};
    double simulated_end = 0, measured_end = 0;
    double simulated_start = std::numeric_limits<double>::infinity();
    double measured_start = std::numeric_limits<double>::infinity();
    int tasks = 0;
  };
  std::map<uint64_t, PerWorker> workers;
  std::vector<std::pair<double, std::string>> slower;  // measured - simulated ms, task
  for (size_t t = 0; t < graph.tasks().size(); ++t) {
    const tessera::TaskSpec& task = graph.tasks()[t];
    PerWorker& w = workers[task.pinned_worker.value()];
    const auto kind = static_cast<size_t>(tessera::ClassifyTask(task.name, task.op));
    const double sim_ms = simulated.end_ms[t] - simulated.start_ms[t];
    w.simulated_ms[kind] += sim_ms;
    w.simulated_end = std::max(w.simulated_end, simulated.end_ms[t]);
    w.simulated_start = std::min(w.simulated_start, simulated.start_ms[t]);
    ++w.tasks;
    const auto found = spans.find(task.name);
    if (found == spans.end()) continue;
    const double meas_ms =
        static_cast<double>(found->second->end_us - found->second->start_us) / 1e3;
    w.measured_ms[kind] += meas_ms;
    w.measured_end =
        std::max(w.measured_end, static_cast<double>(found->second->end_us - first_us) / 1e3);
    w.measured_start =
        std::min(w.measured_start, static_cast<double>(found->second->start_us - first_us) / 1e3);
    slower.emplace_back(meas_ms - sim_ms,
                        fmt::format("{} on worker {}: {:.2f} ms simulated, {:.2f} measured",
                                    task.name, task.pinned_worker.value(), sim_ms, meas_ms));
  }
  const double tasks_ms = tessera::TaskSpanMs(*timeline);
  std::printf(
      "  %s: simulated %.2f ms; per worker, simulated / measured ms (this step %.2f ms, its "
      "tasks' first start to last end %.2f: %.2f outside them)\n",
      what.c_str(), simulated.step_ms, last_step_ms, tasks_ms, last_step_ms - tasks_ms);
  for (const auto& [worker, w] : workers) {
    std::string line =
        fmt::format("  worker {} ({} tasks): starts {:.2f} / {:.2f}, ends {:.2f} / {:.2f}", worker,
                    w.tasks, w.simulated_start, w.measured_start, w.simulated_end, w.measured_end);
    double sim_busy = 0, meas_busy = 0;
    for (size_t k = 0; k < tessera::kSpanKinds; ++k) {
      if (w.simulated_ms[k] == 0 && w.measured_ms[k] == 0) continue;
      line += fmt::format(", {} {:.2f} / {:.2f}",
                          tessera::SpanKindName(static_cast<tessera::SpanKind>(k)),
                          w.simulated_ms[k], w.measured_ms[k]);
      sim_busy += w.simulated_ms[k];
      meas_busy += w.measured_ms[k];
    }
    std::printf("%s; busy %.2f / %.2f\n", line.c_str(), sim_busy, meas_busy);
  }
  // Per worker, its measured idle time before each compute task: waiting for an input (its
  // producer's end here, or its push's end from another worker) or started after its inputs were
  // there (the worker's dispatch and wake-up, a machine's cores busy with others).
  std::map<std::pair<std::string, uint64_t>, int64_t> arrived;  // (object, worker) -> end
  for (const tessera::TimelineSpan& span : timeline->spans) {
    if (const auto push = PushOf(span)) arrived[*push] = span.end_us;
  }
  std::map<uint64_t, std::vector<size_t>> compute_tasks;  // worker -> its matched compute tasks
  for (size_t t = 0; t < graph.tasks().size(); ++t) {
    const tessera::TaskSpec& task = graph.tasks()[t];
    const auto found = spans.find(task.name);
    if (found == spans.end() || found->second->stream < 0) continue;
    compute_tasks[task.pinned_worker.value()].push_back(t);
  }
  for (auto& [worker, tasks] : compute_tasks) {
    std::sort(tasks.begin(), tasks.end(), [&](size_t a, size_t b) {
      return spans.at(graph.tasks()[a].name)->start_us < spans.at(graph.tasks()[b].name)->start_us;
    });
    int64_t previous_end = first_us;
    double input_wait = 0, late_start = 0;
    for (size_t t : tasks) {
      const tessera::TaskSpec& task = graph.tasks()[t];
      int64_t ready = first_us;
      for (tessera::ObjectId input : task.inputs) {
        const tessera::ObjectSpec& object = graph.object(input);
        if (!object.producer.valid()) continue;
        const tessera::TaskSpec& producer = graph.task(object.producer);
        const auto pushed = arrived.find({object.name, worker});
        const auto made = spans.find(producer.name);
        if (producer.pinned_worker.value() != worker && pushed != arrived.end()) {
          ready = std::max(ready, pushed->second);
        } else if (made != spans.end()) {
          ready = std::max(ready, made->second->end_us);
        }
      }
      const int64_t start = spans.at(task.name)->start_us;
      input_wait += static_cast<double>(std::max<int64_t>(0, ready - previous_end)) / 1e3;
      late_start +=
          static_cast<double>(std::max<int64_t>(0, start - std::max(ready, previous_end))) / 1e3;
      previous_end = std::max(previous_end, spans.at(task.name)->end_us);
    }
    const tessera::SimulatedWorker* sim = nullptr;
    for (const tessera::SimulatedWorker& w : simulated.workers) {
      if (w.worker.value() == worker) sim = &w;
    }
    std::printf(
        "  worker %llu idle: waiting for inputs %.2f ms, started after its inputs %.2f ms "
        "(simulated: bubble %.2f, communication %.2f)\n",
        static_cast<unsigned long long>(worker), input_wait, late_start,
        sim != nullptr ? sim->bubble_ms : 0.0, sim != nullptr ? sim->communication_ms : 0.0);
  }
  ExplainCollectives(graph, simulated, spans);
  ExplainPushes(graph, *timeline, spans);
  std::sort(slower.rbegin(), slower.rend());
  for (size_t i = 0; i < std::min<size_t>(slower.size(), 6); ++i) {
    std::printf("    %s\n", slower[i].second.c_str());
  }
  if (!every_task) return;
  // (worker, measured start, task): each worker's tasks in the order they started.
  std::vector<std::tuple<uint64_t, double, size_t>> order;
  for (size_t t = 0; t < graph.tasks().size(); ++t) {
    const auto found = spans.find(graph.tasks()[t].name);
    if (found == spans.end()) continue;
    order.emplace_back(graph.tasks()[t].pinned_worker.value(),
                       static_cast<double>(found->second->start_us - first_us) / 1e3, t);
  }
  std::sort(order.begin(), order.end());
  for (const auto& [worker, start, t] : order) {
    const tessera::TimelineSpan& span = *spans.at(graph.tasks()[t].name);
    std::printf("      worker %llu %-48s simulated %8.2f-%8.2f  measured %8.2f-%8.2f ms\n",
                static_cast<unsigned long long>(worker), graph.tasks()[t].name.c_str(),
                simulated.start_ms[t], simulated.end_ms[t], start,
                static_cast<double>(span.end_us - first_us) / 1e3);
  }
}

Measured RunPlan(const Flags& f, tessera::Cluster& cluster, const Model& model,
                 const tessera::TrainingPlan& plan, const std::string& what,
                 const Simulate& simulate) {
  auto backend =
      Check(tessera::MakeClusterBackend(cluster, tessera::ClusterPlacement::kScheduler), what);
  auto trainer = Check(tessera::Trainer::Create(model.spec, plan, std::move(backend)), what);
  std::vector<tessera::Tensor> batch;
  batch.reserve(model.spec.inputs.size());
  for (const tessera::ModelInput& input : model.spec.inputs) {
    batch.push_back(Check(tessera::Tensor::Zeros(input.Meta(plan.batch, plan.seq_len),
                                                 tessera::SharedHostAllocator()),
                          what));
  }
  std::vector<double> ms;
  Measured measured;
  tessera::StepReport last;
  for (int step = 0; step < f.warmup + f.steps; ++step) {
    tessera::StepReport report = Check(trainer->Step(batch, 0.0f), what);
    if (step < f.warmup) continue;
    ms.push_back(report.step_ms);
    for (const tessera::RankFigures& rank : report.ranks) {
      measured.peak_bytes = std::max(measured.peak_bytes, rank.figures.total_with_scratch_peak);
      measured.allocator_peak_bytes =
          std::max(measured.allocator_peak_bytes, rank.figures.allocator_peak);
    }
    last = std::move(report);
  }
  measured.step_ms = Median(ms);
  if (f.calibrate_each_round) {
    measured.round_predicted_ms =
        Check(simulate(trainer->step_graph(), trainer->planned_model()), what).step_ms;
  }
  if (f.explain) {
    std::string steps;
    for (double one : ms) steps += fmt::format(" {:.2f}", one);
    std::printf("  %s: steps (ms):%s\n", what.c_str(), steps.c_str());
    ExplainPeaks(*trainer, last, what);
  }
  if (f.explain_time) ExplainTime(*trainer, simulate, what, last.step_ms, f.explain_tasks);
  return measured;
}

// The search space of --workers local workers, and the calibration request for its candidates
// (workers and rounds left to the caller).
tessera::SearchSpace SpaceOf(const Flags& f) {
  tessera::SearchSpace space;
  space.workers = f.workers;
  space.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return space;
}
tessera::CalibrationRequest RequestFor(const Model& model, const tessera::SearchSpace& space) {
  tessera::CalibrationRequest request;
  request.rows = tessera::CandidateRows(model.spec, model.base, space);
  request.tensor_splits = tessera::CandidateTensorSplitRows(model.spec, model.base, space);
  return request;
}

// The standard ops, which every plan here runs.
tessera::OpRegistry StandardRegistry() {
  tessera::OpRegistry registry;
  if (tessera::Status s = tessera::RegisterStandardOps(registry); !s.ok()) {
    tessera::bench::Die(kProgram, s, "ops");
  }
  return registry;
}

// The largest host peak an uncapped plan predicts: the caps are fractions of it.
int64_t LargestUncappedPeak(const Model& model, const tessera::SearchSpace& space,
                            const tessera::Calibration& calibration,
                            const tessera::OpRegistry& registry) {
  const tessera::PlanSearchResult uncapped =
      Check(tessera::PlanSearch(model.spec, model.base, space, calibration, registry), "search");
  int64_t largest = 0;
  for (const tessera::RankedPlan& r : uncapped.ranked) largest = std::max(largest, r.peak_bytes[1]);
  return largest;
}

// The plan of that name among a search's ranked ones; null when the search did not rank it.
const tessera::RankedPlan* RankedNamed(const tessera::PlanSearchResult& search,
                                       const std::string& name) {
  const auto found =
      std::find_if(search.ranked.begin(), search.ranked.end(),
                   [&](const tessera::RankedPlan& r) { return r.choice.Name() == name; });
  return found == search.ranked.end() ? nullptr : &*found;
}

// With --out, a model's calibration as calibration_<model><suffix>.json (what --replay reads).
void SaveRecordedCalibration(const Flags& f, const std::string& name, const std::string& suffix,
                             const tessera::Calibration& calibration) {
  if (f.out.empty()) return;
  const std::string path = fmt::format("{}/calibration_{}{}.json", f.out, name, suffix);
  if (tessera::Status s = tessera::SaveCalibration(path, "", calibration); !s.ok()) {
    tessera::bench::Die(kProgram, s, "saving " + path);
  }
}

// Joins `from`'s probe rounds to `into`'s (the same probes, in the same order, else dies naming
// `what`): a fit on both calibrations' measurements.
void PoolProbeRounds(tessera::Calibration& into, const tessera::Calibration& from,
                     const std::string& what) {
  bool same = from.probe_steps.size() == into.probe_steps.size();
  for (size_t i = 0; same && i < from.probe_steps.size(); ++i) {
    same = from.probe_steps[i].what == into.probe_steps[i].what;
  }
  if (!same) {
    tessera::bench::Die(kProgram, tessera::InvalidArgument("{} recorded other probes", what),
                        "pooling probe rounds");
  }
  for (size_t i = 0; i < from.probe_steps.size(); ++i) {
    tessera::Calibration::ProbeRecord& probe = into.probe_steps[i];
    const tessera::Calibration::ProbeRecord& more = from.probe_steps[i];
    // What the steps took outside their tasks, where both recorded it for every round.
    if (probe.outside_ms.size() == probe.ms.size() && more.outside_ms.size() == more.ms.size()) {
      probe.outside_ms.insert(probe.outside_ms.end(), more.outside_ms.begin(),
                              more.outside_ms.end());
    } else {
      probe.outside_ms.clear();
    }
    probe.ms.insert(probe.ms.end(), more.ms.begin(), more.ms.end());
  }
}

void RunModel(const Flags& f, const std::string& name, std::ofstream* tsv) {
  const Model model = MakeModel(f, name);
  tessera::LocalClusterOptions options;
  options.cpu_workers = f.workers;
  options.threads_per_worker = f.threads_per_worker;
  options.bind_cores = f.bind_cores;
  auto cluster = Check(tessera::Cluster::StartLocal(options), "cluster");
  std::vector<tessera::WorkerId> workers;
  {
    auto backend = Check(
        tessera::MakeClusterBackend(*cluster, tessera::ClusterPlacement::kScheduler), "backend");
    workers = backend->workers();
    workers.resize(static_cast<size_t>(f.workers));
  }
  const tessera::SearchSpace space = SpaceOf(f);
  tessera::CalibrationRequest request = RequestFor(model, space);
  {
    // Bound to cores: neighbouring ranks on different cores, whatever order the workers joined.
    const auto info = Check(cluster->Info(), "the cluster's workers");
    workers = tessera::InterleaveCoreGroups(workers, tessera::CoreGroupsOf(info.workers, workers));
    request.core_groups = tessera::CoreGroupsOf(info.workers, workers);
  }
  request.workers = workers;
  request.rounds = f.calibration_rounds;
  tessera::ExecutorOptions executor;
  executor.threads = f.threads_per_worker;
  const auto calibrate = [&](const tessera::CalibrationRequest& asked, const std::string& label) {
    return Check(tessera::Calibrate(
                     model.spec, model.base, asked, executor,
                     [&cluster] {
                       return tessera::MakeClusterBackend(*cluster,
                                                          tessera::ClusterPlacement::kScheduler);
                     },
                     [&](const std::string& line) {
                       std::printf("# %s %s: %s\n", name.c_str(), label.c_str(), line.c_str());
                     }),
                 "calibration");
  };
  const auto started = std::chrono::steady_clock::now();
  const tessera::Calibration calibration = calibrate(request, "calibration");
  const double calibrate_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  SaveRecordedCalibration(f, name, "", calibration);
  const tessera::OpRegistry registry = StandardRegistry();
  const int64_t largest = LargestUncappedPeak(model, space, calibration, registry);
  std::printf("# %s: %zu layers, batch %lld, %d workers x %d thread(s); calibrated in %.1f s\n",
              name.c_str(), model.spec.layers.size(), static_cast<long long>(model.base.batch),
              f.workers, f.threads_per_worker, calibrate_s);
  // Every cap's search and grid points first; then every point of every cap run in each of
  // --rounds rounds, round q starting at the q-th point (so no point always runs first or after
  // the same one, and a slow spell of the machine falls on points of every cap): a point's time
  // the median of its rounds' medians, its peak the largest.
  struct Capped {
    double cap = 0;
    tessera::TrainingPlan base;
    tessera::PlanSearchResult search;
    std::vector<size_t> picks;           // ranks (0-based) of the grid points
    std::vector<std::string> unmatched;  // --plans names no ranked plan of the search has
  };
  std::vector<Capped> capped;
  struct Point {
    size_t capped = 0, pick = 0;
  };
  std::vector<Point> points;
  for (double cap : f.caps) {
    Capped& c = capped.emplace_back();
    c.cap = cap;
    c.base = model.base;
    c.base.memory.host_bytes = static_cast<int64_t>(cap * static_cast<double>(largest));
    c.search =
        Check(tessera::PlanSearch(model.spec, c.base, space, calibration, registry), "search");
    const size_t n = c.search.ranked.size();
    const size_t grid = std::min<size_t>(static_cast<size_t>(f.grid), n);
    for (size_t i = 0; i < grid && f.plans.empty(); ++i) {
      const size_t at = grid == 1 ? 0 : (i * (n - 1) + (grid - 1) / 2) / (grid - 1);
      if (c.picks.empty() || c.picks.back() != at) c.picks.push_back(at);
    }
    std::set<std::string> matched;
    for (size_t at = 0; at < n; ++at) {
      const std::string plan_name = c.search.ranked[at].choice.Name();
      if (std::find(f.plans.begin(), f.plans.end(), plan_name) != f.plans.end()) {
        c.picks.push_back(at);
        matched.insert(plan_name);
      }
    }
    for (const std::string& wanted : f.plans) {
      if (!matched.contains(wanted)) c.unmatched.push_back(wanted);
    }
    for (size_t i = 0; i < c.picks.size(); ++i) points.push_back({capped.size() - 1, i});
  }
  std::vector<std::vector<Measured>> rounds(points.size());
  for (int q = 0; q < f.rounds; ++q) {
    // The round's own calibration: what the machine is like while the round's points run.
    tessera::Calibration round_calibration = calibration;
    if (f.calibrate_each_round) {
      tessera::CalibrationRequest once = request;
      once.rounds = 1;
      round_calibration = calibrate(once, fmt::format("round {} calibration", q + 1));
    }
    for (size_t i = 0; i < points.size(); ++i) {
      const size_t p = (i + static_cast<size_t>(q)) % points.size();
      const Capped& c = capped[points[p].capped];
      const tessera::RankedPlan& r = c.search.ranked[c.picks[points[p].pick]];
      tessera::TrainingPlan plan = c.base;
      plan.parallel = r.parallel;
      plan.parallel.workers.assign(workers.begin(), workers.begin() + r.choice.workers());
      const Simulate simulate = [&](const tessera::StepGraph& step,
                                    const tessera::ModelSpec& planned) {
        return tessera::SimulatePlannedStep(
            step, planned, plan.memory, f.calibrate_each_round ? round_calibration : calibration,
            registry);
      };
      rounds[p].push_back(RunPlan(f, *cluster, model, plan, r.choice.Name(), simulate));
    }
  }
  // The probe rounds of a second calibration, after the grid, pooled with the first's: the
  // machine as it was over the whole grid, each point predicted on it too.
  std::vector<tessera::PlanSearchResult> pooled_searches;
  if (f.calibrate_after) {
    const tessera::Calibration after = calibrate(request, "calibration after the grid");
    SaveRecordedCalibration(f, name, "_after", after);
    tessera::Calibration pooled = calibration;
    PoolProbeRounds(pooled, after, "the calibration after the grid");
    const tessera::Calibration refit =
        Check(tessera::RefitCalibration(model.spec, model.base, request, std::move(pooled),
                                        [&](const std::string& line) {
                                          std::printf("# %s pooled calibrations: %s\n",
                                                      name.c_str(), line.c_str());
                                        }),
              "refitting the pooled calibrations");
    for (const Capped& c : capped) {
      pooled_searches.push_back(
          Check(tessera::PlanSearch(model.spec, c.base, space, refit, registry), "search"));
    }
  }
  size_t first_point = 0;
  for (const Capped& c : capped) {
    const double cap = c.cap;
    const tessera::PlanSearchResult& search = c.search;
    std::printf("\n## %s, host cap %s: %d plans, %zu fit, %zu refused; searched in %.0f ms\n",
                name.c_str(),
                cap > 0 ? fmt::format("{:.2f} MiB ({:.0f}% of the largest peak)",
                                      Mib(c.base.memory.host_bytes), 100 * cap)
                              .c_str()
                        : "none",
                search.considered, search.ranked.size(), search.refused.size(), search.search_ms);
    if (!c.unmatched.empty()) {
      std::printf(
          "--plans names no plan this search ranked (refused under the cap, or not a name it "
          "gives: `tessera plan --top N` lists them): %s\n",
          fmt::format("{}", fmt::join(c.unmatched, ", ")).c_str());
    }
    if (c.picks.empty()) continue;
    std::printf("%-4s %-44s %10s %10s %7s %10s %10s %7s  %s%s\n", "rank", "plan", "pred_ms",
                "meas_ms", "err", "pred_MiB", "meas_MiB", "err", "bottleneck",
                f.calibrate_each_round ? "; then each round's calibration's prediction" : "");
    std::vector<double> measured_ms;
    double auto_ms = 0;
    // Points whose every round's time is within 10% of their median: how far the machine lets
    // one run's measurement be trusted, next to the predictions' count.
    int time_within = 0, peak_within = 0, round_within = 0, steady = 0, pooled_within = 0;
    const tessera::PlanSearchResult* pooled =
        pooled_searches.empty() ? nullptr
                                : &pooled_searches[static_cast<size_t>(&c - capped.data())];
    for (size_t i = 0; i < c.picks.size(); ++i) {
      const size_t at = c.picks[i];
      const tessera::RankedPlan& r = search.ranked[at];
      Measured m;
      std::vector<double> times, round_predictions;
      for (const Measured& round : rounds[first_point + i]) {
        times.push_back(round.step_ms);
        round_predictions.push_back(round.round_predicted_ms);
        m.peak_bytes = std::max(m.peak_bytes, round.peak_bytes);
        m.allocator_peak_bytes = std::max(m.allocator_peak_bytes, round.allocator_peak_bytes);
      }
      m.step_ms = Median(times);
      const auto [quickest, slowest] = std::minmax_element(times.begin(), times.end());
      steady += *quickest >= 0.9 * m.step_ms && *slowest <= 1.1 * m.step_ms ? 1 : 0;
      // Predicted with each round's calibration: the median of those predictions against the
      // median of the rounds' times.
      m.round_predicted_ms = f.calibrate_each_round ? Median(round_predictions) : 0;
      const double round_err = m.round_predicted_ms / m.step_ms - 1;
      round_within += f.calibrate_each_round && WithinTime(round_err) ? 1 : 0;
      const auto predicted_peak = r.expected_peak_bytes[1];
      const double time_err = r.step_ms / m.step_ms - 1;
      const double peak_err = PeakError(predicted_peak, m.peak_bytes);
      time_within += WithinTime(time_err) ? 1 : 0;
      peak_within += WithinPeak(peak_err) ? 1 : 0;
      measured_ms.push_back(m.step_ms);
      if (at == 0) auto_ms = m.step_ms;
      const auto [fewest, most] =
          std::minmax_element(round_predictions.begin(), round_predictions.end());
      std::string round_figures =
          f.calibrate_each_round
              ? fmt::format("; {:.2f} ms {:+.0f}% (rounds' {:.2f}-{:.2f})", m.round_predicted_ms,
                            100 * round_err, *fewest, *most)
              : "";
      const tessera::RankedPlan* other =
          pooled != nullptr ? RankedNamed(*pooled, r.choice.Name()) : nullptr;
      if (other != nullptr) {
        const double err = other->step_ms / m.step_ms - 1;
        pooled_within += WithinTime(err) ? 1 : 0;
        round_figures +=
            fmt::format("; pooled calibrations {:.2f} ms {:+.0f}%", other->step_ms, 100 * err);
      }
      std::printf(
          "%-4zu %-44s %10.2f %10.2f %+6.0f%% %10.2f %10.2f %+6.1f%%  %s (peak in the "
          "executor's order %.2f MiB, in the simulated order %.2f; the allocator's %.2f); "
          "measured %.2f-%.2f ms by round%s\n",
          at + 1, r.choice.Name().c_str(), r.step_ms, m.step_ms, 100 * time_err,
          Mib(predicted_peak), Mib(m.peak_bytes), 100 * peak_err,
          tessera::BottleneckName(r.bottleneck), Mib(r.untimed_peak_bytes), Mib(r.timed_peak_bytes),
          Mib(m.allocator_peak_bytes), *quickest, *slowest, round_figures.c_str());
      if (tsv != nullptr) {
        *tsv << fmt::format(
            "{}\t{:.3f}\t{}\t{}\t{}\t{:.4f}\t{:.4f}\t{}\t{}\t{}\t{:.4f}\t{}\t{:.4f}\t{:.4f}\n",
            name, cap, at + 1, r.choice.Name(), r.choice.Flags(), r.step_ms, m.step_ms,
            predicted_peak, m.peak_bytes, tessera::BottleneckName(r.bottleneck),
            m.round_predicted_ms, m.allocator_peak_bytes, *quickest, *slowest);
      }
      std::fflush(stdout);
    }
    const double best = *std::min_element(measured_ms.begin(), measured_ms.end());
    const double median = Median(measured_ms);
    // --plans may leave the search's choice out: then there is nothing to compare it by.
    const std::string choice =
        auto_ms > 0 ? fmt::format(
                          "the search's choice ran {:.2f} ms: {:.3f}x the best grid "
                          "point's speed ({:.2f} ms), {:.2f}x the grid median's ({:.2f} "
                          "ms)",
                          auto_ms, best / auto_ms, best, median / auto_ms, median)
                    : fmt::format("the search's choice ({}) was not run (not among --plans)",
                                  search.ranked.front().choice.Name());
    std::string round_count = f.calibrate_each_round
                                  ? fmt::format("; with each round's calibration {} of {} (time)",
                                                round_within, c.picks.size())
                                  : "";
    if (pooled != nullptr) {
      round_count += fmt::format("; on the pooled calibrations {} of {} (time)", pooled_within,
                                 c.picks.size());
    }
    std::printf(
        "%s, cap %.2f: %s; predictions within 10%%: %d of %zu (time), within 3%%: %d of %zu "
        "(peak)%s; every round within 10%% of the point's median time: %d of %zu\n",
        name.c_str(), cap, choice.c_str(), time_within, c.picks.size(), peak_within, c.picks.size(),
        round_count.c_str(), steady, c.picks.size());
    first_point += c.picks.size();
  }
}

// One recorded grid point (a line of plan_search.tsv).
struct RecordedPoint {
  double cap = 0;
  std::string plan;
  double measured_ms = 0;
  int64_t measured_peak_bytes = 0;  // 0 in a file that has none
};

std::vector<RecordedPoint> ReadRecordedPoints(const std::string& dir, const std::string& model) {
  const std::string path = dir + "/plan_search.tsv";
  std::ifstream in(path);
  if (!in) {
    tessera::bench::Die(kProgram, tessera::NotFound("cannot open {}", path), "--replay");
  }
  std::vector<RecordedPoint> points;
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    std::vector<std::string> fields;
    for (size_t from = 0;;) {
      const size_t tab = line.find('\t', from);
      fields.push_back(line.substr(from, tab == std::string::npos ? tab : tab - from));
      if (tab == std::string::npos) break;
      from = tab + 1;
    }
    if (fields.size() < 7 || fields[0] != model) continue;
    points.push_back({std::stod(fields[1]), fields[3], std::stod(fields[6]),
                      fields.size() > 8 ? std::stoll(fields[8]) : 0});
  }
  return points;
}

void ReplayModel(const Flags& f, const std::string& name) {
  const Model model = MakeModel(f, name);
  const std::string path = fmt::format("{}/calibration_{}.json", f.replay, name);
  tessera::Calibration recorded = Check(tessera::LoadCalibration(path, ""), "--replay");
  for (const std::string& dir : f.pool_probes) {
    const std::string other = fmt::format("{}/calibration_{}.json", dir, name);
    PoolProbeRounds(recorded, Check(tessera::LoadCalibration(other, ""), "--pool-probes"), other);
  }
  const tessera::SearchSpace space = SpaceOf(f);
  tessera::CalibrationRequest request = RequestFor(model, space);
  if (recorded.probe_workers.empty()) {  // an older file: the ids may order ties otherwise
    for (int w = 0; w < f.workers; ++w) request.workers.emplace_back(static_cast<uint64_t>(w + 1));
  }
  for (const tessera::Calibration::ProbeRecord& probe : recorded.probe_steps) {
    request.rounds = std::max(request.rounds, static_cast<int>(probe.ms.size()));
  }
  const tessera::Calibration calibration =
      Check(tessera::RefitCalibration(model.spec, model.base, request, std::move(recorded),
                                      [&](const std::string& line) {
                                        std::printf("# %s refit: %s\n", name.c_str(), line.c_str());
                                      }),
            "refitting " + path);
  const tessera::OpRegistry registry = StandardRegistry();
  const int64_t largest = LargestUncappedPeak(model, space, calibration, registry);
  const std::vector<RecordedPoint> points = ReadRecordedPoints(f.replay, name);
  std::vector<double> caps;
  for (const RecordedPoint& p : points) {
    if (std::find(caps.begin(), caps.end(), p.cap) == caps.end()) caps.push_back(p.cap);
  }
  for (const double cap : caps) {
    tessera::TrainingPlan base = model.base;
    base.memory.host_bytes = static_cast<int64_t>(cap * static_cast<double>(largest));
    const tessera::PlanSearchResult search =
        Check(tessera::PlanSearch(model.spec, base, space, calibration, registry), "search");
    std::printf("\n## %s, cap %.2f, replayed\n%-44s %10s %10s %7s %10s %10s %7s  %s\n",
                name.c_str(), cap, "plan", "pred_ms", "meas_ms", "err", "pred_MiB", "meas_MiB",
                "err", "bottleneck");
    int within = 0, count = 0, peaks_within = 0, peaks = 0;
    for (const RecordedPoint& p : points) {
      if (p.cap != cap) continue;
      ++count;
      const tessera::RankedPlan* ranked = RankedNamed(search, p.plan);
      if (ranked == nullptr) {
        std::printf("%-44s not ranked by this search\n", p.plan.c_str());
        continue;
      }
      const double err = ranked->step_ms / p.measured_ms - 1;
      within += WithinTime(err) ? 1 : 0;
      // The peak as the live run printed it: the simulated step's (expected_peak_bytes).
      const int64_t predicted_peak = ranked->expected_peak_bytes[1];
      std::string peak = fmt::format("{:>10} {:>10} {:>7}", "-", "-", "-");
      if (p.measured_peak_bytes > 0) {
        const double peak_err = PeakError(predicted_peak, p.measured_peak_bytes);
        ++peaks;
        peaks_within += WithinPeak(peak_err) ? 1 : 0;
        peak = fmt::format("{:10.2f} {:10.2f} {:+6.1f}%", Mib(predicted_peak),
                           Mib(p.measured_peak_bytes), 100 * peak_err);
      }
      std::printf("%-44s %10.2f %10.2f %+6.0f%% %s  %s\n", p.plan.c_str(), ranked->step_ms,
                  p.measured_ms, 100 * err, peak.c_str(),
                  tessera::BottleneckName(ranked->bottleneck));
    }
    std::printf(
        "%s, cap %.2f, replayed: predictions within 10%%: %d of %d (time), within 3%%: %d of %d "
        "(peak)\n",
        name.c_str(), cap, within, count, peaks_within, peaks);
  }
}

int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{"The plan search's predictions and choice against measured runs"};
  app.add_option("--models", f.models, "gpt2 and/or unet3d");
  app.add_option("--workers", f.workers, "Local CPU workers");
  app.add_option("--threads-per-worker", f.threads_per_worker, "Threads each worker computes on");
  app.add_flag("--bind-cores", f.bind_cores,
               "Bind each worker to cores of its own (the simulation shares each core among "
               "its workers only)");
  app.add_option("--caps", f.caps,
                 "Host caps as fractions of the largest uncapped plan's predicted peak (0: none)");
  app.add_option("--grid", f.grid, "Grid points per model and cap (evenly spaced by rank)");
  app.add_option("--steps", f.steps, "Timed steps per grid point");
  app.add_option("--warmup", f.warmup, "Untimed steps first");
  app.add_option("--rounds", f.rounds,
                 "Rounds over the grid, each in another order (a point's time: the median of "
                 "its rounds')")
      ->check(CLI::PositiveNumber);
  app.add_option("--calibration-rounds", f.calibration_rounds,
                 "Rounds of every calibration measurement (a figure: the median of its rounds')")
      ->check(CLI::PositiveNumber);
  app.add_option("--layers", f.layers, "GPT-2 blocks");
  app.add_option("--channels", f.channels, "GPT-2 width");
  app.add_option("--seq-len", f.seq_len, "GPT-2 sequence length");
  app.add_option("--gpt2-batch", f.gpt2_batch, "GPT-2 global batch");
  app.add_option("--unet-preset", f.unet_preset, "U-Net preset");
  app.add_option("--unet-batch", f.unet_batch, "U-Net global batch");
  app.add_option("--out", f.out, "Directory for plan_search.tsv (every grid point)");
  app.add_option("--plans", f.plans,
                 "Run these plans (by name, e.g. \"D4 x P1 M4 ZeRO-3\") instead of the grid");
  app.add_flag("--explain", f.explain,
               "Per worker of each run, every role's predicted and measured peak");
  app.add_flag("--calibrate-each-round", f.calibrate_each_round,
               "Calibrate again before every round (one round of each measurement) and predict "
               "its points with that calibration too: the prediction error without the "
               "machine's drift between the calibration and the runs");
  CLI::Option* replay =
      app.add_option("--replay", f.replay,
                     "Run nothing: fit a directory's recorded calibrations again (their probe "
                     "steps) and predict its recorded grid points with the simulation as built")
          ->check(CLI::ExistingDirectory);
  app.add_flag("--calibrate-after", f.calibrate_after,
               "Calibrate again after the grid and also predict every point on both "
               "calibrations' probe rounds pooled (how much of a miss is one calibration's noise)")
      ->excludes(replay);
  app.add_option("--pool-probes", f.pool_probes,
                 "With --replay: fit on these directories' recorded probe rounds too (the same "
                 "model, workers and probes)")
      ->check(CLI::ExistingDirectory)
      ->needs(replay);
  app.add_flag("--explain-time", f.explain_time,
               "Per worker of each run, its tasks' time by kind and its end, simulated and "
               "measured");
  app.add_flag("--explain-tasks", f.explain_tasks,
               "With --explain-time: every task of each worker, when it started and ended, "
               "simulated and measured (from the step's first task)")
      ->needs("--explain-time");
  app.set_version_flag("--version", tessera::VersionLine(kProgram));
  CLI11_PARSE(app, argc, argv);
  std::unique_ptr<std::ofstream> tsv;
  if (!f.out.empty() && f.replay.empty()) {
    std::filesystem::create_directories(f.out);
    tsv = std::make_unique<std::ofstream>(f.out + "/plan_search.tsv");
    *tsv << "model\tcap\trank\tplan\tflags\tpredicted_ms\tmeasured_ms\tpredicted_peak_bytes\t"
            "measured_peak_bytes\tbottleneck\tround_predicted_ms\tallocator_peak_bytes\t"
            "measured_fastest_round_ms\tmeasured_slowest_round_ms\n";
  }
  std::printf("# %s, %s\n", kProgram, tessera::VersionLine(kProgram).c_str());
  for (const std::string& name : f.models) {
    if (name != "gpt2" && name != "unet3d") {
      std::fprintf(stderr, "%s: --models: '%s' is neither gpt2 nor unet3d\n", kProgram,
                   name.c_str());
      return 2;
    }
    if (!f.replay.empty()) {
      ReplayModel(f, name);
    } else {
      RunModel(f, name, tsv.get());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::bench::RunMain(kProgram, [&] { return Main(argc, argv); });
}

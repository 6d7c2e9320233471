#include "training/plan_calibration.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <system_error>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "ops/standard_ops.h"
#include "planner/step_graph.h"
#include "training/collective_link.h"
#include "training/layer_profile.h"
#include "training/trainer.h"

namespace tessera {
namespace {

using nlohmann::json;

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
    if (c.tensor_parallel > 1) continue;
    rows.insert(base.batch / (int64_t{c.data_parallel} * c.micro_batches));
  }
  return {rows.begin(), rows.end()};
}

std::vector<TensorSplitRows> CandidateTensorSplitRows(const ModelSpec& model,
                                                      const TrainingPlan& base,
                                                      const SearchSpace& space) {
  std::map<int, std::set<int64_t>> rows;
  for (const PlanChoice& c : EnumerateCandidates(model, base, space)) {
    if (c.tensor_parallel < 2) continue;
    rows[c.tensor_parallel].insert(base.batch / (int64_t{c.data_parallel} * c.micro_batches));
  }
  std::vector<TensorSplitRows> splits;
  splits.reserve(rows.size());
  for (const auto& [t, counts] : rows) {
    splits.push_back(TensorSplitRows{t, {counts.begin(), counts.end()}});
  }
  return splits;
}

namespace {

// The median step time of `plan` (its workers bound) on a new backend: zeros at a zero
// learning rate, two untimed steps then `steps`.
Result<double> ProbeStepMs(const ModelSpec& model, const TrainingPlan& plan,
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
  std::vector<double> ms;
  for (int step = 0; step < 2 + steps; ++step) {
    TESSERA_ASSIGN_OR_RETURN(StepReport report, trainer->Step(batch, 0.0f));
    if (step >= 2) ms.push_back(report.step_ms);
  }
  std::sort(ms.begin(), ms.end());
  return ms.size() % 2 == 1 ? ms[ms.size() / 2] : (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]) / 2;
}

// The simulated step of `plan` on `calibration`.
Result<SimulatedStep> Simulated(const ModelSpec& model, const TrainingPlan& plan,
                                const Calibration& calibration, const OpRegistry& registry) {
  TESSERA_ASSIGN_OR_RETURN(StepGraph step, PlanTrainingStep(model, plan, registry));
  return SimulatePlannedStep(step, model, plan.memory, calibration, registry);
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

// With the layers of a split over 2 tensor ranks calibrated and an even number of workers: every
// worker a rank of pairs of tensor ranks at once (D n/2 x T 2, from `one`'s rows per pair), whose
// step waits on two all-reduces a layer pair each way. When it is slower than simulated, what a
// collective waits beyond its bytes while the workers share the machine (a peer that must be
// scheduled first) is the collective latency, bisected so the simulation gives the measured step;
// the idle link's otherwise.
Status FitTheTensorProbe(const ModelSpec& model, const TrainingPlan& one,
                         const CalibrationRequest& request, const BackendFactory& make_backend,
                         const std::function<void(const std::string&)>& say,
                         Calibration& calibration) {
  const auto n = static_cast<int>(request.workers.size());
  if (n < 2 || n % 2 != 0 || calibration.SplitTimes(2) == nullptr ||
      !calibration.links.collective.measured()) {
    return Status::Ok();
  }
  Result<ModelSpec> split = model.PlannedFor(2, 1);
  if (!split.ok()) return Status::Ok();
  OpRegistry registry;
  TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry));
  TrainingPlan pairs = one;
  pairs.batch = one.batch * (n / 2);
  pairs.parallel.data_parallel = n / 2;
  pairs.parallel.tensor_parallel = 2;
  pairs.parallel.workers = request.workers;
  pairs.parallel.link = calibration.links.collective;
  Result<double> probed = ProbeStepMs(model, pairs, make_backend, request.probe_steps);
  if (!probed.ok()) {
    say(
        fmt::format("{} tensor-parallel pairs: the probe step failed ({}); the collective "
                    "latency stays the idle link's",
                    n / 2, probed.status().ToString()));
    return Status::Ok();
  }
  const auto simulated_at = [&](double latency_us) -> Result<double> {
    calibration.links.collective.latency_us = latency_us;
    TESSERA_ASSIGN_OR_RETURN(SimulatedStep step, Simulated(*split, pairs, calibration, registry));
    return step.step_ms;
  };
  const double idle = calibration.links.collective.latency_us;
  TESSERA_ASSIGN_OR_RETURN(const double at_idle, simulated_at(idle));
  if (*probed <= at_idle) {
    calibration.links.collective.latency_us = idle;
    say(
        fmt::format("{} tensor-parallel pairs at once: {:.2f} ms a step, within the simulated "
                    "{:.2f} ms: a collective waits its idle latency, {:.0f} us",
                    n / 2, *probed, at_idle, idle));
    return Status::Ok();
  }
  TESSERA_ASSIGN_OR_RETURN(calibration.links.collective.latency_us,
                           FitByBisection(idle, 1e5, 40, /*grows=*/true, *probed, simulated_at));
  say(
      fmt::format("{} tensor-parallel pairs at once: {:.2f} ms a step against {:.2f} ms "
                  "simulated with the idle link: a collective waits {:.0f} us for its peers when "
                  "the workers share the machine ({:.0f} us idle)",
                  n / 2, *probed, at_idle, calibration.links.collective.latency_us, idle));
  return Status::Ok();
}

// The compute scale, per-step overhead, compute sharing and push latency that make the
// simulation give the probes' measured steps. A probe the workers cannot run (a worker's memory
// cap below an uncapped probe step) leaves its figures at their defaults, and says so.
Status FitTheProbes(const ModelSpec& model, const TrainingPlan& base,
                    const CalibrationRequest& request, const BackendFactory& make_backend,
                    const std::function<void(const std::string&)>& say, Calibration& calibration) {
  OpRegistry registry;
  TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry));
  const auto n = static_cast<int>(request.workers.size());
  // Rows of one rank of the widest data-parallel plan (the base batch over the workers, when it
  // splits), else the fewest profiled.
  const int64_t rows = base.batch % n == 0 ? base.batch / n : request.rows.front();
  TrainingPlan one = base;
  one.batch = rows;
  one.parallel = ParallelConfig{};
  one.parallel.workers = {request.workers.front()};
  one.memory = base.memory;  // planned under the caps the workers hold, as the plans will be
  // One rank on one worker at two row counts: the worker's step is a scale of the profiled work
  // (its kernels may run faster or slower there than in this process) plus a constant per step.
  TrainingPlan other = one;
  other.batch = rows >= 2 && n == 1 ? rows / 2 : rows * 2;
  const auto probe = [&](const TrainingPlan& plan, const std::string& what) -> Result<double> {
    Result<double> ms = ProbeStepMs(model, plan, make_backend, request.probe_steps);
    if (!ms.ok()) {
      say(fmt::format("{}: the probe step failed ({}); its figures are not fitted", what,
                      ms.status().ToString()));
    }
    return ms;
  };
  Result<double> probed_one = probe(one, "one rank on one worker");
  Result<double> probed_other = probe(other, "one rank on one worker");
  if (!probed_one.ok() || !probed_other.ok()) return Status::Ok();
  const double measured_one = *probed_one, measured_other = *probed_other;
  TESSERA_ASSIGN_OR_RETURN(SimulatedStep simulated_one,
                           Simulated(model, one, calibration, registry));
  TESSERA_ASSIGN_OR_RETURN(SimulatedStep simulated_other,
                           Simulated(model, other, calibration, registry));
  const double a = simulated_one.step_ms, b = simulated_other.step_ms;
  double scale = b != a ? (measured_other - measured_one) / (b - a) : 0;
  double constant = measured_one - scale * a;
  if (scale <= 0 || constant < 0) {  // noise: no constant, the scale of both together
    scale = (measured_one + measured_other) / (a + b);
    constant = 0;
  }
  calibration.compute_scale = scale;
  calibration.step_overhead_ms = constant;
  say(
      fmt::format("one rank on one worker at {} and {} rows: {:.2f} and {:.2f} ms a step against "
                  "{:.2f} and {:.2f} ms of profiled work: the worker computes at {:.2f}x the "
                  "profile's times, plus {:.2f} ms a step",
                  one.batch, other.batch, measured_one, measured_other, a, b, scale, constant));
  if (n < 2) return Status::Ok();
  TrainingPlan all = one;
  all.batch = rows * n;
  all.parallel.data_parallel = n;
  all.parallel.workers = request.workers;
  all.parallel.link = calibration.links.collective;
  Result<double> probed_all = probe(all, fmt::format("{} ranks at once", n));
  if (!probed_all.ok()) return Status::Ok();
  const double measured_all = *probed_all;
  calibration.sharing = ComputeSharing{};
  TESSERA_ASSIGN_OR_RETURN(SimulatedStep alone, Simulated(model, all, calibration, registry));
  if (measured_all <= alone.step_ms * 1.05) {
    say(
        fmt::format("{} ranks at once: {:.2f} ms a step, as simulated with a worker's compute to "
                    "itself ({:.2f} ms)",
                    n, measured_all, alone.step_ms));
  } else {
    // The simulated step shrinks as the capacity grows: bisect for the measured one.
    TESSERA_ASSIGN_OR_RETURN(const double capacity,
                             FitByBisection(0.05, n, 30, /*grows=*/false, measured_all,
                                            [&](double room) -> Result<double> {
                                              calibration.sharing = ComputeSharing{room};
                                              TESSERA_ASSIGN_OR_RETURN(
                                                  SimulatedStep shared,
                                                  Simulated(model, all, calibration, registry));
                                              return shared.step_ms;
                                            }));
    calibration.sharing = ComputeSharing{capacity};
    say(
        fmt::format("{} ranks at once: {:.2f} ms a step against {:.2f} ms with a worker's "
                    "compute to itself: the workers share a machine, room for {:.2f} of them at "
                    "full speed",
                    n, measured_all, alone.step_ms, calibration.sharing.capacity));
  }
  // A pipeline of two stages: what an object pushed from one worker to the next waits beyond
  // its bytes over the link (the producer's report, the reader's dispatch and pull), fitted as
  // the point-to-point latency.
  if (model.layers.size() < 2) return Status::Ok();
  TrainingPlan piped = one;
  piped.batch = rows * 4;
  piped.parallel.pipeline_stages = 2;
  piped.parallel.micro_batches = 4;  // 8 pushes a step: one noisy one moves the fit less
  piped.parallel.schedule = PipelineSchedule::kGPipe;
  piped.parallel.workers = {request.workers[0], request.workers[1]};
  Result<double> probed_piped = probe(piped, "a pipeline of two stages");
  if (!probed_piped.ok()) return Status::Ok();
  const double measured_piped = *probed_piped;
  const double bytes_per_us = calibration.links.collective.measured()
                                  ? calibration.links.collective.bytes_per_us
                                  : 1e3;  // 1 GB/s when unmeasured
  TESSERA_ASSIGN_OR_RETURN(
      const double latency_us,
      FitByBisection(0, 1e5, 40, /*grows=*/true, measured_piped,
                     [&](double us) -> Result<double> {  // the step grows with the latency
                       calibration.links.point_to_point = CollectiveLink{us, bytes_per_us};
                       TESSERA_ASSIGN_OR_RETURN(SimulatedStep pushed,
                                                Simulated(model, piped, calibration, registry));
                       return pushed.step_ms;
                     }));
  calibration.links.point_to_point = CollectiveLink{std::max(latency_us, 1.0), bytes_per_us};
  say(
      fmt::format("a pipeline of two stages: {:.2f} ms a step: an object pushed between workers "
                  "waits {:.0f} us beyond its bytes",
                  measured_piped, calibration.links.point_to_point.latency_us));
  return FitTheTensorProbe(model, one, request, make_backend, say, calibration);
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
  double overhead_sum = 0;
  // `what`'s layers at each of `counts` rows in this process (`sum`: its task overheads added).
  const auto profile_layers = [&](const ModelSpec& what, const std::vector<int64_t>& counts,
                                  const std::string& label,
                                  double* sum) -> Result<std::vector<LayerTimesAtRows>> {
    std::vector<LayerTimesAtRows> times;
    for (int64_t rows : counts) {
      TrainingPlan shape = base;
      shape.batch = rows;
      shape.parallel = ParallelConfig{};
      shape.memory = MemoryCaps{};
      Result<StepProfile> profile = ProfileStep(what, shape, executor, options);
      if (!profile.ok()) {
        return profile.status().WithContext(
            fmt::format("calibrating the {} at {} rows", label, rows));
      }
      double step_layers = 0;
      for (OpCosts& ms : profile->layer_ms) {
        // A layer too fast to time still costs something.
        ms.forward = std::max(ms.forward, 1e-3);
        ms.backward = std::max(ms.backward, 1e-3);
        step_layers += ms.forward + ms.backward + ms.weight;
      }
      say(fmt::format("{} at {} rows a micro-batch: {:.1f} ms forward + backward", label, rows,
                      step_layers));
      if (sum != nullptr) *sum += profile->TaskOverheadMs();
      times.push_back(LayerTimesAtRows{rows, std::move(profile->layer_ms)});
    }
    return times;
  };
  TESSERA_ASSIGN_OR_RETURN(calibration.layers,
                           profile_layers(model, request.rows, "layers", &overhead_sum));
  calibration.task_overhead_ms = overhead_sum / static_cast<double>(request.rows.size());
  for (const TensorSplitRows& split : request.tensor_splits) {
    const std::string label =
        fmt::format("layers of one of {} tensor ranks", split.tensor_parallel);
    Result<ModelSpec> rank = model.PlannedFor(split.tensor_parallel, 1);
    if (rank.ok()) rank = rank->OneRankView();
    if (!rank.ok()) return rank.status().WithContext("calibrating the " + label);
    TESSERA_ASSIGN_OR_RETURN(std::vector<LayerTimesAtRows> times,
                             profile_layers(*rank, split.rows, label, nullptr));
    calibration.tensor_splits.push_back(TensorSplitTimes{split.tensor_parallel, std::move(times)});
  }
  if (!make_backend || request.workers.empty()) return calibration;
  if (request.workers.size() >= 2) {
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<GraphBackend> backend, make_backend());
    TESSERA_ASSIGN_OR_RETURN(CollectiveLink link,
                             MeasureCollectiveLink(*backend, request.workers, base.device));
    calibration.links.collective = link;
    calibration.links.collective_group = static_cast<int>(request.workers.size());
    say(fmt::format("collectives among {} workers: {:.0f} us + {:.2f} GB/s (all-reduce)",
                    request.workers.size(), link.latency_us, link.bytes_per_us / 1e3));
  }
  TESSERA_RETURN_IF_ERROR(FitTheProbes(model, base, request, make_backend, say, calibration)
                              .WithContext("calibrating the workers' steps"));
  return calibration;
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
    splits += fmt::format(" T{} [", split.tensor_parallel);
    for (int64_t r : split.rows) splits += fmt::format("{},", r);
    splits += "]";
  }
  return fmt::format(
      "model {:016x} ({} layers) seq {} device {} rows [{}]{} workers {} host {} threads {}",
      std::hash<std::string>()(layers), model.layers.size(), base.seq_len, base.device.ToString(),
      rows, splits, request.workers.size(), HostName(), threads);
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
    splits.push_back(
        {{"tensor_parallel", split.tensor_parallel}, {"layers", LayersJson(split.layers)}});
  }
  const json file = {{"key", key},
                     {"layers", LayersJson(calibration.layers)},
                     {"tensor_splits", splits},
                     {"task_overhead_ms", calibration.task_overhead_ms},
                     {"step_overhead_ms", calibration.step_overhead_ms},
                     {"compute_scale", calibration.compute_scale},
                     {"collective", LinkJson(calibration.links.collective)},
                     {"collective_group", calibration.links.collective_group},
                     {"point_to_point", LinkJson(calibration.links.point_to_point)},
                     {"sharing_capacity", calibration.sharing.capacity}};
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
    if (file.at("key").get<std::string>() != key) {
      return InvalidArgument("the calibration at {} is for another setup ({}), not this one", path,
                             file.at("key").get<std::string>());
    }
    Calibration calibration;
    calibration.layers = LayersFrom(file.at("layers"));
    for (const json& split : file.at("tensor_splits")) {
      calibration.tensor_splits.push_back(
          TensorSplitTimes{split.at("tensor_parallel").get<int>(), LayersFrom(split.at("layers"))});
    }
    calibration.task_overhead_ms = file.at("task_overhead_ms").get<double>();
    calibration.step_overhead_ms = file.at("step_overhead_ms").get<double>();
    calibration.compute_scale = file.at("compute_scale").get<double>();
    calibration.links.collective = LinkFrom(file.at("collective"));
    calibration.links.collective_group = file.at("collective_group").get<int>();
    calibration.links.point_to_point = LinkFrom(file.at("point_to_point"));
    calibration.sharing.capacity = file.at("sharing_capacity").get<double>();
    if (calibration.layers.empty())
      return DataLoss("the calibration at {} holds no layer times", path);
    return calibration;
  } catch (const json::exception& e) {
    return DataLoss("the calibration at {} cannot be read ({}); delete it to measure again", path,
                    e.what());
  }
}

}  // namespace tessera

#include "training/auto_plan.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/statistics.h"
#include "ops/standard_ops.h"

namespace tessera {
namespace {

std::string Why(const PlanSearchResult& search) {
  const RankedPlan& best = search.ranked.front();
  const SimulatedWorker& c = best.critical;
  const double end = std::max(c.end_ms, 1e-12);
  std::vector<double> times;
  times.reserve(search.ranked.size());
  for (const RankedPlan& r : search.ranked) times.push_back(r.step_ms);
  const double median = Median(std::move(times));
  std::string why = fmt::format(
      "{} ({}): predicted {:.2f} ms a step, bound by {} (its slowest worker computes {:.0f}% of "
      "the step, waits {:.0f}% on other stages or ranks, {:.0f}% on communication, {:.0f}% on "
      "swaps)",
      best.choice.Name(), best.choice.Flags(), best.step_ms, BottleneckName(best.bottleneck),
      100 * c.compute_ms / end, 100 * c.bubble_ms / end, 100 * c.communication_ms / end,
      100 * c.swap_ms / end);
  if (search.ranked.size() > 1) {
    why += fmt::format(
        "; the next best, {}, {:.2f} ms; the median of the {} plans that fit, "
        "{:.2f} ms",
        search.ranked[1].choice.Name(), search.ranked[1].step_ms, search.ranked.size(), median);
  }
  if (!search.refused.empty()) {
    why += fmt::format("; {} plan{} refused (over the memory cap, or not plannable)",
                       search.refused.size(), search.refused.size() == 1 ? "" : "s");
  }
  return why;
}

}  // namespace

Result<AutoPlan> ChooseAutoPlan(const ModelSpec& model, const TrainingPlan& base,
                                const AutoPlanOptions& options, const ExecutorOptions& executor,
                                const std::vector<WorkerId>& workers,
                                const BackendFactory& make_backend,
                                const std::function<void(const std::string&)>& progress) {
  const auto say = [&progress](const std::string& line) {
    if (progress) progress(line);
  };
  // A degree the space gives that the model cannot split over: its error, before anything runs.
  TESSERA_RETURN_IF_ERROR(PlannedModels(model, base, options.space).status());
  CalibrationRequest request;
  request.rows = CandidateRows(model, base, options.space);
  request.tensor_splits = CandidateTensorSplitRows(model, base, options.space);
  if (request.rows.empty() && !request.tensor_splits.empty()) {
    // Only split plans (a given degree): the whole model's layers at the split's rows still
    // calibrate the workers' probes.
    request.rows = request.tensor_splits.front().rows;
  }
  if (request.rows.empty()) {
    return InvalidArgument(
        "--plan auto: no plan splits the batch of {} over {} worker(s) (each data-parallel rank "
        "needs whole rows): use a batch that is a multiple of the workers",
        base.batch, options.space.workers);
  }
  request.profile_steps = options.profile_steps;
  request.rounds = options.calibration_rounds;
  const size_t n = std::min(workers.size(), static_cast<size_t>(options.space.workers));
  // Workers bound to cores: neighbouring ranks on different cores (InterleaveCoreGroups).
  const std::vector<WorkerId> ordered =
      InterleaveCoreGroups(workers, CoreGroupsOf(options.cluster, workers));
  request.workers.assign(ordered.begin(), ordered.begin() + static_cast<long>(n));
  request.core_groups = CoreGroupsOf(options.cluster, request.workers);
  AutoPlan plan;
  const std::string key = CalibrationKey(model, base, request, options.threads);
  const std::string path =
      options.cache_dir.empty() ? std::string() : CalibrationPath(options.cache_dir, key);
  bool measured = true;
  if (!path.empty() && !options.recalibrate) {
    Result<Calibration> cached = LoadCalibration(path, key);
    if (cached.ok()) {
      plan.calibration = std::move(*cached);
      // This cluster's ids (the key holds only the shape): the search places its candidates on
      // the probed workers, whose groups these are.
      plan.calibration.sharing.groups = request.core_groups;
      if (!request.workers.empty()) plan.calibration.probe_workers = request.workers;
      plan.calibration_source = "cached in " + path;
      measured = false;
    } else if (cached.status().code() != StatusCode::kNotFound) {
      say(fmt::format("{}; measuring again", cached.status().message()));
    }
  }
  if (measured) {
    TESSERA_ASSIGN_OR_RETURN(plan.calibration,
                             Calibrate(model, base, request, executor, make_backend, progress));
    plan.calibration_source = fmt::format(
        "measured: the layers at {} micro-batch shape(s){}{}", request.rows.size(),
        request.tensor_splits.empty()
            ? ""
            : fmt::format(", one rank of {} split(s) (tensor ranks or slabs)",
                          request.tensor_splits.size()),
        request.workers.empty() ? ""
                                : fmt::format(", steps on {} worker(s)", request.workers.size()));
    if (!path.empty() && plan.calibration.probes_failed > 0) {
      // Its figures hold under these caps only (the cache's key has none): measured again.
      plan.calibration_source += fmt::format(
          ", not cached: {} probe step(s) failed under the workers' caps, their figures left at "
          "the defaults",
          plan.calibration.probes_failed);
    } else if (!path.empty()) {
      const Status saved = SaveCalibration(path, key, plan.calibration);
      if (saved.ok()) {
        plan.calibration_source += ", saved to " + path;
      } else {
        say(fmt::format("{} (the next run measures again)", saved.message()));
      }
    }
  }
  OpRegistry registry;
  TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry));
  TESSERA_ASSIGN_OR_RETURN(plan.search,
                           PlanSearch(model, base, options.space, plan.calibration, registry));
  plan.chosen = base;
  plan.chosen.parallel = plan.search.ranked.front().parallel;
  if (!request.core_groups.empty()) {  // on the workers it was simulated on, in that order
    plan.chosen.parallel.workers.assign(
        request.workers.begin(),
        request.workers.begin() + plan.search.ranked.front().choice.workers());
  }
  plan.why = Why(plan.search);
  return plan;
}

}  // namespace tessera

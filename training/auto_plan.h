// `--plan auto`: the plan a run uses, chosen by the plan search (planner/plan_search.h) on costs
// calibrated on the cluster it runs on (training/plan_calibration.h), cached between runs.
//
// ChooseAutoPlan enumerates the candidates for the space's workers, calibrates the layer times
// at their micro-batch row counts and the collective link among the backend's first workers (or
// loads the cached calibration of the same model, shape and cluster), searches, and returns the
// best plan with the search and a sentence on why it was chosen. The chosen plan carries the
// calibrated layer times, overhead and link, so the trainer plans exactly the step the search
// timed (the same memory decisions). A calibration whose probe steps could not all run (a
// worker's cap below a probe's step: Calibration::probes_failed) holds for these caps only, so it
// is not cached (the key holds no caps) and a run under other caps measures its own.
//
// Thread safety: uses the backend like any caller of it (one call at a time).
#pragma once

#include <functional>
#include <string>

#include "client/graph_backend.h"
#include "core/status.h"
#include "model/model_spec.h"
#include "planner/plan_search.h"
#include "training/plan_calibration.h"
#include "worker/in_process_executor.h"

namespace tessera {

struct AutoPlanOptions {
  SearchSpace space;
  std::string cache_dir;     // empty: no cache (always measured, never saved)
  bool recalibrate = false;  // measure even when a cached calibration matches
  int profile_steps = 2;
  int calibration_rounds = 3;  // CalibrationRequest::rounds
  int threads = 0;             // this process's compute threads (part of the cache key)
  // The cluster's workers as its status reports them: those bound to cores of their own are
  // simulated sharing only their cores (CoreGroupsOf); empty: they share the whole machine.
  std::vector<WorkerInfo> cluster;
};

struct AutoPlan {
  PlanSearchResult search;
  Calibration calibration;
  std::string calibration_source;  // "measured ...", "cached in PATH"
  TrainingPlan chosen;             // the base plan with the best plan's parallel part
  // "D4 x P1 M1 ZeRO-0 (--workers 4 --micro-batches 1 --zero-stage 0): predicted 12.3 ms a step,
  //  bound by compute (...); the median of the 48 plans that fit: 20.1 ms"
  std::string why;
};

// Errors: the calibration's (named), the search's (Infeasible: nothing fits, with the fix).
// `progress` (may be null) hears the calibration's lines.
// `workers`: the cluster's workers (empty: this process), on backends `make_backend` makes.
Result<AutoPlan> ChooseAutoPlan(const ModelSpec& model, const TrainingPlan& base,
                                const AutoPlanOptions& options, const ExecutorOptions& executor,
                                const std::vector<WorkerId>& workers,
                                const BackendFactory& make_backend,
                                const std::function<void(const std::string&)>& progress = nullptr);

}  // namespace tessera

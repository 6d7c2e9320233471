// JobMetrics: what drivers report about their jobs after each training step (JobProgress:
// step, loss, step time, tokens/s or samples/s, a validation loss when the step was evaluated,
// the plan when new), kept for the dashboard's plots and /metrics.
//
// A job is one reporting driver and the name it gives; a driver that leaves keeps its history
// (marked not connected) until newer jobs push it out. Memory is bounded: at most kMaxPoints per
// job (the oldest are dropped, and counted) and kMaxJobs jobs (the oldest job is forgotten).
//
// Thread safety: none; the scheduler's io thread drives it.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "core/ids.h"
#include "core/proto/tessera.capnp.h"
#include "dashboard/dashboard_state.h"

namespace tessera {

struct JobStep {
  int64_t step = 0;
  std::chrono::steady_clock::time_point received;
  double loss = 0;
  double step_ms = 0;
  double tokens_per_second = 0;
  double samples_per_second = 0;
  double validation_loss = 0;  // NaN when the step was not evaluated
};

struct JobHistory {
  std::string name;
  WorkerId driver;
  std::string plan;  // the last one reported
  bool connected = true;
  int64_t dropped = 0;  // points forgotten to keep the bound
  std::deque<JobStep> steps;
  int64_t reported = 0;                     // every step reported
  dashboard::StepTimeHistogram step_times;  // of those with a step time (> 0)
};

class JobMetrics {
 public:
  static constexpr size_t kMaxPoints = 4096;
  static constexpr size_t kMaxJobs = 16;

  // `driver` reported a step at `now`. A job name longer than 200 bytes is cut.
  void Record(WorkerId driver, proto::JobProgress::Reader progress,
              std::chrono::steady_clock::time_point now);
  // The driver left: its jobs stay, not connected.
  void DriverGone(WorkerId driver);
  // Oldest job first.
  const std::deque<JobHistory>& jobs() const { return jobs_; }

 private:
  std::deque<JobHistory> jobs_;
};

}  // namespace tessera

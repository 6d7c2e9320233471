#include "scheduler/job_metrics.h"

#include <cmath>

namespace tessera {

void JobMetrics::Record(WorkerId driver, proto::JobProgress::Reader progress,
                        std::chrono::steady_clock::time_point now) {
  std::string name = progress.getJob();
  if (name.size() > 200) name.resize(200);
  JobHistory* job = nullptr;
  for (JobHistory& candidate : jobs_) {
    if (candidate.driver == driver && candidate.name == name) job = &candidate;
  }
  if (job == nullptr) {
    if (jobs_.size() >= kMaxJobs) jobs_.pop_front();
    job = &jobs_.emplace_back();
    job->name = std::move(name);
    job->driver = driver;
  }
  if (job->steps.size() >= kMaxPoints) {
    job->steps.pop_front();
    ++job->dropped;
  }
  ++job->reported;
  if (const std::string plan = progress.getPlan(); !plan.empty()) job->plan = plan;
  if (const double ms = progress.getStepMs(); std::isfinite(ms) && ms > 0) {
    job->step_times.Add(ms / 1000.0);
  }
  job->steps.push_back(JobStep{.step = progress.getStep(),
                               .received = now,
                               .loss = progress.getLoss(),
                               .step_ms = progress.getStepMs(),
                               .tokens_per_second = progress.getTokensPerSecond(),
                               .samples_per_second = progress.getSamplesPerSecond(),
                               .validation_loss = progress.getValidationLoss()});
}

void JobMetrics::DriverGone(WorkerId driver) {
  for (JobHistory& job : jobs_) {
    if (job.driver == driver) job.connected = false;
  }
}

}  // namespace tessera

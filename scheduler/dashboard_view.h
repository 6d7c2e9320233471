// CoreDashboardSource: the scheduler's state as the dashboard's snapshots (dashboard_state.h).
//
// It reads the core's parts (participants and their heartbeat figures and run reports, task
// counts, job metrics, the work timeline) and copies what the dashboard shows into plain data,
// so the dashboard module never sees the scheduler's tables. Times are relative to `started`
// (the scheduler's start).
//
// Thread safety: like the core it reads; call it on the core's thread (the service serves HTTP
// on its io thread for that reason).
#pragma once

#include <chrono>
#include <functional>
#include <vector>

#include "dashboard/dashboard_state.h"
#include "scheduler/scheduler_core.h"

namespace tessera {

class CoreDashboardSource final : public dashboard::DashboardSource {
 public:
  using Clock = std::chrono::steady_clock;
  // `core` must outlive the source.
  CoreDashboardSource(const SchedulerCore* core, Clock::time_point started,
                      std::function<Clock::time_point()> now);

  dashboard::ClusterView Cluster() override;
  std::vector<dashboard::JobView> Jobs() override;
  dashboard::TimelineView Timeline() override;
  std::string SessionDir() override;

 private:
  double SinceStartMs(Clock::time_point t) const;

  const SchedulerCore* core_;
  const Clock::time_point started_;
  std::function<Clock::time_point()> now_;
};

}  // namespace tessera

#include "scheduler/dashboard_view.h"

#include <algorithm>
#include <string>

#include "core/graph.h"
#include "core/timeline.h"

namespace tessera {

CoreDashboardSource::CoreDashboardSource(const SchedulerCore* core, Clock::time_point started,
                                         std::function<Clock::time_point()> now)
    : core_(core), started_(started), now_(std::move(now)) {}

double CoreDashboardSource::SinceStartMs(Clock::time_point t) const {
  return std::chrono::duration<double, std::milli>(t - started_).count();
}

dashboard::ClusterView CoreDashboardSource::Cluster() {
  dashboard::ClusterView view;
  view.session_dir = core_->session_dir();
  view.uptime_s = SinceStartMs(now_()) / 1000.0;
  view.objects = static_cast<int64_t>(core_->num_objects());
  const TaskCounts tasks = core_->task_counts();
  view.tasks_queued = tasks.waiting;
  view.tasks_running = tasks.running;
  view.tasks_done = tasks.done;
  const std::vector<WorkerWaitLine> waits = core_->Waits();  // in id order, like the loop
  size_t next_wait = 0;
  const auto add_worker = [&](WorkerId id, const Participant& p) {
    dashboard::WorkerView& w = view.workers.emplace_back();
    w.id = id.value();
    w.hostname = p.hostname;
    w.pid = p.pid;
    w.alive = p.alive;
    w.data_address = p.data_address;
    w.gpu = p.gpu;
    w.cpu_threads = p.cpu_threads;
    w.cpus = p.cpus;
    w.host_used = p.host_used;
    w.host_capacity = p.host_capacity;
    w.spilled = p.spilled_bytes;
    w.committed = p.committed_bytes;
    w.device_bytes = p.device_bytes;
    w.spilled_total = p.spilled_total;
    w.objects = p.objects;
    w.restores = p.restores;
    w.cpu_seconds = p.cpu_seconds;
    w.cpu_utilization = p.cpu_utilization;
    w.gpu_use = p.gpu_use;
    w.tasks_in_flight = p.tasks_in_flight;
    w.tasks_done = p.tasks_done;
    w.bytes_pulled = p.bytes_pulled;
    w.bytes_served = p.bytes_served;
    w.bytes_pushed = p.bytes_pushed;
    w.collective_bytes_sent = p.collective_bytes_sent;
    w.instances_finished = p.instances_finished;
    if (next_wait < waits.size() && waits[next_wait].worker == id) {
      w.waits = waits[next_wait].text;
      for (WorkerId blocked : waits[next_wait].blocked_on) w.blocked_on.push_back(blocked.value());
      ++next_wait;
    }
    if (p.last_run) {
      const proto::RunReport::Reader report = p.last_run->getRoot<proto::RunReport>().asReader();
      w.has_last_run = true;
      dashboard::LastRun& run = w.last_run;
      run.graph_id = report.getGraphId();
      run.instance = report.getInstance();
      run.model_state_peak = report.getModelStatePeak();
      run.transient_peak = report.getTransientPeak();
      run.total_peak = report.getTotalPeak();
      run.allocator_peak = report.getAllocatorPeak();
      run.collective_bytes_sent = report.getCollectiveBytesSent();
      run.pushed_bytes = report.getPushedBytes();
      run.wall_ms = static_cast<double>(report.getWallMicros()) / 1000.0;
      const auto peaks = report.getRolePeaks();
      for (unsigned role = 0; role < peaks.size(); ++role) {
        // Roles a newer worker knows and this scheduler does not are shown by number.
        const std::string name = role <= static_cast<unsigned>(ObjectRole::kGradientBucket)
                                     ? std::string(ObjectRoleName(static_cast<ObjectRole>(role)))
                                     : "role" + std::to_string(role);
        run.role_peaks.emplace_back(name, peaks[role]);
      }
    }
  };
  for (const auto& [id, p] : core_->participants().all()) {
    view.drivers += p.role == ParticipantRole::kDriver;
    if (p.role == ParticipantRole::kWorker) add_worker(id, p);
  }
  // Workers whose connection is gone: shown dead, not dropped.
  for (const Participant& p : core_->participants().departed()) add_worker(p.id, p);
  return view;
}

std::string CoreDashboardSource::SessionDir() { return core_->session_dir(); }

std::vector<dashboard::JobView> CoreDashboardSource::Jobs() {
  std::vector<dashboard::JobView> jobs;
  for (const JobHistory& history : core_->job_metrics().jobs()) {
    dashboard::JobView& job = jobs.emplace_back();
    job.name = history.name;
    job.driver = history.driver.value();
    job.plan = history.plan;
    job.connected = history.connected;
    job.points_dropped = history.dropped;
    job.steps_reported = history.reported;
    job.step_times = history.step_times;
    job.points.reserve(history.steps.size());
    for (const JobStep& step : history.steps) {
      job.points.push_back(dashboard::JobPoint{.step = step.step,
                                               .time_s = SinceStartMs(step.received) / 1000.0,
                                               .loss = step.loss,
                                               .step_ms = step.step_ms,
                                               .tokens_per_second = step.tokens_per_second,
                                               .samples_per_second = step.samples_per_second,
                                               .validation_loss = step.validation_loss});
    }
  }
  return jobs;
}

dashboard::TimelineView CoreDashboardSource::Timeline() {
  dashboard::TimelineView view;
  view.now_ms = static_cast<double>(SystemMicrosNow()) / 1000.0;
  for (const TimelineSpan& span : core_->RecentSpans(/*last=*/0)) {
    view.spans.push_back(
        dashboard::TimelineSpan{.worker = span.worker.value(),
                                .stream = StreamName(span.stream),
                                .name = span.name,
                                .kind = std::string(SpanKindName(span.kind)),
                                .start_ms = static_cast<double>(span.start_us) / 1000.0,
                                .end_ms = static_cast<double>(span.end_us) / 1000.0,
                                .bytes = span.bytes,
                                .graph_id = span.graph,
                                .instance = span.instance});
  }
  std::stable_sort(view.spans.begin(), view.spans.end(),
                   [](const auto& a, const auto& b) { return a.start_ms < b.start_ms; });
  return view;
}

}  // namespace tessera

#include "dashboard/prometheus.h"

#include <cmath>
#include <functional>

#include <fmt/format.h>

#include "core/version.h"

namespace tessera::dashboard {

namespace {

// Writes one metric family: HELP and TYPE, then its samples.
class Family {
 public:
  Family(std::string& out, std::string_view name, std::string_view type, std::string_view help)
      : out_(out), name_(name) {
    fmt::format_to(std::back_inserter(out_), "# HELP {} {}\n# TYPE {} {}\n", name, help, name,
                   type);
  }
  // `labels`: already formatted (`worker="3"`), or empty.
  void Sample(std::string_view labels, double value) {
    if (!std::isfinite(value)) return;  // a figure not reported is left out, not faked
    if (labels.empty()) {
      fmt::format_to(std::back_inserter(out_), "{} {}\n", name_, Value(value));
    } else {
      fmt::format_to(std::back_inserter(out_), "{}{{{}}} {}\n", name_, labels, Value(value));
    }
  }

 private:
  static std::string Value(double value) {
    // Integral values print without an exponent or a fraction (byte counts stay exact).
    if (value == std::floor(value) && std::fabs(value) < 9.0e15) {
      return fmt::format("{}", static_cast<int64_t>(value));
    }
    return fmt::format("{}", value);
  }
  std::string& out_;
  std::string_view name_;
};

std::string WorkerLabel(const WorkerView& w) { return fmt::format("worker=\"{}\"", w.id); }

std::string JobLabels(const JobView& job) {
  return fmt::format("job=\"{}\",driver=\"{}\"", EscapeLabelValue(job.name), job.driver);
}

}  // namespace

std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string PrometheusText(const ClusterView& cluster, const std::vector<JobView>& jobs) {
  std::string out;
  Family(out, "tessera_build_info", "gauge", "1, labelled with the scheduler's build.")
      .Sample(fmt::format("version=\"{}\",build=\"{}\"", EscapeLabelValue(TesseraVersion()),
                          EscapeLabelValue(BuildDescription())),
              1);
  int alive = 0;
  for (const WorkerView& w : cluster.workers) alive += w.alive;
  Family(out, "tessera_workers_alive", "gauge", "Workers alive.").Sample("", alive);
  Family(out, "tessera_objects", "gauge", "Objects the scheduler tracks.")
      .Sample("", static_cast<double>(cluster.objects));
  Family(out, "tessera_tasks_queued", "gauge",
         "Dynamic tasks waiting for their inputs or collective siblings (the queue depth).")
      .Sample("", static_cast<double>(cluster.tasks_queued));
  Family(out, "tessera_tasks_running", "gauge", "Dynamic tasks dispatched and not finished.")
      .Sample("", static_cast<double>(cluster.tasks_running));
  Family(out, "tessera_tasks_done_total", "counter",
         "Tasks finished: submitted ones and registered graphs' (a training step's).")
      .Sample("", static_cast<double>(cluster.tasks_done));

  // Per worker: one family at a time, a sample per worker.
  auto per_worker = [&](std::string_view name, std::string_view type, std::string_view help,
                        std::string_view extra_label,
                        const std::function<double(const WorkerView&)>& value) {
    Family family(out, name, type, help);
    for (const WorkerView& w : cluster.workers) {
      std::string labels = WorkerLabel(w);
      if (!extra_label.empty()) labels = fmt::format("{},{}", labels, extra_label);
      family.Sample(labels, value(w));
    }
  };
  per_worker("tessera_worker_up", "gauge", "1 while the worker is alive, 0 once declared dead.", "",
             [](const WorkerView& w) { return w.alive ? 1.0 : 0.0; });
  per_worker("tessera_worker_tasks_in_flight", "gauge",
             "Tasks the scheduler dispatched to the worker that have not finished.", "",
             [](const WorkerView& w) { return w.tasks_in_flight; });
  per_worker("tessera_worker_tasks_done_total", "counter", "Tasks the worker finished.", "",
             [](const WorkerView& w) { return static_cast<double>(w.tasks_done); });
  {  // two tiers, one family
    Family family(out, "tessera_memory_used_bytes", "gauge", "Bytes in use per memory tier.");
    for (const WorkerView& w : cluster.workers) {
      family.Sample(WorkerLabel(w) + ",tier=\"host\"", static_cast<double>(w.host_used));
      family.Sample(WorkerLabel(w) + ",tier=\"device\"", static_cast<double>(w.device_bytes));
    }
  }
  per_worker("tessera_memory_capacity_bytes", "gauge", "Capacity per memory tier in bytes.",
             "tier=\"host\"",
             [](const WorkerView& w) { return static_cast<double>(w.host_capacity); });
  per_worker("tessera_memory_spilled_bytes", "gauge",
             "Bytes the worker's object store spilled from the host tier to disk.", "",
             [](const WorkerView& w) { return static_cast<double>(w.spilled); });
  per_worker("tessera_memory_committed_bytes", "gauge",
             "Host bytes the scheduler promised to tasks in flight on the worker.", "",
             [](const WorkerView& w) { return static_cast<double>(w.committed); });
  per_worker("tessera_worker_objects", "gauge", "Objects in the worker's object store.", "",
             [](const WorkerView& w) { return static_cast<double>(w.objects); });
  per_worker("tessera_worker_restores_total", "counter",
             "Objects the worker's object store read back from disk.", "",
             [](const WorkerView& w) { return static_cast<double>(w.restores); });
  per_worker("tessera_worker_cpu_seconds_total", "counter",
             "CPU time of the worker process (user + system) in seconds.", "",
             [](const WorkerView& w) { return w.cpu_seconds; });
  per_worker("tessera_worker_gpu_utilization_ratio", "gauge",
             "Part of the last sample period a kernel ran on the worker's GPU (0-1; NVML's, every "
             "process on the device).",
             "", [](const WorkerView& w) { return w.gpu_use ? w.gpu_use->utilization : NAN; });
  per_worker("tessera_worker_gpu_memory_used_bytes", "gauge",
             "Bytes in use on the worker's GPU, every process's.", "", [](const WorkerView& w) {
               return w.gpu_use ? static_cast<double>(w.gpu_use->memory_used) : NAN;
             });
  per_worker("tessera_worker_gpu_memory_total_bytes", "gauge",
             "The worker's GPU's memory in bytes.", "", [](const WorkerView& w) {
               return w.gpu_use ? static_cast<double>(w.gpu_use->memory_total) : NAN;
             });
  per_worker("tessera_bytes_pulled_total", "counter", "Bytes the worker pulled from peers.", "",
             [](const WorkerView& w) { return static_cast<double>(w.bytes_pulled); });
  per_worker("tessera_bytes_served_total", "counter", "Bytes peers pulled from the worker.", "",
             [](const WorkerView& w) { return static_cast<double>(w.bytes_served); });
  per_worker("tessera_bytes_pushed_total", "counter",
             "Bytes the worker pushed to other workers (graph instances).", "",
             [](const WorkerView& w) { return static_cast<double>(w.bytes_pushed); });
  per_worker("tessera_collective_bytes_sent_total", "counter",
             "Bytes the worker's collective members sent (graph instances).", "",
             [](const WorkerView& w) { return static_cast<double>(w.collective_bytes_sent); });
  per_worker("tessera_model_state_peak_bytes", "gauge",
             "Peak parameters + gradients + optimizer state of the worker's latest graph "
             "instance.",
             "", [](const WorkerView& w) {
               return w.has_last_run ? static_cast<double>(w.last_run.model_state_peak) : NAN;
             });

  // Per job: its latest reported step.
  auto per_job = [&](std::string_view name, std::string_view help,
                     const std::function<double(const JobPoint&)>& value) {
    Family family(out, name, "gauge", help);
    for (const JobView& job : jobs) {
      if (job.points.empty()) continue;
      family.Sample(JobLabels(job), value(job.points.back()));
    }
  };
  per_job("tessera_job_step", "The job's latest reported training step.",
          [](const JobPoint& p) { return static_cast<double>(p.step); });
  per_job("tessera_job_loss", "The training loss of the job's latest step.",
          [](const JobPoint& p) { return p.loss; });
  per_job("tessera_job_step_seconds", "Wall time of the job's latest step in seconds.",
          [](const JobPoint& p) { return p.step_ms / 1000.0; });
  per_job("tessera_job_tokens_per_second", "Training throughput of the job's latest step.",
          [](const JobPoint& p) { return p.tokens_per_second; });
  per_job("tessera_job_samples_per_second", "Training throughput of the job's latest step.",
          [](const JobPoint& p) { return p.samples_per_second; });

  // Per job, over every step it reported.
  {
    Family steps(out, "tessera_job_steps_total", "counter", "Training steps the job reported.");
    for (const JobView& job : jobs) {
      steps.Sample(JobLabels(job), static_cast<double>(job.steps_reported));
    }
  }
  const std::string_view histogram = "tessera_job_step_duration_seconds";
  Family(out, histogram, "histogram", "Wall time of the job's steps in seconds.");
  for (const JobView& job : jobs) {
    const std::string labels = JobLabels(job);
    int64_t cumulative = 0;
    for (size_t b = 0; b < job.step_times.counts.size(); ++b) {
      cumulative += job.step_times.counts[b];
      const std::string le =
          b < kStepSecondsBounds.size() ? fmt::format("{}", kStepSecondsBounds[b]) : "+Inf";
      fmt::format_to(std::back_inserter(out), "{}_bucket{{{},le=\"{}\"}} {}\n", histogram, labels,
                     le, cumulative);
    }
    fmt::format_to(std::back_inserter(out), "{}_sum{{{}}} {}\n", histogram, labels,
                   job.step_times.sum_s);
    fmt::format_to(std::back_inserter(out), "{}_count{{{}}} {}\n", histogram, labels,
                   job.step_times.count);
  }
  return out;
}

}  // namespace tessera::dashboard

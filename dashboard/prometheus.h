// /metrics: the cluster in the Prometheus text exposition format 0.0.4.
//
// Every family has a HELP and a TYPE line before its samples, names start with `tessera_`, and
// per-worker samples carry worker="<id>" (per-job ones job="<name>"). Counters end in _total.
// Families (all from the scheduler's view; workers report their figures with each heartbeat):
//   tessera_workers_alive, tessera_objects, tessera_tasks_{queued,running} (gauges),
//   tessera_tasks_done_total;
//   per worker: tessera_worker_up, tessera_worker_tasks_in_flight,
//   tessera_worker_tasks_done_total, tessera_memory_used_bytes{tier="host"},
//   tessera_memory_capacity_bytes{tier="host"}, tessera_memory_spilled_bytes,
//   tessera_memory_committed_bytes, tessera_bytes_{pulled,served,pushed}_total,
//   tessera_collective_bytes_sent_total, tessera_model_state_peak_bytes (latest run);
//   per job: tessera_job_step, tessera_job_loss, tessera_job_step_seconds,
//   tessera_job_tokens_per_second, tessera_job_samples_per_second (latest reported step; a
//   figure the job does not report is left out); over all its steps tessera_job_steps_total and
//   the histogram tessera_job_step_duration_seconds (buckets kStepSecondsBounds);
//   tessera_build_info{version,build} 1.
// Stateless; thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "dashboard/dashboard_state.h"

namespace tessera::dashboard {

inline constexpr std::string_view kPrometheusContentType =
    "text/plain; version=0.0.4; charset=utf-8";

std::string PrometheusText(const ClusterView& cluster, const std::vector<JobView>& jobs);

// A label value escaped as the format requires (backslash, double quote, newline).
std::string EscapeLabelValue(std::string_view value);

}  // namespace tessera::dashboard

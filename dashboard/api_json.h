// The dashboard's JSON API bodies: /api/cluster, /api/job, /api/timeline, /api/waits and
// /api/logs, rendered from the
// snapshots of dashboard_state.h. The page (assets/dashboard.js) and scripts read the same
// documents; docs/architecture.md ("The dashboard") lists their fields.
//
// Non-finite numbers (a figure a job does not report) become null. Stateless; thread-safe.
#pragma once

#include <string>
#include <vector>

#include "core/session_logs.h"
#include "dashboard/dashboard_state.h"

namespace tessera::dashboard {

// {"session_dir", "uptime_s", "drivers", "objects", "tasks": {"queued", "running", "done"},
//  "workers": [{"id", "hostname", "pid", "alive", "memory": {"host_used", "host_capacity",
//  "spilled", "committed", "device", "spilled_total"}, "store": {"objects", "restores"}, "cpu":
//  {"seconds", "utilization" (cores busy over the last heartbeat)}, "tasks": {"in_flight", "done"},
//  "bytes": {"pulled", "served", "pushed", "collective_sent"}, "last_run": {...} or null}]}
std::string ClusterJson(const ClusterView& cluster);
// {"jobs": [{"name", "driver", "plan", "steps_reported", "connected", "points_dropped",
//  "points": [{"step", "time_s", "loss", "step_ms", "tokens_per_second", "samples_per_second",
//  "validation_loss"}]}]} (oldest job first)
std::string JobsJson(const std::vector<JobView>& jobs);
// {"now_ms", "spans": [{"worker", "stream", "name", "kind", "start_ms", "end_ms", "bytes",
//  "graph", "instance"}]} (times: ms since the Unix epoch)
std::string TimelineJson(const TimelineView& timeline);
// Who waits on what: {"workers": [{"id", "hostname", "pid", "alive", "waits", "blocked_on":
//  [worker ids]}]} (`waits` as `tessera status --waits` prints it after the worker).
std::string WaitsJson(const ClusterView& cluster);
// The session's logs (core/session_logs.h): {"session_dir", "logs": [{"name", "bytes",
//  "modified_unix_s"}]}.
std::string LogsJson(const std::string& session_dir, const std::vector<SessionLog>& logs);

}  // namespace tessera::dashboard

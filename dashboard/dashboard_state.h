// What the dashboard shows, as plain data: a snapshot of the cluster, the jobs' step history and
// the timeline of recent work per worker.
//
// The dashboard module knows nothing of the scheduler's tables: the scheduler fills these structs
// (scheduler/dashboard_view.h) and the dashboard renders them as JSON (api_json.h), Prometheus
// text (prometheus.h) and the page (assets/). A DashboardSource is asked for a fresh snapshot on
// every request, on the thread that serves requests, so a source that reads single-threaded state
// must be called on that state's thread (the scheduler serves HTTP on its io thread).
//
// Units: bytes, milliseconds, seconds as the field names say. Times on the timeline are
// milliseconds on the system clock (since the Unix epoch): workers stamp their spans with it.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/gpu_use.h"

namespace tessera::dashboard {

// A worker's figures for its latest finished graph instance (one step of a training run).
struct LastRun {
  uint64_t graph_id = 0;
  uint64_t instance = 0;
  int64_t model_state_peak = 0;  // parameters + gradients + optimizer state
  int64_t transient_peak = 0;    // gathered parameters + gradient buckets
  int64_t total_peak = 0;        // every role together
  int64_t allocator_peak = 0;
  std::vector<std::pair<std::string, int64_t>> role_peaks;  // role name, peak bytes
  int64_t collective_bytes_sent = 0;
  int64_t pushed_bytes = 0;
  double wall_ms = 0;
};

struct WorkerView {
  uint64_t id = 0;
  std::string hostname;
  int pid = 0;
  bool alive = false;
  std::string data_address;
  std::string gpu;  // empty for a CPU worker
  int cpu_threads = 0;
  std::string cpus;  // the CPUs it may run on ("0-3"; core/cpu_set.h); empty: not said
  // Memory tiers: the host tier (used of capacity) and what was spilled to disk.
  int64_t host_used = 0;
  int64_t host_capacity = 0;
  int64_t spilled = 0;
  int64_t committed = 0;      // promised by the scheduler to tasks in flight there
  int64_t device_bytes = 0;   // the store's device tier
  int64_t spilled_total = 0;  // written to disk so far
  // The store: objects now, and read back from disk so far.
  int64_t objects = 0;
  int64_t restores = 0;
  // CPU: the process's CPU time so far, and the cores it kept busy over its last heartbeat.
  double cpu_seconds = 0;
  double cpu_utilization = 0;
  // GPU: its device's utilisation and memory as of its last heartbeat (a GPU worker whose meter
  // works); none otherwise.
  std::optional<GpuUse> gpu_use;
  // Tasks: dispatched by the scheduler and not finished, and finished (the worker's count).
  int tasks_in_flight = 0;
  int64_t tasks_done = 0;
  // Data movement, cumulative.
  int64_t bytes_pulled = 0;
  int64_t bytes_served = 0;
  int64_t bytes_pushed = 0;           // summed over its run reports
  int64_t collective_bytes_sent = 0;  // summed over its run reports
  int64_t instances_finished = 0;
  bool has_last_run = false;
  LastRun last_run;
  // Who waits on what (scheduler/waits.h): what it runs or waits for, explained, and the
  // workers it waits for that are silent or absent.
  std::string waits;
  std::vector<uint64_t> blocked_on;
};

struct ClusterView {
  std::string session_dir;
  double uptime_s = 0;
  int drivers = 0;
  int64_t objects = 0;
  int64_t tasks_queued = 0;   // dynamic tasks waiting for inputs or siblings
  int64_t tasks_running = 0;  // dispatched
  int64_t tasks_done = 0;
  std::vector<WorkerView> workers;  // ascending id, dead ones too
};

// One training step as the driver reported it (Cluster::ReportProgress). NaN: not reported.
struct JobPoint {
  int64_t step = 0;
  double time_s = 0;  // when the scheduler received it, since its start
  double loss = std::numeric_limits<double>::quiet_NaN();
  double step_ms = std::numeric_limits<double>::quiet_NaN();
  double tokens_per_second = std::numeric_limits<double>::quiet_NaN();
  double samples_per_second = std::numeric_limits<double>::quiet_NaN();
  double validation_loss = std::numeric_limits<double>::quiet_NaN();  // when evaluated
};

// Upper bounds, in seconds, of the step-time histogram's buckets (/metrics
// tessera_job_step_duration_seconds); a last bucket takes the rest (+Inf).
inline constexpr std::array<double, 13> kStepSecondsBounds = {
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};

// The step times of every step a job reported (its points are bounded; this is not): counts
// per bucket (not cumulative), their sum and count.
struct StepTimeHistogram {
  std::array<int64_t, kStepSecondsBounds.size() + 1> counts{};
  double sum_s = 0;
  int64_t count = 0;
  void Add(double seconds) {
    size_t bucket = 0;
    while (bucket < kStepSecondsBounds.size() && seconds > kStepSecondsBounds[bucket]) ++bucket;
    ++counts[bucket];
    sum_s += seconds;
    ++count;
  }
};

struct JobView {
  std::string name;
  uint64_t driver = 0;  // the reporting driver's participant id
  std::string plan;     // the last plan it reported
  bool connected = false;
  int64_t points_dropped = 0;    // older points forgotten (the history is bounded)
  std::vector<JobPoint> points;  // ascending arrival
  int64_t steps_reported = 0;    // every step reported, dropped points included
  StepTimeHistogram step_times;  // of the steps that reported their time
};

// A span of work on a worker: a task, a push of an object to another worker, or a collective
// member (core/timeline.h, the scheduler's TraceStore). `kind` is one of forward, backward,
// backward_input, backward_weight, optimizer, collective, transfer, other; `stream` is where it
// ran: "compute N" (a thread slot), "transfer" or "collective".
struct TimelineSpan {
  uint64_t worker = 0;
  std::string stream;
  std::string name;
  std::string kind;
  double start_ms = 0;
  double end_ms = 0;
  int64_t bytes = 0;  // pushes and collective members: bytes sent
  uint64_t graph_id = 0;
  uint64_t instance = 0;
};

// The spans of the latest finished graph instances the scheduler keeps (trace_instances).
struct TimelineView {
  double now_ms = 0;
  std::vector<TimelineSpan> spans;  // ascending start
};

// Where the dashboard's figures come from. Called on the serving thread, once per request.
class DashboardSource {
 public:
  virtual ~DashboardSource() = default;
  virtual ClusterView Cluster() = 0;
  virtual std::vector<JobView> Jobs() = 0;
  virtual TimelineView Timeline() = 0;
  // The session directory whose logs /api/logs serves (core/session_logs.h); empty: none.
  virtual std::string SessionDir() { return std::string(); }
};

}  // namespace tessera::dashboard

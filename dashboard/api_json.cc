#include "dashboard/api_json.h"

#include <cmath>

#include <nlohmann/json.hpp>

namespace tessera::dashboard {

namespace {

using nlohmann::json;

json Number(double value) { return std::isfinite(value) ? json(value) : json(nullptr); }

json LastRunJson(const LastRun& run) {
  json roles = json::object();
  for (const auto& [name, bytes] : run.role_peaks) roles[name] = bytes;
  return {{"graph", run.graph_id},
          {"instance", run.instance},
          {"model_state_peak", run.model_state_peak},
          {"transient_peak", run.transient_peak},
          {"total_peak", run.total_peak},
          {"allocator_peak", run.allocator_peak},
          {"role_peaks", std::move(roles)},
          {"collective_bytes_sent", run.collective_bytes_sent},
          {"pushed_bytes", run.pushed_bytes},
          {"wall_ms", Number(run.wall_ms)}};
}

}  // namespace

std::string ClusterJson(const ClusterView& cluster) {
  json workers = json::array();
  for (const WorkerView& w : cluster.workers) {
    workers.push_back({
        {"id", w.id},
        {"hostname", w.hostname},
        {"pid", w.pid},
        {"alive", w.alive},
        {"data_address", w.data_address},
        {"gpu", w.gpu},
        {"cpu_threads", w.cpu_threads},
        {"cpus", w.cpus},
        {"memory",
         {{"host_used", w.host_used},
          {"host_capacity", w.host_capacity},
          {"spilled", w.spilled},
          {"committed", w.committed},
          {"device", w.device_bytes},
          {"spilled_total", w.spilled_total}}},
        {"store", {{"objects", w.objects}, {"restores", w.restores}}},
        {"cpu", {{"seconds", Number(w.cpu_seconds)}, {"utilization", Number(w.cpu_utilization)}}},
        {"gpu_use", w.gpu_use ? json{{"utilization", Number(w.gpu_use->utilization)},
                                     {"memory_used", w.gpu_use->memory_used},
                                     {"memory_total", w.gpu_use->memory_total}}
                              : json(nullptr)},
        {"tasks", {{"in_flight", w.tasks_in_flight}, {"done", w.tasks_done}}},
        {"bytes",
         {{"pulled", w.bytes_pulled},
          {"served", w.bytes_served},
          {"pushed", w.bytes_pushed},
          {"collective_sent", w.collective_bytes_sent}}},
        {"instances_finished", w.instances_finished},
        {"last_run", w.has_last_run ? LastRunJson(w.last_run) : json(nullptr)},
    });
  }
  json out = {{"session_dir", cluster.session_dir},
              {"uptime_s", Number(cluster.uptime_s)},
              {"drivers", cluster.drivers},
              {"objects", cluster.objects},
              {"tasks",
               {{"queued", cluster.tasks_queued},
                {"running", cluster.tasks_running},
                {"done", cluster.tasks_done}}},
              {"workers", std::move(workers)}};
  // Replace invalid UTF-8 (a hostname is the only free text) rather than throw.
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string JobsJson(const std::vector<JobView>& jobs) {
  json list = json::array();
  for (const JobView& job : jobs) {
    json points = json::array();
    for (const JobPoint& p : job.points) {
      points.push_back({{"step", p.step},
                        {"time_s", Number(p.time_s)},
                        {"loss", Number(p.loss)},
                        {"step_ms", Number(p.step_ms)},
                        {"tokens_per_second", Number(p.tokens_per_second)},
                        {"samples_per_second", Number(p.samples_per_second)},
                        {"validation_loss", Number(p.validation_loss)}});
    }
    list.push_back({{"name", job.name},
                    {"driver", job.driver},
                    {"plan", job.plan},
                    {"steps_reported", job.steps_reported},
                    {"connected", job.connected},
                    {"points_dropped", job.points_dropped},
                    {"points", std::move(points)}});
  }
  json out = {{"jobs", std::move(list)}};
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string TimelineJson(const TimelineView& timeline) {
  json spans = json::array();
  for (const TimelineSpan& s : timeline.spans) {
    spans.push_back({{"worker", s.worker},
                     {"stream", s.stream},
                     {"name", s.name},
                     {"kind", s.kind},
                     {"start_ms", Number(s.start_ms)},
                     {"end_ms", Number(s.end_ms)},
                     {"bytes", s.bytes},
                     {"graph", s.graph_id},
                     {"instance", s.instance}});
  }
  json out = {{"now_ms", Number(timeline.now_ms)}, {"spans", std::move(spans)}};
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string WaitsJson(const ClusterView& cluster) {
  json workers = json::array();
  for (const WorkerView& w : cluster.workers) {
    workers.push_back({{"id", w.id},
                       {"hostname", w.hostname},
                       {"pid", w.pid},
                       {"alive", w.alive},
                       {"waits", w.waits},
                       {"blocked_on", w.blocked_on}});
  }
  // Host names and waits come off the wire as bytes: invalid UTF-8 is replaced (dump would
  // throw on it, and the exception would end the scheduler's io thread).
  return json{{"workers", std::move(workers)}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string LogsJson(const std::string& session_dir, const std::vector<SessionLog>& logs) {
  json list = json::array();
  for (const SessionLog& log : logs) {
    list.push_back(
        {{"name", log.name}, {"bytes", log.bytes}, {"modified_unix_s", log.modified_unix_s}});
  }
  return json{{"session_dir", session_dir}, {"logs", std::move(list)}}.dump(
      -1, ' ', false, json::error_handler_t::replace);
}

}  // namespace tessera::dashboard

#include "client/trace.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "core/atomic_file.h"

namespace tessera {

namespace {

// A JSON string literal (quotes included).
std::string Quoted(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<int>(c));
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

int Tid(int stream) {
  if (stream == kCollectiveStream) return kCollectiveTid;
  if (stream == kTransferStream) return kTransferTid;
  return stream;
}

int64_t Pid(WorkerId worker) { return worker.valid() ? static_cast<int64_t>(worker.value()) : 0; }

}  // namespace

std::string ChromeTraceJson(const Timeline& timeline) {
  int64_t origin = std::numeric_limits<int64_t>::max();
  for (const TimelineSpan& span : timeline.spans) origin = std::min(origin, span.start_us);
  if (timeline.spans.empty()) origin = 0;

  std::vector<std::string> events;
  // Processes: those listed, and any a span names that is not.
  std::map<int64_t, std::string> process_names;
  for (const TimelineProcess& process : timeline.processes) {
    const std::string where =
        process.hostname.empty() ? "" : fmt::format(" ({}:{})", process.hostname, process.pid);
    process_names[Pid(process.worker)] =
        process.worker.valid() ? fmt::format("worker {}{}", process.worker.value(), where)
                               : fmt::format("driver{}", where);
  }
  std::set<std::pair<int64_t, int>> threads;
  for (const TimelineSpan& span : timeline.spans) {
    const int64_t pid = Pid(span.worker);
    if (!process_names.contains(pid)) {
      process_names[pid] = span.worker.valid() ? fmt::format("worker {}", pid) : "driver";
    }
    threads.emplace(pid, span.stream);
  }
  events.reserve(process_names.size() + threads.size() + timeline.spans.size());
  for (const auto& [pid, name] : process_names) {
    events.push_back(
        fmt::format(R"({{"ph":"M","name":"process_name","pid":{},"tid":0,"args":{{"name":{}}}}})",
                    pid, Quoted(name)));
  }
  for (const auto& [pid, stream] : threads) {
    events.push_back(
        fmt::format(R"({{"ph":"M","name":"thread_name","pid":{},"tid":{},"args":{{"name":{}}}}})",
                    pid, Tid(stream), Quoted(StreamName(stream))));
  }
  for (const TimelineSpan& span : timeline.spans) {
    const std::string name =
        span.name.empty() ? std::string(span.op.empty() ? "task" : span.op) : span.name;
    events.push_back(fmt::format(
        R"({{"ph":"X","name":{},"cat":{},"ts":{},"dur":{},"pid":{},"tid":{},)"
        R"("args":{{"layer":{},"op":{},"bytes":{},"graph":{},"instance":{}}}}})",
        Quoted(name), Quoted(SpanKindName(span.kind)), span.start_us - origin,
        std::max<int64_t>(0, span.end_us - span.start_us), Pid(span.worker), Tid(span.stream),
        Quoted(span.layer), Quoted(span.op), span.bytes, span.graph, span.instance));
  }
  std::string json = "{\"traceEvents\":[\n";
  for (size_t i = 0; i < events.size(); ++i) {
    json += events[i];
    json += i + 1 < events.size() ? ",\n" : "\n";
  }
  json += fmt::format(R"(],"displayTimeUnit":"ms","otherData":{{"origin_unix_us":{}}}}})", origin);
  json += "\n";
  return json;
}

Status WriteChromeTrace(const std::string& path, const Timeline& timeline) {
  return WriteFileAtomically(path, ChromeTraceJson(timeline))
      .WithContext("writing the trace " + path);
}

}  // namespace tessera

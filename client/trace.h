// Traces of training steps as Chrome/Perfetto trace JSON (open in ui.perfetto.dev or
// chrome://tracing).
//
// A Timeline (core/timeline.h: from GraphBackend::LastTimeline, Trainer::StepTimeline or
// Cluster::Timeline) becomes one JSON object:
//
//   {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {"origin_unix_us": T0}}
//
// with, per process (a worker, or the driver's own process in process):
//   {"ph":"M", "name":"process_name", "pid":P, "tid":0, "args":{"name":"worker 2 (host:pid)"}}
// per stream of that process ("compute N" thread slots, "collective", "transfer"):
//   {"ph":"M", "name":"thread_name", "pid":P, "tid":T, "args":{"name":"compute 0"}}
// and per span a complete event:
//   {"ph":"X", "name":task, "cat":kind, "ts":start, "dur":end-start, "pid":P, "tid":T,
//    "args":{"layer":..., "op":..., "bytes":..., "graph":..., "instance":...}}
// Times are microseconds from T0, the earliest span's start (system clock, microseconds since
// the Unix epoch). pid is the worker id (0 in process); tid is the compute slot, or
// kCollectiveTid / kTransferTid.
//
// Thread safety: pure functions.
#pragma once

#include <string>

#include "core/status.h"
#include "core/timeline.h"

namespace tessera {

inline constexpr int kCollectiveTid = 1000;
inline constexpr int kTransferTid = 1001;

// The trace JSON of `timeline`.
std::string ChromeTraceJson(const Timeline& timeline);

// Writes ChromeTraceJson(timeline) to `path` atomically (core/atomic_file.h): errors name the
// path and the system's reason.
Status WriteChromeTrace(const std::string& path, const Timeline& timeline);

}  // namespace tessera

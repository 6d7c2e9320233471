// WorkTimeline: the latest spans of work per worker, for the dashboard's timeline.
//
// Today each span is one worker's part of one graph instance (a training step's share on that
// worker): it ends when the scheduler receives the worker's InstanceFinished and lasts the
// report's wall time. Workers do not report per-task times yet, so the spans are not split into
// forward/backward/optimizer/collective/transfer; the timeline says so (granularity
// "instances"). Bounded: the newest kMaxSpans are kept.
//
// Thread safety: none; the scheduler's io thread drives it.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>

#include "core/ids.h"

namespace tessera {

struct WorkSpan {
  WorkerId worker;
  uint64_t graph_id = 0;
  uint64_t instance = 0;
  std::chrono::steady_clock::time_point start;
  std::chrono::steady_clock::time_point end;
};

class WorkTimeline {
 public:
  static constexpr size_t kMaxSpans = 4096;

  // `worker` finished its part of an instance at `finished`, after `wall_micros` of work.
  void RecordInstance(WorkerId worker, uint64_t graph_id, uint64_t instance,
                      std::chrono::steady_clock::time_point finished, int64_t wall_micros);
  // Oldest first.
  const std::deque<WorkSpan>& spans() const { return spans_; }

 private:
  std::deque<WorkSpan> spans_;
};

}  // namespace tessera

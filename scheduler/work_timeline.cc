#include "scheduler/work_timeline.h"

#include <algorithm>

namespace tessera {

void WorkTimeline::RecordInstance(WorkerId worker, uint64_t graph_id, uint64_t instance,
                                  std::chrono::steady_clock::time_point finished,
                                  int64_t wall_micros) {
  if (spans_.size() >= kMaxSpans) spans_.pop_front();
  spans_.push_back(
      WorkSpan{.worker = worker,
               .graph_id = graph_id,
               .instance = instance,
               .start = finished - std::chrono::microseconds(std::max<int64_t>(0, wall_micros)),
               .end = finished});
}

}  // namespace tessera

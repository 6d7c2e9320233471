// The order each worker's communication channels run their collectives in, as the runtime does:
// the scheduler numbers the graph's collectives in one global order (OrderCollectives:
// dependencies first, then the first member's place in the graph; scheduler/graph_registry.cc)
// and each worker runs each channel's members strictly in that order (worker/collective_engine.h),
// so a collective that is ready waits for every earlier one of its channel on each of its
// members' workers. The memory model's unit-time simulation and the step simulation both follow
// it (ChannelQueues).
//
// Internal to planner/. Thread safety: ChannelQueues is a value; one simulation owns it.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "core/graph.h"
#include "core/status.h"

namespace tessera {

class ChannelQueues {
 public:
  // Per (worker, channel), the collectives (by their `collective` attribute) in the order the
  // runtime runs them. Errors as OrderCollectives's.
  static Result<ChannelQueues> Of(const Graph& graph);

  // Whether `collective` is the next one of its channel on every worker it has a member on.
  bool IsNext(int64_t collective) const;
  // Marks `collective` as run (its members' queues move on) and returns the collectives that
  // are now next in one of those queues.
  std::vector<int64_t> Pop(int64_t collective);

 private:
  using Queue = std::pair<WorkerId, int>;  // worker, channel
  std::map<Queue, std::vector<int64_t>> order_;
  std::map<Queue, size_t> next_;
  std::map<int64_t, std::vector<Queue>> queues_of_;  // collective -> its members' queues
};

}  // namespace tessera

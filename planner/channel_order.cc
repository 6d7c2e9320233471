#include "planner/channel_order.h"

#include <algorithm>
#include <optional>

#include "core/collective_task.h"

namespace tessera {

Result<ChannelQueues> ChannelQueues::Of(const Graph& graph) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> order,
                           OrderCollectives(graph.tasks(), [&graph](ObjectId object) {
                             return graph.object(object).producer;
                           }));
  std::map<int64_t, size_t> rank;
  for (size_t i = 0; i < order.size(); ++i) rank[order[i]] = i;
  ChannelQueues queues;
  for (const TaskSpec& task : graph.tasks()) {
    TESSERA_ASSIGN_OR_RETURN(std::optional<CollectiveMembership> member, CollectiveOf(task));
    if (!member || member->group_size <= 1) continue;
    const Queue queue{task.pinned_worker, member->channel};
    std::vector<Queue>& of = queues.queues_of_[member->collective];
    if (std::find(of.begin(), of.end(), queue) == of.end()) {
      of.push_back(queue);
      queues.order_[queue].push_back(member->collective);
    }
  }
  for (auto& [queue, collectives] : queues.order_) {
    std::sort(collectives.begin(), collectives.end(),
              [&rank](int64_t a, int64_t b) { return rank.at(a) < rank.at(b); });
    queues.next_[queue] = 0;
  }
  return queues;
}

bool ChannelQueues::IsNext(int64_t collective) const {
  const auto of = queues_of_.find(collective);
  if (of == queues_of_.end()) return true;
  return std::all_of(of->second.begin(), of->second.end(), [&](const Queue& queue) {
    const std::vector<int64_t>& order = order_.at(queue);
    const size_t next = next_.at(queue);
    return next < order.size() && order[next] == collective;
  });
}

std::vector<int64_t> ChannelQueues::Pop(int64_t collective) {
  std::vector<int64_t> now_next;
  const auto of = queues_of_.find(collective);
  if (of == queues_of_.end()) return now_next;
  for (const Queue& queue : of->second) {
    const std::vector<int64_t>& order = order_.at(queue);
    size_t& next = next_.at(queue);
    if (next < order.size() && order[next] == collective) ++next;
    if (next < order.size()) now_next.push_back(order[next]);
  }
  return now_next;
}

}  // namespace tessera

#include "core/collective_task.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <queue>

namespace tessera {

void MoveSequenceBlocks(void* sequence, void* blocks, int64_t group, int64_t batch,
                        int64_t positions, int64_t row_bytes, bool to_sequence) {
  const auto bytes = static_cast<size_t>(positions * row_bytes);
  for (int64_t j = 0; j < group; ++j) {
    for (int64_t b = 0; b < batch; ++b) {
      char* block = static_cast<char*>(blocks) + (j * batch + b) * positions * row_bytes;
      char* whole = static_cast<char*>(sequence) + (b * group + j) * positions * row_bytes;
      if (to_sequence) {
        std::memcpy(whole, block, bytes);
      } else {
        std::memcpy(block, whole, bytes);
      }
    }
  }
}

bool IsCollectiveOp(std::string_view op) {
  return op == "all_reduce" || op == "reduce_scatter" || op == "all_gather" ||
         op == "all_gather_in_place" || op == "all_to_all" || op == "broadcast" ||
         op == "compressed_all_reduce";
}

Result<int64_t> CompressedCount(const Attrs& attrs, int64_t numel) {
  const int64_t count = attrs.GetInt(kCompressedCountAttr, numel);
  if (count < std::min<int64_t>(numel, 1) || count > numel) {
    return InvalidArgument(
        "attribute '{}' is {}: a compressed all-reduce compresses 1 to {} elements of its x "
        "(the group's own; the rest is padding)",
        kCompressedCountAttr, count, numel);
  }
  return count;
}

Result<std::optional<CollectiveMembership>> CollectiveOf(const TaskSpec& task) {
  if (!task.attrs.Has(kCollectiveAttr)) return std::optional<CollectiveMembership>();
  CollectiveMembership membership;
  auto context = [&](const Status& status) {
    return status.WithContext(fmt::format("collective task '{}'", task.name));
  };
  Result<int64_t> collective = task.attrs.GetInt(kCollectiveAttr);
  if (!collective.ok()) return context(collective.status());
  Result<int64_t> rank = task.attrs.GetInt(kRankAttr);
  if (!rank.ok()) return context(rank.status());
  Result<int64_t> size = task.attrs.GetInt(kGroupSizeAttr);
  if (!size.ok()) return context(size.status());
  if (*size > kMaxCollectiveGroupSize) {
    return InvalidArgument(
        "collective task '{}': a group of {} members is more than any cluster holds (at most {})",
        task.name, *size, kMaxCollectiveGroupSize);
  }
  if (*size < 1 || *rank < 0 || *rank >= *size) {
    return InvalidArgument("collective task '{}': rank {} is not in a group of {}", task.name,
                           *rank, *size);
  }
  const int64_t channel = task.attrs.GetInt(kChannelAttr, 0);
  if (channel < 0 || channel >= kCollectiveChannels) {
    return InvalidArgument("collective task '{}': channel {} is not one of 0 .. {}", task.name,
                           channel, kCollectiveChannels - 1);
  }
  membership.collective = *collective;
  membership.rank = static_cast<int>(*rank);
  membership.group_size = static_cast<int>(*size);
  membership.channel = static_cast<int>(channel);
  return std::optional<CollectiveMembership>(membership);
}

Status ValidateCollectives(const std::vector<TaskSpec>& tasks) {
  struct Seen {
    int group_size = 0;
    int channel = 0;
    std::string op;
    // By rank: the task's name. A map, not a vector of group_size: what is kept grows with the
    // members there are, never with the size a member claims.
    std::map<int, std::string> members;
  };
  std::map<int64_t, Seen> collectives;
  for (const TaskSpec& task : tasks) {
    TESSERA_ASSIGN_OR_RETURN(std::optional<CollectiveMembership> membership, CollectiveOf(task));
    if (!membership) continue;
    Seen& seen = collectives[membership->collective];
    if (seen.members.empty()) {
      seen.group_size = membership->group_size;
      seen.channel = membership->channel;
      seen.op = task.op;
    }
    if (membership->channel != seen.channel) {
      return InvalidArgument(
          "collective {}: task '{}' is on channel {}, its other members on channel {}",
          membership->collective, task.name, membership->channel, seen.channel);
    }
    if (membership->group_size != seen.group_size || task.op != seen.op) {
      return InvalidArgument(
          "collective {}: task '{}' ({} over {} ranks) disagrees with its other members ({} over "
          "{} ranks)",
          membership->collective, task.name, task.op, membership->group_size, seen.op,
          seen.group_size);
    }
    auto [slot, added] = seen.members.emplace(membership->rank, task.name);
    if (!added) {
      return InvalidArgument("collective {}: tasks '{}' and '{}' are both rank {}",
                             membership->collective, slot->second, task.name, membership->rank);
    }
  }
  for (const auto& [id, seen] : collectives) {
    // Ranks are in [0, group_size) (CollectiveOf): the first one missing is the first gap.
    int rank = 0;
    for (const auto& [member_rank, name] : seen.members) {
      if (member_rank != rank) break;
      ++rank;
    }
    if (rank < seen.group_size) {
      return InvalidArgument("collective {} ({}, {} ranks) has no member of rank {}", id, seen.op,
                             seen.group_size, rank);
    }
  }
  return Status::Ok();
}

Result<std::vector<int64_t>> OrderCollectives(const std::vector<TaskSpec>& tasks,
                                              const std::function<TaskId(ObjectId)>& producer_of) {
  // Number the collectives by their first member's position in `tasks`.
  std::map<int64_t, int> index_of;
  std::vector<int64_t> ids;
  std::vector<int> member_of(tasks.size(), -1);  // task index -> collective index
  for (size_t t = 0; t < tasks.size(); ++t) {
    TESSERA_ASSIGN_OR_RETURN(std::optional<CollectiveMembership> membership,
                             CollectiveOf(tasks[t]));
    if (!membership) continue;
    auto [it, added] = index_of.emplace(membership->collective, static_cast<int>(ids.size()));
    if (added) ids.push_back(membership->collective);
    member_of[t] = it->second;
  }
  const size_t n = ids.size();
  if (n == 0) return ids;
  if (n > kMaxCollectivesPerGraph) {
    return InvalidArgument("the graph has {} collectives, more than the limit of {}", n,
                           kMaxCollectivesPerGraph);
  }
  // What each task waits for: the producers of its inputs, and the tasks it is after (control
  // edges: a pipeline schedule's order, which can run against the tasks' numbering).
  std::vector<std::vector<size_t>> waits_for(tasks.size());
  std::vector<std::vector<size_t>> waited_by(tasks.size());
  for (size_t t = 0; t < tasks.size(); ++t) {
    for (ObjectId input : tasks[t].inputs) {
      const TaskId producer = producer_of(input);
      if (producer.valid()) waits_for[t].push_back(producer.value() - 1);
    }
    for (TaskId earlier : tasks[t].after) waits_for[t].push_back(earlier.value() - 1);
    for (size_t u : waits_for[t]) {
      if (u >= tasks.size()) {
        return InvalidArgument("task '{}' waits for task {}, which is not in the graph",
                               tasks[t].name, u + 1);
      }
      waited_by[u].push_back(t);
    }
  }
  // The tasks in an order that respects both (Kahn's algorithm, lowest index first).
  std::vector<size_t> task_order;
  {
    std::vector<size_t> pending(tasks.size());
    std::priority_queue<size_t, std::vector<size_t>, std::greater<>> free;
    for (size_t t = 0; t < tasks.size(); ++t) {
      pending[t] = waits_for[t].size();
      if (pending[t] == 0) free.push(t);
    }
    while (!free.empty()) {
      const size_t t = free.top();
      free.pop();
      task_order.push_back(t);
      for (size_t u : waited_by[t]) {
        if (--pending[u] == 0) free.push(u);
      }
    }
    if (task_order.size() != tasks.size()) {
      return InvalidArgument(
          "the graph's tasks wait for each other in a cycle (through inputs "
          "and control edges): no order can run them");
    }
  }
  // reaches[t]: the collectives task t depends on (through any chain), itself included if a
  // member; one bit per collective.
  const size_t words = (n + 63) / 64;
  std::vector<std::vector<uint64_t>> reaches(tasks.size(), std::vector<uint64_t>(words, 0));
  std::vector<std::vector<bool>> before(n, std::vector<bool>(n, false));  // before[a][b]: a -> b
  for (size_t t : task_order) {
    for (size_t u : waits_for[t]) {
      const auto& from = reaches[u];
      for (size_t w = 0; w < words; ++w) reaches[t][w] |= from[w];
    }
    if (member_of[t] < 0) continue;
    const size_t b = static_cast<size_t>(member_of[t]);
    for (size_t a = 0; a < n; ++a) {
      if (a != b && (reaches[t][a / 64] >> (a % 64) & 1)) before[a][b] = true;
    }
    reaches[t][b / 64] |= uint64_t{1} << (b % 64);
  }
  // Kahn's algorithm; among the ready, the earliest-numbered first.
  std::vector<int> blockers(n, 0);
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = 0; b < n; ++b) blockers[b] += before[a][b];
  }
  std::priority_queue<size_t, std::vector<size_t>, std::greater<>> ready;
  for (size_t c = 0; c < n; ++c) {
    if (blockers[c] == 0) ready.push(c);
  }
  std::vector<int64_t> order;
  while (!ready.empty()) {
    const size_t a = ready.top();
    ready.pop();
    order.push_back(ids[a]);
    for (size_t b = 0; b < n; ++b) {
      if (before[a][b] && --blockers[b] == 0) ready.push(b);
    }
  }
  if (order.size() != n) {
    for (size_t a = 0; a < n; ++a) {
      for (size_t b = 0; b < n; ++b) {
        if (blockers[a] > 0 && blockers[b] > 0 && before[a][b] && before[b][a]) {
          return InvalidArgument(
              "collectives {} and {} depend on each other (a member of each waits for the "
              "other's result): every order deadlocks",
              ids[a], ids[b]);
        }
      }
    }
    return InvalidArgument("the graph's collectives depend on each other in a cycle");
  }
  return order;
}

}  // namespace tessera

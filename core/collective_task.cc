#include "core/collective_task.h"

#include <map>

namespace tessera {

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
  if (*size < 1 || *rank < 0 || *rank >= *size) {
    return InvalidArgument("collective task '{}': rank {} is not in a group of {}", task.name,
                           *rank, *size);
  }
  membership.collective = *collective;
  membership.rank = static_cast<int>(*rank);
  membership.group_size = static_cast<int>(*size);
  return std::optional<CollectiveMembership>(membership);
}

Status ValidateCollectives(const Graph& graph) {
  struct Seen {
    int group_size = 0;
    std::string op;
    std::vector<std::string> members;  // by rank: the task's name
  };
  std::map<int64_t, Seen> collectives;
  for (const TaskSpec& task : graph.tasks()) {
    TESSERA_ASSIGN_OR_RETURN(std::optional<CollectiveMembership> membership, CollectiveOf(task));
    if (!membership) continue;
    Seen& seen = collectives[membership->collective];
    if (seen.members.empty()) {
      seen.group_size = membership->group_size;
      seen.op = task.op;
      seen.members.resize(static_cast<size_t>(membership->group_size));
    }
    if (membership->group_size != seen.group_size || task.op != seen.op) {
      return InvalidArgument(
          "collective {}: task '{}' ({} over {} ranks) disagrees with its other members ({} over "
          "{} ranks)",
          membership->collective, task.name, task.op, membership->group_size, seen.op,
          seen.group_size);
    }
    std::string& slot = seen.members[static_cast<size_t>(membership->rank)];
    if (!slot.empty()) {
      return InvalidArgument("collective {}: tasks '{}' and '{}' are both rank {}",
                             membership->collective, slot, task.name, membership->rank);
    }
    slot = task.name;
  }
  for (const auto& [id, seen] : collectives) {
    for (size_t rank = 0; rank < seen.members.size(); ++rank) {
      if (seen.members[rank].empty()) {
        return InvalidArgument("collective {} ({}, {} ranks) has no member of rank {}", id,
                               seen.op, seen.group_size, rank);
      }
    }
  }
  return Status::Ok();
}

}  // namespace tessera

#include "scheduler/gang.h"

#include <algorithm>

namespace tessera {

GangTable::Pending& GangTable::Entry(const Key& key, int group_size) {
  Pending& pending = pending_[key];
  if (pending.group_size == 0) pending.group_size = group_size;
  return pending;
}

Result<std::vector<TaskId>> GangTable::MemberReady(WorkerId driver,
                                                   const CollectiveMembership& membership,
                                                   TaskId task, std::string_view name) {
  const Key key(driver, membership.collective);
  Pending& pending = Entry(key, membership.group_size);
  if (!pending.failed.ok()) return pending.failed;
  if (membership.group_size != pending.group_size || pending.settled.contains(membership.rank)) {
    return InvalidArgument(
        "task '{}' is rank {} of {} in collective {}, which has {} members and may have that rank "
        "taken",
        name, membership.rank, membership.group_size, membership.collective, pending.group_size);
  }
  pending.ready[membership.rank] = task;
  pending.settled.insert(membership.rank);
  if (!pending.all_settled()) return std::vector<TaskId>();
  // Every rank is settled and none failed: every rank 0 .. group_size-1 is ready.
  std::vector<TaskId> members;
  members.reserve(pending.ready.size());
  for (const auto& [rank, id] : pending.ready) members.push_back(id);
  pending_.erase(key);
  return members;
}

std::vector<TaskId> GangTable::MemberFailed(WorkerId driver, const CollectiveMembership& membership,
                                            TaskId task, const Status& why) {
  const Key key(driver, membership.collective);
  Pending& pending = Entry(key, membership.group_size);
  const int rank = membership.rank;
  if (rank < pending.group_size) {
    if (auto it = pending.ready.find(rank); it != pending.ready.end() && it->second == task) {
      pending.ready.erase(it);
    }
    pending.settled.insert(rank);
  }
  if (pending.failed.ok()) pending.failed = why;
  std::vector<TaskId> siblings;
  siblings.reserve(pending.ready.size());
  for (const auto& [sibling_rank, id] : pending.ready) siblings.push_back(id);
  pending.ready.clear();
  if (pending.all_settled()) pending_.erase(key);
  return siblings;
}

}  // namespace tessera

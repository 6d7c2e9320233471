#include "scheduler/gang.h"

#include <algorithm>

namespace tessera {

GangTable::Pending& GangTable::Entry(const Key& key, int group_size) {
  Pending& pending = pending_[key];
  if (pending.group_size == 0) {
    pending.group_size = group_size;
    pending.ready.resize(static_cast<size_t>(group_size));
    pending.settled.assign(static_cast<size_t>(group_size), false);
  }
  return pending;
}

bool GangTable::Pending::all_settled() const {
  return std::all_of(settled.begin(), settled.end(), [](bool s) { return s; });
}

Result<std::vector<TaskId>> GangTable::MemberReady(WorkerId driver,
                                                   const CollectiveMembership& membership,
                                                   TaskId task, std::string_view name) {
  const Key key(driver, membership.collective);
  Pending& pending = Entry(key, membership.group_size);
  if (!pending.failed.ok()) return pending.failed;
  if (membership.group_size != pending.group_size ||
      pending.settled[static_cast<size_t>(membership.rank)]) {
    return InvalidArgument(
        "task '{}' is rank {} of {} in collective {}, which has {} members and may have that rank "
        "taken",
        name, membership.rank, membership.group_size, membership.collective, pending.group_size);
  }
  pending.ready[static_cast<size_t>(membership.rank)] = task;
  pending.settled[static_cast<size_t>(membership.rank)] = true;
  if (!pending.all_settled()) return std::vector<TaskId>();
  std::vector<TaskId> members = std::move(pending.ready);
  pending_.erase(key);
  return members;
}

std::vector<TaskId> GangTable::MemberFailed(WorkerId driver, const CollectiveMembership& membership,
                                            TaskId task, const Status& why) {
  const Key key(driver, membership.collective);
  Pending& pending = Entry(key, membership.group_size);
  const size_t rank = static_cast<size_t>(membership.rank);
  if (rank < pending.ready.size()) {
    if (pending.ready[rank] == task) pending.ready[rank] = TaskId();
    pending.settled[rank] = true;
  }
  if (pending.failed.ok()) pending.failed = why;
  std::vector<TaskId> siblings;
  for (TaskId& id : pending.ready) {
    if (id.valid()) siblings.push_back(std::exchange(id, TaskId()));
  }
  if (pending.all_settled()) pending_.erase(key);
  return siblings;
}

}  // namespace tessera

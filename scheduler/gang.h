// GangTable: dynamic collectives assembling, until every member is ready.
//
// The members of a collective need distinct workers, and their group (those workers in rank
// order, core/collective_task.h) is known only once all of them are placed. So a dynamically
// submitted member that becomes ready waits here, under its driver and collective id, until
// every rank is ready; the task table then runs them together as one instance of a graph of the
// members (gang), placed on distinct workers. When a member fails before that, its siblings
// cannot complete: the ready ones fail with it, and later ones fail as soon as they become ready.
//
// The table keeps task ids only; the task table owns the tasks and acts on what it returns.
//
// Thread safety: none; the scheduler's io thread drives it.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "core/collective_task.h"
#include "core/ids.h"
#include "core/status.h"

namespace tessera {

class GangTable {
 public:
  // Member `task` (named `name`) of `driver`'s collective is ready. Returns every member's task id
  // by rank once all are (the collective is then forgotten here), or nothing while some are not.
  // An error, for the caller to fail the task with: the collective already failed (that error),
  // or its group size or rank clash with earlier members (InvalidArgument).
  Result<std::vector<TaskId>> MemberReady(WorkerId driver, const CollectiveMembership& membership,
                                          TaskId task, std::string_view name);
  // Member `task` failed before it was dispatched, because of `why`. Returns the ready siblings,
  // for the caller to fail with `why`; members that become ready later fail with it at once.
  std::vector<TaskId> MemberFailed(WorkerId driver, const CollectiveMembership& membership,
                                   TaskId task, const Status& why);

 private:
  // Maps by rank, not vectors of group_size: what a collective keeps grows with the members that
  // arrived, never with the size they claim (a driver may declare many collectives of the largest
  // group and send one member of each).
  struct Pending {
    int group_size = 0;
    std::map<int, TaskId> ready;  // ready members not handed back (to run, or to be failed)
    // Ready or failed. Per rank, not a count: a sibling handed back by MemberFailed fails in turn
    // and reports again, and must not count twice (the entry would be forgotten early and a
    // member ready later would wait forever).
    std::set<int> settled;
    Status failed;  // set when one failed: later members fail at once
    bool all_settled() const { return settled.size() == static_cast<size_t>(group_size); }
  };
  using Key = std::pair<WorkerId, int64_t>;  // driver, collective id

  // The collective's entry, created (for `group_size` members) on first use.
  Pending& Entry(const Key& key, int group_size);

  std::map<Key, Pending> pending_;
};

}  // namespace tessera

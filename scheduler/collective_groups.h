// CollectiveGroups: the scheduler as every collective group's rendezvous and watcher.
//
// A group is the list of workers (in rank order) that run the members of a collective; every
// collective over the same list shares the group and its communicators. The scheduler keys
// groups when it places graphs and tasks (GroupFor). Then:
//
//   Forming a communicator. A worker about to run its first member of a group creates its side
//   (e.g. a UCX worker) and joins with a blob (its address) per exchange round; when every
//   member's blob for a round is in, each member gets them all (CollectivePeers). A worker forms
//   a group again after a failure, with a higher epoch; a join with a new epoch starts the
//   group afresh.
//
//   Failures, and one verdict per failure (core/rendezvous_rules.h: the same rule as a
//   standalone group's rank 0). A member that dies (its connection closes or its heartbeats
//   stop: WorkerDied) is certain: every other member gets CollectiveAbort naming it at once. A
//   member that finds a peer silent past its deadline reports it (CollectiveFailed, with how
//   long the peer had been silent); reports arriving within `verdict_window` of the first are
//   weighed together and the verdict names the peer whose silence began first — the stuck one,
//   not a bystander it starved. Every member gets the verdict, so every member's error names
//   the same worker. A group with a dead member cannot form again: a join to it (a later
//   collective of a failed step, reaching it first) gets the verdict at once instead of waiting
//   for the member until the formation deadline.
//
//   Epochs. A verdict is about one formation: it carries the group's epoch, and a member that
//   formed the group again since ignores it; a report from an older formation is ignored here.
//   A graph instance that fails aborts every group its collectives use (GraphRegistry), so every
//   member drops that formation — the one whose collective was cut short and the one whose
//   collective had already finished alike — and the group's next collective (a replay's) forms
//   it afresh on all of them, instead of meeting a communicator aborted or kept on one side only.
//
// Thread safety: none; the scheduler's io thread drives it (like SchedulerCore).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/ids.h"
#include "core/proto/tessera.capnp.h"
#include "core/rendezvous_rules.h"
#include "core/status.h"
#include "scheduler/outbox.h"

namespace tessera {

class CollectiveGroups {
 public:
  using Clock = std::chrono::steady_clock;
  using Describe = std::function<std::string(WorkerId)>;

  CollectiveGroups(Outbox* outbox, Describe describe,
                   std::chrono::milliseconds verdict_window = std::chrono::milliseconds(250))
      : outbox_(outbox), describe_(std::move(describe)), verdict_window_(verdict_window) {}

  // The key of the group of these workers (in rank order) on `channel` (core/collective_task.h:
  // each channel has communicators of its own); the same list and channel always get the same
  // key. REQUIRES: distinct workers.
  uint64_t GroupFor(const std::vector<WorkerId>& members, int channel = 0);
  const std::vector<WorkerId>* Members(uint64_t group) const;
  // The members (in rank order) whose join to the group's open exchange round is missing: while
  // some members wait for the group to form, the ones they wait for. Empty when no round is open
  // (formed, or nobody joined yet) or for an unknown group.
  std::vector<WorkerId> MissingJoins(uint64_t group) const;

  // A member's join. InvalidArgument (a protocol violation by `from`) for an unknown group or a
  // rank that is not `from`'s.
  Status OnJoin(WorkerId from, proto::CollectiveJoin::Reader join);
  Status OnFailed(WorkerId from, proto::CollectiveFailed::Reader failed, Clock::time_point now);
  void WorkerDied(WorkerId worker, const Status& reason);
  // A member task of the group failed outside the collective (on its worker, before it ran), or
  // a graph instance with collectives of the group failed: the group's current formation fails
  // with `reason` (no-op if it already has a verdict).
  void Abort(uint64_t group, const Status& reason);
  // Decides the verdicts whose window has passed.
  void Tick(Clock::time_point now);

 private:
  struct Group {
    Group(std::vector<WorkerId> members_in, std::chrono::milliseconds window)
        : members(std::move(members_in)),
          rounds(static_cast<int>(members.size())),
          verdict(window) {}
    std::vector<WorkerId> members;
    uint32_t epoch = 0;
    GatherRounds rounds;
    FailureVerdict verdict;  // the group's failure, until a new epoch forms it again
  };

  // Tells every member the verdict just decided (with the epoch it is about: a member that
  // formed the group again since ignores it).
  void SendVerdict(uint64_t key, const Group& group);
  void SendVerdictTo(WorkerId member, uint64_t key, const Group& group);

  Outbox* outbox_;
  Describe describe_;
  const std::chrono::milliseconds verdict_window_;
  std::map<std::pair<std::vector<WorkerId>, int>, uint64_t> keys_;  // by members and channel
  // Workers declared dead: a group with one can never form again, and a join says so at once.
  std::set<WorkerId> dead_;
  std::map<uint64_t, Group> groups_;
  uint64_t next_key_ = 1;
};

}  // namespace tessera

// Rendezvous: how the members of a collective group find each other, and learn that one died.
//
// A group of `size` ranks sets up its communicator by exchanging small blobs (UCX worker
// addresses, an NCCL unique id) with AllGather. The same party then watches the members and
// gives the group one verdict when something goes wrong:
//   - a member dies: every other member hears of it through the failure handler, which aborts
//     the group's transport, so a collective in progress fails at once naming the dead rank
//     instead of waiting for its deadline;
//   - a member is stuck (alive, silent): the ranks waiting on it time out, and so do ranks
//     waiting on ranks waiting on it. Each reports which peer it found silent and for how long
//     (ReportFailure); the verdict names the stuck one, not a bystander starved by it (a member
//     that reports is alive; see core/rendezvous_rules.h).
//
// Two kinds: SocketRendezvous (socket_rendezvous.h: rank 0 hosts, the others connect — for
// standalone programs, tests and benchmarks) and, inside a Tessera cluster, the scheduler, which
// already knows every worker and when one dies.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"

namespace tessera {

class Rendezvous {
 public:
  using Clock = std::chrono::steady_clock;
  using FailureHandler = std::function<void(const Status& reason)>;

  virtual ~Rendezvous() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Every rank contributes `mine`; returns every contribution in rank order. All ranks call it
  // the same number of times. Unavailable naming a member that died first; TimedOut naming the
  // ranks still missing at `deadline`.
  virtual Result<std::vector<std::string>> AllGather(const std::string& mine,
                                                     Clock::time_point deadline) = 0;

  // `on_failure` runs once, on the rendezvous' own thread, with a reason naming the dead rank
  // (at once if a death is known already). REQUIRES: thread-safe and quick.
  virtual void OnMemberFailure(FailureHandler on_failure) = 0;

  // Reports what this member found wrong (`reason`: rank `silent_peer` silent for `silent_ms`,
  // or 0 and -1 for an error that is not a silence) and returns the group's verdict, which
  // every member's failure handler also gets: the known failure if there is one, else the
  // verdict of core/rendezvous_rules.h's FailureVerdict over the reports arriving within a short
  // window. Blocks for about that window. Thread-safe.
  virtual Status ReportFailure(const Status& reason, int64_t silent_ms, int silent_peer) = 0;
};

}  // namespace tessera

// The rules every collective rendezvous host applies, whatever carries its messages: the
// scheduler for the groups of a cluster's workers (scheduler/collective_groups.h), rank 0's
// sockets for standalone programs (collectives/socket_rendezvous.h). Two transports, because a
// standalone group has no scheduler and a cluster's workers have no business opening sockets to
// each other's rank 0; one rule, here, so both give the same answers.
//
//   GatherRounds    each member contributes one blob per round (a UCX address, an NCCL id); the
//                   round is complete when every member's blob is in, and every member then gets
//                   all of them in rank order.
//   FailureVerdict  one verdict per formation of a group. A certain failure (a member died, a
//                   member task failed before it ran) decides at once. Reports of silent peers
//                   are weighed together for `window` after the first. A member that reports is
//                   alive, so a report blaming a peer that itself reported is set aside: in a
//                   ring where rank 1 is stuck, rank 2 blames 1 and rank 3 blames 2, and only
//                   rank 2's report stands. Among the reports left (all of them, if none is),
//                   the verdict is the one whose silence began first: a member starved by the
//                   stuck one went silent later than the stuck one did. (Silences in a ring
//                   begin microseconds apart, closer than reports travel, so the first rule is
//                   the one that decides there; the second covers peers nobody can vouch for.)
//                   The first verdict stands until the group forms again (Reset).
//
// Thread safety: none; the host serialises calls (the scheduler's io thread, rank 0's mutex).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"

namespace tessera {

class GatherRounds {
 public:
  explicit GatherRounds(int size) : size_(size) {}

  // Records `rank`'s blob for `round`. Returns every blob of the round in rank order once the
  // round is complete (and forgets it); nullopt before. REQUIRES: 0 <= rank < size.
  std::optional<std::vector<std::string>> Contribute(uint32_t round, int rank, std::string blob);
  // The ranks whose blob for `round` is missing (every rank for a round nobody started).
  std::vector<int> Missing(uint32_t round) const;
  // The earliest round some rank contributed to and that is not complete yet; nullopt: none.
  std::optional<uint32_t> OpenRound() const {
    if (rounds_.empty()) return std::nullopt;
    return rounds_.begin()->first;
  }
  // Forgets every round (the group forms again).
  void Clear() { rounds_.clear(); }

 private:
  int size_;
  std::map<uint32_t, std::vector<std::optional<std::string>>> rounds_;
};

class FailureVerdict {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds kDefaultWindow{250};

  explicit FailureVerdict(std::chrono::milliseconds window = kDefaultWindow) : window_(window) {}

  bool decided() const { return !verdict_.ok(); }
  // The group's failure; OK until decided.
  const Status& verdict() const { return verdict_; }
  // When the collected reports will be weighed; nullopt when there are none.
  std::optional<Clock::time_point> window_end() const { return window_end_; }

  // Member `reporter` found member `silent_peer` silent for `silent_ms` (0 and -1: an error
  // that is not a silence) at `now`. Ranks are positions in the group; -1: unknown. Ignored once
  // decided. An OK reason counts as "a member failed".
  void Report(int reporter, int silent_peer, const Status& reason, int64_t silent_ms,
              Clock::time_point now);
  // A certain failure: decides at once. False, changing nothing, when already decided.
  bool Decide(const Status& reason);
  // Once the window has passed, decides from the reports. True when this call decided.
  bool DecideIfDue(Clock::time_point now);
  // The group forms again: no verdict, no reports.
  void Reset();

 private:
  struct SilentPeer {
    int reporter;
    int silent_peer;
    Status reason;
    Clock::time_point silent_since;
  };
  std::chrono::milliseconds window_;
  Status verdict_;
  std::vector<SilentPeer> reports_;
  std::optional<Clock::time_point> window_end_;
};

}  // namespace tessera

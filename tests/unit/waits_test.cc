// ExplainWaits: a worker's reported wait combined with what the scheduler knows (liveness, a
// group's rendezvous, the other members' reports).
#include "scheduler/waits.h"

#include <gtest/gtest.h>

#include "client/cluster.h"

namespace tessera {
namespace {

using std::chrono::milliseconds;

ReportedWait InCollective(int64_t collective, uint64_t group, int rank, int size,
                          bool forming = false) {
  ReportedWait reported;
  reported.collective = ReportedWait::Collective{.task = "ar" + std::to_string(rank),
                                                 .op = "all_reduce",
                                                 .collective = collective,
                                                 .group = group,
                                                 .rank = rank,
                                                 .size = size,
                                                 .forming = forming,
                                                 .since_us = 2'500'000};
  return reported;
}

WorkerWaitInput Worker(uint64_t id, ReportedWait reported,
                       milliseconds silent = milliseconds(100)) {
  return WorkerWaitInput{.id = WorkerId(id),
                         .alive = true,
                         .silent = silent,
                         .tasks_in_flight = 0,
                         .reported = std::move(reported)};
}

std::function<std::optional<GroupView>(uint64_t)> OneGroup(uint64_t key, const GroupView& view) {
  return [key, view](uint64_t asked) -> std::optional<GroupView> {
    if (asked != key) return std::nullopt;
    return view;
  };
}

TEST(WaitsTest, ACollectiveWaitingForASilentMemberNamesItAndTheCollective) {
  const std::vector<WorkerWaitInput> workers = {
      Worker(1, InCollective(7, 5, 0, 2)),
      Worker(2, InCollective(7, 5, 1, 2), milliseconds(2100)),
  };
  const auto lines = ExplainWaits(workers, OneGroup(5, {{WorkerId(1), WorkerId(2)}, {}}));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].text,
            "waits in collective 7/all_reduce (rank 0 of 2, task ar0, 2.5 s so far) for worker2, "
            "which has not answered for 2.1 s");
  EXPECT_EQ(lines[0].blocked_on, std::vector<WorkerId>{WorkerId(2)});
  EXPECT_EQ(lines[1].text.rfind("not responding (last heartbeat 2100 ms ago); it said: waits in "
                                "collective 7/all_reduce (rank 1 of 2",
                                0),
            0u)
      << lines[1].text;
}

TEST(WaitsTest, AGroupFormingNamesTheMembersThatHaveNotJoined) {
  const std::vector<WorkerWaitInput> workers = {
      Worker(1, InCollective(9, 3, 0, 3, /*forming=*/true)),
      Worker(2, InCollective(9, 3, 1, 3, /*forming=*/true)),
      Worker(3, ReportedWait{}),  // alive, but somewhere else
  };
  const auto lines =
      ExplainWaits(workers, OneGroup(3, {{WorkerId(1), WorkerId(2), WorkerId(3)}, {WorkerId(3)}}));
  EXPECT_EQ(lines[0].text,
            "waits in collective 9/all_reduce (rank 0 of 3, task ar0, 2.5 s so far) for worker3, "
            "which has not reached it (it is idle)");
  EXPECT_EQ(lines[0].blocked_on, std::vector<WorkerId>{WorkerId(3)});
  EXPECT_EQ(lines[2].text, "idle");
  EXPECT_TRUE(lines[2].blocked_on.empty());
}

TEST(WaitsTest, MembersAllInTheCollectiveBlockNobody) {
  const std::vector<WorkerWaitInput> workers = {
      Worker(1, InCollective(7, 5, 0, 2)),
      Worker(2, InCollective(7, 5, 1, 2)),
  };
  const auto lines = ExplainWaits(workers, OneGroup(5, {{WorkerId(1), WorkerId(2)}, {}}));
  EXPECT_EQ(lines[0].text,
            "waits in collective 7/all_reduce (rank 0 of 2, task ar0, 2.5 s so far) with worker2");
  EXPECT_TRUE(lines[0].blocked_on.empty());
}

TEST(WaitsTest, RunningTasksAwaitedObjectsAndDeadWorkers) {
  ReportedWait running;
  running.running = {"1.3/h.0.forward"};
  ReportedWait awaiting;
  awaiting.awaited = {{"1.3/h.0.out", WorkerId(4)}, {"1.3/x", WorkerId()}};
  WorkerWaitInput dead = Worker(4, ReportedWait{});
  dead.alive = false;
  const auto lines = ExplainWaits({Worker(1, running), Worker(2, awaiting), dead},
                                  [](uint64_t) { return std::nullopt; });
  EXPECT_EQ(lines[0].text, "runs 1.3/h.0.forward");
  EXPECT_EQ(lines[1].text, "waits for 1.3/h.0.out from worker4, which is dead; 1.3/x");
  EXPECT_EQ(lines[1].blocked_on, std::vector<WorkerId>{WorkerId(4)});
  EXPECT_EQ(lines[2].text, "dead");
}

TEST(WaitsTest, AnInstanceWithNothingElseToDoWaitsForItsCollectiveMembersTurn) {
  ReportedWait queued;
  queued.instance = "4.2";
  const auto lines = ExplainWaits({Worker(1, queued)}, [](uint64_t) { return std::nullopt; });
  EXPECT_EQ(lines[0].text,
            "in graph instance 4.2: no kernel running, no input awaited (its collective members "
            "wait their turn)");
}

TEST(WaitsTest, FormatWaitPrefixesTheWorkerAndWhereItRuns) {
  EXPECT_EQ(FormatWait(WorkerWait{WorkerId(2), "host", 1234, true, "idle", {}}),
            "worker2 (host:1234): idle");
  EXPECT_EQ(FormatWait(WorkerWait{WorkerId(2), "host", 1234, true, "", {}}),
            "worker2 (host:1234): no report");
}

}  // namespace
}  // namespace tessera

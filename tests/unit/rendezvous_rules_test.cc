// The rules both collective rendezvous hosts apply (core/rendezvous_rules.h): all-gather rounds,
// and one failure verdict that names the stuck member.
#include "core/rendezvous_rules.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using Clock = FailureVerdict::Clock;
using std::chrono::milliseconds;

TEST(GatherRoundsTest, ARoundCompletesInRankOrderWhateverTheArrivalOrder) {
  GatherRounds rounds(3);
  EXPECT_FALSE(rounds.Contribute(0, 2, "c"));
  EXPECT_FALSE(rounds.Contribute(1, 0, "next round"));
  EXPECT_EQ(rounds.Missing(0), (std::vector<int>{0, 1}));
  EXPECT_FALSE(rounds.Contribute(0, 0, "a"));
  auto all = rounds.Contribute(0, 1, "b");
  ASSERT_TRUE(all.has_value());
  EXPECT_EQ(*all, (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(rounds.Missing(0), (std::vector<int>{0, 1, 2}));  // forgotten once complete
  EXPECT_EQ(rounds.Missing(1), (std::vector<int>{1, 2}));
  rounds.Clear();
  EXPECT_EQ(rounds.Missing(1), (std::vector<int>{0, 1, 2}));
}

TEST(FailureVerdictTest, ACertainFailureDecidesAtOnceAndTheFirstStands) {
  FailureVerdict verdict;
  EXPECT_FALSE(verdict.decided());
  EXPECT_TRUE(verdict.Decide(Unavailable("rank 2 died")));
  EXPECT_FALSE(verdict.Decide(Unavailable("rank 3 died")));
  verdict.Report(0, 1, TimedOut("late"), 100, Clock::now());  // ignored once decided
  EXPECT_EQ(verdict.verdict().message(), "rank 2 died");
  EXPECT_FALSE(verdict.window_end().has_value());
  verdict.Reset();
  EXPECT_FALSE(verdict.decided());
}

TEST(FailureVerdictTest, ReportsWaitForTheWindow) {
  FailureVerdict verdict(milliseconds(250));
  const Clock::time_point t0 = Clock::now();
  verdict.Report(0, 1, TimedOut("rank 0 heard nothing from rank 1"), 2000, t0);
  ASSERT_TRUE(verdict.window_end().has_value());
  EXPECT_EQ(*verdict.window_end(), t0 + milliseconds(250));
  EXPECT_FALSE(verdict.DecideIfDue(t0 + milliseconds(249)));
  EXPECT_TRUE(verdict.DecideIfDue(t0 + milliseconds(250)));
  EXPECT_EQ(verdict.verdict().message(), "rank 0 heard nothing from rank 1");
}

// Rank 1 of a ring stops. Rank 2 waits on it and rank 3 waits on rank 2; their silences began
// microseconds apart, and rank 3's report travelled faster, so it looks older. Rank 2 reported,
// so it is alive: the verdict names rank 1.
TEST(FailureVerdictTest, AMemberThatReportsIsNotTheStuckOne) {
  FailureVerdict verdict;
  const Clock::time_point t0 = Clock::now();
  verdict.Report(3, 2, TimedOut("rank 3 heard nothing from rank 2"), 1999, t0);
  verdict.Report(2, 1, TimedOut("rank 2 heard nothing from rank 1"), 1996, t0 + milliseconds(2));
  verdict.Report(0, 3, TimedOut("rank 0 heard nothing from rank 3"), 1990, t0 + milliseconds(3));
  ASSERT_TRUE(verdict.DecideIfDue(t0 + milliseconds(400)));
  EXPECT_EQ(verdict.verdict().message(), "rank 2 heard nothing from rank 1");
}

// Without peer ranks (or when every blamed peer reported too), the silence that began first.
TEST(FailureVerdictTest, OtherwiseTheSilenceThatBeganFirst) {
  FailureVerdict unknown;
  const Clock::time_point t0 = Clock::now();
  unknown.Report(-1, -1, TimedOut("a: heard nothing from b"), 4900, t0);
  unknown.Report(-1, -1, TimedOut("b: heard nothing from c"), 5020, t0 + milliseconds(10));
  ASSERT_TRUE(unknown.DecideIfDue(t0 + milliseconds(300)));
  EXPECT_EQ(unknown.verdict().message(), "b: heard nothing from c");

  FailureVerdict cycle;  // two members blaming each other: both alive; the older silence
  cycle.Report(0, 1, TimedOut("0 blames 1"), 100, t0);
  cycle.Report(1, 0, TimedOut("1 blames 0"), 300, t0);
  ASSERT_TRUE(cycle.DecideIfDue(t0 + milliseconds(300)));
  EXPECT_EQ(cycle.verdict().message(), "1 blames 0");

  FailureVerdict anonymous;  // an OK reason still fails the group
  anonymous.Report(0, -1, Status::Ok(), 0, t0);
  ASSERT_TRUE(anonymous.DecideIfDue(t0 + milliseconds(300)));
  EXPECT_EQ(anonymous.verdict().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tessera::testing

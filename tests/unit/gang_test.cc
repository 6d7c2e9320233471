// Dynamic collectives assembling (scheduler/gang.h).
#include "scheduler/gang.h"

#include "test_util.h"

namespace tessera::testing {
namespace {

const WorkerId kDriver(1);

CollectiveMembership Rank(int rank, int size = 2, int64_t collective = 3) {
  return CollectiveMembership{collective, rank, size};
}

TEST(GangTableTest, MembersWaitUntilEveryRankIsReadyAndComeOutByRank) {
  GangTable gangs;
  ASSERT_OK_AND_ASSIGN(std::vector<TaskId> first,
                       gangs.MemberReady(kDriver, Rank(1), TaskId(11), "b"));
  EXPECT_TRUE(first.empty());
  ASSERT_OK_AND_ASSIGN(std::vector<TaskId> all,
                       gangs.MemberReady(kDriver, Rank(0), TaskId(10), "a"));
  EXPECT_EQ(all, (std::vector<TaskId>{TaskId(10), TaskId(11)}));
  // The collective is forgotten once dispatched: the same id may assemble again.
  ASSERT_OK_AND_ASSIGN(std::vector<TaskId> again,
                       gangs.MemberReady(kDriver, Rank(0), TaskId(12), "c"));
  EXPECT_TRUE(again.empty());
  // Another driver's collective 3 is another collective.
  ASSERT_OK_AND_ASSIGN(std::vector<TaskId> other,
                       gangs.MemberReady(WorkerId(2), Rank(1), TaskId(20), "x"));
  EXPECT_TRUE(other.empty());
}

TEST(GangTableTest, ATakenRankOrAnotherGroupSizeIsRefused) {
  GangTable gangs;
  ASSERT_OK(gangs.MemberReady(kDriver, Rank(0), TaskId(10), "a").status());
  const Status taken = gangs.MemberReady(kDriver, Rank(0), TaskId(11), "b").status();
  EXPECT_EQ(taken.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(taken.message(),
            "task 'b' is rank 0 of 2 in collective 3, which has 2 members and may have that rank "
            "taken");
  EXPECT_FALSE(gangs.MemberReady(kDriver, Rank(1, 3), TaskId(12), "c").ok());
}

TEST(GangTableTest, AFailedMemberTakesTheReadyOnesAndLaterOnesFailAtOnce) {
  GangTable gangs;
  ASSERT_OK(gangs.MemberReady(kDriver, Rank(0, 3), TaskId(10), "a").status());
  const Status why = Internal("input lost");
  EXPECT_EQ(gangs.MemberFailed(kDriver, Rank(1, 3), TaskId(11), why),
            (std::vector<TaskId>{TaskId(10)}));

  GangTable later;
  EXPECT_TRUE(later.MemberFailed(kDriver, Rank(1, 3), TaskId(11), why).empty());
  EXPECT_EQ(later.MemberReady(kDriver, Rank(0, 3), TaskId(10), "a").status().message(),
            "input lost");
}

// Rank 0 is ready, rank 1 fails: rank 0 is handed back and fails in turn (the task table reports
// that failure too). Rank 2, ready later, must still learn of the failure, not wait forever.
TEST(GangTableTest, AHandedBackSiblingIsNotCountedTwice) {
  GangTable gangs;
  const Status why = Internal("input lost");
  ASSERT_OK(gangs.MemberReady(kDriver, Rank(0, 3), TaskId(10), "a").status());
  EXPECT_EQ(gangs.MemberFailed(kDriver, Rank(1, 3), TaskId(11), why),
            (std::vector<TaskId>{TaskId(10)}));
  EXPECT_TRUE(gangs.MemberFailed(kDriver, Rank(0, 3), TaskId(10), why).empty());
  Result<std::vector<TaskId>> late = gangs.MemberReady(kDriver, Rank(2, 3), TaskId(12), "c");
  ASSERT_FALSE(late.ok()) << "rank 2 was taken for the first member of a new collective";
  EXPECT_EQ(late.status().message(), "input lost");
  // The task table fails it, which reports it like any failed member.
  EXPECT_TRUE(gangs.MemberFailed(kDriver, Rank(2, 3), TaskId(12), why).empty());
  // Every rank has settled now: the id may be used again.
  ASSERT_OK_AND_ASSIGN(std::vector<TaskId> fresh,
                       gangs.MemberReady(kDriver, Rank(0, 3), TaskId(13), "d"));
  EXPECT_TRUE(fresh.empty());
}

}  // namespace
}  // namespace tessera::testing

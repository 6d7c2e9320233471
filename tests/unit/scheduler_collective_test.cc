// The scheduler and collectives: dynamic collective members (scheduler_core_fixture.h), and the
// scheduler as collective rendezvous and watcher (scheduler/collective_groups.h).
#include <string>

#include "core/collective_task.h"
#include "scheduler/collective_groups.h"
#include "unit/scheduler_core_fixture.h"
#include "unit/scheduler_test_graphs.h"

namespace tessera::testing {
namespace {

TEST_F(SchedulerCoreTest, DynamicCollectiveMembersAreDispatchedTogetherOnDistinctWorkers) {
  const auto [w1, w2, joined_driver] = JoinTwoWorkersAndADriver();
  const auto driver = joined_driver;  // a variable: Clang 15 cannot capture a binding
  Put(driver, 1, 1, true);
  auto submit_member = [&](uint64_t id, int64_t rank, uint64_t input) {
    ASSERT_OK(Deliver(driver, [&](proto::Envelope::Builder e) {
      TaskSpec spec;
      spec.id = TaskId(id);
      spec.name = fmt::format("m{}", rank);
      spec.op = "all_reduce";
      spec.inputs = {ObjectId(input)};
      spec.outputs = {ObjectId(100 + id)};
      spec.attrs = Member(3, rank, 2);
      rpc::ToWire(spec,
                  {ObjectSpec{ObjectId(100 + id), fmt::format("out{}", id), Floats(1),
                              ObjectRole::kActivation, spec.id}},
                  e.initBody().initSubmitTasks().initTasks(1)[0]);
    }));
  };
  submit_member(10, 0, 1);
  EXPECT_TRUE(Dispatched(w1).empty() && Dispatched(w2).empty()) << "waits for its sibling";
  submit_member(11, 1, 1);
  // One instance of a graph of the two members, on distinct workers: each gets the graph's part
  // and the same RunGraph.
  std::vector<std::pair<WorkerId, rpc::WireTask>> dispatched;
  for (WorkerId worker : {w1, w2}) {
    auto parts = outbox_.Take(worker, Body::GRAPH_PART);
    ASSERT_EQ(parts.size(), 1u);
    auto part = BodyOf(parts[0]).getGraphPart();
    ASSERT_EQ(part.getTasks().size(), 2u);
    for (unsigned t = 0; t < 2; ++t) {
      if (part.getTaskWorkers()[t] != worker.value()) continue;
      ASSERT_OK_AND_ASSIGN(rpc::WireTask wire, rpc::FromWire(part.getTasks()[t]));
      dispatched.emplace_back(worker, std::move(wire));
    }
    auto runs = outbox_.Take(worker, Body::RUN_GRAPH);
    ASSERT_EQ(runs.size(), 1u);
    EXPECT_EQ(BodyOf(runs[0]).getRunGraph().getInstance(), 10u) << "rank 0's task id";
    for (auto base : BodyOf(runs[0]).getRunGraph().getCollectiveBases()) {
      EXPECT_EQ(base.getBase(), 0) << "each worker's first collective";
    }
  }
  ASSERT_EQ(dispatched.size(), 2u);
  EXPECT_NE(dispatched[0].first, dispatched[1].first);
  EXPECT_EQ(dispatched[0].second.spec.attrs.GetInt(kGroupAttr, -1),
            dispatched[1].second.spec.attrs.GetInt(kGroupAttr, -2));
  EXPECT_EQ(dispatched[0].second.spec.attrs.GetInt(kPositionAttr, -1), 0);

  // A member whose input fails takes its ready sibling with it.
  Submit(driver, 20, 1, 2);  // the input of member 31, which will fail
  const WorkerId runner = Dispatched(w1).empty() ? w2 : w1;
  Dispatched(w2);
  submit_member(30, 0, 1);  // ready: waits for 31
  submit_member(31, 1, 2);
  FinishWithError(runner, 20, InvalidArgument("kernel refused"));
  Watch(driver, 130);
  const std::string message = ReadyError(driver);
  EXPECT_NE(message.find("member 'm1' of collective 3 failed"), std::string::npos) << message;
  EXPECT_NE(message.find("kernel refused"), std::string::npos) << message;
}

// The scheduler as collective rendezvous and watcher (scheduler/collective_groups.h).
class CollectiveGroupsTest : public ::testing::Test {
 protected:
  CollectiveGroupsTest() : groups_(&outbox_, [](WorkerId worker) { return worker.ToString(); }) {}

  Status Join(WorkerId from, uint64_t group, uint32_t epoch, uint32_t round, int rank, int size,
              const std::string& blob) {
    capnp::MallocMessageBuilder message;
    auto join = message.initRoot<proto::CollectiveJoin>();
    join.setGroup(group);
    join.setEpoch(epoch);
    join.setRound(round);
    join.setRank(rank);
    join.setSize(size);
    join.setBlob(kj::arrayPtr(reinterpret_cast<const kj::byte*>(blob.data()), blob.size()));
    return groups_.OnJoin(from, join.asReader());
  }

  Status Report(WorkerId from, uint64_t group, const std::string& why, int64_t silent_ms,
                uint32_t epoch = 0) {
    capnp::MallocMessageBuilder message;
    auto failed = message.initRoot<proto::CollectiveFailed>();
    failed.setGroup(group);
    failed.setEpoch(epoch);
    rpc::ToWire(TimedOut("{}", why), failed.initError());
    failed.setSilentMs(silent_ms);
    return groups_.OnFailed(from, failed.asReader(), now_);
  }

  std::string AbortMessage(WorkerId to) {
    auto aborts = outbox_.Take(to, Body::COLLECTIVE_ABORT);
    if (aborts.size() != 1) return fmt::format("{} aborts", aborts.size());
    return rpc::FromWire(BodyOf(aborts[0]).getCollectiveAbort().getError()).message();
  }

  FakeOutbox outbox_;
  CollectiveGroups groups_;
  CollectiveGroups::Clock::time_point now_{};
  const WorkerId a_{1}, b_{2}, c_{3};
};

TEST_F(CollectiveGroupsTest, TheSameWorkersShareAGroupAndGetEveryBlobOnceAllJoined) {
  const uint64_t group = groups_.GroupFor({a_, b_, c_});
  EXPECT_EQ(groups_.GroupFor({a_, b_, c_}), group);
  EXPECT_NE(groups_.GroupFor({b_, a_, c_}), group);  // rank order matters
  ASSERT_OK(Join(a_, group, 1, 0, 0, 3, "A"));
  ASSERT_OK(Join(c_, group, 1, 0, 2, 3, "C"));
  EXPECT_TRUE(outbox_.Take(a_, Body::COLLECTIVE_PEERS).empty());
  ASSERT_OK(Join(b_, group, 1, 0, 1, 3, "B"));
  for (WorkerId member : {a_, b_, c_}) {
    auto peers = outbox_.Take(member, Body::COLLECTIVE_PEERS);
    ASSERT_EQ(peers.size(), 1u);
    auto blobs = BodyOf(peers[0]).getCollectivePeers().getBlobs();
    ASSERT_EQ(blobs.size(), 3u);
    EXPECT_EQ(std::string(blobs[0].begin(), blobs[0].end()), "A");
    EXPECT_EQ(std::string(blobs[2].begin(), blobs[2].end()), "C");
  }
  // A worker may only join as its own rank.
  EXPECT_EQ(Join(c_, group, 1, 1, 0, 3, "X").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Join(a_, 99, 1, 1, 0, 3, "X").code(), StatusCode::kInvalidArgument);
}

TEST_F(CollectiveGroupsTest, TheVerdictNamesThePeerWhoseSilenceBeganFirst) {
  const uint64_t group = groups_.GroupFor({a_, b_, c_});
  // c is stuck. b (waiting on c) has heard nothing for 5 s; a (waiting on b, starved by it)
  // for 4.9 s, and reports first.
  ASSERT_OK(Report(a_, group, "heard nothing from b", 4900));
  now_ += std::chrono::milliseconds(20);
  ASSERT_OK(Report(b_, group, "heard nothing from c", 5020));
  groups_.Tick(now_);  // the window is still open
  EXPECT_TRUE(outbox_.Take(a_, Body::COLLECTIVE_ABORT).empty());
  now_ += std::chrono::milliseconds(300);
  groups_.Tick(now_);
  for (WorkerId member : {a_, b_, c_}) EXPECT_EQ(AbortMessage(member), "heard nothing from c");
}

TEST_F(CollectiveGroupsTest, ADeathIsCertainAndTheGroupCannotFormAgain) {
  const uint64_t group = groups_.GroupFor({a_, b_});
  groups_.WorkerDied(b_, Unavailable("no heartbeat for 3000 ms"));
  EXPECT_NE(AbortMessage(a_).find("worker2 (rank 1 of collective group"), std::string::npos);
  // Reports after the verdict change nothing.
  ASSERT_OK(Report(a_, group, "heard nothing", 10));
  now_ += std::chrono::seconds(1);
  groups_.Tick(now_);
  EXPECT_TRUE(outbox_.Take(a_, Body::COLLECTIVE_ABORT).empty());
  // A later collective of the group (a failed step's) tries to form it again: it is told at once
  // that it cannot, instead of waiting for the dead member until its deadline.
  ASSERT_OK(Join(a_, group, 2, 0, 0, 2, "A2"));
  EXPECT_TRUE(outbox_.Take(a_, Body::COLLECTIVE_PEERS).empty());
  EXPECT_NE(AbortMessage(a_).find("is dead: the group cannot form again"), std::string::npos);
}

// Verdicts name the formation they are about; reports from a formation gone by change nothing.
TEST_F(CollectiveGroupsTest, AVerdictCarriesItsEpochAndStaleReportsAreIgnored) {
  const uint64_t group = groups_.GroupFor({a_, b_});
  ASSERT_OK(Join(a_, group, 3, 0, 0, 2, "A3"));
  ASSERT_OK(Join(b_, group, 3, 0, 1, 2, "B3"));
  ASSERT_OK(Report(a_, group, "heard nothing from b (epoch 2)", 5000, /*epoch=*/2));
  now_ += std::chrono::seconds(1);
  groups_.Tick(now_);
  EXPECT_TRUE(outbox_.Take(a_, Body::COLLECTIVE_ABORT).empty());
  ASSERT_OK(Report(a_, group, "heard nothing from b", 5000, /*epoch=*/3));
  now_ += std::chrono::seconds(1);
  groups_.Tick(now_);
  for (WorkerId member : {a_, b_}) {
    auto aborts = outbox_.Take(member, Body::COLLECTIVE_ABORT);
    ASSERT_EQ(aborts.size(), 1u);
    EXPECT_EQ(BodyOf(aborts[0]).getCollectiveAbort().getEpoch(), 3u);
  }
}

// Of a group with a dead member, every member that joins again is told, also the one that joins
// after the verdict was decided (it may have been at the old epoch when that went out).
TEST_F(CollectiveGroupsTest, EveryMemberJoiningADeadGroupGetsTheVerdict) {
  const uint64_t group = groups_.GroupFor({a_, b_, c_});
  groups_.WorkerDied(c_, Unavailable("connection reset"));
  outbox_.Take(a_, Body::COLLECTIVE_ABORT);
  outbox_.Take(b_, Body::COLLECTIVE_ABORT);
  ASSERT_OK(Join(a_, group, 2, 0, 0, 3, "A2"));
  EXPECT_NE(AbortMessage(a_).find("is dead"), std::string::npos);
  outbox_.Take(b_, Body::COLLECTIVE_ABORT);  // sent while b was still at epoch 1
  ASSERT_OK(Join(b_, group, 2, 0, 1, 3, "B2"));
  auto aborts = outbox_.Take(b_, Body::COLLECTIVE_ABORT);
  ASSERT_EQ(aborts.size(), 1u);
  EXPECT_EQ(BodyOf(aborts[0]).getCollectiveAbort().getEpoch(), 2u);
  EXPECT_TRUE(outbox_.Take(a_, Body::COLLECTIVE_ABORT).empty());
}

TEST_F(CollectiveGroupsTest, AfterAVerdictThatIsNotADeathANewEpochFormsTheGroupAgain) {
  const uint64_t group = groups_.GroupFor({a_, b_});
  groups_.Abort(group, Internal("member 'x' failed before it ran"));
  EXPECT_NE(AbortMessage(a_).find("failed before it ran"), std::string::npos);
  ASSERT_OK(Join(a_, group, 2, 0, 0, 2, "A2"));
  ASSERT_OK(Join(b_, group, 2, 0, 1, 2, "B2"));
  EXPECT_EQ(outbox_.Take(a_, Body::COLLECTIVE_PEERS).size(), 1u);
  EXPECT_EQ(outbox_.Take(b_, Body::COLLECTIVE_PEERS).size(), 1u);
}

}  // namespace
}  // namespace tessera::testing

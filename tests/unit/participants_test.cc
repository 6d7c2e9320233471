// The participant table (scheduler/participants.h): joining, heartbeats, liveness and load.
#include "scheduler/participants.h"

#include <limits>

#include "core/rpc/wire.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using Clock = ParticipantTable::Clock;

class ParticipantTableTest : public ::testing::Test {
 protected:
  Status Hello(WorkerId id, proto::Role role, const std::string& token = "secret",
               uint32_t version = rpc::kProtocolVersion) {
    capnp::MallocMessageBuilder message;
    auto hello = message.initRoot<proto::Hello>();
    hello.setProtocolVersion(version);
    hello.setRole(role);
    hello.setToken(token);
    hello.setHostname("host");
    hello.setPid(static_cast<int32_t>(100 + id.value()));
    hello.setDataAddress("data-" + std::to_string(id.value()));
    hello.setHostCapacity(1000);
    return table_.Hello(*table_.Find(id), hello.asReader());
  }

  ParticipantTable table_{"secret", "/tmp/s"};
  Clock::time_point now_{};
};

TEST_F(ParticipantTableTest, OnlyTheRightTokenAndProtocolJoin) {
  const WorkerId intruder = table_.Accept(now_);
  const Status refused = Hello(intruder, proto::Role::WORKER, "guess");
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable);
  EXPECT_EQ(refused.message(),
            "invalid cluster token: pass the token the head printed (or its file /tmp/s/token)");
  EXPECT_EQ(table_.Find(intruder)->role, ParticipantRole::kPending);
  const WorkerId old = table_.Accept(now_);
  EXPECT_EQ(Hello(old, proto::Role::DRIVER, "secret", rpc::kProtocolVersion + 1).code(),
            StatusCode::kInvalidArgument);

  const WorkerId worker = table_.Accept(now_);
  ASSERT_OK(Hello(worker, proto::Role::WORKER));
  EXPECT_EQ(table_.Find(worker)->role, ParticipantRole::kWorker);
  EXPECT_EQ(table_.DataAddress(worker), "data-" + std::to_string(worker.value()));
  EXPECT_EQ(table_.Describe(worker),
            fmt::format("{} (pid {} on host)", worker.ToString(), 100 + worker.value()));
  EXPECT_EQ(table_.Describe(WorkerId(99)), "worker99");
  EXPECT_EQ(table_.AliveWorkers(), (std::vector<WorkerId>{worker}));
  table_.Remove(worker);
  EXPECT_EQ(table_.Find(worker), nullptr);
}

TEST_F(ParticipantTableTest, LoadIsCommittedMemoryAndTasksInFlightUntilDeath) {
  const WorkerId worker = table_.Accept(now_);
  ASSERT_OK(Hello(worker, proto::Role::WORKER));
  capnp::MallocMessageBuilder message;
  auto heartbeat = message.initRoot<proto::Heartbeat>();
  heartbeat.setHostUsed(100);
  table_.Heartbeat(*table_.Find(worker), heartbeat.asReader());
  table_.AddLoad(worker, 300);
  table_.AddLoad(worker, 50);
  table_.RemoveLoad(worker, 50);
  table_.RemoveLoad(WorkerId(99), 50);  // gone: nothing to discharge
  std::vector<WorkerLoad> loads = table_.WorkerLoads();
  ASSERT_EQ(loads.size(), 1u);
  EXPECT_EQ(loads[0].free_bytes, 1000 - 100 - 300);
  EXPECT_EQ(loads[0].tasks_in_flight, 1);
  table_.MarkDead(*table_.Find(worker));
  loads = table_.WorkerLoads();
  EXPECT_FALSE(loads[0].alive);
  EXPECT_EQ(loads[0].tasks_in_flight, 0);
  // Its task failing afterwards takes nothing off the cleared load (status never shows < 0).
  table_.RemoveLoad(worker, 300);
  loads = table_.WorkerLoads();
  EXPECT_EQ(loads[0].tasks_in_flight, 0);
  EXPECT_EQ(loads[0].free_bytes, 1000 - 100);
  EXPECT_EQ(table_.alive_workers(), 0);
}

TEST_F(ParticipantTableTest, ReportedFiguresAddUpWithoutOverflowing) {
  // A worker's run reports come off the wire: sums of them saturate, negative ones count nothing.
  const WorkerId worker = table_.Accept(now_);
  ASSERT_OK(Hello(worker, proto::Role::WORKER));
  capnp::MallocMessageBuilder message;
  auto report = message.initRoot<proto::RunReport>();
  report.setPushedBytes(std::numeric_limits<int64_t>::max());
  report.setCollectiveBytesSent(-5);
  table_.RecordRun(*table_.Find(worker), report.asReader());
  table_.RecordRun(*table_.Find(worker), report.asReader());
  EXPECT_EQ(table_.Find(worker)->bytes_pushed, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(table_.Find(worker)->collective_bytes_sent, 0);
  EXPECT_EQ(table_.Find(worker)->instances_finished, 2);
}

TEST_F(ParticipantTableTest, SilentAliveWorkersExpire) {
  const WorkerId quiet = table_.Accept(now_);
  ASSERT_OK(Hello(quiet, proto::Role::WORKER));
  const WorkerId driver = table_.Accept(now_);
  ASSERT_OK(Hello(driver, proto::Role::DRIVER));
  const WorkerId chatty = table_.Accept(now_);
  ASSERT_OK(Hello(chatty, proto::Role::WORKER));
  table_.Find(chatty)->last_heard = now_ + std::chrono::seconds(2);
  const auto timeout = std::chrono::milliseconds(3000);
  EXPECT_TRUE(table_.Expired(now_ + std::chrono::seconds(3), timeout).empty());
  EXPECT_EQ(table_.Expired(now_ + std::chrono::milliseconds(3001), timeout),
            (std::vector<WorkerId>{quiet}));
  table_.MarkDead(*table_.Find(quiet));
  EXPECT_TRUE(table_.Expired(now_ + std::chrono::milliseconds(3001), timeout).empty());
}

}  // namespace
}  // namespace tessera::testing

// The scheduler and hostile messages (scheduler_core_fixture.h): a message over a wire limit
// (core/rpc/wire_limits.h) is refused with the reason, changes nothing, and the scheduler goes on
// serving everyone else.
#include <functional>
#include <limits>
#include <string>

#include "core/collective_task.h"
#include "unit/scheduler_core_fixture.h"
#include "unit/scheduler_test_graphs.h"

namespace tessera::testing {
namespace {

class SchedulerLimitsTest : public SchedulerCoreTest {
 protected:
  explicit SchedulerLimitsTest(rpc::WireLimits limits = {}) : SchedulerCoreTest(limits) {}

  // A driver submits one member of a collective.
  Status SubmitMember(WorkerId driver, uint64_t id, int64_t rank, int64_t group_size) {
    return Deliver(driver, [&](proto::Envelope::Builder e) {
      TaskSpec spec;
      spec.id = TaskId(id);
      spec.name = fmt::format("m{}", id);
      spec.op = "all_reduce";
      spec.inputs = {ObjectId(1)};
      spec.outputs = {ObjectId(100 + id)};
      spec.attrs = Member(3, rank, group_size);
      rpc::ToWire(spec,
                  {ObjectSpec{ObjectId(100 + id), fmt::format("out{}", id), Floats(1),
                              ObjectRole::kActivation, spec.id}},
                  e.initBody().initSubmitTasks().initTasks(1)[0]);
    });
  }

  // The reason of the one Refused sent to `to` ("" when none, or more than one).
  std::string Refusal(WorkerId to) {
    auto refused = outbox_.Take(to, Body::REFUSED);
    if (refused.size() != 1) return "";
    return rpc::FromWire(BodyOf(refused[0]).getRefused()).message();
  }

  // The scheduler still serves: a new driver's task runs on a worker.
  void ExpectServing(WorkerId w1, WorkerId w2) {
    const WorkerId driver = Join(proto::Role::DRIVER);
    Put(driver, 50, 1, true);
    Submit(driver, 60, 50, 61);
    EXPECT_EQ(Dispatched(w1).size() + Dispatched(w2).size(), 1u) << "the good task runs";
    EXPECT_EQ(core_.alive_workers(), 2);
  }
};

TEST_F(SchedulerLimitsTest, TheReportedGroupSizesAreRefusedAndTheSchedulerKeepsServing) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Put(driver, 1, 1, true);
  // 2,000,000,000 members: once a bad_alloc (or 5.5 GB), now a refusal naming the size.
  Status refused = SubmitMember(driver, 10, 0, 2'000'000'000);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  const std::string expected =
      "submitted task: collective task 'm10': a group of 2000000000 members is more than any "
      "cluster holds (at most 4096)";
  EXPECT_EQ(refused.message(), expected);
  EXPECT_EQ(Refusal(driver), expected) << "the driver hears why";
  EXPECT_TRUE(outbox_.disconnected.contains(driver));
  EXPECT_EQ(core_.num_tasks(), 0u) << "nothing was submitted";
  // 2^32 + 2 members with rank 2147483000: once truncated to 2 and written out of bounds.
  const WorkerId other = Join(proto::Role::DRIVER);
  Put(other, 2, 1, true);
  refused = SubmitMember(other, 11, 2147483000, 4294967298);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("a group of 4294967298 members"), std::string::npos)
      << refused.ToString();
  EXPECT_FALSE(Refusal(other).empty());
  EXPECT_EQ(core_.num_tasks(), 0u);
  ExpectServing(w1, w2);
}

TEST_F(SchedulerLimitsTest, ARegisteredGraphWithAnOversizedGroupIsRefused) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  AddGelu(graph, "m0", {x}, 1, WorkerId(), Member(4, 0, 2'000'000'000));
  AddGelu(graph, "m1", {x}, 1, WorkerId(), Member(4, 2147483000, 4294967298));
  const Status refused = Deliver(driver, [&](proto::Envelope::Builder e) {
    e.setRequestId(7);
    RegisterGraphToWire(graph, 1, e.initBody().initRegisterGraph());
  });
  EXPECT_EQ(refused.message(),
            "collective task 'm0': a group of 2000000000 members is more than any cluster holds "
            "(at most 4096)");
  auto answers = outbox_.Take(driver, Body::REFUSED);
  ASSERT_EQ(answers.size(), 1u);
  EXPECT_EQ(answers[0]->reader().getRoot<proto::Envelope>().getRequestId(), 7u)
      << "the answer to the registration";
  EXPECT_TRUE(outbox_.Take(w1, Body::GRAPH_PART).empty());
  EXPECT_TRUE(outbox_.Take(w2, Body::GRAPH_PART).empty());
  ExpectServing(w1, w2);
}

TEST_F(SchedulerLimitsTest, AWorkersFiguresOutsideWhatAHostHoldsAreRefused) {
  // Found by fuzz_control_plane: a heartbeat's host figures are subtracted from each other to
  // place tasks, and INT64_MIN overflowed (UBSan). They are bounded on the wire now.
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  const Status refused = Deliver(w2, [](proto::Envelope::Builder e) {
    auto heartbeat = e.initBody().initHeartbeat();
    heartbeat.setHostCapacity(std::numeric_limits<int64_t>::max());
    heartbeat.setHostUsed(std::numeric_limits<int64_t>::min());
  });
  EXPECT_EQ(refused.message(),
            "Heartbeat.hostUsed is -9223372036854775808 bytes, outside [0, 1125899906842624]");
  EXPECT_EQ(Refusal(w2), refused.message());
  core_.Disconnected(w2, refused);  // as the service does once the connection closes
  Put(driver, 1, 1, true);
  Submit(driver, 2, 1, 3);
  EXPECT_EQ(Dispatched(w1).size(), 1u) << "the other worker runs the task";
  EXPECT_EQ(core_.alive_workers(), 1);
}

TEST_F(SchedulerLimitsTest, ACollectiveFailureSilentForAgesIsRefused) {
  // Found by fuzz_control_plane: a member's report of how long a peer was silent is subtracted
  // from the scheduler's clock, and 2^62 ms overflowed the conversion to nanoseconds (UBSan).
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  const Status refused = Deliver(w1, [](proto::Envelope::Builder e) {
    auto failed = e.initBody().initCollectiveFailed();
    failed.setGroup(1);
    failed.setSilentMs(int64_t{1} << 62);
  });
  EXPECT_EQ(refused.message(),
            "CollectiveFailed.silentMs is 4611686018427387904 ms, more than the limit of "
            "1099511627776");
  EXPECT_EQ(Refusal(w1), refused.message());
  ExpectServing(w1, w2);
}

// The limits come from the options (the settings): each is refused with its message.
class ConfiguredLimitsTest : public SchedulerLimitsTest {
 protected:
  ConfiguredLimitsTest() : SchedulerLimitsTest(SmallLimits()) {}
  static rpc::WireLimits SmallLimits() {
    rpc::WireLimits limits;
    limits.max_tasks = 2;
    limits.max_objects = 4;
    limits.max_group_size = 2;
    limits.max_name_bytes = 32;
    return limits;
  }
};

TEST_F(ConfiguredLimitsTest, EachLimitIsRefusedWithItsMessageAndChangesNothing) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Put(driver, 1, 1, true);
  auto refusal = [&](const std::function<void(proto::Envelope::Builder)>& fill) {
    const WorkerId sender = Join(proto::Role::DRIVER);
    const Status status = Deliver(sender, fill);
    auto refused = outbox_.Take(sender, Body::REFUSED);
    EXPECT_EQ(refused.size(), 1u);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    return status.message();
  };
  auto gelu = [](proto::Task::Builder out, uint64_t id, const std::string& name) {
    TaskSpec spec;
    spec.id = TaskId(id);
    spec.name = name;
    spec.op = "gelu_forward";
    spec.inputs = {ObjectId(1)};
    rpc::ToWire(spec, {}, out);
  };
  EXPECT_EQ(refusal([&](proto::Envelope::Builder e) {
              auto tasks = e.initBody().initSubmitTasks().initTasks(3);
              for (unsigned i = 0; i < 3; ++i) gelu(tasks[i], 20 + i, "t");
            }),
            "SubmitTasks.tasks has 3 entries, more than the limit of 2 (TESSERA_WIRE_MAX_TASKS)");
  EXPECT_EQ(
      refusal([&](proto::Envelope::Builder e) { e.initBody().initWatchObjects().initIds(5); }),
      "WatchObjects.ids has 5 entries, more than the limit of 4 (TESSERA_WIRE_MAX_OBJECTS)");
  EXPECT_EQ(refusal([&](proto::Envelope::Builder e) {
              gelu(e.initBody().initSubmitTasks().initTasks(1)[0], 30, std::string(33, 'n'));
            }),
            "SubmitTasks.tasks: task name is 33 bytes long, more than the limit of 32 "
            "(TESSERA_WIRE_MAX_NAME_BYTES)");
  // A bad task in a batch: the good one before it is not submitted either.
  EXPECT_EQ(refusal([&](proto::Envelope::Builder e) {
              auto tasks = e.initBody().initSubmitTasks().initTasks(2);
              gelu(tasks[0], 40, "good");
              gelu(tasks[1], 41, "bad");
              tasks[1].setMemoryEstimate(-5);
            }),
            "submitted task: task 'bad' estimates -5 bytes of memory, outside [0, "
            "1099511627776] (TESSERA_WIRE_MAX_TENSOR_BYTES)");
  EXPECT_EQ(core_.num_tasks(), 0u);
  // Three members of a collective: over the cluster's group limit of 2.
  const Status status = SubmitMember(driver, 50, 0, 3);
  EXPECT_EQ(status.message(),
            "submitted task: collective task 'm50': group_size 3 is more than the limit of 2 "
            "(TESSERA_WIRE_MAX_GROUP_SIZE)");
  EXPECT_EQ(Refusal(driver), status.message());
  ExpectServing(w1, w2);
}

}  // namespace
}  // namespace tessera::testing

// The scheduler's state machine, driven without sockets: a fake outbox records what it sends and
// a fake clock drives heartbeats.
#include <map>

#include "core/rpc/frame.h"
#include "core/rpc/wire.h"
#include "scheduler/collective_groups.h"
#include "scheduler/scheduler_core.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using Body = proto::Envelope::Body;

// Records every message as a decoded copy, per destination.
class FakeOutbox : public Outbox {
 public:
  void Send(WorkerId to, capnp::MessageBuilder& message) override {
    std::vector<uint8_t> frame = rpc::EncodeFrame(message);
    rpc::FrameDecoder decoder;
    TESSERA_CHECK(decoder.Feed(frame).ok());
    sent[to].push_back(decoder.PopMessage());
  }
  void Disconnect(WorkerId who, const Status& reason) override { disconnected[who] = reason; }

  // Messages of one kind sent to `to`, oldest first; clears them.
  std::vector<std::unique_ptr<rpc::ReceivedMessage>> Take(WorkerId to, Body::Which kind) {
    std::vector<std::unique_ptr<rpc::ReceivedMessage>> matching, rest;
    for (auto& message : sent[to]) {
      if (message->reader().getRoot<proto::Envelope>().getBody().which() == kind) {
        matching.push_back(std::move(message));
      } else {
        rest.push_back(std::move(message));
      }
    }
    sent[to] = std::move(rest);
    return matching;
  }

  std::map<WorkerId, std::vector<std::unique_ptr<rpc::ReceivedMessage>>> sent;
  std::map<WorkerId, Status> disconnected;
};

Body::Reader BodyOf(const std::unique_ptr<rpc::ReceivedMessage>& message) {
  return message->reader().getRoot<proto::Envelope>().getBody();
}

class SchedulerCoreTest : public ::testing::Test {
 protected:
  SchedulerCoreTest()
      : core_(
            SchedulerOptions{
                .token = "secret", .heartbeat_timeout_ms = 3000, .session_dir = "/tmp/s"},
            &outbox_, [this] { return now_; }) {}

  Status Deliver(WorkerId from, const std::function<void(proto::Envelope::Builder)>& fill) {
    capnp::MallocMessageBuilder message;
    fill(message.initRoot<proto::Envelope>());
    std::vector<uint8_t> frame = rpc::EncodeFrame(message);
    rpc::FrameDecoder decoder;
    TESSERA_CHECK(decoder.Feed(frame).ok());
    auto received = decoder.PopMessage();
    Status status = core_.Handle(from, received->reader().getRoot<proto::Envelope>());
    core_.Flush();
    return status;
  }

  WorkerId Join(proto::Role role, const std::string& token = "secret", int64_t capacity = 1 << 30) {
    const WorkerId id = core_.Accept();
    Status hello = Deliver(id, [&](proto::Envelope::Builder e) {
      auto h = e.initBody().initHello();
      h.setProtocolVersion(rpc::kProtocolVersion);
      h.setRole(role);
      h.setToken(token);
      h.setHostname("host");
      h.setPid(static_cast<int32_t>(100 + id.value()));
      h.setDataAddress("data-" + std::to_string(id.value()));
      h.setHostCapacity(capacity);
    });
    if (token == "secret") {
      EXPECT_OK(hello);
      EXPECT_EQ(outbox_.Take(id, Body::WELCOME).size(), 1u);
    }
    return id;
  }

  // A driver Put of a scalar (inline) or a big object (held by the driver).
  void Put(WorkerId driver, uint64_t id, int64_t numel, bool inline_data) {
    ASSERT_OK(Deliver(driver, [&](proto::Envelope::Builder e) {
      auto put = e.initBody().initPutObjects();
      ObjectSpec spec{ObjectId(id),
                      "put" + std::to_string(id),
                      {Shape{numel}, DType::kF32, Device::Cpu()},
                      ObjectRole::kInput,
                      TaskId()};
      rpc::ToWire(spec, put.initObjects(1)[0]);
      auto inlines = put.initInline(1);
      if (inline_data)
        inlines.set(0, capnp::Data::Reader(reinterpret_cast<const kj::byte*>("abcd"), 4));
    }));
  }

  // A driver submits gelu(input) -> output.
  void Submit(WorkerId driver, uint64_t task_id, uint64_t input, uint64_t output, int64_t numel = 1,
              WorkerId pinned = WorkerId()) {
    ASSERT_OK(Deliver(driver, [&](proto::Envelope::Builder e) {
      auto tasks = e.initBody().initSubmitTasks().initTasks(1);
      TaskSpec spec;
      spec.id = TaskId(task_id);
      spec.name = "t" + std::to_string(task_id);
      spec.op = "gelu_forward";
      spec.inputs = {ObjectId(input)};
      spec.outputs = {ObjectId(output)};
      spec.pinned_worker = pinned;
      ObjectSpec out{ObjectId(output),
                     "o" + std::to_string(output),
                     {Shape{numel}, DType::kF32, Device::Cpu()},
                     ObjectRole::kActivation,
                     TaskId(task_id)};
      rpc::ToWire(spec, {out}, tasks[0]);
    }));
  }

  void Finish(WorkerId worker, uint64_t task_id, uint64_t output, int64_t bytes = 4) {
    ASSERT_OK(Deliver(worker, [&](proto::Envelope::Builder e) {
      auto result = e.initBody().initTasksFinished().initResults(1)[0];
      result.setTask(task_id);
      auto sealed = result.initOutputs(1)[0];
      sealed.setId(output);
      sealed.setBytes(bytes);
    }));
  }

  void Watch(WorkerId driver, uint64_t id) {
    ASSERT_OK(Deliver(driver, [&](proto::Envelope::Builder e) {
      e.initBody().initWatchObjects().initIds(1).set(0, id);
    }));
  }

  void Release(WorkerId driver, uint64_t id) {
    ASSERT_OK(Deliver(driver, [&](proto::Envelope::Builder e) {
      e.initBody().initReleaseObjects().initIds(1).set(0, id);
    }));
  }

  // Task ids in every DispatchTasks sent to `worker` (and clears them).
  std::vector<uint64_t> Dispatched(WorkerId worker) {
    std::vector<uint64_t> ids;
    for (auto& message : outbox_.Take(worker, Body::DISPATCH_TASKS)) {
      for (auto task : BodyOf(message).getDispatchTasks().getTasks())
        ids.push_back(task.getTask().getId());
    }
    return ids;
  }

  FakeOutbox outbox_;
  SchedulerCore::Clock::time_point now_{};
  SchedulerCore core_;
};

TEST_F(SchedulerCoreTest, AJoinWithoutTheTokenIsRefused) {
  const WorkerId intruder = Join(proto::Role::WORKER, "guess");
  auto refused = outbox_.Take(intruder, Body::REFUSED);
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_NE(
      rpc::ToString(BodyOf(refused[0]).getRefused().getMessage()).find("invalid cluster token"),
      std::string::npos);
  EXPECT_TRUE(outbox_.disconnected.contains(intruder));
  EXPECT_EQ(core_.alive_workers(), 0);

  const WorkerId rude = core_.Accept();
  Status skipped_hello =
      Deliver(rude, [](proto::Envelope::Builder e) { e.initBody().initHeartbeat(); });
  EXPECT_FALSE(skipped_hello.ok());
  EXPECT_TRUE(outbox_.disconnected.contains(rude));
}

TEST_F(SchedulerCoreTest, RunsATaskAndTellsTheWatchingDriver) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1, /*inline_data=*/true);
  Submit(driver, 10, 1, 2);
  Watch(driver, 2);
  auto dispatches = outbox_.Take(worker, Body::DISPATCH_TASKS);
  ASSERT_EQ(dispatches.size(), 1u);
  auto task = BodyOf(dispatches[0]).getDispatchTasks().getTasks()[0];
  EXPECT_EQ(task.getTask().getId(), 10u);
  ASSERT_EQ(task.getInlineInputs().size(), 1u) << "a small input travels with the task";
  EXPECT_EQ(task.getSources().size(), 0u);

  Finish(worker, 10, 2);
  auto ready = outbox_.Take(driver, Body::OBJECTS_READY);
  ASSERT_EQ(ready.size(), 1u);
  auto state = BodyOf(ready[0]).getObjectsReady().getObjects()[0];
  EXPECT_EQ(state.getId(), 2u);
  EXPECT_FALSE(state.hasError());
  EXPECT_EQ(state.getSource().getHolder(), worker.value());
  EXPECT_EQ(rpc::ToString(state.getSource().getAddress()),
            "data-" + std::to_string(worker.value()));

  // Releasing the output frees it on the worker; the input (now unused) too once released.
  Release(driver, 2);
  auto frees = outbox_.Take(worker, Body::FREE_OBJECTS);
  ASSERT_EQ(frees.size(), 1u);
  EXPECT_EQ(BodyOf(frees[0]).getFreeObjects().getIds()[0], 2u);
  Release(driver, 1);
  EXPECT_EQ(core_.num_objects(), 0u);
  EXPECT_EQ(core_.num_tasks(), 0u);
}

TEST_F(SchedulerCoreTest, TasksGoWhereTheirInputsAre) {
  const WorkerId w1 = Join(proto::Role::WORKER);
  const WorkerId w2 = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1, true);
  Submit(driver, 10, 1, 2, /*numel=*/1 << 20);  // big output
  const WorkerId first = Dispatched(w1).empty() ? w2 : w1;
  Dispatched(w2);
  Finish(first, 10, 2, 4 << 20);
  for (uint64_t t = 11; t < 15; ++t) Submit(driver, t, 2, 100 + t);
  const WorkerId other = first == w1 ? w2 : w1;
  EXPECT_EQ(Dispatched(first).size(), 4u) << "every reader of the 4 MiB object runs where it is";
  EXPECT_TRUE(Dispatched(other).empty());
}

TEST_F(SchedulerCoreTest, ADependentTaskWaitsForItsInput) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1, true);
  Submit(driver, 10, 1, 2);
  Submit(driver, 11, 2, 3);
  EXPECT_EQ(Dispatched(worker), (std::vector<uint64_t>{10}));
  Finish(worker, 10, 2);
  EXPECT_EQ(Dispatched(worker), (std::vector<uint64_t>{11}));
}

TEST_F(SchedulerCoreTest, ADeadWorkersTaskIsRetriedWhenItsInputsSurvive) {
  const WorkerId w1 = Join(proto::Role::WORKER);
  const WorkerId w2 = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1 << 20, /*inline_data=*/false);  // held by the driver
  Submit(driver, 10, 1, 2);
  const WorkerId victim = Dispatched(w1).empty() ? w2 : w1;
  const WorkerId survivor = victim == w1 ? w2 : w1;
  Dispatched(w2);
  core_.Disconnected(victim, Unavailable("connection reset"));
  core_.Flush();
  EXPECT_EQ(Dispatched(survivor), (std::vector<uint64_t>{10}));
  EXPECT_EQ(core_.alive_workers(), 1);
}

TEST_F(SchedulerCoreTest, ObjectsLostWithAWorkerFailEverythingThatNeedsThem) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1, true);
  Submit(driver, 10, 1, 2, 1 << 20);
  Finish(worker, 10, 2, 4 << 20);
  Submit(driver, 11, 2, 3);  // dispatched to the worker, which then dies
  Watch(driver, 2);
  Watch(driver, 3);
  outbox_.Take(driver, Body::OBJECTS_READY);  // 2 was already ready
  core_.Disconnected(worker, Unavailable("connection reset"));
  core_.Flush();
  auto ready = outbox_.Take(driver, Body::OBJECTS_READY);
  ASSERT_EQ(ready.size(), 1u);
  auto objects = BodyOf(ready[0]).getObjectsReady().getObjects();
  ASSERT_EQ(objects.size(), 1u);
  EXPECT_EQ(objects[0].getId(), 3u);
  ASSERT_TRUE(objects[0].hasError());
  const std::string message = rpc::ToString(objects[0].getError().getMessage());
  EXPECT_NE(message.find("t11"), std::string::npos) << message;
  EXPECT_NE(message.find(worker.ToString()), std::string::npos) << message;
  EXPECT_NE(message.find("lost inputs: o2"), std::string::npos) << message;
  // Asking for the lost object itself also gives the reason.
  Watch(driver, 2);
  auto lost = outbox_.Take(driver, Body::OBJECTS_READY);
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_NE(rpc::ToString(BodyOf(lost[0]).getObjectsReady().getObjects()[0].getError().getMessage())
                .find("only copy was on"),
            std::string::npos);
}

TEST_F(SchedulerCoreTest, ATaskOnAFailedInputFailsWithoutDisturbingOtherReaders) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1, true);
  Submit(driver, 10, 1, 2);  // dispatched
  ASSERT_OK(Deliver(worker, [](proto::Envelope::Builder e) {
    auto result = e.initBody().initTasksFinished().initResults(1)[0];
    result.setTask(10);
    rpc::ToWire(InvalidArgument("kernel refused"), result.initError());
  }));
  Submit(driver, 11, 2, 3);  // reads the failed object: fails at once
  Watch(driver, 3);
  auto ready = outbox_.Take(driver, Body::OBJECTS_READY);
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_NE(
      rpc::ToString(BodyOf(ready[0]).getObjectsReady().getObjects()[0].getError().getMessage())
          .find("kernel refused"),
      std::string::npos);
  // Everything is released cleanly: no dangling uses keep objects alive.
  Release(driver, 2);
  Release(driver, 3);
  Release(driver, 1);
  EXPECT_EQ(core_.num_objects(), 0u);
  EXPECT_EQ(core_.num_tasks(), 0u);
}

TEST_F(SchedulerCoreTest, MissedHeartbeatsDeclareAWorkerDead) {
  const WorkerId worker = Join(proto::Role::WORKER);
  now_ += std::chrono::milliseconds(2000);
  ASSERT_OK(Deliver(worker, [](proto::Envelope::Builder e) { e.initBody().initHeartbeat(); }));
  now_ += std::chrono::milliseconds(2500);
  core_.Tick();
  core_.Flush();
  EXPECT_EQ(core_.alive_workers(), 1);
  now_ += std::chrono::milliseconds(1000);
  core_.Tick();
  core_.Flush();
  EXPECT_EQ(core_.alive_workers(), 0);
  ASSERT_TRUE(outbox_.disconnected.contains(worker));
  EXPECT_NE(outbox_.disconnected[worker].message().find("no heartbeat"), std::string::npos);
}

TEST_F(SchedulerCoreTest, UnknownInputsAndWrongRolesAreReported) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Submit(driver, 10, /*input=*/999, 2);
  Watch(driver, 2);
  auto ready = outbox_.Take(driver, Body::OBJECTS_READY);
  ASSERT_EQ(ready.size(), 1u);
  const std::string message =
      rpc::ToString(BodyOf(ready[0]).getObjectsReady().getObjects()[0].getError().getMessage());
  EXPECT_NE(message.find("obj999"), std::string::npos) << message;
  EXPECT_TRUE(Dispatched(worker).empty());

  // A worker may not submit tasks; a driver may not report results.
  EXPECT_FALSE(
      Deliver(worker, [](proto::Envelope::Builder e) { e.initBody().initSubmitTasks(); }).ok());
  EXPECT_FALSE(
      Deliver(driver, [](proto::Envelope::Builder e) { e.initBody().initTasksFinished(); }).ok());
  // A result for a task the worker is not running is ignored, not fatal.
  EXPECT_OK(Deliver(worker, [](proto::Envelope::Builder e) {
    e.initBody().initTasksFinished().initResults(1)[0].setTask(12345);
  }));
}

TEST_F(SchedulerCoreTest, StatusDescribesWorkersAndTasks) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId admin = Join(proto::Role::ADMIN);
  ASSERT_OK(Deliver(admin, [](proto::Envelope::Builder e) {
    e.setRequestId(5);
    e.initBody().initStatusRequest();
  }));
  auto replies = outbox_.Take(admin, Body::STATUS_REPLY);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0]->reader().getRoot<proto::Envelope>().getRequestId(), 5u);
  auto status = BodyOf(replies[0]).getStatusReply();
  ASSERT_EQ(status.getWorkers().size(), 1u);
  EXPECT_EQ(status.getWorkers()[0].getId(), worker.value());
  EXPECT_TRUE(status.getWorkers()[0].getAlive());
  EXPECT_EQ(status.getWorkers()[0].getHeartbeat().getHostCapacity(), 1 << 30);
  EXPECT_EQ(rpc::ToString(status.getSessionDir()), "/tmp/s");
}

}  // namespace
}  // namespace tessera::testing

namespace tessera::testing {
namespace {

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

  Status Report(WorkerId from, uint64_t group, const std::string& why, int64_t silent_ms) {
    capnp::MallocMessageBuilder message;
    auto failed = message.initRoot<proto::CollectiveFailed>();
    failed.setGroup(group);
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

TEST_F(CollectiveGroupsTest, ADeathIsCertainAndANewEpochFormsTheGroupAgain) {
  const uint64_t group = groups_.GroupFor({a_, b_});
  groups_.WorkerDied(b_, Unavailable("no heartbeat for 3000 ms"));
  EXPECT_NE(AbortMessage(a_).find("worker2 (rank 1 of collective group"), std::string::npos);
  // Reports after the verdict change nothing.
  ASSERT_OK(Report(a_, group, "heard nothing", 10));
  now_ += std::chrono::seconds(1);
  groups_.Tick(now_);
  EXPECT_TRUE(outbox_.Take(a_, Body::COLLECTIVE_ABORT).empty());
  // The members form it again (epoch 2): the exchange works as new.
  ASSERT_OK(Join(a_, group, 2, 0, 0, 2, "A2"));
  ASSERT_OK(Join(b_, group, 2, 0, 1, 2, "B2"));
  EXPECT_EQ(outbox_.Take(a_, Body::COLLECTIVE_PEERS).size(), 1u);
}

}  // namespace
}  // namespace tessera::testing

// The scheduler's state machine, driven without sockets: a fake outbox records what it sends and
// a fake clock drives heartbeats.
#include <cmath>
#include <limits>
#include <map>

#include "core/collective_task.h"
#include "core/graph.h"

#include "core/rpc/frame.h"
#include "core/rpc/wire.h"
#include "scheduler/collective_groups.h"
#include "scheduler/dashboard_view.h"
#include "scheduler/job_metrics.h"
#include "scheduler/scheduler_core.h"
#include "test_util.h"
#include "unit/scheduler_test_graphs.h"

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

  // Messages of one kind sent to `to` (that `also` accepts), oldest first; clears them.
  std::vector<std::unique_ptr<rpc::ReceivedMessage>> Take(
      WorkerId to, Body::Which kind,
      const std::function<bool(Body::Reader)>& also = [](Body::Reader) { return true; }) {
    std::vector<std::unique_ptr<rpc::ReceivedMessage>> matching, rest;
    for (auto& message : sent[to]) {
      const Body::Reader body = message->reader().getRoot<proto::Envelope>().getBody();
      if (body.which() == kind && also(body)) {
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

  WorkerId Join(proto::Role role, const std::string& token = "secret", int64_t capacity = 1 << 30,
                const std::string& gpu = "") {
    const WorkerId id = core_.Accept();
    Status hello = Deliver(id, [&](proto::Envelope::Builder e) {
      auto h = e.initBody().initHello();
      h.setGpu(gpu);
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

  // The error of the one object in the one ObjectsReady sent to `driver` ("" when it is ready).
  std::string ReadyError(WorkerId driver) {
    auto ready = outbox_.Take(driver, Body::OBJECTS_READY);
    if (ready.size() != 1) return fmt::format("{} ObjectsReady", ready.size());
    auto state = BodyOf(ready[0]).getObjectsReady().getObjects()[0];
    return state.hasError() ? rpc::FromWire(state.getError()).ToString() : "";
  }

  // Two workers then a driver.
  struct Cluster {
    WorkerId w1, w2, driver;
  };
  Cluster JoinTwoWorkersAndADriver() {
    const WorkerId w1 = Join(proto::Role::WORKER);
    const WorkerId w2 = Join(proto::Role::WORKER);
    return Cluster{w1, w2, Join(proto::Role::DRIVER)};
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

  // The worker's report of a submitted task's instance (its id is the task's): `output` sealed.
  void Finish(WorkerId worker, uint64_t task_id, uint64_t output, int64_t bytes = 4) {
    if (!graph_of_.contains(task_id)) Dispatched(worker);
    ASSERT_OK(Deliver(worker, [&](proto::Envelope::Builder e) {
      auto finished = e.initBody().initInstanceFinished();
      finished.setGraphId(graph_of_[task_id]);
      finished.setInstance(task_id);
      auto sealed = finished.initOutputs(1)[0];
      sealed.setId(output);
      sealed.setBytes(bytes);
    }));
  }
  // ... or its failure.
  void FinishWithError(WorkerId worker, uint64_t task_id, const Status& error) {
    if (!graph_of_.contains(task_id)) Dispatched(worker);
    ASSERT_OK(Deliver(worker, [&](proto::Envelope::Builder e) {
      auto finished = e.initBody().initInstanceFinished();
      finished.setGraphId(graph_of_[task_id]);
      finished.setInstance(task_id);
      rpc::ToWire(error, finished.initError());
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

  // Submitted tasks started on `worker`: the instances of scheduler-owned graphs in every RunGraph
  // sent there (a submitted task's instance id is its task id; a dynamic collective's, its rank
  // 0 task's). Clears those messages and the parts of those graphs; remembers each instance's
  // graph for Finish.
  std::vector<uint64_t> Dispatched(WorkerId worker) {
    const auto scheduler_owned = [](Body::Reader body) {
      const uint64_t graph = body.which() == Body::RUN_GRAPH ? body.getRunGraph().getGraphId()
                                                             : body.getGraphPart().getGraphId();
      return graph >= kFirstSchedulerGraphId;
    };
    outbox_.Take(worker, Body::GRAPH_PART, scheduler_owned);
    std::vector<uint64_t> ids;
    for (auto& message : outbox_.Take(worker, Body::RUN_GRAPH, scheduler_owned)) {
      const auto run = BodyOf(message).getRunGraph();
      ids.push_back(run.getInstance());
      graph_of_[run.getInstance()] = run.getGraphId();
    }
    return ids;
  }

  std::map<uint64_t, uint64_t> graph_of_;  // instance -> its graph (Dispatched)
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
  auto parts = outbox_.Take(worker, Body::GRAPH_PART);
  ASSERT_EQ(parts.size(), 1u) << "the task's one-task graph, once";
  EXPECT_EQ(BodyOf(parts[0]).getGraphPart().getTasks().size(), 1u);
  auto dispatches = outbox_.Take(worker, Body::RUN_GRAPH);
  ASSERT_EQ(dispatches.size(), 1u);
  auto task = BodyOf(dispatches[0]).getRunGraph();
  EXPECT_EQ(task.getInstance(), 10u);
  graph_of_[10] = task.getGraphId();
  ASSERT_EQ(task.getTaskNames().size(), 1u);
  EXPECT_EQ(rpc::ToString(task.getTaskNames()[0]), "t10");
  ASSERT_EQ(task.getInlineInputs().size(), 1u) << "a small input travels with the task";
  EXPECT_EQ(task.getInputs().size(), 0u);

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

// A chain put -> t10 -> o2 -> t11 -> o3 -> t12 -> o4 ran on w1; the driver keeps only o4, so o2
// and o3 were freed. w1 dies with o4: the chain runs again on w2 from the put, one task after
// the other, and the driver gets o4 from w2.
TEST_F(SchedulerCoreTest, ALostObjectIsRebuiltFromItsLineageThroughFreedInputs) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Put(driver, 1, 1 << 20, /*inline_data=*/false);
  for (uint64_t t = 10; t <= 12; ++t) {
    Submit(driver, t, t - 9, t - 8, 1 << 20);
    core_.Flush();
    ASSERT_EQ(Dispatched(w1), (std::vector<uint64_t>{t}));
    Finish(w1, t, t - 8, 4 << 20);
  }
  Release(driver, 2);
  Release(driver, 3);
  EXPECT_EQ(core_.num_objects(), 2u);  // the put and o4
  core_.Disconnected(w1, Unavailable("killed"));
  for (uint64_t t = 10; t <= 12; ++t) {
    core_.Flush();
    ASSERT_EQ(Dispatched(w2), (std::vector<uint64_t>{t})) << "task t" << t << " runs again";
    Finish(w2, t, t - 8, 4 << 20);
  }
  Watch(driver, 4);
  core_.Flush();
  auto ready = outbox_.Take(driver, Body::OBJECTS_READY);
  ASSERT_EQ(ready.size(), 1u);
  auto object = BodyOf(ready[0]).getObjectsReady().getObjects()[0];
  ASSERT_FALSE(object.hasError()) << rpc::ToString(object.getError().getMessage());
  EXPECT_EQ(object.getSource().getHolder(), w2.value());
  EXPECT_EQ(core_.num_objects(), 2u) << "the rebuilt intermediates are freed again";
}

// Each task runs again at most max_task_attempts (3) times; then the lost object fails, saying so.
TEST_F(SchedulerCoreTest, RebuildingStopsAtTheBudget) {
  const WorkerId driver = Join(proto::Role::DRIVER);
  WorkerId holder = Join(proto::Role::WORKER);
  Put(driver, 1, 1 << 20, /*inline_data=*/false);
  Submit(driver, 10, 1, 2, 1 << 20);
  core_.Flush();
  ASSERT_EQ(Dispatched(holder), (std::vector<uint64_t>{10}));
  Finish(holder, 10, 2, 4 << 20);
  for (int rebuilds = 1; rebuilds <= 3; ++rebuilds) {
    const WorkerId next = Join(proto::Role::WORKER);
    core_.Disconnected(holder, Unavailable("killed"));
    core_.Flush();
    ASSERT_EQ(Dispatched(next), (std::vector<uint64_t>{10})) << "rebuild " << rebuilds;
    Finish(next, 10, 2, 4 << 20);
    holder = next;
  }
  Join(proto::Role::WORKER);
  core_.Disconnected(holder, Unavailable("killed"));
  Watch(driver, 2);
  const std::string error = ReadyError(driver);
  EXPECT_NE(error.find("only copy was on"), std::string::npos) << error;
  EXPECT_NE(error.find("its task 't10' was run again 3 times already"), std::string::npos) << error;
}

TEST_F(SchedulerCoreTest, ATaskOnAFailedInputFailsWithoutDisturbingOtherReaders) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  Put(driver, 1, 1, true);
  Submit(driver, 10, 1, 2);  // dispatched
  ASSERT_EQ(Dispatched(worker), (std::vector<uint64_t>{10}));
  FinishWithError(worker, 10, InvalidArgument("kernel refused"));
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

// Workers and drivers take a scheduler silent past their limit for gone (a stopped process closes
// no connection): every heartbeat interval each alive participant gets at least a keepalive.
TEST_F(SchedulerCoreTest, EveryParticipantHearsFromTheSchedulerEachHeartbeatInterval) {
  const WorkerId worker = Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  const WorkerId dead = Join(proto::Role::WORKER);
  core_.Disconnected(dead, Unavailable("gone"));
  for (int interval = 1; interval <= 3; ++interval) {
    now_ += std::chrono::milliseconds(500);  // the default heartbeat interval
    ASSERT_OK(Deliver(worker, [](proto::Envelope::Builder e) { e.initBody().initHeartbeat(); }));
    core_.Tick();
    core_.Flush();
    EXPECT_EQ(outbox_.Take(worker, Body::KEEPALIVE).size(), 1u) << "interval " << interval;
    EXPECT_EQ(outbox_.Take(driver, Body::KEEPALIVE).size(), 1u) << "interval " << interval;
    EXPECT_TRUE(outbox_.Take(dead, Body::KEEPALIVE).empty());
  }
  // More ticks within one interval send nothing more.
  core_.Tick();
  core_.Flush();
  EXPECT_TRUE(outbox_.Take(worker, Body::KEEPALIVE).empty());
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
  EXPECT_FALSE(Deliver(driver, [](proto::Envelope::Builder e) {
                 e.initBody().initInstanceFinished();
               }).ok());
  // A result for an instance the worker is not running is ignored, not fatal.
  EXPECT_OK(Deliver(worker, [](proto::Envelope::Builder e) {
    auto finished = e.initBody().initInstanceFinished();
    finished.setGraphId(kFirstSchedulerGraphId + 77);
    finished.setInstance(12345);
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

// ---- registered graphs ----

class RegisteredGraphTest : public SchedulerCoreTest {
 protected:
  // Sends RegisterGraph as the driver library does; returns the protocol status.
  Status Register(WorkerId driver, uint64_t graph_id, const Graph& graph, uint64_t request_id = 7) {
    return Deliver(driver, [&](proto::Envelope::Builder e) {
      e.setRequestId(request_id);
      RegisterGraphToWire(graph, graph_id, e.initBody().initRegisterGraph());
    });
  }

  // The one Reply the driver got (its error, OK when none).
  Status TakeReply(WorkerId driver, uint64_t request_id = 7) {
    auto replies = outbox_.Take(driver, Body::REPLY);
    if (replies.size() != 1) return Internal("{} replies", replies.size());
    EXPECT_EQ(replies[0]->reader().getRoot<proto::Envelope>().getRequestId(), request_id);
    auto reply = BodyOf(replies[0]).getReply();
    return reply.hasMessage() || reply.getCode() != 0 ? rpc::FromWire(reply) : Status::Ok();
  }

  // The task workers of the one GraphPart sent to `worker` (empty when none).
  std::vector<uint64_t> PartOn(WorkerId worker) {
    auto parts = outbox_.Take(worker, Body::GRAPH_PART);
    if (parts.size() != 1) return {};
    std::vector<uint64_t> task_workers;
    for (uint64_t w : BodyOf(parts[0]).getGraphPart().getTaskWorkers()) task_workers.push_back(w);
    return task_workers;
  }

  Status Run(WorkerId driver, uint64_t graph_id, uint64_t instance,
             const std::vector<std::pair<uint64_t, uint64_t>>& bindings,
             const std::vector<uint64_t>& output_ids) {
    return Deliver(driver, [&](proto::Envelope::Builder e) {
      auto run = e.initBody().initRunGraph();
      run.setGraphId(graph_id);
      run.setInstance(instance);
      auto inputs = run.initInputs(static_cast<unsigned>(bindings.size()));
      for (unsigned i = 0; i < bindings.size(); ++i) {
        inputs[i].setObject(bindings[i].first);
        inputs[i].initSource().setObject(bindings[i].second);
      }
      auto ids = run.initOutputIds(static_cast<unsigned>(output_ids.size()));
      for (unsigned i = 0; i < output_ids.size(); ++i) ids.set(i, output_ids[i]);
    });
  }

  // `worker` finished its part of the instance, sealing `sealed` (or failed with `error`).
  Status InstanceDone(WorkerId worker, uint64_t graph_id, uint64_t instance,
                      const std::vector<uint64_t>& sealed, const Status& error = Status::Ok()) {
    return Deliver(worker, [&](proto::Envelope::Builder e) {
      auto done = e.initBody().initInstanceFinished();
      done.setGraphId(graph_id);
      done.setInstance(instance);
      if (!error.ok()) rpc::ToWire(error, done.initError());
      auto outputs = done.initOutputs(static_cast<unsigned>(sealed.size()));
      for (unsigned i = 0; i < sealed.size(); ++i) {
        outputs[i].setId(sealed[i]);
        outputs[i].setBytes(4);
      }
    });
  }
};

TEST_F(RegisteredGraphTest, TasksGoBesideTheirLargestProducedInputElseToTheLeastLoaded) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  const ObjectId a_out = AddGelu(graph, "a", {x}, /*out_numel=*/100);  // least loaded: w1
  const ObjectId b_out = AddGelu(graph, "b", {x}, /*out_numel=*/10);   // least loaded: w2
  AddGelu(graph, "c", {b_out, a_out});                                 // beside a (the larger): w1
  AddGelu(graph, "d", {a_out}, 1, /*pinned=*/w2);                      // pinned: w2
  graph.MarkOutput(AddGelu(graph, "e", {b_out}));                      // beside b: w2
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  const std::vector<uint64_t> expected = {w1.value(), w2.value(), w1.value(), w2.value(),
                                          w2.value()};
  EXPECT_EQ(PartOn(w1), expected);
  EXPECT_EQ(PartOn(w2), expected);

  // An instance: its input bound to a Put, its output sealed where it was produced.
  Put(driver, 1, 1, /*inline_data=*/true);
  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 1}}, {50}));
  for (WorkerId worker : {w1, w2}) {
    auto runs = outbox_.Take(worker, Body::RUN_GRAPH);
    ASSERT_EQ(runs.size(), 1u);
    auto run = BodyOf(runs[0]).getRunGraph();
    EXPECT_EQ(run.getInstance(), 1u);
    ASSERT_EQ(run.getInlineInputs().size(), 1u);
    EXPECT_EQ(run.getInlineInputs()[0].getId(), x.value());
    EXPECT_EQ(run.getOutputIds()[0], 50u);
  }
  Watch(driver, 50);
  EXPECT_TRUE(outbox_.Take(driver, Body::OBJECTS_READY).empty());
  ASSERT_OK(InstanceDone(w1, 3, 1, {}));
  ASSERT_OK(InstanceDone(w2, 3, 1, {50}));
  EXPECT_EQ(ReadyError(driver), "");
  Release(driver, 50);
  Release(driver, 1);
  EXPECT_EQ(core_.num_objects(), 0u);
}

TEST_F(RegisteredGraphTest, TimelineWaitsForTheInstanceAndNamesItsSpans) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  AddGelu(graph, "a", {x}, 1, w1);
  graph.MarkOutput(AddGelu(graph, "b", {x}, 1, w2));
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1, /*inline_data=*/true);
  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 1}}, {50}));
  auto finish = [&](WorkerId worker, uint64_t task, const std::vector<uint64_t>& sealed) {
    return Deliver(worker, [&](proto::Envelope::Builder e) {
      auto done = e.initBody().initInstanceFinished();
      done.setGraphId(3);
      done.setInstance(1);
      auto outputs = done.initOutputs(static_cast<unsigned>(sealed.size()));
      for (unsigned i = 0; i < sealed.size(); ++i) {
        outputs[i].setId(sealed[i]);
        outputs[i].setBytes(4);
      }
      WorkerSpans spans;
      spans.tasks.push_back({task, 0, 100, 200, 0});
      rpc::ToWire(spans, done.initSpans());
    });
  };
  auto request = [&](WorkerId from, uint64_t graph_id) {
    return Deliver(from, [&](proto::Envelope::Builder e) {
      e.setRequestId(9);
      auto wire = e.initBody().initTimelineRequest();
      wire.setLastInstances(1);
      wire.setGraphId(graph_id);
    });
  };
  ASSERT_OK(finish(w1, 1, {}));
  ASSERT_OK(request(driver, 3));
  EXPECT_TRUE(outbox_.Take(driver, Body::TIMELINE_REPLY).empty()) << "w2 has not reported yet";
  ASSERT_OK(finish(w2, 2, {50}));
  auto replies = outbox_.Take(driver, Body::TIMELINE_REPLY);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0]->reader().getRoot<proto::Envelope>().getRequestId(), 9u);
  ASSERT_OK_AND_ASSIGN(Timeline timeline, rpc::FromWire(BodyOf(replies[0]).getTimelineReply()));
  ASSERT_EQ(timeline.spans.size(), 2u);
  EXPECT_EQ(timeline.spans[0].worker, w1);
  EXPECT_EQ(timeline.spans[0].name, "a");
  EXPECT_EQ(timeline.spans[0].kind, SpanKind::kForward);
  EXPECT_EQ(timeline.spans[1].worker, w2);
  EXPECT_EQ(timeline.spans[1].name, "b");
  ASSERT_EQ(timeline.processes.size(), 2u);
  EXPECT_EQ(timeline.processes[0].hostname, "host");
  EXPECT_EQ(timeline.processes[0].pid, static_cast<int>(100 + w1.value()));

  // Any graph: answered at once; workers may not ask.
  ASSERT_OK(request(driver, 0));
  EXPECT_EQ(outbox_.Take(driver, Body::TIMELINE_REPLY).size(), 1u);
  EXPECT_EQ(request(w1, 0).code(), StatusCode::kInvalidArgument);
}

TEST_F(RegisteredGraphTest, MembersOfACollectiveGetDistinctWorkersAndTheirGroup) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  const ObjectId p_out = AddGelu(graph, "p", {x}, 100);  // w1
  // Both members would go beside p; the second moves to the other worker.
  AddGelu(graph, "m0", {p_out}, 1, WorkerId(), Member(4, 0, 2));
  AddGelu(graph, "m1", {p_out}, 1, WorkerId(), Member(4, 1, 2));
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  auto parts = outbox_.Take(w2, Body::GRAPH_PART);
  ASSERT_EQ(parts.size(), 1u);
  auto part = BodyOf(parts[0]).getGraphPart();
  EXPECT_EQ(part.getTaskWorkers()[1], w1.value());
  EXPECT_EQ(part.getTaskWorkers()[2], w2.value());
  ASSERT_OK_AND_ASSIGN(rpc::WireTask m0, rpc::FromWire(part.getTasks()[1]));
  ASSERT_OK_AND_ASSIGN(rpc::WireTask m1, rpc::FromWire(part.getTasks()[2]));
  EXPECT_TRUE(m0.spec.attrs.Has(kGroupAttr));
  EXPECT_EQ(m0.spec.attrs.GetInt(kGroupAttr, -1), m1.spec.attrs.GetInt(kGroupAttr, -2));
  EXPECT_EQ(m0.spec.attrs.GetInt(kPositionAttr, -1), 0);
  EXPECT_EQ(m1.spec.attrs.GetInt(kPositionAttr, -1), 0);
}

TEST_F(RegisteredGraphTest, PlacementsThatCannotWorkAreRefusedWithTheReason) {
  const WorkerId w1 = Join(proto::Role::WORKER);
  Join(proto::Role::WORKER);
  const WorkerId driver = Join(proto::Role::DRIVER);
  {
    Graph graph;
    const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
    AddGelu(graph, "stray", {x}, 1, WorkerId(999));
    ASSERT_OK(Register(driver, 1, graph));
    const Status reply = TakeReply(driver);
    EXPECT_EQ(reply.code(), StatusCode::kInfeasible);
    EXPECT_NE(reply.message().find("task 'stray' is pinned to worker999, which is not an alive "
                                   "worker"),
              std::string::npos)
        << reply.ToString();
  }
  {
    Graph graph;
    const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
    for (int rank = 0; rank < 3; ++rank)
      AddGelu(graph, fmt::format("m{}", rank), {x}, 1, WorkerId(), Member(9, rank, 3));
    ASSERT_OK(Register(driver, 2, graph));
    const Status reply = TakeReply(driver);
    EXPECT_EQ(reply.code(), StatusCode::kInfeasible);
    EXPECT_NE(reply.message().find("collective 9 has 3 members but only 2 workers are alive"),
              std::string::npos)
        << reply.ToString();
  }
  {
    Graph graph;
    const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
    AddGelu(graph, "m0", {x}, 1, w1, Member(9, 0, 2));
    AddGelu(graph, "m1", {x}, 1, w1, Member(9, 1, 2));
    ASSERT_OK(Register(driver, 3, graph));
    const Status reply = TakeReply(driver);
    EXPECT_EQ(reply.code(), StatusCode::kInfeasible);
    EXPECT_NE(reply.message().find("task 'm1' is pinned to " + w1.ToString() +
                                   ", which already runs another member of collective 9"),
              std::string::npos)
        << reply.ToString();
  }
  {
    Graph empty;
    empty.AddObject("x", Floats(1), ObjectRole::kInput);
    ASSERT_OK(Register(driver, 4, empty));
    EXPECT_EQ(TakeReply(driver).message(), "graph 4 has no tasks");
  }
  {
    Graph graph;
    const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
    AddGelu(graph, "a", {x});
    ASSERT_OK(Register(driver, 5, graph));
    EXPECT_OK(TakeReply(driver));
    ASSERT_OK(Register(driver, 5, graph));
    EXPECT_EQ(TakeReply(driver).message(), "graph id 5 is invalid or in use");
    ASSERT_OK(Run(driver, 6, 1, {}, {}));
    const Status unknown = TakeReply(driver, 0);
    EXPECT_EQ(unknown.code(), StatusCode::kNotFound);
    EXPECT_EQ(unknown.message(), "graph 6 is not registered by this driver");
  }
}

TEST_F(RegisteredGraphTest, NoAliveWorkerMeansTheGraphIsRefused) {
  const WorkerId driver = Join(proto::Role::DRIVER);
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  AddGelu(graph, "a", {x});
  ASSERT_OK(Register(driver, 1, graph));
  const Status reply = TakeReply(driver);
  EXPECT_EQ(reply.code(), StatusCode::kUnavailable);
  EXPECT_EQ(reply.message(), "no worker is alive to run graph 1");
}

TEST_F(RegisteredGraphTest, MalformedGraphsAreProtocolErrorsNamingWhatIsWrong) {
  Join(proto::Role::WORKER);
  auto registered = [&](const std::function<void(proto::RegisterGraph::Builder)>& fill) {
    const WorkerId driver = Join(proto::Role::DRIVER);
    return Deliver(driver, [&](proto::Envelope::Builder e) {
      auto wire = e.initBody().initRegisterGraph();
      wire.setGraphId(1);
      fill(wire);
    });
  };
  auto object = [](proto::ObjectDecl::Builder decl, uint64_t id) {
    rpc::ToWire(ObjectSpec{ObjectId(id), fmt::format("o{}", id), Floats(1), ObjectRole::kActivation,
                           TaskId()},
                decl);
  };
  auto task = [](proto::Task::Builder out, uint64_t id, std::vector<ObjectId> inputs,
                 std::vector<ObjectId> outputs) {
    TaskSpec spec;
    spec.id = TaskId(id);
    spec.name = fmt::format("t{}", id);
    spec.op = "gelu_forward";
    spec.inputs = std::move(inputs);
    spec.outputs = std::move(outputs);
    std::vector<ObjectSpec> decls;
    for (ObjectId output : spec.outputs)
      decls.push_back(ObjectSpec{output, "o", Floats(1), ObjectRole::kActivation, spec.id});
    rpc::ToWire(spec, decls, out);
  };
  Status status =
      registered([&](proto::RegisterGraph::Builder wire) { object(wire.initObjects(1)[0], 2); });
  EXPECT_EQ(status.message(), "graph 1 object ids must be dense from 1");
  status = registered([&](proto::RegisterGraph::Builder wire) {
    object(wire.initObjects(1)[0], 1);
    task(wire.initTasks(1)[0], 2, {ObjectId(1)}, {});
  });
  EXPECT_EQ(status.message(), "graph 1 task ids must be dense from 1");
  status = registered([&](proto::RegisterGraph::Builder wire) {
    object(wire.initObjects(1)[0], 1);
    task(wire.initTasks(1)[0], 1, {ObjectId(5)}, {});
  });
  EXPECT_EQ(status.message(), "task 't1' reads an unknown object");
  status = registered([&](proto::RegisterGraph::Builder wire) {
    auto objects = wire.initObjects(2);
    object(objects[0], 1);
    object(objects[1], 2);
    auto tasks = wire.initTasks(2);
    task(tasks[0], 1, {ObjectId(1)}, {ObjectId(2)});
    task(tasks[1], 2, {ObjectId(1)}, {ObjectId(2)});
  });
  EXPECT_EQ(status.message(), "task 't2' produces an unknown object or one another task produces");
  status = registered([&](proto::RegisterGraph::Builder wire) {
    auto objects = wire.initObjects(2);
    object(objects[0], 1);
    object(objects[1], 2);
    task(wire.initTasks(1)[0], 1, {ObjectId(1)}, {ObjectId(2)});
    wire.initOutputs(1).set(0, 3);
  });
  EXPECT_EQ(status.message(), "graph 1 returns an unknown object");
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
}

TEST_F(RegisteredGraphTest, AWorkerDyingMidInstanceCancelsItsPeersAndFailsTheOutputs) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1 << 20), ObjectRole::kInput);
  graph.MarkOutput(AddGelu(graph, "a", {x}));
  AddGelu(graph, "b", {x});
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1 << 20, /*inline_data=*/false);
  ASSERT_OK(Run(driver, 3, 8, {{x.value(), 1}}, {60}));
  for (WorkerId worker : {w1, w2}) {
    auto runs = outbox_.Take(worker, Body::RUN_GRAPH);
    ASSERT_EQ(runs.size(), 1u);
    auto inputs = BodyOf(runs[0]).getRunGraph().getInputs();
    ASSERT_EQ(inputs.size(), 1u) << "a large input is pulled from its holder";
    EXPECT_EQ(inputs[0].getSource().getHolder(), driver.value());
  }
  Watch(driver, 60);
  core_.Disconnected(w2, Unavailable("connection reset"));
  core_.Flush();
  auto cancels = outbox_.Take(w1, Body::CANCEL_INSTANCE);
  ASSERT_EQ(cancels.size(), 1u);
  const std::string why =
      rpc::FromWire(BodyOf(cancels[0]).getCancelInstance().getError()).message();
  EXPECT_NE(why.find(w2.ToString() + " (pid"), std::string::npos) << why;
  EXPECT_NE(why.find("died while running its part of graph 3 (instance 8)"), std::string::npos)
      << why;
  const std::string failed = ReadyError(driver);
  EXPECT_NE(failed.find("died while running its part of graph 3"), std::string::npos) << failed;
  // w1's late report changes nothing.
  ASSERT_OK(InstanceDone(w1, 3, 8, {}));
}

TEST_F(RegisteredGraphTest, BadBindingsAndFailedPartsFailTheInstanceOutputs) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  graph.MarkOutput(AddGelu(graph, "a", {x}));
  AddGelu(graph, "b", {x});
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1, /*inline_data=*/true);
  Put(driver, 2, 8, /*inline_data=*/true);

  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 2}}, {70}));
  Watch(driver, 70);
  EXPECT_NE(ReadyError(driver).find("but was bound to"), std::string::npos);
  ASSERT_OK(Run(driver, 3, 2, {}, {71}));
  Watch(driver, 71);
  EXPECT_NE(ReadyError(driver).find("input 'x' of graph 3 is not bound"), std::string::npos);
  EXPECT_TRUE(outbox_.Take(w1, Body::RUN_GRAPH).empty());
  EXPECT_FALSE(Run(driver, 3, 3, {{x.value(), 1}}, {}).ok()) << "one output id per output";

  ASSERT_OK(Run(driver, 3, 4, {{x.value(), 1}}, {72}));
  EXPECT_FALSE(Run(driver, 3, 4, {{x.value(), 1}}, {73}).ok()) << "instance 4 is running";
  Watch(driver, 72);
  ASSERT_OK(InstanceDone(w2, 3, 4, {}, Internal("kernel crashed")));
  auto cancels = outbox_.Take(w1, Body::CANCEL_INSTANCE);
  ASSERT_EQ(cancels.size(), 1u);
  EXPECT_TRUE(outbox_.Take(w2, Body::CANCEL_INSTANCE).empty());
  const std::string failed = ReadyError(driver);
  EXPECT_NE(failed.find(w2.ToString() + " (pid"), std::string::npos) << failed;
  EXPECT_NE(failed.find("kernel crashed"), std::string::npos) << failed;
  ASSERT_OK(InstanceDone(w1, 3, 4, {}));
  for (uint64_t id : {70, 71, 72, 1, 2}) Release(driver, id);
  EXPECT_EQ(core_.num_objects(), 0u);
}

// A GPU worker's graph takes host values for its device inputs (a driver's batch): its executor
// copies them to the GPU. Shape and dtype must still match.
TEST_F(RegisteredGraphTest, AHostObjectBindsADeviceInputOfTheSameShapeAndDtype) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", FloatsOnGpu(1), ObjectRole::kInput);
  graph.MarkOutput(AddGelu(graph, "a", {x}));
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1, /*inline_data=*/true);  // f32[1] on the host
  Put(driver, 2, 2, /*inline_data=*/true);  // f32[2]
  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 1}}, {70}));
  EXPECT_EQ(outbox_.Take(w1, Body::RUN_GRAPH).size() + outbox_.Take(w2, Body::RUN_GRAPH).size(),
            1u);
  ASSERT_OK(Run(driver, 3, 2, {{x.value(), 2}}, {71}));
  Watch(driver, 71);
  EXPECT_NE(ReadyError(driver).find("but was bound to"), std::string::npos);
}

// A graph with GPU tasks runs on GPU workers only (its host-side tasks too); without any, its
// registration is refused saying so, instead of a CPU worker failing at the first binding.
TEST_F(RegisteredGraphTest, AGraphWithGpuTasksIsPlacedOnGpuWorkersOnly) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", FloatsOnGpu(1), ObjectRole::kInput);
  const ObjectId y = graph.AddObject("on_gpu.out", FloatsOnGpu(1), ObjectRole::kActivation);
  TaskSpec on_gpu_task;
  on_gpu_task.name = "on_gpu";
  on_gpu_task.op = "gelu_forward";
  on_gpu_task.inputs = {x};
  on_gpu_task.outputs = {y};
  on_gpu_task.device_kind = DeviceKind::kCuda;
  graph.AddTask(std::move(on_gpu_task));
  graph.MarkOutput(AddGelu(graph, "on_host", {y}));
  ASSERT_OK(Register(driver, 3, graph));
  const Status refused = TakeReply(driver);
  EXPECT_EQ(refused.code(), StatusCode::kInfeasible) << refused.ToString();
  EXPECT_NE(refused.message().find("runs task 'on_gpu' on a GPU, and no GPU worker is alive"),
            std::string::npos)
      << refused.ToString();
  const WorkerId gpu_worker = Join(proto::Role::WORKER, "secret", 1 << 30, "NVIDIA H200 (cuda:0)");
  ASSERT_OK(Register(driver, 4, graph));
  EXPECT_OK(TakeReply(driver));
  EXPECT_EQ(outbox_.Take(gpu_worker, Body::GRAPH_PART).size(), 1u);
  EXPECT_TRUE(outbox_.Take(w1, Body::GRAPH_PART).empty());
  EXPECT_TRUE(outbox_.Take(w2, Body::GRAPH_PART).empty());
}

// A failed instance aborts the groups of its collectives on every member, the one that reported
// the failure too: each drops that formation, so the group's next collective (a replay's) forms
// it afresh on all of them (worker/collective_engine.h).
TEST_F(RegisteredGraphTest, AFailedInstanceAbortsItsCollectiveGroupsOnEveryMember) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  graph.MarkOutput(AddGelu(graph, "m0", {x}, 1, w1, Member(5, 0, 2)));
  graph.MarkOutput(AddGelu(graph, "m1", {x}, 1, w2, Member(5, 1, 2)));
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1, /*inline_data=*/true);
  ASSERT_OK(Run(driver, 3, 4, {{x.value(), 1}}, {72, 73}));
  for (WorkerId worker : {w1, w2})
    EXPECT_TRUE(outbox_.Take(worker, Body::COLLECTIVE_ABORT).empty());
  ASSERT_OK(InstanceDone(w2, 3, 4, {}, Internal("kernel crashed")));
  for (WorkerId worker : {w1, w2}) {
    auto aborts = outbox_.Take(worker, Body::COLLECTIVE_ABORT);
    ASSERT_EQ(aborts.size(), 1u) << worker.ToString();
    const std::string why =
        rpc::FromWire(BodyOf(aborts[0]).getCollectiveAbort().getError()).message();
    EXPECT_NE(why.find("kernel crashed"), std::string::npos) << why;
  }
}

// Every collective a worker runs has one position in its single order: the instances' bases
// count each worker's members over every instance started there, a driver's graph's steps and
// submitted collectives alike, so every worker meets them in the order they started.
TEST_F(RegisteredGraphTest, CollectiveBasesCountEachWorkersMembersAcrossInstances) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;  // two collectives over w1 and w2: each worker runs two members per step
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  const ObjectId a0 = AddGelu(graph, "a0", {x}, 1, w1, Member(1, 0, 2));
  const ObjectId a1 = AddGelu(graph, "a1", {x}, 1, w2, Member(1, 1, 2));
  graph.MarkOutput(AddGelu(graph, "b0", {a0}, 1, w1, Member(2, 0, 2)));
  graph.MarkOutput(AddGelu(graph, "b1", {a1}, 1, w2, Member(2, 1, 2)));
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1, /*inline_data=*/true);
  // The base each worker got in the one RunGraph sent to it (and that message's instance).
  auto bases = [&](WorkerId worker) {
    std::map<uint64_t, int64_t> out;
    for (auto& message : outbox_.Take(worker, Body::RUN_GRAPH)) {
      for (auto base : BodyOf(message).getRunGraph().getCollectiveBases()) {
        if (base.getWorker() == worker.value()) out[base.getWorker()] = base.getBase();
      }
    }
    return out;
  };
  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 1}}, {50, 52}));
  EXPECT_EQ(bases(w1), (std::map<uint64_t, int64_t>{{w1.value(), 0}}));
  EXPECT_EQ(bases(w2), (std::map<uint64_t, int64_t>{{w2.value(), 0}}));
  ASSERT_OK(InstanceDone(w1, 3, 1, {50}));
  ASSERT_OK(InstanceDone(w2, 3, 1, {52}));
  ASSERT_OK(Run(driver, 3, 2, {{x.value(), 1}}, {51, 53}));  // next step: after 2 members each
  EXPECT_EQ(bases(w1), (std::map<uint64_t, int64_t>{{w1.value(), 2}}));
  EXPECT_EQ(bases(w2), (std::map<uint64_t, int64_t>{{w2.value(), 2}}));
  // A submitted collective over the same workers comes after both steps' members.
  for (int64_t rank = 0; rank < 2; ++rank) {
    ASSERT_OK(Deliver(driver, [&](proto::Envelope::Builder e) {
      TaskSpec spec;
      spec.id = TaskId(20 + static_cast<uint64_t>(rank));
      spec.name = fmt::format("r{}", rank);
      spec.op = "all_reduce";
      spec.inputs = {ObjectId(1)};
      spec.outputs = {ObjectId(120 + static_cast<uint64_t>(rank))};
      spec.attrs = Member(8, rank, 2);
      rpc::ToWire(spec,
                  {ObjectSpec{spec.outputs[0], fmt::format("r{}.out", rank), Floats(1),
                              ObjectRole::kActivation, spec.id}},
                  e.initBody().initSubmitTasks().initTasks(1)[0]);
    }));
  }
  EXPECT_EQ(bases(w1), (std::map<uint64_t, int64_t>{{w1.value(), 4}}));
  EXPECT_EQ(bases(w2), (std::map<uint64_t, int64_t>{{w2.value(), 4}}));
}

// A worker that reports one output twice (after its driver let go of it, so the first seal frees
// it) commits a protocol error: its connection closes; the scheduler does not abort.
TEST_F(RegisteredGraphTest, AnOutputSealedTwiceInOneReportIsAProtocolError) {
  const auto [w1, w2, driver] = JoinTwoWorkersAndADriver();
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  graph.MarkOutput(AddGelu(graph, "a", {x}));
  ASSERT_OK(Register(driver, 3, graph));
  EXPECT_OK(TakeReply(driver));
  Put(driver, 1, 1, /*inline_data=*/true);
  ASSERT_OK(Run(driver, 3, 1, {{x.value(), 1}}, {70}));
  Release(driver, 70);
  int refused = 0;
  for (WorkerId worker : {w1, w2}) {
    const Status status = InstanceDone(worker, 3, 1, {70, 70});
    if (status.ok()) continue;  // not involved in the instance: ignored
    ++refused;
    EXPECT_NE(status.message().find("sealed obj70 twice"), std::string::npos) << status.ToString();
  }
  EXPECT_EQ(refused, 1);
}

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

// ---- the dashboard's figures: job progress and the timeline ----

TEST_F(SchedulerCoreTest, DriverProgressIsKeptForTheDashboardAndAWorkersIsRefused) {
  const Cluster c = JoinTwoWorkersAndADriver();
  for (int64_t step = 1; step <= 3; ++step) {
    EXPECT_OK(Deliver(c.driver, [&](proto::Envelope::Builder e) {
      auto progress = e.initBody().initJobProgress();
      progress.setJob("train_gpt2");
      progress.setStep(step);
      progress.setLoss(5.0 - static_cast<double>(step));
      progress.setStepMs(20);
      progress.setTokensPerSecond(1000);
      progress.setSamplesPerSecond(std::numeric_limits<double>::quiet_NaN());
    }));
  }
  Status refused = Deliver(c.w1, [](proto::Envelope::Builder e) {
    e.initBody().initJobProgress().setJob("not a driver");
  });
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();

  CoreDashboardSource source(&core_, now_, [this] { return now_; });
  const std::vector<dashboard::JobView> jobs = source.Jobs();
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].name, "train_gpt2");
  EXPECT_EQ(jobs[0].driver, c.driver.value());
  EXPECT_TRUE(jobs[0].connected);
  ASSERT_EQ(jobs[0].points.size(), 3u);
  EXPECT_EQ(jobs[0].points[2].step, 3);
  EXPECT_DOUBLE_EQ(jobs[0].points[2].loss, 2.0);
  EXPECT_TRUE(std::isnan(jobs[0].points[2].samples_per_second));

  const dashboard::ClusterView cluster = source.Cluster();
  EXPECT_EQ(cluster.workers.size(), 2u);
  EXPECT_EQ(cluster.drivers, 1);
  EXPECT_EQ(cluster.session_dir, "/tmp/s");

  core_.Disconnected(c.driver, Cancelled("done"));
  EXPECT_FALSE(source.Jobs()[0].connected);  // the history stays, marked finished
}

TEST(JobMetricsTest, HistoryIsBoundedAndCountsWhatItDropped) {
  JobMetrics metrics;
  capnp::MallocMessageBuilder message;
  auto progress = message.initRoot<proto::JobProgress>();
  progress.setJob("job");
  const auto now = std::chrono::steady_clock::now();
  for (size_t step = 1; step <= JobMetrics::kMaxPoints + 5; ++step) {
    progress.setStep(static_cast<int64_t>(step));
    metrics.Record(WorkerId(7), progress.asReader(), now);
  }
  ASSERT_EQ(metrics.jobs().size(), 1u);
  EXPECT_EQ(metrics.jobs()[0].steps.size(), JobMetrics::kMaxPoints);
  EXPECT_EQ(metrics.jobs()[0].dropped, 5);
  EXPECT_EQ(metrics.jobs()[0].steps.front().step, 6);
  for (size_t job = 0; job < JobMetrics::kMaxJobs + 2; ++job) {
    metrics.Record(WorkerId(100 + job), progress.asReader(), now);
  }
  EXPECT_EQ(metrics.jobs().size(), JobMetrics::kMaxJobs);
}

}  // namespace
}  // namespace tessera::testing

// The scheduler's tests' fixture: the scheduler's state machine driven without sockets, a fake
// outbox recording what it sends and a fake clock driving heartbeats. Shared by
// scheduler_core_test.cc (tasks, failures, heartbeats, the dashboard's figures),
// scheduler_graph_test.cc (registered graphs) and scheduler_collective_test.cc (collectives).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/graph.h"
#include "core/rpc/frame.h"
#include "core/rpc/wire.h"
#include "scheduler/scheduler_core.h"
#include "test_util.h"

namespace tessera::testing {

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

inline Body::Reader BodyOf(const std::unique_ptr<rpc::ReceivedMessage>& message) {
  return message->reader().getRoot<proto::Envelope>().getBody();
}

class SchedulerCoreTest : public ::testing::Test {
 protected:
  explicit SchedulerCoreTest(rpc::WireLimits limits = {})
      : core_(SchedulerOptions{.token = "secret",
                               .heartbeat_timeout_ms = 3000,
                               .session_dir = "/tmp/s",
                               .limits = limits},
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
      EXPECT_OK(std::move(hello));  // moved: the macro takes its own copy
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

}  // namespace tessera::testing

// A worker's graph runner (worker/graph_runner.h) driven directly, without a scheduler process:
// graph parts and instances built as the scheduler builds them (scheduler/messages.h), a real
// object store, the InstanceFinished reports captured. Every part is a single-worker one (every
// task on this worker), so no data plane is needed.
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "core/rpc/wire.h"
#include "ops/graph_builder.h"
#include "probe_op.h"
#include "scheduler/messages.h"
#include "scheduler/outbox.h"
#include "test_util.h"
#include "worker/graph_runner.h"

namespace tessera::testing {
namespace {

TensorMeta F32(Shape shape) { return {std::move(shape), DType::kF32, Device::Cpu()}; }

const WorkerId kSelf(1);
constexpr std::string_view kSelfAddress = "self";

// The scheduler's outgoing message, kept (SendGraphPart and SendRunGraph write through it).
class KeepingOutbox final : public Outbox {
 public:
  void Send(WorkerId, capnp::MessageBuilder& message) override {
    kept_ = std::make_unique<capnp::MallocMessageBuilder>();
    kept_->setRoot(message.getRoot<proto::Envelope>().asReader());
  }
  void Disconnect(WorkerId, const Status&) override {}
  proto::Envelope::Body::Reader body() { return kept_->getRoot<proto::Envelope>().getBody(); }

 private:
  std::unique_ptr<capnp::MallocMessageBuilder> kept_;
};

// What one InstanceFinished said.
struct Finished {
  Status error;
  struct Output {
    ObjectId id;
    int64_t bytes = 0;
    std::string inline_bytes;
  };
  std::vector<Output> outputs;
};

class GraphRunnerTest : public ::testing::Test {
 protected:
  using Key = std::pair<uint64_t, uint64_t>;

  GraphRunnerTest()
      : registry_(*RegistryWithProbe(&probe_)), store_(ObjectStoreOptions{}, TestAllocator()) {}
  // A failed assertion may leave a gated kernel waiting: the runner waits for its runs.
  ~GraphRunnerTest() override { probe_.OpenGate(); }

  // The runner, on `threads` threads. REQUIRES: called once, before anything else.
  GraphRunner& Runner(int threads) {
    ExecutorOptions options;
    options.threads = threads;
    runner_ =
        std::make_unique<GraphRunner>(registry_, options, store_, settings_,
                                      [this](capnp::MessageBuilder& message) { Capture(message); });
    return *runner_;
  }

  // Registers `graph` as graph `id` with every task on this worker.
  void AddPart(uint64_t id, const Graph& graph) {
    const std::vector<WorkerId> workers(static_cast<size_t>(graph.num_tasks()), kSelf);
    const std::vector<ObjectId>& outputs = graph.OutputObjects();
    GraphPart part{id, graph.objects(), graph.tasks(), workers, {{kSelf, kSelfAddress}}, outputs};
    KeepingOutbox outbox;
    SendGraphPart(outbox, std::vector<WorkerId>{kSelf}, part);
    runner_->AddPart(kSelf.value(), outbox.body().getGraphPart());
  }

  // Starts instance `instance` of graph `id`: inputs inline (by graph-local id) or bound to store
  // objects; graph outputs sealed under `output_ids`.
  void Start(uint64_t id, uint64_t instance, const std::vector<ObjectId>& output_ids,
             const std::map<ObjectId, Tensor>& inline_inputs,
             const std::map<ObjectId, ObjectId>& stored_inputs = {},
             const std::vector<std::string>& task_names = {}) {
    std::vector<std::string> bytes;  // alive while the message is built
    bytes.reserve(inline_inputs.size());
    GraphRun run{id, instance, output_ids, {}, {}};
    run.task_names = task_names;
    for (const auto& [local, tensor] : inline_inputs) {
      bytes.emplace_back(static_cast<const char*>(tensor.raw_data()),
                         static_cast<size_t>(tensor.bytes()));
    }
    size_t i = 0;
    for (const auto& [local, tensor] : inline_inputs) {
      run.inline_inputs.push_back(InlineObject{local.value(), bytes[i++]});
    }
    for (const auto& [local, cluster] : stored_inputs) {
      run.inputs.emplace_back(local.value(), ObjectSource{cluster, 0, kSelf, kSelfAddress});
    }
    KeepingOutbox outbox;
    SendRunGraph(outbox, std::vector<WorkerId>{kSelf}, run);
    runner_->Start(outbox.body().getRunGraph());
  }

  // The report of an instance (waits for it up to 30 s; an error if none came).
  Finished WaitFinished(uint64_t id, uint64_t instance) {
    std::unique_lock lock(mutex_);
    if (!reported_.wait_for(lock, std::chrono::seconds(30), [&] {
          return finished_.contains({id, instance});
        })) {
      return Finished{Internal("graph {} instance {} never finished", id, instance), {}};
    }
    return finished_.at({id, instance});
  }

  Tensor Stored(ObjectId id) {
    Result<PinnedObject> pinned = store_.Get(id);
    return pinned.ok() ? pinned->tensor() : Tensor();
  }

  // A graph of probe tasks reading x ([4] floats): per task its tag, priority and whether it
  // waits for the gate; each task's output is a graph output. `then`: a probe after the first.
  Graph Probes(const std::vector<std::tuple<int64_t, int32_t, bool>>& tasks, bool then = false) {
    GraphBuilder builder(registry_);
    const ObjectId x = builder.AddInput("x", F32({4}), ObjectRole::kInput);
    ObjectId first;
    for (const auto& [tag, priority, gated] : tasks) {
      Attrs attrs{{"tag", tag}};
      if (gated) attrs.Set("gate", int64_t{1});
      TaskOptions options;
      options.priority = priority;
      const ObjectId out =
          (*builder.AddTask(fmt::format("probe.{}", tag), "probe", {x}, attrs, options))[0];
      if (!first.valid()) first = out;
      builder.MarkOutput(out);
    }
    if (then) {
      builder.MarkOutput((*builder.AddTask("then", "probe", {first}, {{"tag", int64_t{99}}}))[0]);
    }
    return *builder.Build();
  }
  static std::map<ObjectId, Tensor> X(const Graph& graph) {
    return {{graph.InputObjects()[0], RandomTensor({4}, 1)}};
  }
  static std::vector<ObjectId> OutputIds(const Graph& graph, uint64_t base) {
    std::vector<ObjectId> ids;
    for (size_t i = 0; i < graph.OutputObjects().size(); ++i) ids.push_back(ObjectId(base + i));
    return ids;
  }

  Probe probe_;
  OpRegistry registry_;
  Settings settings_;
  ObjectStore store_;
  std::unique_ptr<GraphRunner> runner_;

 private:
  void Capture(capnp::MessageBuilder& message) {
    auto body = message.getRoot<proto::Envelope>().asReader().getBody();
    if (!body.isInstanceFinished()) return;
    auto wire = body.getInstanceFinished();
    Finished finished;
    if (wire.hasError()) finished.error = rpc::FromWire(wire.getError());
    for (proto::SealedObject::Reader output : wire.getOutputs()) {
      const auto data = output.getInline();
      finished.outputs.push_back(
          {ObjectId(output.getId()), output.getBytes(), std::string(data.begin(), data.end())});
    }
    {
      std::lock_guard lock(mutex_);
      finished_[{wire.getGraphId(), wire.getInstance()}] = std::move(finished);
    }
    reported_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable reported_;
  std::map<Key, Finished> finished_;
};

TEST_F(GraphRunnerTest, OutputsAreSealedWithTheirBytesAndReported) {
  Runner(2);
  // z = gelu(x + w): x inline, w from the store.
  GraphBuilder builder(registry_);
  const ObjectId x = builder.AddInput("x", F32({64}), ObjectRole::kInput);
  const ObjectId w = builder.AddInput("w", F32({64}), ObjectRole::kParameter);
  const ObjectId y = (*builder.AddTask("add", "add_forward", {x, w}, {}))[0];
  const ObjectId z = (*builder.AddTask("gelu", "gelu_forward", {y}, {}))[0];
  builder.MarkOutput(z);
  ASSERT_OK_AND_ASSIGN(Graph graph, builder.Build());
  AddPart(1, graph);
  const Tensor xv = RandomTensor({64}, 1), wv = RandomTensor({64}, 2);
  ASSERT_OK(store_.Put(ObjectId(500), wv));
  Start(1, 1, {ObjectId(1000)}, {{x, xv}}, {{w, ObjectId(500)}});

  Finished finished = WaitFinished(1, 1);
  ASSERT_OK(finished.error);
  const Tensor expected =
      (*RunKernel("gelu_forward", {(*RunKernel("add_forward", {xv, wv}))[0]}))[0];
  ASSERT_EQ(finished.outputs.size(), 1u);
  EXPECT_EQ(finished.outputs[0].id, ObjectId(1000));
  EXPECT_EQ(finished.outputs[0].bytes, 64 * 4);
  // Small: its bytes travel in the report too.
  ASSERT_EQ(finished.outputs[0].inline_bytes.size(), 64u * 4);
  EXPECT_EQ(
      std::memcmp(finished.outputs[0].inline_bytes.data(), expected.raw_data(), size_t{64} * 4), 0);
  const Tensor sealed = Stored(ObjectId(1000));
  ASSERT_TRUE(sealed.defined());
  EXPECT_EQ(ToVector(sealed), ToVector(expected));
  EXPECT_TRUE(runner_->Activity().empty());
}

TEST_F(GraphRunnerTest, TwoInstancesRunAtOnceAndBothFinish) {
  Runner(2);
  const Graph graph = Probes({{1, 0, true}});
  AddPart(1, graph);
  Start(1, 1, OutputIds(graph, 1000), X(graph));
  Start(1, 2, OutputIds(graph, 2000), X(graph));
  // Both kernels wait for the gate at once: the second instance did not wait for the first.
  ASSERT_TRUE(Eventually([&] { return probe_.started().size() == 2; }));
  std::vector<GraphRunActivity> activity = runner_->Activity();
  ASSERT_EQ(activity.size(), 2u);
  EXPECT_EQ(activity[0].instance, 1u);
  EXPECT_EQ(activity[1].instance, 2u);
  EXPECT_EQ(activity[0].running, std::vector<std::string>{"probe.1"});
  probe_.OpenGate();
  ASSERT_OK(WaitFinished(1, 1).error);
  ASSERT_OK(WaitFinished(1, 2).error);
  EXPECT_TRUE(Stored(ObjectId(1000)).defined());
  EXPECT_TRUE(Stored(ObjectId(2000)).defined());
}

TEST_F(GraphRunnerTest, ACancelFailsItsInstanceWithTheReasonWhileAnotherCompletes) {
  Runner(2);
  // probe.1 waits for the gate; "then" reads its output.
  const Graph graph = Probes({{1, 0, true}}, /*then=*/true);
  AddPart(1, graph);
  Start(1, 1, OutputIds(graph, 1000), X(graph));
  Start(1, 2, OutputIds(graph, 2000), X(graph));
  ASSERT_TRUE(Eventually([&] { return probe_.started().size() == 2; }));
  runner_->Cancel(1, 1, Unavailable("the driver of graph 1 went away"));
  // Cancelled before it arrives: it fails as it starts.
  runner_->Cancel(1, 3, Cancelled("not wanted"));
  Start(1, 3, OutputIds(graph, 3000), X(graph));
  probe_.OpenGate();
  const Finished cancelled = WaitFinished(1, 1);
  ASSERT_FALSE(cancelled.error.ok());
  EXPECT_NE(cancelled.error.message().find("the driver of graph 1 went away"), std::string::npos)
      << cancelled.error.ToString();
  EXPECT_NE(cancelled.error.message().find("graph 1 instance 1"), std::string::npos);
  ASSERT_OK(WaitFinished(1, 2).error);
  EXPECT_EQ(WaitFinished(1, 3).error.code(), StatusCode::kCancelled);
  EXPECT_FALSE(Stored(ObjectId(1001)).defined());  // instance 1's "then" never ran
  EXPECT_TRUE(Stored(ObjectId(2001)).defined());
  // Instance 1's "then" did not start; instance 2's did (once).
  std::vector<int64_t> started = probe_.started();
  EXPECT_EQ(std::count(started.begin(), started.end(), 99), 1);
}

TEST_F(GraphRunnerTest, AFailingKernelsErrorNamesTheTask) {
  Runner(2);
  GraphBuilder builder(registry_);
  const ObjectId x = builder.AddInput("x", F32({4}), ObjectRole::kInput);
  TaskOptions options;
  options.layer = "head";
  builder.MarkOutput((*builder.AddTask("head/forward", "probe", {x},
                                       {{"tag", int64_t{1}}, {"fail", int64_t{1}}}, options))[0]);
  ASSERT_OK_AND_ASSIGN(Graph graph, builder.Build());
  AddPart(7, graph);
  Start(7, 1, OutputIds(graph, 1000), X(graph));
  const Finished finished = WaitFinished(7, 1);
  ASSERT_FALSE(finished.error.ok());
  EXPECT_EQ(finished.error.code(), StatusCode::kInvalidArgument);
  const std::string message = finished.error.message();
  EXPECT_NE(message.find("task 'head/forward' (layer head, op probe)"), std::string::npos)
      << message;
  EXPECT_NE(message.find("probe failed on purpose"), std::string::npos) << message;
  EXPECT_NE(message.find("graph 7 instance 1"), std::string::npos) << message;
  EXPECT_TRUE(finished.outputs.empty());
}

// A submitted task runs as an instance of a one-task graph the scheduler shares between every
// task of its kind: each instance names its task (RunGraph's taskNames), and errors and waits say
// that name, not the shared graph's. A graph the scheduler forgets can no longer run here.
TEST_F(GraphRunnerTest, AnInstanceOfASharedGraphGoesByItsOwnTaskName) {
  Runner(2);
  GraphBuilder builder(registry_);
  const ObjectId x = builder.AddInput("in0", F32({4}), ObjectRole::kInput);
  builder.MarkOutput(
      (*builder.AddTask("probe", "probe", {x}, {{"tag", int64_t{1}}, {"gate", int64_t{1}}}))[0]);
  ASSERT_OK_AND_ASSIGN(Graph shared, builder.Build());
  const uint64_t id = kFirstSchedulerGraphId + 5;
  AddPart(id, shared);
  Start(id, 41, OutputIds(shared, 1000), X(shared), {}, {"warmup#41"});
  ASSERT_TRUE(probe_.WaitStarted(1));
  std::vector<GraphRunActivity> activity = runner_->Activity();
  ASSERT_EQ(activity.size(), 1u);
  EXPECT_EQ(activity[0].running, std::vector<std::string>{"warmup#41"});
  probe_.OpenGate();
  ASSERT_OK(WaitFinished(id, 41).error);

  GraphBuilder failing(registry_);
  const ObjectId y = failing.AddInput("in0", F32({4}), ObjectRole::kInput);
  failing.MarkOutput(
      (*failing.AddTask("probe", "probe", {y}, {{"tag", int64_t{2}}, {"fail", int64_t{1}}}))[0]);
  ASSERT_OK_AND_ASSIGN(Graph bad, failing.Build());
  AddPart(id + 1, bad);
  Start(id + 1, 42, OutputIds(bad, 2000), X(bad), {}, {"mine#42"});
  const Finished finished = WaitFinished(id + 1, 42);
  ASSERT_FALSE(finished.error.ok());
  EXPECT_NE(finished.error.message().find("task 'mine#42' (op probe)"), std::string::npos)
      << finished.error.ToString();
  EXPECT_EQ(finished.error.message().find("graph "), std::string::npos)
      << "a submitted task's error names the task, not the scheduler's graph: "
      << finished.error.ToString();

  runner_->RemovePart(id);
  Start(id, 43, OutputIds(shared, 3000), X(shared), {}, {"late#43"});
  EXPECT_EQ(WaitFinished(id, 43).error.code(), StatusCode::kNotFound);
  EXPECT_EQ(runner_->stats().done, 3);
  EXPECT_EQ(runner_->stats().tasks_done,
            1);  // the one task of instance 41; 42 failed, 43 never ran
}

TEST_F(GraphRunnerTest, AHighPriorityTaskOfALaterInstanceGoesBeforeQueuedWork) {
  Runner(1);
  // Instance 1 of graph 1: probe 1 holds the only slot until the gate opens; 2, 3 and 4 wait
  // in the queue. Then graph 2's probe 10, of a higher priority, arrives.
  const Graph low = Probes({{1, 0, true}, {2, 0, false}, {3, 0, false}, {4, 0, false}});
  const Graph high = Probes({{10, 5, false}});
  AddPart(1, low);
  AddPart(2, high);
  Start(1, 1, OutputIds(low, 1000), X(low));
  ASSERT_TRUE(probe_.WaitStarted(1));
  Start(2, 1, OutputIds(high, 2000), X(high));
  probe_.OpenGate();
  ASSERT_OK(WaitFinished(1, 1).error);
  ASSERT_OK(WaitFinished(2, 1).error);
  EXPECT_EQ(probe_.started(), (std::vector<int64_t>{1, 10, 2, 3, 4}));
}

}  // namespace
}  // namespace tessera::testing

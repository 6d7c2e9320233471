// The in-process executor: dependencies, frees after last use, donation, errors, late inputs,
// offloaded tasks, device inputs. Runs in flight together: executor_runs_test.cc.
#include <future>
#include <mutex>
#include <thread>

#include "fake_device.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/graph_builder.h"
#include "ops/standard_ops.h"
#include "test_util.h"
#include "unit/executor_test_graphs.h"
#include "worker/in_process_executor.h"
#include "worker/role_meter.h"

namespace tessera::testing {
namespace {

TEST(ExecutorTest, RunsAChainAndMatchesTheKernelsRunDirectly) {
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  Chain chain = GeluChain(3, 1000);
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(chain.graph));
  Tensor x = RandomTensor({1000}, 1, 2.0f);
  Tensor expected = x;
  for (int i = 0; i < 3; ++i) expected = (*RunKernel("gelu_forward", {expected}))[0];
  ASSERT_OK_AND_ASSIGN(RunResult result, executor.Run(prepared, {{chain.input, x}}));
  EXPECT_EQ(result.stats.tasks_run, 3);
  EXPECT_EQ(ToVector(result.outputs.at(chain.output)), ToVector(expected));
}

// One task's change: an in-place update whose output took its input's buffer never counts both;
// freed inputs go after the outputs appeared; model state and transient state peak as sums.
TEST(RoleMeterTest, ADonatedOutputReplacesItsInputAndPeaksAreSums) {
  RoleMeter meter;
  meter.Add(ObjectRole::kParameter, 100);
  meter.Add(ObjectRole::kActivation, 40);
  RoleMeter::Change update;  // parameter updated in place; the activation read and freed
  update.Add(ObjectRole::kParameter, 100);
  update.Replace(ObjectRole::kParameter, 100);
  update.Free(ObjectRole::kParameter, 100);
  update.Free(ObjectRole::kActivation, 40);
  update.Add(ObjectRole::kGradient, 60);
  meter.Apply(update);
  const RoleBytes bytes = meter.bytes();
  EXPECT_EQ(bytes[ObjectRole::kParameter], 100);  // never 200
  EXPECT_EQ(bytes[ObjectRole::kActivation], 40);
  EXPECT_EQ(bytes[ObjectRole::kGradient], 60);
  EXPECT_EQ(bytes.model_state_peak, 160);  // parameter and gradient live together
  RoleMeter::Change gathers;
  gathers.Add(ObjectRole::kGatheredParameter, 30);
  gathers.Add(ObjectRole::kGradientBucket, 20);
  gathers.Free(ObjectRole::kGatheredParameter, 30);  // used and dropped by the same task
  meter.Apply(gathers);
  EXPECT_EQ(meter.bytes().transient_peak, 50);
  EXPECT_EQ(meter.bytes()[ObjectRole::kGatheredParameter], 30);
}

TEST(ExecutorTest, FreesEachObjectAfterItsLastUse) {
  const int64_t n = 1 << 16, bytes = n * 4;
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  Chain chain = GeluChain(6, n);
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(chain.graph));
  ASSERT_OK_AND_ASSIGN(Tensor x, Tensor::Empty(F32({n}), executor.allocator()));
  std::fill(x.data<float>(), x.data<float>() + n, 0.5f);
  ObjectMap inputs{{chain.input, std::move(x)}};
  ASSERT_OK_AND_ASSIGN(RunResult result, executor.Run(prepared, std::move(inputs)));
  // Seven objects of `bytes` each exist over the run, but never more than two at once (a task's
  // input and output): everything but the output is freed after its consumer.
  EXPECT_EQ(result.stats.peak_bytes, 2 * bytes);
  EXPECT_EQ(result.stats.live_bytes_after, bytes);
}

Graph CrossEntropyGraph(ObjectId* logits, ObjectId* loss, ObjectId* dlogits) {
  GraphBuilder builder(CpuRegistry());
  *logits = builder.AddInput("logits", F32({8, 50}), ObjectRole::kActivation);
  ObjectId targets =
      builder.AddInput("targets", {Shape{8}, DType::kI32, Device::Cpu()}, ObjectRole::kInput);
  auto out = *builder.AddTask("xent", "softmax_cross_entropy", {*logits, targets}, {});
  *loss = out[0];
  *dlogits = out[1];
  builder.MarkOutput(out[0]);
  builder.MarkOutput(out[1]);
  return *builder.Build();
}

TEST(ExecutorTest, DonationReusesTheBufferOnlyWhenNobodyElseHoldsIt) {
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  ObjectId logits_id, loss_id, dlogits_id;
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared,
                       executor.Prepare(CrossEntropyGraph(&logits_id, &loss_id, &dlogits_id)));
  const ObjectId targets_id = prepared.graph().InputObjects()[1];
  Tensor targets = RandomTokens({8}, 50, 2);

  // Moved in: the gradient is computed in the logits' own buffer.
  Tensor logits = RandomTensor({8, 50}, 1);
  void* buffer = logits.raw_data();
  ObjectMap moved{{logits_id, std::move(logits)}, {targets_id, targets}};
  ASSERT_OK_AND_ASSIGN(RunResult in_place, executor.Run(prepared, std::move(moved)));
  EXPECT_EQ(in_place.stats.donations_taken, 1);
  EXPECT_EQ(in_place.outputs.at(dlogits_id).raw_data(), buffer);

  // Still held by the caller: the executor copies, and the caller's logits stay intact.
  Tensor kept = RandomTensor({8, 50}, 1);
  const std::vector<float> before = ToVector(kept);
  ASSERT_OK_AND_ASSIGN(RunResult copied,
                       executor.Run(prepared, {{logits_id, kept}, {targets_id, targets}}));
  EXPECT_EQ(copied.stats.donations_copied, 1);
  EXPECT_EQ(ToVector(kept), before);
  EXPECT_EQ(ToVector(copied.outputs.at(dlogits_id)), ToVector(in_place.outputs.at(dlogits_id)));
}

TEST(ExecutorTest, AKernelErrorNamesTheTaskAndHandsBackIntactInputs) {
  GraphBuilder builder(CpuRegistry());
  ObjectId tokens =
      builder.AddInput("tokens", {Shape{1, 3}, DType::kI32, Device::Cpu()}, ObjectRole::kInput);
  ObjectId wte = builder.AddInput("wte", F32({5, 4}), ObjectRole::kParameter);
  ObjectId wpe = builder.AddInput("wpe", F32({3, 4}), ObjectRole::kParameter);
  TaskOptions options;
  options.layer = "embedding";
  auto out =
      *builder.AddTask("embedding/forward", "embedding_forward", {tokens, wte, wpe}, {}, options);
  builder.MarkOutput(out[0]);
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(*builder.Build()));
  ObjectMap intact;
  Result<RunResult> result = executor.Run(prepared,
                                          {{tokens, IntTensor({1, 3}, {0, 9, 1})},
                                           {wte, RandomTensor({5, 4}, 1)},
                                           {wpe, RandomTensor({3, 4}, 2)}},
                                          &intact);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  const std::string message = result.status().message();
  EXPECT_NE(message.find("task 'embedding/forward'"), std::string::npos) << message;
  EXPECT_NE(message.find("layer embedding"), std::string::npos) << message;
  EXPECT_NE(message.find("token id 9"), std::string::npos) << message;
  EXPECT_TRUE(intact.contains(wte));
  EXPECT_TRUE(intact.contains(wpe));
}

TEST(ExecutorTest, InputsThatFinishedTasksOnlyReadComeBackIntact) {
  // gelu reads x; the embedding, which runs after it (a control edge), fails on a bad token; a
  // second gelu of x, after the embedding, never runs. x was read, not updated: it comes back
  // (it is still bound: its second reader has not run).
  GraphBuilder builder(CpuRegistry());
  ObjectId x = builder.AddInput("x", F32({8}), ObjectRole::kParameter);
  ObjectId tokens =
      builder.AddInput("tokens", {Shape{1, 3}, DType::kI32, Device::Cpu()}, ObjectRole::kInput);
  ObjectId wte = builder.AddInput("wte", F32({5, 4}), ObjectRole::kParameter);
  ObjectId wpe = builder.AddInput("wpe", F32({3, 4}), ObjectRole::kParameter);
  auto y = *builder.AddTask("gelu", "gelu_forward", {x}, {}, TaskOptions{});
  auto e =
      *builder.AddTask("embedding", "embedding_forward", {tokens, wte, wpe}, {}, TaskOptions{});
  auto again = *builder.AddTask("gelu_again", "gelu_forward", {x}, {}, TaskOptions{});
  builder.MarkOutput(y[0]);
  builder.MarkOutput(e[0]);
  builder.MarkOutput(again[0]);
  ASSERT_OK_AND_ASSIGN(Graph graph, builder.Build());
  graph.AddControlEdge(graph.object(y[0]).producer, graph.object(e[0]).producer);
  graph.AddControlEdge(graph.object(e[0]).producer, graph.object(again[0]).producer);
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(graph));
  ObjectMap intact;
  Result<RunResult> result = executor.Run(prepared,
                                          {{x, RandomTensor({8}, 3)},
                                           {tokens, IntTensor({1, 3}, {0, 9, 1})},
                                           {wte, RandomTensor({5, 4}, 1)},
                                           {wpe, RandomTensor({3, 4}, 2)}},
                                          &intact);
  ASSERT_FALSE(result.ok());
  EXPECT_TRUE(intact.contains(x));
  EXPECT_TRUE(intact.contains(wte));
}

TEST(ExecutorTest, AnInputThatCannotBeBoundHandsEveryInputBack) {
  GraphBuilder builder(CpuRegistry());
  ObjectId a = builder.AddInput("a", F32({4}), ObjectRole::kParameter);
  ObjectId b = builder.AddInput("b", F32({4}), ObjectRole::kParameter);
  auto sum = *builder.AddTask("add", "add_forward", {a, b}, {}, TaskOptions{});
  builder.MarkOutput(sum[0]);
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(*builder.Build()));
  ObjectMap intact;
  Result<RunResult> result =
      executor.Run(prepared, {{a, RandomTensor({4}, 1)}, {b, RandomTensor({5}, 2)}}, &intact);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(intact.contains(a));
  EXPECT_TRUE(intact.contains(b));
}

TEST(ExecutorTest, UnboundOrMisshapenInputsAreRefused) {
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  Chain chain = GeluChain(1, 10);
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(chain.graph));
  Result<RunResult> unbound = executor.Run(prepared, {});
  ASSERT_FALSE(unbound.ok());
  EXPECT_NE(unbound.status().message().find("graph input 'x'"), std::string::npos);
  Result<RunResult> misshapen = executor.Run(prepared, {{chain.input, RandomTensor({11}, 1)}});
  ASSERT_FALSE(misshapen.ok());
  EXPECT_NE(misshapen.status().message().find("f32[11]"), std::string::npos);
  EXPECT_NE(misshapen.status().message().find("f32[10]"), std::string::npos);
}

TEST(ExecutorTest, PrepareRefusesATaskWithoutACpuKernel) {
  OpRegistry registry;
  ASSERT_OK(RegisterStandardOps(registry));  // definitions only, no kernels
  GraphBuilder builder(registry);
  ObjectId x = builder.AddInput("x", F32({4}), ObjectRole::kInput);
  ASSERT_OK(builder.AddTask("g", "gelu_forward", {x}, {}).status());
  InProcessExecutor executor(registry, TwoThreads());
  Result<PreparedGraph> prepared = executor.Prepare(*builder.Build());
  ASSERT_FALSE(prepared.ok());
  EXPECT_EQ(prepared.status().code(), StatusCode::kNotFound);
  EXPECT_NE(prepared.status().message().find("task 'g'"), std::string::npos);
}

TEST(ExecutorTest, IndependentBranchesAllRunAndJoin) {
  GraphBuilder builder(CpuRegistry());
  ObjectId x = builder.AddInput("x", F32({256}), ObjectRole::kInput);
  std::vector<ObjectId> branches;
  branches.reserve(8);
  for (int i = 0; i < 8; ++i) {
    branches.push_back((*builder.AddTask(fmt::format("b{}", i), "gelu_forward", {x}, {}))[0]);
  }
  ObjectId sum = branches[0];
  for (int i = 1; i < 8; ++i) {
    sum = (*builder.AddTask(fmt::format("add{}", i), "add_forward", {sum, branches[i]}, {}))[0];
  }
  builder.MarkOutput(sum);
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(*builder.Build()));
  Tensor input = RandomTensor({256}, 3);
  ASSERT_OK_AND_ASSIGN(RunResult result, executor.Run(prepared, {{x, input}}));
  EXPECT_EQ(result.stats.tasks_run, 15);
  std::vector<float> gelu = ToVector((*RunKernel("gelu_forward", {input}))[0]);
  std::vector<float> got = ToVector(result.outputs.at(sum));
  for (size_t i = 0; i < gelu.size(); ++i) EXPECT_NEAR(got[i], 8 * gelu[i], 1e-5);
}

TEST(ExecutorTest, ControlEdgesFixTheOrderOfIndependentTasks) {
  // Eight independent tasks chained by control edges in reverse insertion order: on two threads
  // they would otherwise overlap; with the edges each starts after the previous one ended.
  GraphBuilder builder(CpuRegistry());
  ObjectId x = builder.AddInput("x", F32({4096}), ObjectRole::kInput);
  std::vector<TaskId> tasks;
  for (int i = 0; i < 8; ++i) {
    ObjectId out = (*builder.AddTask(fmt::format("b{}", i), "gelu_forward", {x}, {}))[0];
    builder.MarkOutput(out);
    tasks.push_back(builder.graph().object(out).producer);
  }
  for (int i = 7; i > 0; --i) builder.AddControlEdge(tasks[i], tasks[i - 1]);
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(*builder.Build()));
  ASSERT_OK_AND_ASSIGN(RunResult result, executor.Run(prepared, {{x, RandomTensor({4096}, 4)}}));
  ASSERT_EQ(result.stats.tasks_run, 8);
  for (int i = 7; i > 0; --i) {
    const TaskTiming& earlier = result.stats.timings[static_cast<size_t>(i)];
    const TaskTiming& later = result.stats.timings[static_cast<size_t>(i - 1)];
    EXPECT_LE(earlier.end_us, later.start_us) << "b" << i << " then b" << i - 1;
  }
}

TEST(ExecutorTest, LateInputsArriveDuringTheRunAndProducedObjectsAreHandedOut) {
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  SplitGraph g = MakeSplitGraph();
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(g.graph));
  Tensor x = RandomTensor({64}, 1), r = RandomTensor({64}, 2);
  std::promise<Tensor> produced_y;
  RunHooks hooks;
  hooks.late_inputs = {g.r};
  hooks.watched = {g.y};
  hooks.on_produced = [&](ObjectId id, const Tensor& tensor) {
    if (id == g.y) produced_y.set_value(tensor);
  };
  // The late input comes from another thread once y has been produced, like a peer's push.
  std::thread peer([&] {
    auto y = produced_y.get_future();
    ASSERT_EQ(y.wait_for(std::chrono::seconds(5)), std::future_status::ready);
    EXPECT_FALSE(executor.Provide(g.r, RandomTensor({65}, 2)).ok()) << "wrong shape refused";
    EXPECT_OK(executor.Provide(g.r, r));
    EXPECT_FALSE(executor.Provide(g.r, r).ok()) << "provided twice";
  });
  ASSERT_OK_AND_ASSIGN(RunResult result, executor.Run(prepared, {{g.x, x}}, nullptr, &hooks));
  peer.join();
  std::vector<float> expected = ToVector((*RunKernel("gelu_forward", {x}))[0]);
  const std::vector<float> rv = ToVector(r);
  for (size_t i = 0; i < expected.size(); ++i) expected[i] += rv[i];
  EXPECT_EQ(ToVector(result.outputs.at(g.z)), expected);
}

// A peer's reply to a pushed object can arrive before the pushing task's thread goes on: the
// role meter still counts the task's end first (as the memory model does). `send` makes y from x
// for a peer (nobody reads it here); the peer answers with r before on_produced returns; `recv`
// makes z from r. Live: x + y while send runs, then r + z while recv runs: 512 bytes at most,
// never x + y + r (768: the reply counted beside the task that caused it).
TEST(ExecutorTest, AReplyToAPushedObjectIsCountedAfterTheTaskThatPushedIt) {
  GraphBuilder builder(CpuRegistry());
  const ObjectId x = builder.AddInput("x", F32({64}), ObjectRole::kActivation);
  const ObjectId r = builder.AddInput("r", F32({64}), ObjectRole::kActivation);
  const ObjectId y = (*builder.AddTask("send", "gelu_forward", {x}, {}))[0];
  builder.MarkOutput((*builder.AddTask("recv", "gelu_forward", {r}, {}))[0]);
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(*builder.Build()));
  std::promise<void> pushed;
  std::promise<Status> replied;
  std::thread peer([&] {
    pushed.get_future().wait();
    replied.set_value(executor.Provide(r, RandomTensor({64}, 2)));
  });
  RunHooks hooks;
  hooks.late_inputs = {r};
  hooks.watched = {y};
  hooks.on_produced = [&](ObjectId id, const Tensor&) {
    if (id != y) return;
    pushed.set_value();
    EXPECT_OK(replied.get_future().get());  // the reply is in before this thread goes on
  };
  ASSERT_OK_AND_ASSIGN(RunResult result,
                       executor.Run(prepared, {{x, RandomTensor({64}, 1)}}, nullptr, &hooks));
  peer.join();
  EXPECT_EQ(result.stats.role_bytes.total_peak, 2 * 64 * 4);
  EXPECT_EQ(result.stats.role_bytes[ObjectRole::kActivation], 2 * 64 * 4);
}

TEST(ExecutorTest, CancelEndsARunWaitingForAnInputThatNeverComes) {
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  SplitGraph g = MakeSplitGraph();
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(g.graph));
  RunHooks hooks;
  hooks.late_inputs = {g.r};
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    executor.Cancel(Unavailable("worker7 died before sending r"));
  });
  Result<RunResult> result =
      executor.Run(prepared, {{g.x, RandomTensor({64}, 1)}}, nullptr, &hooks);
  canceller.join();
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("worker7 died"), std::string::npos);
  // Not during a run: Provide says so.
  EXPECT_EQ(executor.Provide(g.r, RandomTensor({64}, 2)).code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tessera::testing

namespace tessera::testing {
namespace {

// x -> all_reduce member (offloaded) -> gelu; the "engine" is a thread that doubles the buffer.
struct OffloadGraph {
  Graph graph;
  ObjectId input, reduced, output;
};
OffloadGraph AllReduceThenGelu() {
  GraphBuilder builder(CpuRegistry());
  OffloadGraph g;
  g.input = builder.AddInput("x", F32({64}), ObjectRole::kGradient);
  Attrs member{{"collective", int64_t{1}},
               {"rank", int64_t{0}},
               {"group_size", int64_t{2}},
               {"reduce", std::string("sum")}};
  g.reduced = (*builder.AddTask("grad/all_reduce", "all_reduce", {g.input}, member))[0];
  g.output = (*builder.AddTask("after", "gelu_forward", {g.reduced}, {}))[0];
  builder.MarkOutput(g.reduced);
  builder.MarkOutput(g.output);
  g.graph = *builder.Build();
  return g;
}

TEST(ExecutorOffloadTest, OffloadedTasksFinishFromAnotherThreadAndStartTheirDependents) {
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  OffloadGraph g = AllReduceThenGelu();
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(g.graph));
  std::vector<std::thread> engine;
  RunHooks hooks;
  hooks.offloaded = [](const TaskSpec& task) { return task.op == "all_reduce"; };
  hooks.offload = [&](const TaskSpec&, const std::vector<Tensor>& in,
                      const std::vector<Tensor>& out, const RunHooks::OffloadDone& done) {
    engine.emplace_back([in, out, done] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      // The in-place output starts as the input; "the other member" contributed the same.
      for (int64_t i = 0; i < out[0].numel(); ++i) out[0].data<float>()[i] *= 2;
      done(Status::Ok());
    });
  };
  Tensor x = RandomTensor({64}, 3);
  const std::vector<float> before = ToVector(x);
  ASSERT_OK_AND_ASSIGN(RunResult result, executor.Run(prepared, {{g.input, x}}, nullptr, &hooks));
  for (auto& thread : engine) thread.join();
  std::vector<float> doubled = before;
  for (float& v : doubled) v *= 2;
  EXPECT_EQ(ToVector(result.outputs.at(g.reduced)), doubled);
  EXPECT_EQ(ToVector(result.outputs.at(g.output)),
            ToVector((*RunKernel("gelu_forward", {FloatTensor({64}, doubled)}))[0]));
  EXPECT_EQ(result.stats.tasks_run, 2);
}

TEST(ExecutorOffloadTest, AFailedOffloadFailsTheRunNamingTheTask) {
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  OffloadGraph g = AllReduceThenGelu();
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(g.graph));
  std::thread engine;
  Status told;
  RunHooks hooks;
  hooks.offloaded = [](const TaskSpec& task) { return task.op == "all_reduce"; };
  hooks.offload = [&](const TaskSpec&, const std::vector<Tensor>&, const std::vector<Tensor>&,
                      const RunHooks::OffloadDone& done) {
    engine = std::thread([done] { done(Unavailable("rank 1 died")); });
  };
  hooks.on_failed = [&](const Status& status) { told = status; };
  Result<RunResult> result =
      executor.Run(prepared, {{g.input, RandomTensor({64}, 3)}}, nullptr, &hooks);
  engine.join();
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("grad/all_reduce"), std::string::npos)
      << result.status().ToString();
  EXPECT_NE(result.status().message().find("rank 1 died"), std::string::npos);
  EXPECT_EQ(told.message(), result.status().message());
}

// A run cancelled while an offloaded task is queued (a worker that lost its scheduler in the
// middle of a collective step): on_failed ends the queued work, whose completion reports back
// into the run from inside on_failed. The run must end with the cancel reason, not deadlock.
TEST(ExecutorOffloadTest, ACancelWhileAnOffloadIsQueuedEndsTheRun) {
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  OffloadGraph g = AllReduceThenGelu();
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(g.graph));
  std::mutex mutex;
  RunHooks::OffloadDone queued;
  std::thread canceller;
  RunHooks hooks;
  hooks.offloaded = [](const TaskSpec& task) { return task.op == "all_reduce"; };
  hooks.offload = [&](const TaskSpec&, const std::vector<Tensor>&, const std::vector<Tensor>&,
                      RunHooks::OffloadDone done) {
    {
      std::lock_guard lock(mutex);
      queued = std::move(done);  // waits its turn in the communication stream
    }
    canceller = std::thread([&] { executor.Cancel(Unavailable("lost the scheduler")); });
  };
  hooks.on_failed = [&](const Status& error) {
    RunHooks::OffloadDone done;
    {
      std::lock_guard lock(mutex);
      done = std::move(queued);
    }
    if (done) done(error);  // as CollectiveEngine::EndStream does, on the run's thread
  };
  Result<RunResult> result =
      executor.Run(prepared, {{g.input, RandomTensor({64}, 3)}}, nullptr, &hooks);
  canceller.join();
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("lost the scheduler"), std::string::npos)
      << result.status().ToString();
}

TEST(ExecutorOffloadTest, OneMemberCollectivesRunAsKernels) {
  GraphBuilder builder(CpuRegistry());
  ObjectId x = builder.AddInput("x", F32({6}), ObjectRole::kGradient);
  Attrs one{{"collective", int64_t{1}},
            {"rank", int64_t{0}},
            {"group_size", int64_t{1}},
            {"reduce", std::string("avg")}};
  ObjectId y = (*builder.AddTask("rs", "reduce_scatter", {x}, one))[0];
  Attrs gather{{"collective", int64_t{2}}, {"rank", int64_t{0}}, {"group_size", int64_t{1}}};
  ObjectId z = (*builder.AddTask("ag", "all_gather", {y}, gather))[0];
  Attrs exchange{{"collective", int64_t{3}}, {"rank", int64_t{0}}, {"group_size", int64_t{1}}};
  ObjectId w = (*builder.AddTask("a2a", "all_to_all", {z}, exchange))[0];
  builder.MarkOutput(z);
  builder.MarkOutput(w);
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(*builder.Build()));
  Tensor input = FloatTensor({6}, {1, 2, 3, 4, 5, 6});
  ASSERT_OK_AND_ASSIGN(RunResult result, executor.Run(prepared, {{x, input}}));
  EXPECT_EQ(ToVector(result.outputs.at(z)), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  // One member's all-to-all: its one block goes to itself.
  EXPECT_EQ(ToVector(result.outputs.at(w)), (std::vector<float>{1, 2, 3, 4, 5, 6}));
}

TEST(ExecutorOffloadTest, CollectiveShapesAreChecked) {
  GraphBuilder builder(CpuRegistry());
  ObjectId x = builder.AddInput("x", F32({7}), ObjectRole::kGradient);
  Attrs members{{"collective", int64_t{1}},
                {"rank", int64_t{0}},
                {"group_size", int64_t{2}},
                {"reduce", std::string("sum")}};
  Result<std::vector<ObjectId>> odd = builder.AddTask("rs", "reduce_scatter", {x}, members);
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("not a multiple of the group's 2 members"),
            std::string::npos)
      << odd.status().ToString();
  // All-to-all splits x into one block per member, so x's elements must divide too.
  Result<std::vector<ObjectId>> uneven = builder.AddTask("a2a", "all_to_all", {x}, members);
  ASSERT_FALSE(uneven.ok());
  EXPECT_NE(uneven.status().message().find("7 elements, not a multiple of the group's 2 members"),
            std::string::npos)
      << uneven.status().ToString();
  members.Set("reduce", std::string("product"));
  Result<std::vector<ObjectId>> bad_op = builder.AddTask("ar", "all_reduce", {x}, members);
  ASSERT_FALSE(bad_op.ok());
  EXPECT_NE(bad_op.status().message().find("use sum, avg, max or min"), std::string::npos);
}

}  // namespace
}  // namespace tessera::testing

namespace tessera::testing {
namespace {

// An executor with a (fake) GPU: a host tensor delivered for an object that lives on the GPU,
// bound at the start or provided late (bytes from the network on a GPU worker), is copied there;
// outputs stay on it.
TEST(ExecutorDeviceTest, HostTensorsForDeviceObjectsAreCopiedToTheDevice) {
  ASSERT_OK_AND_ASSIGN(OpRegistry registry, MakeCpuOpRegistry());
  // The fake GPU's memory is host memory: the CPU kernels stand in for its kernels.
  for (const char* op : {"gelu_forward", "add_forward"}) {
    ASSERT_OK_AND_ASSIGN(const KernelFn* kernel, registry.FindKernel(op, DeviceKind::kCpu));
    ASSERT_OK(registry.AddKernel(op, DeviceKind::kCuda, *kernel));
  }
  auto gpu = std::make_shared<FakeDevice>();
  ExecutorOptions options = TwoThreads();
  options.device = gpu;
  InProcessExecutor executor(registry, options);
  GraphBuilder builder(registry);
  const TensorMeta on_gpu{Shape{64}, DType::kF32, Device::Cuda(0)};
  const ObjectId x = builder.AddInput("x", on_gpu, ObjectRole::kInput);
  const ObjectId r = builder.AddInput("r", on_gpu, ObjectRole::kInput);
  TaskOptions cuda;
  cuda.device_kind = DeviceKind::kCuda;
  ASSERT_OK_AND_ASSIGN(std::vector<ObjectId> y,
                       builder.AddTask("g", "gelu_forward", {x}, {}, cuda));
  ASSERT_OK_AND_ASSIGN(std::vector<ObjectId> z,
                       builder.AddTask("z", "add_forward", {y[0], r}, {}, cuda));
  builder.MarkOutput(z[0]);
  ASSERT_OK_AND_ASSIGN(Graph graph, builder.Build());
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(std::move(graph)));
  const Tensor xv = RandomTensor({64}, 1), rv = RandomTensor({64}, 2);
  RunHooks hooks;
  hooks.late_inputs = {r};
  std::thread peer([&] {
    ASSERT_TRUE(Eventually([&] { return executor.Activity().has_value(); }));
    EXPECT_FALSE(executor.Provide(r, RandomTensor({65}, 2)).ok()) << "wrong shape refused";
    EXPECT_OK(executor.Provide(r, rv));
  });
  ASSERT_OK_AND_ASSIGN(RunResult result, executor.Run(prepared, {{x, xv}}, nullptr, &hooks));
  peer.join();
  const Tensor& out = result.outputs.at(z[0]);
  EXPECT_EQ(out.meta().device, Device::Cuda(0));
  EXPECT_EQ(gpu->to_device.load(), 2 * 64 * 4);  // x and r, once each
  std::vector<float> expected = ToVector((*RunKernel("gelu_forward", {xv}))[0]);
  for (size_t i = 0; i < expected.size(); ++i) expected[i] += ToVector(rv)[i];
  EXPECT_EQ(ToVector(out), expected);  // readable here: the fake GPU's memory is the host's
}

}  // namespace
}  // namespace tessera::testing

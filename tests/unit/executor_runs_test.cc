// The in-process executor's runs as objects: several in flight on one executor, priorities across
// them, cancelling and providing inputs per run.
#include <cstring>
#include <future>
#include <thread>

#include "model/gpt2.h"
#include "planner/step_graph.h"
#include "probe_op.h"
#include "test_util.h"
#include "unit/executor_test_graphs.h"
#include "worker/in_process_executor.h"

namespace tessera::testing {
namespace {

ExecutorOptions OneThread() {
  ExecutorOptions options = TwoThreads();
  options.threads = 1;
  return options;
}

// A run started asynchronously, and its result to come.
struct Started {
  std::shared_ptr<GraphExecution> run;
  std::shared_future<Result<RunResult>> result;
};
Started StartRun(InProcessExecutor& executor, const PreparedGraph& prepared, ObjectMap inputs,
                 RunHooks hooks = {}) {
  auto ended = std::make_shared<std::promise<Result<RunResult>>>();
  Started started;
  started.result = ended->get_future().share();
  started.run = executor.Start(
      prepared, std::move(inputs), std::move(hooks),
      [ended](Result<RunResult> result, const ObjectMap&) { ended->set_value(std::move(result)); });
  return started;
}

// x -> 8 gelu branches, summed by a chain of adds.
Graph Branches(ObjectId* x, ObjectId* sum) {
  GraphBuilder builder(CpuRegistry());
  *x = builder.AddInput("x", F32({256}), ObjectRole::kInput);
  std::vector<ObjectId> branches;
  branches.reserve(8);
  for (int i = 0; i < 8; ++i) {
    branches.push_back((*builder.AddTask(fmt::format("b{}", i), "gelu_forward", {*x}, {}))[0]);
  }
  *sum = branches[0];
  for (int i = 1; i < 8; ++i) {
    *sum = (*builder.AddTask(fmt::format("add{}", i), "add_forward", {*sum, branches[i]}, {}))[0];
  }
  builder.MarkOutput(*sum);
  return *builder.Build();
}

TEST(ExecutorRunsTest, RunsInFlightTogetherGiveWhatTheyGiveOneByOne) {
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  Chain chain = GeluChain(5, 4096);
  ObjectId x, sum;
  ASSERT_OK_AND_ASSIGN(PreparedGraph chain_graph, executor.Prepare(chain.graph));
  ASSERT_OK_AND_ASSIGN(PreparedGraph branches_graph, executor.Prepare(Branches(&x, &sum)));
  const Tensor first = RandomTensor({4096}, 11), second = RandomTensor({256}, 12),
               third = RandomTensor({4096}, 13);
  ASSERT_OK_AND_ASSIGN(RunResult first_alone, executor.Run(chain_graph, {{chain.input, first}}));
  ASSERT_OK_AND_ASSIGN(RunResult second_alone, executor.Run(branches_graph, {{x, second}}));
  ASSERT_OK_AND_ASSIGN(RunResult third_alone, executor.Run(chain_graph, {{chain.input, third}}));

  // Two graphs, one of them twice, all in flight at once.
  Started runs[] = {StartRun(executor, chain_graph, {{chain.input, first}}),
                    StartRun(executor, branches_graph, {{x, second}}),
                    StartRun(executor, chain_graph, {{chain.input, third}})};
  ASSERT_OK_AND_ASSIGN(RunResult first_together, runs[0].result.get());
  ASSERT_OK_AND_ASSIGN(RunResult second_together, runs[1].result.get());
  ASSERT_OK_AND_ASSIGN(RunResult third_together, runs[2].result.get());
  EXPECT_EQ(ToVector(first_together.outputs.at(chain.output)),
            ToVector(first_alone.outputs.at(chain.output)));
  EXPECT_EQ(ToVector(second_together.outputs.at(sum)), ToVector(second_alone.outputs.at(sum)));
  EXPECT_EQ(ToVector(third_together.outputs.at(chain.output)),
            ToVector(third_alone.outputs.at(chain.output)));
  EXPECT_EQ(second_together.stats.tasks_run, 15);
  for (const Started& run : runs) EXPECT_TRUE(run.run->ended());
}

// Every input of the GPT-2 tiny step graph: tokens, the learning rate and step, parameters and
// zero moments. The same seed gives the same values.
ObjectMap Gpt2StepInputs(const StepGraph& step, uint64_t seed) {
  const Graph& g = step.graph;
  ObjectMap inputs;
  for (const std::vector<ObjectId>& pieces : step.inputs) {
    for (ObjectId id : pieces) inputs[id] = RandomTokens(g.object(id).meta.shape, 50, seed++);
  }
  inputs[step.lr] = ScalarTensor(1e-3f);
  inputs[step.step] = Int64Scalar(1);
  for (const StateObject& state : step.state) {
    const TensorMeta& meta = g.object(state.input).meta;
    inputs[state.input] = state.kind == StateKind::kParameter
                              ? RandomTensor(meta.shape, seed++, 0.02f)
                              : *Tensor::Zeros(meta, TestAllocator());
  }
  return inputs;
}

TEST(ExecutorRunsTest, TheGpt2StepRunTwiceAtOnceIsBitIdenticalToItAlone) {
  ASSERT_OK_AND_ASSIGN(StepGraph step,
                       PlanTrainingStep(*BuildGpt2(Gpt2Config{2, 32, 4, 50, 16}),
                                        TrainingPlan{.batch = 2, .seq_len = 16}, CpuRegistry()));
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(step.graph));
  for (ObjectId input : step.graph.InputObjects()) {
    ASSERT_TRUE(Gpt2StepInputs(step, 1).contains(input)) << step.graph.object(input).name;
  }
  ASSERT_OK_AND_ASSIGN(RunResult alone, executor.Run(prepared, Gpt2StepInputs(step, 1)));
  Started twice[] = {StartRun(executor, prepared, Gpt2StepInputs(step, 1)),
                     StartRun(executor, prepared, Gpt2StepInputs(step, 1))};
  for (Started& run : twice) {
    ASSERT_OK_AND_ASSIGN(RunResult together, run.result.get());
    ASSERT_EQ(together.outputs.size(), alone.outputs.size());
    for (const auto& [id, tensor] : alone.outputs) {
      const Tensor& other = together.outputs.at(id);
      ASSERT_EQ(other.bytes(), tensor.bytes());
      EXPECT_EQ(
          std::memcmp(other.raw_data(), tensor.raw_data(), static_cast<size_t>(tensor.bytes())), 0)
          << step.graph.object(id).name;
    }
  }
}

// Tasks of `tags` (probe ops reading x), with priorities, options for the first one.
Graph ProbeGraph(const OpRegistry& registry, const std::vector<std::pair<int64_t, int32_t>>& tags,
                 bool gate_first) {
  GraphBuilder builder(registry);
  ObjectId x = builder.AddInput("x", F32({4}), ObjectRole::kInput);
  for (size_t i = 0; i < tags.size(); ++i) {
    Attrs attrs{{"tag", tags[i].first}};
    if (i == 0 && gate_first) attrs.Set("gate", int64_t{1});
    TaskOptions options;
    options.priority = tags[i].second;
    ObjectId out =
        (*builder.AddTask(fmt::format("t{}", tags[i].first), "probe", {x}, attrs, options))[0];
    builder.MarkOutput(out);
  }
  return *builder.Build();
}

TEST(ExecutorRunsTest, ReadyTasksStartByPriorityThenInOrder) {
  Probe probe;
  ASSERT_OK_AND_ASSIGN(OpRegistry registry, RegistryWithProbe(&probe));
  InProcessExecutor executor(registry, OneThread());
  // All four are ready at once; one slot takes them best first, equals in task order.
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared,
                       executor.Prepare(ProbeGraph(registry, {{0, 0}, {1, 2}, {2, 1}, {3, 2}},
                                                   /*gate_first=*/false)));
  ASSERT_OK(executor.Run(prepared, {{prepared.graph().InputObjects()[0], RandomTensor({4}, 1)}})
                .status());
  EXPECT_EQ(probe.started(), (std::vector<int64_t>{1, 3, 2, 0}));
}

// An executor of N threads gives its kernels N threads, whoever started the run: with one, a
// kernel's parallel loops run alone (a worker started with --threads 1 uses one core). TBB lends
// an arena without worker slots a worker of its own when work is enqueued from outside it; that
// worker and the lending thread together made two.
TEST(ExecutorRunsTest, KernelsOfAOneThreadExecutorRunInAnArenaOfOne) {
  Probe probe;
  ASSERT_OK_AND_ASSIGN(OpRegistry registry, RegistryWithProbe(&probe));
  InProcessExecutor executor(registry, OneThread());
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared,
                       executor.Prepare(ProbeGraph(registry, {{0, 0}, {1, 0}, {2, 0}, {3, 0}},
                                                   /*gate_first=*/false)));
  const ObjectId x = prepared.graph().InputObjects()[0];
  for (int run = 0; run < 20; ++run) {
    ASSERT_OK(executor.Run(prepared, {{x, RandomTensor({4}, run)}}).status());
  }
  EXPECT_EQ(probe.started().size(), 80u);
  EXPECT_EQ(probe.widest_arena(), 1);
  // On the executor's own thread, every one: no TBB worker joined (one spins between tasks).
  const std::set<std::thread::id> threads = probe.threads();
  EXPECT_EQ(threads.size(), 1u);
  EXPECT_FALSE(threads.contains(std::this_thread::get_id()));
}

TEST(ExecutorRunsTest, AHighPriorityTaskOfALaterRunGoesBeforeQueuedWork) {
  Probe probe;
  ASSERT_OK_AND_ASSIGN(OpRegistry registry, RegistryWithProbe(&probe));
  InProcessExecutor executor(registry, OneThread());
  OpenGateAtExit gate(probe);
  // The first run's gated task holds the only slot; its three others wait in the queue.
  ASSERT_OK_AND_ASSIGN(PreparedGraph first,
                       executor.Prepare(ProbeGraph(registry, {{1, 0}, {2, 0}, {3, 0}, {4, 0}},
                                                   /*gate_first=*/true)));
  ASSERT_OK_AND_ASSIGN(PreparedGraph second,
                       executor.Prepare(ProbeGraph(registry, {{10, 5}}, /*gate_first=*/false)));
  const ObjectId x = first.graph().InputObjects()[0];
  Started low = StartRun(executor, first, {{x, RandomTensor({4}, 1)}});
  ASSERT_TRUE(probe.WaitStarted(1));
  Started high = StartRun(executor, second, {{x, RandomTensor({4}, 2)}});
  probe.OpenGate();
  ASSERT_OK(low.result.get().status());
  ASSERT_OK(high.result.get().status());
  EXPECT_EQ(probe.started(), (std::vector<int64_t>{1, 10, 2, 3, 4}));
}

TEST(ExecutorRunsTest, TwoThreadsRunTwoTasksAtOnceAndNoMore) {
  Probe probe;
  ASSERT_OK_AND_ASSIGN(OpRegistry registry, RegistryWithProbe(&probe));
  InProcessExecutor executor(registry, TwoThreads());
  OpenGateAtExit gate(probe);
  GraphBuilder builder(registry);
  ObjectId x = builder.AddInput("x", F32({4}), ObjectRole::kInput);
  for (int64_t tag = 1; tag <= 3; ++tag) {
    builder.MarkOutput((*builder.AddTask(fmt::format("t{}", tag), "probe", {x},
                                         {{"tag", tag}, {"gate", int64_t{1}}}))[0]);
  }
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(*builder.Build()));
  Started run = StartRun(executor, prepared, {{x, RandomTensor({4}, 1)}});
  // Both slots hold a task that waits for the gate: the third waits for a slot.
  ASSERT_TRUE(probe.WaitStarted(1));
  ASSERT_TRUE(probe.WaitStarted(2));
  EXPECT_EQ(probe.started().size(), 2u);
  EXPECT_EQ(executor.Activity()->running.size(), 2u);
  probe.OpenGate();
  ASSERT_OK(run.result.get().status());
  ASSERT_EQ(probe.started().size(), 3u);
  EXPECT_EQ(probe.started()[2], 3);  // the first two in either order
}

TEST(ExecutorRunsTest, OffloadedTasksTakeNoSlot) {
  Probe probe;
  ASSERT_OK_AND_ASSIGN(OpRegistry registry, RegistryWithProbe(&probe));
  InProcessExecutor executor(registry, OneThread());
  // An all_reduce member that is done only once the probe beside it ran: with one slot, that
  // works only if the member does not hold the slot while it is out.
  GraphBuilder builder(registry);
  ObjectId x = builder.AddInput("x", F32({4}), ObjectRole::kGradient);
  Attrs member{{"collective", int64_t{1}},
               {"rank", int64_t{0}},
               {"group_size", int64_t{2}},
               {"reduce", std::string("sum")}};
  builder.MarkOutput((*builder.AddTask("grad/all_reduce", "all_reduce", {x}, member))[0]);
  builder.MarkOutput((*builder.AddTask("beside", "probe", {x}, {{"tag", int64_t{7}}}))[0]);
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(*builder.Build()));
  std::thread engine;
  bool probe_ran_first = false;
  RunHooks hooks;
  hooks.offloaded = [](const TaskSpec& task) { return task.op == "all_reduce"; };
  hooks.offload = [&](const TaskSpec&, const std::vector<Tensor>&, const std::vector<Tensor>&,
                      const RunHooks::OffloadDone& done) {
    engine = std::thread([&, done] {
      probe_ran_first = probe.WaitStarted(7);
      done(Status::Ok());
    });
  };
  Result<RunResult> result = executor.Run(prepared, {{x, RandomTensor({4}, 1)}}, nullptr, &hooks);
  engine.join();
  ASSERT_OK(result.status());
  EXPECT_TRUE(probe_ran_first);
  EXPECT_EQ(result->stats.tasks_run, 2);
}

TEST(ExecutorRunsTest, ProvideAndCancelAddressOneRunOfSeveral) {
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  SplitGraph g = MakeSplitGraph();
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(g.graph));
  RunHooks hooks;
  hooks.late_inputs = {g.r};
  const Tensor x = RandomTensor({64}, 1), r = RandomTensor({64}, 2);
  Started cancelled = StartRun(executor, prepared, {{g.x, x}}, hooks);
  Started provided = StartRun(executor, prepared, {{g.x, x}}, hooks);
  EXPECT_EQ(cancelled.run->Activity().awaited, std::vector<ObjectId>{g.r});
  // Both await r: the executor cannot tell which one it is for.
  EXPECT_EQ(executor.Provide(g.r, r).code(), StatusCode::kInvalidArgument);
  EXPECT_OK(provided.run->Provide(g.r, r));
  cancelled.run->Cancel(Unavailable("worker7 died before sending r"));
  ASSERT_OK_AND_ASSIGN(RunResult result, provided.result.get());
  std::vector<float> expected = ToVector((*RunKernel("gelu_forward", {x}))[0]);
  for (size_t i = 0; i < expected.size(); ++i) expected[i] += ToVector(r)[i];
  EXPECT_EQ(ToVector(result.outputs.at(g.z)), expected);
  const Result<RunResult>& failed = cancelled.result.get();
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("worker7 died"), std::string::npos);
  EXPECT_EQ(provided.run->Provide(g.r, r).code(), StatusCode::kUnavailable);
}

TEST(ExecutorRunsTest, StartHandsBackInputsItCannotBind) {
  InProcessExecutor executor(CpuRegistry(), TwoThreads());
  Chain chain = GeluChain(1, 10);
  ASSERT_OK_AND_ASSIGN(PreparedGraph prepared, executor.Prepare(chain.graph));
  Status error;
  ObjectMap back;
  std::shared_ptr<GraphExecution> run =
      executor.Start(prepared, {{chain.input, RandomTensor({11}, 1)}}, {},
                     [&](const Result<RunResult>& result, ObjectMap intact) {
                       error = result.status();
                       back = std::move(intact);
                     });
  run->Wait();
  EXPECT_EQ(error.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(back.contains(chain.input));
  EXPECT_FALSE(executor.Activity().has_value());
}

TEST(ExecutorRunsTest, DestroyingTheExecutorCancelsRunsInFlight) {
  SplitGraph g = MakeSplitGraph();
  std::optional<PreparedGraph> prepared;  // outlives the run, which outlives the executor
  Started waiting;
  {
    InProcessExecutor executor(CpuRegistry(), TwoThreads());
    Result<PreparedGraph> made = executor.Prepare(g.graph);
    ASSERT_OK(made.status());
    prepared.emplace(*std::move(made));
    RunHooks hooks;
    hooks.late_inputs = {g.r};
    waiting = StartRun(executor, *prepared, {{g.x, RandomTensor({64}, 1)}}, hooks);
  }
  const Result<RunResult>& result = waiting.result.get();
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kCancelled);
}

}  // namespace
}  // namespace tessera::testing

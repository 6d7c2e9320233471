// The memory model (planner/memory_model.h): lifetimes, peaks and orders on small graphs whose
// figures are worked out by hand, bad orders refused, and the prediction checked against the
// executor's own accounting (RoleMeter, and each kernel's scratch) on real training steps: GPT-2
// and the 3D U-Net on a one-thread executor, where the predicted peaks must equal the measured
// ones exactly.
#include "planner/memory_model.h"

#include <filesystem>

#include <fmt/format.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/collective_task.h"
#include "data/volumes.h"
#include "gpt2_test_util.h"
#include "model/gpt2.h"
#include "model/unet3d.h"
#include "test_util.h"
#include "training/trainer.h"
#include "worker/gpu.h"
#include "worker/swap_file.h"

namespace tessera::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TensorMeta Floats(int64_t n, Device device = Device::Cpu()) {
  return TensorMeta{Shape{n}, DType::kF32, device};
}

// Adds a task reading `inputs` and making `outputs`, pinned to `worker` (0: unpinned).
TaskId Add(Graph& graph, const std::string& name, std::vector<ObjectId> inputs,
           std::vector<ObjectId> outputs, int32_t priority = 0, uint64_t worker = 0,
           std::vector<Donation> donations = {}) {
  TaskSpec spec;
  spec.name = name;
  spec.op = "probe";
  spec.inputs = std::move(inputs);
  spec.outputs = std::move(outputs);
  spec.priority = priority;
  spec.pinned_worker = WorkerId(worker);
  spec.donations = std::move(donations);
  return graph.AddTask(std::move(spec));
}

std::vector<std::string> Names(const Graph& graph, const std::vector<TaskId>& tasks) {
  std::vector<std::string> names;
  names.reserve(tasks.size());
  for (TaskId id : tasks) names.push_back(graph.task(id).name);
  return names;
}

const ObjectLifetime& Life(const WorkerMemory& memory, ObjectId id) {
  for (const ObjectLifetime& life : memory.objects) {
    if (life.object == id) return life;
  }
  TESSERA_CHECK(false, "{} not held", id.ToString());
  return memory.objects.front();
}

int64_t Host(const WorkerMemory& memory, size_t p) {
  return memory.during[p][static_cast<size_t>(MemoryTier::kHost)];
}

// x (input, 100 B) -> f -> a (400 B) -> g -> b (200 B) -> h -> loss (4 B, output)
// and a is also read by h: a lives from f to h.
TEST(MemoryModelTest, AChainHoldsEachObjectFromItsProducerToItsLastReader) {
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(25), ObjectRole::kInput);
  const ObjectId a = graph.AddObject("a", Floats(100), ObjectRole::kActivation);
  const ObjectId b = graph.AddObject("b", Floats(50), ObjectRole::kActivation);
  const ObjectId loss = graph.AddObject("loss", Floats(1), ObjectRole::kOutput);
  Add(graph, "f", {x}, {a});
  Add(graph, "g", {a}, {b});
  Add(graph, "h", {a, b}, {loss});
  graph.MarkOutput(loss);
  ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(graph));
  ASSERT_EQ(profile.workers.size(), 1u);
  const WorkerMemory& memory = profile.workers[0];
  EXPECT_THAT(Names(graph, memory.order.tasks), ElementsAre("f", "g", "h"));
  EXPECT_EQ(Life(memory, x).first, -1);
  EXPECT_EQ(Life(memory, x).last, 0);
  EXPECT_EQ(Life(memory, a).first, 0);
  EXPECT_EQ(Life(memory, a).last, 2);
  EXPECT_EQ(Life(memory, loss).last, 3);  // kept after the step
  EXPECT_EQ(Host(memory, 0), 100 + 400);
  EXPECT_EQ(Host(memory, 1), 400 + 200);
  EXPECT_EQ(Host(memory, 2), 400 + 200 + 4);
  const TierPeak& peak = memory.peaks[static_cast<size_t>(MemoryTier::kHost)];
  EXPECT_EQ(peak.bytes, 604);
  EXPECT_EQ(peak.position, 2);
  EXPECT_THAT(peak.live, ElementsAre(a, b, loss));
  EXPECT_EQ(peak.by_role[static_cast<size_t>(ObjectRole::kActivation)], 600);
  EXPECT_EQ(memory.total_peak, 604);
  EXPECT_EQ(memory.role_peaks[static_cast<size_t>(ObjectRole::kActivation)], 600);
  EXPECT_EQ(memory.role_peaks[static_cast<size_t>(ObjectRole::kInput)], 100);
  EXPECT_EQ(memory.peaks[static_cast<size_t>(MemoryTier::kDevice)].bytes, 0);
}

TEST(MemoryModelTest, ADonatedInputIsReplacedByItsOutputAndAnUnreadOutputFreedAtOnce) {
  Graph graph;
  const ObjectId p = graph.AddObject("p", Floats(100), ObjectRole::kParameter);
  const ObjectId g = graph.AddObject("g", Floats(100), ObjectRole::kGradient);
  const ObjectId p2 = graph.AddObject("p2", Floats(100), ObjectRole::kParameter);
  const ObjectId scratch = graph.AddObject("scratch", Floats(1000), ObjectRole::kActivation);
  Add(graph, "update", {p, g}, {p2, scratch}, 0, 0, {Donation{0, 0}});
  graph.MarkOutput(p2);
  ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(graph));
  const WorkerMemory& memory = profile.workers[0];
  // During the update: g, p2 (in p's place) and the scratch output nobody reads.
  EXPECT_EQ(Host(memory, 0), 400 + 400 + 4000);
  EXPECT_TRUE(Life(memory, p).replaced);
  EXPECT_EQ(Life(memory, scratch).first, 0);
  EXPECT_EQ(Life(memory, scratch).last, 0);
  EXPECT_EQ(memory.role_peaks[static_cast<size_t>(ObjectRole::kParameter)], 400);
  EXPECT_EQ(memory.model_state_peak, 800);
}

TEST(MemoryModelTest, TheOrderIsTheExecutorsReadyTasksByPriorityThenFirstReady) {
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  std::vector<ObjectId> outs;
  for (const char* name : {"low", "high", "mid", "after_low"}) {
    outs.push_back(graph.AddObject(std::string(name) + ".out", Floats(1), ObjectRole::kOutput));
    graph.MarkOutput(outs.back());
  }
  Add(graph, "low", {x}, {outs[0]}, 0);
  Add(graph, "high", {x}, {outs[1]}, 5);
  Add(graph, "mid", {x}, {outs[2]}, 2);
  Add(graph, "after_low", {outs[0]}, {outs[3]}, 9);
  ASSERT_OK_AND_ASSIGN(std::vector<WorkerOrder> orders, SimulateWorkerOrders(graph));
  ASSERT_EQ(orders.size(), 1u);
  EXPECT_THAT(Names(graph, orders[0].tasks), ElementsAre("high", "mid", "low", "after_low"));
}

// What another worker sends may come as soon as its producer has run, however fast the workers
// are: it is live from right after the last task here that its producer waits for (before the
// first task when it waits for none here).
TEST(MemoryModelTest, AnObjectPushedToAnotherWorkerIsLiveThereFromTheEarliestItCanCome) {
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(10), ObjectRole::kInput);
  const ObjectId y = graph.AddObject("y", Floats(10), ObjectRole::kInput);
  const ObjectId a = graph.AddObject("a", Floats(100), ObjectRole::kActivation);
  const ObjectId b = graph.AddObject("b", Floats(20), ObjectRole::kActivation);
  const ObjectId c = graph.AddObject("c", Floats(20), ObjectRole::kActivation);
  const ObjectId e = graph.AddObject("e", Floats(50), ObjectRole::kActivation);
  const ObjectId out = graph.AddObject("out", Floats(1), ObjectRole::kOutput);
  Add(graph, "w1.solo", {x}, {e}, 0, 1);  // waits for nothing on w2
  Add(graph, "w2.first", {y}, {b}, 0, 2);
  Add(graph, "w1.make", {x, b}, {a}, 0, 1);  // waits for w2.first
  Add(graph, "w2.second", {b}, {c}, 0, 2);
  const ObjectId d = graph.AddObject("d", Floats(1), ObjectRole::kActivation);
  Add(graph, "w2.third", {c}, {d}, 0, 2);
  Add(graph, "w2.use", {a, e}, {out}, -1, 2);  // after the chain, which comes first
  graph.MarkOutput(out);
  ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(graph));
  ASSERT_EQ(profile.workers.size(), 2u);
  const WorkerMemory& w1 = profile.workers[0];
  const WorkerMemory& w2 = profile.workers[1];
  EXPECT_EQ(w1.order.worker, WorkerId(1));
  EXPECT_THAT(Names(graph, w1.order.tasks), ElementsAre("w1.solo", "w1.make"));
  // On the producer nobody reads a: freed as soon as it is made (its push's loan of the
  // buffer is the allocator's to wait for, core/allocator.h).
  EXPECT_EQ(Life(w1, a).first, 1);
  EXPECT_EQ(Life(w1, a).last, 1);
  EXPECT_THAT(Names(graph, w2.order.tasks),
              ElementsAre("w2.first", "w2.second", "w2.third", "w2.use"));
  // e may be there before w2 starts; a right after w2.first, which its producer waits for.
  EXPECT_TRUE(Life(w2, e).received);
  EXPECT_EQ(Life(w2, e).first, -1);
  EXPECT_TRUE(Life(w2, a).received);
  EXPECT_EQ(Life(w2, a).first, 1);
  EXPECT_EQ(Life(w2, a).last, 3);
  EXPECT_EQ(Host(w2, 0), 40 + 80 + 200);        // y, b, e
  EXPECT_EQ(Host(w2, 1), 400 + 80 + 80 + 200);  // a may have come; b, c, e
  EXPECT_EQ(Host(w2, 3), 400 + 200 + 4);        // a, e, out (d nobody reads: freed when made)
}

// With finishing times (a simulated step's), a pushed object arrives at its producer's end, not
// a unit of time per task: a slow reader holds what its fast neighbour sends while it computes
// (a pipeline stage whose next stage returns the backward inputs faster than it takes them).
TEST(MemoryModelTest, WithFinishingTimesWhatAFastProducerSendsPilesUpAtASlowReader) {
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(10), ObjectRole::kInput);
  const ObjectId y = graph.AddObject("y", Floats(10), ObjectRole::kInput);
  const ObjectId a0 = graph.AddObject("a0", Floats(100), ObjectRole::kActivation);
  const ObjectId a1 = graph.AddObject("a1", Floats(100), ObjectRole::kActivation);
  const ObjectId b0 = graph.AddObject("b0", Floats(1), ObjectRole::kOutput);
  const ObjectId b1 = graph.AddObject("b1", Floats(1), ObjectRole::kOutput);
  const TaskId make0 = Add(graph, "w1.make0", {x}, {a0}, 0, 1);
  const TaskId make1 = Add(graph, "w1.make1", {y}, {a1}, 0, 1);
  const TaskId use0 = Add(graph, "w2.use0", {a0}, {b0}, 0, 2);
  const TaskId use1 = Add(graph, "w2.use1", {a1}, {b1}, 0, 2);
  graph.MarkOutput(b0);
  graph.MarkOutput(b1);
  // Untimed, both may come before w2 starts (their producers wait for nothing there).
  ASSERT_OK_AND_ASSIGN(MemoryProfile untimed, PredictMemory(graph));
  ASSERT_EQ(untimed.workers.size(), 2u);
  EXPECT_EQ(Life(untimed.workers[1], a1).first, -1);
  EXPECT_EQ(Host(untimed.workers[1], 0), 400 + 400 + 4);  // a0, a1, b0
  // Timed: w1 makes both by 2 ms, w2's use0 runs from 1 to 10 ms: a1 arrives during use0.
  std::vector<double> finish(4);
  finish[make0.value() - 1] = 1;
  finish[make1.value() - 1] = 2;
  finish[use0.value() - 1] = 10;
  finish[use1.value() - 1] = 11;
  std::vector<WorkerOrder> orders = {{WorkerId(1), {make0, make1}}, {WorkerId(2), {use0, use1}}};
  ASSERT_OK_AND_ASSIGN(MemoryProfile timed, PredictMemory(graph, orders, finish));
  EXPECT_EQ(Life(timed.workers[1], a1).first, 0);
  EXPECT_EQ(Host(timed.workers[1], 0), 400 + 400 + 4);  // a0, a1, b0
  EXPECT_EQ(timed.workers[1].total_peak, 400 + 400 + 4);
  // A producer ending after use0 sends a1 for use1.
  finish[make1.value() - 1] = 10.5;
  ASSERT_OK_AND_ASSIGN(MemoryProfile late, PredictMemory(graph, orders, finish));
  EXPECT_EQ(Life(late.workers[1], a1).first, 1);
  EXPECT_EQ(Host(late.workers[1], 0), 400 + 4);  // a0, b0
  // A time per task, or an error naming the count.
  finish.pop_back();
  const Result<MemoryProfile> short_times = PredictMemory(graph, orders, finish);
  EXPECT_EQ(short_times.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(short_times.status().message(), HasSubstr("3 finishing times for a graph of 4"));
}

TEST(MemoryModelTest, CollectiveMembersFinishTogetherOnEveryWorker) {
  Graph graph;
  std::vector<ObjectId> shards, fulls;
  for (int r = 0; r < 2; ++r) {
    shards.push_back(
        graph.AddObject(fmt::format("shard{}", r), Floats(10), ObjectRole::kParameter));
    fulls.push_back(
        graph.AddObject(fmt::format("full{}", r), Floats(20), ObjectRole::kGatheredParameter));
  }
  const ObjectId slow_in = graph.AddObject("slow_in", Floats(1), ObjectRole::kInput);
  const ObjectId slow = graph.AddObject("slow", Floats(1), ObjectRole::kActivation);
  const ObjectId slow2 = graph.AddObject("slow2", Floats(1), ObjectRole::kActivation);
  // Worker 1 does two tasks before its member is ready; worker 0's member waits for it.
  Add(graph, "w1.a", {slow_in}, {slow}, 0, 2);
  Add(graph, "w1.b", {slow}, {slow2}, 0, 2);
  for (int r = 0; r < 2; ++r) {
    TaskSpec spec;
    spec.name = fmt::format("gather{}", r);
    spec.op = "all_gather";
    spec.inputs = {shards[static_cast<size_t>(r)]};
    if (r == 1) spec.inputs.push_back(slow2);
    spec.outputs = {fulls[static_cast<size_t>(r)]};
    spec.pinned_worker = WorkerId(static_cast<uint64_t>(r + 1));
    spec.attrs.Set(kCollectiveAttr, int64_t{7});
    spec.attrs.Set(kRankAttr, int64_t{r});
    spec.attrs.Set(kGroupSizeAttr, int64_t{2});
    graph.AddTask(std::move(spec));
    graph.MarkOutput(fulls[static_cast<size_t>(r)]);
  }
  ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(graph));
  ASSERT_EQ(profile.workers.size(), 2u);
  // Workers in the order their first task appears: worker 2 (w1.a) first.
  EXPECT_THAT(Names(graph, profile.workers[0].order.tasks), ElementsAre("w1.a", "w1.b", "gather1"));
  EXPECT_THAT(Names(graph, profile.workers[1].order.tasks), ElementsAre("gather0"));
}

TEST(MemoryModelTest, AChannelRunsItsCollectivesInTheRuntimesOrder) {
  const Graph graph = ChannelOrderGraph();
  ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(graph));
  ASSERT_EQ(profile.workers.size(), 2u);
  // Worker 2 (first in the graph): 3 runs at once on its own channel; 2, ready as early, waits
  // on channel 0 for 1, whose member there waits for slow.a and slow.b.
  EXPECT_THAT(Names(graph, profile.workers[0].order.tasks),
              ElementsAre("gather3.1", "slow.a", "slow.b", "gather1.1", "gather2.1"));
  EXPECT_THAT(Names(graph, profile.workers[1].order.tasks),
              ElementsAre("gather3.0", "gather1.0", "gather2.0"));
}

TEST(MemoryModelTest, OrdersThatMissRepeatOrInvertTasksAreRefusedNamingTheTask) {
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(1), ObjectRole::kInput);
  const ObjectId a = graph.AddObject("a", Floats(1), ObjectRole::kActivation);
  const ObjectId b = graph.AddObject("b", Floats(1), ObjectRole::kOutput);
  const TaskId f = Add(graph, "f", {x}, {a});
  const TaskId g = Add(graph, "g", {a}, {b});
  graph.MarkOutput(b);
  EXPECT_THAT(PredictMemory(graph, {WorkerOrder{WorkerId(), {f}}}).status().message(),
              HasSubstr("g is in no worker's order"));
  EXPECT_THAT(PredictMemory(graph, {WorkerOrder{WorkerId(), {f, f, g}}}).status().message(),
              HasSubstr("f is ordered twice"));
  EXPECT_THAT(PredictMemory(graph, {WorkerOrder{WorkerId(), {g, f}}}).status().message(),
              HasSubstr("g is ordered before f"));
  EXPECT_OK(PredictMemory(graph, {WorkerOrder{WorkerId(), {f, g}}}).status());
}

TEST(MemoryModelTest, ExplainNamesThePeakItsTaskWhatIsLiveAndATimeline) {
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(25), ObjectRole::kInput);
  const ObjectId a = graph.AddObject("a", Floats(1 << 20), ObjectRole::kActivation);
  const ObjectId loss = graph.AddObject("loss", Floats(1), ObjectRole::kOutput);
  Add(graph, "f", {x}, {a});
  Add(graph, "h", {a}, {loss});
  graph.MarkOutput(loss);
  ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(graph));
  const std::string text = ExplainMemory(graph, profile);
  EXPECT_THAT(text, HasSubstr("host tier: peak 4.00 MiB while f (task 1 of 2) runs"));
  EXPECT_THAT(text, HasSubstr("activation 4.00 MiB"));
  EXPECT_THAT(text, HasSubstr("a 4.00 MiB"));
  EXPECT_THAT(text, HasSubstr("<- peak"));
}

// --- The prediction against the executor's own accounting ---

ExecutorOptions OneThread() {
  ExecutorOptions options;
  options.threads = 1;
  return options;
}

// Predicted and measured (the step's RoleMeter figures) for the step a trainer just took.
void ExpectPredictionMatches(Trainer& trainer, const StepReport& report, const std::string& what) {
  ASSERT_EQ(report.ranks.size(), 1u) << what;
  const RunFigures& measured = report.ranks[0].figures;
  ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(trainer.step_graph().graph));
  ASSERT_EQ(profile.workers.size(), 1u) << what;
  const WorkerMemory& predicted = profile.workers[0];
  for (size_t role = 0; role < kObjectRoles; ++role) {
    EXPECT_EQ(predicted.role_peaks[role], measured.peak(static_cast<ObjectRole>(role)))
        << what << ": " << ObjectRoleName(static_cast<ObjectRole>(role));
  }
  EXPECT_EQ(predicted.model_state_peak, measured.model_state_peak) << what;
  EXPECT_EQ(predicted.transient_peak, measured.transient_peak) << what;
  EXPECT_EQ(predicted.total_peak, measured.total_peak) << what;
  EXPECT_GT(measured.total_peak, 0) << what;
  // The kernels' scratch on top (OpDef::workspace against what each kernel allocated).
  EXPECT_EQ(predicted.total_with_scratch_peak, measured.total_with_scratch_peak) << what;
  EXPECT_GE(measured.total_with_scratch_peak, measured.total_peak) << what;
  EXPECT_EQ(predicted.peaks[static_cast<size_t>(MemoryTier::kHost)].bytes,
            measured.total_with_scratch_peak)
      << what;
}

TEST(MemoryModelTest, Gpt2StepsPeaksArePredictedExactlyOnAOneThreadExecutor) {
  const Gpt2Config config{2, 32, 4, 64, 16};
  std::vector<int32_t> tokens(size_t{4} * 16), targets(size_t{4} * 16);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>(i * 7 % 64);
    targets[i] = static_cast<int32_t>(i * 11 % 64);
  }
  // Split backwards (the zero-bubble halves) hold other scratch than whole ones.
  for (auto [micro_batches, split] :
       {std::pair{1, false}, std::pair{2, false}, std::pair{1, true}}) {
    TrainingPlan plan{.batch = 4, .seq_len = 16};
    plan.parallel.micro_batches = micro_batches;
    plan.parallel.split_backwards = split;
    ASSERT_OK_AND_ASSIGN(auto trainer, Trainer::Create(*BuildGpt2(config), plan, OneThread()));
    ASSERT_OK(trainer->InitializeParameters(1));
    for (int step = 0; step < 2; ++step) {
      ASSERT_OK_AND_ASSIGN(StepReport report, Gpt2Step(*trainer, tokens, targets, 1e-3f));
      const std::string what = fmt::format("gpt2, {} micro-batches{}, step {}", micro_batches,
                                           split ? ", split backwards" : "", step);
      ExpectPredictionMatches(*trainer, report, what);
      // A whole block backward's scratch (its stash, a [B,T,C] buffer) raises the peak.
      if (!split) {
        EXPECT_GT(report.ranks[0].figures.total_with_scratch_peak,
                  report.ranks[0].figures.total_peak)
            << what;
      }
    }
  }
}

TEST(MemoryModelTest, UNet3dStepsPeaksArePredictedExactlyOnAOneThreadExecutor) {
  const UNet3dConfig config = *UNet3dConfig::Preset("tiny");
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(config, CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(VolumeBatch made, GenerateVolumes(2, config.volume, config.in_channels, 3));
  const int64_t v = config.volume;
  const std::vector<Tensor> batch = {
      FloatTensor(Shape{2, config.in_channels, v, v, v}, made.volumes),
      IntTensor(Shape{2, v, v, v}, made.labels)};
  // The layer programs' scratch (their intermediates, gradient sums and zeros) in the whole
  // backward and in its two halves.
  for (bool split : {false, true}) {
    TrainingPlan plan;
    plan.batch = 2;
    plan.parallel.split_backwards = split;
    ASSERT_OK_AND_ASSIGN(auto trainer, Trainer::Create(model, plan, OneThread()));
    ASSERT_OK(trainer->InitializeParameters(1));
    ASSERT_OK_AND_ASSIGN(StepReport report, trainer->Step(batch, 1e-3f));
    ExpectPredictionMatches(*trainer, report, split ? "unet3d, split backwards" : "unet3d");
    EXPECT_GT(report.ranks[0].figures.total_with_scratch_peak, report.ranks[0].figures.total_peak);
  }
}

// --- Planning under a cap (planner/memory_plan.cc) ---

// A model's batches and how to take a step, for the capped-plan tests.
struct CappedCase {
  std::string name;
  ModelSpec model;
  TrainingPlan plan;
  std::vector<Tensor> batch;
};

CappedCase Gpt2Case() {
  const Gpt2Config config{8, 32, 4, 64, 16};
  std::vector<int32_t> tokens(size_t{4} * 16), targets(size_t{4} * 16);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>(i * 7 % 64);
    targets[i] = static_cast<int32_t>(i * 11 % 64);
  }
  CappedCase c{"gpt2 (8 blocks)", *BuildGpt2(config), TrainingPlan{.batch = 4, .seq_len = 16}, {}};
  c.batch = *Gpt2Batch(config, tokens, targets, 4, 16);
  return c;
}

CappedCase UNetCase() {
  const UNet3dConfig config = *UNet3dConfig::Preset("tiny");
  CappedCase c{"unet3d (tiny)", *BuildUNet3d(config, CpuRegistry()), TrainingPlan{.batch = 2}, {}};
  VolumeBatch made = *GenerateVolumes(2, config.volume, config.in_channels, 3);
  const int64_t v = config.volume;
  c.batch = {FloatTensor(Shape{2, config.in_channels, v, v, v}, made.volumes),
             IntTensor(Shape{2, v, v, v}, made.labels)};
  return c;
}

// Losses of `steps` steps of a plan, and the last step's measured figures.
struct Trained {
  std::vector<float> losses;
  RunFigures figures;
  MemoryDecision memory;
};

Trained Train(const CappedCase& c, const TrainingPlan& plan, int steps) {
  Trained trained;
  auto trainer = Trainer::Create(c.model, plan, OneThread());
  TESSERA_CHECK(trainer.ok(), "{}", trainer.status().ToString());
  TESSERA_CHECK((*trainer)->InitializeParameters(5).ok(), "init");
  for (int step = 0; step < steps; ++step) {
    Result<StepReport> report = (*trainer)->Step(c.batch, 1e-3f);
    TESSERA_CHECK(report.ok(), "{}", report.status().ToString());
    trained.losses.push_back(report->loss);
    trained.figures = report->ranks.at(0).figures;
  }
  trained.memory = (*trainer)->step_graph().memory;
  return trained;
}

CappedCase TwoMicroBatches(CappedCase c) {
  c.name += ", 2 micro-batches";
  c.plan.parallel.micro_batches = 2;
  return c;
}

// GPT-2 at half and a quarter of its activations, and at half and 15% with two micro-batches
// (run one after another, then recomputing); the U-Net at 70% and at half (its layers keeping
// only their convolutions' outputs: the layer programs' partial keep). A quarter is below what
// the U-Net's top decoder's backward alone needs (its inputs, incoming gradient and outgoing
// gradients): MemoryPlanTest.AUNetBelowItsLargestLayersBackwardSplitsItsBatch.
TEST(MemoryPlanTest, StepsWithAShareOfTheirActivationsFitAndTrainBitIdentically) {
  const std::vector<std::pair<CappedCase, std::vector<double>>> cases = {
      {Gpt2Case(), {0.5, 0.25}},
      {TwoMicroBatches(Gpt2Case()), {0.5, 0.15}},
      {UNetCase(), {0.7, 0.5}}};
  for (const auto& [c, budgets] : cases) {
    const Trained reference = Train(c, c.plan, 3);
    for (double budget : budgets) {
      const std::string what = fmt::format("{} with {}% of its activations", c.name, budget * 100);
      TrainingPlan capped = c.plan;
      capped.memory.activation_budget = budget;
      const Trained trained = Train(c, capped, 3);
      const MemoryDecision& memory = trained.memory;
      // Fits, as predicted, and the prediction is what the step measured.
      EXPECT_GT(memory.activation_cap_bytes, 0) << what;
      EXPECT_NEAR(static_cast<double>(memory.activation_cap_bytes),
                  budget * static_cast<double>(memory.uncapped_activation_peak_bytes), 1.0)
          << what;
      EXPECT_LE(memory.activation_peak_bytes, memory.activation_cap_bytes) << what;
      EXPECT_EQ(trained.figures.peak(ObjectRole::kActivation), memory.activation_peak_bytes)
          << what;
      // The peak counts the running kernel's scratch too (OpDef::workspace, measured by the
      // executor): the partial keeps' rebuilt values and the layer programs' intermediates.
      EXPECT_EQ(trained.figures.total_with_scratch_peak, memory.peak_bytes) << what;
      EXPECT_LT(memory.peak_bytes, memory.uncapped_peak_bytes) << what;
      const int kept = CountChoice(memory.activations, ActivationChoice::kKeep);
      if (c.plan.parallel.micro_batches > 1) {
        EXPECT_THAT(memory.reason, HasSubstr("micro-batches one after another")) << what;
      }
      if (c.plan.parallel.micro_batches == 1 || budget < 0.5) {
        EXPECT_LT(kept, static_cast<int>(c.model.layers.size())) << what << ": " << memory.reason;
      }
      // The transformer blocks offer partial keeps (their backward rebuilding layernorms, GELU
      // and attention): at half the activations, some are taken.
      if (c.name == "gpt2 (8 blocks)" && budget == 0.5) {
        EXPECT_GT(CountChoice(memory.activations, ActivationChoice::kKeepPart), 0)
            << what << ": " << memory.reason;
      }
      // The U-Net's layer programs offer to keep only what their convolutions make: at half,
      // some layers take it.
      if (c.name == "unet3d (tiny)" && budget == 0.5) {
        EXPECT_GT(CountChoice(memory.activations, ActivationChoice::kKeepPart) +
                      static_cast<int>(std::count_if(
                          memory.activations.begin(), memory.activations.end(),
                          [](const ActivationDecision& d) { return !d.rebuild.empty(); })),
                  0)
            << what << ": " << memory.reason;
      }
      // Recomputing runs the same kernels on the same inputs: the same losses, bit for bit.
      EXPECT_EQ(trained.losses, reference.losses) << what;
    }
  }
}

// Below what the U-Net's top decoder's backward needs (38-39% of its activations: its two
// inputs, the incoming gradient and the two outgoing ones), recomputing cannot fit; a micro-batch
// of half the rows holds half of every activation, so the plan splits the batch in two, run one
// after another: the same gradients but for the order of their sums (1e-6 relative), under the
// budget as predicted.
TEST(MemoryPlanTest, AUNetBelowItsLargestLayersBackwardSplitsItsBatch) {
  const CappedCase c = UNetCase();
  const Trained reference = Train(c, c.plan, 3);
  TrainingPlan capped = c.plan;
  capped.memory.activation_budget = 0.25;
  const Trained trained = Train(c, capped, 3);
  const MemoryDecision& memory = trained.memory;
  EXPECT_THAT(memory.reason, HasSubstr("each rank's batch split into 2 micro-batches of 1 rows"));
  EXPECT_NEAR(static_cast<double>(memory.activation_cap_bytes),
              0.25 * static_cast<double>(memory.uncapped_activation_peak_bytes), 1.0);
  EXPECT_LE(memory.activation_peak_bytes, memory.activation_cap_bytes) << memory.reason;
  EXPECT_EQ(trained.figures.peak(ObjectRole::kActivation), memory.activation_peak_bytes);
  EXPECT_EQ(trained.figures.total_with_scratch_peak, memory.peak_bytes);
  ASSERT_EQ(trained.losses.size(), reference.losses.size());
  for (size_t i = 0; i < trained.losses.size(); ++i) {
    EXPECT_NEAR(trained.losses[i], reference.losses[i], 1e-6 * std::abs(reference.losses[i]))
        << "step " << i + 1;
  }
}

// The plan search fixes the plan's dimensions (MemoryCaps::fixed_dimensions): the same plan is
// then refused, not changed into another one (the search plans two micro-batches as a candidate
// of its own), and its refusal plans no alternatives.
TEST(MemoryPlanTest, WithItsDimensionsFixedAPlanIsRefusedNotChanged) {
  const CappedCase c = UNetCase();
  TrainingPlan fixed = c.plan;
  fixed.memory.activation_budget = 0.25;
  fixed.memory.fixed_dimensions = true;
  Result<StepGraph> step = PlanTrainingStep(c.model, fixed, CpuRegistry());
  ASSERT_FALSE(step.ok());
  EXPECT_EQ(step.status().code(), StatusCode::kInfeasible);
  EXPECT_THAT(step.status().message(), HasSubstr("the activation budget needs to be at least"));
  EXPECT_THAT(step.status().message(), ::testing::Not(HasSubstr("plans that would fit")));
  EXPECT_THAT(step.status().message(), ::testing::Not(HasSubstr("micro-batches")));
}

// A batch of one row cannot be split: below the floor, the plan is refused with it.
TEST(MemoryPlanTest, AUNetBelowItsLargestLayersBackwardIsRefusedWithTheFloor) {
  CappedCase c = UNetCase();
  c.plan.batch = 1;
  c.plan.memory.activation_budget = 0.25;
  Result<StepGraph> step = PlanTrainingStep(c.model, c.plan, CpuRegistry());
  ASSERT_EQ(step.status().code(), StatusCode::kInfeasible) << step.status().ToString();
  EXPECT_THAT(step.status().message(),
              HasSubstr("recomputing every layer's activations (keeping the least part)"));
  EXPECT_THAT(step.status().message(), HasSubstr("the activation budget needs to be at least"));
}

TEST(MemoryPlanTest, AStepCappedOnItsTierFitsUnderTheCapAsMeasured) {
  CappedCase c = Gpt2Case();
  ASSERT_OK_AND_ASSIGN(StepGraph uncapped, PlanTrainingStep(c.model, c.plan, CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(uncapped.graph));
  // The tier's peak: the step's objects and the running kernel's scratch.
  const int64_t peak = profile.workers[0].peaks[static_cast<size_t>(MemoryTier::kHost)].bytes;
  EXPECT_GT(peak, profile.workers[0].total_peak);
  c.plan.memory.host_bytes = peak * 17 / 20;
  const Trained trained = Train(c, c.plan, 2);
  EXPECT_LE(trained.figures.total_with_scratch_peak, c.plan.memory.host_bytes)
      << trained.memory.reason;
  EXPECT_EQ(trained.figures.total_with_scratch_peak, trained.memory.peak_bytes);
  EXPECT_EQ(trained.memory.uncapped_peak_bytes, peak);
  EXPECT_THAT(trained.memory.reason, HasSubstr("recompute"));
}

// The plan's host cap is the executor's allocator's (on CPU workers the tier they compute in):
// a step under it runs with the allocator's own peak under it too, and memory that something
// else takes from the same allocator meanwhile makes the next step fail with the cap named,
// before the optimizer touched anything (the step can be retried: the same losses after).
TEST(MemoryPlanTest, TheAllocatorHoldsAStepUnderThePlansHostCap) {
  CappedCase c = Gpt2Case();
  ASSERT_OK_AND_ASSIGN(StepGraph uncapped, PlanTrainingStep(c.model, c.plan, CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(uncapped.graph));
  const int64_t peak = profile.workers[0].peaks[static_cast<size_t>(MemoryTier::kHost)].bytes;
  c.plan.memory.host_bytes = peak * 17 / 20;
  const Trained reference = Train(c, c.plan, 3);

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<GraphBackend> backend, MakeInProcessBackend(OneThread()));
  const std::shared_ptr<Allocator> allocator = backend->allocator();
  ASSERT_OK_AND_ASSIGN(auto trainer, Trainer::Create(c.model, c.plan, std::move(backend)));
  EXPECT_EQ(allocator->cap(), c.plan.memory.host_bytes);
  ASSERT_OK(trainer->InitializeParameters(5));
  ASSERT_OK_AND_ASSIGN(StepReport first, trainer->Step(c.batch, 1e-3f));
  EXPECT_EQ(first.loss, reference.losses[0]);
  EXPECT_LE(first.ranks.at(0).figures.allocator_peak, c.plan.memory.host_bytes);
  EXPECT_LE(allocator->stats().peak_bytes, c.plan.memory.host_bytes);

  // Something else in the process takes what the cap leaves: all of it (the batch's upload is
  // refused), or all but the batch and a little (the forward's first outputs are).
  int64_t batch_bytes = 0;
  for (const Tensor& input : c.batch) batch_bytes += input.bytes();
  for (const int64_t leave : {int64_t{0}, batch_bytes + 1024}) {
    const int64_t room = c.plan.memory.host_bytes - allocator->stats().live_bytes - leave;
    ASSERT_GT(room, 0);
    ASSERT_OK_AND_ASSIGN(Tensor hog,
                         Tensor::Empty({Shape{room / 4}, DType::kF32, Device::Cpu()}, allocator));
    const Result<StepReport> refused = trainer->Step(c.batch, 1e-3f);
    ASSERT_FALSE(refused.ok()) << "leaving " << leave;
    EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted)
        << refused.status().ToString();
    EXPECT_THAT(refused.status().message(), HasSubstr("would pass its cap"));
    EXPECT_THAT(refused.status().message(), HasSubstr("--host-memory-gib"));
    EXPECT_THAT(refused.status().message(),
                HasSubstr(leave == 0 ? "uploading a batch's rows" : "task '"));
    EXPECT_LE(allocator->stats().peak_bytes, c.plan.memory.host_bytes);
  }
  // Nothing was updated: the next step is the uninterrupted run's second.
  ASSERT_OK_AND_ASSIGN(StepReport second, trainer->Step(c.batch, 1e-3f));
  EXPECT_EQ(second.loss, reference.losses[1]);
}

TEST(MemoryPlanTest, APlanThatFitsUncappedIsLeftAsItIs) {
  CappedCase c = Gpt2Case();
  ASSERT_OK_AND_ASSIGN(StepGraph uncapped, PlanTrainingStep(c.model, c.plan, CpuRegistry()));
  c.plan.memory.host_bytes = int64_t{1} << 40;
  ASSERT_OK_AND_ASSIGN(StepGraph capped, PlanTrainingStep(c.model, c.plan, CpuRegistry()));
  EXPECT_EQ(capped.graph.num_tasks(), uncapped.graph.num_tasks());
  EXPECT_TRUE(capped.memory.activations.empty());
  EXPECT_THAT(capped.memory.reason, HasSubstr("every activation kept"));
}

TEST(MemoryPlanTest, ACapNothingFitsUnderIsRefusedWithTheFiguresAndWhatToChange) {
  CappedCase c = Gpt2Case();
  c.plan.memory.host_bytes = 1 << 20;  // 1 MiB: less than the model state
  Result<StepGraph> step = PlanTrainingStep(c.model, c.plan, CpuRegistry());
  EXPECT_EQ(step.status().code(), StatusCode::kInfeasible);
  EXPECT_THAT(step.status().message(), HasSubstr("on the host tier of a worker"));
  EXPECT_THAT(step.status().message(), HasSubstr("--host-memory-gib caps it at 1.00 MiB"));
  EXPECT_THAT(step.status().message(), HasSubstr("recomputing every layer's activations"));
  EXPECT_THAT(step.status().message(), HasSubstr("--host-memory-gib needs to be at least"));
  // A cap just below the least the plan fits under (found by bisection between 1 MiB and what
  // recomputing every whole layer needs), which one more worker with ZeRO-3 would meet, says so.
  TrainingPlan naive = Gpt2Case().plan;
  naive.memory.recompute_all = true;
  ASSERT_OK_AND_ASSIGN(StepGraph all_recomputed, PlanTrainingStep(c.model, naive, CpuRegistry()));
  TrainingPlan tight = Gpt2Case().plan;
  int64_t refused_cap = 1 << 20, fitting_cap = all_recomputed.memory.peak_bytes;
  while (fitting_cap - refused_cap > 1) {
    tight.memory.host_bytes = refused_cap + (fitting_cap - refused_cap) / 2;
    (PlanTrainingStep(c.model, tight, CpuRegistry()).ok() ? fitting_cap : refused_cap) =
        tight.memory.host_bytes;
  }
  tight.memory.host_bytes = refused_cap;
  Result<StepGraph> refused = PlanTrainingStep(c.model, tight, CpuRegistry());
  EXPECT_EQ(refused.status().code(), StatusCode::kInfeasible);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("plans that would fit, cheapest first: --workers 2 --zero-stage 3"));
}

// Split backwards under a cap they exceed: every layer's backward runs whole first (what a layer
// saves no longer waits for a deferred weight half), then the layers kept whole get their halves
// back while the plan fits. With room for all but one layer's halves, some stay split; at half
// the activations, the plan recomputes with every backward whole. The losses are the uncapped
// plan's, bit for bit (the halves compute what the whole backward does), and the peaks are as
// predicted.
TEST(MemoryPlanTest, SplitBackwardsUnderACapRunWholeWhereTheCapNeedsIt) {
  CappedCase c = Gpt2Case();
  c.plan.parallel.split_backwards = true;
  const Trained reference = Train(c, c.plan, 2);
  ASSERT_OK_AND_ASSIGN(StepGraph uncapped, PlanTrainingStep(c.model, c.plan, CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(uncapped.graph));
  const int64_t peak = profile.workers[0].peaks[static_cast<size_t>(MemoryTier::kHost)].bytes;
  for (const auto& [cap, budget] : {std::pair{peak - 1, 0.0}, std::pair{int64_t{0}, 0.5}}) {
    TrainingPlan capped = c.plan;
    capped.memory.host_bytes = cap;
    capped.memory.activation_budget = budget;
    const std::string what = fmt::format("cap {} bytes, budget {}", cap, budget);
    const Trained trained = Train(c, capped, 2);
    const MemoryDecision& memory = trained.memory;
    EXPECT_THAT(memory.reason, HasSubstr("layers' backwards run whole")) << what;
    const auto whole = std::count_if(memory.activations.begin(), memory.activations.end(),
                                     [](const ActivationDecision& d) { return d.whole_backward; });
    EXPECT_GT(whole, 0) << what << ": " << memory.reason;
    if (cap > 0) {
      EXPECT_LT(whole, static_cast<int64_t>(c.model.layers.size())) << memory.reason;
      EXPECT_LE(trained.figures.total_with_scratch_peak, cap) << memory.reason;
    } else {
      EXPECT_LE(memory.activation_peak_bytes, memory.activation_cap_bytes) << memory.reason;
      EXPECT_EQ(trained.figures.peak(ObjectRole::kActivation), memory.activation_peak_bytes);
    }
    EXPECT_EQ(trained.figures.total_with_scratch_peak, memory.peak_bytes) << what;
    EXPECT_EQ(trained.losses, reference.losses) << what;
  }
}

// Gpt2Case on the simulated GPU (f32 activations, the CPU kernels); sets TESSERA_SIMULATED_GPU,
// which the test unsets when done.
CappedCase SimulatedGpuGpt2Case() {
  ::setenv("TESSERA_SIMULATED_GPU", "1", 1);
  CappedCase c = Gpt2Case();
  Gpt2Config config{8, 32, 4, 64, 16};
  config.activations = GpuActivations();
  c.model = *BuildGpt2(config);
  c.plan.device = Device::Cuda(0);
  return c;
}

// Harmony's way, on the simulated GPU: given the host link's bandwidth and measured layer times
// (under which the copies hide), the plan swaps what layers save to the host and prefetches it
// back instead of recomputing; the losses are the uncapped ones bit for bit, the measured
// peaks are the predicted ones, and the device holds no more activations than the budget.
TEST(MemoryPlanTest, OnTheSimulatedGpuSavedActivationsAreSwappedToTheHostAndBack) {
  CappedCase c = SimulatedGpuGpt2Case();
  ExecutorOptions options;
  options.threads = 1;
  ASSERT_OK_AND_ASSIGN(options.device, OpenGpu(0));
  auto train = [&](const TrainingPlan& plan, RunFigures& figures, StepGraph& step) {
    auto trainer = Trainer::Create(c.model, plan, options);
    TESSERA_CHECK(trainer.ok(), "{}", trainer.status().ToString());
    TESSERA_CHECK((*trainer)->InitializeParameters(5).ok(), "init");
    std::vector<float> losses;
    for (int i = 0; i < 3; ++i) {
      Result<StepReport> report = (*trainer)->Step(c.batch, 1e-3f);
      TESSERA_CHECK(report.ok(), "{}", report.status().ToString());
      losses.push_back(report->loss);
      figures = report->ranks.at(0).figures;
    }
    step = (*trainer)->step_graph();
    return losses;
  };
  RunFigures uncapped_figures, figures;
  StepGraph uncapped_step, step;
  const std::vector<float> reference = train(c.plan, uncapped_figures, uncapped_step);
  TrainingPlan capped = c.plan;
  capped.memory.activation_budget = 0.5;
  capped.memory.host_link_bytes_per_us = 1e6;  // copies far shorter than a layer's 0.1 ms
  capped.parallel.layer_op_costs.assign(c.model.layers.size(), OpCosts{0.1, 0.2, 0});
  const std::vector<float> losses = train(capped, figures, step);
  ::unsetenv("TESSERA_SIMULATED_GPU");
  const MemoryDecision& memory = step.memory;
  EXPECT_GT(CountChoice(memory.activations, ActivationChoice::kSwap), 0) << memory.reason;
  EXPECT_EQ(CountChoice(memory.activations, ActivationChoice::kRecompute), 0) << memory.reason;
  int swap_outs = 0, swap_ins = 0;
  for (const TaskSpec& task : step.graph.tasks()) {
    if (task.name.find("/swap_out") != std::string::npos) ++swap_outs;
    if (task.name.find("/swap_in") != std::string::npos) ++swap_ins;
  }
  EXPECT_GT(swap_outs, 0);
  EXPECT_EQ(swap_outs, swap_ins);
  EXPECT_EQ(losses, reference);
  EXPECT_LE(memory.activation_peak_bytes, memory.activation_cap_bytes) << memory.reason;
  ASSERT_OK_AND_ASSIGN(MemoryProfile predicted, PredictMemory(step.graph));
  EXPECT_EQ(figures.total_peak, predicted.workers[0].total_peak);
  EXPECT_EQ(figures.peak(ObjectRole::kActivation),
            predicted.workers[0].role_peaks[static_cast<size_t>(ObjectRole::kActivation)]);
  EXPECT_LT(memory.peak_bytes, memory.uncapped_peak_bytes);
}

// ZeRO-Infinity's next tier down, on a CPU worker: with a swap file and its link's bandwidth (and
// measured layer times, under which the copies hide), the plan swaps what layers save to the disk
// and reads it back ahead of each backward instead of recomputing; at a quarter, where a whole
// block's saved objects do not fit beside the next forward's, it swaps the part a partial keep
// saves and the backward rebuilds the rest. The losses are the uncapped ones bit for bit; the
// host holds no more than the predicted peak (within the 3%) and no more activations than
// the budget, and the swap file's measured peak is the plan's disk tier exactly. The copies run
// on the I/O thread beside the compute: on layers this small the drive is slower than the
// compute, so a prefetch lands later than the model's order has it (the measured peak is then
// lower), and on a loaded machine two ready tasks may swap places (a few scalars more, seen: 28
// bytes); bench_memory compares the two at real sizes, where they agree to the byte. Without a
// swap file the same plan fails at its first swap, naming --swap-dir.
TEST(MemoryPlanTest, OnACpuWorkerSavedActivationsAreSwappedToTheDiskAndBack) {
  const CappedCase c = Gpt2Case();
  const Trained reference = Train(c, c.plan, 3);
  for (const double budget : {0.5, 0.25}) {
    SCOPED_TRACE(fmt::format("activation budget {}", budget));
    const std::string dir = TempPath("tessera_memory_plan_swap");
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    ASSERT_OK_AND_ASSIGN(std::shared_ptr<DeviceRuntime> disk, OpenSwapFile({dir}));
    ExecutorOptions options = OneThread();
    options.disk = disk;
    TrainingPlan capped = c.plan;
    capped.memory.activation_budget = budget;
    capped.memory.disk_link_bytes_per_us = 1e6;  // copies far shorter than a layer's 0.1 ms
    capped.parallel.layer_op_costs.assign(c.model.layers.size(), OpCosts{0.1, 0.2, 0});

    auto trainer = Trainer::Create(c.model, capped, options);
    ASSERT_OK(trainer.status());
    ASSERT_OK((*trainer)->InitializeParameters(5));
    std::vector<float> losses;
    RunFigures figures;
    for (int i = 0; i < 3; ++i) {
      ASSERT_OK_AND_ASSIGN(StepReport report, (*trainer)->Step(c.batch, 1e-3f));
      losses.push_back(report.loss);
      figures = report.ranks.at(0).figures;
    }
    const StepGraph& step = (*trainer)->step_graph();
    const MemoryDecision& memory = step.memory;
    int swapped_whole = 0, swapped_part = 0;
    for (const ActivationDecision& decision : memory.activations) {
      if (decision.choice != ActivationChoice::kSwap) continue;
      ++(decision.rebuild.empty() ? swapped_whole : swapped_part);
    }
    EXPECT_GT(swapped_whole + swapped_part, 0) << memory.reason;
    if (budget < 0.5) {
      EXPECT_GT(swapped_part, 0) << memory.reason;
    }
    EXPECT_EQ(CountChoice(memory.activations, ActivationChoice::kRecompute), 0) << memory.reason;
    int swap_outs = 0, swap_ins = 0;
    for (const TaskSpec& task : step.graph.tasks()) {
      const bool out = task.name.find("/swap_out") != std::string::npos;
      swap_outs += out;
      swap_ins += task.name.find("/swap_in") != std::string::npos;
      if (out) {
        EXPECT_EQ(step.graph.object(task.outputs[0]).meta.device, Device::Disk());
      }
    }
    EXPECT_GT(swap_outs, 0);
    EXPECT_EQ(swap_outs, swap_ins);
    EXPECT_EQ(losses, reference.losses);
    EXPECT_LE(memory.activation_peak_bytes, memory.activation_cap_bytes) << memory.reason;
    ASSERT_OK_AND_ASSIGN(MemoryProfile predicted, PredictMemory(step.graph));
    const WorkerMemory& worker = predicted.workers[0];
    EXPECT_LE(static_cast<double>(figures.total_peak),
              1.03 * static_cast<double>(worker.total_peak));
    EXPECT_LE(figures.peak(ObjectRole::kActivation), memory.activation_cap_bytes);
    EXPECT_LT(figures.peak(ObjectRole::kActivation),
              reference.figures.peak(ObjectRole::kActivation));
    EXPECT_EQ(memory.peak_bytes, worker.peaks[static_cast<size_t>(MemoryTier::kHost)].bytes);
    const int64_t disk_peak = worker.peaks[static_cast<size_t>(MemoryTier::kDisk)].bytes;
    EXPECT_GT(disk_peak, 0);
    EXPECT_EQ(disk->memory().peak_bytes, disk_peak);
    EXPECT_EQ(disk->memory().live_bytes, 0);
    EXPECT_GT(worker.tier_copy_bytes, 0);

    auto without = Trainer::Create(c.model, capped, OneThread());
    ASSERT_OK(without.status());
    ASSERT_OK((*without)->InitializeParameters(5));
    Result<StepReport> refused = (*without)->Step(c.batch, 1e-3f);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("--swap-dir"), std::string::npos)
        << refused.status().ToString();
  }
}

// Harmony's case in miniature, on the simulated GPU: the model states (fp32 parameters,
// gradients and Adam's two moments, 16 bytes a parameter) are three times the device's memory,
// which the device allocator enforces. The memory plan moves the parameters to the host (nothing
// fits otherwise): each layer's come up before its forward and its backward and go after, its
// gradient goes down as it completes, and the update runs on the host. The step trains with the
// losses of the uncapped plan bit for bit, the device's measured peak is under the cap and within
// 3% of the prediction, and what the step copies between tiers is what the plan says.
// A run of three steps on a fresh simulated GPU whose allocator is capped at `device_cap` (0:
// uncapped): the losses, the plan, the device's peak and what the last step's copies between
// tiers moved (its trace).
struct SimulatedGpuRun {
  std::vector<float> losses;
  StepGraph step;
  int64_t device_peak = 0;
  int64_t copied = 0;
};

SimulatedGpuRun TrainOnSimulatedGpu(const CappedCase& c, const TrainingPlan& plan,
                                    int64_t device_cap) {
  ExecutorOptions options;
  options.threads = 1;
  Result<std::shared_ptr<DeviceRuntime>> gpu = OpenGpu(0, device_cap);
  TESSERA_CHECK(gpu.ok(), "{}", gpu.status().ToString());
  options.device = *gpu;
  SimulatedGpuRun run;
  auto trainer = Trainer::Create(c.model, plan, options);
  TESSERA_CHECK(trainer.ok(), "{}", trainer.status().ToString());
  TESSERA_CHECK((*trainer)->InitializeParameters(5).ok(), "init");
  for (int i = 0; i < 3; ++i) {
    Result<StepReport> report = (*trainer)->Step(c.batch, 1e-3f);
    TESSERA_CHECK(report.ok(), "{}", report.status().ToString());
    run.losses.push_back(report->loss);
  }
  run.device_peak = options.device->memory().peak_bytes;
  Result<Timeline> timeline = (*trainer)->StepTimeline(1);
  TESSERA_CHECK(timeline.ok(), "{}", timeline.status().ToString());
  for (const TimelineSpan& span : timeline->spans) {
    if (span.kind == SpanKind::kTransfer) run.copied += span.bytes;
  }
  run.step = (*trainer)->step_graph();
  return run;
}

// The device's peak as measured under the cap and within 3% of the prediction; the bytes copied
// between tiers the plan's within 2%. Returns the plan's.
int64_t ExpectDeviceAndCopiesAsPredicted(const SimulatedGpuRun& run, int64_t cap) {
  Result<MemoryProfile> predicted = PredictMemory(run.step.graph);
  EXPECT_TRUE(predicted.ok()) << predicted.status().ToString();
  if (!predicted.ok()) return 0;
  const int64_t device_peak =
      predicted->workers[0].peaks[static_cast<size_t>(MemoryTier::kDevice)].bytes;
  EXPECT_LE(run.device_peak, cap);
  EXPECT_NEAR(static_cast<double>(run.device_peak), static_cast<double>(device_peak),
              0.03 * static_cast<double>(device_peak));
  const int64_t planned = predicted->workers[0].tier_copy_bytes;
  EXPECT_NEAR(static_cast<double>(run.copied), static_cast<double>(planned),
              0.02 * static_cast<double>(planned));
  return planned;
}

TEST(MemoryPlanTest, OnTheSimulatedGpuModelStatesThreeTimesTheDeviceTrainStreamedFromTheHost) {
  CappedCase c = SimulatedGpuGpt2Case();
  const int64_t states = 16 * c.model.NumParameters();
  const int64_t cap = states / 3;
  const SimulatedGpuRun reference = TrainOnSimulatedGpu(c, c.plan, 0);
  TrainingPlan capped = c.plan;
  capped.memory.device_bytes = cap;
  const SimulatedGpuRun streamed = TrainOnSimulatedGpu(c, capped, cap);
  ::unsetenv("TESSERA_SIMULATED_GPU");
  const MemoryDecision& memory = streamed.step.memory;
  EXPECT_EQ(streamed.step.parallel.offload, OffloadMode::kParameters) << memory.reason;
  EXPECT_THAT(memory.reason, HasSubstr("--offload parameters")) << memory.reason;
  // Every layer's parameters live on the host and the device reads copies made for each use.
  for (const StateObject& object : streamed.step.state) {
    EXPECT_TRUE(streamed.step.graph.object(object.input).meta.device.is_cpu())
        << streamed.step.graph.object(object.input).name;
  }
  int uploads = 0;
  for (const TaskSpec& task : streamed.step.graph.tasks()) {
    uploads += task.name.find("/upload_") != std::string::npos;
  }
  EXPECT_GE(uploads, 2 * 8) << "every block's parameters up for its forward and its backward";
  EXPECT_EQ(streamed.losses, reference.losses);
  // Under the cap (the allocator enforces it: the step would have failed) and as predicted.
  const int64_t planned = ExpectDeviceAndCopiesAsPredicted(streamed, cap);
  EXPECT_GT(reference.device_peak, 3 * streamed.device_peak) << "the uncapped plan holds it all";
  // About 12 bytes a parameter: up for the forward and the backward, the gradient down (the
  // head's own come up once, its backward following its forward; the embedding's backward
  // reads none, and the head's tied read brings them up again).
  const double twelve = 12.0 * static_cast<double>(c.model.NumParameters());
  EXPECT_NEAR(static_cast<double>(planned), twelve, 0.01 * twelve);
}

// Nearer the model state (90% of it), some layers' parameters can stay on the device without
// recomputing more: the plan keeps the largest that do there (ZeRO-Offload's placement for
// them) and streams the rest, copying less than streaming all; the step is the uncapped one's
// bit for bit, under the cap as predicted.
TEST(MemoryPlanTest, NearerTheStateTheLargestLayersParametersStayOnTheDevice) {
  CappedCase c = SimulatedGpuGpt2Case();
  const int64_t states = 16 * c.model.NumParameters();
  const SimulatedGpuRun reference = TrainOnSimulatedGpu(c, c.plan, 0);
  TrainingPlan capped = c.plan;
  capped.memory.device_bytes = states * 9 / 10;
  const SimulatedGpuRun mixed = TrainOnSimulatedGpu(c, capped, capped.memory.device_bytes);
  TrainingPlan all_streamed = c.plan;
  all_streamed.parallel.offload = OffloadMode::kParameters;
  ASSERT_OK_AND_ASSIGN(StepGraph streamed, PlanTrainingStep(c.model, all_streamed, CpuRegistry()));
  ::unsetenv("TESSERA_SIMULATED_GPU");
  const std::vector<bool>& resident = mixed.step.parallel.resident_params;
  const auto kept = std::count(resident.begin(), resident.end(), true);
  EXPECT_GT(kept, 0) << mixed.step.memory.reason;
  EXPECT_LT(kept, 10) << mixed.step.memory.reason;
  EXPECT_THAT(mixed.step.memory.reason, HasSubstr(fmt::format("the other {} stay", kept)));
  EXPECT_EQ(mixed.step.memory.activation_overhead, 0) << "no layer recomputed or kept in part";
  // A resident layer's parameters are on the device, with a host master copy; a streamed one's
  // on the host, without.
  for (const StateObject& object : mixed.step.state) {
    if (object.kind != StateKind::kParameter && object.kind != StateKind::kMasterParameter) {
      continue;
    }
    const bool on_host = mixed.step.graph.object(object.input).meta.device.is_cpu();
    const bool stays = resident.at(object.piece.layer);
    EXPECT_EQ(on_host, object.kind == StateKind::kMasterParameter || !stays)
        << mixed.step.graph.object(object.input).name;
  }
  EXPECT_EQ(mixed.losses, reference.losses);
  const int64_t planned = ExpectDeviceAndCopiesAsPredicted(mixed, capped.memory.device_bytes);
  ASSERT_OK_AND_ASSIGN(MemoryProfile all, PredictMemory(streamed.graph));
  EXPECT_LT(planned, all.workers[0].tier_copy_bytes);
}

// Over a slow host link (1 MB/s, given with measured layer times of 0.1 / 0.2 ms), a streamed
// layer's uploads would keep the step waiting far longer than recomputing takes: at 70% of the
// model state, where streaming every layer fits without recomputing less, the plan keeps layers
// resident and recomputes to make room, which it does not without the link; the step is the
// uncapped one's bit for bit, under the cap.
TEST(MemoryPlanTest, OverASlowLinkLayersStayResidentAndRecomputeInstead) {
  CappedCase c = SimulatedGpuGpt2Case();
  const int64_t states = 16 * c.model.NumParameters();
  TrainingPlan capped = c.plan;
  capped.memory.device_bytes = states * 7 / 10;
  capped.parallel.layer_op_costs.assign(c.model.layers.size(), OpCosts{0.1, 0.2, 0});
  ASSERT_OK_AND_ASSIGN(StepGraph fast, PlanTrainingStep(c.model, capped, CpuRegistry()));
  capped.memory.host_link_bytes_per_us = 1;
  const SimulatedGpuRun slow = TrainOnSimulatedGpu(c, capped, capped.memory.device_bytes);
  const SimulatedGpuRun reference = TrainOnSimulatedGpu(c, c.plan, 0);
  ::unsetenv("TESSERA_SIMULATED_GPU");
  const auto resident = [](const StepGraph& step) {
    return std::count(step.parallel.resident_params.begin(), step.parallel.resident_params.end(),
                      true);
  };
  EXPECT_EQ(fast.parallel.offload, OffloadMode::kParameters) << fast.memory.reason;
  EXPECT_EQ(slow.step.parallel.offload, OffloadMode::kParameters) << slow.step.memory.reason;
  EXPECT_GT(resident(slow.step), resident(fast)) << slow.step.memory.reason;
  EXPECT_GT(slow.step.memory.activation_overhead, fast.memory.activation_overhead);
  EXPECT_EQ(slow.losses, reference.losses);
  ExpectDeviceAndCopiesAsPredicted(slow, capped.memory.device_bytes);
}

}  // namespace
}  // namespace tessera::testing

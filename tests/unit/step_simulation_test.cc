// The step simulation (planner/step_simulation.h) against references: one worker's step is its
// busy time (PredictStepTime's figure); a pipeline's layer tasks with the schedule's op costs end
// when SimulateSchedule's makespan says; a collective takes the link's latency and its ring
// traffic over the bandwidth; each worker's compute, bubble, communication and swap add up to its
// end. (Against measured steps: bench_plan_search.)
#include "planner/step_simulation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/collective_task.h"
#include "core/exchange_layout.h"
#include "model/gpt2.h"
#include "model/unet3d.h"
#include "planner/step_graph.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

// Eight layers: embedding, h.0 .. h.5, head (only the blocks split their backward).
ModelSpec SixBlocks() { return *BuildGpt2(Gpt2Config{6, 32, 4, 64, 16}); }

TrainingPlan Plan(int stages, int ranks, int micro, PipelineSchedule schedule,
                  int virtual_stages = 1) {
  TrainingPlan plan;
  plan.batch = int64_t{2} * ranks * micro;
  plan.seq_len = 16;
  plan.parallel.pipeline_stages = stages;
  plan.parallel.data_parallel = ranks;
  plan.parallel.micro_batches = micro;
  plan.parallel.schedule = schedule;
  plan.parallel.virtual_stages = virtual_stages;
  plan.parallel.layer_costs.assign(8, 1.0);  // equal layers: equal chunks
  for (int w = 0; w < stages * ranks; ++w) plan.parallel.workers.push_back(WorkerId(100 + w));
  return plan;
}

// Layer tasks: 1 ms a forward, 2 a whole backward, 1 each half; everything else free.
std::vector<TaskTime> LayerTimesOnly(const StepGraph& step, const ModelSpec& model) {
  std::vector<TaskTime> times;
  for (const TaskSpec& task : step.graph.tasks()) {
    TaskTime& time = times.emplace_back();
    Result<const LayerSpec*> layer = model.FindLayer(task.layer);
    if (!layer.ok() || task.layer.empty()) continue;
    const LayerSpec& spec = **layer;
    if (task.op == spec.forward_op) time.ms = 1;
    if (task.op == spec.backward_op) time.ms = 2;
    if (task.op == spec.backward_input_op || task.op == spec.backward_weight_op) time.ms = 1;
    time.layer = time.ms > 0;
  }
  return times;
}

// The tiny U-Net split into four slabs of each volume, and a plan of one volume over four
// workers so split.
Result<ModelSpec> TinyUNetInFourSlabs() {
  TESSERA_ASSIGN_OR_RETURN(ModelSpec unet,
                           BuildUNet3d(*UNet3dConfig::Preset("tiny"), CpuRegistry()));
  return unet.PlannedFor(1, 4, false, SequenceAttention::kHalo);
}
TrainingPlan OneVolumeInFourSlabs() {
  TrainingPlan plan;
  plan.batch = 2;
  plan.parallel.data_parallel = 4;
  plan.parallel.sequence_parallel = 4;
  plan.parallel.sequence_attention = SequenceAttention::kHalo;
  for (int r = 0; r < 4; ++r) plan.parallel.workers.push_back(WorkerId(10 + r));
  return plan;
}

void ExpectPartsAddUp(const SimulatedStep& simulated) {
  for (const SimulatedWorker& w : simulated.workers) {
    EXPECT_NEAR(w.compute_ms + w.bubble_ms + w.communication_ms + w.swap_ms, w.end_ms, 1e-9)
        << w.worker.ToString();
  }
}

TEST(StepSimulationTest, OneWorkersStepIsItsBusyTime) {
  const ModelSpec model = SixBlocks();
  TrainingPlan plan{.batch = 4, .seq_len = 16};
  plan.parallel.micro_batches = 2;
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  const std::vector<OpCosts> layer_ms(model.layers.size(), OpCosts{1, 1.5, 0.5});
  ASSERT_OK_AND_ASSIGN(std::vector<TaskTime> times,
                       EstimateTaskTimes(step.graph, model, layer_ms, CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(StepTimePrediction busy,
                       PredictStepTime(step.graph, model, layer_ms, CpuRegistry(), 0.25));
  ASSERT_OK_AND_ASSIGN(SimulatedStep simulated, SimulateStep(step.graph, times, {}, 0.25));
  ASSERT_EQ(simulated.workers.size(), 1u);
  EXPECT_NEAR(simulated.step_ms, busy.step_ms, 1e-9);
  EXPECT_NEAR(simulated.workers[0].compute_ms, busy.step_ms, 1e-9);
  EXPECT_EQ(simulated.workers[0].bubble_ms, 0);
  EXPECT_EQ(simulated.bottleneck, Bottleneck::kCompute);
  // Every task ran once, one after another, each after what it reads.
  for (const TaskSpec& task : step.graph.tasks()) {
    const size_t t = task.id.value() - 1;
    EXPECT_GE(simulated.end_ms[t], simulated.start_ms[t]);
    for (ObjectId input : task.inputs) {
      const TaskId producer = step.graph.object(input).producer;
      if (producer.valid()) {
        EXPECT_LE(simulated.end_ms[producer.value() - 1], simulated.start_ms[t]) << task.name;
      }
    }
  }
}

TEST(StepSimulationTest, APipelinesLayerTasksEndWhenTheScheduleSimulationSays) {
  const ModelSpec model = SixBlocks();
  struct Case {
    PipelineSchedule schedule;
    int stages, micro, virtual_stages;
  };
  for (const Case& c :
       {Case{PipelineSchedule::kGPipe, 2, 4, 1}, Case{PipelineSchedule::k1F1B, 2, 4, 1},
        Case{PipelineSchedule::k1F1B, 4, 6, 1}, Case{PipelineSchedule::kInterleaved, 2, 4, 2},
        Case{PipelineSchedule::kZbH1, 2, 4, 1}}) {
    SCOPED_TRACE(fmt::format("{} P={} M={} V={}", ScheduleName(c.schedule), c.stages, c.micro,
                             c.virtual_stages));
    const TrainingPlan plan = Plan(c.stages, 1, c.micro, c.schedule, c.virtual_stages);
    ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
    // Each stage holds as many layers, each 1 ms forward; whole backwards 2 ms, split ones (the
    // blocks, under zb-h1) 1 + 1, the ends' (embedding, head: one per end stage) whole.
    // SimulateSchedule takes a stage's costs (a chunk's are 1/V of them).
    const double layers = 8.0 / c.stages;
    OpCosts chunk{layers, 2 * layers, 0};
    if (SplitsBackward(c.schedule)) chunk = OpCosts{layers, layers + 1, layers - 1};
    ASSERT_OK_AND_ASSIGN(
        ScheduleSimulation reference,
        SimulateSchedule(step.schedule_order, c.stages, c.virtual_stages, c.micro, chunk));
    ASSERT_OK_AND_ASSIGN(SimulatedStep simulated,
                         SimulateStep(step.graph, LayerTimesOnly(step, model), {}));
    EXPECT_NEAR(simulated.step_ms, reference.makespan, 1e-9);
    ExpectPartsAddUp(simulated);
    // Idle time is bubble; no transfer is timed.
    const SimulatedWorker& critical = simulated.workers[simulated.critical];
    EXPECT_EQ(critical.communication_ms, 0);
    EXPECT_NEAR(critical.compute_ms + critical.bubble_ms, reference.makespan, 1e-9);
  }
}

TEST(StepSimulationTest, ACollectiveTakesTheLinksLatencyAndItsRingTrafficOverTheBandwidth) {
  const ModelSpec model = SixBlocks();
  TrainingPlan plan = Plan(1, 2, 1, PipelineSchedule::k1F1B);
  plan.parallel.bucket_bytes = 0;  // one all-reduce per group
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  const std::vector<TaskTime> times = LayerTimesOnly(step, model);
  ASSERT_OK_AND_ASSIGN(SimulatedStep free, SimulateStep(step.graph, times, {}));
  StepLinks links;
  links.collective = CollectiveLink{.latency_us = 100, .bytes_per_us = 50};  // 50 MB/s
  links.collective_group = 2;
  ASSERT_OK_AND_ASSIGN(SimulatedStep linked, SimulateStep(step.graph, times, links));
  int checked = 0;
  for (const TaskSpec& task : step.graph.tasks()) {
    if (task.op != "all_reduce") continue;
    // Two members: a ring all-reduce moves the tensor once per member, as the link measured.
    const double bytes = static_cast<double>(step.graph.object(task.inputs[0]).meta.bytes());
    const size_t t = task.id.value() - 1;
    EXPECT_NEAR(linked.end_ms[t] - linked.start_ms[t], (100 + bytes / 50) / 1e3, 1e-9) << task.name;
    ++checked;
  }
  EXPECT_GT(checked, 0);
  // The last layers' reductions wait on nothing but run after the backward: the step waits.
  EXPECT_GT(linked.step_ms, free.step_ms);
  EXPECT_GT(linked.workers[linked.critical].communication_ms, 0);
  ExpectPartsAddUp(linked);
  // Far slower, the step is the link's.
  links.collective.bytes_per_us = 0.05;
  ASSERT_OK_AND_ASSIGN(SimulatedStep slow, SimulateStep(step.graph, times, links));
  EXPECT_EQ(slow.bottleneck, Bottleneck::kCommunication);
  ExpectPartsAddUp(slow);
}

TEST(StepSimulationTest, ALargerGroupWaitsItsOwnLatency) {
  StepLinks links;
  links.collective = CollectiveLink{.latency_us = 40, .bytes_per_us = 50};
  EXPECT_EQ(links.LatencyUs(2), 40);
  EXPECT_EQ(links.LatencyUs(8), 40);  // nothing calibrated for more members: the link's
  links.group_latency = {{4, 150}, {8, 400}};
  EXPECT_EQ(links.LatencyUs(2), 40);
  EXPECT_EQ(links.LatencyUs(3), 40);
  EXPECT_EQ(links.LatencyUs(4), 150);
  EXPECT_EQ(links.LatencyUs(6), 150);  // the largest calibrated group below it
  EXPECT_EQ(links.LatencyUs(16), 400);

  // A step of four data-parallel ranks: each all-reduce of the four waits the group's latency.
  const ModelSpec model = SixBlocks();
  TrainingPlan plan = Plan(1, 4, 1, PipelineSchedule::k1F1B);
  plan.parallel.bucket_bytes = 0;  // one all-reduce per group
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  const std::vector<TaskTime> times = LayerTimesOnly(step, model);
  links.collective_group = 4;
  ASSERT_OK_AND_ASSIGN(SimulatedStep simulated, SimulateStep(step.graph, times, links));
  int checked = 0;
  for (const TaskSpec& task : step.graph.tasks()) {
    if (task.op != "all_reduce") continue;
    // A ring all-reduce of four moves 2 * 3/4 of the tensor per member; the bus bandwidth is
    // the link's at that traffic, so the bytes take bytes / link bandwidth.
    const double bytes = static_cast<double>(step.graph.object(task.inputs[0]).meta.bytes());
    const size_t t = task.id.value() - 1;
    EXPECT_NEAR(simulated.end_ms[t] - simulated.start_ms[t], (150 + bytes / 50) / 1e3, 1e-9)
        << task.name;
    ++checked;
  }
  EXPECT_GT(checked, 0);
  ExpectPartsAddUp(simulated);
}

TEST(StepSimulationTest, SequenceShardingsCollectivesWaitTheirOwnLatency) {
  StepLinks links;
  links.collective = CollectiveLink{.latency_us = 40, .bytes_per_us = 50};
  links.group_latency = {{4, 150}};
  EXPECT_EQ(links.SequenceShardLatencyUs(2), 40);  // none calibrated: LatencyUs'
  EXPECT_EQ(links.SequenceShardLatencyUs(4), 150);
  links.sequence_shard_latency = {{2, 90}};
  EXPECT_EQ(links.SequenceShardLatencyUs(2), 90);
  EXPECT_EQ(links.SequenceShardLatencyUs(4), 90);  // the largest calibrated group below it
  EXPECT_EQ(links.LatencyUs(2), 40);               // the all-reduces' are their own

  // A tensor pair sharding sequences: its reduce-scatters and all-gathers on tensor
  // parallelism's channel wait the sequence-sharded latency, every other collective the link's.
  ASSERT_OK_AND_ASSIGN(const ModelSpec model,
                       SixBlocks().PlannedFor(2, 1, /*shard_sequence=*/true));
  TrainingPlan plan = Plan(1, 1, 1, PipelineSchedule::k1F1B);
  plan.parallel.tensor_parallel = 2;
  plan.parallel.shard_sequence = true;
  plan.parallel.layer_costs.clear();  // the split has layers of its own
  plan.parallel.workers = {WorkerId(100), WorkerId(101)};
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  const std::vector<TaskTime> times(step.graph.tasks().size());
  ASSERT_OK_AND_ASSIGN(SimulatedStep simulated, SimulateStep(step.graph, times, links));
  int sharded = 0, others = 0;
  for (const TaskSpec& task : step.graph.tasks()) {
    ASSERT_OK_AND_ASSIGN(std::optional<CollectiveMembership> member, CollectiveOf(task));
    if (!member.has_value()) continue;
    const bool shard = member->channel == kTensorChannel &&
                       (task.op == "reduce_scatter" || task.op == "all_gather");
    double bytes = 0;
    if (!task.inputs.empty()) bytes = step.graph.object(task.inputs[0]).meta.bytes();
    if (!task.outputs.empty()) {
      bytes = std::max<double>(bytes, step.graph.object(task.outputs[0]).meta.bytes());
    }
    const double traffic = task.op == "all_reduce" ? 1.0 : 0.5;  // 2(N-1)/N or (N-1)/N of 2
    const size_t t = task.id.value() - 1;
    EXPECT_NEAR(simulated.end_ms[t] - simulated.start_ms[t],
                ((shard ? 90 : 40) + traffic * bytes / 50) / 1e3, 1e-9)
        << task.name;
    ++(shard ? sharded : others);
  }
  EXPECT_GT(sharded, 0);
  EXPECT_GT(others, 0);
  ExpectPartsAddUp(simulated);
}

// Spatial parallelism's exchanges (all-to-alls on tensor parallelism's channel: halos passed to
// a neighbour, norm statistics traded in blocks) wait the exchanges' calibrated latency; a halo
// moves its whole buffer, the statistics (N-1)/N of theirs.
TEST(StepSimulationTest, SlabExchangesWaitTheirOwnLatency) {
  StepLinks links;
  links.collective = CollectiveLink{.latency_us = 40, .bytes_per_us = 50};
  links.group_latency = {{4, 150}};
  EXPECT_EQ(links.ExchangeLatencyUs(2), 40);  // none calibrated: LatencyUs'
  EXPECT_EQ(links.ExchangeLatencyUs(4), 150);
  links.exchange_latency = {{4, 70}};
  EXPECT_EQ(links.ExchangeLatencyUs(2), 40);
  EXPECT_EQ(links.ExchangeLatencyUs(4), 70);
  EXPECT_EQ(links.LatencyUs(4), 150);  // the all-reduces' are their own
  EXPECT_EQ(links.SequenceShardLatencyUs(4), 150);

  // One volume in four slabs: every collective of the step has four members.
  ASSERT_OK_AND_ASSIGN(const ModelSpec slabs, TinyUNetInFourSlabs());
  ASSERT_OK_AND_ASSIGN(StepGraph step,
                       PlanTrainingStep(slabs, OneVolumeInFourSlabs(), CpuRegistry()));
  const std::vector<TaskTime> times(step.graph.tasks().size());
  links.collective_group = 4;
  ASSERT_OK_AND_ASSIGN(SimulatedStep simulated, SimulateStep(step.graph, times, links));
  int halos = 0, statistics = 0, others = 0;
  for (const TaskSpec& task : step.graph.tasks()) {
    ASSERT_OK_AND_ASSIGN(std::optional<CollectiveMembership> member, CollectiveOf(task));
    if (!member.has_value()) continue;
    ASSERT_EQ(member->group_size, 4) << task.name;
    const double bytes =
        static_cast<double>(std::max(step.graph.object(task.inputs[0]).meta.bytes(),
                                     step.graph.object(task.outputs[0]).meta.bytes()));
    double latency = 150, traffic = 2 * 3.0 / 4;  // an all-reduce of the gradients
    int* counted = &others;
    if (task.op == "all_to_all") {
      ASSERT_EQ(member->channel, kTensorChannel) << task.name;
      ASSERT_OK_AND_ASSIGN(const ExchangeLayout layout, ExchangeLayoutOf(task.attrs));
      const bool halo = PassesHalo(layout);
      latency = 70;
      traffic = halo ? 1.0 : 3.0 / 4;
      counted = halo ? &halos : &statistics;
    }
    // The bus bandwidth is the link's at an all-reduce's traffic of four: 50 x 2 x 3/4.
    const size_t t = task.id.value() - 1;
    EXPECT_NEAR(simulated.end_ms[t] - simulated.start_ms[t],
                (latency + traffic * bytes / (50 * 2 * 3.0 / 4)) / 1e3, 1e-9)
        << task.name;
    ++*counted;
  }
  EXPECT_GT(halos, 0);
  EXPECT_GT(statistics, 0);
  EXPECT_GT(others, 0);
  ExpectPartsAddUp(simulated);
}

// ZeRO-3's parameter gathers (their own channel) wait the figure calibrated for them, looked up
// at or below their member count, else LatencyUs'; every other collective of the step keeps its
// own: a step of four ZeRO-3 ranks simulated with and without it differs by the difference in
// each gather and nowhere else.
TEST(StepSimulationTest, ZeroThreesParameterGathersWaitTheirOwnLatency) {
  StepLinks links;
  links.collective = CollectiveLink{.latency_us = 40, .bytes_per_us = 50};
  links.collective_group = 4;
  links.group_latency = {{4, 150}};
  EXPECT_EQ(links.GatherLatencyUs(4), 150);  // none calibrated: LatencyUs'
  StepLinks gathering = links;
  gathering.gather_latency = {{4, 900}};
  EXPECT_EQ(gathering.GatherLatencyUs(2), 40);
  EXPECT_EQ(gathering.GatherLatencyUs(4), 900);
  EXPECT_EQ(gathering.GatherLatencyUs(8), 900);
  EXPECT_EQ(gathering.LatencyUs(4), 150);

  const ModelSpec model = SixBlocks();
  TrainingPlan plan = Plan(1, 4, 2, PipelineSchedule::kGPipe);
  plan.parallel.zero_stage = 3;
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  const std::vector<TaskTime> times(step.graph.tasks().size());
  ASSERT_OK_AND_ASSIGN(SimulatedStep at_link, SimulateStep(step.graph, times, links));
  ASSERT_OK_AND_ASSIGN(SimulatedStep calibrated, SimulateStep(step.graph, times, gathering));
  int gathers = 0, others = 0;
  for (const TaskSpec& task : step.graph.tasks()) {
    ASSERT_OK_AND_ASSIGN(std::optional<CollectiveMembership> member, CollectiveOf(task));
    if (!member.has_value()) continue;
    const size_t t = task.id.value() - 1;
    const double before = at_link.end_ms[t] - at_link.start_ms[t];
    const double after = calibrated.end_ms[t] - calibrated.start_ms[t];
    if (member->channel == kGatherChannel) {
      EXPECT_NEAR(after - before, (900 - 150) / 1e3, 1e-9) << task.name;
      ++gathers;
    } else {
      EXPECT_NEAR(after, before, 1e-9) << task.name;
      ++others;
    }
  }
  EXPECT_GT(gathers, 0);
  EXPECT_GT(others, 0);
  EXPECT_GT(calibrated.step_ms, at_link.step_ms);
  ExpectPartsAddUp(calibrated);

  // Slabs of one volume meet at every layer (their halo passes and statistics): the gathers of
  // their parameters keep what any collective of four waits.
  ASSERT_OK_AND_ASSIGN(const ModelSpec slabs, TinyUNetInFourSlabs());
  TrainingPlan sliced = OneVolumeInFourSlabs();
  sliced.parallel.zero_stage = 3;
  ASSERT_OK_AND_ASSIGN(StepGraph slab_step, PlanTrainingStep(slabs, sliced, CpuRegistry()));
  const std::vector<TaskTime> slab_times(slab_step.graph.tasks().size());
  ASSERT_OK_AND_ASSIGN(SimulatedStep slabs_at_link,
                       SimulateStep(slab_step.graph, slab_times, links));
  ASSERT_OK_AND_ASSIGN(SimulatedStep slabs_calibrated,
                       SimulateStep(slab_step.graph, slab_times, gathering));
  int slab_gathers = 0;
  for (const TaskSpec& task : slab_step.graph.tasks()) {
    ASSERT_OK_AND_ASSIGN(std::optional<CollectiveMembership> member, CollectiveOf(task));
    if (!member.has_value() || member->channel != kGatherChannel) continue;
    ++slab_gathers;
  }
  EXPECT_GT(slab_gathers, 0);
  EXPECT_EQ(slabs_calibrated.end_ms, slabs_at_link.end_ms);
}

// A group of workers that runs collectives on tensor parallelism's channel together waits the
// figure calibrated inside a pipeline where the group is a pipeline's stage (its compute reads
// objects another stage's workers made), its kind's own figure where the groups stand side by
// side; kinds and counts with nothing calibrated inside a pipeline keep their own.
TEST(StepSimulationTest, AGroupThatIsAPipelinesStageWaitsItsStagedLatency) {
  using Wait = StepLinks::GroupWait;
  StepLinks links;
  links.collective = CollectiveLink{.latency_us = 40, .bytes_per_us = 50};
  links.sequence_shard_latency = {{2, 90}};
  links.staged_latency = {{Wait::kAllReduce, 2, 300}, {Wait::kExchange, 4, 500}};
  EXPECT_EQ(links.GroupWaitUs(Wait::kAllReduce, 2, false), 40);
  EXPECT_EQ(links.GroupWaitUs(Wait::kAllReduce, 2, true), 300);
  EXPECT_EQ(links.GroupWaitUs(Wait::kAllReduce, 4, true), 300);     // the largest count below
  EXPECT_EQ(links.GroupWaitUs(Wait::kSequenceShard, 2, true), 90);  // none for its kind
  EXPECT_EQ(links.GroupWaitUs(Wait::kExchange, 2, true), 40);       // none at or below 2
  EXPECT_EQ(links.GroupWaitUs(Wait::kExchange, 4, true), 500);
  EXPECT_EQ(links.GroupWaitUs(Wait::kExchange, 4, false), 40);
  // A group of 8 at or above its own side-by-side figure: a staged pair's 300 below 8's 600.
  links.group_latency = {{8, 600}};
  EXPECT_EQ(links.GroupWaitUs(Wait::kAllReduce, 8, false), 600);
  EXPECT_EQ(links.GroupWaitUs(Wait::kAllReduce, 8, true), 600);
  EXPECT_EQ(links.GroupWaitUs(Wait::kAllReduce, 4, true), 300);
  links.group_latency.clear();

  // Tensor pairs on four workers, two side by side (D2 x T2) or two stages of one pipeline
  // (D1 x T2 x P2): every all-reduce of a pair waits 40 us beside the other pair, 300 us in the
  // pipeline; the collectives on other channels (the ranks' gradients, the norm) the link's.
  ASSERT_OK_AND_ASSIGN(const ModelSpec model, SixBlocks().PlannedFor(2, 1, false));
  for (const int stages : {1, 2}) {
    TrainingPlan plan = Plan(stages, 2 / stages, 2, PipelineSchedule::k1F1B);
    plan.parallel.tensor_parallel = 2;
    plan.parallel.layer_costs.clear();  // the split has layers of its own
    plan.parallel.workers = {WorkerId(100), WorkerId(101), WorkerId(102), WorkerId(103)};
    ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
    const std::vector<TaskTime> times(step.graph.tasks().size());
    ASSERT_OK_AND_ASSIGN(SimulatedStep simulated, SimulateStep(step.graph, times, links));
    int pairs = 0, others = 0;
    for (const TaskSpec& task : step.graph.tasks()) {
      ASSERT_OK_AND_ASSIGN(std::optional<CollectiveMembership> member, CollectiveOf(task));
      if (!member.has_value()) continue;
      const size_t t = task.id.value() - 1;
      const double took_us = (simulated.end_ms[t] - simulated.start_ms[t]) * 1e3;
      const double bytes = static_cast<double>(step.graph.object(task.inputs[0]).meta.bytes());
      if (member->channel != kTensorChannel) {
        EXPECT_LT(took_us, 40 + 2 * bytes / 50 + 1e-6) << task.name;
        ++others;
        continue;
      }
      ASSERT_EQ(task.op, "all_reduce") << task.name;
      ASSERT_EQ(member->group_size, 2) << task.name;
      EXPECT_NEAR(took_us, (stages == 2 ? 300 : 40) + bytes / 50, 1e-6)
          << task.name << " in " << stages << " stage(s)";
      ++pairs;
    }
    EXPECT_GT(pairs, 0) << stages;
    EXPECT_GT(others, 0) << stages;
    ExpectPartsAddUp(simulated);
  }
}

TEST(StepSimulationTest, ACompressedAllReduceMovesABitAnElement) {
  // The same 1 Mi f32 elements over a pair, all-reduced and compressed: the ring moves
  // 2(N-1)/N of the bytes, the compressed collective 1/32 of that.
  constexpr int64_t kCount = int64_t{1} << 20;
  Graph graph;
  for (const char* op : {"all_reduce", "compressed_all_reduce"}) {
    const int64_t collective = std::string_view(op) == "all_reduce" ? 1 : 2;
    for (int r = 0; r < 2; ++r) {
      const ObjectId x = graph.AddObject(fmt::format("{}.x{}", op, r),
                                         TensorMeta{Shape{kCount}, DType::kF32, Device::Cpu()},
                                         ObjectRole::kGradient);
      TaskSpec task;
      task.name = fmt::format("{}.{}", op, r);
      task.op = op;
      task.inputs = {x};
      task.outputs = {graph.AddObject(fmt::format("{}.out{}", op, r), graph.object(x).meta,
                                      ObjectRole::kGradient)};
      task.pinned_worker = WorkerId(static_cast<uint64_t>(r + 1));
      task.attrs.Set(kCollectiveAttr, collective);
      task.attrs.Set(kRankAttr, int64_t{r});
      task.attrs.Set(kGroupSizeAttr, int64_t{2});
      graph.MarkOutput(task.outputs[0]);
      graph.AddTask(std::move(task));
    }
  }
  StepLinks links;
  links.collective = CollectiveLink{.latency_us = 10, .bytes_per_us = 1000};
  ASSERT_OK_AND_ASSIGN(SimulatedStep simulated,
                       SimulateStep(graph, std::vector<TaskTime>(graph.tasks().size()), links));
  const double bytes = 4.0 * kCount;
  const auto took = [&](size_t t) { return simulated.end_ms[t] - simulated.start_ms[t]; };
  EXPECT_NEAR(took(0), (10 + bytes / 1000) / 1e3, 1e-9);       // 2 x 1/2 of the bytes
  EXPECT_NEAR(took(2), (10 + bytes / 32 / 1000) / 1e3, 1e-9);  // a bit an element
}

TEST(StepSimulationTest, AChannelRunsItsCollectivesInTheRuntimesOrder) {
  // Collective 1 is first on channel 0 but its member on worker 2 waits 2 x 2.5 ms for slow.a
  // and slow.b; collective 2, ready at once on the same channel, waits for it; collective 3, on
  // the gather channel, does not.
  const Graph graph = ChannelOrderGraph();
  std::vector<TaskTime> times(graph.tasks().size());
  times[0].ms = times[1].ms = 2.5;
  StepLinks links;
  links.collective = CollectiveLink{.latency_us = 1000, .bytes_per_us = 1e6};  // 1 ms each
  ASSERT_OK_AND_ASSIGN(SimulatedStep simulated, SimulateStep(graph, times, links));
  auto start = [&](const std::string& name) {
    for (const TaskSpec& task : graph.tasks()) {
      if (task.name == name) return simulated.start_ms[task.id.value() - 1];
    }
    ADD_FAILURE() << name;
    return -1.0;
  };
  EXPECT_NEAR(start("gather3.0"), 0, 1e-9);
  EXPECT_NEAR(start("gather1.0"), 5, 1e-6);
  EXPECT_NEAR(start("gather2.0"), start("gather1.0") + 1, 1e-3);
  EXPECT_NEAR(start("gather2.1"), start("gather2.0"), 1e-9);
}

TEST(StepSimulationTest, PushingActivationsBetweenStagesDelaysTheNextStage) {
  const ModelSpec model = SixBlocks();
  const TrainingPlan plan = Plan(2, 1, 4, PipelineSchedule::k1F1B);
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  const std::vector<TaskTime> times = LayerTimesOnly(step, model);
  ASSERT_OK_AND_ASSIGN(SimulatedStep free, SimulateStep(step.graph, times, {}));
  StepLinks links;
  links.point_to_point = CollectiveLink{.latency_us = 500, .bytes_per_us = 1e9};
  ASSERT_OK_AND_ASSIGN(SimulatedStep pushed, SimulateStep(step.graph, times, links));
  // Each micro-batch crosses twice (activation forward, gradient back) on the critical path at
  // least once each way.
  EXPECT_GE(pushed.step_ms, free.step_ms + 2 * 0.5);
  double communication = 0;
  for (const SimulatedWorker& w : pushed.workers) communication += w.communication_ms;
  EXPECT_GT(communication, 0);
  ExpectPartsAddUp(pushed);
  // Calibrated while the workers share a machine, a push waits that latency in place of the
  // link's: the step of a link 2 ms slow, to the task.
  links.shared_push_latency_us = 2000;
  ASSERT_OK_AND_ASSIGN(SimulatedStep shared, SimulateStep(step.graph, times, links));
  StepLinks slow;
  slow.point_to_point = CollectiveLink{.latency_us = 2000, .bytes_per_us = 1e9};
  ASSERT_OK_AND_ASSIGN(SimulatedStep as_slow, SimulateStep(step.graph, times, slow));
  EXPECT_GE(shared.step_ms, pushed.step_ms + 2 * 1.5);
  EXPECT_EQ(shared.step_ms, as_slow.step_ms);
  EXPECT_EQ(shared.end_ms, as_slow.end_ms);
}

// Workers sharing one machine: four ranks computing the same tasks at once on room for one take
// four times as long, on room for two twice; a pipeline on room for one keeps the machine busy,
// so its step is all its work one after another.
TEST(StepSimulationTest, WorkersSharingAMachineComputeAtTheirShareOfIt) {
  const ModelSpec model = SixBlocks();
  const TrainingPlan ranks = Plan(1, 4, 1, PipelineSchedule::k1F1B);
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, ranks, CpuRegistry()));
  const std::vector<TaskTime> times = LayerTimesOnly(step, model);
  ASSERT_OK_AND_ASSIGN(SimulatedStep own, SimulateStep(step.graph, times, {}));
  for (double capacity : {1.0, 2.0, 4.0, 8.0}) {
    ASSERT_OK_AND_ASSIGN(SimulatedStep shared,
                         SimulateStep(step.graph, times, {}, 0, ComputeSharing{capacity}));
    EXPECT_NEAR(shared.step_ms, own.step_ms * std::max(1.0, 4 / capacity), 1e-9) << capacity;
    ExpectPartsAddUp(shared);
  }
  const TrainingPlan piped = Plan(2, 1, 4, PipelineSchedule::kGPipe);
  ASSERT_OK_AND_ASSIGN(StepGraph pipeline, PlanTrainingStep(model, piped, CpuRegistry()));
  const std::vector<TaskTime> piped_times = LayerTimesOnly(pipeline, model);
  double work = 0;
  for (const TaskTime& t : piped_times) work += t.ms;
  ASSERT_OK_AND_ASSIGN(SimulatedStep one,
                       SimulateStep(pipeline.graph, piped_times, {}, 0, ComputeSharing{1}));
  EXPECT_NEAR(one.step_ms, work, 1e-9);
  ExpectPartsAddUp(one);
}

// Collectives beside the compute (ZeRO-3's gathers and reduce-scatters) wait with their cores
// yielded: four ZeRO-3 ranks on room for four run as on machines of their own, their gathers
// overlapping the compute included. A tensor group's members do take cores: two tensor pairs
// on room for two are slower than on machines of their own, by more than their compute alone
// would make them (each pair's collectives share the cores with the other pair's compute).
TEST(StepSimulationTest, OnlyTensorParallelCollectivesTakeTheComputesCores) {
  const ModelSpec model = SixBlocks();
  StepLinks links;
  links.collective = CollectiveLink{.latency_us = 30, .bytes_per_us = 800};
  TrainingPlan zero3 = Plan(1, 4, 2, PipelineSchedule::k1F1B);
  zero3.parallel.zero_stage = 3;
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, zero3, CpuRegistry()));
  const std::vector<TaskTime> times = LayerTimesOnly(step, model);
  ASSERT_OK_AND_ASSIGN(SimulatedStep own, SimulateStep(step.graph, times, links));
  ASSERT_OK_AND_ASSIGN(SimulatedStep shared,
                       SimulateStep(step.graph, times, links, 0, ComputeSharing{4}));
  EXPECT_NEAR(shared.step_ms, own.step_ms, 1e-9);
  ExpectPartsAddUp(shared);
  // The gathers did run beside the compute (else the rule is not exercised): some gather starts
  // before a compute task of its worker ends and ends after that task starts.
  bool overlapped = false;
  for (const TaskSpec& gather : step.graph.tasks()) {
    if (gather.op != "all_gather") continue;
    const size_t g = gather.id.value() - 1;
    for (const TaskSpec& task : step.graph.tasks()) {
      const size_t t = task.id.value() - 1;
      if (task.pinned_worker != gather.pinned_worker || times[t].ms <= 0) continue;
      overlapped |= own.start_ms[g] < own.end_ms[t] && own.start_ms[t] < own.end_ms[g];
    }
  }
  EXPECT_TRUE(overlapped);

  ASSERT_OK_AND_ASSIGN(const ModelSpec tensor_model, SixBlocks().PlannedFor(2, 1, false));
  TrainingPlan pairs = Plan(1, 2, 2, PipelineSchedule::k1F1B);
  pairs.parallel.tensor_parallel = 2;
  pairs.parallel.layer_costs.clear();
  pairs.parallel.workers = {WorkerId(100), WorkerId(101), WorkerId(102), WorkerId(103)};
  ASSERT_OK_AND_ASSIGN(StepGraph tensor, PlanTrainingStep(tensor_model, pairs, CpuRegistry()));
  const std::vector<TaskTime> tensor_times = LayerTimesOnly(tensor, tensor_model);
  ASSERT_OK_AND_ASSIGN(SimulatedStep apart, SimulateStep(tensor.graph, tensor_times, links));
  ASSERT_OK_AND_ASSIGN(SimulatedStep crowded,
                       SimulateStep(tensor.graph, tensor_times, links, 0, ComputeSharing{2}));
  double compute = 0;
  for (const SimulatedWorker& w : apart.workers) compute = std::max(compute, w.compute_ms);
  EXPECT_GT(crowded.step_ms, apart.step_ms + compute + 1e-6);
  ExpectPartsAddUp(crowded);
}

// Workers bound to cores of their own share only their group's: four ranks on room for two, in
// two groups of one core each, take twice as long with two ranks on each core; with all four on
// one core's group and nothing on the other, four times; and groups that split the ranks as the
// whole machine would give its step exactly (the same rates).
TEST(StepSimulationTest, WorkersBoundToCoresShareOnlyTheirGroupsCores) {
  const ModelSpec model = SixBlocks();
  const TrainingPlan ranks = Plan(1, 4, 1, PipelineSchedule::k1F1B);
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, ranks, CpuRegistry()));
  const std::vector<TaskTime> times = LayerTimesOnly(step, model);
  ASSERT_OK_AND_ASSIGN(SimulatedStep own, SimulateStep(step.graph, times, {}));
  ASSERT_OK_AND_ASSIGN(SimulatedStep whole,
                       SimulateStep(step.graph, times, {}, 0, ComputeSharing{2}));
  const WorkerId a(100), b(101), c(102), d(103);
  ComputeSharing pairs{2, {CoreGroup{{a, c}, 0.5}, CoreGroup{{b, d}, 0.5}}};
  ASSERT_OK_AND_ASSIGN(SimulatedStep split, SimulateStep(step.graph, times, {}, 0, pairs));
  EXPECT_NEAR(split.step_ms, 2 * own.step_ms, 1e-9);
  EXPECT_EQ(split.step_ms, whole.step_ms);
  ExpectPartsAddUp(split);
  ComputeSharing lopsided{2, {CoreGroup{{a, b, c, d}, 0.5}, CoreGroup{{}, 0.5}}};
  ASSERT_OK_AND_ASSIGN(SimulatedStep crowded, SimulateStep(step.graph, times, {}, 0, lopsided));
  EXPECT_NEAR(crowded.step_ms, 4 * own.step_ms, 1e-9);
  // Three on one core and one alone on the other: the lone rank at full speed, the three at a
  // third; the step waits for the three.
  ComputeSharing three{2, {CoreGroup{{a, b, c}, 0.5}, CoreGroup{{d}, 0.5}}};
  ASSERT_OK_AND_ASSIGN(SimulatedStep uneven, SimulateStep(step.graph, times, {}, 0, three));
  EXPECT_NEAR(uneven.step_ms, 3 * own.step_ms, 1e-9);
  ExpectPartsAddUp(uneven);
  // A rank alone on its group's cores runs at full speed even where the group's share of the
  // capacity is below one worker's: two ranks (the others idle) on groups of 0.4 each.
  const TrainingPlan pair = Plan(1, 2, 1, PipelineSchedule::k1F1B);
  ASSERT_OK_AND_ASSIGN(StepGraph two, PlanTrainingStep(model, pair, CpuRegistry()));
  const std::vector<TaskTime> two_times = LayerTimesOnly(two, model);
  ASSERT_OK_AND_ASSIGN(SimulatedStep two_own, SimulateStep(two.graph, two_times, {}));
  ComputeSharing small{0.8, {CoreGroup{{a}, 0.5}, CoreGroup{{b}, 0.5}}};
  ASSERT_OK_AND_ASSIGN(SimulatedStep alone, SimulateStep(two.graph, two_times, {}, 0, small));
  EXPECT_EQ(alone.step_ms, two_own.step_ms);
  ComputeSharing together{0.8, {CoreGroup{{a, b}, 0.5}, CoreGroup{{}, 0.5}}};
  ASSERT_OK_AND_ASSIGN(SimulatedStep turns, SimulateStep(two.graph, two_times, {}, 0, together));
  EXPECT_NEAR(turns.step_ms, two_own.step_ms * 2 / 0.4, 1e-9);
}

TEST(StepSimulationTest, ARunIsTheSameEveryTime) {
  const ModelSpec model = SixBlocks();
  const TrainingPlan plan = Plan(2, 2, 4, PipelineSchedule::kZbH1);
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  StepLinks links;
  links.collective = CollectiveLink{.latency_us = 30, .bytes_per_us = 800};
  ASSERT_OK_AND_ASSIGN(SimulatedStep a,
                       SimulateStep(step.graph, LayerTimesOnly(step, model), links, 0.1));
  ASSERT_OK_AND_ASSIGN(SimulatedStep b,
                       SimulateStep(step.graph, LayerTimesOnly(step, model), links, 0.1));
  EXPECT_EQ(a.step_ms, b.step_ms);
  EXPECT_EQ(a.start_ms, b.start_ms);
  EXPECT_EQ(a.workers.size(), 4u);
  ExpectPartsAddUp(a);
}

TEST(StepSimulationTest, TimesForAnotherGraphAreRefused) {
  const ModelSpec model = SixBlocks();
  ASSERT_OK_AND_ASSIGN(
      StepGraph step,
      PlanTrainingStep(model, TrainingPlan{.batch = 2, .seq_len = 16}, CpuRegistry()));
  const Result<SimulatedStep> refused = SimulateStep(step.graph, {TaskTime{}}, {});
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("1 task times for a graph of"));
}

}  // namespace
}  // namespace tessera::testing

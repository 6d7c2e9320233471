// Balancing pipeline stages by measured layer times (training/layer_profile.h): the times a trace
// gives each layer, a profiling run that times every layer of a model, the host link, and what
// copies beside a step take from its compute.
#include "training/layer_profile.h"

#include <cmath>
#include <filesystem>
#include <memory>

#include <gmock/gmock.h>

#include "model/gpt2.h"
#include "model/unet3d.h"
#include "planner/step_time.h"
#include "test_util.h"
#include "worker/simulated_gpu.h"
#include "worker/swap_file.h"

namespace tessera::testing {
namespace {

TimelineSpan Span(const std::string& layer, SpanKind kind, int64_t start_us, int64_t end_us) {
  TimelineSpan span;
  span.layer = layer;
  span.kind = kind;
  span.start_us = start_us;
  span.end_us = end_us;
  return span;
}

TEST(LayerProfileTest, EachLayersComputeSpansAreSummedAndAveragedOverSteps) {
  const ModelSpec model = *BuildGpt2(Gpt2Config{1, 32, 4, 64, 16});  // embedding, h.0, head
  Timeline timeline;
  timeline.spans = {
      Span("h.0", SpanKind::kForward, 0, 1000),
      Span("h.0", SpanKind::kBackwardInput, 2000, 2600),
      Span("h.0", SpanKind::kBackwardWeight, 3000, 3400),
      Span("h.0", SpanKind::kCollective, 0, 5000),  // a gather of its parameters: not compute
      Span("head", SpanKind::kForward, 1000, 1300),
      Span("head", SpanKind::kBackward, 1300, 1500),
      Span("", SpanKind::kOptimizer, 4000, 9000),     // no layer
      Span("h.0", SpanKind::kForward, 10000, 11000),  // the second step
  };
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> ms, LayerTimesFromTimeline(model, timeline, 2));
  ASSERT_EQ(ms.size(), 3u);
  EXPECT_DOUBLE_EQ(ms[0].forward + ms[0].backward + ms[0].weight, 0.0);
  EXPECT_DOUBLE_EQ(ms[1].forward, (1.0 + 1.0) / 2);
  EXPECT_DOUBLE_EQ(ms[1].backward, 0.6 / 2);
  EXPECT_DOUBLE_EQ(ms[1].weight, 0.4 / 2);
  EXPECT_DOUBLE_EQ(ms[2].forward, 0.3 / 2);
  EXPECT_DOUBLE_EQ(ms[2].backward, 0.2 / 2);
  EXPECT_DOUBLE_EQ(ms[2].weight, 0.0);
  EXPECT_EQ(LayerTimesFromTimeline(model, timeline, 0).status().code(),
            StatusCode::kInvalidArgument);
}

// Tasks running beside each other on one worker's compute slots share that time: the times add
// up to the worker's busy time. Another worker's tasks, and collectives, share nothing.
TEST(LayerProfileTest, TasksRunningTogetherOnAWorkerShareItsTime) {
  const ModelSpec model = *BuildGpt2(Gpt2Config{1, 32, 4, 64, 16});  // embedding, h.0, head
  Timeline timeline;
  TimelineSpan forward = Span("h.0", SpanKind::kForward, 0, 1000);
  TimelineSpan head = Span("head", SpanKind::kForward, 500, 1500);
  head.stream = 1;
  TimelineSpan elsewhere = Span("embedding", SpanKind::kForward, 0, 1500);
  elsewhere.worker = WorkerId(2);
  TimelineSpan gather = Span("h.0", SpanKind::kCollective, 0, 1500);
  gather.stream = kCollectiveStream;
  timeline.spans = {forward, head, elsewhere, gather};
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> ms, LayerTimesFromTimeline(model, timeline, 1));
  EXPECT_DOUBLE_EQ(ms[1].forward, 0.5 + 0.25);  // alone for 500 us, then half of 500
  EXPECT_DOUBLE_EQ(ms[2].forward, 0.25 + 0.5);
  EXPECT_DOUBLE_EQ(ms[0].forward, 1.5);
}

// A step's profile for predicting step times: whole backwards when asked (no weight halves), the
// step's tasks counted, and its time and its tasks' time measured.
TEST(LayerProfileTest, AStepProfileCountsTheTasksAndTimesTheStep) {
  const ModelSpec gpt2 = *BuildGpt2(Gpt2Config{2, 32, 4, 64, 16});
  const TrainingPlan plan{.batch = 4, .seq_len = 16};
  ASSERT_OK_AND_ASSIGN(StepProfile profile, ProfileStep(gpt2, plan, ExecutorOptions{},
                                                        {.steps = 2, .split_backwards = false}));
  ASSERT_EQ(profile.layer_ms.size(), gpt2.layers.size());
  for (const OpCosts& ms : profile.layer_ms) {
    EXPECT_GT(ms.forward, 0.0);
    EXPECT_GT(ms.backward, 0.0);
    EXPECT_EQ(ms.weight, 0.0);
  }
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(gpt2, plan, CpuRegistry()));
  EXPECT_EQ(profile.tasks, static_cast<double>(step.graph.num_tasks()));
  EXPECT_GT(profile.step_ms, 0.0);
  EXPECT_GT(profile.busy_ms, 0.0);
  EXPECT_GE(profile.TaskOverheadMs(), 0.0);
  // The tasks of no layer (the optimizer's) at their measured rate make up the rest of the busy
  // time: the layers' times and theirs add up to it.
  EXPECT_GT(profile.other_ms_per_unit, 0.0);
  double units = 0, layers = 0;
  ASSERT_OK_AND_ASSIGN(std::vector<TaskTime> times,
                       EstimateTaskTimes(step.graph, gpt2, profile.layer_ms, CpuRegistry()));
  for (size_t t = 0; t < times.size(); ++t) {
    if (times[t].layer) continue;
    ASSERT_OK_AND_ASSIGN(const double estimate,
                         TaskCostUnits(step.graph, step.graph.tasks()[t], CpuRegistry()));
    units += estimate;
  }
  for (const OpCosts& ms : profile.layer_ms) layers += ms.forward + ms.backward + ms.weight;
  EXPECT_NEAR(profile.other_ms_per_unit * units + layers, profile.busy_ms, 1e-6 * profile.busy_ms);
}

// Every layer of GPT-2 and of the U-Net runs in the profile and gets a forward and backward
// time, and the layers whose backward splits (GPT-2's blocks; every U-Net layer with parameters
// and an input gradient) a weight-half time; a plan whose batch leaves no row per micro-batch is
// refused naming the split.
TEST(LayerProfileTest, AProfilingRunTimesEveryLayerOfAnyModel) {
  TrainingPlan plan;
  plan.batch = 8;
  plan.seq_len = 16;
  plan.parallel.micro_batches = 4;
  plan.parallel.pipeline_stages = 2;
  const ModelSpec gpt2 = *BuildGpt2(Gpt2Config{2, 32, 4, 64, 16});
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> gpt2_ms,
                       ProfileLayerTimes(gpt2, plan, ExecutorOptions{}, {.steps = 1}));
  ASSERT_EQ(gpt2_ms.size(), gpt2.layers.size());
  for (size_t l = 0; l < gpt2_ms.size(); ++l) {
    SCOPED_TRACE(gpt2.layers[l].name);
    EXPECT_GT(gpt2_ms[l].forward, 0.0);
    EXPECT_GT(gpt2_ms[l].backward, 0.0);
    EXPECT_EQ(gpt2_ms[l].weight > 0.0, gpt2.layers[l].name.starts_with("h."));
  }

  ASSERT_OK_AND_ASSIGN(
      ModelSpec unet,
      BuildUNet3d(UNet3dConfig{.base_channels = 4, .depth = 1, .volume = 8}, CpuRegistry()));
  plan.seq_len = 1;
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> unet_ms,
                       ProfileLayerTimes(unet, plan, ExecutorOptions{}, {.steps = 1}));
  ASSERT_EQ(unet_ms.size(), unet.layers.size());
  int weighed = 0;
  for (size_t l = 0; l < unet_ms.size(); ++l) {
    SCOPED_TRACE(unet.layers[l].name);
    EXPECT_GT(unet_ms[l].forward, 0.0);
    weighed += unet_ms[l].weight > 0.0;
  }
  EXPECT_GT(weighed, 0);

  plan.batch = 2;
  const Status refused = ProfileLayerTimes(gpt2, plan, ExecutorOptions{}).status();
  EXPECT_EQ(refused.message(),
            "profiling the layers: the batch of 2 rows gives no row per micro-batch over 1 "
            "rank(s) x 4 micro-batch(es)");
}

// One rank of a tensor split runs in one process as a model of its own (ModelSpec::OneRankView):
// the split's layers and shapes, every layer timed, its parameters a rank's slices; a split whose
// collectives change shapes (sequence sharding, sequence parallelism) is refused, naming why.
TEST(LayerProfileTest, OneRankOfATensorSplitIsProfiledInOneProcess) {
  TrainingPlan plan;
  plan.batch = 4;
  plan.seq_len = 16;
  const ModelSpec gpt2 = *BuildGpt2(Gpt2Config{2, 32, 4, 64, 16});
  ASSERT_OK_AND_ASSIGN(ModelSpec split, gpt2.PlannedFor(2, 1));
  ASSERT_OK_AND_ASSIGN(ModelSpec rank, split.OneRankView());
  EXPECT_EQ(rank.tensor_parallel, 1);
  EXPECT_FALSE(rank.rewritten());
  ASSERT_EQ(rank.layers.size(), split.layers.size());
  for (size_t l = 0; l < rank.layers.size(); ++l) {
    EXPECT_EQ(rank.layers[l].name, split.layers[l].name);
    EXPECT_EQ(rank.layers[l].params.numel(), split.layers[l].params.numel());
    EXPECT_FALSE(rank.layers[l].tensor_parallel.has_value());
  }
  EXPECT_LT(rank.NumParameters(), gpt2.NumParameters());
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> ms,
                       ProfileLayerTimes(rank, plan, ExecutorOptions{}, {.steps = 1}));
  ASSERT_EQ(ms.size(), rank.layers.size());
  for (size_t l = 0; l < ms.size(); ++l) {
    SCOPED_TRACE(rank.layers[l].name);
    EXPECT_GT(ms[l].forward, 0.0);
    EXPECT_GT(ms[l].backward + ms[l].weight, 0.0);
  }
  ASSERT_OK_AND_ASSIGN(
      ModelSpec unet,
      BuildUNet3d(UNet3dConfig{.base_channels = 4, .depth = 1, .volume = 8}, CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(ModelSpec unet_split, unet.PlannedFor(2, 1));
  ASSERT_OK_AND_ASSIGN(ModelSpec unet_rank, unet_split.OneRankView());
  plan.seq_len = 1;
  EXPECT_OK(ProfileLayerTimes(unet_rank, plan, ExecutorOptions{}, {.steps = 1}).status());

  ASSERT_OK_AND_ASSIGN(ModelSpec sharded, gpt2.PlannedFor(2, 1, /*shard_sequence=*/true));
  Result<ModelSpec> refused = sharded.OneRankView();
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("Megatron-LM's sequence"));
  ASSERT_OK_AND_ASSIGN(ModelSpec ulysses, gpt2.PlannedFor(1, 2));
  EXPECT_FALSE(ulysses.OneRankView().ok());
}

// The host link of the simulated GPU (copies through host memory, unscrambling as a real GPU's
// copies would move bytes): a finite positive bandwidth; bad sizes are refused by name.
TEST(LayerProfileTest, TheHostLinkIsMeasuredBothWays) {
  std::shared_ptr<DeviceRuntime> gpu = MakeSimulatedGpu(int64_t{64} << 20);
  ASSERT_OK_AND_ASSIGN(double bytes_per_us, MeasureHostLink(*gpu, int64_t{4} << 20, 3));
  EXPECT_GT(bytes_per_us, 0.0);
  EXPECT_TRUE(std::isfinite(bytes_per_us));
  EXPECT_EQ(gpu->memory().live_bytes, 0);  // the probe's device buffer is freed
  EXPECT_THAT(MeasureHostLink(*gpu, 0, 3).status().message(),
              ::testing::HasSubstr("0 bytes 3 times; both must be >= 1"));
}

// What copies beside a step take from its compute, measured on a swap file: a finite figure of at
// least 0 (how much depends on the machine: nothing where the copier has a core and a drive of
// its own, a share of the kernels' time where it has neither); a link too small for the probe's
// 16 MiB buffer is named, as is a bad profile.
TEST(LayerProfileTest, WhatCopiesTakeFromTheComputeIsMeasuredBesideAProfile) {
  const ModelSpec model = *BuildGpt2(Gpt2Config{1, 32, 4, 64, 16});
  TrainingPlan plan;
  plan.batch = 4;
  plan.seq_len = 16;
  ASSERT_OK_AND_ASSIGN(StepProfile alone,
                       ProfileStep(model, plan, ExecutorOptions{}, {.steps = 2}));
  const std::string dir = TempPath("layer_profile_swap");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<DeviceRuntime> disk, OpenSwapFile({dir}));
  ASSERT_OK_AND_ASSIGN(double us_per_byte, MeasureCopyCompute(model, plan, ExecutorOptions{}, *disk,
                                                              alone, {.steps = 2}));
  EXPECT_GE(us_per_byte, 0.0);
  EXPECT_TRUE(std::isfinite(us_per_byte));
  EXPECT_EQ(disk->memory().live_bytes, 0);  // the probe's region is freed

  std::shared_ptr<DeviceRuntime> small = MakeSimulatedGpu(int64_t{1} << 20);
  const Status too_small =
      MeasureCopyCompute(model, plan, ExecutorOptions{}, *small, alone, {.steps = 1}).status();
  EXPECT_THAT(too_small.message(), ::testing::HasSubstr("take from the compute"));
  TrainingPlan empty = plan;
  empty.batch = 0;
  const Status refused =
      MeasureCopyCompute(model, empty, ExecutorOptions{}, *disk, alone, {.steps = 1}).status();
  EXPECT_THAT(refused.message(), ::testing::HasSubstr("profiling the layers"));
  EXPECT_EQ(disk->memory().live_bytes, 0);
}

}  // namespace
}  // namespace tessera::testing

// The offload pass (planner/offload_pass.cc): under a host update, the gradients and clipping
// factors go down to the host after the factor and at most three layers ahead of the updates,
// and the updated master pieces come back up; without one, nothing moves. Under parameter
// offload the parameters live on the host, each use reads a copy made for it (the sharding
// policy's UsableParams), and gradients go down as soon as they are complete.
#include <gmock/gmock.h>

#include "planner_test_util.h"

namespace tessera::testing {
namespace {

using ::testing::ElementsAre;

std::vector<std::string> AfterNames(const PlanState& state, const TaskSpec& task) {
  std::vector<std::string> names;
  names.reserve(task.after.size());
  for (TaskId id : task.after) names.push_back(state.builder.graph().task(id).name);
  return names;
}

TEST(OffloadPassTest, DownloadsWaitForTheFactorAndAtMostThreeLayersAheadOfTheUpdates) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = 2, .offload_to_gpu_host = true});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "offload_downloads"));
  const TaskSpec* clip = FindTask(state, "rank0/clip_to_host");
  ASSERT_NE(clip, nullptr);
  EXPECT_EQ(clip->device_kind, DeviceKind::kCpu);
  const TaskSpec* download = FindTask(state, "rank0/head/grad_to_host");
  ASSERT_NE(download, nullptr);
  EXPECT_EQ(download->device_kind, DeviceKind::kCpu);
  EXPECT_THAT(NamesOf(state, download->inputs), ElementsAre("rank0/head.grad[shard]"));
  EXPECT_THAT(AfterNames(state, *download), ElementsAre("rank0/clip_to_host"));
  const RankState& rank = state.ranks[0];
  EXPECT_EQ(state.builder.graph().object(rank.update_grad[3]).name, "rank0/head.grad.host");
  EXPECT_EQ(state.builder.graph().object(rank.update_clip[0]).name, "rank0/clip_scale.host");
  // The update pass then holds the fourth download until the first update ended.
  ASSERT_OK(UpdateOptimizerPass(state));
  EXPECT_THAT(AfterNames(state, *FindTask(state, "rank0/head/grad_to_host")),
              ElementsAre("rank0/clip_to_host", "rank0/embedding/adamw"));
  EXPECT_THAT(AfterNames(state, *FindTask(state, "rank0/h.1/grad_to_host")),
              ElementsAre("rank0/clip_to_host"));
}

TEST(OffloadPassTest, UpdatedShardsGoBackUpAndAreGathered) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = 1, .offload_to_gpu_host = true});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "update_optimizer"));
  const TaskSpec* upload = FindTask(state, "rank1/h.0/params_to_device");
  ASSERT_NE(upload, nullptr);
  EXPECT_EQ(upload->device_kind, DeviceKind::kCuda);
  EXPECT_THAT(NamesOf(state, upload->inputs), ElementsAre("rank1/h.0.master_params[shard].next"));
  EXPECT_THAT(NamesOf(state, upload->outputs), ElementsAre("rank1/h.0.params[shard]"));
  const TaskSpec* gather = FindTask(state, "rank1/h.0/all_gather");
  ASSERT_NE(gather, nullptr);
  EXPECT_EQ(gather->op, "all_gather");
  EXPECT_THAT(NamesOf(state, gather->outputs), ElementsAre("rank1/h.0.params.next"));
  const StateObject& params = state.step.state[state.ranks[1].param[1]];
  EXPECT_EQ(params.output, gather->outputs[0]);
  EXPECT_TRUE(state.builder.graph().IsOutput(params.output));
  EXPECT_TRUE(state.builder.graph().IsOutput(state.step.state[state.ranks[1].master[1]].output));
}

// Clipping off, the factor is the host's constant 1: the downloads wait for no factor.
TEST(OffloadPassTest, WithoutClippingDownloadsStartAsGradientsAreReduced) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan =
      MakeTinyPlan({.ranks = 2, .zero = 2, .offload_to_gpu_host = true, .max_grad_norm = 0});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "offload_downloads"));
  EXPECT_EQ(CountOp(state, "copy"), 2 * 4) << "gradients only";
  EXPECT_TRUE(FindTask(state, "rank0/h.1/grad_to_host")->after.empty());
  EXPECT_EQ(state.ranks[0].update_clip, state.ranks[0].clip);
}

TEST(OffloadPassTest, NothingMovesOnCpuWorkers) {
  const ModelSpec model = TinyGpt2();
  TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = 2});
  plan.parallel.offload = OffloadMode::kOptimizer;
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "offload_downloads"));
  EXPECT_FALSE(state.host_update);
  EXPECT_EQ(CountOp(state, "copy"), 0);
  EXPECT_EQ(state.ranks[1].update_grad, state.ranks[1].grad);
  EXPECT_EQ(state.ranks[1].update_clip, state.ranks[1].clip);
}

TrainingPlan ParameterOffloadPlan(int ranks, int zero) {
  TrainingPlan plan = MakeTinyPlan({.ranks = ranks, .zero = zero, .offload_to_gpu_host = true});
  plan.parallel.offload = OffloadMode::kParameters;
  return plan;
}

TEST(OffloadPassTest, UnderParameterOffloadEachUseReadsACopyAndGradientsGoDownAtOnce) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = ParameterOffloadPlan(1, 0);
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "update_optimizer"));
  EXPECT_TRUE(state.host_params);
  const Graph& graph = state.builder.graph();
  for (const StateObject& object : state.step.state) {
    EXPECT_NE(object.kind, StateKind::kMasterParameter) << "the parameters are the update's target";
    EXPECT_TRUE(graph.object(object.input).meta.device.is_cpu()) << graph.object(object.input).name;
  }
  // A copy up for the forward, prefetched one layer ahead (after the activation entering the
  // layer before), and another for the backward.
  const TaskSpec* forward = FindTask(state, "h.1/upload_forward");
  ASSERT_NE(forward, nullptr);
  EXPECT_EQ(forward->op, "copy");
  EXPECT_EQ(forward->device_kind, DeviceKind::kCuda);
  EXPECT_THAT(NamesOf(state, forward->inputs), ElementsAre("h.1.params"));
  EXPECT_THAT(AfterNames(state, *forward), ElementsAre("embedding/forward"));
  EXPECT_EQ(graph.object(forward->outputs[0]).role, ObjectRole::kGatheredParameter);
  EXPECT_THAT(NamesOf(state, FindTask(state, "h.1/forward")->inputs),
              ::testing::Contains("h.1/upload_forward:params"));
  ASSERT_NE(FindTask(state, "h.1/upload_backward"), nullptr);
  EXPECT_THAT(NamesOf(state, FindTask(state, "h.1/backward")->inputs),
              ::testing::Contains("h.1/upload_backward:params"));
  // The gradient goes down without waiting for the clipping factor, its norm is taken at once,
  // and the host updates the parameters in place: nothing goes back up.
  EXPECT_TRUE(FindTask(state, "h.1/grad_to_host")->after.empty());
  EXPECT_EQ(FindTask(state, "h.1/grad_norm")->priority, kBackwardPriority + 1);
  const TaskSpec* update = FindTask(state, "h.1/adamw");
  ASSERT_NE(update, nullptr);
  EXPECT_EQ(update->device_kind, DeviceKind::kCpu);
  EXPECT_EQ(NamesOf(state, update->inputs)[0], "h.1.params");
  EXPECT_FALSE(graph.FindTask("h.1/params_to_device").ok());
}

// A layer the plan keeps resident (ParallelConfig::resident_params) is ZeRO-Offload's: its
// parameters on the device, a host master, the download after the factor and the upload after
// the update; the others stream.
TEST(OffloadPassTest, AResidentLayerUnderParameterOffloadIsZeroOffloads) {
  const ModelSpec model = TinyGpt2();
  TrainingPlan plan = ParameterOffloadPlan(1, 0);
  plan.parallel.resident_params.assign(model.layers.size(), false);
  plan.parallel.resident_params[1] = true;  // h.0
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "update_optimizer"));
  const Graph& graph = state.builder.graph();
  EXPECT_FALSE(graph.FindTask("h.0/upload_forward").ok());
  EXPECT_THAT(NamesOf(state, FindTask(state, "h.0/forward")->inputs),
              ::testing::Contains("h.0.params"));
  EXPECT_THAT(AfterNames(state, *FindTask(state, "h.0/grad_to_host")), ElementsAre("clip_to_host"));
  ASSERT_NE(FindTask(state, "h.0/params_to_device"), nullptr);
  EXPECT_EQ(NamesOf(state, FindTask(state, "h.0/adamw")->inputs)[0], "h.0.master_params");
  ASSERT_NE(FindTask(state, "h.1/upload_forward"), nullptr);
  EXPECT_TRUE(FindTask(state, "h.1/grad_to_host")->after.empty());
  // A list that does not name every layer is refused.
  plan.parallel.resident_params.resize(2);
  EXPECT_EQ(PlanTrainingStep(model, plan, CpuRegistry()).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(OffloadPassTest, UnderParameterOffloadZero3UploadsEachShardThenGathers) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = ParameterOffloadPlan(2, 3);  // the state holds a reference
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "update_optimizer"));
  const TaskSpec* gather = FindTask(state, "rank1/h.0/gather_forward");
  ASSERT_NE(gather, nullptr);
  EXPECT_EQ(NamesOf(state, gather->inputs)[0], "rank1/h.0/upload_forward:params");
  EXPECT_THAT(NamesOf(state, FindTask(state, "rank1/h.0/upload_forward")->inputs),
              ElementsAre("rank1/h.0.params[shard]"));
}

TEST(OffloadPassTest, ParameterOffloadRefusesZero1And2OverSeveralRanks) {
  const ModelSpec model = TinyGpt2();
  for (int zero : {1, 2}) {
    Result<StepGraph> step = PlanTrainingStep(model, ParameterOffloadPlan(2, zero), CpuRegistry());
    EXPECT_EQ(step.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(step.status().message(), ::testing::HasSubstr("use --zero-stage 3"));
  }
}

}  // namespace
}  // namespace tessera::testing

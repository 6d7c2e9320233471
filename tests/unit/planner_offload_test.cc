// The offload pass (planner/offload_pass.cc): under a host update, the gradients and clipping
// factors go down to the host after the factor and at most three layers ahead of the updates,
// and the updated master pieces come back up; without one, nothing moves.
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

}  // namespace
}  // namespace tessera::testing

// The loss pass (planner/loss_pass.cc) and the clipping pass (planner/clipping_pass.cc).
#include <gmock/gmock.h>

#include "planner_test_util.h"

namespace tessera::testing {
namespace {

using ::testing::ElementsAre;

TEST(AddLossPassTest, MicroBatchLossesSummedScaledAndAllReduced) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .micro = 2});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "add_loss"));
  const TaskSpec* sum = FindTask(state, "rank1/loss/sum");
  ASSERT_NE(sum, nullptr);
  EXPECT_THAT(NamesOf(state, sum->inputs), ElementsAre("rank1/micro_loss@0", "rank1/micro_loss@1"));
  EXPECT_DOUBLE_EQ(sum->attrs.GetFloat("scale", 0), 0.25);
  const TaskSpec* total = FindTask(state, "rank1/loss/all_reduce");
  ASSERT_NE(total, nullptr);
  EXPECT_EQ(total->attrs.GetInt("group_size", 0), 2);
  EXPECT_EQ(state.builder.graph().object(state.step.loss).name, "rank0/loss");
  EXPECT_TRUE(state.builder.graph().IsOutput(state.step.loss));
  // One rank, one micro-batch: the loss layer's output is the loss.
  const TrainingPlan one = MakeTinyPlan({});
  PlanState single(model, one, CpuRegistry());
  ASSERT_OK(RunPassesThrough(single, "add_loss"));
  EXPECT_EQ(single.builder.graph().object(single.step.loss).name, "loss");
  EXPECT_EQ(CountOp(single, "sum_scalars"), 0);
}

// Sharded gradients: every worker's sum of squares all-reduced over every worker. Replicated
// ones in a pipeline: a rank's stages' sums all-reduced among them.
TEST(ClipGradientsPassTest, NormsAreReducedOverWhoeverHoldsParts) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan sharded_plan = MakeTinyPlan({.ranks = 2, .zero = 2, .micro = 2, .stages = 2});
  PlanState sharded(model, sharded_plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(sharded, "clip_gradients"));
  const TaskSpec* all = FindTask(sharded, "rank1/stage1/grad_norm/all_reduce");
  ASSERT_NE(all, nullptr);
  EXPECT_EQ(all->attrs.GetInt("group_size", 0), 4);
  EXPECT_EQ(all->attrs.GetInt("rank", -1), 3);  // stage 1, rank 1
  EXPECT_EQ(all->pinned_worker, WorkerId(103));
  const TrainingPlan replicated_plan =
      MakeTinyPlan({.ranks = 2, .zero = 0, .micro = 2, .stages = 2});
  PlanState replicated(model, replicated_plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(replicated, "clip_gradients"));
  const TaskSpec* stages = FindTask(replicated, "rank1/stage1/grad_norm/all_reduce");
  ASSERT_NE(stages, nullptr);
  EXPECT_EQ(stages->attrs.GetInt("group_size", 0), 2);
  EXPECT_EQ(stages->attrs.GetInt("rank", -1), 1);
  EXPECT_NE(
      stages->attrs.GetInt("collective", 0),
      FindTask(replicated, "rank0/stage1/grad_norm/all_reduce")->attrs.GetInt("collective", 0))
      << "each rank reduces over its own stages";
  // Each stage's worker has its clipping factor; rank 0 stage 0's norm is the output.
  ASSERT_EQ(replicated.ranks[1].clip.size(), 2u);
  EXPECT_EQ(replicated.builder.graph().object(replicated.ranks[1].clip[1]).name,
            "rank1/stage1/clip_scale");
  EXPECT_EQ(replicated.builder.graph().object(replicated.step.grad_norm).name,
            "rank0/stage0/grad_norm");
}

// One worker: the clip task sums the groups' squares itself; clipping off, the updates read a
// constant 1 instead of the factor.
TEST(ClipGradientsPassTest, OneWorkerSumsLocallyAndClippingOffIsAConstant) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = MakeTinyPlan({.max_grad_norm = 0});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "clip_gradients"));
  EXPECT_EQ(CountOp(state, "all_reduce"), 0);
  EXPECT_THAT(NamesOf(state, FindTask(state, "clip")->inputs),
              ElementsAre("embedding/grad_norm:sum", "h.0/grad_norm:sum", "h.1/grad_norm:sum",
                          "head/grad_norm:sum"));
  EXPECT_EQ(state.builder.graph().object(state.ranks[0].clip[0]).name, "clip_scale_one");
  EXPECT_TRUE(state.builder.graph().IsOutput(state.step.grad_norm)) << "reported either way";
}

}  // namespace
}  // namespace tessera::testing

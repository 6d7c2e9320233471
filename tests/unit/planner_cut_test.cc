// The cut pass (planner/pipeline_cut.cc): each layer's chunk and stage, and the cut it refuses.
// (BalancedChunks itself: pipeline_plan_test.)
#include <gmock/gmock.h>

#include "model/model.h"
#include "planner_test_util.h"

namespace tessera::testing {
namespace {

using ::testing::ElementsAre;

TEST(CutPipelinePassTest, EveryLayerOnStageZeroWithoutAPipeline) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = MakeTinyPlan({.ranks = 2});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "cut"));
  EXPECT_THAT(state.step.layer_chunk, ElementsAre(0, 0, 0, 0));
  EXPECT_THAT(state.step.layer_stage, ElementsAre(0, 0, 0, 0));
  EXPECT_EQ(state.stage_of_name.at("head"), 0);
}

TEST(CutPipelinePassTest, InterleavedChunksGoRoundTheStages) {
  const ModelSpec model = TinyGpt2();
  TrainingPlan plan = MakeTinyPlan({.micro = 2, .stages = 2});
  plan.parallel.schedule = PipelineSchedule::kInterleaved;
  plan.parallel.virtual_stages = 2;
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "cut"));
  // Four layers in four chunks; chunk c on stage c % 2.
  EXPECT_THAT(state.step.layer_chunk, ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(state.step.layer_stage, ElementsAre(0, 1, 0, 1));
  EXPECT_EQ(state.stage_of_name.at("h.0"), 1);
  EXPECT_EQ(state.builder.graph().num_objects(), 0) << "the cut adds nothing to the graph";
}

TEST(CutPipelinePassTest, GivenCostsMoveTheCutAndAStageWithoutStateToShardIsRefused) {
  const ModelSpec model = TinyGpt2();
  TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = 0, .micro = 2, .stages = 2});
  plan.parallel.layer_costs = {1, 1, 1, 10};
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "cut"));
  EXPECT_THAT(state.step.layer_stage, ElementsAre(0, 0, 0, 1));
  // Every stage of GPT-2 holds parameters; a model whose loss layer has none, cut alone onto
  // the last stage, leaves that stage nothing to shard.
  ModelBuilder builder("two_layers", CpuRegistry());
  ModelValue x = builder.Input("x", DType::kF32, Shape{1, 8});
  ModelValue y = builder.Input("y", DType::kI32, Shape{1}, /*label=*/true);
  ModelValue logits = builder.Layer("fc", {x}, [](LayerBuilder& l) {
    return l.Call("linear_forward", {l.input(0), l.Param("w", Shape{3, 8}, ParamInit::Zeros()),
                                     l.Param("b", Shape{3}, ParamInit::Zeros())});
  });
  builder.Loss("loss", {logits, y}, [](LayerBuilder& l) {
    return l.Call("softmax_cross_entropy", {l.input(0), l.input(1)});
  });
  ASSERT_OK_AND_ASSIGN(ModelSpec small, builder.Build());
  plan.parallel.layer_costs = {1, 1};
  plan.parallel.zero_stage = 2;
  PlanState sharded(small, plan, CpuRegistry());
  EXPECT_EQ(RunPassesThrough(sharded, "cut").message(),
            "pipeline stage 1 holds no parameters, but ZeRO stage 2 shards each stage's "
            "parameters over its 2 ranks: use fewer pipeline stages, give the layers costs that "
            "move the cut, or use --zero-stage 0");
}

}  // namespace
}  // namespace tessera::testing

// The pass pipeline (planner/plan_passes.h): its order, and PlanTrainingStep as nothing but the
// passes run over one state.
#include <gmock/gmock.h>

#include "planner_test_util.h"

namespace tessera::testing {
namespace {

using ::testing::ElementsAre;

TEST(PlanPassesTest, TheTrainingPassesInTheirOrder) {
  std::vector<std::string> names;
  for (const PlanPass& pass : TrainingPasses()) names.emplace_back(pass.name);
  EXPECT_THAT(names,
              ElementsAre("validate", "cut", "place_state", "expand_layers", "reduce_gradients",
                          "add_loss", "clip_gradients", "offload_downloads", "update_optimizer",
                          "order_schedule", "settle_reductions"));
}

TEST(PlanPassesTest, PlanTrainingStepIsThePassesOverOneState) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = 3, .micro = 2, .stages = 2});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "order_schedule"));
  ASSERT_OK_AND_ASSIGN(Graph built, state.builder.Build());
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  ASSERT_EQ(built.num_tasks(), step.graph.num_tasks());
  for (int i = 0; i < built.num_tasks(); ++i) {
    EXPECT_EQ(built.tasks()[static_cast<size_t>(i)].name,
              step.graph.tasks()[static_cast<size_t>(i)].name);
  }
  EXPECT_EQ(state.step.layer_stage, step.layer_stage);
  EXPECT_EQ(state.step.gather_reason, step.gather_reason);
  // A refusal stops the pipeline at its pass, before anything is added.
  TrainingPlan bad = plan;
  bad.parallel.workers.pop_back();
  PlanState refused(model, bad, CpuRegistry());
  EXPECT_FALSE(RunPassesThrough(refused, "order_schedule").ok());
  EXPECT_EQ(refused.builder.graph().num_objects(), 0);
}

}  // namespace
}  // namespace tessera::testing

// The optimizer pass (planner/optimizer_pass.cc): each update's target, addressing and names,
// and the gather that follows it where the policy asks for one.
#include <gmock/gmock.h>

#include "planner_test_util.h"

namespace tessera::testing {
namespace {

using ::testing::ElementsAre;

TEST(UpdateOptimizerPassTest, AdamWAddressesItsPieceOfTheGroup) {
  const ModelSpec model = TinyGpt2();
  // Per stage: the attribute placing rank 1's shard (param_offset: the shard inside the full
  // parameters; element_offset: the parameters are the shard), and the updated target's name.
  struct Want {
    std::string offset_attr;  // empty: neither
    std::string next;
  };
  const Want want[] = {
      {"", "rank1/h.0.params.next"},
      {"param_offset", "rank1/h.0.params.next"},
      {"param_offset", "rank1/h.0.params.next"},
      {"element_offset", "rank1/h.0.params[shard].next"},
  };
  for (int zero = 0; zero <= 3; ++zero) {
    SCOPED_TRACE("stage " + std::to_string(zero));
    const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = zero});
    PlanState state(model, plan, CpuRegistry());
    ASSERT_OK(RunPassesThrough(state, "update_optimizer"));
    const TaskSpec* adamw = FindTask(state, "rank1/h.0/adamw");
    ASSERT_NE(adamw, nullptr);
    for (const std::string attr : {"param_offset", "element_offset"}) {
      EXPECT_EQ(adamw->attrs.Has(attr), attr == want[zero].offset_attr) << attr;
    }
    if (!want[zero].offset_attr.empty()) {
      EXPECT_EQ(adamw->attrs.GetInt(want[zero].offset_attr, -1), state.step.group_numel[1] / 2);
    }
    EXPECT_EQ(state.builder.graph().object(adamw->outputs[0]).name, want[zero].next);
    EXPECT_EQ(adamw->donations.size(), 3u) << "in place";
    EXPECT_EQ(adamw->priority, kOptimizerPriority);
    // ZeRO-1/2 exchange the updated shards in place inside the full parameters.
    const Result<TaskId> gather = state.builder.graph().FindTask("rank1/h.0/all_gather");
    EXPECT_EQ(gather.ok(), zero == 1 || zero == 2);
    const StateObject& params = state.step.state[state.ranks[1].param[1]];
    if (gather.ok()) {
      const TaskSpec& task = state.builder.graph().task(*gather);
      EXPECT_EQ(task.op, "all_gather_in_place");
      EXPECT_THAT(NamesOf(state, task.outputs), ElementsAre("rank1/h.0.params.gathered"));
      EXPECT_EQ(params.output, task.outputs[0]);
    } else {
      EXPECT_EQ(params.output, adamw->outputs[0]);
    }
    EXPECT_TRUE(state.builder.graph().IsOutput(params.output));
    EXPECT_TRUE(state.builder.graph().IsOutput(state.step.state[state.ranks[1].exp_avg[1]].output));
  }
}

TEST(UpdateOptimizerPassTest, SgdUpdatesTheParametersWithTheFactorAndLearningRate) {
  const ModelSpec model = TinyGpt2();
  TrainingPlan plan = MakeTinyPlan({.ranks = 2});
  plan.optimizer.kind = OptimizerConfig::Kind::kSgd;
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "update_optimizer"));
  const TaskSpec* sgd = FindTask(state, "rank0/head/sgd");
  ASSERT_NE(sgd, nullptr);
  EXPECT_THAT(
      NamesOf(state, sgd->inputs),
      ElementsAre("rank0/head.params", "rank0/head.grad_reduced", "rank0/clip_scale", "lr"));
  EXPECT_THAT(NamesOf(state, sgd->outputs), ElementsAre("rank0/head.params.next"));
  EXPECT_EQ(CountOp(state, "adamw"), 0);
}

}  // namespace
}  // namespace tessera::testing

// The forward/backward expansion pass (planner/layer_expansion.cc): each rank's forwards and
// backwards per micro-batch, the gradient sums, split backwards, and the tasks it records for
// the schedule.
#include <fmt/format.h>
#include <gmock/gmock.h>

#include "planner_test_util.h"

namespace tessera::testing {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;

TEST(ExpandLayersPassTest, AForwardAndABackwardPerLayerRankAndMicroBatch) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .micro = 2});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "expand_layers"));
  for (int r = 0; r < 2; ++r) {
    const RankState& rank = state.ranks[static_cast<size_t>(r)];
    ASSERT_EQ(rank.losses.size(), 2u);
    for (size_t l = 0; l < 4; ++l) {
      for (size_t k = 0; k < 2; ++k) {
        const std::string suffix = "@" + std::to_string(k);
        const std::string prefix = "rank" + std::to_string(r) + "/" + model.layers[l].name;
        EXPECT_EQ(state.builder.graph().task(rank.forward_task[l][k]).name,
                  fmt::format("{}/forward{}", prefix, suffix));
        EXPECT_EQ(state.builder.graph().task(rank.backward_task[l][k]).name,
                  fmt::format("{}/backward{}", prefix, suffix));
        EXPECT_FALSE(rank.weight_task[l][k].valid()) << "nothing splits without being asked";
        EXPECT_EQ(state.builder.graph().task(rank.forward_task[l][k]).pinned_worker,
                  WorkerId(100 + r));
      }
    }
  }
  // The loss layer scales its gradient by 1 / (ranks x micro-batches) and names its loss.
  const TaskSpec* head = FindTask(state, "rank1/head/forward@1");
  ASSERT_NE(head, nullptr);
  EXPECT_DOUBLE_EQ(head->attrs.GetFloat("grad_scale", 0), 0.25);
  EXPECT_EQ(state.builder.graph().object(head->outputs[0]).name, "rank1/micro_loss@1");
  EXPECT_EQ(head->priority, kForwardPriority);
  EXPECT_EQ(FindTask(state, "rank1/head/backward@1")->priority, kBackwardPriority);
  // The tied classifier's part of the embedding's gradient is summed into the embedding's
  // backward (kGradientSoFar), and the second micro-batch's gradient accumulated in place.
  EXPECT_THAT(NamesOf(state, FindTask(state, "rank0/embedding/backward@0")->inputs),
              Contains("rank0/embedding.grad_from_head@0"));
  EXPECT_THAT(NamesOf(state, FindTask(state, "rank0/embedding/accumulate@1")->inputs),
              ElementsAre("rank0/embedding.grad@0", "rank0/embedding.grad@1"));
  EXPECT_EQ(state.last_gradient[0], 0u) << "the embedding's gradient is complete last";
}

// Split backwards (asked for, or under zb-h1): the blocks' backwards as input and weight
// halves, the weight half reading the stash first; the embedding (tied) and the head stay whole.
TEST(ExpandLayersPassTest, SplitBackwardsRunTheHalvesWhereTheyCan) {
  const ModelSpec model = TinyGpt2();
  TrainingPlan plan = MakeTinyPlan({});
  plan.parallel.split_backwards = true;
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "expand_layers"));
  EXPECT_FALSE(state.builder.graph().FindTask("h.0/backward").ok());
  const TaskSpec* input_half = FindTask(state, "h.0/backward_input");
  const TaskSpec* weight_half = FindTask(state, "h.0/backward_weight");
  ASSERT_NE(input_half, nullptr);
  ASSERT_NE(weight_half, nullptr);
  EXPECT_EQ(NamesOf(state, weight_half->inputs).front(), "h.0/backward_input:stash");
  EXPECT_THAT(NamesOf(state, input_half->outputs),
              ElementsAre("h.0/backward:dx", "h.0/backward_input:stash"));
  EXPECT_THAT(NamesOf(state, weight_half->outputs), ElementsAre("h.0.grad"));
  const RankState& rank = state.ranks[0];
  EXPECT_EQ(rank.backward_task[1][0], FindTask(state, "h.0/backward_input")->id);
  EXPECT_EQ(rank.weight_task[1][0], FindTask(state, "h.0/backward_weight")->id);
  EXPECT_NE(FindTask(state, "embedding/backward"), nullptr);
  EXPECT_NE(FindTask(state, "head/backward"), nullptr);
}

}  // namespace
}  // namespace tessera::testing

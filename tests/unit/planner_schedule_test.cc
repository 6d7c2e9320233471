// The schedule pass (planner/schedule_pass.cc): each worker's forwards and backwards chained by
// control edges in the order ScheduleOrder gives its stage, and nothing else chained.
#include <algorithm>

#include <gmock/gmock.h>

#include "planner_test_util.h"

namespace tessera::testing {
namespace {

int ControlEdges(const PlanState& state) {
  int edges = 0;
  for (const TaskSpec& task : state.builder.graph().tasks()) {
    edges += static_cast<int>(task.after.size());
  }
  return edges;
}

TEST(OrderSchedulePassTest, ChainsEachWorkersTasksInTheSchedulesOrder) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan =
      MakeTinyPlan({.ranks = 2, .micro = 2, .stages = 2, .schedule = PipelineSchedule::kGPipe});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "update_optimizer"));
  EXPECT_EQ(ControlEdges(state), 0);
  ASSERT_OK(OrderSchedulePass(state));
  const auto want = ScheduleOrder(PipelineSchedule::kGPipe, 2, 2, 1);
  EXPECT_EQ(state.step.schedule_order, want);
  // Per rank and stage, every forward and backward of its layers in one chain: each task after
  // the previous one, nothing else chained.
  const Graph& g = state.builder.graph();
  for (int r = 0; r < 2; ++r) {
    const RankState& rank = state.ranks[static_cast<size_t>(r)];
    for (int s = 0; s < 2; ++s) {
      std::vector<TaskId> chain;
      for (const PipelineOp& op : want[static_cast<size_t>(s)]) {
        std::vector<size_t> layers;
        for (size_t l = 0; l < 4; ++l) {
          if (state.step.layer_chunk[l] == op.chunk) layers.push_back(l);
        }
        const bool forward = op.kind == PipelineOp::Kind::kForward;
        if (!forward) std::reverse(layers.begin(), layers.end());
        for (size_t l : layers) {
          chain.push_back((forward ? rank.forward_task : rank.backward_task)[l][op.micro]);
        }
      }
      ASSERT_GE(chain.size(), 4u);
      EXPECT_TRUE(g.task(chain[0]).after.empty());
      for (size_t i = 1; i < chain.size(); ++i) {
        EXPECT_EQ(g.task(chain[i]).after, std::vector<TaskId>{chain[i - 1]})
            << g.task(chain[i]).name;
      }
    }
  }
  EXPECT_EQ(ControlEdges(state), 2 * (4 * 2 * 2 - 2)) << "one chain per rank and stage";
}

TEST(OrderSchedulePassTest, ZeroBubbleChainsTheWeightHalvesAndRecordsItsCosts) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan =
      MakeTinyPlan({.micro = 2, .stages = 2, .schedule = PipelineSchedule::kZbH1});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "order_schedule"));
  EXPECT_GT(state.step.schedule_costs.weight, 0) << "the op cost model's W";
  int weights_chained = 0;
  for (const TaskSpec& task : state.builder.graph().tasks()) {
    if (task.name.find("/backward_weight") != std::string::npos) {
      weights_chained += !task.after.empty();
    }
  }
  EXPECT_EQ(weights_chained, 2 * 2) << "both blocks' weight halves, per micro-batch";
}

TEST(OrderSchedulePassTest, NoPipelineNoEdges) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .micro = 2});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "order_schedule"));
  EXPECT_EQ(ControlEdges(state), 0);
  EXPECT_TRUE(state.step.schedule_order.empty());
}

}  // namespace
}  // namespace tessera::testing

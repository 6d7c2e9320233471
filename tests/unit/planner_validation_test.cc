// The validation pass (planner/plan_validation.cc): what it refuses, in what words, and the
// policy it leaves for the passes after it.
#include <gmock/gmock.h>

#include "planner_test_util.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

TEST(ValidatePlanPassTest, LeavesThePolicyOfTheStage) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = 2});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_EQ(state.sharding, nullptr);
  ASSERT_OK(ValidatePlanPass(state));
  ASSERT_NE(state.sharding, nullptr);
  EXPECT_EQ(state.sharding->name(), "ZeRO-2");
  EXPECT_EQ(state.builder.graph().num_objects(), 0) << "validation adds nothing to the graph";
}

Status Refusal(const TrainingPlan& plan) {
  const ModelSpec model = TinyGpt2();
  PlanState state(model, plan, CpuRegistry());
  return ValidatePlanPass(state);
}

TEST(ValidatePlanPassTest, RefusesWithWhatToChange) {
  TrainingPlan no_micro = MakeTinyPlan({});
  no_micro.parallel.micro_batches = 0;
  EXPECT_EQ(Refusal(no_micro).message(), "micro_batches must be >= 1, got 0");
  TrainingPlan uneven = MakeTinyPlan({.ranks = 3});
  EXPECT_EQ(Refusal(uneven).message(),
            "the batch of 8 rows does not split evenly over 3 worker(s) x 1 micro-batch(es): use "
            "a batch that is a multiple of 3 (e.g. 9), or change --workers / --micro-batches");
  TrainingPlan stage_four = MakeTinyPlan({.ranks = 2});
  stage_four.parallel.zero_stage = 4;
  EXPECT_THAT(Refusal(stage_four).message(), HasSubstr("ZeRO stage 4 does not exist"));
  TrainingPlan sgd = MakeTinyPlan({.ranks = 2, .zero = 1});
  sgd.optimizer.kind = OptimizerConfig::Kind::kSgd;
  EXPECT_EQ(Refusal(sgd).message(),
            "SGD has no optimizer state to shard: use ZeRO stage 0 or AdamW");
  sgd.parallel.data_parallel = 1;  // one rank: nothing is sharded
  sgd.parallel.workers.resize(1);
  EXPECT_OK(Refusal(sgd));
  TrainingPlan unbound = MakeTinyPlan({.ranks = 2});
  unbound.parallel.workers.clear();
  EXPECT_EQ(Refusal(unbound).message(),
            "2 data-parallel ranks x 1 pipeline stages need a worker each: run on a cluster with "
            "at least 2 workers");
}

}  // namespace
}  // namespace tessera::testing

// 0/1 Adam's schedule (planner/zero_one_adam.h) against DeepSpeed's ZeroOneAdam rules worked by
// hand: variance steps at multiples of an interval that doubles after every var_update_scaler
// of them, the other steps up to var_freeze_step compressed; then local steps, synchronising at
// multiples of an interval that doubles every local_step_scaler steps up to local_step_clipper.
#include <string>

#include <gmock/gmock.h>

#include "planner/zero_one_adam.h"

namespace tessera::testing {
namespace {

using Step = OptimizerConfig::ZeroOneStep;

OptimizerConfig Config() {
  OptimizerConfig config;
  config.kind = OptimizerConfig::Kind::kZeroOneAdam;
  config.var_freeze_step = 40;
  config.var_update_scaler = 4;
  config.local_step_scaler = 3;
  config.local_step_clipper = 4;
  return config;
}

// Steps 1-52 as letters: V variance, C compressed gradient, L local, S sync.
std::string Trace(ZeroOneAdamSchedule schedule, int steps) {
  std::string trace;
  for (int i = 0; i < steps; ++i) {
    trace += "VCLS"[static_cast<int>(schedule.Next())];
    schedule.Advance();
  }
  return trace;
}

TEST(ZeroOneAdamScheduleTest, FollowsDeepSpeedsRules) {
  // Variance at 1-4 (interval 1), 6-12 by 2, 16-28 by 4, then 32 and 40 (by 8); from 41 a sync
  // every step for 3 steps, every 2 for 3 (44, 46), then every 4 (48, 52).
  const std::string expected =
      "VVVV"
      "CVCVCVCV"
      "CCCVCCCVCCCVCCCV"
      "CCCVCCCCCCCV"  // steps 1-40
      "SSS"
      "SLS"
      "LSLLLS";  // steps 41-52
  ASSERT_EQ(expected.size(), 52u);
  EXPECT_EQ(Trace(ZeroOneAdamSchedule(Config()), 52), expected);
}

TEST(ZeroOneAdamScheduleTest, AResumedScheduleIsTheUninterruptedOnesRest) {
  const std::string whole = Trace(ZeroOneAdamSchedule(Config()), 70);
  for (int steps : {0, 4, 13, 40, 41, 45, 47, 60}) {
    const ZeroOneAdamSchedule resumed = ZeroOneAdamSchedule::After(Config(), steps);
    EXPECT_EQ(resumed.steps_taken(), steps);
    EXPECT_EQ(Trace(resumed, 70 - steps), whole.substr(static_cast<size_t>(steps)))
        << "after " << steps << " steps";
  }
}

TEST(ZeroOneAdamScheduleTest, TheRanksAreSynchronisedButAfterALocalStep) {
  ZeroOneAdamSchedule schedule(Config());
  EXPECT_TRUE(schedule.synchronized());
  for (int step = 1; step <= 52; ++step) {
    const Step kind = schedule.Next();
    schedule.Advance();
    EXPECT_EQ(schedule.synchronized(), kind != Step::kLocal) << "after step " << step;
  }
  EXPECT_EQ(schedule.local_step_interval(), 4);
  EXPECT_EQ(schedule.variance_interval(), 8);
  EXPECT_STREQ(ZeroOneStepName(Step::kCompressedGradient), "compressed-gradient");
}

TEST(ZeroOneAdamScheduleTest, TheLocalIntervalStopsAtTheClipper) {
  OptimizerConfig config = Config();
  config.local_step_scaler = 1;
  config.local_step_clipper = 2;
  const ZeroOneAdamSchedule schedule = ZeroOneAdamSchedule::After(config, 200);
  EXPECT_EQ(schedule.local_step_interval(), 2);
  EXPECT_EQ(Trace(schedule, 6), "LSLSLS");  // 201 local, 202 sync, ...
}

}  // namespace
}  // namespace tessera::testing

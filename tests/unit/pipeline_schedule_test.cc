// Pipeline schedules (planner/pipeline_schedule.h): every op once, dependencies respected, and the
// bubble and in-flight micro-batches of each order against the textbook figures.
#include "planner/pipeline_schedule.h"

#include <fmt/format.h>

#include <set>
#include <tuple>

#include "test_util.h"

namespace tessera::testing {
namespace {

using Kind = PipelineOp::Kind;

struct Case {
  PipelineSchedule schedule;
  int stages, micro, virtual_stages;
};

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (int p : {2, 4}) {
    for (int m : {4, 8, 16}) {
      cases.push_back({PipelineSchedule::kGPipe, p, m, 1});
      cases.push_back({PipelineSchedule::k1F1B, p, m, 1});
      cases.push_back({PipelineSchedule::kInterleaved, p, m, 2});
      cases.push_back({PipelineSchedule::kZbH1, p, m, 1});
    }
  }
  return cases;
}

OpCosts CostsOf(PipelineSchedule schedule) {
  // F = 1 and a backward of 2, split into B = W = 1 by zero-bubble schedules.
  return SplitsBackward(schedule) ? OpCosts{1, 1, 1} : OpCosts{1, 2, 0};
}

TEST(PipelineScheduleTest, EveryStageRunsEachOfItsOpsOnceInAnOrderThatCannotDeadlock) {
  for (const Case& c : AllCases()) {
    SCOPED_TRACE(fmt::format("{} P={} M={} V={}", ScheduleName(c.schedule), c.stages, c.micro,
                             c.virtual_stages));
    ASSERT_OK(CheckSchedule(c.schedule, c.stages, c.micro, c.virtual_stages));
    const auto orders = ScheduleOrder(c.schedule, c.stages, c.micro, c.virtual_stages);
    ASSERT_EQ(orders.size(), static_cast<size_t>(c.stages));
    for (int s = 0; s < c.stages; ++s) {
      std::set<std::tuple<Kind, int, int>> seen;
      for (const PipelineOp& op : orders[static_cast<size_t>(s)]) {
        EXPECT_EQ(op.chunk % c.stages, s) << ToString(op);
        EXPECT_TRUE(seen.emplace(op.kind, op.chunk, op.micro).second) << ToString(op);
      }
      const size_t kinds = SplitsBackward(c.schedule) ? 3 : 2;
      EXPECT_EQ(seen.size(), kinds * static_cast<size_t>(c.micro * c.virtual_stages));
      // Gradients accumulate in micro-batch order: each chunk's backwards are in order.
      std::vector<int> last_micro(static_cast<size_t>(c.stages * c.virtual_stages), -1);
      for (const PipelineOp& op : orders[static_cast<size_t>(s)]) {
        if (op.kind != Kind::kBackward) continue;
        EXPECT_EQ(op.micro, last_micro[static_cast<size_t>(op.chunk)] + 1) << ToString(op);
        last_micro[static_cast<size_t>(op.chunk)] = op.micro;
      }
    }
    EXPECT_OK(SimulateSchedule(orders, c.stages, c.virtual_stages, c.micro, CostsOf(c.schedule))
                  .status());
  }
}

TEST(PipelineScheduleTest, BubblesMatchTheTextbook) {
  for (const Case& c : AllCases()) {
    SCOPED_TRACE(fmt::format("{} P={} M={} V={}", ScheduleName(c.schedule), c.stages, c.micro,
                             c.virtual_stages));
    const auto orders = ScheduleOrder(c.schedule, c.stages, c.micro, c.virtual_stages);
    ASSERT_OK_AND_ASSIGN(
        ScheduleSimulation sim,
        SimulateSchedule(orders, c.stages, c.virtual_stages, c.micro, CostsOf(c.schedule)));
    const double theory = TheoreticalBubble(c.schedule, c.stages, c.micro, c.virtual_stages);
    EXPECT_NEAR(sim.bubble, theory, 1e-9) << "makespan " << sim.makespan;
  }
}

TEST(PipelineScheduleTest, InFlightMicroBatchesAreEachSchedulesBound) {
  for (const Case& c : AllCases()) {
    SCOPED_TRACE(fmt::format("{} P={} M={} V={}", ScheduleName(c.schedule), c.stages, c.micro,
                             c.virtual_stages));
    const auto orders = ScheduleOrder(c.schedule, c.stages, c.micro, c.virtual_stages);
    ASSERT_OK_AND_ASSIGN(
        ScheduleSimulation sim,
        SimulateSchedule(orders, c.stages, c.virtual_stages, c.micro, CostsOf(c.schedule)));
    for (int s = 0; s < c.stages; ++s) {
      const int peak = sim.peak_in_flight[static_cast<size_t>(s)];
      switch (c.schedule) {
        case PipelineSchedule::kGPipe:
          EXPECT_EQ(peak, c.micro) << "stage " << s;
          break;
        case PipelineSchedule::k1F1B:
          EXPECT_EQ(peak, c.stages - s) << "stage " << s;
          break;
        case PipelineSchedule::kInterleaved:
          // Megatron's warm-up: (P - s - 1) * 2 + (V - 1) * P chunk forwards, plus one; at
          // most every chunk of every micro-batch.
          EXPECT_EQ(peak, std::min((c.stages - s - 1) * 2 + (c.virtual_stages - 1) * c.stages + 1,
                                   c.micro * c.virtual_stages))
              << "stage " << s;
          break;
        case PipelineSchedule::kZbH1:
          // Activations live until W: one micro-batch more than 1F1B's peak (P, stage 0's).
          EXPECT_LE(peak, c.stages + 1) << "stage " << s;
          break;
      }
    }
  }
}

// ZB-H1 ordered by the costs it will run with: whatever the F : B : W ratio, its order is valid,
// holds at most P + 1 micro-batches, and leaves no more bubble than 1F1B doing the same work
// (B + W as one backward).
TEST(PipelineScheduleTest, ZeroBubbleOrderedByTheRealCostsBeatsOneFOneB) {
  for (const OpCosts costs : {OpCosts{1, 1, 1}, OpCosts{1, 1.5, 1}, OpCosts{1, 1.1, 0.3},
                              OpCosts{2, 1, 0.2}, OpCosts{1, 2, 2}}) {
    for (int stages : {2, 4}) {
      for (int micro : {4, 8, 16}) {
        SCOPED_TRACE(fmt::format("F {} B {} W {}, P={} M={}", costs.forward, costs.backward,
                                 costs.weight, stages, micro));
        const auto zb = ScheduleOrder(PipelineSchedule::kZbH1, stages, micro, 1, costs);
        ASSERT_OK_AND_ASSIGN(ScheduleSimulation zb_sim,
                             SimulateSchedule(zb, stages, 1, micro, costs));
        const auto one = ScheduleOrder(PipelineSchedule::k1F1B, stages, micro, 1);
        ASSERT_OK_AND_ASSIGN(
            ScheduleSimulation one_sim,
            SimulateSchedule(one, stages, 1, micro,
                             OpCosts{costs.forward, costs.backward + costs.weight, 0}));
        EXPECT_LE(zb_sim.makespan, one_sim.makespan + 1e-9);
        for (int peak : zb_sim.peak_in_flight) EXPECT_LE(peak, stages + 1);
        if (stages == 2 && costs.forward == costs.weight && costs.backward == costs.weight) {
          // The textbook bubble within 1F1B's memory (P micro-batches), as the paper's ZB-H1.
          EXPECT_NEAR(zb_sim.bubble, TheoreticalBubble(PipelineSchedule::kZbH1, 2, micro, 1), 1e-9);
          for (int peak : zb_sim.peak_in_flight) EXPECT_LE(peak, stages);
        }
      }
    }
  }
}

TEST(PipelineScheduleTest, BadSchedulesAreRefusedWithWhatToChange) {
  const std::vector<std::pair<Status, std::string>> cases = {
      {CheckSchedule(PipelineSchedule::k1F1B, 4, 2, 1),
       "schedule 1f1b needs at least as many micro-batches as pipeline stages (2 < 4): use "
       "--micro-batches 4 or more, or --schedule gpipe"},
      {CheckSchedule(PipelineSchedule::kInterleaved, 2, 6, 1),
       "the interleaved schedule needs --virtual-stages V >= 2 (chunks per stage); with V = 1 it "
       "is 1f1b"},
      {CheckSchedule(PipelineSchedule::kInterleaved, 4, 6, 2),
       "the interleaved schedule runs micro-batches in groups of the 4 stages: use a multiple of "
       "4 micro-batches (got 6)"},
      {CheckSchedule(PipelineSchedule::kGPipe, 2, 4, 2),
       "--virtual-stages 2 needs --schedule interleaved (schedule gpipe runs one chunk per "
       "stage)"},
      {CheckSchedule(PipelineSchedule::kGPipe, 0, 4, 1), "pipeline stages must be >= 1, got 0"},
  };
  for (const auto& [status, message] : cases) {
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(status.message(), message);
  }
  EXPECT_OK(CheckSchedule(PipelineSchedule::kGPipe, 4, 2, 1));  // GPipe takes M < P
  ASSERT_OK_AND_ASSIGN(PipelineSchedule zb, ParseSchedule("zb-h1"));
  EXPECT_EQ(zb, PipelineSchedule::kZbH1);
  EXPECT_EQ(ParseSchedule("pipedream").status().message(),
            "schedule 'pipedream' is not one of: gpipe, 1f1b, interleaved, zb-h1");
}

TEST(PipelineScheduleTest, AnOrderThatWaitsForItselfIsCaught) {
  // Stage 0 runs B0 before F0 of chunk 0 exists.
  const std::vector<std::vector<PipelineOp>> orders = {
      {{Kind::kBackward, 0, 0}, {Kind::kForward, 0, 0}},
      {{Kind::kForward, 1, 0}, {Kind::kBackward, 1, 0}}};
  const Status status = SimulateSchedule(orders, 2, 1, 1, OpCosts{}).status();
  EXPECT_EQ(status.message(), "schedule deadlocks: stage 0 waits at B0(c0)");
}

}  // namespace
}  // namespace tessera::testing

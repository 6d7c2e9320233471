// Pipeline schedules (planner/pipeline_schedule.h): every op once, dependencies respected, and the
// bubble and in-flight micro-batches of each order against the textbook figures.
#include "planner/pipeline_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <random>
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

// The references for the event-driven list schedule and simulation: the direct algorithms they
// replaced. The list schedule looks at every free stage at every op's end; the simulation sweeps
// every stage until nothing moves.
std::vector<std::vector<PipelineOp>> DirectListSchedule(int stages, int micro_batches,
                                                        OpCosts costs, int in_flight) {
  std::vector<std::vector<PipelineOp>> orders(static_cast<size_t>(stages));
  constexpr double kNever = std::numeric_limits<double>::infinity();
  const size_t p = static_cast<size_t>(stages), m = static_cast<size_t>(micro_batches);
  std::vector<std::vector<double>> f_end(p, std::vector<double>(m, kNever)), b_end = f_end;
  std::vector<int> next_f(p, 0), next_b(p, 0), next_w(p, 0);
  std::vector<double> free_at(p, 0.0);
  for (int done = 0; done < stages * micro_batches * 3;) {
    double now = kNever;
    for (size_t s = 0; s < p; ++s) {
      if (next_w[s] < micro_batches) now = std::min(now, free_at[s]);
    }
    bool progressed = false;
    for (int s = 0; s < stages; ++s) {
      const size_t i = static_cast<size_t>(s);
      if (next_w[i] >= micro_batches || free_at[i] > now) continue;
      const int b = next_b[i], f = next_f[i];
      const bool b_ready = b < micro_batches && b < f &&
                           (s == stages - 1 ? f_end[i][static_cast<size_t>(b)]
                                            : b_end[i + 1][static_cast<size_t>(b)]) <= now;
      const bool f_ready = f < micro_batches && f - b < stages - s && f - next_w[i] < in_flight &&
                           (s == 0 || f_end[i - 1][static_cast<size_t>(f)] <= now);
      double cost = 0;
      if (b_ready) {
        orders[i].push_back({Kind::kBackward, s, b});
        cost = costs.backward;
        b_end[i][static_cast<size_t>(b)] = now + cost;
        ++next_b[i];
      } else if (f_ready) {
        orders[i].push_back({Kind::kForward, s, f});
        cost = costs.forward;
        f_end[i][static_cast<size_t>(f)] = now + cost;
        ++next_f[i];
      } else if (next_w[i] < next_b[i]) {
        orders[i].push_back({Kind::kWeight, s, next_w[i]++});
        cost = costs.weight;
      } else {
        continue;
      }
      free_at[i] = now + cost;
      progressed = true;
      ++done;
    }
    if (progressed) continue;
    double next = kNever;
    for (double end : free_at) {
      if (end > now) next = std::min(next, end);
    }
    if (next == kNever) break;
    for (double& at : free_at) at = at <= now ? next : at;
  }
  return orders;
}

// The simulation by sweeps; an error names the first stuck stage and its op.
Result<ScheduleSimulation> DirectSimulation(const std::vector<std::vector<PipelineOp>>& orders,
                                            int micro_batches, const std::vector<OpCosts>& costs) {
  constexpr double kNotYet = -1;
  const int chunks = static_cast<int>(costs.size());
  auto index = [&](int chunk, int micro) {
    return static_cast<size_t>(chunk) * static_cast<size_t>(micro_batches) +
           static_cast<size_t>(micro);
  };
  const size_t n = static_cast<size_t>(chunks) * static_cast<size_t>(micro_batches);
  std::vector<double> f_end(n, kNotYet), b_end(n, kNotYet);
  const bool split =
      std::any_of(costs.begin(), costs.end(), [](const OpCosts& c) { return c.weight > 0; });
  const size_t p = orders.size();
  std::vector<size_t> next(p, 0);
  std::vector<double> free_at(p, 0), busy(p, 0);
  ScheduleSimulation result;
  result.peak_in_flight.assign(p, 0);
  std::vector<int> in_flight(p, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t s = 0; s < p; ++s) {
      for (; next[s] < orders[s].size(); ++next[s], progress = true) {
        const PipelineOp& op = orders[s][next[s]];
        const size_t i = index(op.chunk, op.micro);
        const OpCosts& cost = costs[static_cast<size_t>(op.chunk)];
        double ready = 0, took = 0;
        if (op.kind == Kind::kForward) {
          ready = op.chunk == 0 ? 0 : f_end[index(op.chunk - 1, op.micro)];
          took = cost.forward;
        } else if (op.kind == Kind::kBackward) {
          ready = f_end[i] == kNotYet      ? kNotYet
                  : op.chunk == chunks - 1 ? f_end[i]
                                           : b_end[index(op.chunk + 1, op.micro)];
          took = cost.backward;
        } else {
          ready = b_end[i];
          took = cost.weight;
        }
        if (ready == kNotYet) break;
        free_at[s] = std::max(ready, free_at[s]) + took;
        if (op.kind == Kind::kForward) f_end[i] = free_at[s];
        if (op.kind == Kind::kBackward) b_end[i] = free_at[s];
        busy[s] += took;
        if (op.kind == Kind::kForward) {
          result.peak_in_flight[s] = std::max(result.peak_in_flight[s], ++in_flight[s]);
        } else if ((op.kind == Kind::kWeight) == split) {
          --in_flight[s];
        }
      }
    }
  }
  double total_busy = 0;
  for (size_t s = 0; s < p; ++s) {
    if (next[s] != orders[s].size()) {
      return InvalidArgument("schedule deadlocks: stage {} waits at {}", s,
                             ToString(orders[s][next[s]]));
    }
    result.makespan = std::max(result.makespan, free_at[s]);
    result.stage_end.push_back(free_at[s]);
    total_busy += busy[s];
  }
  result.bubble =
      result.makespan > 0 ? 1.0 - total_busy / (result.makespan * static_cast<double>(p)) : 0;
  return result;
}

// Costs drawn from {1, 2, 3} (many ops end at the same time: ties decide the list schedule's
// order) or from (0.1, 3).
OpCosts RandomCosts(std::mt19937& random, bool small_integers, bool split) {
  auto draw = [&] {
    return small_integers ? static_cast<double>(1 + random() % 3)
                          : 0.1 + static_cast<double>(random() % 2900) / 1000;
  };
  OpCosts costs;
  costs.forward = draw();
  costs.backward = draw();
  costs.weight = split ? draw() : 0;
  return costs;
}

TEST(PipelineScheduleTest, ZeroBubbleOrdersAreTheDirectListSchedulesOpForOp) {
  std::mt19937 random(20261206);
  for (int trial = 0; trial < 300; ++trial) {
    const int stages = 1 + static_cast<int>(random() % 12);
    const int micro = stages + static_cast<int>(random() % 40);
    const OpCosts costs = RandomCosts(random, trial % 2 == 0, /*split=*/true);
    SCOPED_TRACE(fmt::format("P={} M={} F {} B {} W {}", stages, micro, costs.forward,
                             costs.backward, costs.weight));
    // ZB-H1 takes the list schedule holding P micro-batches unless P + 1 is faster.
    const auto tight = DirectListSchedule(stages, micro, costs, stages);
    const auto loose = DirectListSchedule(stages, micro, costs, stages + 1);
    const std::vector<OpCosts> stage_costs(static_cast<size_t>(stages), costs);
    ASSERT_OK_AND_ASSIGN(ScheduleSimulation tight_sim, DirectSimulation(tight, micro, stage_costs));
    ASSERT_OK_AND_ASSIGN(ScheduleSimulation loose_sim, DirectSimulation(loose, micro, stage_costs));
    const auto& expected = tight_sim.makespan <= loose_sim.makespan * (1 + 1e-9) ? tight : loose;
    const auto orders = ScheduleOrder(PipelineSchedule::kZbH1, stages, micro, 1, costs);
    ASSERT_EQ(orders.size(), expected.size());
    for (size_t s = 0; s < orders.size(); ++s) {
      ASSERT_EQ(orders[s].size(), expected[s].size()) << "stage " << s;
      for (size_t k = 0; k < orders[s].size(); ++k) {
        ASSERT_EQ(ToString(orders[s][k]), ToString(expected[s][k])) << "stage " << s << " op " << k;
      }
    }
  }
}

TEST(PipelineScheduleTest, SimulationsAreTheDirectSweepsBitForBit) {
  std::mt19937 random(1206);
  for (int trial = 0; trial < 400; ++trial) {
    const auto schedule = static_cast<PipelineSchedule>(trial % 4);
    const int stages = 1 + static_cast<int>(random() % 8);
    const int v =
        schedule == PipelineSchedule::kInterleaved ? 2 + static_cast<int>(random() % 2) : 1;
    int micro = stages + static_cast<int>(random() % 24);
    if (schedule == PipelineSchedule::kInterleaved) micro = (micro / stages) * stages;
    if (schedule == PipelineSchedule::kInterleaved && stages == 1) continue;
    ASSERT_OK(CheckSchedule(schedule, stages, micro, v));
    std::vector<OpCosts> costs;
    costs.reserve(static_cast<size_t>(stages) * static_cast<size_t>(v));
    for (int c = 0; c < stages * v; ++c) {
      costs.push_back(RandomCosts(random, trial % 3 == 0, SplitsBackward(schedule)));
    }
    std::vector<std::vector<PipelineOp>> orders =
        ScheduleOrder(schedule, stages, micro, v, costs.front());
    // Every fifth order has two ops of a stage swapped: valid or deadlocked, the same verdict.
    if (trial % 5 == 4) {
      auto& order = orders[random() % orders.size()];
      std::swap(order[random() % order.size()], order[random() % order.size()]);
    }
    SCOPED_TRACE(fmt::format("{} P={} M={} V={}", ScheduleName(schedule), stages, micro, v));
    const Result<ScheduleSimulation> expected = DirectSimulation(orders, micro, costs);
    const Result<ScheduleSimulation> sim = SimulateSchedule(orders, stages, v, micro, costs);
    ASSERT_EQ(sim.ok(), expected.ok()) << sim.status().ToString() << expected.status().ToString();
    if (!sim.ok()) {
      EXPECT_EQ(sim.status().message(), expected.status().message());
      continue;
    }
    EXPECT_EQ(sim->makespan, expected->makespan);
    EXPECT_EQ(sim->bubble, expected->bubble);
    EXPECT_EQ(sim->stage_end, expected->stage_end);
    EXPECT_EQ(sim->peak_in_flight, expected->peak_in_flight);
    EXPECT_EQ(PeakInFlight(orders, SplitsBackward(schedule)), expected->peak_in_flight);
  }
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

// The activation solver (planner/activation_solver.h): against brute force over every choice on
// random chains (up to 10 layers with three choices, 7 with partial keeps too, 16 with keep and
// recompute), and the classic cases (equal layers at half the memory keep half; the cheap layer
// is recomputed before the expensive one; a cheap partial keep before whole recomputes; swapping
// when the link hides it, recomputing when it does not; swapping a part where the whole does not
// fit beside the next forward), bad problems refused, impossible caps explained.
#include "planner/activation_solver.h"

#include <limits>
#include <random>
#include <string>

#include <fmt/format.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

// Every assignment of the allowed choices, evaluated by the cost model: the least step time of
// those that fit (infinity when none does).
double BruteForceBest(const ActivationProblem& problem) {
  const size_t n = problem.layers.size();
  std::vector<std::vector<ActivationDecision>> allowed(n);
  size_t total = 1;
  for (size_t i = 0; i < n; ++i) {
    allowed[i].push_back({ActivationChoice::kKeep});
    for (const PartialKeep& part : problem.layers[i].partial_keeps) {
      allowed[i].push_back({ActivationChoice::kKeepPart, part.rebuild});
    }
    if (problem.allow_recompute) {
      allowed[i].push_back({ActivationChoice::kRecompute});
      for (const PartialKeep& part : problem.layers[i].partial_keeps) {
        allowed[i].push_back({ActivationChoice::kRecompute, part.rebuild});
      }
    }
    if (problem.allow_swap && problem.link_bytes_per_us > 0) {
      allowed[i].push_back({ActivationChoice::kSwap});
      for (const PartialKeep& part : problem.layers[i].partial_keeps) {
        allowed[i].push_back({ActivationChoice::kSwap, part.rebuild});
      }
    }
    total *= allowed[i].size();
  }
  double best = std::numeric_limits<double>::infinity();
  std::vector<ActivationDecision> decisions(n);
  for (size_t code = 0; code < total; ++code) {
    size_t rest = code;
    for (size_t i = 0; i < n; ++i) {
      decisions[i] = allowed[i][rest % allowed[i].size()];
      rest /= allowed[i].size();
    }
    const ActivationPlan plan = EvaluateActivationPlan(problem, decisions);
    if (plan.fits) best = std::min(best, plan.step_us);
  }
  return best;
}

// `partial_keeps`: up to that many per layer, each keeping a random share at a random cost;
// `copies`: each layer's kept copies (micro-batches in flight) drawn from 1 .. copies.
ActivationProblem RandomProblem(std::mt19937& rng, size_t n, bool swap, int partial_keeps = 0,
                                int64_t copies = 1) {
  std::uniform_int_distribution<int64_t> bytes(1, 100);
  std::uniform_real_distribution<double> micros(1.0, 50.0);
  std::uniform_int_distribution<int> parts(0, partial_keeps);
  std::uniform_int_distribution<int64_t> kept_copies(1, copies);
  ActivationProblem problem;
  int64_t all = 0;
  for (size_t i = 0; i < n; ++i) {
    ActivationLayer layer{bytes(rng) * 1000, micros(rng), micros(rng)};
    layer.kept_copies = kept_copies(rng);
    layer.recompute_bytes = bytes(rng) * 100;
    for (int k = parts(rng); k > 0; --k) {
      const int64_t kept = layer.saved_bytes * bytes(rng) / 101;
      layer.partial_keeps.push_back({fmt::format("part{}", k), kept, micros(rng) / 4});
    }
    problem.layers.push_back(layer);
    problem.base_forward_bytes.push_back(bytes(rng) * 100);
    problem.base_backward_bytes.push_back(bytes(rng) * 100);
    all += layer.saved_bytes;
  }
  // Caps from tight to loose around what keeping everything needs.
  std::uniform_real_distribution<double> share(0.2, 1.1);
  problem.cap_bytes = static_cast<int64_t>(share(rng) * static_cast<double>(all + 10'000));
  problem.link_bytes_per_us = swap ? std::uniform_real_distribution<double>(200, 20'000)(rng) : 0;
  // Some links take compute time from each byte copied (a CPU worker's swap file).
  if (swap && bytes(rng) % 2 == 0) {
    problem.copy_compute_us_per_byte = std::uniform_real_distribution<double>(0, 1e-3)(rng);
  }
  problem.allow_swap = swap;
  return problem;
}

// The solver's plan against brute force on `problem`: both infeasible, or within 1% (the
// programme is exact; the tolerance is for rounding). Returns whether it was feasible.
bool MatchesBruteForce(const ActivationProblem& problem, const std::string& trial) {
  const double best = BruteForceBest(problem);
  Result<ActivationPlan> plan = SolveActivations(problem);
  if (std::isinf(best)) {
    EXPECT_EQ(plan.status().code(), StatusCode::kInfeasible) << trial;
    return false;
  }
  EXPECT_TRUE(plan.ok()) << trial << ": " << plan.status().ToString();
  if (!plan.ok()) return true;
  EXPECT_TRUE(plan->fits) << trial;
  EXPECT_LE(plan->peak_bytes, problem.cap_bytes) << trial;
  EXPECT_LE(plan->step_us, best * (1 + 1e-9)) << trial;
  EXPECT_GE(plan->step_us, best * (1 - 1e-9)) << trial;
  return true;
}

TEST(ActivationSolverTest, MatchesBruteForceOnRandomChainsOfUpToTenLayersWithThreeChoices) {
  std::mt19937 rng(7);
  int solved = 0, infeasible = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const size_t n = 1 + static_cast<size_t>(trial % 10);
    const ActivationProblem problem = RandomProblem(rng, n, /*swap=*/true);
    const bool feasible = MatchesBruteForce(problem, fmt::format("trial {}, {} layers", trial, n));
    ++(feasible ? solved : infeasible);
  }
  // The caps span both sides of feasibility.
  EXPECT_GT(solved, 100);
  EXPECT_GT(infeasible, 5);
}

// Partial keeps, and layers holding up to three micro-batches' copies of what they keep.
TEST(ActivationSolverTest, MatchesBruteForceWithPartialKeepsOnChainsOfUpToSevenLayers) {
  std::mt19937 rng(13);
  int solved = 0, infeasible = 0, kept_part = 0, swapped_part = 0;
  for (int trial = 0; trial < 150; ++trial) {
    const size_t n = 1 + static_cast<size_t>(trial % 7);
    const ActivationProblem problem = RandomProblem(rng, n, /*swap=*/trial % 2 == 0,
                                                    /*partial_keeps=*/2, /*copies=*/3);
    const bool feasible = MatchesBruteForce(problem, fmt::format("trial {}, {} layers", trial, n));
    ++(feasible ? solved : infeasible);
    Result<ActivationPlan> plan = SolveActivations(problem);
    if (!plan.ok()) continue;
    kept_part += plan->Count(ActivationChoice::kKeepPart);
    for (const ActivationDecision& decision : plan->decisions) {
      swapped_part += decision.choice == ActivationChoice::kSwap && !decision.rebuild.empty();
    }
  }
  EXPECT_GT(solved, 60);
  EXPECT_GT(infeasible, 5);
  // The partial keeps are taken, not only offered: kept, and swapped.
  EXPECT_GT(kept_part, 20);
  EXPECT_GT(swapped_part, 5);
}

TEST(ActivationSolverTest, MatchesBruteForceOnSixteenLayerChainsOfKeepAndRecompute) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 8; ++trial) {
    const ActivationProblem problem = RandomProblem(rng, 16, /*swap=*/false);
    MatchesBruteForce(problem, fmt::format("trial {}", trial));
    Result<ActivationPlan> plan = SolveActivations(problem);
    if (plan.ok()) {
      EXPECT_EQ(plan->Count(ActivationChoice::kSwap), 0);
    }
  }
}

ActivationProblem EqualLayers(size_t n, int64_t saved, double forward_us) {
  ActivationProblem problem;
  for (size_t i = 0; i < n; ++i) problem.layers.push_back({saved, forward_us, 2 * forward_us});
  problem.cap_bytes = saved * static_cast<int64_t>(n);
  return problem;
}

TEST(ActivationSolverTest, EqualLayersAtHalfTheMemoryKeepHalf) {
  // Twelve layers of 100 bytes peak at 1200 kept; at 600 the first five and the last fit.
  ActivationProblem problem = EqualLayers(12, 100, 10);
  problem.cap_bytes = 600;
  ASSERT_OK_AND_ASSIGN(ActivationPlan plan, SolveActivations(problem));
  EXPECT_EQ(plan.Count(ActivationChoice::kKeep), 6) << DescribeActivationPlan(plan, {});
  EXPECT_EQ(plan.Count(ActivationChoice::kRecompute), 6);
  EXPECT_EQ(plan.peak_bytes, 600);
  EXPECT_DOUBLE_EQ(plan.step_us, 12 * 30 + 6 * 10);
  // Uncapped, everything is kept and nothing is added.
  problem.cap_bytes = 1200;
  ASSERT_OK_AND_ASSIGN(ActivationPlan all, SolveActivations(problem));
  EXPECT_EQ(all.Count(ActivationChoice::kKeep), 12);
  EXPECT_DOUBLE_EQ(all.step_us, 12 * 30);
}

TEST(ActivationSolverTest, TheCheapLayerIsRecomputedBeforeTheExpensiveOne) {
  ActivationProblem problem;
  problem.layers = {{100, 50, 100}, {100, 5, 10}, {100, 50, 100}};
  problem.cap_bytes = 200;  // one of the first two must go
  ASSERT_OK_AND_ASSIGN(ActivationPlan plan, SolveActivations(problem));
  EXPECT_EQ(plan.decisions[0].choice, ActivationChoice::kKeep) << DescribeActivationPlan(plan, {});
  EXPECT_EQ(plan.decisions[1].choice, ActivationChoice::kRecompute);
  EXPECT_DOUBLE_EQ(plan.step_us, 150 + 15 + 150 + 5);
}

TEST(ActivationSolverTest, ACheapPartialKeepComesBeforeRecomputingWholeLayers) {
  // Six layers of 100 bytes under a cap of 400: each may keep 60 for 1 us of rebuilding, or
  // recompute its 10 us forward. Keeping part of all six (360 bytes, 6 us) beats recomputing
  // two (20 us).
  ActivationProblem problem = EqualLayers(6, 100, 10);
  for (ActivationLayer& layer : problem.layers) layer.partial_keeps = {{"lean", 60, 1}};
  problem.cap_bytes = 400;
  ASSERT_OK_AND_ASSIGN(ActivationPlan plan, SolveActivations(problem));
  // The last layer keeps its whole: its saved bytes are live at its backward in any case.
  EXPECT_EQ(plan.Count(ActivationChoice::kRecompute), 0) << DescribeActivationPlan(plan, {});
  EXPECT_EQ(plan.Count(ActivationChoice::kKeepPart), 5);
  EXPECT_EQ(plan.decisions[0], (ActivationDecision{ActivationChoice::kKeepPart, "lean"}));
  EXPECT_DOUBLE_EQ(plan.step_us, 6 * 30 + 5 * 1);
  // At 250 the partial keeps alone do not fit (5 x 60 + 100): one layer is recomputed.
  problem.cap_bytes = 250;
  ASSERT_OK_AND_ASSIGN(ActivationPlan tighter, SolveActivations(problem));
  EXPECT_LE(tighter.peak_bytes, 250);
  EXPECT_GT(tighter.Count(ActivationChoice::kRecompute), 0) << DescribeActivationPlan(tighter, {});
  EXPECT_GT(tighter.Count(ActivationChoice::kKeepPart), 0);
}

TEST(ActivationSolverTest, SwapsWhenTheLinkHidesTheCopiesAndRecomputesWhenItDoesNot) {
  ActivationProblem problem = EqualLayers(6, 1000, 10);
  problem.cap_bytes = 3000;
  // Copies of 1000 bytes at 1000 bytes/us take 1 us, under the next layer's 10 us forward.
  problem.link_bytes_per_us = 1000;
  ASSERT_OK_AND_ASSIGN(ActivationPlan fast_link, SolveActivations(problem));
  EXPECT_GT(fast_link.Count(ActivationChoice::kSwap), 0) << DescribeActivationPlan(fast_link, {});
  EXPECT_EQ(fast_link.Count(ActivationChoice::kRecompute), 0);
  EXPECT_DOUBLE_EQ(fast_link.step_us, 6 * 30);
  EXPECT_LE(fast_link.peak_bytes, 3000);
  // At 10 bytes/us a copy takes 100 us: recomputing (10 us) is cheaper.
  problem.link_bytes_per_us = 10;
  ASSERT_OK_AND_ASSIGN(ActivationPlan slow_link, SolveActivations(problem));
  EXPECT_EQ(slow_link.Count(ActivationChoice::kSwap), 0) << DescribeActivationPlan(slow_link, {});
  EXPECT_GT(slow_link.Count(ActivationChoice::kRecompute), 0);
}

TEST(ActivationSolverTest, APartIsSwappedWhereTheWholeDoesNotFitBesideTheNextForward) {
  // Six layers of 1000 bytes (10 us forward, 20 us backward) under a cap of 1500; each may keep
  // 400 for 1 us of rebuilding. A running layer holds all 1000 either way (under a partial keep
  // the rest is its kernels' scratch). A whole swap holds its 1000 bytes while the next forward
  // makes 1000: over the cap. Keeping part of every layer holds 6 x 400 besides: over too.
  // Swapping the parts (400 down while the next forward makes 1000) fits, and the last layer
  // keeps everything (it holds it all while it runs anyway: a part would only cost a rebuild):
  // five rebuilds, no recompute.
  ActivationProblem problem = EqualLayers(6, 1000, 10);
  for (ActivationLayer& layer : problem.layers) layer.partial_keeps = {{"lean", 400, 1}};
  problem.cap_bytes = 1500;
  problem.link_bytes_per_us = 1000;  // a 400-byte copy takes 0.4 us, under a 10 us forward
  ASSERT_OK_AND_ASSIGN(ActivationPlan plan, SolveActivations(problem));
  for (size_t j = 0; j < 5; ++j) {
    EXPECT_EQ(plan.decisions[j], (ActivationDecision{ActivationChoice::kSwap, "lean"}))
        << "layer " << j << ": " << DescribeActivationPlan(plan, {});
  }
  EXPECT_EQ(plan.decisions[5], (ActivationDecision{ActivationChoice::kKeep, ""}));
  EXPECT_DOUBLE_EQ(plan.step_us, 6 * 30 + 5 * 1);
  EXPECT_EQ(plan.peak_bytes, 1400);  // a layer being made, the part before it on its way down
  EXPECT_THAT(DescribeActivationPlan(plan, {}), HasSubstr("0 swap (lean)"));
  // Without the parts, only recomputes fit: dearer.
  for (ActivationLayer& layer : problem.layers) layer.partial_keeps.clear();
  ASSERT_OK_AND_ASSIGN(ActivationPlan whole, SolveActivations(problem));
  EXPECT_GT(whole.Count(ActivationChoice::kRecompute), 0) << DescribeActivationPlan(whole, {});
  EXPECT_GT(whole.step_us, plan.step_us);
}

TEST(ActivationSolverTest, CopiesThatTakeComputeTimeAreSwappedLess) {
  // The case above with copies free besides their time on the link: every layer but the last
  // swaps. When each byte copied takes compute time (a CPU worker's swap file), a swap of 1000
  // bytes costs 2 x 1000 x 0.004 = 8 us, more than keeping part (1 us) where that fits: only
  // what the cap needs is swapped, and the step costs what the copies take.
  ActivationProblem problem = EqualLayers(6, 1000, 10);
  for (ActivationLayer& layer : problem.layers) layer.partial_keeps = {{"lean", 400, 1}};
  problem.cap_bytes = 3000;
  problem.link_bytes_per_us = 1000;
  ASSERT_OK_AND_ASSIGN(ActivationPlan free, SolveActivations(problem));
  EXPECT_DOUBLE_EQ(free.step_us, 6 * 30);
  const int free_swaps = free.Count(ActivationChoice::kSwap);
  EXPECT_GE(free_swaps, 3) << DescribeActivationPlan(free, {});
  problem.copy_compute_us_per_byte = 0.004;
  ASSERT_OK_AND_ASSIGN(ActivationPlan taxed, SolveActivations(problem));
  EXPECT_LE(taxed.peak_bytes, 3000);
  EXPECT_LT(taxed.Count(ActivationChoice::kSwap), free_swaps) << DescribeActivationPlan(taxed, {});
  EXPECT_GT(taxed.Count(ActivationChoice::kKeepPart), 0) << DescribeActivationPlan(taxed, {});
  // What the plan's copies take is in its time: it matches the cost model's evaluation.
  EXPECT_DOUBLE_EQ(taxed.step_us, EvaluateActivationPlan(problem, taxed.decisions).step_us);
  EXPECT_GT(taxed.step_us, free.step_us);
}

TEST(ActivationSolverTest, BaseMemoryCountsAgainstTheCap) {
  ActivationProblem problem = EqualLayers(4, 100, 10);
  problem.cap_bytes = 400;
  problem.base_forward_bytes = {0, 0, 0, 0};
  problem.base_backward_bytes = {0, 0, 0, 200};  // the last backward holds 200 more
  ASSERT_OK_AND_ASSIGN(ActivationPlan plan, SolveActivations(problem));
  EXPECT_LE(plan.peak_bytes, 400);
  EXPECT_EQ(plan.Count(ActivationChoice::kKeep), 2) << DescribeActivationPlan(plan, {});
}

TEST(ActivationSolverTest, ACapNothingFitsUnderIsExplainedWithTheLeastPeak) {
  ActivationProblem problem = EqualLayers(3, 100, 10);
  problem.base_backward_bytes = {50, 50, 50};
  problem.cap_bytes = 120;
  Result<ActivationPlan> plan = SolveActivations(problem);
  EXPECT_EQ(plan.status().code(), StatusCode::kInfeasible);
  EXPECT_THAT(plan.status().message(),
              HasSubstr("the least they can hold (keep 0, keep part 0, recompute 3, swap 0) peaks "
                        "at 150 bytes; raise the cap by 30 bytes"));
}

TEST(ActivationSolverTest, BadProblemsAreRefusedNamingTheField) {
  ActivationProblem problem = EqualLayers(2, 100, 10);
  problem.cap_bytes = 0;
  EXPECT_THAT(SolveActivations(problem).status().message(), HasSubstr("device cap must be > 0"));
  problem.cap_bytes = 100;
  problem.base_forward_bytes = {1, 2, 3};
  EXPECT_THAT(SolveActivations(problem).status().message(), HasSubstr("3 entries for 2 layers"));
  problem.base_forward_bytes.clear();
  problem.layers[1].forward_us = -1;
  EXPECT_THAT(SolveActivations(problem).status().message(), HasSubstr("activation layer 1"));
  problem.layers[1].forward_us = 10;
  problem.layers[0].partial_keeps = {{"lean", 100, 1}};  // keeps the whole: no partial keep
  EXPECT_THAT(SolveActivations(problem).status().message(),
              HasSubstr("partial keep 'lean' keeps 100 of 100 bytes"));
}

TEST(ActivationSolverTest, DescribeNamesEveryLayersChoice) {
  ActivationPlan plan;
  plan.decisions = {{ActivationChoice::kKeep},
                    {ActivationChoice::kKeepPart, "norms_gelu"},
                    {ActivationChoice::kRecompute},
                    {ActivationChoice::kSwap}};
  EXPECT_EQ(DescribeActivationPlan(plan, {"h.0", "h.1", "h.2", "h.3"}),
            "keep 1, keep part 1, recompute 1, swap 1: h.0 keep, h.1 keep part (norms_gelu), h.2 "
            "recompute, h.3 swap");
}

}  // namespace
}  // namespace tessera::testing

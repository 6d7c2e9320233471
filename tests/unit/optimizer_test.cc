// Optimizer and gradient-norm ops against naive references.
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "ops/cpu/kernels.h"

#include "test_util.h"

namespace tessera::testing {
namespace {

// torch.optim.AdamW's single-tensor update for one element, in double.
struct NaiveAdamW {
  double p, m, v;
  void Step(double g, double lr, double beta1, double beta2, double eps, double wd, int step) {
    p *= 1 - lr * wd;
    m = beta1 * m + (1 - beta1) * g;
    v = beta2 * v + (1 - beta2) * g * g;
    const double bc1 = 1 - std::pow(beta1, step), bc2 = 1 - std::pow(beta2, step);
    p -= lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
  }
};

TEST(OptimizerTest, AdamWMatchesNaiveUpdateWithDecayRangesAndClipping) {
  const int64_t n = 1000;
  Tensor param = RandomTensor({n}, 1), grad = RandomTensor({n}, 2);
  Tensor m = RandomTensor({n}, 3, 0.1f), v = RandomTensor({n}, 4, 0.1f);
  for (int64_t i = 0; i < n; ++i) v.data<float>()[i] = std::abs(v.data<float>()[i]);
  std::vector<NaiveAdamW> naive(n);
  for (int64_t i = 0; i < n; ++i) {
    naive[i] = {param.data<float>()[i], m.data<float>()[i], v.data<float>()[i]};
  }
  // This tensor is the shard [500, 1500) of a group whose decayed ranges are [400, 700) and
  // [900, 1000): decay applies to local elements [0, 200) and [400, 500).
  const Attrs attrs{{"beta1", 0.9},
                    {"beta2", 0.95},
                    {"eps", 1e-8},
                    {"weight_decay", 0.1},
                    {"element_offset", int64_t{500}},
                    {"decay_ranges", std::vector<int64_t>{400, 700, 900, 1000}}};
  const float lr = 0.01f, clip = 0.5f;
  for (int step = 1; step <= 3; ++step) {
    ASSERT_OK_AND_ASSIGN(auto out, RunKernel("adamw",
                                             {param, grad, m, v, ScalarTensor(clip),
                                              ScalarTensor(lr), Int64Scalar(step)},
                                             attrs));
    param = out[0];
    m = out[1];
    v = out[2];
    for (int64_t i = 0; i < n; ++i) {
      const bool decay = (i < 200) || (i >= 400 && i < 500);
      naive[i].Step(static_cast<double>(grad.data<float>()[i]) * clip, lr, 0.9, 0.95, 1e-8,
                    decay ? 0.1 : 0.0, step);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(param.data<float>()[i], naive[i].p, 1e-5 * (1 + std::abs(naive[i].p))) << i;
    ASSERT_NEAR(m.data<float>()[i], naive[i].m, 1e-6) << i;
    ASSERT_NEAR(v.data<float>()[i], naive[i].v, 1e-6) << i;
  }
}

TEST(OptimizerTest, EveryAdamWInstructionSetMatchesTheNaiveUpdate) {
  // Odd lengths and decay boundaries off the vector width exercise the bodies and the tails.
  const int64_t n = 70'001;
  const std::vector<int64_t> decay_ranges{3, 40'017, 50'001, 69'999};
  const Tensor param0 = RandomTensor({n}, 11), grad = RandomTensor({n}, 12);
  const Tensor m0 = RandomTensor({n}, 13, 0.1f);
  Tensor v0 = RandomTensor({n}, 14, 0.1f);
  for (int64_t i = 0; i < n; ++i) v0.data<float>()[i] = std::abs(v0.data<float>()[i]);
  const cpu::AdamWConfig config{0.9f, 0.95f, 1e-8f, 0.1f};
  const float lr = 0.01f, grad_scale = 0.5f;
  const int steps = 3;
  std::vector<NaiveAdamW> naive(n);
  for (int64_t i = 0; i < n; ++i) {
    naive[i] = {param0.data<float>()[i], m0.data<float>()[i], v0.data<float>()[i]};
    const bool decay = (i >= 3 && i < 40'017) || (i >= 50'001 && i < 69'999);
    for (int step = 1; step <= steps; ++step) {
      naive[i].Step(static_cast<double>(grad.data<float>()[i]) * grad_scale, lr, 0.9, 0.95, 1e-8,
                    decay ? 0.1 : 0.0, step);
    }
  }
  const auto run = [&](cpu::KernelExecution execution) {
    std::vector<float> p = ToVector(param0), m = ToVector(m0), v = ToVector(v0);
    for (int step = 1; step <= steps; ++step) {
      cpu::AdamWUpdate(p.data(), m.data(), v.data(), grad.data<float>(), n, config, lr, step,
                       grad_scale, decay_ranges.data(), 2, 0, execution);
    }
    return std::array{p, m, v};
  };
  std::vector<cpu::SimdLevel> levels{cpu::SimdLevel::kScalar};
  if (cpu::BestSimdLevel() >= cpu::SimdLevel::kAvx2) levels.push_back(cpu::SimdLevel::kAvx2);
  if (cpu::BestSimdLevel() >= cpu::SimdLevel::kAvx512) levels.push_back(cpu::SimdLevel::kAvx512);
  for (cpu::SimdLevel level : levels) {
    SCOPED_TRACE(std::string(cpu::SimdLevelName(level)));
    const auto parallel = run({.simd = level, .parallel = true});
    const auto sequential = run({.simd = level, .parallel = false});
    // Splitting the group across threads changes nothing, bit for bit.
    ASSERT_EQ(parallel, sequential);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(parallel[0][i], naive[i].p, 1e-5 * (1 + std::abs(naive[i].p))) << i;
      ASSERT_NEAR(parallel[1][i], naive[i].m, 1e-6) << i;
      ASSERT_NEAR(parallel[2][i], naive[i].v, 1e-6) << i;
    }
  }
}

TEST(OptimizerTest, AdamWRejectsStepZero) {
  Tensor p = RandomTensor({4}, 1);
  Result<std::vector<Tensor>> out =
      RunKernel("adamw", {p, p, p, p, ScalarTensor(1), ScalarTensor(0.1f), Int64Scalar(0)});
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("step must be >= 1"), std::string::npos);
}

// DeepSpeed's OnebitAdam for one element, in double: Adam without bias correction, the weight
// decay added to the update; after the freeze step the variance stays and the momentum is the
// ranks' average (here: given).
struct NaiveOneBitAdam {
  double p, m, v;
  void Warmup(double g, double lr, double beta1, double beta2, double eps, double wd) {
    m = beta1 * m + (1 - beta1) * g;
    v = beta2 * v + (1 - beta2) * g * g;
    p -= lr * (m / (std::sqrt(v) + eps) + wd * p);
  }
  void Frozen(double averaged_m, double lr, double eps, double wd) {
    m = averaged_m;
    p -= lr * (m / (std::sqrt(v) + eps) + wd * p);
  }
};

TEST(OptimizerTest, OneBitAdamsPhasesMatchTheNaiveUpdateWithDecayRangesAndClipping) {
  constexpr int64_t kCount = 1000;
  Tensor param = RandomTensor({kCount}, 1), grad = RandomTensor({kCount}, 2);
  Tensor m = FloatTensor({kCount}, std::vector<float>(kCount, 0.f)), v = m;
  std::vector<NaiveOneBitAdam> naive;
  for (float x : ToVector(param)) naive.push_back({x, 0, 0});
  // Element 0 of this piece is element 300 of the group: decay on [100, 400) and [600, 1000)
  // of the group is on [0, 100) and [300, 700) here.
  const Attrs attrs{{"beta1", 0.9},
                    {"beta2", 0.999},
                    {"eps", 1e-8},
                    {"weight_decay", 0.01},
                    {"element_offset", int64_t{300}},
                    {"decay_ranges", std::vector<int64_t>{100, 400, 600, 1000}}};
  const auto decays = [](int64_t i) { return i < 100 || (i >= 300 && i < 700); };
  const float lr = 0.01f, clip = 0.5f;
  for (int step = 1; step <= 3; ++step) {
    ASSERT_OK_AND_ASSIGN(
        auto out,
        RunKernel("onebit_adam", {param, grad, m, v, ScalarTensor(clip), ScalarTensor(lr)}, attrs));
    param = out[0];
    m = out[1];
    v = out[2];
    for (int64_t i = 0; i < kCount; ++i) {
      naive[i].Warmup(static_cast<double>(grad.data<float>()[i]) * clip, lr, 0.9, 0.999, 1e-8,
                      decays(i) ? 0.01 : 0.0);
    }
  }
  // The compressed phase: this rank's momentum, then (standing in for the compressed average)
  // that momentum scaled, then the frozen update.
  ASSERT_OK_AND_ASSIGN(auto momentum,
                       RunKernel("onebit_adam_momentum", {m, grad, ScalarTensor(clip)}, attrs));
  std::vector<float> averaged = ToVector(momentum[0]);
  for (int64_t i = 0; i < kCount; ++i) {
    const double expected =
        0.9 * naive[i].m + 0.1 * static_cast<double>(grad.data<float>()[i]) * clip;
    EXPECT_NEAR(averaged[i], expected, 1e-6 * (1 + std::abs(expected))) << i;
    averaged[i] *= 0.75f;
  }
  ASSERT_OK_AND_ASSIGN(
      auto frozen, RunKernel("onebit_adam_frozen",
                             {param, FloatTensor({kCount}, averaged), v, ScalarTensor(lr)}, attrs));
  for (int64_t i = 0; i < kCount; ++i) {
    naive[i].Frozen(averaged[i], lr, 1e-8, decays(i) ? 0.01 : 0.0);
    EXPECT_NEAR(frozen[0].data<float>()[i], naive[i].p, 1e-5 * (1 + std::abs(naive[i].p))) << i;
    EXPECT_NEAR(v.data<float>()[i], naive[i].v, 1e-6 * (1 + naive[i].v)) << i;
  }
  // Odd decay ranges are refused by name.
  Attrs odd = attrs;
  odd.Set("decay_ranges", std::vector<int64_t>{1, 2, 3});
  const Status refused =
      RunKernel("onebit_adam_frozen", {param, m, v, ScalarTensor(lr)}, odd).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("decay_ranges"), std::string::npos);
}

// DeepSpeed's ZeroOneAdam for one element, in double (ops/cpu/kernels.h's arithmetic): the
// compressed-gradient step's update, a local step (u: the parameter at the interval's start, then
// at a sync the move since, times sqrt(v) + eps), and the sync's end (u: the ranks' average).
struct NaiveZeroOneAdam {
  double p, m, v, u;
  double Denominator(double eps) const { return std::sqrt(v) + eps; }
  void Compressed(double averaged_g, double lr, double beta1, double eps, double wd) {
    m = beta1 * m + (1 - beta1) * averaged_g;
    p -= lr * (m / Denominator(eps) + wd * p);
  }
  void Local(double g, double lr, double beta1, double eps, double wd, bool sync) {
    m = beta1 * m + (1 - beta1) * g;
    p -= lr * (m / Denominator(eps) + wd * p);
    if (sync) {
      const double delta = p - u;
      p = u;
      u = delta * Denominator(eps);
    }
  }
  void SyncEnd(double averaged_u, double lr_sum, double eps, double wd) {
    m = -averaged_u / lr_sum - wd * p * Denominator(eps);
    p += averaged_u / Denominator(eps);
    u = p;
  }
};

TEST(OptimizerTest, ZeroOneAdamsStepsMatchTheNaiveUpdateWithDecayRanges) {
  constexpr int64_t kCount = 1000;
  const Tensor grad = RandomTensor({kCount}, 2);
  Tensor param = RandomTensor({kCount}, 1), m = RandomTensor({kCount}, 3, 0.1f);
  Tensor v = RandomTensor({kCount}, 4, 0.1f);
  for (int64_t i = 0; i < kCount; ++i) v.data<float>()[i] = std::abs(v.data<float>()[i]);
  std::vector<NaiveZeroOneAdam> naive;
  for (int64_t i = 0; i < kCount; ++i) {
    naive.push_back({param.data<float>()[i], m.data<float>()[i], v.data<float>()[i], 0.0});
  }
  // Decay on [100, 400) and [600, 1000) of the group, element 300 of which is element 0 here.
  Attrs attrs{{"beta1", 0.9},
              {"eps", 1e-8},
              {"weight_decay", 0.01},
              {"element_offset", int64_t{300}},
              {"decay_ranges", std::vector<int64_t>{100, 400, 600, 1000}}};
  const auto decays = [](int64_t i) { return i < 100 || (i >= 300 && i < 700); };
  Tensor u;  // the interval start, from the first local step on
  const auto expect_near = [&](const char* what, int step) {
    for (int64_t i = 0; i < kCount; ++i) {
      const NaiveZeroOneAdam& e = naive[static_cast<size_t>(i)];
      ASSERT_NEAR(param.data<float>()[i], e.p, 2e-5 * (1 + std::abs(e.p))) << what << step << i;
      ASSERT_NEAR(m.data<float>()[i], e.m, 2e-5 * (1 + std::abs(e.m))) << what << step << i;
      ASSERT_NEAR(u.data<float>()[i], e.u, 2e-5 * (1 + std::abs(e.u))) << what << step << i;
    }
  };
  // A compressed-gradient step (the average standing in: the gradient itself).
  ASSERT_OK_AND_ASSIGN(auto compressed, RunKernel("zero_one_adam_compressed",
                                                  {param, grad, m, v, ScalarTensor(0.01f)}, attrs));
  param = compressed[0];
  m = compressed[1];
  for (int64_t i = 0; i < kCount; ++i) {
    naive[static_cast<size_t>(i)].Compressed(grad.data<float>()[i], 0.01, 0.9, 1e-8,
                                             decays(i) ? 0.01 : 0.0);
  }
  u = FloatTensor({kCount}, ToVector(param));  // the interval starts here
  for (NaiveZeroOneAdam& e : naive) e.u = e.p;
  expect_near("compressed", 0);
  // Three local steps at different rates and clipping factors, the last one a sync.
  const float lrs[] = {0.01f, 0.02f, 0.005f}, clips[] = {1.0f, 0.5f, 0.8f};
  double lr_sum = 0;
  for (int step = 0; step < 3; ++step) {
    const bool sync = step == 2;
    Attrs local = attrs;
    local.Set("sync", int64_t{sync ? 1 : 0});
    ASSERT_OK_AND_ASSIGN(auto out, RunKernel("zero_one_adam_local",
                                             {param, grad, m, v, u, ScalarTensor(clips[step]),
                                              ScalarTensor(lrs[step])},
                                             local));
    param = out[0];
    m = out[1];
    u = out[3];
    lr_sum += lrs[step];
    for (int64_t i = 0; i < kCount; ++i) {
      naive[static_cast<size_t>(i)].Local(static_cast<double>(grad.data<float>()[i]) * clips[step],
                                          lrs[step], 0.9, 1e-8, decays(i) ? 0.01 : 0.0, sync);
    }
    expect_near("local", step);
  }
  // The ranks' average standing in: this rank's buffer scaled.
  std::vector<float> averaged = ToVector(u);
  for (float& x : averaged) x *= 0.75f;
  ASSERT_OK_AND_ASSIGN(auto synced, RunKernel("zero_one_adam_sync",
                                              {param, m, v, FloatTensor({kCount}, averaged),
                                               ScalarTensor(static_cast<float>(lr_sum))},
                                              attrs));
  param = synced[0];
  m = synced[1];
  u = synced[3];
  for (int64_t i = 0; i < kCount; ++i) {
    naive[static_cast<size_t>(i)].SyncEnd(averaged[static_cast<size_t>(i)], lr_sum, 1e-8,
                                          decays(i) ? 0.01 : 0.0);
  }
  expect_near("sync", 3);
  // The sync needs the interval's learning rates.
  const Status refused =
      RunKernel("zero_one_adam_sync", {param, m, v, u, ScalarTensor(0.0f)}, attrs).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("lr_sum"), std::string::npos);
}

// On one rank, a sync every step is 1-bit Adam's frozen update: the weight decay stays out of
// the momentum the sync recovers.
TEST(OptimizerTest, ZeroOneAdamsSyncEveryStepIsOneBitAdamsFrozenUpdate) {
  constexpr int64_t kCount = 500;
  const Tensor grad = RandomTensor({kCount}, 7);
  Tensor v = RandomTensor({kCount}, 8, 0.1f);
  for (int64_t i = 0; i < kCount; ++i) v.data<float>()[i] = std::abs(v.data<float>()[i]) + 1e-4f;
  const Tensor param = RandomTensor({kCount}, 9), m = RandomTensor({kCount}, 10, 0.1f);
  const Tensor start = FloatTensor({kCount}, ToVector(param));
  const Attrs attrs{{"beta1", 0.9}, {"eps", 1e-8}, {"weight_decay", 0.1}, {"sync", int64_t{1}}};
  const float lr = 0.01f, clip = 0.7f;
  ASSERT_OK_AND_ASSIGN(
      auto local,
      RunKernel("zero_one_adam_local",
                {param, grad, m, v, start, ScalarTensor(clip), ScalarTensor(lr)}, attrs));
  ASSERT_OK_AND_ASSIGN(
      auto synced, RunKernel("zero_one_adam_sync",
                             {local[0], local[1], local[2], local[3], ScalarTensor(lr)}, attrs));
  ASSERT_OK_AND_ASSIGN(auto momentum,
                       RunKernel("onebit_adam_momentum", {m, grad, ScalarTensor(clip)}, attrs));
  ASSERT_OK_AND_ASSIGN(auto frozen, RunKernel("onebit_adam_frozen",
                                              {param, momentum[0], v, ScalarTensor(lr)}, attrs));
  for (int64_t i = 0; i < kCount; ++i) {
    const float want_p = frozen[0].data<float>()[i], want_m = momentum[0].data<float>()[i];
    EXPECT_NEAR(synced[0].data<float>()[i], want_p, 1e-6 * (1 + std::abs(want_p))) << i;
    EXPECT_NEAR(synced[1].data<float>()[i], want_m, 1e-5 * (1 + std::abs(want_m))) << i;
    EXPECT_EQ(synced[3].data<float>()[i], synced[0].data<float>()[i]) << i;  // the next start
  }
}

TEST(OptimizerTest, ScaleMultipliesInPlace) {
  ASSERT_OK_AND_ASSIGN(
      auto out, RunKernel("scale", {FloatTensor({3}, {1.f, -2.f, 4.f}), ScalarTensor(0.5f)}));
  EXPECT_EQ(ToVector(out[0]), (std::vector<float>{0.5f, -1.f, 2.f}));
}

// ZeRO-1/2: a shard's 1-bit Adam updates (param_offset) inside the full parameters write the
// bits the whole group's update writes there and leave the rest as they were; the compressed
// phase's frozen update reads the whole (averaged) momentum at the same offset.
TEST(OptimizerTest, OneBitAdamsShardUpdatesAreTheGroupsOnTheirPiece) {
  constexpr int64_t kCount = 256, kBegin = 128, kShard = 128;
  const Tensor param = RandomTensor({kCount}, 3), grad = RandomTensor({kCount}, 4);
  const Tensor zeros = FloatTensor({kCount}, std::vector<float>(kCount, 0.f));
  const Attrs whole{{"weight_decay", 0.01}, {"decay_ranges", std::vector<int64_t>{0, 200}}};
  Attrs shard = whole;
  shard.Set("param_offset", kBegin);
  const auto piece = [](const Tensor& t, int64_t begin, int64_t numel) {
    const std::vector<float> all = ToVector(t);
    return std::vector<float>(all.begin() + begin, all.begin() + begin + numel);
  };
  const Tensor lr = ScalarTensor(0.01f), clip = ScalarTensor(0.5f);
  ASSERT_OK_AND_ASSIGN(auto full,
                       RunKernel("onebit_adam", {param, grad, zeros, zeros, clip, lr}, whole));
  const Tensor shard_zeros = FloatTensor({kShard}, std::vector<float>(kShard, 0.f));
  ASSERT_OK_AND_ASSIGN(
      auto part, RunKernel("onebit_adam",
                           {param, FloatTensor({kShard}, piece(grad, kBegin, kShard)), shard_zeros,
                            shard_zeros, clip, lr},
                           shard));
  EXPECT_EQ(piece(part[0], kBegin, kShard), piece(full[0], kBegin, kShard));
  EXPECT_EQ(piece(part[0], 0, kBegin), piece(param, 0, kBegin)) << "outside the shard";
  EXPECT_EQ(ToVector(part[1]), piece(full[1], kBegin, kShard));
  EXPECT_EQ(ToVector(part[2]), piece(full[2], kBegin, kShard));
  // The frozen update: the whole averaged momentum, the shard's variance.
  const Tensor momentum = RandomTensor({kCount}, 5);
  ASSERT_OK_AND_ASSIGN(auto frozen_full,
                       RunKernel("onebit_adam_frozen", {full[0], momentum, full[2], lr}, whole));
  ASSERT_OK_AND_ASSIGN(auto frozen_part,
                       RunKernel("onebit_adam_frozen", {full[0], momentum, part[2], lr}, shard));
  EXPECT_EQ(piece(frozen_part[0], kBegin, kShard), piece(frozen_full[0], kBegin, kShard));
  EXPECT_EQ(piece(frozen_part[0], 0, kBegin), piece(full[0], 0, kBegin)) << "outside the shard";
  // A shard that does not fit is refused by name.
  shard.Set("param_offset", kCount - 1);
  const Status refused =
      RunKernel("onebit_adam_frozen", {full[0], momentum, part[2], lr}, shard).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("exp_avg_sq shard"), std::string::npos) << refused.message();
}

TEST(OptimizerTest, SgdMatchesNaiveUpdate) {
  Tensor param = RandomTensor({100}, 1), grad = RandomTensor({100}, 2);
  const std::vector<float> before = ToVector(param);
  ASSERT_OK_AND_ASSIGN(auto out,
                       RunKernel("sgd", {param, grad, ScalarTensor(0.5f), ScalarTensor(0.1f)},
                                 Attrs{{"weight_decay", 0.01}}));
  for (int64_t i = 0; i < 100; ++i) {
    const double g = grad.data<float>()[i] * 0.5;
    const double expected = before[i] - 0.1 * (g + 0.01 * before[i]);
    EXPECT_NEAR(out[0].data<float>()[i], expected, 1e-6);
  }
}

TEST(OptimizerTest, SumOfSquaresAndClipScale) {
  Tensor a = RandomTensor({100'003}, 1), b = RandomTensor({17}, 2);
  double expected_a = 0, expected_b = 0;
  for (float x : ToVector(a)) expected_a += static_cast<double>(x) * x;
  for (float x : ToVector(b)) expected_b += static_cast<double>(x) * x;
  ASSERT_OK_AND_ASSIGN(auto sa, RunKernel("sum_of_squares", {a}));
  ASSERT_OK_AND_ASSIGN(auto sb, RunKernel("sum_of_squares", {b}));
  EXPECT_NEAR(*sa[0].data<float>(), expected_a, 1e-6 * expected_a);
  EXPECT_NEAR(*sb[0].data<float>(), expected_b, 1e-6 * expected_b);
  // Over ranges only (a tensor-parallel rank leaving out the slots another rank counts).
  const std::vector<float> values = ToVector(b);
  double expected_ranges = 0;
  for (int64_t i : {2, 3, 4, 10, 11}) {
    expected_ranges +=
        static_cast<double>(values[static_cast<size_t>(i)]) * values[static_cast<size_t>(i)];
  }
  ASSERT_OK_AND_ASSIGN(
      auto ranged,
      RunKernel("sum_of_squares", {b}, Attrs{{"ranges", std::vector<int64_t>{2, 5, 10, 12}}}));
  EXPECT_NEAR(*ranged[0].data<float>(), expected_ranges, 1e-6 * expected_ranges);
  EXPECT_FALSE(
      RunKernel("sum_of_squares", {b}, Attrs{{"ranges", std::vector<int64_t>{5, 2}}}).ok());
  EXPECT_FALSE(
      RunKernel("sum_of_squares", {b}, Attrs{{"ranges", std::vector<int64_t>{0, 18}}}).ok());

  const double norm = std::sqrt(expected_a + expected_b);
  ASSERT_OK_AND_ASSIGN(auto clipped,
                       RunKernel("clip_scale", {sa[0], sb[0]}, Attrs{{"max_norm", 1.0}}));
  EXPECT_NEAR(*clipped[1].data<float>(), norm, 1e-5 * norm);
  EXPECT_NEAR(*clipped[0].data<float>(), 1.0 / (norm + 1e-6), 1e-7);
  // A norm already below the bound is left alone; max_norm 0 disables clipping.
  ASSERT_OK_AND_ASSIGN(auto loose,
                       RunKernel("clip_scale", {sa[0], sb[0]}, Attrs{{"max_norm", 1e9}}));
  EXPECT_EQ(*loose[0].data<float>(), 1.0f);
  ASSERT_OK_AND_ASSIGN(auto off, RunKernel("clip_scale", {sa[0]}, Attrs{{"max_norm", 0.0}}));
  EXPECT_EQ(*off[0].data<float>(), 1.0f);
}

TEST(OptimizerTest, AdamWOnAShardUpdatesOnlyItsSliceOfTheFullParameter) {
  // ZeRO-1/2: the gradient and Adam state are the shard [300, 700) of a 1000-element group;
  // the update must equal the whole-tensor update on that slice and leave the rest untouched.
  const int64_t n = 1000, begin = 300, count = 400;
  Tensor param = RandomTensor({n}, 1), grad = RandomTensor({n}, 2);
  Tensor m = RandomTensor({n}, 3, 0.1f), v = RandomTensor({n}, 4, 0.1f);
  for (int64_t i = 0; i < n; ++i) v.data<float>()[i] = std::abs(v.data<float>()[i]);
  const auto slice = [&](const Tensor& t) {
    Tensor s = RandomTensor({count}, 9);
    std::copy_n(t.data<float>() + begin, count, s.data<float>());
    return s;
  };
  const Attrs common{{"weight_decay", 0.1},
                     {"decay_ranges", std::vector<int64_t>{0, 100, 350, 1000}}};
  Attrs shard_attrs = common;
  shard_attrs.Set("param_offset", begin);
  const std::vector<float> before = ToVector(param);
  ASSERT_OK_AND_ASSIGN(auto full, RunKernel("adamw",
                                            {param, grad, m, v, ScalarTensor(0.5f),
                                             ScalarTensor(0.01f), Int64Scalar(2)},
                                            common));
  ASSERT_OK_AND_ASSIGN(auto shard,
                       RunKernel("adamw",
                                 {param, slice(grad), slice(m), slice(v), ScalarTensor(0.5f),
                                  ScalarTensor(0.01f), Int64Scalar(2)},
                                 shard_attrs));
  ASSERT_EQ(shard[0].numel(), n);
  ASSERT_EQ(shard[1].numel(), count);
  for (int64_t i = 0; i < n; ++i) {
    const float expected = (i >= begin && i < begin + count) ? full[0].data<float>()[i] : before[i];
    ASSERT_EQ(shard[0].data<float>()[i], expected) << i;
  }
  for (int64_t i = 0; i < count; ++i) {
    ASSERT_EQ(shard[1].data<float>()[i], full[1].data<float>()[begin + i]) << i;
    ASSERT_EQ(shard[2].data<float>()[i], full[2].data<float>()[begin + i]) << i;
  }
  // A shard that overruns the parameter is refused by name.
  shard_attrs.Set("param_offset", int64_t{700});
  Result<std::vector<Tensor>> overrun =
      RunKernel("adamw",
                {param, slice(grad), slice(m), slice(v), ScalarTensor(1), ScalarTensor(0.01f),
                 Int64Scalar(1)},
                shard_attrs);
  ASSERT_FALSE(overrun.ok());
  EXPECT_NE(overrun.status().message().find("does not fit"), std::string::npos)
      << overrun.status().message();
}

TEST(OptimizerTest, AccumulateAddsInPlace) {
  Tensor sum = RandomTensor({257}, 1), x = RandomTensor({257}, 2);
  ASSERT_OK_AND_ASSIGN(auto out, RunKernel("accumulate", {sum, x}));
  for (int64_t i = 0; i < 257; ++i) {
    EXPECT_EQ(out[0].data<float>()[i], sum.data<float>()[i] + x.data<float>()[i]) << i;
  }
  EXPECT_FALSE(RunKernel("accumulate", {sum, RandomTensor({256}, 3)}).ok());
}

TEST(OptimizerTest, SumScalarsAddsInOrderAndScales) {
  ASSERT_OK_AND_ASSIGN(
      auto out,
      RunKernel("sum_scalars", {ScalarTensor(1.5f), ScalarTensor(2.0f), ScalarTensor(-0.25f)},
                Attrs{{"scale", 0.5}}));
  EXPECT_FLOAT_EQ(*out[0].data<float>(), 1.625f);
  Result<std::vector<Tensor>> vector_input = RunKernel("sum_scalars", {RandomTensor({3}, 1)});
  ASSERT_FALSE(vector_input.ok());
  EXPECT_NE(vector_input.status().message().find("adds f32 scalars"), std::string::npos);
}

}  // namespace
}  // namespace tessera::testing

// The vectorisable exp and tanh (ops/cpu/vector_math.h) against double precision over dense
// sweeps, their special values, and the GELU kernels built on them (compiled at the library's
// optimisation, so vectorised) against GELU in double precision.
#include <cmath>
#include <limits>
#include <vector>

#include "ops/cpu/kernels.h"
#include "ops/cpu/vector_math.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using cpu::VectorExp;
using cpu::VectorTanh;

// The distance from `value` to `exact` in units of the last place of the float nearest `exact`.
double UlpError(float value, double exact) {
  const float nearest = static_cast<float>(exact);
  const double ulp = std::nextafter(std::fabs(nearest), std::numeric_limits<float>::infinity()) -
                     std::fabs(nearest);
  return std::fabs(static_cast<double>(value) - exact) / ulp;
}

// Evenly spaced floats over [low, high], both ends included.
std::vector<float> Sweep(double low, double high, int points) {
  std::vector<float> values;
  values.reserve(static_cast<size_t>(points));
  for (int i = 0; i < points; ++i)
    values.push_back(static_cast<float>(low + (high - low) * i / (points - 1)));
  return values;
}

TEST(VectorMathTest, TanhIsWithinTwoUlpEverywhere) {
  std::vector<float> xs = Sweep(-12.0, 12.0, 2'000'001);
  // Around the switch from the polynomial to the exponential form, and tiny magnitudes.
  for (float x : {0.625f, 0.6249999f, 0.6250001f, 1e-3f, 1e-8f, 1e-30f, 9.999999f, 10.0f}) {
    xs.push_back(x);
    xs.push_back(-x);
  }
  double worst = 0;
  float worst_at = 0;
  for (float x : xs) {
    const double error = UlpError(VectorTanh(x), std::tanh(static_cast<double>(x)));
    if (error > worst) {
      worst = error;
      worst_at = x;
    }
  }
  EXPECT_LE(worst, 2.0) << "at x = " << worst_at;
}

TEST(VectorMathTest, TanhSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(VectorTanh(0.0f), 0.0f);
  EXPECT_TRUE(std::signbit(VectorTanh(-0.0f)));
  EXPECT_EQ(VectorTanh(inf), 1.0f);
  EXPECT_EQ(VectorTanh(-inf), -1.0f);
  EXPECT_EQ(VectorTanh(10.0f), 1.0f);
  EXPECT_EQ(VectorTanh(-50.0f), -1.0f);
  EXPECT_TRUE(std::isnan(VectorTanh(std::numeric_limits<float>::quiet_NaN())));
  const float denormal = std::numeric_limits<float>::denorm_min() * 3;
  EXPECT_EQ(VectorTanh(denormal), denormal);
}

TEST(VectorMathTest, ExpIsWithinTwoUlpOnItsDomain) {
  double worst = 0;
  float worst_at = 0;
  for (float y : Sweep(-87.0, 88.0, 2'000'001)) {
    const double error = UlpError(VectorExp(y), std::exp(static_cast<double>(y)));
    if (error > worst) {
      worst = error;
      worst_at = y;
    }
  }
  EXPECT_LE(worst, 2.0) << "at y = " << worst_at;
  EXPECT_EQ(VectorExp(0.0f), 1.0f);
}

// GELU (tanh form) and its derivative in double precision.
double GeluExact(double v) {
  const double beta = std::sqrt(2.0 / M_PI);
  return 0.5 * v * (1.0 + std::tanh(beta * (v + 0.044715 * v * v * v)));
}
double GeluDerivativeExact(double v) {
  const double beta = std::sqrt(2.0 / M_PI);
  const double t = std::tanh(beta * (v + 0.044715 * v * v * v));
  return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * beta * (1.0 + 3.0 * 0.044715 * v * v);
}

TEST(VectorMathTest, GeluKernelsMatchDoublePrecision) {
  // An odd length: the vectorised loops' tails are checked too.
  const std::vector<float> x = Sweep(-10.0, 10.0, 100'003);
  std::vector<float> dout(x.size());
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = 0.5f + static_cast<float>(i % 7) * 0.25f;
  std::vector<float> out(x.size()), dx(x.size());
  cpu::GeluForward(out.data(), x.data(), static_cast<int64_t>(x.size()));
  cpu::GeluBackward(dx.data(), dout.data(), x.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    // Float GELU is exact to rounding in its inputs' scale: tanh's 2 ulp (< 1.2e-7 absolute)
    // times 0.5 |v|, plus a few roundings of the result.
    const double scale = 1.0 + std::fabs(v);
    ASSERT_NEAR(out[i], GeluExact(v), 3e-7 * scale) << "forward at x = " << v;
    ASSERT_NEAR(dx[i], dout[i] * GeluDerivativeExact(v), 1e-6 * scale * scale * dout[i])
        << "backward at x = " << v;
  }
}

}  // namespace
}  // namespace tessera::testing

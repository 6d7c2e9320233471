// Transcendental functions the compiler can vectorise: exp and tanh in plain float arithmetic.
//
// glibc's expf/tanhf are scalar calls, so a loop over them runs one element at a time; in the
// GELU of a GPT-2 block on CPU they were a fifth of a worker's time. These are straight-line
// float code (a range reduction, a polynomial and selects, no calls and no branches), so a loop
// over them compiles to SIMD at whatever width the target has, with the same results at every
// width.
//
// Accuracy (measured over a dense sweep against double precision; tests/unit/vector_math_test.cc
// holds it): VectorExp within 2 ulp on its domain, VectorTanh within 2 ulp everywhere, exact at
// 0 (sign kept), +-1 beyond |x| = 10, NaN for NaN. glibc's tanhf is within ~1.4 ulp.
//
// How: exp(y) = 2^n * exp(r) with n = round(y / ln 2) and r = y - n ln 2 (ln 2 split in two
// parts so the reduction is exact), exp(r) a degree-6 polynomial on [-ln2/2, ln2/2], 2^n built in
// the exponent bits. tanh(a) for a = |x| < 0.625 is a + a^3 P(a^2) (degree 4, fitted by weighted
// least squares on Chebyshev nodes); above, 1 - 2 / (exp(2a) + 1), which loses nothing to
// cancellation there (the result is > 0.55).
//
// Internal to ops/cpu. Pure functions.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace tessera::cpu {

// e^y for y in [-87, 88] (the caller keeps y there: beyond, 2^n leaves the normal range).
inline float VectorExp(float y) {
  constexpr float kLog2E = 1.44269504088896341f;
  constexpr float kLn2High = 0.693145751953125f;  // few mantissa bits: n * kLn2High is exact
  constexpr float kLn2Low = 1.42860676533018714e-06f;
  const float n = std::floor(y * kLog2E + 0.5f);
  const float r = (y - n * kLn2High) - n * kLn2Low;
  float p = 0.001382942427881062f;
  p = p * r + 0.0083747748285532f;
  p = p * r + 0.0416683591902256f;
  p = p * r + 0.1666642129421234f;
  p = p * r + 0.49999991059303284f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float two_to_n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return p * two_to_n;
}

// tanh(x) for every float x.
inline float VectorTanh(float x) {
  constexpr float kSaturated = 10.0f;  // tanh(10) rounds to 1 in float
  constexpr float kPolynomialBelow = 0.625f;
  const float magnitude = std::fabs(x);
  // NaN compares false and becomes kSaturated here; it is given back as itself at the end.
  const float a = magnitude < kSaturated ? magnitude : kSaturated;
  const float a2 = a * a;
  float p = -0.005718891508877277f;
  p = p * a2 + 0.02065306343138218f;
  p = p * a2 - 0.053744640201330185f;
  p = p * a2 + 0.13331513106822968f;
  p = p * a2 - 0.3333328664302826f;
  const float near_zero = a + a * a2 * p;
  const float away_from_zero = 1.0f - 2.0f / (VectorExp(a + a) + 1.0f);
  const float t = a < kPolynomialBelow ? near_zero : away_from_zero;
  return x == x ? std::copysign(t, x) : x;
}

}  // namespace tessera::cpu

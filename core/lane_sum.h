// Sums of squares in interleaved partial sums: element i of a range into partial sum
// i % kSquareLanes in element order, each square in double (exact for a float: its 24-bit
// significand squared fits in 53 bits), the partials then added in lane order. The additions of
// different lanes are independent, so they overlap (the compiler vectorises the loop) instead of
// waiting on one another: a serial sum runs at about a quarter of the speed. The result is fixed
// to the bit on every CPU and compiler that follows IEEE double arithmetic (it is not the serial
// sum's bits), which the compressed all-reduce's scales (core/sign_compression.h) and the
// gradient norm (ops/cpu/optimizer.h) rely on.
//
// Thread safety: a pure function of its arguments (and of what `value_at` reads).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace tessera {

inline constexpr int64_t kSquareLanes = 8;

// The sum of value_at(i)^2 for i in [0, n), in kSquareLanes partial sums (above). `value_at`
// returns a float and is called once per element, in order (it may also write the element:
// the compressed all-reduce adds its error feedback in the same pass).
template <typename ValueAt>
double LaneSumOfSquares(int64_t n, ValueAt&& value_at) {
  std::array<double, kSquareLanes> partial{};
  const auto add_square = [&](int64_t i, int64_t lane) {
    const auto v = static_cast<double>(value_at(i));
    partial[static_cast<size_t>(lane)] += v * v;
  };
  int64_t i = 0;
  for (; i + kSquareLanes <= n; i += kSquareLanes) {
    for (int64_t lane = 0; lane < kSquareLanes; ++lane) add_square(i + lane, lane);
  }
  for (int64_t lane = 0; i < n; ++i, ++lane) add_square(i, lane);
  double sum = 0;
  for (double p : partial) sum += p;
  return sum;
}

}  // namespace tessera

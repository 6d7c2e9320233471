// SplitMix64: the data module's random numbers (internal, not installed). Every step is
// specified, so generated volumes and sampled patches are the same on every platform and
// standard library.
#pragma once

#include <cmath>
#include <cstdint>

namespace tessera {

// SplitMix64 (Steele, Lea, Flood 2014): a small generator whose every step is specified, so the
// volumes are the same on every platform and standard library.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1).
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  // Uniform in [lo, hi).
  double Uniform(double lo, double hi) { return lo + (hi - lo) * Uniform(); }
  // Uniform integer in [lo, hi]. REQUIRES: lo <= hi.
  int64_t Int(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(Next() % static_cast<uint64_t>(hi - lo + 1));
  }
  // Standard normal (Box-Muller; the second value of each pair is kept for the next call).
  double Normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = 1.0 - Uniform();  // (0, 1]: log stays finite
    const double u2 = Uniform();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    constexpr double kTwoPi = 6.283185307179586;
    spare_ = radius * std::sin(kTwoPi * u2);
    has_spare_ = true;
    return radius * std::cos(kTwoPi * u2);
  }

 private:
  uint64_t state_;
  double spare_ = 0;
  bool has_spare_ = false;
};

// A stream of its own for item `index` of a generator seeded `seed`: the two mixed, so items are
// independent of how many there are.
inline SplitMix64 StreamFor(uint64_t seed, int64_t index) {
  return SplitMix64(
      SplitMix64(seed ^ (0xd1b54a32d192ed03ULL * static_cast<uint64_t>(index + 1))).Next());
}

}  // namespace tessera

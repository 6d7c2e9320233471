// Statistics of measurements. A figure measured on a machine whose speed moves (other processes,
// a virtual machine's host, workers sharing cores) is the median of its repeats: one disturbed
// repeat moves it less than it moves a mean.
//
// Thread safety: a pure function.
#pragma once

#include <algorithm>
#include <vector>

namespace tessera {

// The median of `values`: the middle one, the mean of the middle two for an even count; 0 for
// none.
inline double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

}  // namespace tessera

// Statistics of measurements. A figure measured on a machine whose speed moves (other processes,
// a virtual machine's host, workers sharing cores) is the median of its repeats: one disturbed
// repeat moves it less than it moves a mean.
//
// Thread safety: a pure function.
#pragma once

#include <algorithm>
#include <utility>
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

// A line y = intercept + slope * x through measured (x, y) points, by the median of the pairwise
// slopes (Theil-Sen: one disturbed point moves it little, as a median) and the median of
// y - slope * x; both held non-negative (a falling line: the median y, flat; a negative
// intercept: through the origin, at the median of y / x). Points of equal x give no slope of
// their own. 0, 0 for no points.
struct Line {
  double intercept = 0, slope = 0;
  double At(double x) const { return intercept + slope * x; }
};
inline Line FitNonNegativeLine(const std::vector<std::pair<double, double>>& points) {
  if (points.empty()) return {};
  std::vector<double> slopes;
  for (size_t i = 0; i < points.size(); ++i) {
    for (size_t j = i + 1; j < points.size(); ++j) {
      const double dx = points[j].first - points[i].first;
      if (dx != 0) slopes.push_back((points[j].second - points[i].second) / dx);
    }
  }
  const double slope = std::max(0.0, Median(std::move(slopes)));
  std::vector<double> intercepts, through_origin;
  for (const auto& [x, y] : points) {
    intercepts.push_back(y - slope * x);
    if (x > 0) through_origin.push_back(y / x);
  }
  const double intercept = Median(std::move(intercepts));
  if (intercept >= 0) return {intercept, slope};
  return {0, std::max(0.0, Median(std::move(through_origin)))};
}

}  // namespace tessera

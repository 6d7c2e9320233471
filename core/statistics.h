// Statistics of measurements. A figure measured on a machine whose speed moves (other processes,
// a virtual machine's host, workers sharing cores) is the median of its repeats: one disturbed
// repeat moves it less than it moves a mean.
//
// Thread safety: a pure function.
#pragma once

#include <algorithm>
#include <map>
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

// Lines of one slope through groups of measured (x, y) points, each group its own intercept
// (y = intercept[group] + slope * x): the slope the median of the slopes between points of one
// group (Theil-Sen: one disturbed point moves it little, as a median), held non-negative; each
// intercept the median of its group's y - slope * x. Points of equal x give no slope of their
// own; no slope at all: 0. Groups keyed by an int (the calibration's: worker counts).
struct SharedSlope {
  double slope = 0;
  std::map<int, double> intercepts;  // by group
};
struct GroupedPoint {
  int group = 0;
  double x = 0, y = 0;
};
inline SharedSlope FitSharedSlope(const std::vector<GroupedPoint>& points) {
  std::vector<double> slopes;
  for (size_t i = 0; i < points.size(); ++i) {
    for (size_t j = i + 1; j < points.size(); ++j) {
      const double dx = points[j].x - points[i].x;
      if (points[i].group == points[j].group && dx != 0) {
        slopes.push_back((points[j].y - points[i].y) / dx);
      }
    }
  }
  SharedSlope fit;
  fit.slope = std::max(0.0, Median(std::move(slopes)));
  std::map<int, std::vector<double>> intercepts;
  for (const GroupedPoint& point : points) {
    intercepts[point.group].push_back(point.y - fit.slope * point.x);
  }
  for (auto& [group, values] : intercepts) fit.intercepts[group] = Median(std::move(values));
  return fit;
}

}  // namespace tessera

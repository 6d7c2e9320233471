#include "data/sliding_window.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace tessera {

namespace {

// Patch starts along one axis of `size` voxels.
std::vector<int64_t> AxisStarts(int64_t size, int64_t patch, int64_t step) {
  if (size <= patch) return {-(patch - size) / 2};
  std::vector<int64_t> starts;
  for (int64_t start = 0; start + patch < size; start += step) starts.push_back(start);
  starts.push_back(size - patch);  // the last patch ends at the volume's end
  return starts;
}

}  // namespace

std::vector<PatchOrigin> SlidingWindowTiles(int64_t width, int64_t height, int64_t depth,
                                            int64_t patch, int64_t step) {
  step = std::max<int64_t>(1, step);
  std::vector<PatchOrigin> tiles;
  for (int64_t z : AxisStarts(depth, patch, step)) {
    for (int64_t y : AxisStarts(height, patch, step)) {
      for (int64_t x : AxisStarts(width, patch, step)) tiles.push_back({x, y, z});
    }
  }
  return tiles;
}

SlidingWindowPrediction::SlidingWindowPrediction(int64_t width, int64_t height, int64_t depth,
                                                 int64_t classes, int64_t patch)
    : width_(width), height_(height), depth_(depth), classes_(classes), patch_(patch) {
  const double sigma = static_cast<double>(patch) / 8;
  const double centre = static_cast<double>(patch - 1) / 2;
  std::vector<double> along(static_cast<size_t>(patch));
  for (int64_t i = 0; i < patch; ++i) {
    const double d = (static_cast<double>(i) - centre) / sigma;
    along[static_cast<size_t>(i)] = std::exp(-0.5 * d * d);
  }
  importance_.resize(static_cast<size_t>(patch * patch * patch));
  for (int64_t z = 0; z < patch; ++z) {
    for (int64_t y = 0; y < patch; ++y) {
      for (int64_t x = 0; x < patch; ++x) {
        // A floor keeps border voxels of a volume that only one patch covers from weighing 0.
        importance_[static_cast<size_t>((z * patch + y) * patch + x)] = static_cast<float>(
            std::max(1e-3, along[static_cast<size_t>(x)] * along[static_cast<size_t>(y)] *
                               along[static_cast<size_t>(z)]));
      }
    }
  }
  sums_.assign(static_cast<size_t>(classes * width * height * depth), 0.0f);
}

void SlidingWindowPrediction::Add(PatchOrigin origin, const float* logits) {
  const int64_t patch_voxels = patch_ * patch_ * patch_;
  const int64_t volume = width_ * height_ * depth_;
  std::vector<float> probabilities(static_cast<size_t>(classes_));
  for (int64_t z = 0; z < patch_; ++z) {
    const int64_t vz = origin.z + z;
    if (vz < 0 || vz >= depth_) continue;
    for (int64_t y = 0; y < patch_; ++y) {
      const int64_t vy = origin.y + y;
      if (vy < 0 || vy >= height_) continue;
      for (int64_t x = 0; x < patch_; ++x) {
        const int64_t vx = origin.x + x;
        if (vx < 0 || vx >= width_) continue;
        const int64_t p = (z * patch_ + y) * patch_ + x;
        float largest = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < classes_; ++c)
          largest = std::max(largest, logits[c * patch_voxels + p]);
        float total = 0;
        for (int64_t c = 0; c < classes_; ++c) {
          probabilities[static_cast<size_t>(c)] = std::exp(logits[c * patch_voxels + p] - largest);
          total += probabilities[static_cast<size_t>(c)];
        }
        const float weight = importance_[static_cast<size_t>(p)] / total;
        const int64_t v = (vz * height_ + vy) * width_ + vx;
        for (int64_t c = 0; c < classes_; ++c) {
          sums_[static_cast<size_t>(c * volume + v)] +=
              weight * probabilities[static_cast<size_t>(c)];
        }
      }
    }
  }
}

std::vector<int32_t> SlidingWindowPrediction::Classes() const {
  const int64_t volume = width_ * height_ * depth_;
  std::vector<int32_t> classes(static_cast<size_t>(volume), 0);
  for (int64_t v = 0; v < volume; ++v) {
    float best = sums_[static_cast<size_t>(v)];
    for (int64_t c = 1; c < classes_; ++c) {
      if (sums_[static_cast<size_t>(c * volume + v)] > best) {
        best = sums_[static_cast<size_t>(c * volume + v)];
        classes[static_cast<size_t>(v)] = static_cast<int32_t>(c);
      }
    }
  }
  return classes;
}

Result<std::vector<double>> DicePerClass(const std::vector<int32_t>& predicted,
                                         const std::vector<int32_t>& labels, int64_t classes) {
  if (predicted.size() != labels.size()) {
    return InvalidArgument("a prediction of {} voxels cannot be scored against {} labels",
                           predicted.size(), labels.size());
  }
  std::vector<int64_t> both(static_cast<size_t>(classes)), in_predicted(both), in_labels(both);
  for (size_t i = 0; i < labels.size(); ++i) {
    const int32_t p = predicted[i], g = labels[i];
    if (p >= 0 && p < classes) ++in_predicted[static_cast<size_t>(p)];
    if (g >= 0 && g < classes) ++in_labels[static_cast<size_t>(g)];
    if (p == g && g >= 0 && g < classes) ++both[static_cast<size_t>(g)];
  }
  std::vector<double> dice;
  for (int64_t c = 1; c < classes; ++c) {
    const int64_t denominator =
        in_predicted[static_cast<size_t>(c)] + in_labels[static_cast<size_t>(c)];
    dice.push_back(denominator == 0 ? std::numeric_limits<double>::quiet_NaN()
                                    : 2.0 * static_cast<double>(both[static_cast<size_t>(c)]) /
                                          static_cast<double>(denominator));
  }
  return dice;
}

}  // namespace tessera

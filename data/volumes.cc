#include "data/volumes.h"

#include <algorithm>
#include <cmath>

#include "data/split_mix64.h"

namespace tessera {

namespace {

// Paints one sample's labels ([V, V, V]) and intensities ([C, V, V, V]).
void GenerateSample(uint64_t seed, int64_t index, int64_t v, int64_t channels, int32_t* labels,
                    float* volumes) {
  // Sample i's own stream: the seed and the index mixed, so samples are independent of count.
  SplitMix64 rng = StreamFor(seed, index);
  const int64_t voxels = v * v * v;
  std::fill(labels, labels + voxels, 0);

  const int64_t spheres = rng.Int(1, 3);
  for (int64_t s = 0; s < spheres; ++s) {
    const double vd = static_cast<double>(v);
    const double radius = rng.Uniform(std::max(1.0, vd / 8), std::max(1.5, vd / 4));
    // The centre keeps the sphere inside the volume when it fits.
    double centre[3];
    for (double& c : centre) {
      const double lo = std::min(radius, (vd - 1) / 2), hi = std::max(lo, vd - 1 - radius);
      c = rng.Uniform(lo, hi);
    }
    for (int64_t z = 0; z < v; ++z) {
      for (int64_t y = 0; y < v; ++y) {
        for (int64_t x = 0; x < v; ++x) {
          const double dz = static_cast<double>(z) - centre[0];
          const double dy = static_cast<double>(y) - centre[1];
          const double dx = static_cast<double>(x) - centre[2];
          if (dz * dz + dy * dy + dx * dx <= radius * radius) labels[(z * v + y) * v + x] = 1;
        }
      }
    }
  }

  const int64_t boxes = rng.Int(1, 3);
  for (int64_t b = 0; b < boxes; ++b) {
    int64_t begin[3], end[3];
    for (int axis = 0; axis < 3; ++axis) {
      const int64_t side = rng.Int(std::max<int64_t>(2, v / 8), std::max<int64_t>(2, v / 4));
      begin[axis] = rng.Int(0, v - side);
      end[axis] = begin[axis] + side;
    }
    for (int64_t z = begin[0]; z < end[0]; ++z) {
      for (int64_t y = begin[1]; y < end[1]; ++y) {
        std::fill(labels + (z * v + y) * v + begin[2], labels + (z * v + y) * v + end[2], 2);
      }
    }
  }

  for (int64_t c = 0; c < channels; ++c) {
    float* channel = volumes + c * voxels;
    for (int64_t i = 0; i < voxels; ++i) {
      channel[i] = kVolumeClassMean[labels[i]] + kVolumeNoiseStd * static_cast<float>(rng.Normal());
    }
  }
}

}  // namespace

Result<VolumeBatch> GenerateVolumes(int64_t count, int64_t volume, int64_t in_channels,
                                    uint64_t seed) {
  if (count < 1) return InvalidArgument("GenerateVolumes: count must be >= 1, got {}", count);
  if (in_channels < 1) {
    return InvalidArgument("GenerateVolumes: in_channels must be >= 1, got {}", in_channels);
  }
  if (volume < kMinVolume) {
    return InvalidArgument(
        "GenerateVolumes: volume must be >= {} (room for a shape and background), got {}",
        kMinVolume, volume);
  }
  // In doubles: the product of the arguments may overflow int64.
  const double elements = static_cast<double>(count) * static_cast<double>(in_channels) *
                          std::pow(static_cast<double>(volume), 3);
  if (elements > static_cast<double>(kMaxVolumeElements)) {
    return InvalidArgument(
        "GenerateVolumes: {} samples of {} channel(s) of {}^3 voxels are {:.0f} floats, more "
        "than the {} one call may make: generate fewer samples per call",
        count, in_channels, volume, elements, kMaxVolumeElements);
  }
  VolumeBatch batch{.count = count, .channels = in_channels, .volume = volume};
  const int64_t voxels = volume * volume * volume;
  batch.volumes.resize(static_cast<size_t>(count * in_channels * voxels));
  batch.labels.resize(static_cast<size_t>(count * voxels));
  for (int64_t i = 0; i < count; ++i) {
    GenerateSample(seed, i, volume, in_channels, batch.labels.data() + i * voxels,
                   batch.volumes.data() + i * in_channels * voxels);
  }
  return batch;
}

}  // namespace tessera

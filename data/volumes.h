// Procedurally generated 3D segmentation volumes: a dataset for the 3D U-Net (model/unet3d.h)
// that needs no files.
//
// Each sample is a V x V x V volume on background (class 0) with 1-3 spheres (class 1) and then
// 1-3 axis-aligned boxes (class 2) painted over it, boxes last (a box may hide part of a
// sphere). Every voxel of every channel is its class's mean intensity (kVolumeClassMean) plus
// Gaussian noise of standard deviation kVolumeNoiseStd, drawn independently per channel: one
// voxel's intensity leaves its class uncertain, its neighbourhood (shape and context) settles
// it, so the task is learnable but not trivial.
//
// Deterministic: sample i depends only on (seed, i), through a generator specified here
// (SplitMix64, Box-Muller) rather than the standard library's distributions, so the same seed
// gives the same bytes on every platform, and the first k samples of a larger count are the k
// samples of a smaller one. Thread-compatible: a pure function.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"

namespace tessera {

inline constexpr int32_t kVolumeClasses = 3;  // background, sphere, box
inline constexpr float kVolumeClassMean[kVolumeClasses] = {0.0f, 1.0f, -1.0f};
inline constexpr float kVolumeNoiseStd = 0.75f;
// The smallest volume GenerateVolumes makes (room for a shape and background around it).
inline constexpr int64_t kMinVolume = 4;
// The most elements (floats) a call may make: 2^28, 1 GiB of volumes.
inline constexpr int64_t kMaxVolumeElements = int64_t{1} << 28;

struct VolumeBatch {
  int64_t count = 0;
  int64_t channels = 0;
  int64_t volume = 0;           // V
  std::vector<float> volumes;   // f32 [count, channels, V, V, V], row-major (NCDHW)
  std::vector<int32_t> labels;  // i32 [count, V, V, V], values in [0, kVolumeClasses)
};

// `count` samples of `volume`^3 voxels with `in_channels` channels, deterministic in `seed`.
// InvalidArgument naming the argument when count or in_channels is below 1, volume is below
// kMinVolume, or the volumes would exceed kMaxVolumeElements.
Result<VolumeBatch> GenerateVolumes(int64_t count, int64_t volume, int64_t in_channels,
                                    uint64_t seed);

}  // namespace tessera

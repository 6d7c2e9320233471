// A segmentation dataset of NIfTI volumes on disk, and the training patches cut from it.
//
// Layout, as nnU-Net's raw datasets (v2) or the Medical Segmentation Decathlon's:
//   DIR/labelsTr/CASE.nii.gz         one label map per case (its classes as whole numbers)
//   DIR/imagesTr/CASE_0000.nii.gz    one image per channel (nnU-Net: _0000, _0001, ...), or
//   DIR/imagesTr/CASE.nii.gz         one image with the channels as its 4th dimension (MSD)
// `.nii` works wherever `.nii.gz` does. Cases are the label maps' names, sorted.
//
// Loading reads every case into memory (bounded: VolumeDatasetOptions::max_bytes), checks that
// each image matches its label map's size and the model's channel count, and normalises each
// channel of each case to zero mean and unit variance over its voxels (nnU-Net's scheme for
// non-CT images).
//
// SamplePatches cuts training patches: for each, a case, a crop of patch^3 voxels at a random
// offset (a volume smaller than the patch along an axis is padded with zeros and background), and
// a random flip along each axis. Deterministic in (seed, index) through SplitMix64, like the
// generated volumes (data/volumes.h): a resumed run draws the same patches.
//
// WriteVolumeDataset writes generated volumes (data/volumes.h) in the nnU-Net layout with a
// dataset.json, for tests and for trying the NIfTI path without a download.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "data/volumes.h"

namespace tessera {

struct VolumeCase {
  std::string name;
  int64_t width = 0, height = 0, depth = 0, channels = 0;
  // Its label map's grid (data/nifti.h), for writing a prediction that lines up with it.
  std::array<double, 3> spacing = {1, 1, 1};
  std::array<std::array<double, 4>, 3> affine = {{{1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 1, 0}}};
  std::vector<float> image;     // [channels][depth][height][width], normalised per channel
  std::vector<int32_t> labels;  // [depth][height][width]
};

struct VolumeDatasetOptions {
  int64_t channels = 1;                  // the model's input channels
  int32_t classes = kVolumeClasses;      // the model's classes
  int64_t max_bytes = int64_t{4} << 30;  // of images and labels in memory
};

// Loads DIR. NotFound when DIR, its labelsTr or a case's image is missing (naming the paths
// looked for); InvalidArgument naming the case for a size or channel mismatch and for a bad file
// (data/nifti.h's errors); ResourceExhausted past max_bytes, naming the figure and the option.
Result<std::vector<VolumeCase>> LoadVolumeDataset(const std::string& dir,
                                                  const VolumeDatasetOptions& options);

struct PatchOrigin {
  int64_t x = 0, y = 0, z = 0;  // the patch's first voxel in the case (negative: in padding)
};

// Copies the patch^3 patch at `origin` of `volume_case` into image ([channels][patch^3]) and
// labels ([patch^3]); voxels outside the case are 0 and background.
void CropPatch(const VolumeCase& volume_case, PatchOrigin origin, int64_t patch, float* image,
               int32_t* labels);

// `count` patches of patch^3 voxels (patches `first` .. `first + count - 1` of the stream seeded
// `seed`). InvalidArgument when there are no cases or patch < 1.
Result<VolumeBatch> SamplePatches(const std::vector<VolumeCase>& cases, int64_t count,
                                  int64_t patch, uint64_t seed, int64_t first);

// Writes `volumes` as cases case_000, case_001, ... under DIR (created if missing): images as
// float32, label maps as uint8, 1 mm spacing, and DIR/dataset.json. Files are written atomically.
Status WriteVolumeDataset(const std::string& dir, const VolumeBatch& volumes);

}  // namespace tessera

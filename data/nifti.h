// NIfTI volumes: medical images and label maps as the 3D U-Net reads them.
//
// NIfTI-1 and NIfTI-2 files (`.nii`, or gzipped `.nii.gz`) are read and written with the NIfTI
// reference library (Debian's libnifti2-dev, `nifti2_io.h`), never a parser of our own. A volume
// is 3D (x, y, z) or 4D with the 4th dimension as channels (the Medical Segmentation Decathlon's
// multi-modal images); its voxels are converted to f32 with the file's scaling (scl_slope,
// scl_inter) applied. (The library itself reads NaN and infinite floats as 0.) Memory layout is
// NIfTI's own, x fastest, which is the U-Net's NCDHW with W = x, H = y, D = z: [channel][z][y][x],
// no transposition.
//
// What a volume keeps besides its voxels: the grid spacing (pixdim, in the file's units, usually
// mm), the voxel-to-world affine (the sform when the file has one, else the qform, else the
// spacing on the diagonal) and the type the file stores. WriteNifti writes all of it back (sform
// and qform both set from the affine), atomically: a temporary file in the destination's folder,
// fsync, rename.
//
// Errors name the file and what is wrong with it: not there (NotFound), not NIfTI, the wrong
// number of dimensions, a type that is not a real number (complex, RGB), data shorter than the
// header promises, values that scaling makes infinite; for label maps, a value that is not a whole
// number in [0, classes).
//
// Thread safety: the functions may be called from several threads at once (the library keeps no
// per-file state between calls; its message level is set once).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace tessera {

// The types a NIfTI file stores that WriteNifti can write (ReadNifti reads these and the other
// integer widths too).
enum class NiftiType { kUint8, kInt16, kInt32, kFloat32, kFloat64 };
std::string_view NiftiTypeName(NiftiType type);  // "uint8", "int16", ...

// The largest volume ReadNifti accepts: 2^31 voxels (8 GiB as f32).
inline constexpr int64_t kMaxNiftiVoxels = int64_t{1} << 31;

struct NiftiVolume {
  int64_t width = 0;   // x
  int64_t height = 0;  // y
  int64_t depth = 0;   // z
  int64_t channels = 1;
  std::array<double, 3> spacing = {1, 1, 1};  // x, y, z
  // Voxel (i, j, k) to world (x, y, z): world = affine[r][0] i + affine[r][1] j + affine[r][2] k
  // + affine[r][3] for r = 0..2.
  std::array<std::array<double, 4>, 3> affine = {{{1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 1, 0}}};
  // The file's type (ReadNifti: what it stored; WriteNifti: what to store). A read of another
  // integer type (int8, uint16, uint32, int64, uint64) says so in `stored_name`.
  NiftiType stored = NiftiType::kFloat32;
  std::string stored_name = "float32";
  std::vector<float> voxels;  // [channels][depth][height][width]

  int64_t voxels_per_channel() const { return width * height * depth; }
};

// Reads a volume. NotFound when the file is not there; InvalidArgument naming the file and the
// problem otherwise (see the top of this file); ResourceExhausted past kMaxNiftiVoxels.
Result<NiftiVolume> ReadNifti(const std::string& path);

// Writes `volume` as `path` (`.nii` or `.nii.gz`: gzipped by the name) in the type
// volume.stored. InvalidArgument for a volume whose sizes and voxels disagree, a path without
// either extension, or voxels the type cannot hold exactly (a fraction or an out-of-range value
// in an integer type, naming the voxel); Internal/Unavailable naming the path when writing fails.
Status WriteNifti(const std::string& path, const NiftiVolume& volume);

// A label map's voxels as class indices: every voxel of the (one-channel) volume must be a whole
// number in [0, classes). InvalidArgument naming `path`, the first offending value and its voxel
// (x, y, z), and the class range.
Result<std::vector<int32_t>> NiftiLabels(const NiftiVolume& volume, int32_t classes,
                                         const std::string& path);

}  // namespace tessera

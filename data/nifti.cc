#include "data/nifti.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>

#include <fmt/format.h>

#include <nifti2_io.h>

namespace tessera {

namespace {

struct NiftiFree {
  void operator()(nifti_image* image) const { nifti_image_free(image); }
};
using NiftiImage = std::unique_ptr<nifti_image, NiftiFree>;

// The library prints its complaints to stderr unless told not to; our errors say it instead.
void QuietLibrary() {
  static std::once_flag once;
  std::call_once(once, [] { nifti_set_debug_level(0); });
}

bool EndsWith(const std::string& text, std::string_view suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

int DatatypeCode(NiftiType type) {
  switch (type) {
    case NiftiType::kUint8:
      return DT_UINT8;
    case NiftiType::kInt16:
      return DT_INT16;
    case NiftiType::kInt32:
      return DT_INT32;
    case NiftiType::kFloat32:
      return DT_FLOAT32;
    case NiftiType::kFloat64:
      return DT_FLOAT64;
  }
  return DT_FLOAT32;
}

// The file's voxels of type T as f32, scaled as the header says.
template <typename T>
void Convert(const void* data, int64_t count, double slope, double intercept, float* out) {
  const T* in = static_cast<const T*>(data);
  for (int64_t i = 0; i < count; ++i) {
    out[i] = static_cast<float>(static_cast<double>(in[i]) * slope + intercept);
  }
}

bool ConvertData(int datatype, const void* data, int64_t count, double slope, double intercept,
                 float* out) {
  switch (datatype) {
    case DT_UINT8:
      Convert<uint8_t>(data, count, slope, intercept, out);
      return true;
    case DT_INT8:
      Convert<int8_t>(data, count, slope, intercept, out);
      return true;
    case DT_INT16:
      Convert<int16_t>(data, count, slope, intercept, out);
      return true;
    case DT_UINT16:
      Convert<uint16_t>(data, count, slope, intercept, out);
      return true;
    case DT_INT32:
      Convert<int32_t>(data, count, slope, intercept, out);
      return true;
    case DT_UINT32:
      Convert<uint32_t>(data, count, slope, intercept, out);
      return true;
    case DT_INT64:
      Convert<int64_t>(data, count, slope, intercept, out);
      return true;
    case DT_UINT64:
      Convert<uint64_t>(data, count, slope, intercept, out);
      return true;
    case DT_FLOAT32:
      Convert<float>(data, count, slope, intercept, out);
      return true;
    case DT_FLOAT64:
      Convert<double>(data, count, slope, intercept, out);
      return true;
    default:
      return false;
  }
}

std::string VoxelName(const NiftiVolume& volume, int64_t index) {
  const int64_t per_channel = volume.voxels_per_channel();
  const int64_t channel = index / per_channel;
  int64_t rest = index % per_channel;
  const int64_t x = rest % volume.width;
  rest /= volume.width;
  const int64_t y = rest % volume.height;
  const int64_t z = rest / volume.height;
  return volume.channels > 1 ? fmt::format("(x={}, y={}, z={}, channel {})", x, y, z, channel)
                             : fmt::format("(x={}, y={}, z={})", x, y, z);
}

// Stores `volume`'s voxels as T, each exactly (integers: whole and within T's range).
template <typename T>
Status Store(const NiftiVolume& volume, void* data) {
  T* out = static_cast<T*>(data);
  for (size_t i = 0; i < volume.voxels.size(); ++i) {
    const float value = volume.voxels[i];
    if constexpr (std::is_integral_v<T>) {
      if (!std::isfinite(value) || value != std::nearbyint(value) ||
          value < static_cast<float>(std::numeric_limits<T>::min()) ||
          value > static_cast<float>(std::numeric_limits<T>::max())) {
        return InvalidArgument("voxel {} is {}, which {} cannot hold exactly; store it as float32",
                               VoxelName(volume, static_cast<int64_t>(i)), value,
                               NiftiTypeName(volume.stored));
      }
    }
    out[i] = static_cast<T>(value);
  }
  return Status::Ok();
}

Status StoreVoxels(const NiftiVolume& volume, void* data) {
  switch (volume.stored) {
    case NiftiType::kUint8:
      return Store<uint8_t>(volume, data);
    case NiftiType::kInt16:
      return Store<int16_t>(volume, data);
    case NiftiType::kInt32:
      return Store<int32_t>(volume, data);
    case NiftiType::kFloat32:
      return Store<float>(volume, data);
    case NiftiType::kFloat64:
      return Store<double>(volume, data);
  }
  return InvalidArgument("unknown NIfTI type");
}

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

Status SyncFile(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_DIRECTORY : 0) | O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Unavailable("cannot open {} to sync it: {}", path, std::strerror(errno));
  const int synced = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (synced != 0) return Unavailable("fsync of {} failed: {}", path, std::strerror(error));
  return Status::Ok();
}

}  // namespace

std::string_view NiftiTypeName(NiftiType type) {
  switch (type) {
    case NiftiType::kUint8:
      return "uint8";
    case NiftiType::kInt16:
      return "int16";
    case NiftiType::kInt32:
      return "int32";
    case NiftiType::kFloat32:
      return "float32";
    case NiftiType::kFloat64:
      return "float64";
  }
  return "unknown";
}

Result<NiftiVolume> ReadNifti(const std::string& path) {
  QuietLibrary();
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    return NotFound("NIfTI file {} does not exist: {}", path, std::strerror(errno));
  }
  if (!S_ISREG(info.st_mode)) return InvalidArgument("{} is not a file", path);
  NiftiImage image(nifti_image_read(path.c_str(), 0));
  if (image == nullptr) {
    return InvalidArgument(
        "{} is not a NIfTI-1 or NIfTI-2 file (its header does not read: another format, or cut "
        "short within the header)",
        path);
  }
  const int64_t ndim = image->dim[0];
  for (int64_t d = 5; d <= 7 && d <= ndim; ++d) {
    if (image->dim[d] > 1) {
      return InvalidArgument(
          "{} has {} dimensions ({} along dimension {}); a volume has 3 (x, y, z) or 4 (x, y, z, "
          "channels)",
          path, ndim, image->dim[d], d);
    }
  }
  if (ndim < 3 || image->nx < 1 || image->ny < 1 || image->nz < 1) {
    return InvalidArgument(
        "{} is {}-dimensional ({} x {} x {}); a volume needs 3 dimensions (x, y, z), or 4 with "
        "channels",
        path, ndim, image->nx, ndim >= 2 ? image->ny : 1, ndim >= 3 ? image->nz : 1);
  }
  NiftiVolume volume;
  volume.width = image->nx;
  volume.height = image->ny;
  volume.depth = image->nz;
  volume.channels = ndim >= 4 ? std::max<int64_t>(1, image->nt) : 1;
  const int64_t voxels = volume.voxels_per_channel() * volume.channels;
  if (voxels > kMaxNiftiVoxels) {
    return ResourceExhausted("{} holds {} voxels, more than the {} a volume may have", path, voxels,
                             kMaxNiftiVoxels);
  }
  switch (image->datatype) {
    case DT_UINT8:
      volume.stored = NiftiType::kUint8;
      break;
    case DT_INT16:
      volume.stored = NiftiType::kInt16;
      break;
    case DT_INT32:
      volume.stored = NiftiType::kInt32;
      break;
    case DT_FLOAT64:
      volume.stored = NiftiType::kFloat64;
      break;
    case DT_INT8:
    case DT_UINT16:
    case DT_UINT32:
    case DT_INT64:
    case DT_UINT64:
    case DT_FLOAT32:
      volume.stored = NiftiType::kFloat32;
      break;
    default:
      return InvalidArgument(
          "{} stores {} voxels; a volume is real numbers (an integer or float "
          "type)",
          path, nifti_datatype_string(image->datatype));
  }
  // The other integer widths read as float32 and keep their own name.
  volume.stored_name = DatatypeCode(volume.stored) == image->datatype
                           ? std::string(NiftiTypeName(volume.stored))
                           : std::string(nifti_datatype_string(image->datatype));
  const int64_t data_bytes = voxels * image->nbyper;
  if (!nifti_is_gzfile(path.c_str()) && image->iname_offset >= 0 &&
      info.st_size < image->iname_offset + data_bytes) {
    return InvalidArgument(
        "{} is truncated: its header promises {} voxels of {} ({} bytes from byte {}), the file "
        "has {} bytes",
        path, voxels, nifti_datatype_string(image->datatype), data_bytes, image->iname_offset,
        static_cast<int64_t>(info.st_size));
  }
  if (nifti_image_load(image.get()) != 0 || image->data == nullptr) {
    return InvalidArgument(
        "{} is truncated or damaged: its data does not read ({} voxels of {} promised)", path,
        voxels, nifti_datatype_string(image->datatype));
  }
  double slope = image->scl_slope, intercept = image->scl_inter;
  if (slope == 0 || !std::isfinite(slope) || !std::isfinite(intercept)) {  // NIfTI: 0 = unscaled
    slope = 1;
    intercept = 0;
  }
  volume.voxels.resize(static_cast<size_t>(voxels));
  ConvertData(image->datatype, image->data, voxels, slope, intercept, volume.voxels.data());
  for (int64_t i = 0; i < voxels; ++i) {
    if (!std::isfinite(volume.voxels[static_cast<size_t>(i)])) {
      return InvalidArgument("{}: voxel {} is {}; a volume's values must be finite", path,
                             VoxelName(volume, i), volume.voxels[static_cast<size_t>(i)]);
    }
  }
  volume.spacing = {image->dx, image->dy, image->dz};
  const nifti_dmat44* to_world = image->sform_code > 0   ? &image->sto_xyz
                                 : image->qform_code > 0 ? &image->qto_xyz
                                                         : nullptr;
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 4; ++c) {
      volume.affine[r][c] = to_world != nullptr ? to_world->m[r][c]
                            : c == r            ? volume.spacing[static_cast<size_t>(r)]
                                                : 0.0;
    }
  }
  return volume;
}

Status WriteNifti(const std::string& path, const NiftiVolume& volume) {
  QuietLibrary();
  if (!EndsWith(path, ".nii") && !EndsWith(path, ".nii.gz")) {
    return InvalidArgument("{}: a NIfTI file's name ends in .nii or .nii.gz", path);
  }
  if (volume.width < 1 || volume.height < 1 || volume.depth < 1 || volume.channels < 1 ||
      static_cast<int64_t>(volume.voxels.size()) != volume.voxels_per_channel() * volume.channels) {
    return InvalidArgument(
        "a volume of {} x {} x {} voxels with {} channel(s) cannot hold {} values (writing {})",
        volume.width, volume.height, volume.depth, volume.channels, volume.voxels.size(), path);
  }
  const int64_t dims[8] = {volume.channels > 1 ? 4 : 3,
                           volume.width,
                           volume.height,
                           volume.depth,
                           volume.channels,
                           1,
                           1,
                           1};
  NiftiImage image(nifti_make_new_nim(dims, DatatypeCode(volume.stored), 1));
  if (image == nullptr) return Internal("the NIfTI library could not make an image for {}", path);
  TESSERA_RETURN_IF_ERROR(StoreVoxels(volume, image->data).WithContext(path));
  image->dx = image->pixdim[1] = volume.spacing[0];
  image->dy = image->pixdim[2] = volume.spacing[1];
  image->dz = image->pixdim[3] = volume.spacing[2];
  image->xyz_units = NIFTI_UNITS_MM;
  nifti_dmat44 to_world{};
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 4; ++c) to_world.m[r][c] = volume.affine[r][c];
  }
  to_world.m[3][3] = 1;
  image->sform_code = NIFTI_XFORM_SCANNER_ANAT;
  image->sto_xyz = to_world;
  image->qform_code = NIFTI_XFORM_SCANNER_ANAT;
  double dx = 0, dy = 0, dz = 0;
  nifti_dmat44_to_quatern(to_world, &image->quatern_b, &image->quatern_c, &image->quatern_d,
                          &image->qoffset_x, &image->qoffset_y, &image->qoffset_z, &dx, &dy, &dz,
                          &image->qfac);
  image->qto_xyz = to_world;
  // NIfTI-1 holds sizes below 2^15; larger volumes need NIfTI-2.
  const bool small = volume.width < 32768 && volume.height < 32768 && volume.depth < 32768 &&
                     volume.channels < 32768;
  image->nifti_type = small ? NIFTI_FTYPE_NIFTI1_1 : NIFTI_FTYPE_NIFTI2_1;
  // Written under a temporary name with the same extension (the library picks gzip by it).
  static std::atomic<int> counter{0};
  const std::string directory = DirectoryOf(path);
  if (struct stat folder{}; ::stat(directory.c_str(), &folder) != 0 || !S_ISDIR(folder.st_mode)) {
    return NotFound("cannot write {}: the folder {} does not exist", path, directory);
  }
  const std::string base =
      path.substr(path.rfind('/') == std::string::npos ? 0 : path.rfind('/') + 1);
  const std::string temp =
      fmt::format("{}/.tmp-{}-{}-{}", directory, ::getpid(), counter.fetch_add(1), base);
  std::free(image->fname);
  std::free(image->iname);
  image->fname = strdup(temp.c_str());
  image->iname = strdup(temp.c_str());
  image->iname_offset = -1;  // the library places the data after the header
  nifti_image_write(image.get());
  // The library's writer returns nothing: read the header back to know it wrote this file.
  NiftiImage written(nifti_image_read(temp.c_str(), 0));
  const auto cleanup = [&] { std::remove(temp.c_str()); };
  if (written == nullptr || written->nx != volume.width || written->ny != volume.height ||
      written->nz != volume.depth || written->datatype != image->datatype) {
    cleanup();
    return Unavailable("could not write {} (is {} writable, with space left?)", path, directory);
  }
  struct stat info {};
  if (!nifti_is_gzfile(temp.c_str()) &&
      (::stat(temp.c_str(), &info) != 0 ||
       info.st_size <
           written->iname_offset + volume.voxels_per_channel() * volume.channels * image->nbyper)) {
    cleanup();
    return Unavailable("writing {} stopped short (is there space left in {}?)", path, directory);
  }
  if (Status synced = SyncFile(temp, false); !synced.ok()) {
    cleanup();
    return synced;
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    cleanup();
    return Unavailable("cannot move the written {} into place: {}", path, std::strerror(error));
  }
  return SyncFile(directory, true);
}

Result<std::vector<int32_t>> NiftiLabels(const NiftiVolume& volume, int32_t classes,
                                         const std::string& path) {
  if (volume.channels != 1) {
    return InvalidArgument("label map {} has {} channels; a label map has one", path,
                           volume.channels);
  }
  std::vector<int32_t> labels(volume.voxels.size());
  for (size_t i = 0; i < volume.voxels.size(); ++i) {
    const float value = volume.voxels[i];
    if (value != std::nearbyint(value) || value < 0 || value >= static_cast<float>(classes)) {
      return InvalidArgument(
          "label map {} has the value {} at voxel {}; labels are whole numbers 0..{} for the "
          "model's {} classes (remap the labels, or give the model more classes)",
          path, value, VoxelName(volume, static_cast<int64_t>(i)), classes - 1, classes);
    }
    labels[i] = static_cast<int32_t>(value);
  }
  return labels;
}

}  // namespace tessera

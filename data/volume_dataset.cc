#include "data/volume_dataset.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "core/atomic_file.h"
#include "data/nifti.h"
#include "data/split_mix64.h"

namespace tessera {

namespace {

namespace fs = std::filesystem;

bool IsFile(const std::string& path) {
  std::error_code error;
  return fs::is_regular_file(path, error);
}

// The case name of a label map's file name, or empty for a file that is not NIfTI.
std::string CaseName(const std::string& file) {
  for (std::string_view ending : {".nii.gz", ".nii"}) {
    if (file.size() > ending.size() && file.ends_with(ending)) {
      return file.substr(0, file.size() - ending.size());
    }
  }
  return {};
}

// The label map's ending (.nii.gz or .nii), which the images share.
std::string EndingOf(const std::string& file) {
  return file.ends_with(".nii.gz") ? ".nii.gz" : ".nii";
}

// Zero mean, unit variance over the channel's voxels (a constant channel becomes zeros).
void Normalise(float* voxels, int64_t count) {
  double sum = 0, sum_squares = 0;
  for (int64_t i = 0; i < count; ++i) sum += voxels[i];
  const double mean = sum / static_cast<double>(count);
  for (int64_t i = 0; i < count; ++i) {
    const double d = voxels[i] - mean;
    sum_squares += d * d;
  }
  const double std_dev = std::sqrt(sum_squares / static_cast<double>(count));
  const double scale = std_dev > 1e-8 ? 1.0 / std_dev : 0.0;
  for (int64_t i = 0; i < count; ++i) {
    voxels[i] = static_cast<float>((voxels[i] - mean) * scale);
  }
}

std::string Shape(const NiftiVolume& v) {
  return fmt::format("{} x {} x {}", v.width, v.height, v.depth);
}

// Reads one case's image channels into `c` (sized by its label map).
Status ReadImages(const std::string& images, const std::string& ending, int64_t channels,
                  VolumeCase& c) {
  const int64_t voxels = c.width * c.height * c.depth;
  const auto check_size = [&](const NiftiVolume& image, const std::string& path) -> Status {
    if (image.width != c.width || image.height != c.height || image.depth != c.depth) {
      return InvalidArgument("case {}: image {} is {} voxels, its label map {} x {} x {}", c.name,
                             path, Shape(image), c.width, c.height, c.depth);
    }
    return Status::Ok();
  };
  c.image.resize(static_cast<size_t>(voxels * channels));
  const std::string whole = fmt::format("{}/{}{}", images, c.name, ending);
  const std::string first = fmt::format("{}/{}_0000{}", images, c.name, ending);
  if (IsFile(first)) {  // nnU-Net: a file per channel
    for (int64_t ch = 0; ch < channels; ++ch) {
      const std::string path = fmt::format("{}/{}_{:04d}{}", images, c.name, ch, ending);
      if (!IsFile(path)) {
        return NotFound("case {}: no {} for channel {} (the model reads {} channels)", c.name, path,
                        ch, channels);
      }
      TESSERA_ASSIGN_OR_RETURN(NiftiVolume image, ReadNifti(path));
      if (image.channels != 1) {
        return InvalidArgument("case {}: {} has {} channels; a per-channel image has one", c.name,
                               path, image.channels);
      }
      TESSERA_RETURN_IF_ERROR(check_size(image, path));
      std::copy(image.voxels.begin(), image.voxels.end(), c.image.begin() + ch * voxels);
    }
    const std::string extra = fmt::format("{}/{}_{:04d}{}", images, c.name, channels, ending);
    if (IsFile(extra)) {
      return InvalidArgument("case {} has more channels than the model's {} ({} exists)", c.name,
                             channels, extra);
    }
  } else if (IsFile(whole)) {  // the Decathlon: the channels as the 4th dimension
    TESSERA_ASSIGN_OR_RETURN(NiftiVolume image, ReadNifti(whole));
    if (image.channels != channels) {
      return InvalidArgument("case {}: {} has {} channel(s), the model reads {}", c.name, whole,
                             image.channels, channels);
    }
    TESSERA_RETURN_IF_ERROR(check_size(image, whole));
    c.image = std::move(image.voxels);
  } else {
    return NotFound("case {} has no image: neither {} nor {} exists", c.name, first, whole);
  }
  for (int64_t ch = 0; ch < channels; ++ch) Normalise(c.image.data() + ch * voxels, voxels);
  return Status::Ok();
}

// Reverses a patch^3 cube along `axis` (0: x, 1: y, 2: z), in place.
template <typename T>
void Flip(T* cube, int64_t patch, int axis) {
  const int64_t stride = axis == 0 ? 1 : axis == 1 ? patch : patch * patch;
  for (int64_t i = 0; i < patch * patch * patch; ++i) {
    const int64_t along = (i / stride) % patch;
    if (along < patch - 1 - along) std::swap(cube[i], cube[i + (patch - 1 - 2 * along) * stride]);
  }
}

}  // namespace

void CropPatch(const VolumeCase& c, PatchOrigin origin, int64_t patch, float* image,
               int32_t* labels) {
  const int64_t patch_voxels = patch * patch * patch;
  const int64_t case_voxels = c.width * c.height * c.depth;
  std::fill(image, image + c.channels * patch_voxels, 0.0f);
  std::fill(labels, labels + patch_voxels, 0);
  for (int64_t z = 0; z < patch; ++z) {
    const int64_t cz = origin.z + z;
    if (cz < 0 || cz >= c.depth) continue;
    for (int64_t y = 0; y < patch; ++y) {
      const int64_t cy = origin.y + y;
      if (cy < 0 || cy >= c.height) continue;
      // The run of x inside the case.
      const int64_t x_begin = std::max<int64_t>(0, -origin.x);
      const int64_t x_end = std::min(patch, c.width - origin.x);
      if (x_begin >= x_end) continue;
      const int64_t from = (cz * c.height + cy) * c.width + origin.x + x_begin;
      const int64_t to = (z * patch + y) * patch + x_begin;
      std::copy_n(c.labels.begin() + from, x_end - x_begin, labels + to);
      for (int64_t ch = 0; ch < c.channels; ++ch) {
        std::copy_n(c.image.begin() + ch * case_voxels + from, x_end - x_begin,
                    image + ch * patch_voxels + to);
      }
    }
  }
}

Result<std::vector<VolumeCase>> LoadVolumeDataset(const std::string& dir,
                                                  const VolumeDatasetOptions& options) {
  if (options.channels < 1) return InvalidArgument("channels must be at least 1");
  if (options.classes < 2) return InvalidArgument("classes must be at least 2");
  const std::string labels_dir = dir + "/labelsTr";
  const std::string images_dir = dir + "/imagesTr";
  std::error_code error;
  if (!fs::is_directory(labels_dir, error) || !fs::is_directory(images_dir, error)) {
    return NotFound(
        "{} is not a volume dataset: it needs {} and {} (nnU-Net's or the Medical Segmentation "
        "Decathlon's layout; train_unet3d --write-volumes DIR makes one)",
        dir, images_dir, labels_dir);
  }
  std::vector<std::string> label_files;
  for (const fs::directory_entry& entry : fs::directory_iterator(labels_dir, error)) {
    const std::string file = entry.path().filename().string();
    if (!file.starts_with(".") && !CaseName(file).empty()) label_files.push_back(file);
  }
  if (error) return Unavailable("cannot list {}: {}", labels_dir, error.message());
  std::sort(label_files.begin(), label_files.end());
  if (label_files.empty()) return NotFound("{} holds no .nii or .nii.gz label maps", labels_dir);
  std::vector<VolumeCase> cases;
  int64_t bytes = 0;
  for (const std::string& file : label_files) {
    const std::string path = fmt::format("{}/{}", labels_dir, file);
    TESSERA_ASSIGN_OR_RETURN(NiftiVolume label_map, ReadNifti(path));
    VolumeCase& c = cases.emplace_back();
    c.name = CaseName(file);
    c.width = label_map.width;
    c.height = label_map.height;
    c.depth = label_map.depth;
    c.channels = options.channels;
    c.spacing = label_map.spacing;
    c.affine = label_map.affine;
    TESSERA_ASSIGN_OR_RETURN(c.labels, NiftiLabels(label_map, options.classes, path));
    bytes += c.width * c.height * c.depth * (options.channels + 1) * 4;
    if (bytes > options.max_bytes) {
      return ResourceExhausted(
          "{}: the cases up to {} take {:.1f} MiB in memory, more than the {:.1f} MiB allowed "
          "(raise the limit, e.g. train_unet3d --data-memory-gib, or use fewer cases)",
          dir, c.name, bytes / double(1 << 20), options.max_bytes / double(1 << 20));
    }
    TESSERA_RETURN_IF_ERROR(ReadImages(images_dir, EndingOf(file), options.channels, c));
  }
  return cases;
}

Result<VolumeBatch> SamplePatches(const std::vector<VolumeCase>& cases, int64_t count,
                                  int64_t patch, uint64_t seed, int64_t first) {
  if (cases.empty()) return InvalidArgument("no cases to sample patches from");
  if (patch < 1) return InvalidArgument("patch size {} must be at least 1", patch);
  if (count < 1) return InvalidArgument("count {} must be at least 1", count);
  const int64_t channels = cases.front().channels;
  const int64_t patch_voxels = patch * patch * patch;
  if (count * channels * patch_voxels > kMaxVolumeElements) {
    return InvalidArgument("{} patches of {}^3 voxels with {} channels exceed {} elements", count,
                           patch, channels, kMaxVolumeElements);
  }
  VolumeBatch batch;
  batch.count = count;
  batch.channels = channels;
  batch.volume = patch;
  batch.volumes.assign(static_cast<size_t>(count * channels * patch_voxels), 0.0f);
  batch.labels.assign(static_cast<size_t>(count * patch_voxels), 0);
  for (int64_t s = 0; s < count; ++s) {
    SplitMix64 rng = StreamFor(seed, first + s);
    const VolumeCase& c =
        cases[static_cast<size_t>(rng.Int(0, static_cast<int64_t>(cases.size()) - 1))];
    // Per axis: where the patch starts in the case (negative: it starts in the padding) and
    // whether it is flipped.
    const int64_t size[3] = {c.width, c.height, c.depth};
    int64_t start[3];
    bool flip[3];
    for (int a = 0; a < 3; ++a) {
      start[a] = size[a] >= patch ? rng.Int(0, size[a] - patch) : -rng.Int(0, patch - size[a]);
      flip[a] = (rng.Next() & 1) != 0;
    }
    float* image = batch.volumes.data() + s * channels * patch_voxels;
    int32_t* labels = batch.labels.data() + s * patch_voxels;
    CropPatch(c, {start[0], start[1], start[2]}, patch, image, labels);
    for (int a = 0; a < 3; ++a) {
      if (!flip[a]) continue;
      for (int64_t ch = 0; ch < channels; ++ch) Flip(image + ch * patch_voxels, patch, a);
      Flip(labels, patch, a);
    }
  }
  return batch;
}

Status WriteVolumeDataset(const std::string& dir, const VolumeBatch& volumes) {
  const int64_t v = volumes.volume;
  const int64_t voxels = v * v * v;
  if (volumes.count < 1 || volumes.channels < 1 || v < 1 ||
      static_cast<int64_t>(volumes.volumes.size()) != volumes.count * volumes.channels * voxels ||
      static_cast<int64_t>(volumes.labels.size()) != volumes.count * voxels) {
    return InvalidArgument("volumes whose counts and contents disagree (writing {})", dir);
  }
  std::error_code error;
  for (const std::string& sub : {dir + "/imagesTr", dir + "/labelsTr"}) {
    fs::create_directories(sub, error);
    if (error) return Unavailable("cannot create {}: {}", sub, error.message());
  }
  for (int64_t i = 0; i < volumes.count; ++i) {
    const std::string name = fmt::format("case_{:03d}", i);
    NiftiVolume image;
    image.width = image.height = image.depth = v;
    image.stored = NiftiType::kFloat32;
    for (int64_t ch = 0; ch < volumes.channels; ++ch) {
      const float* from = volumes.volumes.data() + (i * volumes.channels + ch) * voxels;
      image.voxels.assign(from, from + voxels);
      TESSERA_RETURN_IF_ERROR(
          WriteNifti(fmt::format("{}/imagesTr/{}_{:04d}.nii.gz", dir, name, ch), image));
    }
    NiftiVolume labels;
    labels.width = labels.height = labels.depth = v;
    labels.stored = NiftiType::kUint8;
    const int32_t* from = volumes.labels.data() + i * voxels;
    labels.voxels.assign(from, from + voxels);
    TESSERA_RETURN_IF_ERROR(WriteNifti(fmt::format("{}/labelsTr/{}.nii.gz", dir, name), labels));
  }
  std::string channel_names;
  for (int64_t ch = 0; ch < volumes.channels; ++ch) {
    channel_names += fmt::format("{}\"{}\": \"generated{}\"", ch == 0 ? "" : ", ", ch, ch);
  }
  const std::string json = fmt::format(
      "{{\n  \"channel_names\": {{{}}},\n  \"labels\": {{\"background\": 0, \"sphere\": 1, "
      "\"box\": 2}},\n  \"numTraining\": {},\n  \"file_ending\": \".nii.gz\",\n  \"name\": "
      "\"tessera generated volumes (data/volumes.h)\"\n}}\n",
      channel_names, volumes.count);
  return WriteFileAtomically(dir + "/dataset.json", json);
}

}  // namespace tessera

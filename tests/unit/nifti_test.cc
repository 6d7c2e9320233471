// NIfTI volumes (data/nifti.h) and the volume dataset (data/volume_dataset.h): generated volumes
// round-trip through files (shape, spacing, orientation, type, values; .nii and .nii.gz, 3D and
// 4D, every writable type); bad files get errors naming the file and what is wrong (missing, not
// NIfTI, truncated, 2D, complex voxels, NaN, label values out of range or fractional); datasets
// in nnU-Net's and the Decathlon's layouts load, normalised, and refuse mismatches; patches are
// crops and flips of the cases, deterministic in the seed; sliding-window tiles cover a volume,
// a prediction made from perfect patch logits is the label map, and Dice per class is counted.
#include <gtest/gtest.h>

#include <unistd.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>

#include <nifti2_io.h>

#include "data/nifti.h"
#include "data/sliding_window.h"
#include "data/volume_dataset.h"
#include "data/volumes.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

class NiftiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt::format("tessera-nifti-test-{}", ::getpid());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

// A file written by the NIfTI library directly (what WriteNifti refuses to make), zero-filled, then
// changed by `change`.
void WriteRawNifti(const std::string& path, std::array<int64_t, 8> dims, int datatype,
                   const std::function<void(nifti_image*)>& change = nullptr) {
  nifti_image* image = nifti_make_new_nim(dims.data(), datatype, 1);
  ASSERT_NE(image, nullptr);
  if (change) change(image);
  nifti_set_filenames(image, path.c_str(), 0, 1);
  nifti_image_write(image);
  nifti_image_free(image);
}

NiftiVolume Ramp(int64_t w, int64_t h, int64_t d, int64_t c, NiftiType type) {
  NiftiVolume v;
  v.width = w;
  v.height = h;
  v.depth = d;
  v.channels = c;
  v.stored = type;
  v.spacing = {0.8, 1.25, 2.5};
  // A rotation about z by 90 degrees, the spacing, and an origin: an orientation that is not the
  // identity (RAS vs LPS and oblique scans are this kind of matrix).
  v.affine = {{{0, -1.25, 0, 10.5}, {0.8, 0, 0, -20.25}, {0, 0, 2.5, 33}}};
  v.voxels.resize(static_cast<size_t>(w * h * d * c));
  for (size_t i = 0; i < v.voxels.size(); ++i) {
    v.voxels[i] = type == NiftiType::kFloat32 || type == NiftiType::kFloat64
                      ? static_cast<float>(std::sin(0.1 * static_cast<double>(i)) * 100)
                      : static_cast<float>(i % 200);
  }
  return v;
}

TEST_F(NiftiTest, AVolumeRoundTripsInEveryTypeAndEnding) {
  for (NiftiType type : {NiftiType::kUint8, NiftiType::kInt16, NiftiType::kInt32,
                         NiftiType::kFloat32, NiftiType::kFloat64}) {
    for (const std::string ending : {".nii", ".nii.gz"}) {
      for (int64_t channels : {1, 3}) {
        SCOPED_TRACE(fmt::format("{} {} channels={}", NiftiTypeName(type), ending, channels));
        const NiftiVolume written = Ramp(7, 5, 4, channels, type);
        const std::string path = Path(fmt::format("v{}", ending));
        ASSERT_OK(WriteNifti(path, written));
        ASSERT_OK_AND_ASSIGN(NiftiVolume read, ReadNifti(path));
        EXPECT_EQ(read.width, 7);
        EXPECT_EQ(read.height, 5);
        EXPECT_EQ(read.depth, 4);
        EXPECT_EQ(read.channels, channels);
        EXPECT_EQ(read.stored, type);
        EXPECT_EQ(read.stored_name, NiftiTypeName(type));
        for (int a = 0; a < 3; ++a) EXPECT_NEAR(read.spacing[a], written.spacing[a], 1e-6);
        for (int r = 0; r < 3; ++r) {
          for (int c = 0; c < 4; ++c) EXPECT_NEAR(read.affine[r][c], written.affine[r][c], 1e-5);
        }
        EXPECT_EQ(read.voxels, written.voxels);
        EXPECT_FALSE(fs::exists(path + ".tmp"));
      }
    }
  }
  // Only the file itself is left: no temporary from the atomic write.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 2);
}

TEST_F(NiftiTest, BadFilesAreNamedWithWhatIsWrong) {
  EXPECT_EQ(ReadNifti(Path("absent.nii.gz")).status().code(), StatusCode::kNotFound);

  std::ofstream(Path("text.nii")) << "this is not a volume\n";
  Status status = ReadNifti(Path("text.nii")).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("text.nii is not a NIfTI-1 or NIfTI-2 file"), std::string::npos)
      << status.ToString();

  // Truncated: cut in the data, uncompressed and gzipped.
  ASSERT_OK(WriteNifti(Path("whole.nii"), Ramp(8, 8, 8, 1, NiftiType::kFloat32)));
  fs::copy_file(Path("whole.nii"), Path("cut.nii"));
  fs::resize_file(Path("cut.nii"), fs::file_size(Path("cut.nii")) - 100);
  status = ReadNifti(Path("cut.nii")).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("cut.nii is truncated: its header promises 512 voxels of "
                                  "FLOAT32 (2048 bytes from byte 352), the file has 2300 bytes"),
            std::string::npos)
      << status.ToString();
  ASSERT_OK(WriteNifti(Path("whole.nii.gz"), Ramp(16, 16, 16, 1, NiftiType::kFloat32)));
  fs::copy_file(Path("whole.nii.gz"), Path("cut.nii.gz"));
  fs::resize_file(Path("cut.nii.gz"), fs::file_size(Path("cut.nii.gz")) / 2);
  status = ReadNifti(Path("cut.nii.gz")).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("cut.nii.gz is truncated or damaged"), std::string::npos)
      << status.ToString();

  // Wrong dimensions (a 2D image, a 5D one) and complex voxels, written by the library itself.
  WriteRawNifti(Path("flat.nii"), {2, 6, 6, 1, 1, 1, 1, 1}, DT_FLOAT32);
  status = ReadNifti(Path("flat.nii")).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("flat.nii is 2-dimensional (6 x 6 x 1)"), std::string::npos)
      << status.ToString();
  WriteRawNifti(Path("five.nii"), {5, 4, 4, 4, 2, 3, 1, 1}, DT_FLOAT32);
  status = ReadNifti(Path("five.nii")).status();
  EXPECT_NE(status.message().find("five.nii has 5 dimensions (3 along dimension 5)"),
            std::string::npos)
      << status.ToString();
  WriteRawNifti(Path("complex.nii"), {3, 4, 4, 4, 1, 1, 1, 1}, DT_COMPLEX64);
  status = ReadNifti(Path("complex.nii")).status();
  EXPECT_NE(status.message().find("complex.nii stores COMPLEX64 voxels"), std::string::npos)
      << status.ToString();

  // Not finite: the reference library reads NaN and infinities in float files as 0 (its
  // nifti_read_buffer "fixes" them); nothing non-finite reaches a volume.
  NiftiVolume nan = Ramp(4, 4, 4, 1, NiftiType::kFloat32);
  nan.voxels[1 + 4 * (2 + 4 * 3)] = std::nanf("");
  nan.voxels[2] = INFINITY;
  ASSERT_OK(WriteNifti(Path("nan.nii"), nan));
  ASSERT_OK_AND_ASSIGN(NiftiVolume fixed, ReadNifti(Path("nan.nii")));
  EXPECT_EQ(fixed.voxels[1 + 4 * (2 + 4 * 3)], 0.0f);
  EXPECT_EQ(fixed.voxels[2], 0.0f);
  EXPECT_EQ(fixed.voxels[3], nan.voxels[3]);
  // Scaling that overflows f32 is refused, naming the voxel.
  WriteRawNifti(Path("scaled.nii"), {3, 2, 2, 2, 1, 1, 1, 1}, DT_INT16, [](nifti_image* image) {
    static_cast<int16_t*>(image->data)[3] = 30000;
    image->scl_slope = 1e36;
  });
  status = ReadNifti(Path("scaled.nii")).status();
  EXPECT_NE(status.message().find("voxel (x=1, y=1, z=0) is inf"), std::string::npos)
      << status.ToString();

  // Writing: a value an integer type cannot hold, an unknown ending, sizes that disagree.
  NiftiVolume fraction = Ramp(4, 4, 4, 1, NiftiType::kUint8);
  fraction.voxels[5] = 2.5f;
  status = WriteNifti(Path("fraction.nii"), fraction);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("voxel (x=1, y=1, z=0) is 2.5, which uint8 cannot hold"),
            std::string::npos)
      << status.ToString();
  EXPECT_FALSE(fs::exists(Path("fraction.nii")));
  EXPECT_EQ(WriteNifti(Path("v.img"), Ramp(4, 4, 4, 1, NiftiType::kUint8)).code(),
            StatusCode::kInvalidArgument);
  NiftiVolume short_volume = Ramp(4, 4, 4, 1, NiftiType::kUint8);
  short_volume.voxels.pop_back();
  EXPECT_EQ(WriteNifti(Path("short.nii"), short_volume).code(), StatusCode::kInvalidArgument);
  status = WriteNifti(Path("no/such/dir/v.nii"), Ramp(4, 4, 4, 1, NiftiType::kUint8));
  EXPECT_EQ(status.code(), StatusCode::kNotFound);
  EXPECT_NE(status.message().find("no/such/dir does not exist"), std::string::npos)
      << status.ToString();
}

TEST_F(NiftiTest, LabelsAreWholeClassesOrNamed) {
  NiftiVolume labels = Ramp(4, 4, 4, 1, NiftiType::kUint8);
  for (float& v : labels.voxels) v = std::fmod(v, 3.0f);
  ASSERT_OK_AND_ASSIGN(std::vector<int32_t> classes, NiftiLabels(labels, 3, "l.nii"));
  EXPECT_EQ(classes[4], 1);
  labels.voxels[2 + 4 * 1] = 3;
  Status status = NiftiLabels(labels, 3, "l.nii").status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find(
                "label map l.nii has the value 3 at voxel (x=2, y=1, z=0); labels are whole "
                "numbers 0..2 for the model's 3 classes"),
            std::string::npos)
      << status.ToString();
  labels.voxels[2 + 4 * 1] = 0.5f;
  EXPECT_NE(NiftiLabels(labels, 3, "l.nii").status().message().find("the value 0.5"),
            std::string::npos);
  labels.channels = 2;
  EXPECT_EQ(NiftiLabels(labels, 3, "l.nii").status().code(), StatusCode::kInvalidArgument);
}

TEST_F(NiftiTest, AGeneratedDatasetLoadsNormalisedInBothLayouts) {
  ASSERT_OK_AND_ASSIGN(VolumeBatch generated, GenerateVolumes(3, 12, 2, 5));
  ASSERT_OK(WriteVolumeDataset(Path("nnunet"), generated));
  EXPECT_TRUE(fs::exists(Path("nnunet/imagesTr/case_002_0001.nii.gz")));
  EXPECT_TRUE(fs::exists(Path("nnunet/dataset.json")));
  ASSERT_OK_AND_ASSIGN(std::vector<VolumeCase> cases,
                       LoadVolumeDataset(Path("nnunet"), {.channels = 2, .classes = 3}));
  ASSERT_EQ(cases.size(), 3u);
  const int64_t voxels = int64_t{12} * 12 * 12;
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(cases[i].name, fmt::format("case_{:03d}", i));
    EXPECT_EQ(cases[i].width, 12);
    const std::vector<int32_t> labels(
        generated.labels.begin() + static_cast<int64_t>(i) * voxels,
        generated.labels.begin() + static_cast<int64_t>(i + 1) * voxels);
    EXPECT_EQ(cases[i].labels, labels);
    for (int64_t ch = 0; ch < 2; ++ch) {
      const float* x = cases[i].image.data() + ch * voxels;
      const double mean = std::accumulate(x, x + voxels, 0.0) / voxels;
      double var = 0;
      for (int64_t j = 0; j < voxels; ++j) var += (x[j] - mean) * (x[j] - mean);
      EXPECT_NEAR(mean, 0, 1e-5);
      EXPECT_NEAR(var / voxels, 1, 1e-4);
      // Normalising is affine: the order of intensities is the generated one.
      const float* g = generated.volumes.data() + (static_cast<int64_t>(i) * 2 + ch) * voxels;
      EXPECT_EQ(x[0] < x[1], g[0] < g[1]);
    }
  }

  // The Decathlon's layout: one 4D image per case.
  fs::create_directories(Path("msd/imagesTr"));
  fs::create_directories(Path("msd/labelsTr"));
  NiftiVolume image = Ramp(6, 5, 4, 2, NiftiType::kFloat32);
  NiftiVolume labels = Ramp(6, 5, 4, 1, NiftiType::kUint8);
  for (float& v : labels.voxels) v = std::fmod(v, 2.0f);
  ASSERT_OK(WriteNifti(Path("msd/imagesTr/brain_1.nii.gz"), image));
  ASSERT_OK(WriteNifti(Path("msd/labelsTr/brain_1.nii.gz"), labels));
  ASSERT_OK_AND_ASSIGN(cases, LoadVolumeDataset(Path("msd"), {.channels = 2, .classes = 2}));
  ASSERT_EQ(cases.size(), 1u);
  EXPECT_EQ(cases[0].depth, 4);

  // Mismatches are named.
  Status status = LoadVolumeDataset(Path("msd"), {.channels = 1, .classes = 2}).status();
  EXPECT_NE(status.message().find("brain_1.nii.gz has 2 channel(s), the model reads 1"),
            std::string::npos)
      << status.ToString();
  status = LoadVolumeDataset(Path("msd"), {.channels = 2, .classes = 1}).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  ASSERT_OK(WriteNifti(Path("msd/labelsTr/brain_2.nii.gz"), Ramp(6, 5, 3, 1, NiftiType::kUint8)));
  status = LoadVolumeDataset(Path("msd"), {.channels = 2, .classes = 200}).status();
  EXPECT_EQ(status.code(), StatusCode::kNotFound);
  EXPECT_NE(status.message().find("case brain_2 has no image"), std::string::npos)
      << status.ToString();
  ASSERT_OK(WriteNifti(Path("msd/imagesTr/brain_2.nii.gz"), image));
  status = LoadVolumeDataset(Path("msd"), {.channels = 2, .classes = 200}).status();
  EXPECT_NE(status.message().find("is 6 x 5 x 4 voxels, its label map 6 x 5 x 3"),
            std::string::npos)
      << status.ToString();
  status = LoadVolumeDataset(Path("nnunet"), {.channels = 1, .classes = 3}).status();
  EXPECT_NE(status.message().find("more channels than the model's 1"), std::string::npos)
      << status.ToString();
  status =
      LoadVolumeDataset(Path("nnunet"), {.channels = 2, .classes = 3, .max_bytes = 1000}).status();
  EXPECT_EQ(status.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(LoadVolumeDataset(Path("nowhere"), {}).status().code(), StatusCode::kNotFound);
}

TEST_F(NiftiTest, PatchesAreCropsAndFlipsOfTheCasesDeterministicInTheSeed) {
  VolumeCase c;
  c.name = "ramp";
  c.width = 9;
  c.height = 7;
  c.depth = 5;
  c.channels = 1;
  for (int64_t i = 0; i < int64_t{9} * 7 * 5; ++i) {
    c.image.push_back(static_cast<float>(i));
    c.labels.push_back(static_cast<int32_t>(i % 3));
  }
  const std::vector<VolumeCase> cases = {c};
  ASSERT_OK_AND_ASSIGN(VolumeBatch batch, SamplePatches(cases, 6, 4, 11, 0));
  EXPECT_EQ(batch.volumes.size(), 6u * 64u);
  for (int64_t s = 0; s < 6; ++s) {
    // Every patch is a box of the case, maybe flipped per axis: along each axis, neighbours in
    // the patch differ by the case's stride along that axis, one sign for the whole patch.
    const float* p = batch.volumes.data() + s * 64;
    const auto at = [&](int64_t x, int64_t y, int64_t z) { return p[(z * 4 + y) * 4 + x]; };
    EXPECT_EQ(std::abs(at(1, 0, 0) - at(0, 0, 0)), 1);
    EXPECT_EQ(std::abs(at(0, 1, 0) - at(0, 0, 0)), 9);
    EXPECT_EQ(std::abs(at(0, 0, 1) - at(0, 0, 0)), 63);
    EXPECT_EQ(at(3, 2, 1) - at(2, 2, 1), at(1, 0, 0) - at(0, 0, 0));
    for (int64_t i = 0; i < 64; ++i) {
      EXPECT_EQ(batch.labels[static_cast<size_t>(s * 64 + i)], static_cast<int32_t>(p[i]) % 3);
    }
  }
  // The same stream again, and a resumed stream (from patch 3) gives the same patches.
  ASSERT_OK_AND_ASSIGN(VolumeBatch again, SamplePatches(cases, 6, 4, 11, 0));
  EXPECT_EQ(again.volumes, batch.volumes);
  ASSERT_OK_AND_ASSIGN(VolumeBatch later, SamplePatches(cases, 3, 4, 11, 3));
  EXPECT_TRUE(std::equal(later.volumes.begin(), later.volumes.end(),
                         batch.volumes.begin() + int64_t{3} * 64));
  ASSERT_OK_AND_ASSIGN(VolumeBatch other, SamplePatches(cases, 6, 4, 12, 0));
  EXPECT_NE(other.volumes, batch.volumes);

  // A patch larger than the case: the case inside, padding of zeros and background around.
  ASSERT_OK_AND_ASSIGN(VolumeBatch padded, SamplePatches(cases, 1, 10, 3, 0));
  const int64_t nonzero_labels =
      std::count_if(padded.labels.begin(), padded.labels.end(), [](int32_t l) { return l != 0; });
  EXPECT_EQ(nonzero_labels,
            std::count_if(c.labels.begin(), c.labels.end(), [](int32_t l) { return l != 0; }));
  EXPECT_EQ(SamplePatches({}, 1, 4, 1, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SamplePatches(cases, 1, 0, 1, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(SlidingWindowTest, TilesCoverTheVolumeHalfAPatchApart) {
  const std::vector<PatchOrigin> tiles = SlidingWindowTiles(17, 8, 5, 8, 4);
  // x: 0, 4, 8 and 9 (the last ends at 17); y: one patch; z: one patch, centred (starts at -1).
  ASSERT_EQ(tiles.size(), 4u);
  EXPECT_EQ(tiles[3].x, 9);
  EXPECT_EQ(tiles[0].y, 0);
  EXPECT_EQ(tiles[0].z, -1);
  std::vector<int> covered(size_t{17} * 8 * 5, 0);
  for (const PatchOrigin& t : tiles) {
    for (int64_t z = std::max<int64_t>(0, t.z); z < std::min<int64_t>(5, t.z + 8); ++z) {
      for (int64_t y = t.y; y < t.y + 8; ++y) {
        for (int64_t x = t.x; x < t.x + 8; ++x)
          ++covered[static_cast<size_t>((z * 8 + y) * 17 + x)];
      }
    }
  }
  EXPECT_EQ(std::count(covered.begin(), covered.end(), 0), 0);
  EXPECT_EQ(SlidingWindowTiles(32, 32, 32, 16, 8).size(), 27u);  // 0, 8, 16 per axis
}

// The model replaced by an oracle: each patch's logits favour the patch's true labels. The
// Gaussian-weighted sum over overlapping patches then predicts the label map exactly.
TEST(SlidingWindowTest, PerfectPatchLogitsPredictTheLabelMap) {
  ASSERT_OK_AND_ASSIGN(VolumeBatch generated, GenerateVolumes(1, 20, 1, 3));
  VolumeCase c;
  c.width = c.height = c.depth = 20;
  c.channels = 1;
  c.image = generated.volumes;
  c.labels = generated.labels;
  constexpr int64_t kPatch = 8, kClasses = 3, kVoxels = kPatch * kPatch * kPatch;
  SlidingWindowPrediction prediction(20, 20, 20, kClasses, kPatch);
  std::vector<float> image(kVoxels), logits(kClasses * kVoxels);
  std::vector<int32_t> labels(kVoxels);
  for (const PatchOrigin& t : SlidingWindowTiles(20, 20, 20, kPatch, kPatch / 2)) {
    CropPatch(c, t, kPatch, image.data(), labels.data());
    for (int64_t v = 0; v < kVoxels; ++v) {
      for (int64_t k = 0; k < kClasses; ++k) {
        logits[static_cast<size_t>(k * kVoxels + v)] = labels[static_cast<size_t>(v)] == k ? 3 : 0;
      }
    }
    prediction.Add(t, logits.data());
  }
  EXPECT_EQ(prediction.Classes(), c.labels);
  ASSERT_OK_AND_ASSIGN(std::vector<double> dice,
                       DicePerClass(prediction.Classes(), c.labels, kClasses));
  ASSERT_EQ(dice.size(), 2u);
  EXPECT_EQ(dice[0], 1.0);
  EXPECT_EQ(dice[1], 1.0);
}

TEST(SlidingWindowTest, DicePerClassCountsOverlap) {
  // Class 1: predicted 3 voxels, true 2, overlap 2 -> 4/5. Class 2: in neither -> NaN.
  ASSERT_OK_AND_ASSIGN(std::vector<double> dice, DicePerClass({1, 1, 1, 0, 0}, {1, 1, 0, 0, 0}, 3));
  EXPECT_DOUBLE_EQ(dice[0], 0.8);
  EXPECT_TRUE(std::isnan(dice[1]));
  EXPECT_EQ(DicePerClass({1}, {1, 0}, 3).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tessera::testing

// The volume ops against PyTorch (tests/reference/make_volume_reference.py): outputs and input
// gradients of conv3d, conv_transpose3d, upsample_nearest3d, max_pool3d, group_norm, SiLU, ReLU,
// the voxel cross-entropy and the Dice score.
//
// Tolerance: 1e-5 of each tensor's scale (ScaledMaxError). The references are PyTorch evaluated
// in float64 from the same f32 inputs and rounded to f32 once, so they are the exact answers to
// within 6e-8. Our kernels sum in f32 inside GEMMs (at most 250 terms here: conv_s1p1's weight
// gradient sums 2 samples x 125 positions) and in double elsewhere (norm statistics, bias
// gradients, losses). f32 rounding in a sum of K terms is bounded by K * 2^-24 ~ 1.5e-5 of the
// terms' magnitudes and in practice grows like sqrt(K) * 2^-24 ~ 1e-6; the errors seen are
// ~2e-7. 1e-5 leaves room for OpenBLAS's other kernel families (this suite runs under each)
// while any indexing or formula error shows up at the scale of a whole term (>= 1e-2).
#include <cmath>
#include <string>

#include "test_util.h"

namespace tessera::testing {
namespace {

using Tensors = std::vector<Tensor>;

constexpr double kTolerance = 1e-5;

class VolumeReferenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::map<std::string, ReferenceTensor>> file =
        ReadReferenceFile(SourcePath("tests/reference/volume_reference.bin"));
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    ref_ = *std::move(file);
  }

  const ReferenceTensor& Ref(const std::string& name) const {
    auto it = ref_.find(name);
    TESSERA_CHECK(it != ref_.end(), "reference tensor '{}' is missing", name);
    return it->second;
  }
  Tensor Float(const std::string& name) const {
    return FloatTensor(Ref(name).shape, Ref(name).floats);
  }
  Tensor Int(const std::string& name) const { return IntTensor(Ref(name).shape, Ref(name).ints); }
  int64_t Attr(const std::string& test, size_t i) const { return Ref(test + ".attrs").ints.at(i); }

  // Compares `actual` with reference tensor `name` (shape and values) and prints the error.
  void ExpectMatches(const Tensor& actual, const std::string& name) const {
    const ReferenceTensor& expected = Ref(name);
    ASSERT_EQ(actual.shape(), expected.shape) << name;
    const double error = ScaledMaxError(ToVector(actual), expected.floats);
    std::printf("%-22s max error %.2e of its scale\n", name.c_str(), error);
    EXPECT_LE(error, kTolerance) << name << " differs from PyTorch by " << error << " of its scale";
  }

  // A forward op with inputs x, w, b and output y, and its backward (dy, x, w) -> dx, dw, db.
  void CheckConvolution(const std::string& test, const std::string& op) {
    const Attrs attrs{{"stride", Attr(test, 0)}, {"padding", Attr(test, 1)}};
    const Tensor x = Float(test + ".x"), w = Float(test + ".w");
    ASSERT_OK_AND_ASSIGN(Tensors y, RunKernel(op + "_forward", {x, w, Float(test + ".b")}, attrs));
    ExpectMatches(y[0], test + ".y");
    ASSERT_OK_AND_ASSIGN(Tensors grads,
                         RunKernel(op + "_backward", {Float(test + ".dy"), x, w}, attrs));
    ExpectMatches(grads[0], test + ".dx");
    ExpectMatches(grads[1], test + ".dw");
    ExpectMatches(grads[2], test + ".db");
  }

  std::map<std::string, ReferenceTensor> ref_;
};

TEST_F(VolumeReferenceTest, Conv3dStride1Padding1) { CheckConvolution("conv_s1p1", "conv3d"); }

TEST_F(VolumeReferenceTest, Conv3dStride2UnequalKernel) { CheckConvolution("conv_s2", "conv3d"); }

TEST_F(VolumeReferenceTest, ConvTranspose3dKernel2Stride2) {
  CheckConvolution("convt_k2s2", "conv_transpose3d");
}

TEST_F(VolumeReferenceTest, ConvTranspose3dKernel3Stride2Padding1) {
  CheckConvolution("convt_k3s2p1", "conv_transpose3d");
}

TEST_F(VolumeReferenceTest, UpsampleNearest3d) {
  const Attrs attrs{{"scale", Attr("upsample", 0)}};
  ASSERT_OK_AND_ASSIGN(Tensors y,
                       RunKernel("upsample_nearest3d_forward", {Float("upsample.x")}, attrs));
  ExpectMatches(y[0], "upsample.y");
  ASSERT_OK_AND_ASSIGN(Tensors dx,
                       RunKernel("upsample_nearest3d_backward", {Float("upsample.dy")}, attrs));
  ExpectMatches(dx[0], "upsample.dx");
}

TEST_F(VolumeReferenceTest, MaxPool3dFloorMode) {
  const Attrs attrs{{"kernel", Attr("maxpool", 0)}};
  const Tensor x = Float("maxpool.x");
  ASSERT_OK_AND_ASSIGN(Tensors y, RunKernel("max_pool3d_forward", {x}, attrs));
  ExpectMatches(y[0], "maxpool.y");
  ASSERT_EQ(y[1].shape(), Ref("maxpool.indices").shape);
  const int32_t* indices = y[1].data<int32_t>();
  EXPECT_EQ(std::vector<int32_t>(indices, indices + y[1].numel()), Ref("maxpool.indices").ints);
  ASSERT_OK_AND_ASSIGN(Tensors dx,
                       RunKernel("max_pool3d_backward", {Float("maxpool.dy"), x, y[1]}, attrs));
  ExpectMatches(dx[0], "maxpool.dx");
}

TEST_F(VolumeReferenceTest, GroupNorm) {
  const Attrs attrs{{"groups", Attr("groupnorm", 0)}};
  const Tensor x = Float("groupnorm.x"), w = Float("groupnorm.w");
  ASSERT_OK_AND_ASSIGN(Tensors y,
                       RunKernel("group_norm_forward", {x, w, Float("groupnorm.b")}, attrs));
  ExpectMatches(y[0], "groupnorm.y");
  ExpectMatches(y[1], "groupnorm.mean");
  ExpectMatches(y[2], "groupnorm.rstd");
  ASSERT_OK_AND_ASSIGN(Tensors grads, RunKernel("group_norm_backward",
                                                {Float("groupnorm.dy"), x, w, y[1], y[2]}, attrs));
  ExpectMatches(grads[0], "groupnorm.dx");
  ExpectMatches(grads[1], "groupnorm.dw");
  ExpectMatches(grads[2], "groupnorm.db");
}

TEST_F(VolumeReferenceTest, SiluAndRelu) {
  for (const std::string op : {"silu", "relu"}) {
    const Tensor x = Float(op + ".x");
    ASSERT_OK_AND_ASSIGN(Tensors y, RunKernel(op + "_forward", {x}));
    ExpectMatches(y[0], op + ".y");
    ASSERT_OK_AND_ASSIGN(Tensors dx, RunKernel(op + "_backward", {Float(op + ".dy"), x}));
    ExpectMatches(dx[0], op + ".dx");
  }
}

TEST_F(VolumeReferenceTest, VoxelCrossEntropy) {
  const Attrs attrs{{"grad_scale", static_cast<double>(Ref("voxel_ce.grad_scale").floats[0])}};
  ASSERT_OK_AND_ASSIGN(
      Tensors out,
      RunKernel("voxel_cross_entropy", {Float("voxel_ce.logits"), Int("voxel_ce.targets")}, attrs));
  const float expected = Ref("voxel_ce.loss").floats[0];
  std::printf("voxel_ce loss %.8f vs PyTorch %.8f\n", *out[0].data<float>(), expected);
  EXPECT_NEAR(*out[0].data<float>(), expected, kTolerance * std::abs(expected));
  ExpectMatches(out[1], "voxel_ce.dlogits");
}

// Deep supervision's pieces against PyTorch: downsample_labels is interpolate(mode=
// "nearest-exact") at 1/2 exactly, and two weighted voxel_cross_entropy terms (2/3 and 1/3) sum
// to PyTorch's weighted loss, each term's dlogits its gradient.
TEST_F(VolumeReferenceTest, DeepSupervisionLevels) {
  ASSERT_OK_AND_ASSIGN(Tensors coarse, RunKernel("downsample_labels", {Int("deep_sup.targets")},
                                                 Attrs{{"factor", int64_t{2}}}));
  ASSERT_EQ(coarse[0].shape(), Ref("deep_sup.coarse").shape);
  const std::vector<int32_t> sampled(coarse[0].data<int32_t>(),
                                     coarse[0].data<int32_t>() + coarse[0].numel());
  EXPECT_EQ(sampled, Ref("deep_sup.coarse").ints);
  ASSERT_OK_AND_ASSIGN(Tensors fine, RunKernel("voxel_cross_entropy",
                                               {Float("deep_sup.logits0"), Int("deep_sup.targets")},
                                               Attrs{{"weight", 2.0 / 3.0}}));
  ASSERT_OK_AND_ASSIGN(Tensors half,
                       RunKernel("voxel_cross_entropy", {Float("deep_sup.logits1"), coarse[0]},
                                 Attrs{{"weight", 1.0 / 3.0}}));
  const double loss = static_cast<double>(*fine[0].data<float>()) + *half[0].data<float>();
  const float expected = Ref("deep_sup.loss").floats[0];
  std::printf("deep_sup loss %.8f vs PyTorch %.8f\n", loss, expected);
  EXPECT_NEAR(loss, expected, kTolerance * std::abs(expected));
  ExpectMatches(fine[1], "deep_sup.dlogits0");
  ExpectMatches(half[1], "deep_sup.dlogits1");
}

TEST_F(VolumeReferenceTest, DiceScore) {
  ASSERT_OK_AND_ASSIGN(
      Tensors out, RunKernel("dice_score", {Float("voxel_ce.logits"), Int("voxel_ce.targets")}));
  // Counts are integers and the ratio is formed in double: equal to the f32 rounding.
  EXPECT_FLOAT_EQ(*out[0].data<float>(), Ref("dice.score").floats[0]);
}

}  // namespace
}  // namespace tessera::testing

// The volume ops (ops/volume_ops.h): every backward against finite differences of its forward,
// with the backward's inputs assembled from the forward op's GradientRule (so the rules are
// checked too); shape errors; chunked convolutions against one chunk; and the same bits on any
// number of threads.
//
// The finite-difference check (tests/op_gradient_check.h) holds each gradient to 2% of its
// scale: with a step of 1e-2 the f32 rounding of L (~1e-6 of L) contributes ~1e-4 and the
// truncation error O(step^2) less.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <utility>

#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <fmt/format.h>

#include "core/half.h"
#include "op_gradient_check.h"
#include "ops/cpu/volume_kernels.h"
#include "ops/volume_ops.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using Tensors = std::vector<Tensor>;

// Every gradient the forward's GradientRule names, on 40 elements of each input.
void CheckGradients(GradientCase c) { ExpectGradientsMatchFiniteDifferences(std::move(c), 40); }

Attrs ConvAttrs(int64_t stride, int64_t padding) {
  return Attrs{{"stride", stride}, {"padding", padding}};
}

// Uniform values kept at least `gap` away from zero (no finite difference crosses ReLU's kink).
Tensor AwayFromZero(const Shape& shape, uint64_t seed, float gap) {
  Tensor t = RandomTensor(shape, seed, 2.0f);
  for (int64_t i = 0; i < t.numel(); ++i) {
    float& v = t.data<float>()[i];
    v = v < 0 ? v - gap : v + gap;
  }
  return t;
}

// A random permutation of values 0.01 apart: every pooling window has one clear maximum.
Tensor DistinctValues(const Shape& shape, uint64_t seed) {
  std::vector<float> values(static_cast<size_t>(shape.numel()));
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.01f * static_cast<float>(i) - 1.0f;
  std::shuffle(values.begin(), values.end(), std::mt19937_64(seed));
  return FloatTensor(shape, values);
}

// ---- finite differences ----

TEST(VolumeGradientTest, Conv3dStride1Padding1) {
  CheckGradients({.forward = "conv3d_forward",
                  .forward_attrs = ConvAttrs(1, 1),
                  .inputs = {RandomTensor({2, 3, 4, 5, 4}, 1), RandomTensor({4, 3, 3, 3, 3}, 2),
                             RandomTensor({4}, 3)}});
}

TEST(VolumeGradientTest, Conv3dStride2Padding1) {
  CheckGradients({.forward = "conv3d_forward",
                  .forward_attrs = ConvAttrs(2, 1),
                  .inputs = {RandomTensor({2, 3, 6, 5, 6}, 1), RandomTensor({2, 3, 3, 3, 3}, 2),
                             RandomTensor({2}, 3)}});
}

TEST(VolumeGradientTest, Conv3dUnequalKernelStride2NoPadding) {
  CheckGradients({.forward = "conv3d_forward",
                  .forward_attrs = ConvAttrs(2, 0),
                  .inputs = {RandomTensor({2, 2, 5, 6, 4}, 1), RandomTensor({3, 2, 3, 1, 2}, 2),
                             RandomTensor({3}, 3)}});
}

TEST(VolumeGradientTest, ConvTranspose3dKernel2Stride2) {
  CheckGradients({.forward = "conv_transpose3d_forward",
                  .forward_attrs = ConvAttrs(2, 0),
                  .inputs = {RandomTensor({2, 4, 3, 2, 3}, 1), RandomTensor({4, 3, 2, 2, 2}, 2),
                             RandomTensor({3}, 3)}});
}

TEST(VolumeGradientTest, ConvTranspose3dKernel3Stride2Padding1) {
  CheckGradients({.forward = "conv_transpose3d_forward",
                  .forward_attrs = ConvAttrs(2, 1),
                  .inputs = {RandomTensor({2, 3, 3, 4, 3}, 1), RandomTensor({3, 2, 3, 3, 3}, 2),
                             RandomTensor({2}, 3)}});
}

// The bias-free convolution plus channel_bias_add is conv3d (how a tensor-parallel pair of
// convolutions adds its bias after its partial sums): values and gradients.
TEST(VolumeGradientTest, Conv3dWithoutBiasThenChannelBiasIsConv3d) {
  const Tensor x = RandomTensor({2, 3, 4, 5, 4}, 1), w = RandomTensor({4, 3, 3, 3, 3}, 2);
  const Tensor b = RandomTensor({4}, 3);
  CheckGradients(
      {.forward = "conv3d_no_bias_forward", .forward_attrs = ConvAttrs(1, 1), .inputs = {x, w}});
  CheckGradients({.forward = "channel_bias_add_forward",
                  .inputs = {RandomTensor({2, 4, 3, 2, 3}, 4), RandomTensor({4}, 5)}});
  ASSERT_OK_AND_ASSIGN(Tensors whole, RunKernel("conv3d_forward", {x, w, b}, ConvAttrs(1, 1)));
  ASSERT_OK_AND_ASSIGN(Tensors part, RunKernel("conv3d_no_bias_forward", {x, w}, ConvAttrs(1, 1)));
  ASSERT_OK_AND_ASSIGN(Tensors biased, RunKernel("channel_bias_add_forward", {part[0], b}));
  const std::vector<float> expected = ToVector(whole[0]), got = ToVector(biased[0]);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], expected[i], 1e-5f) << i;
  // The backward: dx and dweight are conv3d's bit for bit, dbias channel_bias_add's.
  const Tensor dy = RandomTensor(whole[0].shape(), 6);
  ASSERT_OK_AND_ASSIGN(Tensors full, RunKernel("conv3d_backward", {dy, x, w}, ConvAttrs(1, 1)));
  ASSERT_OK_AND_ASSIGN(Tensors no_bias,
                       RunKernel("conv3d_no_bias_backward", {dy, x, w}, ConvAttrs(1, 1)));
  ASSERT_OK_AND_ASSIGN(Tensors weight_half,
                       RunKernel("conv3d_no_bias_backward_weight", {dy, x, w}, ConvAttrs(1, 1)));
  ASSERT_OK_AND_ASSIGN(Tensors bias_grad, RunKernel("channel_bias_add_backward", {dy}));
  ASSERT_EQ(no_bias.size(), 2u);
  ASSERT_EQ(weight_half.size(), 1u);
  EXPECT_EQ(ToVector(no_bias[0]), ToVector(full[0]));
  EXPECT_EQ(ToVector(no_bias[1]), ToVector(full[1]));
  EXPECT_EQ(ToVector(weight_half[0]), ToVector(full[1]));
  EXPECT_EQ(ToVector(bias_grad[0]), ToVector(dy));
  EXPECT_EQ(ToVector(bias_grad[1]), ToVector(full[2]));
  // A bias of the wrong length is refused naming it.
  Result<Tensors> wrong = RunKernel("channel_bias_add_forward", {part[0], RandomTensor({5}, 7)});
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("input 'bias'"), std::string::npos)
      << wrong.status().ToString();
}

// The convolutions' backward halves (zero-bubble pipelines): dx alone and dweight/dbias alone
// are the whole backward's outputs, bit for bit.
TEST(VolumeGradientTest, ConvolutionBackwardHalvesAreTheWholeBackward) {
  struct Case {
    std::string op;
    Attrs attrs;
    Tensor x, weight, dy;
  };
  const std::vector<Case> cases = {
      {"conv3d", ConvAttrs(2, 1), RandomTensor({2, 3, 6, 5, 6}, 1),
       RandomTensor({2, 3, 3, 3, 3}, 2), RandomTensor({2, 2, 3, 3, 3}, 3)},
      {"conv_transpose3d", ConvAttrs(2, 1), RandomTensor({2, 3, 3, 4, 3}, 1),
       RandomTensor({3, 2, 3, 3, 3}, 2), RandomTensor({2, 2, 5, 7, 5}, 3)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.op);
    const std::vector<Tensor> in = {c.dy, c.x, c.weight};
    ASSERT_OK_AND_ASSIGN(auto whole, RunKernel(c.op + "_backward", in, c.attrs));
    ASSERT_OK_AND_ASSIGN(auto input, RunKernel(c.op + "_backward_input", in, c.attrs));
    ASSERT_OK_AND_ASSIGN(auto weight, RunKernel(c.op + "_backward_weight", in, c.attrs));
    ASSERT_EQ(whole.size(), 3u);
    ASSERT_EQ(input.size(), 1u);
    ASSERT_EQ(weight.size(), 2u);
    EXPECT_EQ(ToVector(input[0]), ToVector(whole[0]));
    EXPECT_EQ(ToVector(weight[0]), ToVector(whole[1]));
    EXPECT_EQ(ToVector(weight[1]), ToVector(whole[2]));
  }
}

TEST(VolumeGradientTest, UpsampleNearest3d) {
  CheckGradients({.forward = "upsample_nearest3d_forward",
                  .forward_attrs = Attrs{{"scale", int64_t{2}}},
                  .inputs = {RandomTensor({2, 3, 2, 3, 2}, 1)}});
  CheckGradients({.forward = "upsample_nearest3d_forward",
                  .forward_attrs = Attrs{{"scale", int64_t{3}}},
                  .inputs = {RandomTensor({1, 2, 2, 1, 2}, 1)}});
}

TEST(VolumeGradientTest, MaxPool3d) {
  // W = 5: floor mode drops the last column, whose gradient must be zero.
  CheckGradients({.forward = "max_pool3d_forward",
                  .inputs = {DistinctValues({2, 3, 4, 6, 5}, 1)},
                  .step = 1e-3f});
  CheckGradients({.forward = "max_pool3d_forward",
                  .forward_attrs = Attrs{{"kernel", int64_t{3}}},
                  .inputs = {DistinctValues({1, 2, 6, 3, 6}, 2)},
                  .step = 1e-3f});
}

TEST(VolumeGradientTest, GroupNorm) {
  CheckGradients({.forward = "group_norm_forward",
                  .forward_attrs = Attrs{{"groups", int64_t{3}}},
                  .inputs = {RandomTensor({2, 6, 4, 3, 5}, 1, 2.0f), RandomTensor({6}, 2),
                             RandomTensor({6}, 3)}});
  // One group per channel (instance norm) and one for all (layer norm over C, D, H, W).
  for (int64_t groups : {int64_t{4}, int64_t{1}}) {
    CheckGradients({.forward = "group_norm_forward",
                    .forward_attrs = Attrs{{"groups", groups}, {"eps", 1e-3}},
                    .inputs = {RandomTensor({2, 4, 3, 3, 3}, 4, 2.0f), RandomTensor({4}, 5),
                               RandomTensor({4}, 6)}});
  }
}

// ---- spatial parallelism: slabs of a volume's depth ----

// Planes [first, first + count) of x [N, C, D, H, W] along D.
Tensor DepthSlab(const Tensor& x, int64_t first, int64_t count) {
  const Shape& s = x.shape();
  const int64_t rows = s[0] * s[1], plane = s[3] * s[4];
  std::vector<float> out;
  for (int64_t r = 0; r < rows; ++r) {
    const float* from = x.data<float>() + (r * s[2] + first) * plane;
    out.insert(out.end(), from, from + count * plane);
  }
  return FloatTensor(Shape{s[0], s[1], count, s[3], s[4]}, out);
}

// The slabs, joined back along D.
Tensor JoinDepth(const Tensors& slabs) {
  const Shape& s = slabs[0].shape();
  const int64_t rows = s[0] * s[1], plane = s[3] * s[4];
  std::vector<float> out;
  int64_t depth = 0;
  for (const Tensor& slab : slabs) depth += slab.shape()[2];
  for (int64_t r = 0; r < rows; ++r) {
    for (const Tensor& slab : slabs) {
      const int64_t d = slab.shape()[2];
      const float* from = slab.data<float>() + r * d * plane;
      out.insert(out.end(), from, from + d * plane);
    }
  }
  return FloatTensor(Shape{s[0], s[1], depth, s[3], s[4]}, out);
}

void ExpectClose(const Tensor& got, const Tensor& expected, float tolerance,
                 const std::string& what) {
  ASSERT_EQ(got.shape(), expected.shape()) << what;
  const std::vector<float> g = ToVector(got), e = ToVector(expected);
  float worst = 0;
  for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::abs(g[i] - e[i]));
  EXPECT_LE(worst, tolerance) << what;
}

TEST(VolumeGradientTest, SlabPlanesAndHaloJoin) {
  CheckGradients({.forward = "slab_planes_forward",
                  .forward_attrs = Attrs{{"depth", int64_t{4}}},
                  .inputs = {RandomTensor({2, 3, 4, 3, 2}, 1)}});
  // One plane deep: first and last are the same plane, its gradient their sum.
  CheckGradients({.forward = "slab_planes_forward",
                  .forward_attrs = Attrs{{"depth", int64_t{1}}},
                  .inputs = {RandomTensor({1, 2, 1, 3, 3}, 2)}});
  // The depth is the forward's x's: another is refused naming it.
  Result<Tensors> wrong_depth = RunKernel("slab_planes_forward", {RandomTensor({1, 2, 3, 2, 2}, 3)},
                                          Attrs{{"depth", int64_t{2}}});
  ASSERT_FALSE(wrong_depth.ok());
  EXPECT_NE(wrong_depth.status().message().find("attribute 'depth' is 2"), std::string::npos)
      << wrong_depth.status().ToString();
  CheckGradients({.forward = "halo_join_forward",
                  .inputs = {RandomTensor({2, 3, 1, 3, 2}, 3), RandomTensor({2, 3, 4, 3, 2}, 4),
                             RandomTensor({2, 3, 1, 3, 2}, 5)}});
  Result<Tensors> wrong = RunKernel(
      "halo_join_forward", {RandomTensor({2, 3, 1, 3, 3}, 3), RandomTensor({2, 3, 4, 3, 2}, 4),
                            RandomTensor({2, 3, 1, 3, 2}, 5)});
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("input 'above'"), std::string::npos)
      << wrong.status().ToString();
}

TEST(VolumeGradientTest, SlabGroupNormAndItsStatistics) {
  const Tensor x = RandomTensor({2, 4, 3, 2, 3}, 1, 2.0f);
  for (int64_t ranks : {int64_t{1}, int64_t{3}}) {
    const Attrs attrs{{"groups", int64_t{2}}, {"ranks", ranks}};
    CheckGradients({.forward = "group_norm_stats_forward", .forward_attrs = attrs, .inputs = {x}});
    ASSERT_OK_AND_ASSIGN(Tensors stats, RunKernel("group_norm_stats_forward", {x}, attrs));
    ASSERT_EQ(stats[0].shape(), (Shape{ranks, 2, 2, kSlabStatsWidth}));
    // Statistics of other slabs: this one's, scaled, as if the volume were larger.
    Tensor all = stats[0];
    for (int64_t i = all.numel() / ranks; i < all.numel(); ++i) all.data<float>()[i] *= 1.5f;
    CheckGradients({.forward = "group_norm_slab_forward",
                    .forward_attrs = Attrs{{"groups", int64_t{2}}},
                    .inputs = {x, all, RandomTensor({4}, 2), RandomTensor({4}, 3)}});
  }
}

// P slabs of a volume, each with every slab's statistics (as the all-to-all of blocks hands
// them), normalise as the whole volume does, forward and backward: the slabs' y and dx joined
// are group_norm's, their dweight and dbias summed are its.
TEST(VolumeOpsTest, SlabGroupNormOverEverySlabIsGroupNorm) {
  const Tensor x = RandomTensor({2, 6, 8, 3, 5}, 1, 2.0f), weight = RandomTensor({6}, 2);
  const Tensor bias = RandomTensor({6}, 3), dy = RandomTensor({2, 6, 8, 3, 5}, 4);
  const Attrs norm{{"groups", int64_t{3}}};
  ASSERT_OK_AND_ASSIGN(Tensors whole, RunKernel("group_norm_forward", {x, weight, bias}, norm));
  ASSERT_OK_AND_ASSIGN(Tensors whole_grads,
                       RunKernel("group_norm_backward", {dy, x, weight, whole[1], whole[2]}, norm));
  for (int64_t ranks : {int64_t{2}, int64_t{4}}) {
    const std::string what = fmt::format("{} slabs", ranks);
    const int64_t depth = 8 / ranks;
    Tensors slabs, stats;
    for (int64_t p = 0; p < ranks; ++p) {
      slabs.push_back(DepthSlab(x, p * depth, depth));
      ASSERT_OK_AND_ASSIGN(Tensors made,
                           RunKernel("group_norm_stats_forward", {slabs.back()},
                                     Attrs{{"groups", int64_t{3}}, {"ranks", ranks}}));
      stats.push_back(made[0]);
    }
    // The all-to-all of blocks: rank p's block q is rank q's statistics.
    const int64_t block = stats[0].numel() / ranks;
    const auto exchange = [&](const Tensors& sent) {
      Tensors received;
      for (int64_t p = 0; p < ranks; ++p) {
        const Tensor& t = sent[static_cast<size_t>(p)];
        std::vector<float> values = ToVector(t);
        for (int64_t q = 0; q < ranks; ++q) {
          const std::vector<float> from = ToVector(sent[static_cast<size_t>(q)]);
          std::copy_n(from.begin() + p * block, block, values.begin() + q * block);
        }
        received.push_back(FloatTensor(t.shape(), values));
      }
      return received;
    };
    const Tensors gathered = exchange(stats);
    Tensors ys, dxs, dstats;
    std::vector<float> dweight(6, 0.0f), dbias(6, 0.0f);
    for (int64_t p = 0; p < ranks; ++p) {
      const auto i = static_cast<size_t>(p);
      ASSERT_OK_AND_ASSIGN(Tensors y, RunKernel("group_norm_slab_forward",
                                                {slabs[i], gathered[i], weight, bias}, norm));
      // The mean and rstd are the whole volume's on every slab.
      ExpectClose(y[1], whole[1], 1e-6f, what + " mean");
      ExpectClose(y[2], whole[2], 1e-5f, what + " rstd");
      ys.push_back(y[0]);
      ASSERT_OK_AND_ASSIGN(Tensors grads, RunKernel("group_norm_slab_backward",
                                                    {DepthSlab(dy, p * depth, depth), slabs[i],
                                                     gathered[i], weight, y[1], y[2]},
                                                    norm));
      dxs.push_back(grads[0]);
      dstats.push_back(grads[1]);
      for (int c = 0; c < 6; ++c) {
        dweight[static_cast<size_t>(c)] += grads[2].data<float>()[c];
        dbias[static_cast<size_t>(c)] += grads[3].data<float>()[c];
      }
    }
    ExpectClose(JoinDepth(ys), whole[0], 1e-5f, what + " y");
    // The statistics' gradients go back by the adjoint all-to-all, and each slab adds their term.
    const Tensors returned = exchange(dstats);
    for (int64_t p = 0; p < ranks; ++p) {
      const auto i = static_cast<size_t>(p);
      ASSERT_OK_AND_ASSIGN(Tensors through,
                           RunKernel("group_norm_stats_backward", {returned[i], slabs[i]},
                                     Attrs{{"groups", int64_t{3}}, {"ranks", ranks}}));
      for (int64_t k = 0; k < dxs[i].numel(); ++k)
        dxs[i].data<float>()[k] += through[0].data<float>()[k];
    }
    ExpectClose(JoinDepth(dxs), whole_grads[0], 1e-5f, what + " dx");
    ExpectClose(FloatTensor(Shape{6}, dweight), whole_grads[1], 1e-4f, what + " dweight");
    ExpectClose(FloatTensor(Shape{6}, dbias), whole_grads[2], 1e-4f, what + " dbias");
  }
}

// A slab joined with its neighbours' boundary planes (zeros past the ends), convolved with
// depth_padding 0, is its part of the whole volume's convolution: stride 1 and the strided
// convolutions of nnU-Net's encoder.
TEST(VolumeOpsTest, AHaloJoinedSlabConvolvesAsItsPartOfTheVolume) {
  const Tensor x = RandomTensor({2, 3, 8, 5, 6}, 1), w = RandomTensor({4, 3, 3, 3, 3}, 2);
  const Tensor b = RandomTensor({4}, 3);
  for (int64_t stride : {int64_t{1}, int64_t{2}}) {
    ASSERT_OK_AND_ASSIGN(Tensors whole,
                         RunKernel("conv3d_forward", {x, w, b}, ConvAttrs(stride, 1)));
    for (int64_t ranks : {int64_t{2}, int64_t{4}}) {
      const int64_t depth = 8 / ranks;
      const Tensor zeros =
          FloatTensor(Shape{2, 3, 1, 5, 6}, std::vector<float>(size_t{2} * 3 * 5 * 6));
      Tensors parts;
      for (int64_t p = 0; p < ranks; ++p) {
        const Tensor above = p == 0 ? zeros : DepthSlab(x, p * depth - 1, 1);
        const Tensor below = p + 1 == ranks ? zeros : DepthSlab(x, (p + 1) * depth, 1);
        ASSERT_OK_AND_ASSIGN(
            Tensors joined,
            RunKernel("halo_join_forward", {above, DepthSlab(x, p * depth, depth), below}));
        Attrs attrs = ConvAttrs(stride, 1);
        attrs.Set(kDepthPaddingAttr, int64_t{0});
        ASSERT_OK_AND_ASSIGN(Tensors y, RunKernel("conv3d_forward", {joined[0], w, b}, attrs));
        parts.push_back(y[0]);
      }
      ExpectClose(JoinDepth(parts), whole[0], 1e-5f,
                  fmt::format("stride {}, {} slabs", stride, ranks));
    }
  }
}

TEST(VolumeGradientTest, ReluAndSilu) {
  CheckGradients({.forward = "relu_forward", .inputs = {AwayFromZero({2, 3, 4, 5}, 1, 0.05f)}});
  CheckGradients(
      {.forward = "leaky_relu_forward", .inputs = {AwayFromZero({2, 3, 4, 5}, 2, 0.05f)}});
  CheckGradients(
      {.forward = "silu_forward", .inputs = {RandomTensor({2, 3, 4, 5}, 1, 4.0f)}, .step = 1e-3f});
}

// Leaky ReLU against its formula (PyTorch's F.leaky_relu with negative_slope 0.01): x above
// zero passes, at and below zero it is scaled by 0.01; so is the gradient.
TEST(VolumeOpsTest, LeakyReluFollowsItsFormula) {
  const std::vector<float> x = {-3.0f, -0.5f, 0.0f, 1e-6f, 2.5f};
  const std::vector<float> dy = {1.0f, 2.0f, 3.0f, 4.0f, 5.0f};
  ASSERT_OK_AND_ASSIGN(Tensors y, RunKernel("leaky_relu_forward", {FloatTensor(Shape{5}, x)}));
  EXPECT_EQ(ToVector(y[0]), (std::vector<float>{-0.03f, -0.005f, 0.0f, 1e-6f, 2.5f}));
  ASSERT_OK_AND_ASSIGN(Tensors dx, RunKernel("leaky_relu_backward", {FloatTensor(Shape{5}, dy),
                                                                     FloatTensor(Shape{5}, x)}));
  EXPECT_EQ(ToVector(dx[0]), (std::vector<float>{0.01f, 0.02f, 0.03f, 4.0f, 5.0f}));
}

TEST(VolumeGradientTest, Concat) {
  CheckGradients({.forward = "concat_forward",
                  .inputs = {RandomTensor({2, 3, 2, 3, 2}, 1), RandomTensor({2, 2, 2, 3, 2}, 2)}});
}

// The loss returns its gradient at once: check the dlogits output against finite differences
// of the loss output.
TEST(VolumeGradientTest, VoxelCrossEntropy) {
  ExpectLossGradientMatchesFiniteDifferences(
      "voxel_cross_entropy",
      {RandomTensor({2, 4, 3, 2, 3}, 1, 3.0f), RandomTokens({2, 3, 2, 3}, 4, 2)},
      /*grad_scale=*/0.5);
}

TEST(VolumeOpsTest, VoxelCrossEntropyMatchesDirectFormula) {
  // Two voxels, three classes: logits (1, 2, 3) -> target 2 and (0, 0, 0) -> target 0.
  ASSERT_OK_AND_ASSIGN(Tensors out,
                       RunKernel("voxel_cross_entropy", {FloatTensor({1, 3, 2}, {1, 0, 2, 0, 3, 0}),
                                                         IntTensor({1, 2}, {2, 0})}));
  const double first = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 3.0;
  const double second = std::log(3.0);
  EXPECT_NEAR(*out[0].data<float>(), (first + second) / 2, 1e-6);
  // dlogits of voxel 2 (column 1): (1/3 - 1, 1/3, 1/3) / 2 voxels.
  EXPECT_NEAR(out[1].data<float>()[1], (1.0 / 3 - 1) / 2, 1e-7);
  EXPECT_NEAR(out[1].data<float>()[3], 1.0 / 6, 1e-7);
}

// A weight (deep supervision's term weights) scales the loss and its gradient; weight 1 is the
// unweighted op bit for bit, and a negative or infinite weight is refused.
TEST(VolumeOpsTest, AWeightScalesTheCrossEntropyAndItsGradient) {
  const Tensor logits = RandomTensor({2, 3, 2, 2, 2}, 5, 2.0f);
  const Tensor targets = RandomTokens({2, 2, 2, 2}, 3, 6);
  ASSERT_OK_AND_ASSIGN(Tensors plain, RunKernel("voxel_cross_entropy", {logits, targets}));
  ASSERT_OK_AND_ASSIGN(Tensors one,
                       RunKernel("voxel_cross_entropy", {logits, targets}, Attrs{{"weight", 1.0}}));
  EXPECT_EQ(*one[0].data<float>(), *plain[0].data<float>());
  EXPECT_EQ(std::memcmp(one[1].raw_data(), plain[1].raw_data(), plain[1].bytes()), 0);
  ASSERT_OK_AND_ASSIGN(Tensors quarter, RunKernel("voxel_cross_entropy", {logits, targets},
                                                  Attrs{{"weight", 0.25}, {"grad_scale", 2.0}}));
  EXPECT_NEAR(*quarter[0].data<float>(), 0.25 * *plain[0].data<float>(),
              1e-7 * std::abs(*plain[0].data<float>()));
  for (int64_t i = 0; i < plain[1].numel(); ++i) {
    EXPECT_NEAR(quarter[1].data<float>()[i], 0.5 * plain[1].data<float>()[i], 1e-8) << i;
  }
  for (const double bad : {-0.5, std::numeric_limits<double>::infinity()}) {
    Result<Tensors> refused =
        RunKernel("voxel_cross_entropy", {logits, targets}, Attrs{{"weight", bad}});
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.status().message().find("attribute 'weight'"), std::string::npos)
        << refused.status().message();
  }
}

// downsample_labels samples the voxel at factor * k + factor / 2 along each axis (what PyTorch's
// interpolate(mode="nearest-exact") picks at a scale of 1 / factor), per sample.
TEST(VolumeOpsTest, DownsampleLabelsSamplesTheNearestExactVoxel) {
  constexpr int64_t kBatch = 2, kD = 4, kH = 8, kW = 4;
  std::vector<int32_t> fine(static_cast<size_t>(kBatch * kD * kH * kW));
  for (size_t i = 0; i < fine.size(); ++i) fine[i] = static_cast<int32_t>(i);
  const Tensor targets = IntTensor({kBatch, kD, kH, kW}, fine);
  for (const int64_t factor : {1, 2, 4}) {
    SCOPED_TRACE(factor);
    ASSERT_OK_AND_ASSIGN(Tensors out,
                         RunKernel("downsample_labels", {targets}, Attrs{{"factor", factor}}));
    const int64_t d = kD / factor, h = kH / factor, w = kW / factor;
    ASSERT_EQ(out[0].shape(), (Shape{kBatch, d, h, w}));
    ASSERT_EQ(out[0].dtype(), DType::kI32);
    const int32_t* coarse = out[0].data<int32_t>();
    for (int64_t n = 0; n < kBatch; ++n) {
      for (int64_t z = 0; z < d; ++z) {
        for (int64_t y = 0; y < h; ++y) {
          for (int64_t x = 0; x < w; ++x) {
            const int64_t fz = z * factor + factor / 2, fy = y * factor + factor / 2,
                          fx = x * factor + factor / 2;
            EXPECT_EQ(coarse[((n * d + z) * h + y) * w + x],
                      fine[static_cast<size_t>(((n * kD + fz) * kH + fy) * kW + fx)]);
          }
        }
      }
    }
  }
  Result<Tensors> odd = RunKernel("downsample_labels", {targets}, Attrs{{"factor", int64_t{8}}});
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("multiples of factor 8"), std::string::npos)
      << odd.status().message();
  Result<Tensors> floats = RunKernel("downsample_labels", {RandomTensor({1, 2, 2, 2}, 1)});
  ASSERT_FALSE(floats.ok());
  EXPECT_NE(floats.status().message().find("i32 [N, D, H, W]"), std::string::npos)
      << floats.status().message();
}

TEST(VolumeOpsTest, VoxelCrossEntropyRejectsATargetOutOfRange) {
  Result<Tensors> out =
      RunKernel("voxel_cross_entropy", {RandomTensor({1, 3, 2}, 1), IntTensor({1, 2}, {0, 3})});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("target class 3 at voxel 1"), std::string::npos)
      << out.status().message();
}

TEST(VolumeOpsTest, DiceScoreIsHardDiceOverForegroundClasses) {
  // Four voxels, three classes. argmax = (0, 1, 1, 2); targets = (0, 1, 2, 2).
  // Class 1: |P| = 2, |T| = 1, |P and T| = 1 -> 2/3. Class 2: |P| = 1, |T| = 2, both 1 -> 2/3.
  const Tensor logits = FloatTensor({1, 3, 4}, {5, 0, 0, 0,  //
                                                0, 5, 5, 0,  //
                                                0, 0, 0, 5});
  ASSERT_OK_AND_ASSIGN(Tensors out,
                       RunKernel("dice_score", {logits, IntTensor({1, 4}, {0, 1, 2, 2})}));
  EXPECT_FLOAT_EQ(*out[0].data<float>(), 2.0f / 3.0f);
  // Perfect prediction scores 1; a class absent from both prediction and targets counts as 1.
  ASSERT_OK_AND_ASSIGN(out, RunKernel("dice_score", {logits, IntTensor({1, 4}, {0, 1, 1, 2})}));
  EXPECT_FLOAT_EQ(*out[0].data<float>(), 1.0f);
  const Tensor four_classes = FloatTensor({1, 4, 1}, {0, 3, 0, 0});  // predicts class 1
  ASSERT_OK_AND_ASSIGN(out, RunKernel("dice_score", {four_classes, IntTensor({1, 1}, {2})}));
  EXPECT_FLOAT_EQ(*out[0].data<float>(), 1.0f / 3.0f);  // classes 1, 2: 0; class 3: 1
}

TEST(VolumeOpsTest, MaxPoolIndicesPointAtTheMaximaAndTiesKeepTheFirst) {
  // One 2x2x2 window of equal values, and one whose maximum is its last element.
  Tensor x = FloatTensor({1, 1, 2, 2, 4}, std::vector<float>(16, 1.0f));
  x.data<float>()[(1 * 2 + 1) * 4 + 3] = 7.0f;  // last element of the second window
  ASSERT_OK_AND_ASSIGN(Tensors out, RunKernel("max_pool3d_forward", {x}));
  ASSERT_EQ(out[1].dtype(), DType::kI32);
  EXPECT_EQ(out[1].data<int32_t>()[0], 0);
  EXPECT_EQ(out[1].data<int32_t>()[1], (1 * 2 + 1) * 4 + 3);
  EXPECT_EQ(out[0].data<float>()[1], 7.0f);
}

// ---- chunked convolutions and thread counts ----

// Chunks of output positions (the vol2col workspace) change only the grouping of GEMMs: a
// convolution cut into chunks of 7 positions (runs crossing rows and planes) matches one chunk.
TEST(VolumeOpsTest, ChunkedConvolutionMatchesOneChunk) {
  cpu::Conv3dGeometry g{.batch = 2,
                        .in_channels = 3,
                        .in_d = 6,
                        .in_h = 5,
                        .in_w = 7,
                        .out_channels = 4,
                        .out_d = 3,
                        .out_h = 3,
                        .out_w = 4,
                        .kd = 3,
                        .kh = 2,
                        .kw = 3,
                        .stride = 2,
                        .padding = 1,
                        .padding_d = 1};
  const std::vector<float> x = ToVector(RandomTensor({g.batch * g.in_channels * g.InVolume()}, 1));
  const std::vector<float> w = ToVector(RandomTensor({g.out_channels * g.ColumnRows()}, 2));
  const std::vector<float> b = ToVector(RandomTensor({g.out_channels}, 3));
  const std::vector<float> dy =
      ToVector(RandomTensor({g.batch * g.out_channels * g.OutVolume()}, 4));
  const std::vector<float> c = ToVector(RandomTensor({g.in_channels}, 5));
  auto run = [&](int64_t chunk) {
    g.positions_per_chunk = chunk;
    std::vector<float> workspace(static_cast<size_t>(cpu::Conv3dWorkspaceFloats(g)));
    std::vector<float> y(dy.size()), dx(x.size()), dw(w.size());
    cpu::Conv3dForward(y.data(), x.data(), w.data(), b.data(), g, workspace.data(), 1);
    cpu::Conv3dInputGradient(dx.data(), dy.data(), w.data(), c.data(), g, workspace.data(), 1);
    cpu::Conv3dWeightGradient(dw.data(), dy.data(), x.data(), g, workspace.data(), 1);
    return std::vector<std::vector<float>>{y, dx, dw};
  };
  const auto whole = run(g.OutVolume());
  const auto chunked = run(7);
  for (size_t i = 0; i < whole.size(); ++i) {
    EXPECT_LE(ScaledMaxError(chunked[i], whole[i]), 1e-6) << "result " << i;
  }
  // And the one-chunk forward against a direct loop.
  for (int64_t n = 0; n < g.batch; ++n) {
    for (int64_t co = 0; co < g.out_channels; ++co) {
      for (int64_t p = 0; p < g.OutVolume(); ++p) {
        const int64_t od = p / (g.out_h * g.out_w), oh = (p / g.out_w) % g.out_h, ow = p % g.out_w;
        double sum = b[co];
        for (int64_t ci = 0; ci < g.in_channels; ++ci) {
          for (int64_t a = 0; a < g.kd; ++a) {
            for (int64_t bb = 0; bb < g.kh; ++bb) {
              for (int64_t e = 0; e < g.kw; ++e) {
                const int64_t id = od * 2 - 1 + a, ih = oh * 2 - 1 + bb, iw = ow * 2 - 1 + e;
                if (id < 0 || id >= g.in_d || ih < 0 || ih >= g.in_h || iw < 0 || iw >= g.in_w) {
                  continue;
                }
                sum += static_cast<double>(
                           w[(((co * g.in_channels + ci) * g.kd + a) * g.kh + bb) * g.kw + e]) *
                       x[(((n * g.in_channels + ci) * g.in_d + id) * g.in_h + ih) * g.in_w + iw];
              }
            }
          }
        }
        ASSERT_NEAR(whole[0][(n * g.out_channels + co) * g.OutVolume() + p], sum, 1e-5)
            << "n " << n << " co " << co << " position " << p;
      }
    }
  }
}

TEST(VolumeOpsTest, DefaultChunksDependOnTheShapeOnly) {
  EXPECT_EQ(cpu::DefaultPositionsPerChunk(81, 100), 100);
  EXPECT_EQ(cpu::DefaultPositionsPerChunk(int64_t{32} * 27, 1 << 18), 2368);  // 8 MB of columns
  EXPECT_EQ(cpu::DefaultPositionsPerChunk(1 << 22, 1 << 18), 64);  // at least 64 positions
}

struct DeterminismCase {
  std::string op;
  Tensors inputs;
  Attrs attrs;
};

// Every op on 1, 2, 3 and 8 threads: the same bytes. Shapes are big enough that every parallel
// loop and every GEMM split (RunKernel splits all GEMMs) has several pieces.
TEST(VolumeOpsTest, AnyThreadCountGivesTheSameBits) {
  const Tensor x = RandomTensor({2, 4, 12, 10, 12}, 1);
  const Tensor w = RandomTensor({8, 4, 3, 3, 3}, 2);
  const Tensor b = RandomTensor({8}, 3);
  const Attrs conv = ConvAttrs(1, 1);
  ASSERT_OK_AND_ASSIGN(Tensors y, RunKernel("conv3d_forward", {x, w, b}, conv));
  const Tensor dy = RandomTensor(y[0].shape(), 4);
  const Tensor tw = RandomTensor({4, 8, 2, 2, 2}, 5);  // conv_transpose3d: 4 -> 8 channels
  const Attrs up = ConvAttrs(2, 0);
  ASSERT_OK_AND_ASSIGN(Tensors ty, RunKernel("conv_transpose3d_forward", {x, tw, b}, up));
  const Tensor tdy = RandomTensor(ty[0].shape(), 6);
  const Tensor gw = RandomTensor({4}, 7), gb = RandomTensor({4}, 8);
  const Attrs groups{{"groups", int64_t{2}}};
  ASSERT_OK_AND_ASSIGN(Tensors gn, RunKernel("group_norm_forward", {x, gw, gb}, groups));
  ASSERT_OK_AND_ASSIGN(Tensors pool, RunKernel("max_pool3d_forward", {x}));
  const Tensor logits = RandomTensor({2, 5, 20, 16, 12}, 9, 3.0f);
  const Tensor targets = RandomTokens({2, 20, 16, 12}, 5, 10);
  const std::vector<DeterminismCase> cases = {
      {"conv3d_forward", {x, w, b}, conv},
      {"conv3d_backward", {dy, x, w}, conv},
      {"conv3d_backward", {RandomTensor({2, 8, 6, 5, 6}, 11), x, w}, ConvAttrs(2, 1)},
      {"conv_transpose3d_forward", {x, tw, b}, up},
      {"conv_transpose3d_backward", {tdy, x, tw}, up},
      {"conv3d_no_bias_forward", {x, w}, conv},
      {"conv3d_no_bias_backward", {dy, x, w}, conv},
      {"channel_bias_add_forward", {y[0], b}, {}},
      {"channel_bias_add_backward", {dy}, {}},
      {"upsample_nearest3d_forward", {x}, {}},
      {"upsample_nearest3d_backward", {tdy}, {}},
      {"max_pool3d_forward", {x}, {}},
      {"max_pool3d_backward", {RandomTensor(pool[0].shape(), 12), x, pool[1]}, {}},
      {"group_norm_forward", {x, gw, gb}, groups},
      {"group_norm_backward", {RandomTensor(x.shape(), 13), x, gw, gn[1], gn[2]}, groups},
      {"silu_forward", {x}, {}},
      {"silu_backward", {dy, y[0]}, {}},
      {"relu_backward", {dy, y[0]}, {}},
      {"leaky_relu_forward", {x}, {}},
      {"leaky_relu_backward", {dy, y[0]}, {}},
      {"concat_forward", {x, y[0]}, {}},
      {"voxel_cross_entropy", {logits, targets}, {}},
      {"dice_score", {logits, targets}, {}},
  };
  // TBB caps its workers at the core count by default; lift the cap so that a small CI machine
  // runs these arenas with their full thread counts too (the least of all controls applies).
  const tbb::global_control allow_threads(tbb::global_control::max_allowed_parallelism, 8);
  auto run = [](tbb::task_arena& arena, const DeterminismCase& c) {
    Tensors out;
    arena.execute([&] {
      Result<Tensors> r = RunKernel(c.op, c.inputs, c.attrs);
      TESSERA_CHECK(r.ok(), "{}: {}", c.op, r.status().ToString());
      out = *std::move(r);
    });
    return out;
  };
  tbb::task_arena one_thread(1);
  std::vector<Tensors> expected;
  expected.reserve(cases.size());
  for (const DeterminismCase& c : cases) expected.push_back(run(one_thread, c));
  // Small kernels often finish before a worker joins in; several runs on a warm arena give the
  // workers their chance (a thread-dependent reduction fails here within a few runs).
  constexpr int kRuns = 10;
  for (int threads : {2, 3, 8}) {
    tbb::task_arena arena(threads);
    for (size_t i = 0; i < cases.size(); ++i) {
      for (int attempt = 0; attempt < kRuns; ++attempt) {
        const Tensors many = run(arena, cases[i]);
        ASSERT_EQ(many.size(), expected[i].size());
        for (size_t k = 0; k < many.size(); ++k) {
          ASSERT_EQ(std::memcmp(many[k].raw_data(), expected[i][k].raw_data(),
                                static_cast<size_t>(many[k].bytes())),
                    0)
              << cases[i].op << " output " << k << " differs on " << threads << " threads";
        }
      }
    }
  }
}

// ---- shape errors ----

struct ShapeErrorCase {
  std::string op;
  std::vector<TensorMeta> inputs;
  Attrs attrs;
  std::vector<std::string> message_parts;  // each must appear in the error
};

TensorMeta F32(Shape shape) { return TensorMeta{std::move(shape), DType::kF32, Device::Cpu()}; }
TensorMeta I32(Shape shape) { return TensorMeta{std::move(shape), DType::kI32, Device::Cpu()}; }

TEST(VolumeOpsTest, ShapeErrorsNameTheInputAndTheShapes) {
  const TensorMeta x = F32({2, 3, 8, 8, 8});
  const std::vector<ShapeErrorCase> cases = {
      {"conv3d_forward",
       {x, F32({4, 3, 3, 3}), F32({4})},
       {},
       {"input 'weight'", "[4, 3, 3, 3]", "4 dims", "conv3d needs [Cout, Cin, kD, kH, kW]"}},
      {"conv3d_forward",
       {x, F32({4, 2, 3, 3, 3}), F32({4})},
       {},
       {"input 'weight'", "[4, 2, 3, 3, 3]", "[2, 3, 8, 8, 8]", "Cin = 3"}},
      {"conv3d_forward",
       {F32({2, 3, 8, 8}), F32({4, 3, 3, 3, 3}), F32({4})},
       {},
       {"input 'x'", "[2, 3, 8, 8]", "[N, C, D, H, W]"}},
      {"conv3d_forward", {x, F32({4, 3, 3, 3, 3}), F32({5})}, {}, {"input 'bias'", "[5]", "[4]"}},
      {"conv3d_forward",
       {F32({2, 3, 2, 8, 8}), F32({4, 3, 3, 3, 3}), F32({4})},
       {},
       {"leaves no output along axis 2", "[2, 3, 2, 8, 8]"}},
      {"conv3d_forward",
       {x, F32({4, 3, 3, 3, 3}), F32({4})},
       {{"stride", int64_t{0}}},
       {"attribute 'stride' must be >= 1, got 0"}},
      {"conv3d_backward",
       {F32({2, 4, 8, 8, 8}), x, F32({4, 3, 3, 3, 3})},
       {},
       {"input 'dy'", "[2, 4, 8, 8, 8]", "[2, 4, 6, 6, 6]"}},
      {"conv_transpose3d_forward",
       {x, F32({4, 3, 2, 2, 2}), F32({3})},
       {{"stride", int64_t{2}}},
       {"input 'weight'", "[4, 3, 2, 2, 2]", "Cin = 3", "[Cin, Cout, kD, kH, kW]"}},
      {"conv_transpose3d_backward",
       {F32({2, 4, 8, 8, 8}), x, F32({3, 4, 2, 2, 2})},
       {{"stride", int64_t{2}}},
       {"input 'dy'", "[2, 4, 16, 16, 16]"}},
      {"upsample_nearest3d_backward",
       {F32({2, 3, 4, 5, 4})},
       {},
       {"input 'dy'", "[2, 3, 4, 5, 4]", "multiples of scale 2"}},
      {"max_pool3d_forward",
       {F32({2, 3, 1, 8, 8})},
       {},
       {"input 'x'", "[2, 3, 1, 8, 8]", "kernel 2"}},
      {"max_pool3d_backward",
       {F32({2, 3, 4, 4, 4}), x, F32({2, 3, 4, 4, 4})},
       {},
       {"input 'indices'", "i32[2, 3, 4, 4, 4]"}},
      {"group_norm_forward",
       {x, F32({3}), F32({3})},
       {{"groups", int64_t{2}}},
       {"attribute 'groups' is 2", "C = 3"}},
      {"group_norm_forward", {x, F32({3}), F32({3})}, {}, {"groups"}},
      {"group_norm_forward",
       {x, F32({4}), F32({3})},
       {{"groups", int64_t{3}}},
       {"input 'weight'", "[4]", "[3]"}},
      {"group_norm_backward",
       {x, x, F32({3}), F32({2, 3}), F32({2, 1})},
       {{"groups", int64_t{3}}},
       {"input 'rstd'", "[2, 1]", "[2, 3]"}},
      {"silu_backward", {F32({4}), F32({5})}, {}, {"input 'dy'", "[4]", "[5]"}},
      {"relu_forward", {I32({4})}, {}, {"input 'x'", "i32[4]", "f32"}},
      {"concat_forward",
       {x, F32({2, 3, 8, 8, 4})},
       {},
       {"inputs 'a' [2, 3, 8, 8, 8] and 'b' [2, 3, 8, 8, 4]"}},
      {"concat_backward",
       {F32({2, 3, 8, 8, 8}), x},
       {},
       {"input 'dout'", "input 'a'", "at least one left for b"}},
      {"voxel_cross_entropy",
       {x, I32({2, 8, 8, 4})},
       {},
       {"input 'targets'", "i32[2, 8, 8, 4]", "[2, 8, 8, 8]"}},
      {"voxel_cross_entropy", {x, F32({2, 8, 8, 8})}, {}, {"input 'targets'", "i32"}},
      {"dice_score", {F32({2, 1, 8}), I32({2, 8})}, {}, {"input 'logits'", "C >= 2"}},
  };
  for (const ShapeErrorCase& c : cases) {
    Result<std::vector<TensorMeta>> result = CpuRegistry().InferShapes(c.op, c.inputs, c.attrs);
    ASSERT_FALSE(result.ok()) << c.op << " accepted bad input";
    EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument) << result.status().ToString();
    for (const std::string& part : c.message_parts) {
      EXPECT_NE(result.status().message().find(part), std::string::npos)
          << c.op << ": '" << part << "' is missing from: " << result.status().message();
    }
  }
}

TEST(VolumeOpsTest, ShapesAndCostsOfAUNetLevel) {
  const OpRegistry& r = CpuRegistry();
  const TensorMeta x = F32({1, 16, 32, 32, 32});
  ASSERT_OK_AND_ASSIGN(
      auto y,
      r.InferShapes("conv3d_forward", {x, F32({32, 16, 3, 3, 3}), F32({32})}, ConvAttrs(1, 1)));
  EXPECT_EQ(y[0].shape, Shape({1, 32, 32, 32, 32}));
  ASSERT_OK_AND_ASSIGN(OpCost cost, r.Cost("conv3d_forward", {x, F32({32, 16, 3, 3, 3}), F32({32})},
                                           ConvAttrs(1, 1)));
  EXPECT_DOUBLE_EQ(cost.flops, 2.0 * 32 * 32768 * 16 * 27 + 32 * 32768);
  ASSERT_OK_AND_ASSIGN(auto down, r.InferShapes("max_pool3d_forward", {x}, {}));
  EXPECT_EQ(down[0].shape, Shape({1, 16, 16, 16, 16}));
  EXPECT_EQ(down[1].dtype, DType::kI32);
  ASSERT_OK_AND_ASSIGN(auto upsampled,
                       r.InferShapes("conv_transpose3d_forward",
                                     {down[0], F32({16, 8, 2, 2, 2}), F32({8})}, ConvAttrs(2, 0)));
  EXPECT_EQ(upsampled[0].shape, Shape({1, 8, 32, 32, 32}));
  ASSERT_OK_AND_ASSIGN(
      OpCost up_cost, r.Cost("conv_transpose3d_forward", {down[0], F32({16, 8, 2, 2, 2}), F32({8})},
                             ConvAttrs(2, 0)));
  EXPECT_DOUBLE_EQ(up_cost.flops, 2.0 * 16 * 4096 * 8 * 8 + 8 * 32768);
  ASSERT_OK_AND_ASSIGN(auto cat, r.InferShapes("concat_forward", {upsampled[0], x}, {}));
  EXPECT_EQ(cat[0].shape, Shape({1, 24, 32, 32, 32}));
  ASSERT_OK_AND_ASSIGN(auto norm, r.InferShapes("group_norm_forward", {x, F32({16}), F32({16})},
                                                Attrs{{"groups", int64_t{4}}}));
  EXPECT_EQ(norm[1].shape, Shape({1, 4}));
  ASSERT_OK_AND_ASSIGN(
      auto loss,
      r.InferShapes("voxel_cross_entropy", {F32({1, 3, 32, 32, 32}), I32({1, 32, 32, 32})}, {}));
  EXPECT_EQ(loss[0].shape, Shape{});
  for (const char* op : {"conv3d_backward", "group_norm_backward", "dice_score"}) {
    ASSERT_OK(r.Find(op).status());
    EXPECT_FALSE((*r.Find(op))->doc.empty()) << op;
  }
}

// ---- bf16 activations ----

// A zero tensor of `meta`.
Tensor Zeros(const TensorMeta& meta) { return Tensor::Zeros(meta, TestAllocator()).value(); }

// `values` rounded to bf16, as a bf16 tensor.
Tensor Bf16Tensor(const Tensor& values) {
  Tensor out = Zeros(TensorMeta{values.shape(), DType::kBF16, Device::Cpu()});
  auto* bits = static_cast<uint16_t*>(out.raw_data());
  for (int64_t i = 0; i < values.numel(); ++i) bits[i] = FloatToBf16(values.data<float>()[i]);
  return out;
}

// `values` rounded to bf16, kept in an f32 tensor (what a bf16 tensor holds, exactly).
Tensor RoundedToBf16(const Tensor& values) {
  Tensor out = Zeros(values.meta());
  for (int64_t i = 0; i < values.numel(); ++i) {
    out.data<float>()[i] = Bf16ToFloat(FloatToBf16(values.data<float>()[i]));
  }
  return out;
}

// A bf16 tensor's values.
std::vector<float> Bf16Values(const Tensor& t) {
  std::vector<float> values(static_cast<size_t>(t.numel()));
  const auto* bits = static_cast<const uint16_t*>(t.raw_data());
  for (size_t i = 0; i < values.size(); ++i) values[i] = Bf16ToFloat(bits[i]);
  return values;
}

// What the GPU's kernels do with bf16 activations (ops/volume_ops.h): read them into f32,
// compute in f32, round each activation output to bf16. On the CPU each volume op on bf16
// activations is exactly its f32 op on the same values with the activation outputs rounded;
// parameter gradients, norm statistics, losses and scores come out f32 and equal the f32 op's.
// (RunKernel also holds each kernel's scratch, the f32 copies included, to what the op
// declares: the memory model's figure.)
TEST(VolumeBf16Test, EachOpOnBf16ActivationsIsItsF32OpRounded) {
  struct Case {
    std::string op;
    Tensors inputs;
    std::set<size_t> activations;  // which inputs are activations (bf16 in the bf16 call)
    Attrs attrs;
  };
  const Tensor x = RandomTensor({2, 4, 4, 3, 4}, 1, 2.0f);
  const Tensor w = RandomTensor({3, 4, 3, 3, 3}, 2, 0.3f), b = RandomTensor({3}, 3);
  const Tensor dy = RandomTensor({2, 3, 4, 3, 4}, 4);
  const Tensor gamma = RandomTensor({4}, 5), beta = RandomTensor({4}, 6);
  const Attrs padded = ConvAttrs(1, 1), groups{{"groups", int64_t{2}}};
  const Tensor up_w = RandomTensor({4, 2, 2, 2, 2}, 7, 0.5f), up_b = RandomTensor({2}, 8);
  ASSERT_OK_AND_ASSIGN(Tensors norm,
                       RunKernel("group_norm_forward", {RoundedToBf16(x), gamma, beta}, groups));
  const Tensor pooled = DistinctValues({2, 4, 4, 2, 4}, 9);
  ASSERT_OK_AND_ASSIGN(Tensors pool, RunKernel("max_pool3d_forward", {RoundedToBf16(pooled)}));
  const Tensor targets = RandomTokens({2, 4, 3, 4}, 3, 10);
  const std::vector<Case> cases = {
      {"conv3d_forward", {x, w, b}, {0}, padded},
      {"conv3d_backward", {dy, x, w}, {0, 1}, padded},
      {"conv3d_backward_input", {dy, x, w}, {0, 1}, padded},
      {"conv3d_backward_weight", {dy, x, w}, {0, 1}, padded},
      {"conv3d_no_bias_forward", {x, w}, {0}, padded},
      {"conv3d_no_bias_backward", {dy, x, w}, {0, 1}, padded},
      {"conv_transpose3d_forward", {x, up_w, up_b}, {0}, Attrs{{"stride", int64_t{2}}}},
      {"channel_bias_add_forward", {dy, b}, {0}, {}},
      {"channel_bias_add_backward", {dy}, {0}, {}},
      {"upsample_nearest3d_forward", {x}, {0}, {}},
      {"max_pool3d_forward", {pooled}, {0}, {}},
      {"max_pool3d_backward", {pool[0], pooled, pool[1]}, {0, 1}, {}},
      {"group_norm_forward", {x, gamma, beta}, {0}, groups},
      {"group_norm_backward",
       {RandomTensor(x.shape(), 11), x, gamma, norm[1], norm[2]},
       {0, 1},
       groups},
      {"silu_forward", {x}, {0}, {}},
      {"silu_backward", {RandomTensor(x.shape(), 12), x}, {0, 1}, {}},
      {"leaky_relu_backward", {RandomTensor(x.shape(), 13), x}, {0, 1}, {}},
      {"concat_forward", {x, dy}, {0, 1}, {}},
      {"concat_backward", {RandomTensor({2, 7, 4, 3, 4}, 14), x}, {0, 1}, {}},
      {"voxel_cross_entropy", {RandomTensor({2, 3, 4, 3, 4}, 15, 3.0f), targets}, {0}, {}},
      {"dice_score", {RandomTensor({2, 3, 4, 3, 4}, 16, 3.0f), targets}, {0}, {}},
      {"loss_gradient", {ScalarTensor(0.75f), dy}, {1}, {}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.op);
    Tensors f32 = c.inputs, bf16 = c.inputs;
    for (size_t i : c.activations) {
      f32[i] = RoundedToBf16(c.inputs[i]);
      bf16[i] = Bf16Tensor(c.inputs[i]);
    }
    ASSERT_OK_AND_ASSIGN(Tensors expected, RunKernel(c.op, f32, c.attrs));
    ASSERT_OK_AND_ASSIGN(Tensors got, RunKernel(c.op, bf16, c.attrs));
    ASSERT_EQ(got.size(), expected.size());
    int rounded = 0;
    for (size_t o = 0; o < got.size(); ++o) {
      ASSERT_EQ(got[o].shape(), expected[o].shape()) << "output " << o;
      if (got[o].dtype() == DType::kBF16) {
        ++rounded;
        EXPECT_EQ(Bf16Values(got[o]), ToVector(RoundedToBf16(expected[o]))) << "output " << o;
      } else {
        ASSERT_EQ(got[o].dtype(), expected[o].dtype()) << "output " << o;
        EXPECT_EQ(std::memcmp(got[o].raw_data(), expected[o].raw_data(),
                              static_cast<size_t>(got[o].bytes())),
                  0)
            << "output " << o;
      }
    }
    // Every op with an activation output makes it bf16.
    const bool has_activation_output = c.op != "dice_score" && c.op != "conv3d_backward_weight";
    EXPECT_EQ(rounded > 0, has_activation_output);
  }
}

// Activation outputs take the activations' type, the rest stay f32; mixed types, integer
// activations and bf16 slabs are refused by name.
TEST(VolumeBf16Test, OutputsTakeTheActivationsTypeAndMixedTypesAreRefused) {
  const OpRegistry& r = CpuRegistry();
  const TensorMeta x{Shape{1, 4, 4, 4, 4}, DType::kBF16, Device::Cpu()};
  const TensorMeta w{Shape{2, 4, 3, 3, 3}, DType::kF32, Device::Cpu()};
  const TensorMeta bias{Shape{2}, DType::kF32, Device::Cpu()};
  const TensorMeta dy{Shape{1, 2, 4, 4, 4}, DType::kBF16, Device::Cpu()};
  const auto dtypes = [](const std::vector<TensorMeta>& metas) {
    std::vector<DType> out(metas.size());
    std::transform(metas.begin(), metas.end(), out.begin(),
                   [](const TensorMeta& m) { return m.dtype; });
    return out;
  };
  ASSERT_OK_AND_ASSIGN(auto conv, r.InferShapes("conv3d_forward", {x, w, bias}, ConvAttrs(1, 1)));
  EXPECT_EQ(dtypes(conv), std::vector<DType>{DType::kBF16});
  ASSERT_OK_AND_ASSIGN(auto grads, r.InferShapes("conv3d_backward", {dy, x, w}, ConvAttrs(1, 1)));
  EXPECT_EQ(dtypes(grads), (std::vector<DType>{DType::kBF16, DType::kF32, DType::kF32}));
  const TensorMeta gamma{Shape{4}, DType::kF32, Device::Cpu()};
  ASSERT_OK_AND_ASSIGN(auto norm, r.InferShapes("group_norm_forward", {x, gamma, gamma},
                                                Attrs{{"groups", int64_t{2}}}));
  EXPECT_EQ(dtypes(norm), (std::vector<DType>{DType::kBF16, DType::kF32, DType::kF32}));
  const TensorMeta labels{Shape{1, 4, 4, 4}, DType::kI32, Device::Cpu()};
  ASSERT_OK_AND_ASSIGN(auto loss, r.InferShapes("voxel_cross_entropy", {x, labels}, {}));
  EXPECT_EQ(dtypes(loss), (std::vector<DType>{DType::kF32, DType::kBF16}));

  const auto expect_refused = [&r](const std::string& op, const std::vector<TensorMeta>& in,
                                   const Attrs& attrs, const std::string& says) {
    Result<std::vector<TensorMeta>> out = r.InferShapes(op, in, attrs);
    ASSERT_FALSE(out.ok()) << op;
    EXPECT_NE(out.status().message().find(says), std::string::npos)
        << op << ": " << out.status().message();
  };
  const TensorMeta x32{x.shape, DType::kF32, Device::Cpu()};
  expect_refused("concat_forward", {x, x32}, {}, "both must have one dtype");
  expect_refused("conv3d_backward", {TensorMeta{dy.shape, DType::kF32, Device::Cpu()}, x, w},
                 ConvAttrs(1, 1), "input 'dy'");
  expect_refused("silu_forward", {TensorMeta{x.shape, DType::kI32, Device::Cpu()}}, {},
                 "an activation must be f32 or bf16");
  const TensorMeta plane{Shape{1, 4, 1, 4, 4}, DType::kBF16, Device::Cpu()};
  expect_refused("halo_join_forward", {plane, x, plane}, {}, "f32");
  expect_refused("cast_forward", {x32}, Attrs{{"dtype", std::string("f16")}}, "f32 or bf16");
}

// cast_forward rounds to nearest even (ties included), as the GPU's cast does; back to f32 is
// exact; cast_backward gives dy in x's type.
TEST(VolumeBf16Test, CastRoundsToNearestEvenAndBack) {
  // 1 + 2^-8 lies halfway between two bf16 values (1 and 1 + 2^-7): ties go to the even, 1;
  // 1 + 3 * 2^-8 goes up to 1 + 2^-6 (even); 1 + 2^-8 + 2^-12 is above the tie: up.
  const std::vector<float> values = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-12f,
                                     -2.5f, 0.0f};
  const std::vector<float> rounded = {1.0f, 1.0f + 0x1p-6f, 1.0f + 0x1p-7f, -2.5f, 0.0f};
  const Tensor x = FloatTensor({1, 1, 1, 1, 5}, values);
  const Attrs to_bf16{{"dtype", std::string("bf16")}}, to_f32{{"dtype", std::string("f32")}};
  ASSERT_OK_AND_ASSIGN(Tensors half, RunKernel("cast_forward", {x}, to_bf16));
  ASSERT_EQ(half[0].dtype(), DType::kBF16);
  ASSERT_OK_AND_ASSIGN(Tensors back, RunKernel("cast_forward", {half[0]}, to_f32));
  ASSERT_EQ(back[0].dtype(), DType::kF32);
  EXPECT_EQ(ToVector(back[0]), rounded);
  ASSERT_OK_AND_ASSIGN(Tensors dx, RunKernel("cast_backward", {half[0], x}, to_bf16));
  ASSERT_EQ(dx[0].dtype(), DType::kF32);
  EXPECT_EQ(ToVector(dx[0]), rounded);
}

// ---- every op is defined, has a kernel, a rule where it is differentiable, and a test ----

TEST(VolumeOpsTest, EveryVolumeOpHasAKernelARuleAndATest) {
  OpRegistry volume_only;
  ASSERT_OK(RegisterVolumeOps(volume_only));
  const std::set<std::string> tested = {"conv3d_forward",
                                        "conv3d_backward",
                                        "conv_transpose3d_forward",
                                        "conv_transpose3d_backward",
                                        "conv3d_backward_input",
                                        "conv3d_backward_weight",
                                        "conv_transpose3d_backward_input",
                                        "conv_transpose3d_backward_weight",
                                        "conv3d_no_bias_forward",
                                        "conv3d_no_bias_backward",
                                        "conv3d_no_bias_backward_weight",
                                        "channel_bias_add_forward",
                                        "channel_bias_add_backward",
                                        "upsample_nearest3d_forward",
                                        "upsample_nearest3d_backward",
                                        "max_pool3d_forward",
                                        "max_pool3d_backward",
                                        "group_norm_forward",
                                        "group_norm_backward",
                                        "slab_planes_forward",
                                        "slab_planes_backward",
                                        "halo_join_forward",
                                        "halo_join_backward",
                                        "group_norm_stats_forward",
                                        "group_norm_stats_backward",
                                        "group_norm_slab_forward",
                                        "group_norm_slab_backward",
                                        "relu_forward",
                                        "relu_backward",
                                        "silu_forward",
                                        "silu_backward",
                                        "leaky_relu_forward",
                                        "leaky_relu_backward",
                                        "concat_forward",
                                        "concat_backward",
                                        "cast_forward",
                                        "cast_backward",
                                        "voxel_cross_entropy",
                                        "downsample_labels",
                                        "dice_score"};
  const std::set<std::string> no_gradient = {"dice_score", "downsample_labels"};
  for (const std::string& op : volume_only.OpNames()) {
    EXPECT_TRUE(tested.contains(op)) << "volume op '" << op << "' has no test";
    EXPECT_TRUE(CpuRegistry().Supports(op, DeviceKind::kCpu)) << op << " has no CPU kernel";
    ASSERT_OK_AND_ASSIGN(const OpDef* def, volume_only.Find(op));
    EXPECT_FALSE(def->doc.empty()) << op;
    const std::string_view suffix = "_forward";
    if (op.ends_with(suffix)) {
      ASSERT_TRUE(def->gradient.has_value()) << op << " needs a GradientRule";
      EXPECT_EQ(def->gradient->op, op.substr(0, op.size() - suffix.size()) + "_backward");
      ASSERT_OK_AND_ASSIGN(const OpDef* backward, volume_only.Find(def->gradient->op));
      EXPECT_EQ(backward->input_names.size(), def->gradient->inputs.size()) << op;
      EXPECT_EQ(backward->output_names.size(), def->gradient->gradient_of.size()) << op;
    } else if (op == "voxel_cross_entropy") {
      // A loss: its gradient (dlogits) comes out of the forward, scaled by the loss's gradient.
      ASSERT_TRUE(def->gradient.has_value()) << op;
      EXPECT_EQ(def->gradient->op, "loss_gradient");
      EXPECT_EQ(def->gradient->gradient_of, std::vector<int>{0});
    } else {
      EXPECT_FALSE(def->gradient.has_value()) << op;
      EXPECT_TRUE(op.ends_with("_backward") || op.ends_with("_backward_input") ||
                  op.ends_with("_backward_weight") || no_gradient.contains(op))
          << op;
    }
  }
  EXPECT_EQ(volume_only.OpNames().size(), tested.size());
}

}  // namespace
}  // namespace tessera::testing

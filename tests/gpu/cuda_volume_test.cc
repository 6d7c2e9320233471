// The CUDA volume kernels (ops/cuda/volume_kernels.h) against their CPU counterparts
// (ops/cpu/volume_kernels.h), in f32 and in bf16, at U-Net-like shapes with odd sizes: group and
// instance norm forward and backward, the three activations, channel bias and its gradient,
// concatenation, nearest upsampling, max pooling (NaN included), voxel cross-entropy and Dice
// (bad targets reported), and cuDNN's convolutions (forward, input and weight gradients, stride 1
// and 2, the transposed convolution as the input gradient); plus run-to-run determinism. Then the
// ops' registered kCuda kernels, run as a GPU worker runs them (device tensors, in-place outputs
// holding their input), against the CPU kernels.
//
// Both sides compute on the same numbers (inputs the GPU reads as bf16 are rounded to bf16 first).
// Tolerances on ||gpu - cpu|| / ||cpu||:
//   kF32Tolerance    fp32 math in another order (block trees, cuDNN's algorithms): 1e-5.
//   kConvF32Tolerance  cuDNN's f32 convolutions accumulate in another order over up to ~8000
//                    products (FFT and Winograd algorithms are excluded only if not ranked
//                    first among the deterministic ones): 1e-4.
//   kBf16Tolerance   a bf16 output rounded once from fp32 math: 4e-3 (as cuda_kernels_test).
//   kBf16ConvTolerance  bf16 inputs and a bf16 output around fp32 accumulation: 1e-2.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>  // before gpu_test_util.h: cudaMalloc(T**) for its DeviceBuffer
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/half.h"
#include "data/volumes.h"
#include "gpu/gpu_test_util.h"
#include "model/unet3d.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/cpu/volume_kernels.h"
#include "ops/cuda/cuda_op_kernels.h"
#include "ops/cuda/volume_kernels.h"
#include "test_util.h"
#include "training/trainer.h"
#include "worker/gpu.h"
#include "worker/task_runner.h"

namespace tessera {
namespace {

using cuda::bf16;
using testing::DeviceBuffer;
using testing::RandomFloats;
using testing::RandomInts;
using testing::RandomTensor;
using testing::RandomTokens;
using testing::RelativeError;
using testing::RoundToBf16;
using testing::RunKernel;
using testing::ToBf16;
using testing::ToF32;
using testing::ToVector;

constexpr double kF32Tolerance = 1e-5;
constexpr double kConvF32Tolerance = 1e-4;
constexpr double kBf16Tolerance = 4e-3;
constexpr double kBf16ConvTolerance = 1e-2;

// A tensor on both sides: the host values (rounded to bf16 for a bf16 device copy) and the device
// copy of type T.
template <typename T>
struct Both {
  std::vector<float> host;
  std::unique_ptr<DeviceBuffer<T>> device;

  explicit Both(std::vector<float> values) {
    if constexpr (std::is_same_v<T, bf16>) {
      host = RoundToBf16(values);
      device = std::make_unique<DeviceBuffer<T>>(ToBf16(host));
    } else {
      host = std::move(values);
      device = std::make_unique<DeviceBuffer<T>>(host);
    }
  }
  T* get() const { return device->get(); }
};

// A device output of n elements of T, poisoned, downloaded as floats.
template <typename T>
struct Out {
  explicit Out(int64_t n) : device(n) { device.Poison(); }
  std::vector<float> Get() const {
    if constexpr (std::is_same_v<T, bf16>) {
      return ToF32(device.Download());
    } else {
      return device.Download();
    }
  }
  T* get() const { return device.get(); }
  DeviceBuffer<T> device;
};

template <typename T>
double Tolerance() {
  return std::is_same_v<T, bf16> ? kBf16Tolerance : kF32Tolerance;
}

template <typename T>
class CudaVolumeTest : public ::testing::Test {
 protected:
  void SetUp() override { TESSERA_REQUIRE_GPU(); }
};
using ActivationTypes = ::testing::Types<float, bf16>;
TYPED_TEST_SUITE(CudaVolumeTest, ActivationTypes);

TYPED_TEST(CudaVolumeTest, GroupAndInstanceNormMatchTheCpu) {
  using T = TypeParam;
  const int64_t batch = 2, channels = 12, spatial = int64_t{5} * 6 * 7;
  for (int64_t groups : {int64_t{4}, channels}) {  // group norm, instance norm
    SCOPED_TRACE(groups);
    const int64_t n = batch * channels * spatial;
    Both<T> x(RandomFloats(n, 1, -2.0f, 3.0f)), dy(RandomFloats(n, 2));
    const std::vector<float> w = RandomFloats(channels, 3, 0.5f, 1.5f);
    const std::vector<float> b = RandomFloats(channels, 4);
    DeviceBuffer<float> dw_in(w), db_in(b);
    Out<T> y(n), dx(n);
    Out<float> mean(batch * groups), rstd(batch * groups), dweight(channels), dbias(channels);
    DeviceBuffer<float> scratch(cuda::GroupNormBackwardScratch(batch, channels, groups));
    ASSERT_OK(cuda::GroupNormForward(y.get(), mean.get(), rstd.get(), x.get(), dw_in.get(),
                                     db_in.get(), batch, channels, spatial, groups, 1e-5f,
                                     nullptr));
    ASSERT_OK(cuda::GroupNormBackward(dx.get(), dweight.get(), dbias.get(), scratch.get(), dy.get(),
                                      x.get(), dw_in.get(), mean.get(), rstd.get(), batch, channels,
                                      spatial, groups, nullptr));
    std::vector<float> cy(n), cmean(batch * groups), crstd(batch * groups), cdx(n), cdw(channels),
        cdb(channels);
    cpu::GroupNormForward(cy.data(), cmean.data(), crstd.data(), x.host.data(), w.data(), b.data(),
                          batch, channels, spatial, groups, 1e-5f);
    cpu::GroupNormBackward(cdx.data(), cdw.data(), cdb.data(), dy.host.data(), x.host.data(),
                           w.data(), cmean.data(), crstd.data(), batch, channels, spatial, groups);
    EXPECT_LT(RelativeError(mean.Get(), cmean), kF32Tolerance);
    EXPECT_LT(RelativeError(rstd.Get(), crstd), kF32Tolerance);
    EXPECT_LT(RelativeError(y.Get(), cy), Tolerance<T>());
    EXPECT_LT(RelativeError(dx.Get(), cdx), Tolerance<T>());
    EXPECT_LT(RelativeError(dweight.Get(), cdw), kF32Tolerance);
    EXPECT_LT(RelativeError(dbias.Get(), cdb), kF32Tolerance);
  }
}

TYPED_TEST(CudaVolumeTest, ActivationsMatchTheCpu) {
  using T = TypeParam;
  const int64_t n = 1001;
  Both<T> x(RandomFloats(n, 5, -4.0f, 4.0f)), dy(RandomFloats(n, 6));
  struct Case {
    cuda::VolumeActivation kind;
    void (*forward)(float*, const float*, int64_t);
    void (*backward)(float*, const float*, const float*, int64_t);
  };
  for (const Case& c :
       {Case{cuda::VolumeActivation::kRelu, cpu::ReluForward, cpu::ReluBackward},
        Case{cuda::VolumeActivation::kLeakyRelu, cpu::LeakyReluForward, cpu::LeakyReluBackward},
        Case{cuda::VolumeActivation::kSilu, cpu::SiluForward, cpu::SiluBackward}}) {
    SCOPED_TRACE(static_cast<int>(c.kind));
    Out<T> y(n), dx(n);
    ASSERT_OK(cuda::ActivationForward(c.kind, y.get(), x.get(), n, nullptr));
    ASSERT_OK(cuda::ActivationBackward(c.kind, dx.get(), dy.get(), x.get(), n, nullptr));
    std::vector<float> cy(n), cdx(n);
    c.forward(cy.data(), x.host.data(), n);
    c.backward(cdx.data(), dy.host.data(), x.host.data(), n);
    EXPECT_LT(RelativeError(y.Get(), cy), Tolerance<T>());
    EXPECT_LT(RelativeError(dx.Get(), cdx), Tolerance<T>());
  }
}

TYPED_TEST(CudaVolumeTest, ChannelBiasConcatAndUpsamplingMatchTheCpu) {
  using T = TypeParam;
  const int64_t batch = 2, channels = 3, spatial = int64_t{4} * 5 * 3;
  const int64_t n = batch * channels * spatial;
  Both<T> x(RandomFloats(n, 7)), other(RandomFloats(batch * 2 * spatial, 8));
  const std::vector<float> bias = RandomFloats(channels, 9);
  DeviceBuffer<float> dbias_in(bias);
  Out<T> y(n);
  Out<float> sums(channels);
  ASSERT_OK(
      cuda::ChannelBiasAdd(y.get(), x.get(), dbias_in.get(), batch, channels, spatial, nullptr));
  ASSERT_OK(cuda::ChannelSums(sums.get(), x.get(), batch, channels, spatial, nullptr));
  std::vector<float> cy(n), csums(channels);
  cpu::ChannelBiasAdd(cy.data(), x.host.data(), bias.data(), batch, channels, spatial);
  cpu::ChannelSums(csums.data(), x.host.data(), batch, channels, spatial);
  EXPECT_LT(RelativeError(y.Get(), cy), Tolerance<T>());
  EXPECT_LT(RelativeError(sums.Get(), csums), kF32Tolerance);

  // Concatenation: [batch, 3 + 2 channels]; its backward splits it back exactly.
  const int64_t a_inner = channels * spatial, b_inner = 2 * spatial;
  Out<T> joined(batch * (a_inner + b_inner)), da(n), db(batch * b_inner);
  ASSERT_OK(
      cuda::ConcatForward(joined.get(), x.get(), other.get(), batch, a_inner, b_inner, nullptr));
  std::vector<float> cjoined(batch * (a_inner + b_inner));
  cpu::ConcatForward(cjoined.data(), x.host.data(), other.host.data(), batch, a_inner, b_inner);
  EXPECT_EQ(joined.Get(), cjoined);
  ASSERT_OK(
      cuda::ConcatBackward(da.get(), db.get(), joined.get(), batch, a_inner, b_inner, nullptr));
  EXPECT_EQ(da.Get(), x.host);
  EXPECT_EQ(db.Get(), other.host);

  // Nearest upsampling by 2 of [6 planes, 3 x 2 x 4] and back (sums of 8 values).
  const int64_t planes = 6, d = 3, h = 2, w = 4, scale = 2;
  Both<T> small(RandomFloats(planes * d * h * w, 10));
  Both<T> big_grad(RandomFloats(planes * d * h * w * 8, 11));
  Out<T> up(planes * d * h * w * 8), down(planes * d * h * w);
  ASSERT_OK(cuda::UpsampleNearest3dForward(up.get(), small.get(), planes, d, h, w, scale, nullptr));
  ASSERT_OK(
      cuda::UpsampleNearest3dBackward(down.get(), big_grad.get(), planes, d, h, w, scale, nullptr));
  std::vector<float> cup(planes * d * h * w * 8), cdown(planes * d * h * w);
  cpu::UpsampleNearest3dForward(cup.data(), small.host.data(), planes, d, h, w, scale);
  cpu::UpsampleNearest3dBackward(cdown.data(), big_grad.host.data(), planes, d, h, w, scale);
  EXPECT_EQ(up.Get(), cup);
  EXPECT_LT(RelativeError(down.Get(), cdown), Tolerance<T>());
}

TYPED_TEST(CudaVolumeTest, MaxPoolingMatchesTheCpuNaNIncluded) {
  using T = TypeParam;
  const int64_t planes = 5, d = 5, h = 6, w = 7, k = 2;  // floor mode: 2 x 3 x 3 outputs
  const int64_t volume = d * h * w, pooled = (d / k) * (h / k) * (w / k);
  std::vector<float> values = RandomFloats(planes * volume, 12);
  values[3] = std::numeric_limits<float>::quiet_NaN();  // NaN wins its window
  Both<T> x(values), dy(RandomFloats(planes * pooled, 13));
  Out<T> y(planes * pooled), dx(planes * volume);
  Out<int32_t> indices(planes * pooled);
  DeviceBuffer<int32_t> bad(std::vector<int32_t>{-1});
  ASSERT_OK(cuda::MaxPool3dForward(y.get(), indices.get(), x.get(), planes, d, h, w, k, nullptr));
  ASSERT_OK(cuda::MaxPool3dBackward(dx.get(), bad.get(), dy.get(), indices.get(), planes, volume,
                                    pooled, nullptr));
  std::vector<float> cy(planes * pooled), cdx(planes * volume);
  std::vector<int32_t> cindices(planes * pooled);
  cpu::MaxPool3dForward(cy.data(), cindices.data(), x.host.data(), planes, d, h, w, k);
  ASSERT_OK(
      cpu::MaxPool3dBackward(cdx.data(), dy.host.data(), cindices.data(), planes, volume, pooled));
  EXPECT_EQ(indices.device.Download(), cindices);
  const std::vector<float> got = y.Get();
  EXPECT_TRUE(std::isnan(got[0]));
  for (size_t i = 1; i < got.size(); ++i) EXPECT_EQ(got[i], cy[i]) << i;
  EXPECT_EQ(dx.Get(), cdx);
  EXPECT_EQ(bad.Download()[0], -1);
  // An index outside its plane is skipped and reported.
  std::vector<int32_t> broken = cindices;
  broken[7] = static_cast<int32_t>(volume);
  DeviceBuffer<int32_t> broken_indices(broken);
  ASSERT_OK(cuda::MaxPool3dBackward(dx.get(), bad.get(), dy.get(), broken_indices.get(), planes,
                                    volume, pooled, nullptr));
  EXPECT_EQ(bad.Download()[0], 7);
}

TYPED_TEST(CudaVolumeTest, VoxelCrossEntropyAndDiceMatchTheCpu) {
  using T = TypeParam;
  const int64_t batch = 2, classes = 4, spatial = int64_t{9} * 10 * 11;
  Both<T> logits(RandomFloats(batch * classes * spatial, 14, -3.0f, 3.0f));
  std::vector<int32_t> targets = RandomInts(batch * spatial, 15, 0, classes);
  DeviceBuffer<int32_t> dtargets(targets);
  Out<float> loss(1), score(1);
  Out<T> dlogits(batch * classes * spatial);
  DeviceBuffer<float> scratch(cuda::VoxelCrossEntropyScratch(batch, spatial));
  DeviceBuffer<unsigned long long> counts(cuda::DiceScoreCounts(classes));  // NOLINT
  DeviceBuffer<int32_t> bad(std::vector<int32_t>{-1});
  ASSERT_OK(cuda::VoxelCrossEntropy(loss.get(), dlogits.get(), scratch.get(), bad.get(),
                                    logits.get(), dtargets.get(), batch, classes, spatial, 0.5f,
                                    nullptr));
  ASSERT_OK(cuda::DiceScore(score.get(), counts.get(), bad.get(), logits.get(), dtargets.get(),
                            batch, classes, spatial, nullptr));
  std::vector<float> cdlogits(batch * classes * spatial);
  ASSERT_OK_AND_ASSIGN(float closs,
                       cpu::VoxelCrossEntropy(cdlogits.data(), logits.host.data(), targets.data(),
                                              batch, classes, spatial, 0.5f));
  ASSERT_OK_AND_ASSIGN(float cscore,
                       cpu::DiceScore(logits.host.data(), targets.data(), batch, classes, spatial));
  EXPECT_NEAR(loss.Get()[0], closs, kF32Tolerance * closs);
  EXPECT_LT(RelativeError(dlogits.Get(), cdlogits), Tolerance<T>());
  EXPECT_EQ(score.Get()[0], cscore);  // integer counts, the same ratio
  EXPECT_EQ(bad.Download()[0], -1);
  // Reproducible: the loss again, bit for bit.
  Out<float> again(1);
  ASSERT_OK(cuda::VoxelCrossEntropy(again.get(), nullptr, scratch.get(), bad.get(), logits.get(),
                                    dtargets.get(), batch, classes, spatial, 0.5f, nullptr));
  EXPECT_EQ(again.Get()[0], loss.Get()[0]);
  // A target outside [0, classes) is reported (the lowest voxel of those).
  targets[100] = static_cast<int32_t>(classes);
  targets[50] = -1;
  dtargets.Upload(targets);
  ASSERT_OK(cuda::DiceScore(score.get(), counts.get(), bad.get(), logits.get(), dtargets.get(),
                            batch, classes, spatial, nullptr));
  EXPECT_EQ(bad.Download()[0], 50);
}

// A convolution beyond cuDNN's 32-bit strides runs split along D (CudnnConvolutions): with the
// limit forced down to a few planes' worth, every direction split into chunks equals the one
// call, for stride 1 and stride 2 (nnU-Net's downsampling: windows overlap by one plane) and the
// transposed convolution (kernel 2, stride 2, backward data with the roles swapped: windows that
// tile). f32: within fp32 summation order (1e-5); bf16: the chunks' outputs are rounded once, as
// the call's are, but the input gradient's overlapping planes add two rounded parts and the
// weight gradient accumulates per chunk in bf16 (1e-2).
TYPED_TEST(CudaVolumeTest, ConvolutionsSplitAlongDepthEqualOneCall) {
  using T = TypeParam;
  Result<std::unique_ptr<cuda::CudnnConvolutions>> whole = cuda::CudnnConvolutions::Create(nullptr);
  if (!whole.ok()) GTEST_SKIP() << whole.status().ToString();
  const double tolerance = std::is_same_v<T, bf16> ? kBf16ConvTolerance : 1e-5;
  struct Case {
    cuda::VolumeConvShape s;
    int64_t limit;  // elements a call may hold: a few planes of the larger side
  };
  const auto shape = [](int64_t cin, int64_t d, int64_t cout, int64_t k, int64_t stride,
                        int64_t padding) {
    const int64_t out = (d + 2 * padding - k) / stride + 1;
    return cuda::VolumeConvShape{.batch = 2,
                                 .in_channels = cin,
                                 .in_d = d,
                                 .in_h = 6,
                                 .in_w = 5,
                                 .out_channels = cout,
                                 .out_d = out,
                                 .out_h = (6 + 2 * padding - k) / stride + 1,
                                 .out_w = (5 + 2 * padding - k) / stride + 1,
                                 .kd = k,
                                 .kh = k,
                                 .kw = k,
                                 .stride = stride,
                                 .padding = padding,
                                 .padding_d = padding};
  };
  const std::vector<Case> cases = {
      {shape(3, 11, 4, 3, 1, 1), 2 * 3 * 6 * 5 * 4},  // 2 output planes a chunk
      {shape(3, 12, 4, 3, 2, 1), 2 * 3 * 6 * 5 * 5},  // 2 a chunk, windows of 5 planes
      {shape(4, 10, 3, 2, 2, 0), 2 * 4 * 6 * 5 * 4},  // the transposed convolution's shape
  };
  for (const Case& c : cases) {
    const cuda::VolumeConvShape& s = c.s;
    SCOPED_TRACE(fmt::format("stride {} kernel {} limit {}", s.stride, s.kd, c.limit));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<cuda::CudnnConvolutions> split,
                         cuda::CudnnConvolutions::Create(nullptr, c.limit));
    const int64_t nx = s.batch * s.in_channels * s.in_d * s.in_h * s.in_w;
    const int64_t ny = s.batch * s.out_channels * s.out_d * s.out_h * s.out_w;
    const int64_t nw = s.out_channels * s.in_channels * s.kd * s.kh * s.kw;
    ASSERT_GT(nx, c.limit);  // the split runs
    Both<T> x(RandomFloats(nx, 26)), w(RandomFloats(nw, 27, -0.3f, 0.3f)), dy(RandomFloats(ny, 28));
    Out<T> y(ny), dx(nx), dw(nw), y_split(ny), dx_split(nx), dw_split(nw);
    ASSERT_OK((*whole)->Forward(y.get(), x.get(), w.get(), s));
    ASSERT_OK((*whole)->BackwardData(dx.get(), dy.get(), w.get(), s));
    ASSERT_OK((*whole)->BackwardFilter(dw.get(), x.get(), dy.get(), s));
    ASSERT_OK(split->Forward(y_split.get(), x.get(), w.get(), s));
    ASSERT_OK(split->BackwardData(dx_split.get(), dy.get(), w.get(), s));
    ASSERT_OK(split->BackwardFilter(dw_split.get(), x.get(), dy.get(), s));
    EXPECT_LT(RelativeError(y_split.Get(), y.Get()), tolerance);
    EXPECT_LT(RelativeError(dx_split.Get(), dx.Get()), tolerance);
    EXPECT_LT(RelativeError(dw_split.Get(), dw.Get()), tolerance);
  }
  // Not one output plane's window within the limit: refused by name before memory is touched.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<cuda::CudnnConvolutions> tiny,
                       cuda::CudnnConvolutions::Create(nullptr, 16));
  const cuda::VolumeConvShape s = shape(3, 11, 4, 3, 1, 1);
  for (const Status& status :
       {tiny->Forward(static_cast<T*>(nullptr), nullptr, nullptr, s),
        tiny->BackwardData(static_cast<T*>(nullptr), nullptr, nullptr, s),
        tiny->BackwardFilter(static_cast<T*>(nullptr), nullptr, nullptr, s)}) {
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
    EXPECT_NE(status.message().find("cannot split along D"), std::string::npos)
        << status.ToString();
  }
}

// cuDNN's convolutions: conv3d forward and its two gradients at stride 1 (kernel 3, padding 1) and
// stride 2 (nnU-Net's downsampling), and the transposed convolution (kernel 2, stride 2) as a
// backward-data call with the roles swapped.
TYPED_TEST(CudaVolumeTest, CudnnConvolutionsMatchTheCpu) {
  using T = TypeParam;
  Result<std::unique_ptr<cuda::CudnnConvolutions>> made = cuda::CudnnConvolutions::Create(nullptr);
  if (!made.ok()) GTEST_SKIP() << made.status().ToString();
  cuda::CudnnConvolutions& conv = **made;
  const double tolerance = std::is_same_v<T, bf16> ? kBf16ConvTolerance : kConvF32Tolerance;
  for (const auto& [stride, padding, k] : {std::tuple{1, 1, 3}, std::tuple{2, 1, 3}}) {
    SCOPED_TRACE(stride);
    cpu::Conv3dGeometry g{.batch = 2,
                          .in_channels = 3,
                          .in_d = 6,
                          .in_h = 7,
                          .in_w = 5,
                          .out_channels = 4,
                          .kd = k,
                          .kh = k,
                          .kw = k,
                          .stride = stride,
                          .padding = padding,
                          .padding_d = padding};
    g.out_d = (g.in_d + int64_t{2} * padding - k) / stride + 1;
    g.out_h = (g.in_h + int64_t{2} * padding - k) / stride + 1;
    g.out_w = (g.in_w + int64_t{2} * padding - k) / stride + 1;
    g.positions_per_chunk = cpu::DefaultPositionsPerChunk(g.ColumnRows(), g.OutVolume());
    const cuda::VolumeConvShape s{.batch = g.batch,
                                  .in_channels = g.in_channels,
                                  .in_d = g.in_d,
                                  .in_h = g.in_h,
                                  .in_w = g.in_w,
                                  .out_channels = g.out_channels,
                                  .out_d = g.out_d,
                                  .out_h = g.out_h,
                                  .out_w = g.out_w,
                                  .kd = k,
                                  .kh = k,
                                  .kw = k,
                                  .stride = stride,
                                  .padding = padding};
    const int64_t nx = g.batch * g.in_channels * g.InVolume();
    const int64_t ny = g.batch * g.out_channels * g.OutVolume();
    const int64_t nw = g.out_channels * g.ColumnRows();
    Both<T> x(RandomFloats(nx, 16)), w(RandomFloats(nw, 17, -0.3f, 0.3f)), dy(RandomFloats(ny, 18));
    Out<T> y(ny), dx(nx), dw(nw);
    ASSERT_OK(conv.Forward(y.get(), x.get(), w.get(), s));
    ASSERT_OK(conv.BackwardData(dx.get(), dy.get(), w.get(), s));
    ASSERT_OK(conv.BackwardFilter(dw.get(), x.get(), dy.get(), s));
    std::vector<float> workspace(cpu::Conv3dWorkspaceFloats(g)), cy(ny), cdx(nx), cdw(nw);
    cpu::Conv3dForward(cy.data(), x.host.data(), w.host.data(), nullptr, g, workspace.data(), 1);
    cpu::Conv3dInputGradient(cdx.data(), dy.host.data(), w.host.data(), nullptr, g,
                             workspace.data(), 1);
    cpu::Conv3dWeightGradient(cdw.data(), dy.host.data(), x.host.data(), g, workspace.data(), 1);
    EXPECT_LT(RelativeError(y.Get(), cy), tolerance);
    EXPECT_LT(RelativeError(dx.Get(), cdx), tolerance);
    EXPECT_LT(RelativeError(dw.Get(), cdw), tolerance);
    // Deterministic algorithms: the weight gradient again, bit for bit.
    Out<T> dw_again(nw);
    ASSERT_OK(conv.BackwardFilter(dw_again.get(), x.get(), dy.get(), s));
    EXPECT_EQ(dw_again.Get(), dw.Get());
  }
  // A shape whose output does not follow from its input is refused, naming the sizes.
  const cuda::VolumeConvShape wrong{.batch = 1,
                                    .in_channels = 1,
                                    .in_d = 4,
                                    .in_h = 4,
                                    .in_w = 4,
                                    .out_channels = 1,
                                    .out_d = 3,
                                    .out_h = 4,
                                    .out_w = 4,
                                    .kd = 3,
                                    .kh = 3,
                                    .kw = 3,
                                    .stride = 1,
                                    .padding = 1};
  Out<T> y(64), x(64), w(27);
  const Status refused = conv.Forward(y.get(), x.get(), w.get(), wrong);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("not the 3 x 4 x 4 given"), std::string::npos)
      << refused.ToString();
}

// The registered kernels on a real device: each op's kCuda kernel on device copies of the inputs
// (outputs allocated from the op's inferred metas; in-place outputs start as their input) against
// the CPU kernel on the host ones. f32 activations, as the volume ops infer today.
class CudaVolumeOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TESSERA_REQUIRE_GPU();
    Result<std::shared_ptr<DeviceRuntime>> device = cuda::OpenCudaDevice(0);
    ASSERT_TRUE(device.ok()) << device.status().ToString();
    device_ = *device;
    Result<OpRegistry> registry = MakeCpuOpRegistry();
    ASSERT_TRUE(registry.ok()) << registry.status().ToString();
    registry_ = std::make_unique<OpRegistry>(*std::move(registry));
    ASSERT_OK(cuda::RegisterCudaKernels(*registry_));
  }

  // The op's outputs computed on the GPU, copied back to the host.
  Result<std::vector<Tensor>> OnGpu(const std::string& op, const std::vector<Tensor>& inputs,
                                    const Attrs& attrs) {
    const KernelContext context{device_->allocator(), 0, registry_.get(), device_.get()};
    TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry_->Find(op));
    std::vector<Tensor> on_device;
    std::vector<TensorMeta> metas;
    for (const Tensor& input : inputs) {
      TensorMeta meta = input.meta();
      meta.device = Device::Cuda(0);
      TESSERA_ASSIGN_OR_RETURN(Tensor moved, MoveTo(meta, input, context));
      on_device.push_back(moved);
      metas.push_back(meta);
    }
    TESSERA_ASSIGN_OR_RETURN(std::vector<TensorMeta> out_metas, def->infer(metas, attrs));
    std::vector<Tensor> outputs;
    for (size_t j = 0; j < out_metas.size(); ++j) {
      TensorMeta meta = out_metas[j];
      meta.device = Device::Cuda(0);
      TESSERA_ASSIGN_OR_RETURN(Tensor out, AllocateOn(meta, context));
      for (const auto& [input, output] : def->in_place) {
        if (output == static_cast<int>(j)) {
          TESSERA_RETURN_IF_ERROR(CopyTensor(out, on_device[static_cast<size_t>(input)], context));
        }
      }
      outputs.push_back(out);
    }
    TESSERA_ASSIGN_OR_RETURN(const KernelFn* kernel, registry_->FindKernel(op, DeviceKind::kCuda));
    TESSERA_RETURN_IF_ERROR((*kernel)(context, on_device, outputs, attrs));
    std::vector<Tensor> host;
    for (const Tensor& out : outputs) {
      TESSERA_ASSIGN_OR_RETURN(Tensor copy, HostCopyOf(out, context));
      host.push_back(copy);
    }
    return host;
  }

  // The op on bf16 activations (the inputs `activations` names, rounded to bf16) on the GPU
  // against the CPU's bf16 path (f32 math on the same values, outputs rounded alike): within
  // `tolerance` relative for every output, each output of the same type on both sides.
  void ExpectSameAsCpuInBf16(const std::string& op, std::vector<Tensor> inputs,
                             const std::vector<size_t>& activations, const Attrs& attrs,
                             double tolerance) {
    SCOPED_TRACE(op + " in bf16");
    for (size_t i : activations) inputs[i] = AsBf16(inputs[i]);
    ASSERT_OK_AND_ASSIGN(std::vector<Tensor> gpu, OnGpu(op, inputs, attrs));
    ASSERT_OK_AND_ASSIGN(std::vector<Tensor> cpu, RunKernel(op, inputs, attrs));
    ASSERT_EQ(gpu.size(), cpu.size());
    int bf16_outputs = 0;
    for (size_t j = 0; j < cpu.size(); ++j) {
      SCOPED_TRACE(j);
      ASSERT_EQ(gpu[j].dtype(), cpu[j].dtype());
      bf16_outputs += cpu[j].dtype() == DType::kBF16;
      EXPECT_LT(RelativeError(Values(gpu[j]), Values(cpu[j])), tolerance);
    }
    EXPECT_GT(bf16_outputs, 0);
  }

  // `t`'s values rounded to bf16, as a bf16 host tensor.
  static Tensor AsBf16(const Tensor& t) {
    Tensor out =
        Tensor::Empty(TensorMeta{t.shape(), DType::kBF16, Device::Cpu()}, testing::TestAllocator())
            .value();
    auto* bits = static_cast<uint16_t*>(out.raw_data());
    for (int64_t i = 0; i < t.numel(); ++i) bits[i] = FloatToBf16(t.data<float>()[i]);
    return out;
  }

  // A host tensor's values as floats (f32 or bf16).
  static std::vector<float> Values(const Tensor& t) {
    if (t.dtype() != DType::kBF16) return ToVector(t);
    std::vector<float> values(static_cast<size_t>(t.numel()));
    const auto* bits = static_cast<const uint16_t*>(t.raw_data());
    for (size_t i = 0; i < values.size(); ++i) values[i] = Bf16ToFloat(bits[i]);
    return values;
  }

  void ExpectSameAsCpu(const std::string& op, const std::vector<Tensor>& inputs, const Attrs& attrs,
                       double tolerance) {
    SCOPED_TRACE(op);
    ASSERT_OK_AND_ASSIGN(std::vector<Tensor> gpu, OnGpu(op, inputs, attrs));
    ASSERT_OK_AND_ASSIGN(std::vector<Tensor> cpu, RunKernel(op, inputs, attrs));
    ASSERT_EQ(gpu.size(), cpu.size());
    for (size_t j = 0; j < cpu.size(); ++j) {
      SCOPED_TRACE(j);
      if (cpu[j].dtype() == DType::kI32) {
        const auto ints = [](const Tensor& t) {
          return std::vector<int32_t>(t.data<int32_t>(), t.data<int32_t>() + t.numel());
        };
        EXPECT_EQ(ints(gpu[j]), ints(cpu[j]));
      } else {
        EXPECT_LT(RelativeError(ToVector(gpu[j]), ToVector(cpu[j])), tolerance);
      }
    }
  }

  std::shared_ptr<DeviceRuntime> device_;
  std::unique_ptr<OpRegistry> registry_;
};

TEST_F(CudaVolumeOpsTest, TheRegisteredKernelsMatchTheCpuOnes) {
  const Tensor x = RandomTensor({2, 3, 6, 5, 4}, 1);
  const Tensor w = RandomTensor({4, 3, 3, 3, 3}, 2, 0.3f);
  const Tensor b = RandomTensor({4}, 3);
  const Attrs conv{{"padding", int64_t{1}}};
  ExpectSameAsCpu("conv3d_forward", {x, w, b}, conv, kConvF32Tolerance);
  const Tensor dy = RandomTensor({2, 4, 6, 5, 4}, 4);
  ExpectSameAsCpu("conv3d_backward", {dy, x, w}, conv, kConvF32Tolerance);
  const Attrs strided{{"padding", int64_t{1}}, {"stride", int64_t{2}}};
  ExpectSameAsCpu("conv3d_forward", {x, w, b}, strided, kConvF32Tolerance);
  // Transposed, kernel 2 stride 2: [2, 4, 3, 3, 2] -> [2, 3, 6, 6, 4].
  const Tensor small = RandomTensor({2, 4, 3, 3, 2}, 5);
  const Tensor tw = RandomTensor({4, 3, 2, 2, 2}, 6, 0.3f);
  const Tensor tb = RandomTensor({3}, 7);
  const Attrs up{{"stride", int64_t{2}}};
  ExpectSameAsCpu("conv_transpose3d_forward", {small, tw, tb}, up, kConvF32Tolerance);
  ExpectSameAsCpu("conv_transpose3d_backward", {RandomTensor({2, 3, 6, 6, 4}, 8), small, tw}, up,
                  kConvF32Tolerance);
  const Tensor gw = RandomTensor({3}, 9), gb = RandomTensor({3}, 10);
  const Attrs instance{{"groups", int64_t{3}}};
  ExpectSameAsCpu("group_norm_forward", {x, gw, gb}, instance, kF32Tolerance);
  ASSERT_OK_AND_ASSIGN(std::vector<Tensor> stats,
                       RunKernel("group_norm_forward", {x, gw, gb}, instance));
  ExpectSameAsCpu("group_norm_backward", {RandomTensor(x.shape(), 11), x, gw, stats[1], stats[2]},
                  instance, kF32Tolerance);
  for (const char* op : {"leaky_relu_forward", "silu_forward", "relu_forward"}) {
    ExpectSameAsCpu(op, {x}, {}, kF32Tolerance);
  }
  ExpectSameAsCpu("leaky_relu_backward", {RandomTensor(x.shape(), 12), x}, {}, kF32Tolerance);
  ExpectSameAsCpu("max_pool3d_forward", {RandomTensor({2, 3, 6, 6, 4}, 13)},
                  {{"kernel", int64_t{2}}}, kF32Tolerance);
  ExpectSameAsCpu("concat_forward", {x, RandomTensor({2, 2, 6, 5, 4}, 14)}, {}, kF32Tolerance);
  ExpectSameAsCpu("upsample_nearest3d_forward", {small}, {{"scale", int64_t{2}}}, kF32Tolerance);
  ExpectSameAsCpu("channel_bias_add_backward", {dy}, {}, kF32Tolerance);
  const Tensor logits = RandomTensor({2, 3, 6, 5, 4}, 15, 3.0f);
  const Tensor targets = RandomTokens(Shape{2, 6, 5, 4}, 3, 16);
  ExpectSameAsCpu("voxel_cross_entropy", {logits, targets}, {{"grad_scale", 0.5}}, kF32Tolerance);
  // Deep supervision's pieces: a weighted term, the labels sampled down, the terms' sum.
  ExpectSameAsCpu("voxel_cross_entropy", {logits, targets}, {{"weight", 0.25}}, kF32Tolerance);
  ExpectSameAsCpu("downsample_labels", {RandomTokens(Shape{2, 4, 6, 2}, 3, 18)},
                  {{"factor", int64_t{2}}}, kF32Tolerance);
  ExpectSameAsCpu("add_forward", {x, RandomTensor(x.shape(), 19)}, {}, kF32Tolerance);
  ExpectSameAsCpu("add_backward", {dy}, {}, kF32Tolerance);
  ExpectSameAsCpu("dice_score", {logits, targets}, {}, kF32Tolerance);
  ExpectSameAsCpu("loss_gradient", {testing::ScalarTensor(0.75f), logits}, {}, kF32Tolerance);
  // A target outside the classes: the GPU's loss names it, as the CPU's does.
  const Tensor bad = RandomTokens(Shape{2, 6, 5, 4}, 4, 17);
  const Status refused = OnGpu("voxel_cross_entropy", {logits, bad}, {}).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("outside [0, 3)"), std::string::npos) << refused.ToString();
}

// The registered kernels on bf16 activations against the CPU's bf16 path (ops/volume_ops.h: f32
// math on the bf16 values, each activation output rounded to bf16), which the U-Net's bf16 run
// on the CPU uses: the GPU's bf16 steps are checked against it.
TEST_F(CudaVolumeOpsTest, TheRegisteredKernelsInBf16MatchTheCpusBf16Path) {
  const Tensor x = RandomTensor({2, 3, 6, 5, 4}, 1);
  const Tensor w = RandomTensor({4, 3, 3, 3, 3}, 2, 0.3f), b = RandomTensor({4}, 3);
  const Tensor dy = RandomTensor({2, 4, 6, 5, 4}, 4);
  const Attrs conv{{"padding", int64_t{1}}};
  ExpectSameAsCpuInBf16("conv3d_forward", {x, w, b}, {0}, conv, kBf16ConvTolerance);
  ExpectSameAsCpuInBf16("conv3d_backward", {dy, x, w}, {0, 1}, conv, kBf16ConvTolerance);
  const Tensor small = RandomTensor({2, 4, 3, 3, 2}, 5);
  const Tensor tw = RandomTensor({4, 3, 2, 2, 2}, 6, 0.3f), tb = RandomTensor({3}, 7);
  const Attrs up{{"stride", int64_t{2}}};
  ExpectSameAsCpuInBf16("conv_transpose3d_forward", {small, tw, tb}, {0}, up, kBf16ConvTolerance);
  const Tensor gw = RandomTensor({3}, 9), gb = RandomTensor({3}, 10);
  const Attrs instance{{"groups", int64_t{3}}};
  ExpectSameAsCpuInBf16("group_norm_forward", {x, gw, gb}, {0}, instance, kBf16Tolerance);
  ExpectSameAsCpuInBf16("leaky_relu_forward", {x}, {0}, {}, kBf16Tolerance);
  ExpectSameAsCpuInBf16("concat_forward", {x, RandomTensor({2, 2, 6, 5, 4}, 14)}, {0, 1}, {},
                        kBf16Tolerance);
  const Tensor logits = RandomTensor({2, 3, 6, 5, 4}, 15, 3.0f);
  const Tensor targets = RandomTokens(Shape{2, 6, 5, 4}, 3, 16);
  ExpectSameAsCpuInBf16("voxel_cross_entropy", {logits, targets}, {0}, {}, kBf16Tolerance);
  ExpectSameAsCpuInBf16("loss_gradient", {testing::ScalarTensor(0.75f), logits}, {1}, {},
                        kBf16Tolerance);
  ExpectSameAsCpuInBf16("cast_forward", {x}, {}, {{"dtype", std::string("bf16")}}, kBf16Tolerance);
}

// Ten steps of a 3D U-Net on the GPU (its layer programs running the volume ops' CUDA kernels
// and cuDNN's convolutions) in `activations` (UNet3dConfig::activations); the losses of each
// step, on the GPU and, for `also_cpu`, on the CPU.
struct UNetLosses {
  std::vector<float> gpu, cpu;
};
Result<UNetLosses> TenUNetSteps(DType activations, bool also_cpu) {
  UNet3dConfig config = *UNet3dConfig::Preset("small");
  config.activations = activations;
  const int64_t v = config.volume;
  std::vector<std::vector<Tensor>> batches;
  for (int step = 0; step < 10; ++step) {
    TESSERA_ASSIGN_OR_RETURN(VolumeBatch made,
                             GenerateVolumes(2, v, config.in_channels, 40 + step));
    batches.push_back({testing::FloatTensor(Shape{2, config.in_channels, v, v, v}, made.volumes),
                       testing::IntTensor(Shape{2, v, v, v}, made.labels)});
  }
  const auto train = [&](bool on_gpu) -> Result<std::vector<float>> {
    TrainingPlan plan;
    plan.batch = 2;
    ExecutorOptions options;
    if (on_gpu) {
      plan.device = Device::Cuda(0);
      TESSERA_ASSIGN_OR_RETURN(options.device, OpenGpu(0));
    }
    TESSERA_ASSIGN_OR_RETURN(ModelSpec model, BuildUNet3d(config, testing::CpuRegistry()));
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                             Trainer::Create(model, plan, options));
    TESSERA_RETURN_IF_ERROR(trainer->InitializeParameters(1));
    std::vector<float> losses;
    for (const std::vector<Tensor>& batch : batches) {
      TESSERA_ASSIGN_OR_RETURN(StepReport report, trainer->Step(batch, 3e-3f));
      losses.push_back(report.loss);
    }
    return losses;
  };
  UNetLosses losses;
  TESSERA_ASSIGN_OR_RETURN(losses.gpu, train(true));
  if (also_cpu) {
    TESSERA_ASSIGN_OR_RETURN(losses.cpu, train(false));
  }
  return losses;
}

// f32: the CPU's losses within 1e-4 relative (fp32 sums in other orders, cuDNN's algorithms and
// block trees, compound over ten AdamW steps).
TEST(CudaUNetTest, TenStepsFollowTheCpuLosses) {
  TESSERA_REQUIRE_GPU();
  ASSERT_OK_AND_ASSIGN(UNetLosses f32, TenUNetSteps(DType::kF32, /*also_cpu=*/true));
  for (size_t i = 0; i < f32.cpu.size(); ++i) {
    std::printf("step %zu: cpu %.7f gpu %.7f\n", i + 1, f32.cpu[i], f32.gpu[i]);
    EXPECT_NEAR(f32.gpu[i], f32.cpu[i], 1e-4 * std::abs(f32.cpu[i])) << "step " << i + 1;
  }
}

// bf16 activations (what --device cuda trains in): within bf16's tolerance of the CPU's f32
// losses (1%: 8 mantissa bits, 0.4% a rounding, over ten steps) and closer to the CPU's own bf16
// path (0.5%: the same roundings but where fp32 sums in another order cross a bf16 boundary).
TEST(CudaUNetTest, TenStepsInBf16FollowTheCpuLossesWithinBf16Tolerance) {
  TESSERA_REQUIRE_GPU();
  ASSERT_OK_AND_ASSIGN(UNetLosses f32, TenUNetSteps(DType::kF32, /*also_cpu=*/true));
  ASSERT_OK_AND_ASSIGN(UNetLosses mixed, TenUNetSteps(DType::kBF16, /*also_cpu=*/true));
  for (size_t i = 0; i < f32.cpu.size(); ++i) {
    std::printf("step %zu: cpu f32 %.7f cpu bf16 %.7f gpu bf16 %.7f\n", i + 1, f32.cpu[i],
                mixed.cpu[i], mixed.gpu[i]);
    EXPECT_NEAR(mixed.gpu[i], f32.cpu[i], 1e-2 * std::abs(f32.cpu[i])) << "step " << i + 1;
    EXPECT_NEAR(mixed.gpu[i], mixed.cpu[i], 5e-3 * std::abs(mixed.cpu[i])) << "step " << i + 1;
  }
}

}  // namespace
}  // namespace tessera

// The CUDA kernels of ops/cuda/kernels.h (casts, embedding, layernorm, elementwise, classifier,
// optimizer; attention has cuda_attention_test.cc) against their CPU counterparts
// (ops/cpu/kernels.h), on the vectorised path (16-byte accesses: C % 8 == 0, aligned pointers)
// and the scalar one (odd sizes, pointers offset by one element); plus reproducibility of the
// deterministic reductions, bad-token/bad-target reporting, empty inputs and argument checks.
//
// Both sides compute on the same numbers: inputs the GPU reads as bf16 are rounded to bf16 first.
// Tolerances are on ||gpu - cpu|| / ||cpu||:
//   kBf16Tolerance   a bf16 output, rounded once from fp32 math: per element the relative error is
//                    at most 2^-8 (rms ~1.6e-3 over many elements); 4e-3 leaves 2.5x of room.
//   kSumTolerance    fp32 sums of up to ~1000 terms taken in another order than the CPU's (row
//                    chunks, warp trees): each addition may round differently, a random walk of
//                    ~sqrt(N) * 2^-24 relative, ~1e-6; 1e-5 leaves room.
//   kSameMathTolerance  the same operations in the same order (AdamW, casts back, means in fp64):
//                    only library ulps (pow, tanhf) or a summation tree differ; 1e-6.
//   kSquaresTolerance   SumOfSquares' fp32 block partials (~40 roundings per element's path,
//                    positive terms) against the CPU's fp64 sum: 2e-6.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <cuda_runtime.h>  // before gpu_test_util.h: cudaMalloc(T**) for its DeviceBuffer
#include <gtest/gtest.h>

#include "gpu/gpu_test_util.h"
#include "ops/cpu/kernels.h"
#include "ops/cuda/kernels.h"
#include "test_util.h"

namespace tessera {
namespace {

using cuda::bf16;
using testing::DeviceBuffer;
using testing::RandomFloats;
using testing::RandomInts;
using testing::RelativeError;
using testing::RoundToBf16;
using testing::ToBf16;
using testing::ToF32;

constexpr double kBf16Tolerance = 4e-3;
constexpr double kSumTolerance = 1e-5;
constexpr double kSameMathTolerance = 1e-6;
constexpr double kSquaresTolerance = 2e-6;

uint16_t Bits(bf16 value) {
  uint16_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

template <typename T>
std::vector<T> Slice(const std::vector<T>& v, int64_t begin, int64_t n) {
  return std::vector<T>(v.begin() + begin, v.begin() + begin + n);
}

// The relative error of one scalar.
double ScalarError(double got, double want) {
  if (std::isnan(got)) return INFINITY;
  return want == 0 ? std::abs(got) : std::abs(got - want) / std::abs(want);
}

std::vector<float> DownloadBf16(const DeviceBuffer<bf16>& buffer) {
  return ToF32(buffer.Download());
}

std::vector<int32_t> ScalarInt(int32_t value) { return std::vector<int32_t>{value}; }

// ---- casts ----

TEST(CudaKernelsTest, CastsRoundToNearestEvenBothWays) {
  TESSERA_REQUIRE_GPU();
  for (int64_t n : {int64_t{1001}, int64_t{4096}, int64_t{7}}) {
    for (int64_t offset : {0, 1}) {  // offset 1: unaligned, the scalar path
      SCOPED_TRACE(::testing::Message() << "n=" << n << " offset=" << offset);
      const std::vector<float> x = RandomFloats(n + offset, 11 + n, -3.0f, 3.0f);
      DeviceBuffer<float> in(x);
      DeviceBuffer<bf16> half(n + offset);
      half.Poison();
      ASSERT_OK(cuda::CastF32ToBf16(half.get() + offset, in.get() + offset, n, nullptr));
      const std::vector<bf16> got = half.Download();
      const std::vector<bf16> want = ToBf16(x);
      for (int64_t i = offset; i < n + offset; ++i) {
        ASSERT_EQ(Bits(got[i]), Bits(want[i])) << "element " << i << " of " << x[i];
      }

      DeviceBuffer<float> back(n + offset);
      back.Poison();
      ASSERT_OK(cuda::CastBf16ToF32(back.get() + offset, half.get() + offset, n, nullptr));
      const std::vector<float> back_host = back.Download();
      const std::vector<float> want_back = ToF32(want);
      for (int64_t i = offset; i < n + offset; ++i) ASSERT_EQ(back_host[i], want_back[i]) << i;
    }
  }
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

// ---- embedding ----

struct EmbeddingCase {
  int64_t batch, seq_len, channels, vocab;
};

class EmbeddingTest : public ::testing::TestWithParam<EmbeddingCase> {};

TEST_P(EmbeddingTest, ForwardMatchesCpuAndReportsTheFirstBadToken) {
  TESSERA_REQUIRE_GPU();
  const auto [batch, seq_len, channels, vocab] = GetParam();
  const int64_t rows = batch * seq_len;
  const std::vector<float> wte = RandomFloats(vocab * channels, 1);
  const std::vector<float> wpe = RandomFloats(seq_len * channels, 2);
  const std::vector<int32_t> tokens = RandomInts(rows, 3, 0, static_cast<int32_t>(vocab));
  DeviceBuffer<float> wte_d(wte), wpe_d(wpe);

  // Valid tokens.
  {
    std::vector<float> want(rows * channels);
    ASSERT_OK(cpu::EmbeddingForward(want.data(), tokens.data(), wte.data(), wpe.data(), batch,
                                    seq_len, channels, vocab));
    DeviceBuffer<int32_t> tokens_d(tokens), bad(ScalarInt(-1));
    DeviceBuffer<bf16> out(rows * channels);
    out.Poison();
    ASSERT_OK(cuda::EmbeddingForward(out.get(), bad.get(), tokens_d.get(), wte_d.get(), wpe_d.get(),
                                     batch, seq_len, channels, vocab, nullptr));
    EXPECT_LT(RelativeError(DownloadBf16(out), want), kBf16Tolerance);
    EXPECT_EQ(bad.Download()[0], -1);
  }

  // Bad tokens at rows 9 (negative), 5 (== vocab) and the last row: row 5 is reported, and each
  // bad row is zeros.
  std::vector<int32_t> bad_tokens = tokens;
  const std::vector<int64_t> bad_rows = {9, 5, rows - 1};
  bad_tokens[9] = -1;
  bad_tokens[5] = static_cast<int32_t>(vocab);
  bad_tokens[rows - 1] = static_cast<int32_t>(vocab) + 100;
  std::vector<int32_t> repaired = bad_tokens;
  for (int64_t r : bad_rows) repaired[r] = 0;
  std::vector<float> want(rows * channels);
  ASSERT_OK(cpu::EmbeddingForward(want.data(), repaired.data(), wte.data(), wpe.data(), batch,
                                  seq_len, channels, vocab));
  for (int64_t r : bad_rows) std::fill_n(want.begin() + r * channels, channels, 0.0f);
  DeviceBuffer<int32_t> tokens_d(bad_tokens), bad(ScalarInt(-1));
  DeviceBuffer<bf16> out(rows * channels);
  out.Poison();
  ASSERT_OK(cuda::EmbeddingForward(out.get(), bad.get(), tokens_d.get(), wte_d.get(), wpe_d.get(),
                                   batch, seq_len, channels, vocab, nullptr));
  const std::vector<float> got = DownloadBf16(out);
  EXPECT_LT(RelativeError(got, want), kBf16Tolerance);
  for (int64_t r : bad_rows) {
    for (int64_t c = 0; c < channels; ++c) ASSERT_EQ(got[r * channels + c], 0.0f) << r;
  }
  EXPECT_EQ(bad.Download()[0], 5);
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

TEST_P(EmbeddingTest, BackwardAccumulatesLikeCpu) {
  TESSERA_REQUIRE_GPU();
  const auto [batch, seq_len, channels, vocab_unused] = GetParam();
  (void)vocab_unused;
  const int64_t vocab = 7;  // few tokens: many rows share a dwte row
  const int64_t rows = batch * seq_len;
  const std::vector<float> dwte_init = RandomFloats(vocab * channels, 4);
  const std::vector<float> dwpe_init = RandomFloats(seq_len * channels, 5);
  const std::vector<float> dout = RoundToBf16(RandomFloats(rows * channels, 6));
  const std::vector<int32_t> tokens = RandomInts(rows, 7, 0, static_cast<int32_t>(vocab));
  std::vector<float> dwte_want = dwte_init, dwpe_want = dwpe_init;
  cpu::EmbeddingBackward(dwte_want.data(), dwpe_want.data(), dout.data(), tokens.data(), batch,
                         seq_len, channels);

  DeviceBuffer<bf16> dout_d(ToBf16(dout));
  DeviceBuffer<int32_t> tokens_d(tokens);
  std::vector<float> first_dwpe;
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer<float> dwte(dwte_init), dwpe(dwpe_init);
    ASSERT_OK(cuda::EmbeddingBackward(dwte.get(), dwpe.get(), dout_d.get(), tokens_d.get(), batch,
                                      seq_len, channels, nullptr));
    // dwte: atomics in any order, a few fp32 additions per element.
    EXPECT_LT(RelativeError(dwte.Download(), dwte_want), kSameMathTolerance);
    // dwpe: the CPU's additions in the CPU's order.
    const std::vector<float> got_dwpe = dwpe.Download();
    EXPECT_LT(RelativeError(got_dwpe, dwpe_want), kSameMathTolerance);
    if (run == 0) {
      first_dwpe = got_dwpe;
    } else {
      EXPECT_EQ(std::memcmp(first_dwpe.data(), got_dwpe.data(), got_dwpe.size() * sizeof(float)), 0)
          << "dwpe differs between two runs";
    }
  }
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

INSTANTIATE_TEST_SUITE_P(Shapes, EmbeddingTest,
                         ::testing::Values(EmbeddingCase{4, 64, 768, 1000},  // vectorised
                                           EmbeddingCase{2, 33, 64, 300},    // vectorised, short
                                           EmbeddingCase{3, 7, 37, 50}));    // scalar

// ---- layernorm ----

struct LayerNormCase {
  int64_t rows, channels;
};

class LayerNormTest : public ::testing::TestWithParam<LayerNormCase> {};

TEST_P(LayerNormTest, ForwardMatchesCpu) {
  TESSERA_REQUIRE_GPU();
  const auto [rows, channels] = GetParam();
  const std::vector<float> x = RoundToBf16(RandomFloats(rows * channels, 21, -1.5f, 2.5f));
  const std::vector<float> weight = RandomFloats(channels, 22, 0.5f, 1.5f);
  const std::vector<float> bias = RandomFloats(channels, 23, -0.5f, 0.5f);
  std::vector<float> out(rows * channels), mean(rows), rstd(rows);
  cpu::LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), weight.data(), bias.data(),
                        rows, channels);

  cudaStream_t stream;
  TESSERA_ASSERT_CUDA(cudaStreamCreate(&stream));
  DeviceBuffer<bf16> x_d(ToBf16(x)), out_d(rows * channels);
  DeviceBuffer<float> weight_d(weight), bias_d(bias), mean_d(rows), rstd_d(rows);
  out_d.Poison();
  mean_d.Poison();
  rstd_d.Poison();
  ASSERT_OK(cuda::LayerNormForward(out_d.get(), mean_d.get(), rstd_d.get(), x_d.get(),
                                   weight_d.get(), bias_d.get(), rows, channels, stream));
  TESSERA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  TESSERA_ASSERT_CUDA(cudaStreamDestroy(stream));
  EXPECT_LT(RelativeError(DownloadBf16(out_d), out), kBf16Tolerance);
  EXPECT_LT(RelativeError(mean_d.Download(), mean), kSumTolerance);
  EXPECT_LT(RelativeError(rstd_d.Download(), rstd), kSumTolerance);
}

TEST_P(LayerNormTest, BackwardMatchesCpuAndIsReproducible) {
  TESSERA_REQUIRE_GPU();
  const auto [rows, channels] = GetParam();
  const std::vector<float> x = RoundToBf16(RandomFloats(rows * channels, 31, -1.5f, 2.5f));
  const std::vector<float> dout = RoundToBf16(RandomFloats(rows * channels, 32));
  const std::vector<float> dx_init = RoundToBf16(RandomFloats(rows * channels, 33));
  const std::vector<float> weight = RandomFloats(channels, 34, 0.5f, 1.5f);
  const std::vector<float> bias = RandomFloats(channels, 35, -0.5f, 0.5f);
  std::vector<float> y(rows * channels), mean(rows), rstd(rows);
  cpu::LayerNormForward(y.data(), mean.data(), rstd.data(), x.data(), weight.data(), bias.data(),
                        rows, channels);

  DeviceBuffer<bf16> x_d(ToBf16(x)), dout_d(ToBf16(dout));
  DeviceBuffer<float> weight_d(weight), mean_d(mean), rstd_d(rstd);
  DeviceBuffer<float> scratch(cuda::LayerNormBackwardScratch(rows, channels));
  for (bool accumulate : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "accumulate_dx=" << accumulate);
    std::vector<float> dx_want = accumulate ? dx_init : std::vector<float>(rows * channels);
    std::vector<float> dw_want(channels), db_want(channels);
    cpu::LayerNormBackward(dx_want.data(), dw_want.data(), db_want.data(), dout.data(), x.data(),
                           weight.data(), mean.data(), rstd.data(), rows, channels, accumulate);
    std::vector<float> first_dw, first_db;
    for (int run = 0; run < 2; ++run) {
      DeviceBuffer<bf16> dx(rows * channels);
      if (accumulate) {
        dx.Upload(ToBf16(dx_init));
      } else {
        dx.Poison();
      }
      DeviceBuffer<float> dw(channels), db(channels);
      dw.Poison();
      db.Poison();
      scratch.Poison();
      ASSERT_OK(cuda::LayerNormBackward(dx.get(), dw.get(), db.get(), scratch.get(), dout_d.get(),
                                        x_d.get(), weight_d.get(), mean_d.get(), rstd_d.get(), rows,
                                        channels, accumulate, nullptr));
      EXPECT_LT(RelativeError(DownloadBf16(dx), dx_want), kBf16Tolerance);
      const std::vector<float> got_dw = dw.Download(), got_db = db.Download();
      EXPECT_LT(RelativeError(got_dw, dw_want), kSumTolerance);
      EXPECT_LT(RelativeError(got_db, db_want), kSumTolerance);
      if (run == 0) {
        first_dw = got_dw;
        first_db = got_db;
      } else {
        EXPECT_EQ(std::memcmp(first_dw.data(), got_dw.data(), channels * sizeof(float)), 0);
        EXPECT_EQ(std::memcmp(first_db.data(), got_db.data(), channels * sizeof(float)), 0);
      }
    }
  }

  // dx written over dout (allowed when not accumulating).
  std::vector<float> dx_want(rows * channels), dw_want(channels), db_want(channels);
  cpu::LayerNormBackward(dx_want.data(), dw_want.data(), db_want.data(), dout.data(), x.data(),
                         weight.data(), mean.data(), rstd.data(), rows, channels, false);
  DeviceBuffer<bf16> in_place(ToBf16(dout));
  DeviceBuffer<float> dw(channels), db(channels);
  ASSERT_OK(cuda::LayerNormBackward(in_place.get(), dw.get(), db.get(), scratch.get(),
                                    in_place.get(), x_d.get(), weight_d.get(), mean_d.get(),
                                    rstd_d.get(), rows, channels, false, nullptr));
  EXPECT_LT(RelativeError(DownloadBf16(in_place), dx_want), kBf16Tolerance);
  EXPECT_LT(RelativeError(dw.Download(), dw_want), kSumTolerance);
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

INSTANTIATE_TEST_SUITE_P(Shapes, LayerNormTest,
                         ::testing::Values(LayerNormCase{300, 768},  // vectorised, partial block
                                           LayerNormCase{33, 64},    // vectorised, 8 lanes a row
                                           LayerNormCase{1001, 37},  // scalar
                                           LayerNormCase{1, 1600}));

// ---- elementwise ----

class ElementwiseTest : public ::testing::TestWithParam<int64_t> {};

// n elements at offset 0 (vector body + tail) and at offset 1 (scalar path).
TEST_P(ElementwiseTest, AddMatchesCpu) {
  TESSERA_REQUIRE_GPU();
  const int64_t n = GetParam();
  for (int64_t offset : {0, 1}) {
    SCOPED_TRACE(::testing::Message() << "offset=" << offset);
    const std::vector<float> a = RoundToBf16(RandomFloats(n + offset, 41));
    const std::vector<float> b = RoundToBf16(RandomFloats(n + offset, 42));
    std::vector<float> want(n);
    cpu::Add(want.data(), a.data() + offset, b.data() + offset, n);
    DeviceBuffer<bf16> a_d(ToBf16(a)), b_d(ToBf16(b)), out(n + offset);
    out.Poison();
    ASSERT_OK(cuda::Add(out.get() + offset, a_d.get() + offset, b_d.get() + offset, n, nullptr));
    EXPECT_LT(RelativeError(Slice(DownloadBf16(out), offset, n), want), kBf16Tolerance);
    // In place: a += b.
    ASSERT_OK(cuda::Add(a_d.get() + offset, a_d.get() + offset, b_d.get() + offset, n, nullptr));
    EXPECT_LT(RelativeError(Slice(DownloadBf16(a_d), offset, n), want), kBf16Tolerance);
  }
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

TEST_P(ElementwiseTest, GeluForwardAndBackwardMatchCpu) {
  TESSERA_REQUIRE_GPU();
  const int64_t n = GetParam();
  for (int64_t offset : {0, 1}) {
    SCOPED_TRACE(::testing::Message() << "offset=" << offset);
    const std::vector<float> x = RoundToBf16(RandomFloats(n + offset, 51, -4.0f, 4.0f));
    const std::vector<float> dout = RoundToBf16(RandomFloats(n + offset, 52));
    std::vector<float> y_want(n), dx_want(n);
    cpu::GeluForward(y_want.data(), x.data() + offset, n);
    cpu::GeluBackward(dx_want.data(), dout.data() + offset, x.data() + offset, n);

    DeviceBuffer<bf16> x_d(ToBf16(x)), dout_d(ToBf16(dout)), y(n + offset), dx(n + offset);
    y.Poison();
    dx.Poison();
    ASSERT_OK(cuda::GeluForward(y.get() + offset, x_d.get() + offset, n, nullptr));
    EXPECT_LT(RelativeError(Slice(DownloadBf16(y), offset, n), y_want), kBf16Tolerance);
    ASSERT_OK(cuda::GeluBackward(dx.get() + offset, dout_d.get() + offset, x_d.get() + offset, n,
                                 nullptr));
    EXPECT_LT(RelativeError(Slice(DownloadBf16(dx), offset, n), dx_want), kBf16Tolerance);

    // In place: dx over dout, then out over x.
    ASSERT_OK(cuda::GeluBackward(dout_d.get() + offset, dout_d.get() + offset, x_d.get() + offset,
                                 n, nullptr));
    EXPECT_LT(RelativeError(Slice(DownloadBf16(dout_d), offset, n), dx_want), kBf16Tolerance);
    ASSERT_OK(cuda::GeluForward(x_d.get() + offset, x_d.get() + offset, n, nullptr));
    EXPECT_LT(RelativeError(Slice(DownloadBf16(x_d), offset, n), y_want), kBf16Tolerance);
  }
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

INSTANTIATE_TEST_SUITE_P(Sizes, ElementwiseTest,
                         ::testing::Values(int64_t{1001}, int64_t{64 * 3072 + 5}, int64_t{3}));

struct SumRowsCase {
  int64_t rows, cols;
};

class SumRowsTest : public ::testing::TestWithParam<SumRowsCase> {};

TEST_P(SumRowsTest, MatchesCpuAccumulatesAndIsReproducible) {
  TESSERA_REQUIRE_GPU();
  const auto [rows, cols] = GetParam();
  const std::vector<float> x = RoundToBf16(RandomFloats(rows * cols, 61));
  const std::vector<float> init = RandomFloats(cols, 62);
  std::vector<float> want(cols);
  cpu::SumRows(want.data(), x.data(), rows, cols);
  std::vector<float> want_accumulated(cols);
  for (int64_t c = 0; c < cols; ++c) want_accumulated[c] = init[c] + want[c];

  DeviceBuffer<bf16> x_d(ToBf16(x));
  DeviceBuffer<float> scratch(cuda::SumRowsScratch(rows, cols));
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer<float> out(cols);
    out.Poison();
    scratch.Poison();
    ASSERT_OK(cuda::SumRows(out.get(), scratch.get(), x_d.get(), rows, cols, false, nullptr));
    const std::vector<float> got = out.Download();
    EXPECT_LT(RelativeError(got, want), kSumTolerance);
    if (run == 0) {
      first = got;
    } else {
      EXPECT_EQ(std::memcmp(first.data(), got.data(), cols * sizeof(float)), 0);
    }
  }
  DeviceBuffer<float> out(init);
  ASSERT_OK(cuda::SumRows(out.get(), scratch.get(), x_d.get(), rows, cols, true, nullptr));
  EXPECT_LT(RelativeError(out.Download(), want_accumulated), kSumTolerance);
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

INSTANTIATE_TEST_SUITE_P(Shapes, SumRowsTest,
                         ::testing::Values(SumRowsCase{300, 768},   // vectorised, 3 row chunks
                                           SumRowsCase{129, 64},    // vectorised, ragged chunk
                                           SumRowsCase{1001, 37},   // scalar
                                           SumRowsCase{1, 2304}));  // one row

// ---- classifier ----

struct CrossEntropyCase {
  int64_t rows, vocab, padded_vocab;
};

class CrossEntropyTest : public ::testing::TestWithParam<CrossEntropyCase> {};

// loss[r] = logsumexp(row) - row[target], in double.
std::vector<float> ReferenceLosses(const std::vector<float>& logits, const std::vector<int32_t>& t,
                                   int64_t rows, int64_t vocab) {
  std::vector<float> losses(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits.data() + r * vocab;
    double max = -INFINITY;
    for (int64_t j = 0; j < vocab; ++j) max = std::max(max, static_cast<double>(l[j]));
    double sum = 0;
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(l[j] - max);
    losses[r] = static_cast<float>(max + std::log(sum) - l[t[r]]);
  }
  return losses;
}

TEST_P(CrossEntropyTest, LossesAndGradientMatchCpu) {
  TESSERA_REQUIRE_GPU();
  const auto [rows, vocab, padded] = GetParam();
  const float grad_scale = 2.5f;
  // Padded columns hold random values too: they must not count, and must come back as zeros.
  const std::vector<float> logits = RoundToBf16(RandomFloats(rows * padded, 71, -4.0f, 4.0f));
  const std::vector<int32_t> targets = RandomInts(rows, 72, 0, static_cast<int32_t>(vocab));
  std::vector<float> compact(rows * vocab);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(logits.begin() + r * padded, vocab, compact.begin() + r * vocab);
  }
  std::vector<float> dlogits(rows * vocab);
  ASSERT_OK_AND_ASSIGN(const float mean_loss,
                       cpu::SoftmaxCrossEntropy(dlogits.data(), compact.data(), targets.data(),
                                                rows, vocab, grad_scale));
  const std::vector<float> losses_want = ReferenceLosses(compact, targets, rows, vocab);

  DeviceBuffer<int32_t> targets_d(targets);
  // Loss only: the logits stay as they are.
  {
    DeviceBuffer<bf16> logits_d(ToBf16(logits));
    DeviceBuffer<float> losses(rows);
    DeviceBuffer<int32_t> bad(ScalarInt(-1));
    losses.Poison();
    ASSERT_OK(cuda::SoftmaxCrossEntropy(logits_d.get(), losses.get(), bad.get(), targets_d.get(),
                                        rows, vocab, padded, grad_scale, false, nullptr));
    EXPECT_LT(RelativeError(losses.Download(), losses_want), kSumTolerance);
    const std::vector<bf16> after = logits_d.Download(), before = ToBf16(logits);
    for (size_t i = 0; i < after.size(); ++i) ASSERT_EQ(Bits(after[i]), Bits(before[i])) << i;
    EXPECT_EQ(bad.Download()[0], -1);
  }
  // With the gradient, in place.
  DeviceBuffer<bf16> logits_d(ToBf16(logits));
  DeviceBuffer<float> losses(rows), mean(1);
  DeviceBuffer<int32_t> bad(ScalarInt(-1));
  losses.Poison();
  mean.Poison();
  ASSERT_OK(cuda::SoftmaxCrossEntropy(logits_d.get(), losses.get(), bad.get(), targets_d.get(),
                                      rows, vocab, padded, grad_scale, true, nullptr));
  ASSERT_OK(cuda::Mean(mean.get(), losses.get(), rows, nullptr));
  EXPECT_LT(RelativeError(losses.Download(), losses_want), kSumTolerance);
  EXPECT_LT(ScalarError(mean.Download()[0], mean_loss), kSumTolerance);
  EXPECT_EQ(bad.Download()[0], -1);
  const std::vector<float> grad = DownloadBf16(logits_d);
  std::vector<float> grad_real(rows * vocab);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(grad.begin() + r * padded, vocab, grad_real.begin() + r * vocab);
    for (int64_t j = vocab; j < padded; ++j) ASSERT_EQ(grad[r * padded + j], 0.0f) << r << "," << j;
  }
  EXPECT_LT(RelativeError(grad_real, dlogits), kBf16Tolerance);
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

TEST_P(CrossEntropyTest, BadTargetsGiveNanLossesAndTheFirstIndex) {
  TESSERA_REQUIRE_GPU();
  const auto [rows, vocab, padded] = GetParam();
  const std::vector<float> logits = RoundToBf16(RandomFloats(rows * padded, 81, -4.0f, 4.0f));
  std::vector<int32_t> targets = RandomInts(rows, 82, 0, static_cast<int32_t>(vocab));
  std::vector<float> compact(rows * vocab);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(logits.begin() + r * padded, vocab, compact.begin() + r * vocab);
  }
  const std::vector<float> losses_want = ReferenceLosses(compact, targets, rows, vocab);
  const int64_t last = rows - 1;
  targets[last] = -5;
  targets[3] = static_cast<int32_t>(vocab);
  DeviceBuffer<bf16> logits_d(ToBf16(logits));
  DeviceBuffer<int32_t> targets_d(targets), bad(ScalarInt(-1));
  DeviceBuffer<float> losses(rows);
  losses.Poison();
  ASSERT_OK(cuda::SoftmaxCrossEntropy(logits_d.get(), losses.get(), bad.get(), targets_d.get(),
                                      rows, vocab, padded, 1.0f, true, nullptr));
  EXPECT_EQ(bad.Download()[0], 3);
  const std::vector<float> got = losses.Download();
  for (int64_t r = 0; r < rows; ++r) {
    if (r == 3 || r == last) {
      EXPECT_TRUE(std::isnan(got[r])) << r;
    } else {
      EXPECT_LT(ScalarError(got[r], losses_want[r]), kSumTolerance) << r;
    }
  }
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CrossEntropyTest,
    ::testing::Values(CrossEntropyCase{64, 1000, 1024},   // vectorised, masked tail group
                      CrossEntropyCase{8, 50257, 50304},  // GPT-2's vocabulary
                      CrossEntropyCase{33, 997, 1001},    // scalar (padded % 8 != 0)
                      CrossEntropyCase{5, 64, 64}));      // fewer columns than threads

TEST(CudaKernelsTest, MeanIsTheFp64MeanAndReproducible) {
  TESSERA_REQUIRE_GPU();
  for (int64_t n : {int64_t{1}, int64_t{1001}, int64_t{32768}}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    const std::vector<float> x = RandomFloats(n, 91 + n, 0.5f, 10.0f);
    double sum = 0;
    for (float v : x) sum += v;
    const float want = static_cast<float>(sum / static_cast<double>(n));
    DeviceBuffer<float> x_d(x), out(1);
    out.Poison();
    ASSERT_OK(cuda::Mean(out.get(), x_d.get(), n, nullptr));
    const float first = out.Download()[0];
    EXPECT_LT(ScalarError(first, want), kSameMathTolerance);
    out.Poison();
    ASSERT_OK(cuda::Mean(out.get(), x_d.get(), n, nullptr));
    const float second = out.Download()[0];
    EXPECT_EQ(std::bit_cast<uint32_t>(first), std::bit_cast<uint32_t>(second));  // bitwise
  }
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

// ---- optimizer ----

class AdamWTest : public ::testing::TestWithParam<int64_t> {};

// Three steps (step 1, 2, 3; lr and grad_scale changing, grad_scale null once) of a shard that
// starts at element 1000 of its group, against cpu::AdamWUpdate; offset 1 takes the scalar path.
TEST_P(AdamWTest, StepsMatchCpu) {
  TESSERA_REQUIRE_GPU();
  const int64_t offset = GetParam();
  const int64_t n = 10007;
  const int64_t element_offset = 1000;
  // Group coordinates; relative to the shard: [0, 500), [2000, 2001), [4000, 8000), [9500, n).
  const std::vector<int64_t> ranges = {0, 1500, 3000, 3001, 5000, 9000, 10500, 20000};
  cpu::AdamWConfig cpu_config{.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  cuda::AdamWConfig config{.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  cuda::DecayRanges decay;
  decay.count = static_cast<int>(ranges.size() / 2);
  for (int r = 0; r < decay.count; ++r) {
    decay.begin[r] = ranges[2 * static_cast<size_t>(r)];
    decay.end[r] = ranges[2 * static_cast<size_t>(r) + 1];
  }

  std::vector<float> param = RandomFloats(n + offset, 101);
  std::vector<float> m(n + offset, 0.0f), v(n + offset, 0.0f);
  DeviceBuffer<float> param_d(param), m_d(m), v_d(v), grad_d(n + offset);
  DeviceBuffer<float> lr_d(1), scale_d(1);
  DeviceBuffer<int64_t> step_d(1);
  const float lrs[] = {1e-3f, 2e-3f, 5e-4f};
  const float scales[] = {0.5f, 1.0f, 0.25f};
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    const std::vector<float> grad = RandomFloats(n + offset, 110 + step);
    const float lr = lrs[step - 1];
    const bool null_scale = step == 2;
    const float grad_scale = scales[step - 1];
    cpu::AdamWUpdate(param.data() + offset, m.data() + offset, v.data() + offset,
                     grad.data() + offset, n, cpu_config, lr, step, grad_scale, ranges.data(),
                     decay.count, element_offset, {.parallel = false});
    grad_d.Upload(grad);
    lr_d.Upload({lr});
    scale_d.Upload({grad_scale});
    step_d.Upload({step});
    ASSERT_OK(cuda::AdamWUpdate(param_d.get() + offset, m_d.get() + offset, v_d.get() + offset,
                                grad_d.get() + offset, n, config, lr_d.get(), step_d.get(),
                                null_scale ? nullptr : scale_d.get(), decay, element_offset,
                                nullptr));
    EXPECT_LT(RelativeError(Slice(param_d.Download(), offset, n), Slice(param, offset, n)),
              kSameMathTolerance);
    EXPECT_LT(RelativeError(Slice(m_d.Download(), offset, n), Slice(m, offset, n)),
              kSameMathTolerance);
    EXPECT_LT(RelativeError(Slice(v_d.Download(), offset, n), Slice(v, offset, n)),
              kSameMathTolerance);
  }
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

INSTANTIATE_TEST_SUITE_P(Alignment, AdamWTest, ::testing::Values(int64_t{0}, int64_t{1}));

TEST(CudaKernelsTest, SumOfSquaresMatchesCpuAndIsReproducible) {
  TESSERA_REQUIRE_GPU();
  for (int64_t n : {int64_t{1}, int64_t{1001}, int64_t{100003}}) {
    for (int64_t offset : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " offset=" << offset);
      const std::vector<float> x = RandomFloats(n + offset, 121 + n);
      const double want = cpu::SumOfSquares(x.data() + offset, n);
      DeviceBuffer<float> x_d(x), out(1);
      DeviceBuffer<uint8_t> scratch(cuda::SumOfSquaresScratch(n));
      float first = 0;
      for (int run = 0; run < 2; ++run) {
        out.Poison();
        scratch.Poison();
        ASSERT_OK(cuda::SumOfSquares(out.get(), scratch.get(), x_d.get() + offset, n, nullptr));
        const float got = out.Download()[0];
        EXPECT_LT(ScalarError(got, want), kSquaresTolerance);
        if (run == 0) {
          first = got;
        } else {
          EXPECT_EQ(std::bit_cast<uint32_t>(first), std::bit_cast<uint32_t>(got));  // bitwise
        }
      }
    }
  }
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

TEST(CudaKernelsTest, ClipScaleMatchesCpu) {
  TESSERA_REQUIRE_GPU();
  for (int count : {1, 3, cuda::kMaxClipInputs}) {
    const std::vector<float> sums = RandomFloats(count, 131 + count, 0.01f, 2.0f);
    double total = 0;
    for (float s : sums) total += s;
    const double norm_want = std::sqrt(total);
    DeviceBuffer<float> sums_d(sums);
    std::vector<const float*> pointers(count);
    for (int i = 0; i < count; ++i) pointers[i] = sums_d.get() + i;
    for (float max_norm : {1.0f, 0.0f, 1e4f}) {
      SCOPED_TRACE(::testing::Message() << "count=" << count << " max_norm=" << max_norm);
      DeviceBuffer<float> scale(1), norm(1);
      scale.Poison();
      norm.Poison();
      ASSERT_OK(
          cuda::ClipScale(scale.get(), norm.get(), pointers.data(), count, max_norm, nullptr));
      EXPECT_LT(ScalarError(norm.Download()[0], norm_want), kSameMathTolerance);
      EXPECT_LT(ScalarError(scale.Download()[0], cpu::ClipScale(norm_want, max_norm)),
                kSameMathTolerance);
    }
  }
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

// ---- empty inputs and argument checks ----

TEST(CudaKernelsTest, EmptyInputsAreNoOpsOrWriteTheEmptyResult) {
  TESSERA_REQUIRE_GPU();
  EXPECT_OK(cuda::CastF32ToBf16(nullptr, nullptr, 0, nullptr));
  EXPECT_OK(cuda::CastBf16ToF32(nullptr, nullptr, 0, nullptr));
  EXPECT_OK(cuda::Add(nullptr, nullptr, nullptr, 0, nullptr));
  EXPECT_OK(cuda::GeluForward(nullptr, nullptr, 0, nullptr));
  EXPECT_OK(cuda::GeluBackward(nullptr, nullptr, nullptr, 0, nullptr));
  EXPECT_OK(cuda::EmbeddingForward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 64, 768, 100,
                                   nullptr));
  EXPECT_OK(cuda::EmbeddingBackward(nullptr, nullptr, nullptr, nullptr, 0, 64, 768, nullptr));
  EXPECT_OK(cuda::LayerNormForward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 768,
                                   nullptr));
  EXPECT_OK(cuda::SoftmaxCrossEntropy(nullptr, nullptr, nullptr, nullptr, 0, 100, 104, 1.0f, true,
                                      nullptr));
  EXPECT_OK(cuda::AdamWUpdate(nullptr, nullptr, nullptr, nullptr, 0, {}, nullptr, nullptr, nullptr,
                              {}, 0, nullptr));
  EXPECT_EQ(cuda::SumRowsScratch(0, 64), 0);
  EXPECT_EQ(cuda::LayerNormBackwardScratch(0, 64), 0);
  EXPECT_EQ(cuda::SumOfSquaresScratch(0), 0);

  // Reductions over nothing write their empty value: zeros (sums), 0 (mean), 1 (clip scale).
  DeviceBuffer<float> dw(64), db(64), out(64), scalar(1), scale(1);
  dw.Poison();
  db.Poison();
  out.Poison();
  ASSERT_OK(cuda::LayerNormBackward(nullptr, dw.get(), db.get(), nullptr, nullptr, nullptr, nullptr,
                                    nullptr, nullptr, 0, 64, false, nullptr));
  ASSERT_OK(cuda::SumRows(out.get(), nullptr, nullptr, 0, 64, false, nullptr));
  const std::vector<float> zeros(64, 0.0f);
  EXPECT_EQ(dw.Download(), zeros);
  EXPECT_EQ(db.Download(), zeros);
  EXPECT_EQ(out.Download(), zeros);
  scalar.Poison();
  ASSERT_OK(cuda::Mean(scalar.get(), nullptr, 0, nullptr));
  EXPECT_EQ(scalar.Download()[0], 0.0f);
  scalar.Poison();
  ASSERT_OK(cuda::SumOfSquares(scalar.get(), nullptr, nullptr, 0, nullptr));
  EXPECT_EQ(scalar.Download()[0], 0.0f);
  scalar.Poison();
  scale.Poison();
  ASSERT_OK(cuda::ClipScale(scale.get(), scalar.get(), nullptr, 0, 1.0f, nullptr));
  EXPECT_EQ(scalar.Download()[0], 0.0f);
  EXPECT_EQ(scale.Download()[0], 1.0f);
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

TEST(CudaKernelsTest, BadSizesAreInvalidArguments) {
  TESSERA_REQUIRE_GPU();
  auto invalid = [](const Status& status) { return status.code() == StatusCode::kInvalidArgument; };
  EXPECT_TRUE(invalid(cuda::Add(nullptr, nullptr, nullptr, -1, nullptr)));
  EXPECT_TRUE(invalid(cuda::CastF32ToBf16(nullptr, nullptr, -8, nullptr)));
  EXPECT_TRUE(invalid(
      cuda::LayerNormForward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 4, 0, nullptr)));
  EXPECT_TRUE(invalid(cuda::SoftmaxCrossEntropy(nullptr, nullptr, nullptr, nullptr, 4, 100, 99,
                                                1.0f, true, nullptr)));
  EXPECT_TRUE(invalid(cuda::SumRows(nullptr, nullptr, nullptr, -1, 4, false, nullptr)));
  const float* sums[cuda::kMaxClipInputs + 1] = {};
  EXPECT_TRUE(
      invalid(cuda::ClipScale(nullptr, nullptr, sums, cuda::kMaxClipInputs + 1, 1.0f, nullptr)));
  cuda::DecayRanges unsorted;
  unsorted.count = 2;
  unsorted.begin[0] = 100;
  unsorted.end[0] = 200;
  unsorted.begin[1] = 0;
  unsorted.end[1] = 50;
  EXPECT_TRUE(invalid(cuda::AdamWUpdate(nullptr, nullptr, nullptr, nullptr, 10, {}, nullptr,
                                        nullptr, nullptr, unsorted, 0, nullptr)));
  cuda::DecayRanges too_many;
  too_many.count = cuda::kMaxDecayRanges + 1;
  EXPECT_TRUE(invalid(cuda::AdamWUpdate(nullptr, nullptr, nullptr, nullptr, 10, {}, nullptr,
                                        nullptr, nullptr, too_many, 0, nullptr)));
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace tessera

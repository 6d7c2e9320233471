// The CUDA flash attention (ops/cuda/attention.cu) against the CPU kernel (ops/cpu/attention.cc):
// forward output and log-sum-exp, backward dq, dk, dv, over head sizes 16..128, ragged and
// single-token sequences, two input magnitudes; its reproducibility; its argument checks.
//
// Both sides compute on the same bf16-rounded qkv and dout; the CPU in fp32 throughout, the GPU
// with bf16 tensor-core inputs (P and dS rounded to bf16) and bf16 outputs, hence the tolerances.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>  // before gpu_test_util.h: cudaMalloc(T**) for its DeviceBuffer
#include <gtest/gtest.h>

#include "gpu/gpu_test_util.h"
#include "ops/cpu/kernels.h"
#include "ops/cuda/kernels.h"

namespace tessera {
namespace {

using cuda::bf16;
using testing::DeviceBuffer;
using testing::RandomFloats;
using testing::RelativeError;
using testing::RoundToBf16;
using testing::ToBf16;
using testing::ToF32;

struct AttentionCase {
  std::string name;
  int64_t batch, seq_len, channels, heads;
  float magnitude;  // qkv ~ U(-magnitude, magnitude); dout ~ U(-1, 1)
};

std::ostream& operator<<(std::ostream& os, const AttentionCase& c) {
  return os << c.name << " (B=" << c.batch << " T=" << c.seq_len << " C=" << c.channels
            << " heads=" << c.heads << " qkv in +-" << c.magnitude << ")";
}

// One slot (0 = q, 1 = k, 2 = v) of a [rows, 3C] tensor, as a [rows, C] vector.
std::vector<float> Slot(const std::vector<float>& x, int64_t rows, int64_t channels, int slot) {
  std::vector<float> part(static_cast<size_t>(rows * channels));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < channels; ++c) {
      part[r * channels + c] = x[(r * 3 + slot) * channels + c];
    }
  }
  return part;
}

bool AllFinite(const std::vector<float>& x) {
  for (float v : x) {
    if (!std::isfinite(v)) return false;
  }
  return true;
}

// Device results of one forward + backward.
struct GpuResults {
  std::vector<bf16> out, dqkv;
  std::vector<float> lse;
};

// Runs the CUDA forward, then the backward on the forward's own out and lse, on poisoned outputs.
void RunGpu(const AttentionCase& c, const std::vector<float>& qkv, const std::vector<float>& dout,
            GpuResults* results) {
  const int64_t rows = c.batch * c.seq_len;
  DeviceBuffer<bf16> qkv_d(ToBf16(qkv)), dout_d(ToBf16(dout));
  DeviceBuffer<bf16> out_d(rows * c.channels), dqkv_d(rows * 3 * c.channels);
  DeviceBuffer<float> lse_d(c.batch * c.heads * c.seq_len);
  const int64_t scratch_bytes =
      cuda::AttentionBackwardScratch(c.batch, c.seq_len, c.channels, c.heads);
  DeviceBuffer<uint8_t> scratch_d(scratch_bytes);
  out_d.Poison();
  dqkv_d.Poison();
  lse_d.Poison();
  scratch_d.Poison();

  const Status forward = cuda::AttentionForward(out_d.get(), lse_d.get(), qkv_d.get(), c.batch,
                                                c.seq_len, c.channels, c.heads, nullptr);
  ASSERT_TRUE(forward.ok()) << forward.ToString();
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
  const Status backward =
      cuda::AttentionBackward(dqkv_d.get(), scratch_d.get(), dout_d.get(), out_d.get(), qkv_d.get(),
                              lse_d.get(), c.batch, c.seq_len, c.channels, c.heads, nullptr);
  ASSERT_TRUE(backward.ok()) << backward.ToString();
  TESSERA_ASSERT_CUDA(cudaDeviceSynchronize());
  results->out = out_d.Download();
  results->dqkv = dqkv_d.Download();
  results->lse = lse_d.Download();
}

class CudaAttentionTest : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(CudaAttentionTest, MatchesCpu) {
  TESSERA_REQUIRE_GPU();
  const AttentionCase& c = GetParam();
  const int64_t rows = c.batch * c.seq_len;
  const std::vector<float> qkv =
      RoundToBf16(RandomFloats(rows * 3 * c.channels, 17, -c.magnitude, c.magnitude));
  const std::vector<float> dout = RoundToBf16(RandomFloats(rows * c.channels, 29));

  std::vector<float> out_ref(static_cast<size_t>(rows * c.channels));
  std::vector<float> lse_ref(static_cast<size_t>(c.batch * c.heads * c.seq_len));
  std::vector<float> dqkv_ref(static_cast<size_t>(rows * 3 * c.channels));
  cpu::AttentionForward(out_ref.data(), lse_ref.data(), qkv.data(), c.batch, c.seq_len, c.channels,
                        c.heads);
  cpu::AttentionBackward(dqkv_ref.data(), dout.data(), qkv.data(), lse_ref.data(), c.batch,
                         c.seq_len, c.channels, c.heads);

  GpuResults gpu;
  ASSERT_NO_FATAL_FAILURE(RunGpu(c, qkv, dout, &gpu));
  const std::vector<float> dqkv = ToF32(gpu.dqkv);

  // out: P rounded to bf16 before P V, then the output rounding (up to 4e-3 each, averaging
  // out). lse is fp32 end to end. The gradients go through more bf16 products (dS rounded) and
  // the GPU's D uses the bf16 out. Seen on an H200: out <= 2.1e-3, lse <= 1e-7, dq/dk <= 4.8e-3
  // (the +-4 inputs, whose peaked softmax weighs single roundings more), dv <= 2.4e-3.
  // Tolerances are about twice those; a wrong tile, mask or index gives errors near 1.
  const double out_error = RelativeError(ToF32(gpu.out), out_ref);
  const double lse_error = RelativeError(gpu.lse, lse_ref);
  const double dq_error =
      RelativeError(Slot(dqkv, rows, c.channels, 0), Slot(dqkv_ref, rows, c.channels, 0));
  const double dk_error =
      RelativeError(Slot(dqkv, rows, c.channels, 1), Slot(dqkv_ref, rows, c.channels, 1));
  const double dv_error =
      RelativeError(Slot(dqkv, rows, c.channels, 2), Slot(dqkv_ref, rows, c.channels, 2));
  EXPECT_LT(out_error, 5e-3) << c;
  EXPECT_LT(lse_error, 1e-6) << c;
  EXPECT_LT(dq_error, 1e-2) << c;
  EXPECT_LT(dk_error, 1e-2) << c;
  EXPECT_LT(dv_error, 5e-3) << c;
  std::printf("%-22s out %.2e  lse %.2e  dq %.2e  dk %.2e  dv %.2e\n", c.name.c_str(), out_error,
              lse_error, dq_error, dk_error, dv_error);
}

// Tiles are 64 rows: T = 37 and 200 leave a ragged last tile, T = 1 a single row, T = 1024 many
// full tiles (the GPT-2 124M shape, B reduced to 2).
INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttentionTest,
                         ::testing::Values(AttentionCase{"hs16_t64", 2, 64, 64, 4, 1.0f},
                                           AttentionCase{"hs16_t37", 2, 37, 64, 4, 1.0f},
                                           AttentionCase{"hs32_t200", 2, 200, 64, 2, 1.0f},
                                           AttentionCase{"hs32_t1", 3, 1, 96, 3, 1.0f},
                                           AttentionCase{"hs64_t1", 2, 1, 128, 2, 1.0f},
                                           AttentionCase{"hs64_t37", 2, 37, 128, 2, 1.0f},
                                           AttentionCase{"hs64_t200", 2, 200, 128, 2, 1.0f},
                                           AttentionCase{"hs64_t200_large", 2, 200, 128, 2, 4.0f},
                                           AttentionCase{"hs128_t37", 1, 37, 256, 2, 1.0f},
                                           AttentionCase{"hs128_t200", 2, 200, 256, 2, 1.0f},
                                           AttentionCase{"hs128_t64_large", 2, 64, 256, 2, 4.0f},
                                           AttentionCase{"hs16_t200_large", 1, 200, 64, 4, 4.0f},
                                           AttentionCase{"gpt2_t1024", 2, 1024, 768, 12, 1.0f}),
                         [](const ::testing::TestParamInfo<AttentionCase>& test) {
                           return test.param.name;
                         });

// The kernels use no atomics (dQ and dK/dV are separate passes, each summing in a fixed order),
// so two runs on the same inputs agree bitwise; a difference means a race.
TEST(CudaAttention, Reproducible) {
  TESSERA_REQUIRE_GPU();
  for (const AttentionCase& c : {AttentionCase{"hs64_t200", 2, 200, 128, 2, 2.0f},
                                 AttentionCase{"hs128_t130", 2, 130, 256, 2, 2.0f}}) {
    const int64_t rows = c.batch * c.seq_len;
    const std::vector<float> qkv =
        RoundToBf16(RandomFloats(rows * 3 * c.channels, 5, -c.magnitude, c.magnitude));
    const std::vector<float> dout = RoundToBf16(RandomFloats(rows * c.channels, 7));
    GpuResults first, second;
    ASSERT_NO_FATAL_FAILURE(RunGpu(c, qkv, dout, &first));
    ASSERT_NO_FATAL_FAILURE(RunGpu(c, qkv, dout, &second));
    EXPECT_EQ(std::memcmp(first.out.data(), second.out.data(), first.out.size() * sizeof(bf16)), 0)
        << c;
    EXPECT_EQ(first.lse, second.lse) << c;
    EXPECT_EQ(std::memcmp(first.dqkv.data(), second.dqkv.data(), first.dqkv.size() * sizeof(bf16)),
              0)
        << c;
    // Bitwise equal could also mean the same elements left unwritten (poison) both times.
    EXPECT_TRUE(AllFinite(ToF32(first.out)) && AllFinite(first.lse) && AllFinite(ToF32(first.dqkv)))
        << c;
  }
}

// The launchers check shapes before touching the device, so this runs without a GPU.
TEST(CudaAttention, RejectsUnsupportedShapes) {
  struct Bad {
    int64_t batch, seq_len, channels, heads;
    const char* says;
  };
  for (const Bad& bad : {Bad{2, 16, 40, 2, "head size 20"}, Bad{2, 16, 512, 2, "head size 256"},
                         Bad{2, 16, 64, 3, "not a multiple"}, Bad{0, 16, 64, 4, "positive"},
                         Bad{2, 0, 64, 4, "positive"}, Bad{2, 16, 64, 0, "positive"}}) {
    const Status forward = cuda::AttentionForward(nullptr, nullptr, nullptr, bad.batch, bad.seq_len,
                                                  bad.channels, bad.heads, nullptr);
    EXPECT_EQ(forward.code(), StatusCode::kInvalidArgument) << forward.ToString();
    EXPECT_NE(forward.message().find(bad.says), std::string::npos) << forward.ToString();
    const Status backward =
        cuda::AttentionBackward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, bad.batch,
                                bad.seq_len, bad.channels, bad.heads, nullptr);
    EXPECT_EQ(backward.code(), StatusCode::kInvalidArgument) << backward.ToString();
    EXPECT_NE(backward.message().find(bad.says), std::string::npos) << backward.ToString();
  }
  const Status hs20 = cuda::AttentionForward(nullptr, nullptr, nullptr, 2, 16, 40, 2, nullptr);
  EXPECT_NE(hs20.message().find("16, 32, 64 or 128"), std::string::npos) << hs20.ToString();
}

}  // namespace
}  // namespace tessera

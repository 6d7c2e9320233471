// Token + position embedding: fp32 tables, bf16 output rows.
//
// Forward: one thread per 8 channels of a row (16-byte accesses when channels % 8 == 0 and the
// pointers are aligned; else one channel per thread). A token outside [0, vocab) zeroes its row
// and reports the smallest such row index through an atomic compare-and-swap on
// *bad_token_index.
//
// Backward: one thread per (position t, 8 channels), looping over the batch in order. dwpe[t] is
// read once, the batch's rows added in b order (the CPU's order, so dwpe matches it bitwise) and
// written once: deterministic, no atomics. dwte rows are shared between rows of equal tokens, so
// the same pass adds each row of dout into dwte with fp32 atomicAdd (16-byte vector atomics on
// Hopper): the order of those additions (and so dwte's last bits) may vary between runs, as
// kernels.h allows.
#include "ops/cuda/common.cuh"  // first: see there

#include <cuda_bf16.h>

#include "core/cuda_check.h"
#include "ops/cuda/kernels.h"

namespace tessera::cuda {
namespace {

constexpr int kBlock = 256;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kHasVectorAtomics = true;  // atomicAdd(float4*, float4)
#else
constexpr bool kHasVectorAtomics = false;
#endif

// ---- kernels ----

// *index = min(*index, row), where -1 means "none yet".
__device__ void RecordFirst(int32_t* index, int32_t row) {
  int32_t seen = *index;
  while (seen == -1 || seen > row) {
    const int32_t previous = atomicCAS(index, seen, row);
    if (previous == seen) break;
    seen = previous;
  }
}

template <int kWidth>
__global__ void __launch_bounds__(kBlock)
    EmbeddingForwardKernel(bf16* __restrict__ out, int32_t* bad_token_index,
                           const int32_t* __restrict__ tokens, const float* __restrict__ wte,
                           const float* __restrict__ wpe, int64_t rows, int64_t seq_len,
                           int64_t channels, int64_t vocab) {
  const int64_t groups_per_row = channels / kWidth;
  const int64_t total = rows * groups_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t row = i / groups_per_row;
    const int64_t c = (i - row * groups_per_row) * kWidth;
    const int32_t token = tokens[row];
    float v[kWidth];
    if (token < 0 || token >= vocab) {
#pragma unroll
      for (int j = 0; j < kWidth; ++j) v[j] = 0.0f;
      if (c == 0 && bad_token_index != nullptr) {
        RecordFirst(bad_token_index, static_cast<int32_t>(row));
      }
    } else {
      const float* token_row = wte + static_cast<int64_t>(token) * channels + c;
      const float* position_row = wpe + (row % seq_len) * channels + c;
      if constexpr (kWidth == 8) {
        float p[8];
        detail::LoadF32x8(token_row, v);
        detail::LoadF32x8(position_row, p);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] += p[j];
      } else {
        v[0] = token_row[0] + position_row[0];
      }
    }
    if constexpr (kWidth == 8) {
      detail::StoreBf16x8(out + row * channels + c, v);
    } else {
      out[row * channels + c] = __float2bfloat16_rn(v[0]);
    }
  }
}

template <int kWidth>
__global__ void __launch_bounds__(kBlock)
    EmbeddingBackwardKernel(float* dwte, float* __restrict__ dwpe, const bf16* __restrict__ dout,
                            const int32_t* __restrict__ tokens, int64_t batch, int64_t seq_len,
                            int64_t channels) {
  const int64_t groups_per_row = channels / kWidth;
  const int64_t total = seq_len * groups_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t t = i / groups_per_row;
    const int64_t c = (i - t * groups_per_row) * kWidth;
    float* position_row = dwpe + t * channels + c;
    float acc[kWidth];
    if constexpr (kWidth == 8) {
      detail::LoadF32x8(position_row, acc);
    } else {
      acc[0] = position_row[0];
    }
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t row = b * seq_len + t;
      float g[kWidth];
      if constexpr (kWidth == 8) {
        detail::LoadBf16x8(dout + row * channels + c, g);
      } else {
        g[0] = __bfloat162float(dout[row * channels + c]);
      }
      float* token_row = dwte + static_cast<int64_t>(tokens[row]) * channels + c;
#pragma unroll
      for (int j = 0; j < kWidth; ++j) acc[j] += g[j];
      if constexpr (kWidth == 8 && kHasVectorAtomics) {
        // Hopper's 16-byte atomic add: a quarter of the operations.
        atomicAdd(reinterpret_cast<float4*>(token_row), make_float4(g[0], g[1], g[2], g[3]));
        atomicAdd(reinterpret_cast<float4*>(token_row) + 1, make_float4(g[4], g[5], g[6], g[7]));
      } else {
#pragma unroll
        for (int j = 0; j < kWidth; ++j) atomicAdd(token_row + j, g[j]);
      }
    }
    if constexpr (kWidth == 8) {
      detail::StoreF32x8(position_row, acc);
    } else {
      position_row[0] = acc[0];
    }
  }
}

}  // namespace

// ---- launchers ----

Status EmbeddingForward(bf16* out, int32_t* bad_token_index, const int32_t* tokens,
                        const float* wte, const float* wpe, int64_t batch, int64_t seq_len,
                        int64_t channels, int64_t vocab, cudaStream_t stream) {
  if (batch < 0 || seq_len < 0 || channels < 0 || vocab < 0) {
    return InvalidArgument(
        "EmbeddingForward: batch = {}, seq_len = {}, channels = {} and vocab = {} must be >= 0",
        batch, seq_len, channels, vocab);
  }
  const int64_t rows = batch * seq_len;
  if (rows > INT32_MAX) {
    return InvalidArgument("EmbeddingForward: {} rows exceed the int32 bad_token_index", rows);
  }
  if (rows == 0 || channels == 0) return Status::Ok();
  if (channels % 8 == 0 && detail::IsAligned16(out) && detail::IsAligned16(wte) &&
      detail::IsAligned16(wpe)) {
    EmbeddingForwardKernel<8>
        <<<detail::GridSize(rows * (channels / 8), kBlock), kBlock, 0, stream>>>(
            out, bad_token_index, tokens, wte, wpe, rows, seq_len, channels, vocab);
  } else {
    EmbeddingForwardKernel<1><<<detail::GridSize(rows * channels, kBlock), kBlock, 0, stream>>>(
        out, bad_token_index, tokens, wte, wpe, rows, seq_len, channels, vocab);
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

Status EmbeddingBackward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens,
                         int64_t batch, int64_t seq_len, int64_t channels, cudaStream_t stream) {
  if (batch < 0 || seq_len < 0 || channels < 0) {
    return InvalidArgument(
        "EmbeddingBackward: batch = {}, seq_len = {} and channels = {} must be >= 0", batch,
        seq_len, channels);
  }
  if (batch == 0 || seq_len == 0 || channels == 0) return Status::Ok();
  if (channels % 8 == 0 && detail::IsAligned16(dwte) && detail::IsAligned16(dwpe) &&
      detail::IsAligned16(dout)) {
    EmbeddingBackwardKernel<8>
        <<<detail::GridSize(seq_len * (channels / 8), kBlock), kBlock, 0, stream>>>(
            dwte, dwpe, dout, tokens, batch, seq_len, channels);
  } else {
    EmbeddingBackwardKernel<1><<<detail::GridSize(seq_len * channels, kBlock), kBlock, 0, stream>>>(
        dwte, dwpe, dout, tokens, batch, seq_len, channels);
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tessera::cuda

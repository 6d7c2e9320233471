// Fused softmax + cross-entropy over the vocabulary (bf16 logits, fp32 math and losses), and the
// mean of a vector (the mean loss).
//
// SoftmaxCrossEntropy: one block per row. Pass 1 keeps, per thread, a running maximum and the sum
// of exponentials relative to it (rescaled whenever the maximum grows, once per 8 logits), then
// the block combines the threads' (max, sum) pairs in a fixed shuffle tree. Pass 2 rewrites the
// row in place as the gradient; it re-reads the logits, which a row-sized block leaves in L2.
// Every thread walks the row in 16-byte steps when padded_vocab % 8 == 0 and the logits are
// aligned (columns past vocab are masked), else one column at a time.
//
// Mean: one block, fp64 accumulation in a fixed order (per-thread strided sums, then the block
// tree), rounded once to fp32 like the CPU's mean loss.
#include "ops/cuda/common.cuh"  // first: see there

#include <cmath>

#include <cuda_bf16.h>

#include "core/cuda_check.h"
#include "ops/cuda/kernels.h"

namespace tessera::cuda {
namespace {

constexpr int kBlock = 512;
constexpr int kMeanBlock = 1024;
// Column indices are int; a thread's last step may run kBlock * 8 past padded_vocab.
constexpr int64_t kMaxPaddedVocab = INT32_MAX - kBlock * 8;

// ---- kernels ----

// A running softmax denominator: sum is the sum of exp(x - max) over the values seen.
struct MaxSum {
  float max;
  float sum;
};

// Merges two partial denominators. Symmetric bit for bit (IEEE + and * commute), so both lanes
// of a shuffle pair hold the same result.
__device__ __forceinline__ MaxSum Combine(MaxSum a, MaxSum b) {
  const float max = fmaxf(a.max, b.max);
  if (max == -INFINITY) return {max, 0.0f};  // both empty
  return {max, a.sum * expf(a.max - max) + b.sum * expf(b.max - max)};
}

__device__ __forceinline__ MaxSum WarpCombine(MaxSum v) {
#pragma unroll
  for (int offset = detail::kWarpSize / 2; offset > 0; offset /= 2) {
    const MaxSum other{__shfl_xor_sync(detail::kFullMask, v.max, offset),
                       __shfl_xor_sync(detail::kFullMask, v.sum, offset)};
    v = Combine(v, other);
  }
  return v;
}

// The block's combined (max, sum), returned to every thread. Synchronises the block.
__device__ MaxSum BlockCombine(MaxSum v) {
  __shared__ MaxSum warp_results[detail::kWarpSize];
  const int lane = threadIdx.x % detail::kWarpSize;
  const int warp = threadIdx.x / detail::kWarpSize;
  v = WarpCombine(v);
  if (lane == 0) warp_results[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / detail::kWarpSize) ? warp_results[lane]
                                                              : MaxSum{-INFINITY, 0.0f};
  return WarpCombine(v);
}

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
__device__ __forceinline__ void LoadLogits(const bf16* p, float (&v)[kWidth]) {
  if constexpr (kWidth == 8) {
    detail::LoadBf16x8(p, v);
  } else {
    v[0] = __bfloat162float(*p);
  }
}

// kWidth 8 REQUIRES padded_vocab % 8 == 0 and 16-byte aligned logits, so that every 8-column
// group that starts below vocab lies inside the padded row. Columns are int: the launcher bounds
// padded_vocab well below 2^31.
template <int kWidth>
__global__ void __launch_bounds__(kBlock)
    SoftmaxCrossEntropyKernel(bf16* logits, float* __restrict__ losses, int32_t* bad_target_index,
                              const int32_t* __restrict__ targets, int vocab, int padded_vocab,
                              float row_scale, bool write_gradient) {
  constexpr int kStep = kBlock * kWidth;
  const int64_t row = blockIdx.x;
  bf16* l = logits + row * padded_vocab;
  const int32_t target = targets[row];
  const bool bad_target = target < 0 || target >= vocab;
  // Read before BlockCombine's barrier, so before any thread overwrites the row.
  const float target_logit = threadIdx.x == 0 && !bad_target ? __bfloat162float(l[target]) : 0.0f;

  // exp via __expf (ex2.approx): its arguments are <= 0 here, where it is within a few ulps for
  // the terms that matter (those near the maximum); far below it, the terms vanish in the sum.
  MaxSum acc{-INFINITY, 0.0f};
  for (int c = threadIdx.x * kWidth; c < vocab; c += kStep) {
    float v[kWidth];
    LoadLogits<kWidth>(l + c, v);
    if (c + kWidth > vocab) {  // the last group: columns past vocab add exp(-inf) = 0
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        if (c + j >= vocab) v[j] = -INFINITY;
      }
    }
    float group_max = v[0];
#pragma unroll
    for (int j = 1; j < kWidth; ++j) group_max = fmaxf(group_max, v[j]);
    if (group_max > acc.max) {
      acc.sum *= __expf(acc.max - group_max);  // exp(-inf) = 0 on the first group
      acc.max = group_max;
    }
#pragma unroll
    for (int j = 0; j < kWidth; ++j) acc.sum += __expf(v[j] - acc.max);
  }
  const MaxSum total = BlockCombine(acc);

  if (threadIdx.x == 0) {
    if (bad_target) {
      losses[row] = NAN;
      if (bad_target_index != nullptr) RecordFirst(bad_target_index, static_cast<int32_t>(row));
    } else {
      losses[row] = total.max + logf(total.sum) - target_logit;
    }
  }
  if (!write_gradient) return;

  // (softmax - onehot) * row_scale, as the CPU: exp(x - max) * (row_scale / sum), then the
  // target's row_scale subtracted (unfused, so rounded as there). A bad target subtracts nothing.
  const float scale = row_scale / total.sum;
  for (int c = threadIdx.x * kWidth; c < padded_vocab; c += kStep) {
    float v[kWidth];
    if (c < vocab) {
      LoadLogits<kWidth>(l + c, v);
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        const float p = __fmul_rn(__expf(v[j] - total.max), scale);
        v[j] = c + j == target ? p - row_scale : p;
      }
      if (c + kWidth > vocab) {
#pragma unroll
        for (int j = 0; j < kWidth; ++j) {
          if (c + j >= vocab) v[j] = 0.0f;
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kWidth; ++j) v[j] = 0.0f;
    }
    if constexpr (kWidth == 8) {
      detail::StoreBf16x8(l + c, v);
    } else {
      l[c] = __float2bfloat16_rn(v[0]);
    }
  }
}

__global__ void __launch_bounds__(kMeanBlock) MeanKernel(float* out, const float* x, int64_t n) {
  __shared__ double warp_sums[detail::kWarpSize];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += static_cast<double>(x[i]);
  sum = detail::BlockSum(sum, warp_sums);
  if (threadIdx.x == 0) *out = n > 0 ? static_cast<float>(sum / static_cast<double>(n)) : 0.0f;
}

}  // namespace

// ---- launchers ----

Status SoftmaxCrossEntropy(bf16* logits, float* losses, int32_t* bad_target_index,
                           const int32_t* targets, int64_t rows, int64_t vocab,
                           int64_t padded_vocab, float grad_scale, bool write_gradient,
                           cudaStream_t stream) {
  if (rows < 0 || rows > INT32_MAX || vocab <= 0 || padded_vocab < vocab ||
      padded_vocab > kMaxPaddedVocab) {
    return InvalidArgument(
        "SoftmaxCrossEntropy: rows = {} must be in [0, 2^31), vocab = {} >= 1 and padded_vocab = "
        "{} in [vocab, {}]",
        rows, vocab, padded_vocab, kMaxPaddedVocab);
  }
  if (rows == 0) return Status::Ok();
  const float row_scale = grad_scale / static_cast<float>(rows);
  const unsigned grid = static_cast<unsigned>(rows);
  if (padded_vocab % 8 == 0 && detail::IsAligned16(logits)) {
    SoftmaxCrossEntropyKernel<8><<<grid, kBlock, 0, stream>>>(
        logits, losses, bad_target_index, targets, static_cast<int>(vocab),
        static_cast<int>(padded_vocab), row_scale, write_gradient);
  } else {
    SoftmaxCrossEntropyKernel<1><<<grid, kBlock, 0, stream>>>(
        logits, losses, bad_target_index, targets, static_cast<int>(vocab),
        static_cast<int>(padded_vocab), row_scale, write_gradient);
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

Status Mean(float* out, const float* x, int64_t n, cudaStream_t stream) {
  if (n < 0) return InvalidArgument("Mean: n = {} must be >= 0", n);
  MeanKernel<<<1, kMeanBlock, 0, stream>>>(out, x, n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tessera::cuda

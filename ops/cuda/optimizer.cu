// Optimizer kernels over flat fp32 parameter groups: the fused AdamW update, the sum of squares
// of a gradient (for the global norm) and the clipping factor from several such sums.
//
// AdamWUpdate reproduces cpu::AdamWUpdate element for element: the per-step scalars are computed
// in double from the device's lr and step and rounded to float once (as there), and each element
// takes the CPU's vector-path operations in the same order, with the same fused multiply-adds
// (fmaf) and no others, and IEEE division and square root. Four elements per thread (16-byte
// accesses when every pointer is aligned); an element's decay comes from a binary search of the
// sorted decay ranges.
//
// SumOfSquares is deterministic: fixed chunks of kChunk elements, one block each, summed in fp32
// in a fixed order (per-thread strided sums, then the block tree) into a partial per block; one
// block then adds the partials in double, in a fixed order. ClipScale adds its sums in double in
// a fixed tree order and applies cpu::ClipScale's formula in double.
#include "ops/cuda/common.cuh"  // first: see there

#include <algorithm>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "ops/cuda/kernels.h"

namespace tessera::cuda {
namespace {

constexpr int kAdamBlock = 256;
constexpr int64_t kAdamMaxBlocks = 4096;  // threads loop beyond; amortises the scalars' pow()
constexpr int kSumBlock = 256;
constexpr int64_t kChunk = int64_t{kSumBlock} * 32;  // elements per partial (a multiple of 4)
constexpr int kClipBlock = kMaxClipInputs;           // one thread per input

// The per-step scalars of cpu::AdamWUpdate, rounded to float once.
struct AdamWScalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float neg_step_size, bias_correction2_sqrt, grad_scale, decay_factor;
};

// The device pointers to ClipScale's scalars, passed by value.
struct ClipInputs {
  const float* sums[kMaxClipInputs];
};

// ---- kernels ----

__device__ AdamWScalars ComputeScalars(const AdamWConfig& config, const float* lr_ptr,
                                       const int64_t* step_ptr, const float* grad_scale_ptr) {
  const float lr = *lr_ptr;
  const double step = static_cast<double>(*step_ptr);
  const double bias_correction1 = 1.0 - pow(static_cast<double>(config.beta1), step);
  const double bias_correction2 = 1.0 - pow(static_cast<double>(config.beta2), step);
  AdamWScalars s;
  s.beta1 = config.beta1;
  s.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(config.beta1));
  s.beta2 = config.beta2;
  s.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(config.beta2));
  s.eps = config.eps;
  s.neg_step_size = static_cast<float>(-(static_cast<double>(lr) / bias_correction1));
  s.bias_correction2_sqrt = static_cast<float>(sqrt(bias_correction2));
  s.grad_scale = grad_scale_ptr != nullptr ? *grad_scale_ptr : 1.0f;
  s.decay_factor =
      static_cast<float>(1.0 - static_cast<double>(lr) * static_cast<double>(config.weight_decay));
  return s;
}

// The decay factor of group element `index` (element_offset already added): decay_factor inside
// a range, else 1. REQUIRES: ranges sorted and disjoint (the launcher checks).
__device__ __forceinline__ float DecayAt(const DecayRanges& decay, int64_t index,
                                         float decay_factor) {
  // The number of ranges that begin at or before index.
  int lo = 0;
  int hi = decay.count;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (decay.begin[mid] <= index) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo > 0 && index < decay.end[lo - 1] ? decay_factor : 1.0f;
}

// cpu::AdamWUpdate's vector-path arithmetic for one element (see ops/cpu/optimizer.cc).
__device__ __forceinline__ void AdamWElement(const AdamWScalars& s, float decay, float& param,
                                             float& m, float& v, float grad) {
  const float g = __fmul_rn(grad, s.grad_scale);
  const float m_new = fmaf(m, s.beta1, __fmul_rn(s.one_minus_beta1, g));
  const float v_new = fmaf(v, s.beta2, __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v_new), s.bias_correction2_sqrt), s.eps);
  const float step = __fdiv_rn(__fmul_rn(s.neg_step_size, m_new), denom);
  m = m_new;
  v = v_new;
  param = fmaf(param, decay, step);
}

// kVector: elements [4k, 4k + 4) per thread and step with float4 accesses, then the tail of at
// most 3 elements one per thread; else one element per thread and step.
template <bool kVector>
__global__ void __launch_bounds__(kAdamBlock)
    AdamWKernel(float* __restrict__ param, float* __restrict__ m, float* __restrict__ v,
                const float* __restrict__ grad, int64_t n, AdamWConfig config, const float* lr,
                const int64_t* step, const float* grad_scale, DecayRanges decay,
                int64_t element_offset) {
  const AdamWScalars s = ComputeScalars(config, lr, step, grad_scale);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t scalar_begin = 0;
  if constexpr (kVector) {
    const int64_t vectors = n / 4;
    for (int64_t k = thread; k < vectors; k += stride) {
      const int64_t i = 4 * k;
      float4 p = reinterpret_cast<float4*>(param)[k];
      float4 mm = reinterpret_cast<float4*>(m)[k];
      float4 vv = reinterpret_cast<float4*>(v)[k];
      const float4 g = reinterpret_cast<const float4*>(grad)[k];
      const int64_t index = element_offset + i;
      AdamWElement(s, DecayAt(decay, index, s.decay_factor), p.x, mm.x, vv.x, g.x);
      AdamWElement(s, DecayAt(decay, index + 1, s.decay_factor), p.y, mm.y, vv.y, g.y);
      AdamWElement(s, DecayAt(decay, index + 2, s.decay_factor), p.z, mm.z, vv.z, g.z);
      AdamWElement(s, DecayAt(decay, index + 3, s.decay_factor), p.w, mm.w, vv.w, g.w);
      reinterpret_cast<float4*>(param)[k] = p;
      reinterpret_cast<float4*>(m)[k] = mm;
      reinterpret_cast<float4*>(v)[k] = vv;
    }
    scalar_begin = vectors * 4;
    const int64_t i = scalar_begin + thread;  // the tail: at most 3 elements
    if (i < n) {
      AdamWElement(s, DecayAt(decay, element_offset + i, s.decay_factor), param[i], m[i], v[i],
                   grad[i]);
    }
  } else {
    for (int64_t i = thread; i < n; i += stride) {
      AdamWElement(s, DecayAt(decay, element_offset + i, s.decay_factor), param[i], m[i], v[i],
                   grad[i]);
    }
  }
}

// Block b sums the squares of [b * kChunk, min(n, (b + 1) * kChunk)) into partials[b].
template <bool kVector>
__global__ void __launch_bounds__(kSumBlock)
    SumOfSquaresPartialKernel(float* __restrict__ partials, const float* __restrict__ x,
                              int64_t n) {
  __shared__ float warp_sums[detail::kWarpSize];
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = min(n, begin + kChunk);
  float sum = 0.0f;
  int64_t scalar_begin = begin;
  if constexpr (kVector) {
    const int64_t vector_end = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + 4 * threadIdx.x; i < vector_end; i += 4 * kSumBlock) {
      const float4 value = *reinterpret_cast<const float4*>(x + i);
      sum += value.x * value.x;
      sum += value.y * value.y;
      sum += value.z * value.z;
      sum += value.w * value.w;
    }
    scalar_begin = vector_end;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < end; i += kSumBlock) sum += x[i] * x[i];
  sum = detail::BlockSum(sum, warp_sums);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__global__ void __launch_bounds__(kSumBlock)
    SumPartialsKernel(float* out, const float* __restrict__ partials, int64_t count) {
  __shared__ double warp_sums[detail::kWarpSize];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kSumBlock) sum += static_cast<double>(partials[i]);
  sum = detail::BlockSum(sum, warp_sums);
  if (threadIdx.x == 0) *out = static_cast<float>(sum);
}

__global__ void __launch_bounds__(kClipBlock)
    ClipScaleKernel(float* scale, float* norm, ClipInputs inputs, int count, float max_norm) {
  __shared__ double warp_sums[detail::kWarpSize];
  const double value =
      static_cast<int>(threadIdx.x) < count ? static_cast<double>(*inputs.sums[threadIdx.x]) : 0.0;
  const double total = detail::BlockSum(value, warp_sums);
  if (threadIdx.x == 0) {
    const double n = sqrt(total);
    const double max = static_cast<double>(max_norm);
    *norm = static_cast<float>(n);
    *scale = max <= 0.0 ? 1.0f : static_cast<float>(fmin(1.0, max / (n + 1e-6)));
  }
}

}  // namespace

// ---- launchers ----

Status AdamWUpdate(float* param, float* m, float* v, const float* grad, int64_t n,
                   const AdamWConfig& config, const float* lr, const int64_t* step,
                   const float* grad_scale, const DecayRanges& decay, int64_t element_offset,
                   cudaStream_t stream) {
  if (n < 0 || element_offset < 0) {
    return InvalidArgument("AdamWUpdate: n = {} and element_offset = {} must be >= 0", n,
                           element_offset);
  }
  if (decay.count < 0 || decay.count > kMaxDecayRanges) {
    return InvalidArgument("AdamWUpdate: {} decay ranges, at most {} are supported", decay.count,
                           kMaxDecayRanges);
  }
  for (int r = 0; r < decay.count; ++r) {
    if (decay.begin[r] > decay.end[r] || (r > 0 && decay.begin[r] < decay.end[r - 1])) {
      return InvalidArgument(
          "AdamWUpdate: decay range {} [{}, {}) is not sorted after, and disjoint from, the "
          "one before it",
          r, decay.begin[r], decay.end[r]);
    }
  }
  if (n == 0) return Status::Ok();
  const bool vector = detail::IsAligned16(param) && detail::IsAligned16(m) &&
                      detail::IsAligned16(v) && detail::IsAligned16(grad);
  const int64_t items = vector ? detail::CeilDiv(n, 4) : n;
  const unsigned grid =
      static_cast<unsigned>(std::min(kAdamMaxBlocks, detail::CeilDiv(items, kAdamBlock)));
  if (vector) {
    AdamWKernel<true><<<grid, kAdamBlock, 0, stream>>>(param, m, v, grad, n, config, lr, step,
                                                       grad_scale, decay, element_offset);
  } else {
    AdamWKernel<false><<<grid, kAdamBlock, 0, stream>>>(param, m, v, grad, n, config, lr, step,
                                                        grad_scale, decay, element_offset);
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

int64_t SumOfSquaresScratch(int64_t n) {
  return n <= 0 ? 0 : detail::CeilDiv(n, kChunk) * static_cast<int64_t>(sizeof(float));
}

Status SumOfSquares(float* out, void* scratch, const float* x, int64_t n, cudaStream_t stream) {
  if (n < 0) return InvalidArgument("SumOfSquares: n = {} must be >= 0", n);
  const int64_t blocks = n == 0 ? 0 : detail::CeilDiv(n, kChunk);
  if (blocks > INT32_MAX) {
    return InvalidArgument("SumOfSquares: n = {} exceeds {} (split the call)", n,
                           INT32_MAX * kChunk);
  }
  float* partials = static_cast<float*>(scratch);
  if (blocks > 0) {
    if (detail::IsAligned16(x)) {
      SumOfSquaresPartialKernel<true>
          <<<static_cast<unsigned>(blocks), kSumBlock, 0, stream>>>(partials, x, n);
    } else {
      SumOfSquaresPartialKernel<false>
          <<<static_cast<unsigned>(blocks), kSumBlock, 0, stream>>>(partials, x, n);
    }
    TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  SumPartialsKernel<<<1, kSumBlock, 0, stream>>>(out, partials, blocks);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

Status ClipScale(float* scale, float* norm, const float* const* sums, int count, float max_norm,
                 cudaStream_t stream) {
  if (count < 0 || count > kMaxClipInputs) {
    return InvalidArgument("ClipScale: {} sums, at most {} are supported", count, kMaxClipInputs);
  }
  ClipInputs inputs{};
  for (int i = 0; i < count; ++i) inputs.sums[i] = sums[i];
  ClipScaleKernel<<<1, kClipBlock, 0, stream>>>(scale, norm, inputs, count, max_norm);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tessera::cuda

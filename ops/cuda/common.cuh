// Device helpers shared by the memory-bound kernels of ops/cuda (casts, embedding, layernorm,
// elementwise, classifier, optimizer, the volume ops, the scalars): warp and block reductions,
// one element of f32 or bf16 read as float and stored rounded, 16-byte vector access to bf16
// and fp32 rows, an elementwise "map" launcher with a vector body and a scalar fallback, and the
// fixed-order reduction of per-block column partials.
//
// Determinism: every reduction here combines values in an order fixed by the launch shape
// (shuffle trees, warps in index order, partials in index order), never by timing, so a kernel
// built on them returns bitwise the same result for the same inputs and sizes.
//
// Include from .cu files only (internal to ops/cuda), before any other header.
#pragma once

// fmt 9 turns its constexpr off under nvcc (FMT_USE_CONSTEXPR 0), yet its C++20 consteval
// format-string check and constexpr functions still call those helpers, so Tessera's Status
// factories (core/status.h, core/cuda_check.h) do not compile in a .cu. nvcc 13's front end and
// host compiler handle fmt's constexpr code: turn it back on. Must precede the first fmt include.
#if defined(__CUDACC__) && !defined(FMT_USE_CONSTEXPR)
#define FMT_USE_CONSTEXPR 1
#endif

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace tessera::cuda::detail {

inline constexpr int kWarpSize = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;
// Grid-stride kernels are launched with at most this many blocks (enough to fill any current
// GPU many times over; each thread then loops).
inline constexpr int64_t kMaxGridBlocks = int64_t{1} << 20;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for `items` work items of `block` threads each, at least 1, at most kMaxGridBlocks.
inline unsigned GridSize(int64_t items, int block) {
  int64_t blocks = CeilDiv(items, block);
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxGridBlocks) blocks = kMaxGridBlocks;
  return static_cast<unsigned>(blocks);
}

inline bool IsAligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// ---- reductions ----

template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

// Sum over the block, returned to every thread. REQUIRES: blockDim.x a multiple of 32 (at most
// 1024), blockDim.y == blockDim.z == 1, every thread of the block calls it (it synchronises);
// `warp_sums` is __shared__ storage for 32 values, which may be reused after the call returns.
template <typename T>
__device__ T BlockSum(T v, T* warp_sums) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  v = WarpSum(v);
  __syncthreads();  // an earlier call's readers are done with warp_sums
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = lane < warps ? warp_sums[lane] : T(0);
  return WarpSum(v);  // each warp sums the same values in the same order
}

// ---- one element of f32 or bf16, read as float and stored rounded (nearest even) ----

__device__ __forceinline__ float Load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float Load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void Store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void Store(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

// ---- 16-byte vector access ----

// 8 bf16 at p (16-byte aligned) as floats.
__device__ __forceinline__ void LoadBf16x8(const __nv_bfloat16* p, float (&out)[8]) {
  const int4 raw = *reinterpret_cast<const int4*>(p);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// Rounds 8 floats to bf16 (nearest even) and stores them at p (16-byte aligned).
__device__ __forceinline__ void StoreBf16x8(__nv_bfloat16* p, const float (&in)[8]) {
  int4 raw;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  *reinterpret_cast<int4*>(p) = raw;
}

// 8 floats at p (16-byte aligned), as two 16-byte accesses.
__device__ __forceinline__ void LoadF32x8(const float* p, float (&out)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

__device__ __forceinline__ void StoreF32x8(float* p, const float (&in)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
}

// ---- elementwise map ----
// An Op is a small struct of pointers with two device members:
//   Vector(i): elements [i, i + 8), i a multiple of 8 (every pointer 16-byte aligned there);
//   Scalar(i): element i.
// Each element is handled by exactly one thread, which reads its inputs before writing its
// output, so an output may alias an input of the same element.

// Vector body over [0, n / 8 * 8), then the tail of at most 7 elements, one per thread.
template <typename Op>
__global__ void MapVectorKernel(Op op, int64_t n) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t vectors = n / 8;
  for (int64_t v = thread; v < vectors; v += stride) op.Vector(v * 8);
  const int64_t tail = vectors * 8 + thread;  // the grid has at least 8 threads
  if (tail < n) op.Scalar(tail);
}

template <typename Op>
__global__ void MapScalarKernel(Op op, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    op.Scalar(i);
  }
}

inline constexpr int kMapBlock = 256;

// Launches op over [0, n) (n > 0): the vector kernel when `vectorizable` (every pointer of op
// 16-byte aligned), else the scalar one. The caller checks the launch.
template <typename Op>
void LaunchMap(const Op& op, int64_t n, bool vectorizable, cudaStream_t stream) {
  if (vectorizable) {
    MapVectorKernel<<<GridSize(CeilDiv(n, 8), kMapBlock), kMapBlock, 0, stream>>>(op, n);
  } else {
    MapScalarKernel<<<GridSize(n, kMapBlock), kMapBlock, 0, stream>>>(op, n);
  }
}

// ---- fixed-order reduction of column partials ----
// Up to two independent jobs (blockIdx.y picks one): out[c] (+)= sum over k in index order of
// partials[k * cols + c], c in [0, cols).
struct ColumnPartials {
  float* out[2];
  const float* partials[2];
};

inline constexpr int kPartialRowThreads = 32;  // block (32, 32): 32 columns, 32 partial rows

// Thread (x, y) sums partial rows y, y + 32, ... of column blockIdx.x * 32 + x in order; row 0 of
// the block then adds the 32 results in order.
template <int kRowThreads>
__global__ void __launch_bounds__(kWarpSize* kRowThreads)
    SumColumnPartialsKernel(ColumnPartials job, int64_t num_partials, int64_t cols,
                            bool accumulate) {
  __shared__ float sums[kRowThreads][kWarpSize + 1];
  // Selected without indexing the parameter by a run-time value (that copies it to the stack).
  const bool second = blockIdx.y != 0;
  const float* __restrict__ partials = second ? job.partials[1] : job.partials[0];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarpSize + threadIdx.x;
  float sum = 0.0f;
  if (c < cols) {
#pragma unroll 8
    for (int64_t k = threadIdx.y; k < num_partials; k += kRowThreads) sum += partials[k * cols + c];
  }
  sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
#pragma unroll
    for (int y = 0; y < kRowThreads; ++y) total += sums[y][threadIdx.x];
    float* out = second ? job.out[1] : job.out[0];
    out[c] = accumulate ? out[c] + total : total;
  }
}

// Launches the reduction for `jobs` (1 or 2) jobs; the caller checks the launch. With
// num_partials == 0 it writes zeros (or leaves out as it is when accumulating).
// REQUIRES: cols > 0. (A template only so that files not using it do not compile its kernel.)
template <int kRowThreads = kPartialRowThreads>
void LaunchSumColumnPartials(const ColumnPartials& job, int jobs, int64_t num_partials,
                             int64_t cols, bool accumulate, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(CeilDiv(cols, kWarpSize)), static_cast<unsigned>(jobs));
  const dim3 block(kWarpSize, kRowThreads);
  SumColumnPartialsKernel<kRowThreads>
      <<<grid, block, 0, stream>>>(job, num_partials, cols, accumulate);
}

}  // namespace tessera::cuda::detail

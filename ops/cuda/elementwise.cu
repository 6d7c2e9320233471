// Elementwise bf16 arithmetic (residual add, GELU and its derivative) and column sums of a bf16
// matrix (the bias gradients of linear layers).
//
// Elementwise kernels take 8 elements (16 bytes) per thread when every pointer is 16-byte aligned,
// else one; either way each element's result is the CPU's fp32 arithmetic rounded once to bf16.
//
// SumRows is deterministic: the rows are cut into fixed chunks of kSumRowsChunk; a block sums
// one chunk of one column tile (each thread a fixed subset of rows, then the block's row lanes in
// order) into a partial row of scratch; a second kernel adds the partial rows in chunk order.
#include "ops/cuda/common.cuh"  // first: see there

#include <cuda_bf16.h>

#include "core/cuda_check.h"
#include "ops/cuda/kernels.h"

namespace tessera::cuda {
namespace {

// sqrt(2/pi) and the cubic coefficient of GELU's tanh approximation (as ops/cpu/elementwise.cc).
constexpr float kGeluBeta = 0.7978845608028654f;
constexpr float kGeluKappa = 0.044715f;

constexpr int64_t kSumRowsChunk = 128;  // rows per partial sum
constexpr int kSumRowsLanes = 8;        // row lanes (warps) per block

// ---- kernels ----

__device__ __forceinline__ float Gelu(float v) {
  const float inner = kGeluBeta * (v + kGeluKappa * v * v * v);
  return 0.5f * v * (1.0f + tanhf(inner));
}

__device__ __forceinline__ float GeluGrad(float dout, float v) {
  const float v2 = v * v;
  const float tanh_inner = tanhf(kGeluBeta * (v + kGeluKappa * v2 * v));
  const float left = 0.5f * (1.0f + tanh_inner);
  const float right =
      0.5f * v * (1.0f - tanh_inner * tanh_inner) * kGeluBeta * (1.0f + 3.0f * kGeluKappa * v2);
  return dout * (left + right);
}

struct AddOp {
  bf16* out;
  const bf16* a;
  const bf16* b;
  __device__ void Vector(int64_t i) const {
    float x[8], y[8];
    detail::LoadBf16x8(a + i, x);
    detail::LoadBf16x8(b + i, y);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] += y[j];
    detail::StoreBf16x8(out + i, x);
  }
  __device__ void Scalar(int64_t i) const {
    out[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
  }
};

struct GeluForwardOp {
  bf16* out;
  const bf16* x;
  __device__ void Vector(int64_t i) const {
    float v[8];
    detail::LoadBf16x8(x + i, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = Gelu(v[j]);
    detail::StoreBf16x8(out + i, v);
  }
  __device__ void Scalar(int64_t i) const {
    out[i] = __float2bfloat16_rn(Gelu(__bfloat162float(x[i])));
  }
};

struct GeluBackwardOp {
  bf16* dx;
  const bf16* dout;
  const bf16* x;
  __device__ void Vector(int64_t i) const {
    float g[8], v[8];
    detail::LoadBf16x8(dout + i, g);
    detail::LoadBf16x8(x + i, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = GeluGrad(g[j], v[j]);
    detail::StoreBf16x8(dx + i, g);
  }
  __device__ void Scalar(int64_t i) const {
    dx[i] = __float2bfloat16_rn(GeluGrad(__bfloat162float(dout[i]), __bfloat162float(x[i])));
  }
};

// Block (32, kSumRowsLanes), grid (column tiles, row chunks). A tile is 32 * kWidth columns:
// thread x owns columns [x * kWidth, (x + 1) * kWidth) of it (kWidth 8: one 16-byte load per
// row) and sums rows y, y + kSumRowsLanes, ... of the chunk; the lanes are then added in order.
// partials[chunk * cols + c] receives the chunk's sum of column c.
template <int kWidth>
__global__ void __launch_bounds__(detail::kWarpSize* kSumRowsLanes)
    SumRowsPartialKernel(float* __restrict__ partials, const bf16* __restrict__ x, int64_t rows,
                         int64_t cols) {
  constexpr int kTile = detail::kWarpSize * kWidth;
  __shared__ float lane_sums[kSumRowsLanes][kTile];
  const int64_t tile_begin = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t c = tile_begin + threadIdx.x * kWidth;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * kSumRowsChunk;
  const int64_t row_end = min(rows, row_begin + kSumRowsChunk);
  float sum[kWidth];
#pragma unroll
  for (int j = 0; j < kWidth; ++j) sum[j] = 0.0f;
  if (c < cols) {  // kWidth 8 only with cols % 8 == 0: the whole vector is inside
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kSumRowsLanes) {
      if constexpr (kWidth == 8) {
        float v[8];
        detail::LoadBf16x8(x + r * cols + c, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) sum[j] += v[j];
      } else {
        sum[0] += __bfloat162float(x[r * cols + c]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kWidth; ++j) lane_sums[threadIdx.y][threadIdx.x * kWidth + j] = sum[j];
  __syncthreads();
  const int thread = threadIdx.y * detail::kWarpSize + threadIdx.x;
  for (int t = thread; t < kTile; t += detail::kWarpSize * kSumRowsLanes) {
    if (tile_begin + t >= cols) break;
    float total = 0.0f;
#pragma unroll
    for (int y = 0; y < kSumRowsLanes; ++y) total += lane_sums[y][t];
    partials[static_cast<int64_t>(blockIdx.y) * cols + tile_begin + t] = total;
  }
}

}  // namespace

// ---- launchers ----

Status Add(bf16* out, const bf16* a, const bf16* b, int64_t n, cudaStream_t stream) {
  if (n < 0) return InvalidArgument("Add: n = {} must be >= 0", n);
  if (n == 0) return Status::Ok();
  const bool vector = detail::IsAligned16(out) && detail::IsAligned16(a) && detail::IsAligned16(b);
  detail::LaunchMap(AddOp{out, a, b}, n, vector, stream);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

Status GeluForward(bf16* out, const bf16* x, int64_t n, cudaStream_t stream) {
  if (n < 0) return InvalidArgument("GeluForward: n = {} must be >= 0", n);
  if (n == 0) return Status::Ok();
  detail::LaunchMap(GeluForwardOp{out, x}, n, detail::IsAligned16(out) && detail::IsAligned16(x),
                    stream);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

Status GeluBackward(bf16* dx, const bf16* dout, const bf16* x, int64_t n, cudaStream_t stream) {
  if (n < 0) return InvalidArgument("GeluBackward: n = {} must be >= 0", n);
  if (n == 0) return Status::Ok();
  const bool vector =
      detail::IsAligned16(dx) && detail::IsAligned16(dout) && detail::IsAligned16(x);
  detail::LaunchMap(GeluBackwardOp{dx, dout, x}, n, vector, stream);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

int64_t SumRowsScratch(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return 0;
  return detail::CeilDiv(rows, kSumRowsChunk) * cols;
}

Status SumRows(float* out, float* scratch, const bf16* x, int64_t rows, int64_t cols,
               bool accumulate, cudaStream_t stream) {
  if (rows < 0 || cols < 0) {
    return InvalidArgument("SumRows: rows = {} and cols = {} must be >= 0", rows, cols);
  }
  if (cols == 0) return Status::Ok();
  const int64_t chunks = rows == 0 ? 0 : detail::CeilDiv(rows, kSumRowsChunk);
  if (chunks > 65535) {
    return InvalidArgument("SumRows: rows = {} exceeds {} (split the call)", rows,
                           65535 * kSumRowsChunk);
  }
  if (chunks > 0) {
    const dim3 block(detail::kWarpSize, kSumRowsLanes);
    if (cols % 8 == 0 && detail::IsAligned16(x)) {
      const dim3 grid(static_cast<unsigned>(detail::CeilDiv(cols, detail::kWarpSize * 8)),
                      static_cast<unsigned>(chunks));
      SumRowsPartialKernel<8><<<grid, block, 0, stream>>>(scratch, x, rows, cols);
    } else {
      const dim3 grid(static_cast<unsigned>(detail::CeilDiv(cols, detail::kWarpSize)),
                      static_cast<unsigned>(chunks));
      SumRowsPartialKernel<1><<<grid, block, 0, stream>>>(scratch, x, rows, cols);
    }
    TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  detail::LaunchSumColumnPartials({{out, nullptr}, {scratch, nullptr}}, 1, chunks, cols, accumulate,
                                  stream);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tessera::cuda

// LayerNorm over the last dimension (eps 1e-5, biased variance, as ops/cpu/layernorm.cc):
// bf16 rows in and out, fp32 statistics, parameters and parameter gradients.
//
// Forward: one warp per row, three passes over the row (sum, squared deviations, output): over
// registers when the row fits them (C <= 1024 on the vector path), else over memory (the second
// and third passes re-read the row from L1), so a row of any length needs no shared memory.
//
// Backward: one warp per row for dx (the two row means of the CPU's formula, then dx). The weight
// and bias gradients are sums over rows, made deterministic without atomics: each block owns
// kBackwardRows consecutive rows; each of its warps accumulates its rows' contributions in its own
// shared-memory row (a column belongs to one lane, so no two threads touch one address); at the
// end the block adds its warps in order into a partial row of scratch, and a second kernel adds
// the partial rows in block order. The result depends only on rows and channels.
#include "ops/cuda/common.cuh"  // first: see there

#include <cuda_bf16.h>

#include "core/cuda_check.h"
#include "ops/cuda/kernels.h"

namespace tessera::cuda {
namespace {

constexpr float kEps = 1e-5f;
constexpr int kForwardWarps = 8;  // rows per forward block
constexpr int kForwardCachedSteps =
    4;                             // rows of up to 32 * 8 * 4 = 1024 channels stay in registers
constexpr int kBackwardWarps = 4;  // warps per backward block
constexpr int kBackwardRows = 32;  // rows per backward block (one partial row of scratch)
constexpr int64_t kMaxChannels = int64_t{1} << 24;
// Row stride (in elements) between a lane's successive columns: 32 lanes x kWidth.
template <int kWidth>
constexpr int kLaneStride = detail::kWarpSize* kWidth;

// ---- kernels ----

// kWidth 8: a lane handles 8 consecutive channels per step with 16-byte accesses (channels % 8
// == 0, every pointer 16-byte aligned); kWidth 1: one channel per step.
template <int kWidth>
__device__ __forceinline__ void LoadRow(const bf16* p, float (&v)[kWidth]) {
  if constexpr (kWidth == 8) {
    detail::LoadBf16x8(p, v);
  } else {
    v[0] = __bfloat162float(*p);
  }
}

template <int kWidth>
__device__ __forceinline__ void LoadParams(const float* p, float (&v)[kWidth]) {
  if constexpr (kWidth == 8) {
    detail::LoadF32x8(p, v);
  } else {
    v[0] = *p;
  }
}

template <int kWidth>
__device__ __forceinline__ void StoreRow(bf16* p, const float (&v)[kWidth]) {
  if constexpr (kWidth == 8) {
    detail::StoreBf16x8(p, v);
  } else {
    *p = __float2bfloat16_rn(v[0]);
  }
}

// kCachedSteps > 0: the row is read once into registers (each lane's kCachedSteps groups of
// kWidth channels; REQUIRES channels <= 32 * kWidth * kCachedSteps); 0: three passes over
// memory. Both sum each lane's channels in the same order.
template <int kWidth, int kCachedSteps>
__global__ void __launch_bounds__(detail::kWarpSize* kForwardWarps)
    LayerNormForwardKernel(bf16* __restrict__ out, float* __restrict__ mean,
                           float* __restrict__ rstd, const bf16* __restrict__ x,
                           const float* __restrict__ weight, const float* __restrict__ bias,
                           int64_t rows, int channels) {
  const int lane = threadIdx.x % detail::kWarpSize;
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * kForwardWarps + threadIdx.x / detail::kWarpSize;
  if (row >= rows) return;  // whole warps only: the shuffles below see all 32 lanes
  const bf16* xr = x + row * channels;
  bf16* o = out + row * channels;
  const float inv_c = 1.0f / static_cast<float>(channels);
  float m, s;

  if constexpr (kCachedSteps > 0) {
    float v[kCachedSteps][kWidth];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kCachedSteps; ++k) {
      const int c = lane * kWidth + k * kLaneStride<kWidth>;
      if (c < channels) {
        LoadRow<kWidth>(xr + c, v[k]);
#pragma unroll
        for (int j = 0; j < kWidth; ++j) sum += v[k][j];
      }
    }
    m = detail::WarpSum(sum) * inv_c;
    float sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < kCachedSteps; ++k) {
      const int c = lane * kWidth + k * kLaneStride<kWidth>;
      if (c < channels) {
#pragma unroll
        for (int j = 0; j < kWidth; ++j) {
          const float d = v[k][j] - m;
          sum_sq += d * d;
        }
      }
    }
    s = 1.0f / sqrtf(detail::WarpSum(sum_sq) * inv_c + kEps);
#pragma unroll
    for (int k = 0; k < kCachedSteps; ++k) {
      const int c = lane * kWidth + k * kLaneStride<kWidth>;
      if (c < channels) {
        float w[kWidth], b[kWidth];
        LoadParams<kWidth>(weight + c, w);
        LoadParams<kWidth>(bias + c, b);
#pragma unroll
        for (int j = 0; j < kWidth; ++j) v[k][j] = (v[k][j] - m) * s * w[j] + b[j];
        StoreRow<kWidth>(o + c, v[k]);
      }
    }
  } else {
    float sum = 0.0f;
    for (int c = lane * kWidth; c < channels; c += kLaneStride<kWidth>) {
      float v[kWidth];
      LoadRow<kWidth>(xr + c, v);
#pragma unroll
      for (int j = 0; j < kWidth; ++j) sum += v[j];
    }
    m = detail::WarpSum(sum) * inv_c;

    float sum_sq = 0.0f;
    for (int c = lane * kWidth; c < channels; c += kLaneStride<kWidth>) {
      float v[kWidth];
      LoadRow<kWidth>(xr + c, v);
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        const float d = v[j] - m;
        sum_sq += d * d;
      }
    }
    s = 1.0f / sqrtf(detail::WarpSum(sum_sq) * inv_c + kEps);

    for (int c = lane * kWidth; c < channels; c += kLaneStride<kWidth>) {
      float v[kWidth], w[kWidth], b[kWidth];
      LoadRow<kWidth>(xr + c, v);
      LoadParams<kWidth>(weight + c, w);
      LoadParams<kWidth>(bias + c, b);
#pragma unroll
      for (int j = 0; j < kWidth; ++j) v[j] = (v[j] - m) * s * w[j] + b[j];
      StoreRow<kWidth>(o + c, v);
    }
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// Block: kBackwardWarps warps; rows [blockIdx.x * kBackwardRows, +kBackwardRows), warp w taking
// rows w, w + kBackwardWarps, ... of them. Dynamic shared memory: kBackwardWarps * 2 * channels
// floats (per warp: dweight then dbias accumulators). partials: [blocks][channels] of dweight,
// then [blocks][channels] of dbias. dx may alias dout (not when accumulate_dx): a lane reads a
// column's dout before it writes that column's dx, and no other lane touches the column.
template <int kWidth>
__global__ void __launch_bounds__(detail::kWarpSize* kBackwardWarps)
    LayerNormBackwardKernel(bf16* dx, float* __restrict__ partials, const bf16* dout,
                            const bf16* __restrict__ x, const float* __restrict__ weight,
                            const float* __restrict__ mean, const float* __restrict__ rstd,
                            int64_t rows, int channels, bool accumulate_dx) {
  extern __shared__ float4 shared_raw[];  // float4: 16-byte aligned for the vector accesses
  float* shared = reinterpret_cast<float*>(shared_raw);
  const int lane = threadIdx.x % detail::kWarpSize;
  const int warp = threadIdx.x / detail::kWarpSize;
  float* dw_acc = shared + static_cast<int64_t>(warp) * 2 * channels;
  float* db_acc = dw_acc + channels;
  for (int c = lane; c < 2 * channels; c += detail::kWarpSize) dw_acc[c] = 0.0f;
  __syncwarp();

  const float inv_c = 1.0f / static_cast<float>(channels);
  const int64_t row_begin = static_cast<int64_t>(blockIdx.x) * kBackwardRows;
  const int64_t row_end = min(rows, row_begin + kBackwardRows);
  for (int64_t row = row_begin + warp; row < row_end; row += kBackwardWarps) {
    const bf16* xr = x + row * channels;
    const bf16* g = dout + row * channels;
    const float m = mean[row];
    const float s = rstd[row];

    float dnorm_mean = 0.0f;
    float dnorm_norm_mean = 0.0f;
    for (int c = lane * kWidth; c < channels; c += kLaneStride<kWidth>) {
      float xv[kWidth], gv[kWidth], wv[kWidth], dw[kWidth], db[kWidth];
      LoadRow<kWidth>(xr + c, xv);
      LoadRow<kWidth>(g + c, gv);
      LoadParams<kWidth>(weight + c, wv);
      LoadParams<kWidth>(dw_acc + c, dw);
      LoadParams<kWidth>(db_acc + c, db);
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        const float norm = (xv[j] - m) * s;
        const float dnorm = wv[j] * gv[j];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * norm;
        dw[j] += gv[j] * norm;
        db[j] += gv[j];
      }
      if constexpr (kWidth == 8) {
        detail::StoreF32x8(dw_acc + c, dw);
        detail::StoreF32x8(db_acc + c, db);
      } else {
        dw_acc[c] = dw[0];
        db_acc[c] = db[0];
      }
    }
    dnorm_mean = detail::WarpSum(dnorm_mean) * inv_c;
    dnorm_norm_mean = detail::WarpSum(dnorm_norm_mean) * inv_c;

    bf16* dxr = dx + row * channels;
    for (int c = lane * kWidth; c < channels; c += kLaneStride<kWidth>) {
      float xv[kWidth], gv[kWidth], wv[kWidth], value[kWidth];
      LoadRow<kWidth>(xr + c, xv);
      LoadRow<kWidth>(g + c, gv);
      LoadParams<kWidth>(weight + c, wv);
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        const float norm = (xv[j] - m) * s;
        value[j] = (wv[j] * gv[j] - dnorm_mean - norm * dnorm_norm_mean) * s;
      }
      if (accumulate_dx) {
        float old[kWidth];
        LoadRow<kWidth>(dxr + c, old);
#pragma unroll
        for (int j = 0; j < kWidth; ++j) value[j] = old[j] + value[j];
      }
      StoreRow<kWidth>(dxr + c, value);
    }
  }

  __syncthreads();
  float* dw_partial = partials + static_cast<int64_t>(blockIdx.x) * channels;
  float* db_partial = partials + (static_cast<int64_t>(gridDim.x) + blockIdx.x) * channels;
  for (int c = threadIdx.x; c < channels; c += blockDim.x) {
    float dw = 0.0f, db = 0.0f;
#pragma unroll
    for (int w = 0; w < kBackwardWarps; ++w) {
      dw += shared[static_cast<int64_t>(w) * 2 * channels + c];
      db += shared[static_cast<int64_t>(w) * 2 * channels + channels + c];
    }
    dw_partial[c] = dw;
    db_partial[c] = db;
  }
}

}  // namespace

// ---- launchers ----

Status LayerNormForward(bf16* out, float* mean, float* rstd, const bf16* x, const float* weight,
                        const float* bias, int64_t rows, int64_t channels, cudaStream_t stream) {
  if (rows < 0 || channels <= 0 || channels > kMaxChannels) {
    return InvalidArgument("LayerNormForward: rows = {} must be >= 0 and channels = {} in [1, {}]",
                           rows, channels, kMaxChannels);
  }
  if (rows == 0) return Status::Ok();
  const unsigned grid = static_cast<unsigned>(detail::CeilDiv(rows, kForwardWarps));
  const int block = detail::kWarpSize * kForwardWarps;
  const int c = static_cast<int>(channels);
  const bool vector = channels % 8 == 0 && detail::IsAligned16(out) && detail::IsAligned16(x) &&
                      detail::IsAligned16(weight) && detail::IsAligned16(bias);
  auto* kernel = !vector ? LayerNormForwardKernel<1, 0>
                 : channels <= kLaneStride<8> * kForwardCachedSteps
                     ? LayerNormForwardKernel<8, kForwardCachedSteps>
                     : LayerNormForwardKernel<8, 0>;
  kernel<<<grid, block, 0, stream>>>(out, mean, rstd, x, weight, bias, rows, c);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

int64_t LayerNormBackwardScratch(int64_t rows, int64_t channels) {
  if (rows <= 0 || channels <= 0) return 0;
  return 2 * detail::CeilDiv(rows, kBackwardRows) * channels;
}

Status LayerNormBackward(bf16* dx, float* dweight, float* dbias, float* scratch, const bf16* dout,
                         const bf16* x, const float* weight, const float* mean, const float* rstd,
                         int64_t rows, int64_t channels, bool accumulate_dx, cudaStream_t stream) {
  if (rows < 0 || channels <= 0 || channels > kMaxChannels) {
    return InvalidArgument("LayerNormBackward: rows = {} must be >= 0 and channels = {} in [1, {}]",
                           rows, channels, kMaxChannels);
  }
  if (accumulate_dx && dx == dout) {
    return InvalidArgument("LayerNormBackward: dx may alias dout only when not accumulating");
  }
  const int64_t blocks = detail::CeilDiv(rows, kBackwardRows);
  if (blocks > 0) {
    const size_t shared_bytes = static_cast<size_t>(kBackwardWarps) * 2 * channels * sizeof(float);
    const bool vector = channels % 8 == 0 && detail::IsAligned16(dx) && detail::IsAligned16(dout) &&
                        detail::IsAligned16(x) && detail::IsAligned16(weight);
    auto* kernel = vector ? LayerNormBackwardKernel<8> : LayerNormBackwardKernel<1>;
    if (shared_bytes > 48 * 1024) {
      int device = 0;
      int limit = 0;
      TESSERA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
      TESSERA_CUDA_RETURN_IF_ERROR(
          cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
      if (shared_bytes > static_cast<size_t>(limit)) {
        return InvalidArgument(
            "LayerNormBackward: channels = {} needs {} bytes of shared memory per block, over "
            "this device's {} (at most {} channels)",
            channels, shared_bytes, limit, limit / (kBackwardWarps * 2 * sizeof(float)));
      }
      TESSERA_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes)));
    }
    kernel<<<static_cast<unsigned>(blocks), detail::kWarpSize * kBackwardWarps, shared_bytes,
             stream>>>(dx, scratch, dout, x, weight, mean, rstd, rows, static_cast<int>(channels),
                       accumulate_dx);
    TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  detail::LaunchSumColumnPartials({{dweight, dbias}, {scratch, scratch + blocks * channels}}, 2,
                                  blocks, channels, /*accumulate=*/false, stream);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tessera::cuda

// The volume ops' memory-bound kernels (ops/cuda/volume_kernels.h): group norm, activations,
// channel bias, concatenation, nearest upsampling, max pooling, voxel cross-entropy and Dice.
//
// Every kernel is templated on the activation type T (float or bf16), reads T as fp32, computes
// in fp32 and rounds once on store. Reductions are deterministic: block sums in a fixed order
// (common.cuh), partial sums added in block order, and Dice's integer counts.
//
// Group norm runs one block per (sample, group) for its statistics (a group's channels are
// contiguous: per_group * spatial elements), two passes (mean, then centred squares) as on the
// CPU; its backward sums dy and dy * xhat per (sample, channel) row, combines rows per channel
// (dweight, dbias) and per group (the two means dx needs) in index order, then maps dx.
#include "ops/cuda/common.cuh"  // first: see there

#include <cuda_bf16.h>

#include "core/cuda_check.h"
#include "ops/cuda/volume_kernels.h"

namespace tessera::cuda {
namespace {

constexpr int kBlock = 256;
constexpr float kLeakySlope = 0.01f;  // ops/cpu/volume_kernels.h: kLeakyReluSlope

using detail::Load;
using detail::Store;

// Reports `index` as the first bad one (the lowest index wins, whatever the order threads run).
__device__ __forceinline__ void ReportBad(int32_t* bad_index, int64_t index) {
  const int32_t value = index > INT32_MAX ? INT32_MAX : static_cast<int32_t>(index);
  int32_t seen = *bad_index;
  while (seen < 0 || value < seen) {
    const int32_t previous = atomicCAS(bad_index, seen, value);
    if (previous == seen) break;
    seen = previous;
  }
}

#define TESSERA_FOR_EACH(i, n)                                                           \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// ---- group norm ----

template <typename T>
__global__ void GroupNormForwardKernel(T* y, float* mean, float* rstd, const T* x,
                                       const float* weight, const float* bias, int64_t channels,
                                       int64_t spatial, int64_t groups, float eps) {
  __shared__ float warp_sums[32];
  const int64_t stat = blockIdx.x;
  const int64_t n = stat / groups, g = stat % groups, per_group = channels / groups;
  const int64_t count = per_group * spatial;
  const int64_t offset = (n * channels + g * per_group) * spatial;
  float sum = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) sum += Load(x, offset + i);
  const float m = detail::BlockSum(sum, warp_sums) / static_cast<float>(count);
  float squares = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const float d = Load(x, offset + i) - m;
    squares += d * d;
  }
  const float var = detail::BlockSum(squares, warp_sums) / static_cast<float>(count);
  const float s = 1.0f / sqrtf(var + eps);
  if (threadIdx.x == 0) {
    mean[stat] = m;
    rstd[stat] = s;
  }
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const int64_t c = g * per_group + i / spatial;
    Store(y, offset + i, (Load(x, offset + i) - m) * s * weight[c] + bias[c]);
  }
}

// Per (n, c) row: the sums of dy and of dy * xhat.
template <typename T>
__global__ void GroupNormRowSumsKernel(float* dy_sums, float* dy_xhat_sums, const T* dy, const T* x,
                                       const float* mean, const float* rstd, int64_t channels,
                                       int64_t spatial, int64_t groups) {
  __shared__ float warp_sums[32];
  const int64_t r = blockIdx.x;
  const int64_t stat = (r / channels) * groups + (r % channels) / (channels / groups);
  const float m = mean[stat], s = rstd[stat];
  float sum = 0, sum_xhat = 0;
  for (int64_t i = threadIdx.x; i < spatial; i += blockDim.x) {
    const float g = Load(dy, r * spatial + i);
    sum += g;
    sum_xhat += g * ((Load(x, r * spatial + i) - m) * s);
  }
  sum = detail::BlockSum(sum, warp_sums);
  sum_xhat = detail::BlockSum(sum_xhat, warp_sums);
  if (threadIdx.x == 0) {
    dy_sums[r] = sum;
    dy_xhat_sums[r] = sum_xhat;
  }
}

// dweight and dbias per channel (over samples in order), and per (n, g) the means over the group
// of dy * weight and of dy * weight * xhat.
__global__ void GroupNormCombineKernel(float* dweight, float* dbias, float* mean_dxhat,
                                       float* mean_dxhat_xhat, const float* dy_sums,
                                       const float* dy_xhat_sums, const float* weight,
                                       int64_t batch, int64_t channels, int64_t spatial,
                                       int64_t groups) {
  const int64_t per_group = channels / groups;
  const float count = static_cast<float>(per_group * spatial);
  TESSERA_FOR_EACH(i, channels + batch * groups) {
    if (i < channels) {
      float dw = 0, db = 0;
      for (int64_t n = 0; n < batch; ++n) {
        dw += dy_xhat_sums[n * channels + i];
        db += dy_sums[n * channels + i];
      }
      dweight[i] = dw;
      dbias[i] = db;
    } else {
      const int64_t stat = i - channels, n = stat / groups, g = stat % groups;
      float a = 0, b = 0;
      for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
        a += weight[c] * dy_sums[n * channels + c];
        b += weight[c] * dy_xhat_sums[n * channels + c];
      }
      mean_dxhat[stat] = a / count;
      mean_dxhat_xhat[stat] = b / count;
    }
  }
}

template <typename T>
__global__ void GroupNormInputGradKernel(T* dx, const T* dy, const T* x, const float* weight,
                                         const float* mean, const float* rstd,
                                         const float* mean_dxhat, const float* mean_dxhat_xhat,
                                         int64_t channels, int64_t spatial, int64_t groups,
                                         int64_t n_elements) {
  TESSERA_FOR_EACH(i, n_elements) {
    const int64_t r = i / spatial, c = r % channels;
    const int64_t stat = (r / channels) * groups + c / (channels / groups);
    const float s = rstd[stat];
    const float xhat = (Load(x, i) - mean[stat]) * s;
    Store(dx, i, (weight[c] * Load(dy, i) - mean_dxhat[stat] - xhat * mean_dxhat_xhat[stat]) * s);
  }
}

// ---- activations ----

template <typename T>
__global__ void ActivationForwardKernel(VolumeActivation kind, T* y, const T* x, int64_t n) {
  TESSERA_FOR_EACH(i, n) {
    const float v = Load(x, i);
    float out;
    switch (kind) {
      case VolumeActivation::kRelu:
        out = v > 0.0f ? v : 0.0f;
        break;
      case VolumeActivation::kLeakyRelu:
        out = v > 0.0f ? v : kLeakySlope * v;
        break;
      default:
        out = v / (1.0f + expf(-v));
        break;
    }
    Store(y, i, out);
  }
}

template <typename T>
__global__ void ActivationBackwardKernel(VolumeActivation kind, T* dx, const T* dy, const T* x,
                                         int64_t n) {
  TESSERA_FOR_EACH(i, n) {
    const float v = Load(x, i), g = Load(dy, i);
    float out;
    switch (kind) {
      case VolumeActivation::kRelu:
        out = v > 0.0f ? g : 0.0f;
        break;
      case VolumeActivation::kLeakyRelu:
        out = v > 0.0f ? g : kLeakySlope * g;
        break;
      default: {
        const float s = 1.0f / (1.0f + expf(-v));
        out = g * s * (1.0f + v * (1.0f - s));
        break;
      }
    }
    Store(dx, i, out);
  }
}

// ---- scaling by a device scalar ----

template <typename T>
__global__ void ScaleByScalarKernel(T* y, const T* x, const float* scale, int64_t n) {
  const float s = *scale;
  TESSERA_FOR_EACH(i, n) { Store(y, i, Load(x, i) * s); }
}

// ---- channel bias ----

template <typename T>
__global__ void ChannelBiasAddKernel(T* y, const T* x, const float* bias, int64_t channels,
                                     int64_t spatial, int64_t n) {
  TESSERA_FOR_EACH(i, n) { Store(y, i, Load(x, i) + bias[(i / spatial) % channels]); }
}

template <typename T>
__global__ void ChannelSumsKernel(float* out, const T* t, int64_t batch, int64_t channels,
                                  int64_t spatial) {
  __shared__ float warp_sums[32];
  const int64_t c = blockIdx.x;
  float sum = 0;
  for (int64_t n = 0; n < batch; ++n) {
    const int64_t row = (n * channels + c) * spatial;
    for (int64_t s = threadIdx.x; s < spatial; s += blockDim.x) sum += Load(t, row + s);
  }
  sum = detail::BlockSum(sum, warp_sums);
  if (threadIdx.x == 0) out[c] = sum;
}

// ---- concatenation ----

template <typename T>
__global__ void ConcatForwardKernel(T* out, const T* a, const T* b, int64_t a_inner,
                                    int64_t b_inner, int64_t n) {
  const int64_t inner = a_inner + b_inner;
  TESSERA_FOR_EACH(i, n) {
    const int64_t o = i / inner, j = i % inner;
    out[i] = j < a_inner ? a[o * a_inner + j] : b[o * b_inner + (j - a_inner)];
  }
}

template <typename T>
__global__ void ConcatBackwardKernel(T* da, T* db, const T* dout, int64_t a_inner, int64_t b_inner,
                                     int64_t n) {
  const int64_t inner = a_inner + b_inner;
  TESSERA_FOR_EACH(i, n) {
    const int64_t o = i / inner, j = i % inner;
    if (j < a_inner) {
      da[o * a_inner + j] = dout[i];
    } else {
      db[o * b_inner + (j - a_inner)] = dout[i];
    }
  }
}

// ---- nearest upsampling ----

template <typename T>
__global__ void UpsampleForwardKernel(T* y, const T* x, int64_t d, int64_t h, int64_t w,
                                      int64_t scale, int64_t n) {
  const int64_t od = d * scale, oh = h * scale, ow = w * scale;
  TESSERA_FOR_EACH(i, n) {
    const int64_t xw = i % ow, rest = i / ow;
    const int64_t xh = rest % oh, rest2 = rest / oh;
    const int64_t xd = rest2 % od, plane = rest2 / od;
    y[i] = x[((plane * d + xd / scale) * h + xh / scale) * w + xw / scale];
  }
}

template <typename T>
__global__ void UpsampleBackwardKernel(T* dx, const T* dy, int64_t d, int64_t h, int64_t w,
                                       int64_t scale, int64_t n) {
  const int64_t oh = h * scale, ow = w * scale;
  TESSERA_FOR_EACH(i, n) {
    const int64_t xw = i % w, rest = i / w;
    const int64_t xh = rest % h, rest2 = rest / h;
    const int64_t xd = rest2 % d, plane = rest2 / d;
    float sum = 0;
    for (int64_t a = 0; a < scale; ++a) {
      for (int64_t b = 0; b < scale; ++b) {
        const int64_t row = ((plane * d * scale + xd * scale + a) * oh + xh * scale + b) * ow;
        for (int64_t e = 0; e < scale; ++e) sum += Load(dy, row + xw * scale + e);
      }
    }
    Store(dx, i, sum);
  }
}

// ---- max pooling ----

template <typename T>
__global__ void MaxPoolForwardKernel(T* y, int32_t* indices, const T* x, int64_t d, int64_t h,
                                     int64_t w, int64_t k, int64_t n) {
  const int64_t od = d / k, oh = h / k, ow = w / k;
  TESSERA_FOR_EACH(o, n) {
    const int64_t l = o % ow, rest = o / ow;
    const int64_t j = rest % oh, rest2 = rest / oh;
    const int64_t i = rest2 % od, plane = rest2 / od;
    const T* xp = x + plane * d * h * w;
    // PyTorch's scan, as the CPU: the first element's index, -inf, then (v > best || isnan(v)).
    int64_t best_index = (i * k * h + j * k) * w + l * k;
    float best = -INFINITY;
    for (int64_t a = 0; a < k; ++a) {
      for (int64_t b = 0; b < k; ++b) {
        const int64_t base = ((i * k + a) * h + j * k + b) * w + l * k;
        for (int64_t e = 0; e < k; ++e) {
          const float v = Load(xp, base + e);
          if (v > best || isnan(v)) {
            best = v;
            best_index = base + e;
          }
        }
      }
    }
    Store(y, o, best);
    indices[o] = static_cast<int32_t>(best_index);
  }
}

template <typename T>
__global__ void MaxPoolBackwardKernel(T* dx, int32_t* bad_index, const T* dy,
                                      const int32_t* indices, int64_t volume, int64_t pooled_volume,
                                      int64_t n) {
  TESSERA_FOR_EACH(o, n) {
    const int64_t index = indices[o];
    if (index < 0 || index >= volume) {
      ReportBad(bad_index, o);
      continue;
    }
    dx[(o / pooled_volume) * volume + index] = dy[o];
  }
}

// ---- voxel cross-entropy ----

template <typename T>
__global__ void VoxelCrossEntropyKernel(float* partials, T* dlogits, int32_t* bad_index,
                                        const T* logits, const int32_t* targets, int64_t classes,
                                        int64_t spatial, int64_t voxels, float dscale) {
  __shared__ float warp_sums[32];
  float sum = 0;
  TESSERA_FOR_EACH(v, voxels) {
    const int64_t n = v / spatial, s = v % spatial;
    const int64_t base = n * classes * spatial + s;
    const int32_t target = targets[v];
    if (target < 0 || target >= classes) {
      ReportBad(bad_index, v);
      if (dlogits != nullptr) {
        for (int64_t c = 0; c < classes; ++c) Store(dlogits, base + c * spatial, 0.0f);
      }
      continue;
    }
    float largest = -INFINITY;
    for (int64_t c = 0; c < classes; ++c)
      largest = fmaxf(largest, Load(logits, base + c * spatial));
    float total = 0;
    for (int64_t c = 0; c < classes; ++c) total += expf(Load(logits, base + c * spatial) - largest);
    const float lse = largest + logf(total);
    sum += lse - Load(logits, base + target * spatial);
    if (dlogits != nullptr) {
      for (int64_t c = 0; c < classes; ++c) {
        const float p = expf(Load(logits, base + c * spatial) - lse);
        Store(dlogits, base + c * spatial, (p - (c == target ? 1.0f : 0.0f)) * dscale);
      }
    }
  }
  sum = detail::BlockSum(sum, warp_sums);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__global__ void SumPartialsKernel(float* out, const float* partials, int64_t count, float scale) {
  __shared__ float warp_sums[32];
  float sum = 0;
  // Each thread a fixed stride of partials, then the block sum: a fixed order.
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  sum = detail::BlockSum(sum, warp_sums);
  if (threadIdx.x == 0) *out = sum * scale;
}

// ---- deep supervision: coarse label maps, sums of loss terms ----

__global__ void DownsampleLabelsKernel(int32_t* coarse, const int32_t* targets, int64_t d,
                                       int64_t h, int64_t w, int64_t factor, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t cd = d / factor, ch = h / factor, cw = w / factor, half = factor / 2;
  const int64_t x = i % cw, y = (i / cw) % ch, z = (i / (cw * ch)) % cd, b = i / (cw * ch * cd);
  coarse[i] =
      targets[((b * d + z * factor + half) * h + y * factor + half) * w + x * factor + half];
}

__global__ void AddF32Kernel(float* out, const float* a, const float* b, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}

// ---- Dice ----

template <typename T>
__global__ void DiceCountsKernel(unsigned long long* counts, int32_t* bad_index,  // NOLINT
                                 const T* logits, const int32_t* targets, int64_t classes,
                                 int64_t spatial, int64_t voxels) {
  extern __shared__ unsigned long long block_counts[];  // NOLINT: [classes][3]
  for (int64_t i = threadIdx.x; i < classes * 3; i += blockDim.x) block_counts[i] = 0;
  __syncthreads();
  TESSERA_FOR_EACH(v, voxels) {
    const int64_t n = v / spatial, s = v % spatial;
    const int64_t base = n * classes * spatial + s;
    const int32_t target = targets[v];
    if (target < 0 || target >= classes) {
      ReportBad(bad_index, v);
      continue;
    }
    int64_t predicted = 0;
    float best = Load(logits, base);
    for (int64_t c = 1; c < classes; ++c) {
      const float value = Load(logits, base + c * spatial);
      if (value > best) {
        best = value;
        predicted = c;
      }
    }
    atomicAdd(&block_counts[predicted * 3 + 1], 1ULL);
    atomicAdd(&block_counts[target * 3 + 2], 1ULL);
    if (predicted == target) atomicAdd(&block_counts[predicted * 3], 1ULL);
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < classes * 3; i += blockDim.x) {
    if (block_counts[i] != 0) atomicAdd(&counts[i], block_counts[i]);
  }
}

__global__ void DiceFromCountsKernel(float* score, const unsigned long long* counts,  // NOLINT
                                     int64_t classes) {
  double total = 0;
  for (int64_t c = 1; c < classes; ++c) {
    const double both = static_cast<double>(counts[c * 3]);
    const double sum = static_cast<double>(counts[c * 3 + 1] + counts[c * 3 + 2]);
    total += sum == 0 ? 1.0 : 2.0 * both / sum;
  }
  *score = static_cast<float>(total / static_cast<double>(classes - 1));
}

// ---- launchers ----

Status CheckPositive(std::initializer_list<int64_t> sizes, const char* what) {
  for (int64_t size : sizes) {
    if (size < 1) return InvalidArgument("{}: every size must be at least 1", what);
  }
  return Status::Ok();
}

template <typename T>
Status GroupNormForwardT(T* y, float* mean, float* rstd, const T* x, const float* weight,
                         const float* bias, int64_t batch, int64_t channels, int64_t spatial,
                         int64_t groups, float eps, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(CheckPositive({batch, channels, spatial, groups}, "GroupNormForward"));
  if (channels % groups != 0) {
    return InvalidArgument("GroupNormForward: {} groups do not divide {} channels", groups,
                           channels);
  }
  GroupNormForwardKernel<<<static_cast<unsigned>(batch * groups), kBlock, 0, stream>>>(
      y, mean, rstd, x, weight, bias, channels, spatial, groups, eps);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template <typename T>
Status GroupNormBackwardT(T* dx, float* dweight, float* dbias, float* scratch, const T* dy,
                          const T* x, const float* weight, const float* mean, const float* rstd,
                          int64_t batch, int64_t channels, int64_t spatial, int64_t groups,
                          cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(CheckPositive({batch, channels, spatial, groups}, "GroupNormBackward"));
  if (channels % groups != 0) {
    return InvalidArgument("GroupNormBackward: {} groups do not divide {} channels", groups,
                           channels);
  }
  float* dy_sums = scratch;
  float* dy_xhat_sums = dy_sums + batch * channels;
  float* mean_dxhat = dy_xhat_sums + batch * channels;
  float* mean_dxhat_xhat = mean_dxhat + batch * groups;
  GroupNormRowSumsKernel<<<static_cast<unsigned>(batch * channels), kBlock, 0, stream>>>(
      dy_sums, dy_xhat_sums, dy, x, mean, rstd, channels, spatial, groups);
  GroupNormCombineKernel<<<detail::GridSize(channels + batch * groups, kBlock), kBlock, 0,
                           stream>>>(dweight, dbias, mean_dxhat, mean_dxhat_xhat, dy_sums,
                                     dy_xhat_sums, weight, batch, channels, spatial, groups);
  const int64_t n = batch * channels * spatial;
  GroupNormInputGradKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(
      dx, dy, x, weight, mean, rstd, mean_dxhat, mean_dxhat_xhat, channels, spatial, groups, n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template <typename T>
Status VoxelCrossEntropyT(float* loss, T* dlogits, float* scratch, int32_t* bad_index,
                          const T* logits, const int32_t* targets, int64_t batch, int64_t classes,
                          int64_t spatial, float grad_scale, float weight, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(CheckPositive({batch, classes, spatial}, "VoxelCrossEntropy"));
  const int64_t voxels = batch * spatial;
  const unsigned blocks = detail::GridSize(voxels, kBlock);
  VoxelCrossEntropyKernel<<<blocks, kBlock, 0, stream>>>(
      scratch, dlogits, bad_index, logits, targets, classes, spatial, voxels,
      grad_scale * weight / static_cast<float>(voxels));
  SumPartialsKernel<<<1, 1024, 0, stream>>>(loss, scratch, blocks,
                                            weight / static_cast<float>(voxels));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template <typename T>
Status DiceScoreT(float* score, unsigned long long* counts, int32_t* bad_index,  // NOLINT
                  const T* logits, const int32_t* targets, int64_t batch, int64_t classes,
                  int64_t spatial, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(CheckPositive({batch, classes, spatial}, "DiceScore"));
  if (classes < 2 || classes > 1024) {
    return InvalidArgument("DiceScore: {} classes; it scores 2 to 1024", classes);
  }
  const size_t count_bytes = static_cast<size_t>(classes * 3) * sizeof(unsigned long long);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(counts, 0, count_bytes, stream));
  const int64_t voxels = batch * spatial;
  DiceCountsKernel<<<detail::GridSize(voxels, kBlock), kBlock, count_bytes, stream>>>(
      counts, bad_index, logits, targets, classes, spatial, voxels);
  DiceFromCountsKernel<<<1, 1, 0, stream>>>(score, counts, classes);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template <typename T>
Status ActivationForwardT(VolumeActivation kind, T* y, const T* x, int64_t n, cudaStream_t stream) {
  if (n < 1) return Status::Ok();
  ActivationForwardKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(kind, y, x, n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}
template <typename T>
Status ActivationBackwardT(VolumeActivation kind, T* dx, const T* dy, const T* x, int64_t n,
                           cudaStream_t stream) {
  if (n < 1) return Status::Ok();
  ActivationBackwardKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(kind, dx, dy, x, n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}
template <typename T>
Status ChannelBiasAddT(T* y, const T* x, const float* bias, int64_t batch, int64_t channels,
                       int64_t spatial, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(CheckPositive({batch, channels, spatial}, "ChannelBiasAdd"));
  const int64_t n = batch * channels * spatial;
  ChannelBiasAddKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(y, x, bias, channels,
                                                                           spatial, n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}
template <typename T>
Status ChannelSumsT(float* out, const T* t, int64_t batch, int64_t channels, int64_t spatial,
                    cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(CheckPositive({batch, channels, spatial}, "ChannelSums"));
  ChannelSumsKernel<<<static_cast<unsigned>(channels), kBlock, 0, stream>>>(out, t, batch, channels,
                                                                            spatial);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}
template <typename T>
Status ConcatForwardT(T* out, const T* a, const T* b, int64_t outer, int64_t a_inner,
                      int64_t b_inner, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(CheckPositive({outer, a_inner, b_inner}, "ConcatForward"));
  const int64_t n = outer * (a_inner + b_inner);
  ConcatForwardKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(out, a, b, a_inner,
                                                                          b_inner, n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}
template <typename T>
Status ConcatBackwardT(T* da, T* db, const T* dout, int64_t outer, int64_t a_inner, int64_t b_inner,
                       cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(CheckPositive({outer, a_inner, b_inner}, "ConcatBackward"));
  const int64_t n = outer * (a_inner + b_inner);
  ConcatBackwardKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(da, db, dout, a_inner,
                                                                           b_inner, n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}
template <typename T>
Status UpsampleForwardT(T* y, const T* x, int64_t planes, int64_t d, int64_t h, int64_t w,
                        int64_t scale, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(CheckPositive({planes, d, h, w, scale}, "UpsampleNearest3dForward"));
  const int64_t n = planes * d * h * w * scale * scale * scale;
  UpsampleForwardKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(y, x, d, h, w, scale,
                                                                            n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}
template <typename T>
Status UpsampleBackwardT(T* dx, const T* dy, int64_t planes, int64_t d, int64_t h, int64_t w,
                         int64_t scale, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(CheckPositive({planes, d, h, w, scale}, "UpsampleNearest3dBackward"));
  const int64_t n = planes * d * h * w;
  UpsampleBackwardKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(dx, dy, d, h, w, scale,
                                                                             n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}
template <typename T>
Status MaxPoolForwardT(T* y, int32_t* indices, const T* x, int64_t planes, int64_t d, int64_t h,
                       int64_t w, int64_t k, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(CheckPositive({planes, d, h, w, k}, "MaxPool3dForward"));
  if (d < k || h < k || w < k || d * h * w > INT32_MAX) {
    return InvalidArgument("MaxPool3dForward: a {}x{}x{} plane for kernel {}", d, h, w, k);
  }
  const int64_t n = planes * (d / k) * (h / k) * (w / k);
  MaxPoolForwardKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(y, indices, x, d, h, w,
                                                                           k, n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}
template <typename T>
Status MaxPoolBackwardT(T* dx, int32_t* bad_index, const T* dy, const int32_t* indices,
                        int64_t planes, int64_t volume, int64_t pooled_volume,
                        cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(CheckPositive({planes, volume, pooled_volume}, "MaxPool3dBackward"));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      dx, 0, static_cast<size_t>(planes * volume) * sizeof(T), stream));  // zeros in both types
  const int64_t n = planes * pooled_volume;
  MaxPoolBackwardKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(
      dx, bad_index, dy, indices, volume, pooled_volume, n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace

Status GroupNormForward(float* y, float* mean, float* rstd, const float* x, const float* weight,
                        const float* bias, int64_t batch, int64_t channels, int64_t spatial,
                        int64_t groups, float eps, cudaStream_t stream) {
  return GroupNormForwardT(y, mean, rstd, x, weight, bias, batch, channels, spatial, groups, eps,
                           stream);
}
Status GroupNormForward(bf16* y, float* mean, float* rstd, const bf16* x, const float* weight,
                        const float* bias, int64_t batch, int64_t channels, int64_t spatial,
                        int64_t groups, float eps, cudaStream_t stream) {
  return GroupNormForwardT(y, mean, rstd, x, weight, bias, batch, channels, spatial, groups, eps,
                           stream);
}
Status GroupNormBackward(float* dx, float* dweight, float* dbias, float* scratch, const float* dy,
                         const float* x, const float* weight, const float* mean, const float* rstd,
                         int64_t batch, int64_t channels, int64_t spatial, int64_t groups,
                         cudaStream_t stream) {
  return GroupNormBackwardT(dx, dweight, dbias, scratch, dy, x, weight, mean, rstd, batch, channels,
                            spatial, groups, stream);
}
Status GroupNormBackward(bf16* dx, float* dweight, float* dbias, float* scratch, const bf16* dy,
                         const bf16* x, const float* weight, const float* mean, const float* rstd,
                         int64_t batch, int64_t channels, int64_t spatial, int64_t groups,
                         cudaStream_t stream) {
  return GroupNormBackwardT(dx, dweight, dbias, scratch, dy, x, weight, mean, rstd, batch, channels,
                            spatial, groups, stream);
}
int64_t GroupNormBackwardScratch(int64_t batch, int64_t channels, int64_t groups) {
  return 2 * batch * channels + 2 * batch * groups;
}

Status ActivationForward(VolumeActivation kind, float* y, const float* x, int64_t n,
                         cudaStream_t stream) {
  return ActivationForwardT(kind, y, x, n, stream);
}
Status ActivationForward(VolumeActivation kind, bf16* y, const bf16* x, int64_t n,
                         cudaStream_t stream) {
  return ActivationForwardT(kind, y, x, n, stream);
}
Status ActivationBackward(VolumeActivation kind, float* dx, const float* dy, const float* x,
                          int64_t n, cudaStream_t stream) {
  return ActivationBackwardT(kind, dx, dy, x, n, stream);
}
Status ActivationBackward(VolumeActivation kind, bf16* dx, const bf16* dy, const bf16* x, int64_t n,
                          cudaStream_t stream) {
  return ActivationBackwardT(kind, dx, dy, x, n, stream);
}

namespace {
template <typename T>
Status ScaleByScalarT(T* y, const T* x, const float* scale, int64_t n, cudaStream_t stream) {
  if (n < 1) return Status::Ok();
  ScaleByScalarKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(y, x, scale, n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}
}  // namespace
Status ScaleByScalar(float* y, const float* x, const float* scale, int64_t n, cudaStream_t stream) {
  return ScaleByScalarT(y, x, scale, n, stream);
}
Status ScaleByScalar(bf16* y, const bf16* x, const float* scale, int64_t n, cudaStream_t stream) {
  return ScaleByScalarT(y, x, scale, n, stream);
}
Status ChannelBiasAdd(float* y, const float* x, const float* bias, int64_t batch, int64_t channels,
                      int64_t spatial, cudaStream_t stream) {
  return ChannelBiasAddT(y, x, bias, batch, channels, spatial, stream);
}
Status ChannelBiasAdd(bf16* y, const bf16* x, const float* bias, int64_t batch, int64_t channels,
                      int64_t spatial, cudaStream_t stream) {
  return ChannelBiasAddT(y, x, bias, batch, channels, spatial, stream);
}
Status ChannelSums(float* out, const float* t, int64_t batch, int64_t channels, int64_t spatial,
                   cudaStream_t stream) {
  return ChannelSumsT(out, t, batch, channels, spatial, stream);
}
Status ChannelSums(float* out, const bf16* t, int64_t batch, int64_t channels, int64_t spatial,
                   cudaStream_t stream) {
  return ChannelSumsT(out, t, batch, channels, spatial, stream);
}

Status ConcatForward(float* out, const float* a, const float* b, int64_t outer, int64_t a_inner,
                     int64_t b_inner, cudaStream_t stream) {
  return ConcatForwardT(out, a, b, outer, a_inner, b_inner, stream);
}
Status ConcatForward(bf16* out, const bf16* a, const bf16* b, int64_t outer, int64_t a_inner,
                     int64_t b_inner, cudaStream_t stream) {
  return ConcatForwardT(out, a, b, outer, a_inner, b_inner, stream);
}
Status ConcatBackward(float* da, float* db, const float* dout, int64_t outer, int64_t a_inner,
                      int64_t b_inner, cudaStream_t stream) {
  return ConcatBackwardT(da, db, dout, outer, a_inner, b_inner, stream);
}
Status ConcatBackward(bf16* da, bf16* db, const bf16* dout, int64_t outer, int64_t a_inner,
                      int64_t b_inner, cudaStream_t stream) {
  return ConcatBackwardT(da, db, dout, outer, a_inner, b_inner, stream);
}

Status UpsampleNearest3dForward(float* y, const float* x, int64_t planes, int64_t d, int64_t h,
                                int64_t w, int64_t scale, cudaStream_t stream) {
  return UpsampleForwardT(y, x, planes, d, h, w, scale, stream);
}
Status UpsampleNearest3dForward(bf16* y, const bf16* x, int64_t planes, int64_t d, int64_t h,
                                int64_t w, int64_t scale, cudaStream_t stream) {
  return UpsampleForwardT(y, x, planes, d, h, w, scale, stream);
}
Status UpsampleNearest3dBackward(float* dx, const float* dy, int64_t planes, int64_t d, int64_t h,
                                 int64_t w, int64_t scale, cudaStream_t stream) {
  return UpsampleBackwardT(dx, dy, planes, d, h, w, scale, stream);
}
Status UpsampleNearest3dBackward(bf16* dx, const bf16* dy, int64_t planes, int64_t d, int64_t h,
                                 int64_t w, int64_t scale, cudaStream_t stream) {
  return UpsampleBackwardT(dx, dy, planes, d, h, w, scale, stream);
}

Status MaxPool3dForward(float* y, int32_t* indices, const float* x, int64_t planes, int64_t d,
                        int64_t h, int64_t w, int64_t k, cudaStream_t stream) {
  return MaxPoolForwardT(y, indices, x, planes, d, h, w, k, stream);
}
Status MaxPool3dForward(bf16* y, int32_t* indices, const bf16* x, int64_t planes, int64_t d,
                        int64_t h, int64_t w, int64_t k, cudaStream_t stream) {
  return MaxPoolForwardT(y, indices, x, planes, d, h, w, k, stream);
}
Status MaxPool3dBackward(float* dx, int32_t* bad_index, const float* dy, const int32_t* indices,
                         int64_t planes, int64_t volume, int64_t pooled_volume,
                         cudaStream_t stream) {
  return MaxPoolBackwardT(dx, bad_index, dy, indices, planes, volume, pooled_volume, stream);
}
Status MaxPool3dBackward(bf16* dx, int32_t* bad_index, const bf16* dy, const int32_t* indices,
                         int64_t planes, int64_t volume, int64_t pooled_volume,
                         cudaStream_t stream) {
  return MaxPoolBackwardT(dx, bad_index, dy, indices, planes, volume, pooled_volume, stream);
}

Status VoxelCrossEntropy(float* loss, float* dlogits, float* scratch, int32_t* bad_index,
                         const float* logits, const int32_t* targets, int64_t batch,
                         int64_t classes, int64_t spatial, float grad_scale, cudaStream_t stream,
                         float weight) {
  return VoxelCrossEntropyT(loss, dlogits, scratch, bad_index, logits, targets, batch, classes,
                            spatial, grad_scale, weight, stream);
}
Status VoxelCrossEntropy(float* loss, bf16* dlogits, float* scratch, int32_t* bad_index,
                         const bf16* logits, const int32_t* targets, int64_t batch, int64_t classes,
                         int64_t spatial, float grad_scale, cudaStream_t stream, float weight) {
  return VoxelCrossEntropyT(loss, dlogits, scratch, bad_index, logits, targets, batch, classes,
                            spatial, grad_scale, weight, stream);
}

Status DownsampleLabels(int32_t* coarse, const int32_t* targets, int64_t batch, int64_t d,
                        int64_t h, int64_t w, int64_t factor, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(CheckPositive({batch, d, h, w, factor}, "DownsampleLabels"));
  const int64_t n = batch * (d / factor) * (h / factor) * (w / factor);
  if (n == 0) return Status::Ok();
  DownsampleLabelsKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(coarse, targets, d, h,
                                                                             w, factor, n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

Status AddF32(float* out, const float* a, const float* b, int64_t n, cudaStream_t stream) {
  if (n <= 0) return Status::Ok();
  AddF32Kernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(out, a, b, n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}
int64_t VoxelCrossEntropyScratch(int64_t batch, int64_t spatial) {
  return detail::GridSize(batch * spatial, kBlock);
}

Status DiceScore(float* score, unsigned long long* counts, int32_t* bad_index,  // NOLINT
                 const float* logits, const int32_t* targets, int64_t batch, int64_t classes,
                 int64_t spatial, cudaStream_t stream) {
  return DiceScoreT(score, counts, bad_index, logits, targets, batch, classes, spatial, stream);
}
Status DiceScore(float* score, unsigned long long* counts, int32_t* bad_index,  // NOLINT
                 const bf16* logits, const int32_t* targets, int64_t batch, int64_t classes,
                 int64_t spatial, cudaStream_t stream) {
  return DiceScoreT(score, counts, bad_index, logits, targets, batch, classes, spatial, stream);
}
int64_t DiceScoreCounts(int64_t classes) { return 3 * classes; }

// ---- depth windows: the convolutions' split along D (volume_conv.cc) ----

namespace {

// dst [rows, depth, plane] = planes first .. first + depth - 1 of src [rows, src_depth, plane],
// zeros for planes outside [0, src_depth).
template <typename T>
__global__ void CopyDepthWindowKernel(T* dst, const T* src, int64_t rows, int64_t src_depth,
                                      int64_t plane, int64_t first, int64_t depth) {
  TESSERA_FOR_EACH(i, rows * depth * plane) {
    const int64_t p = i % plane, j = (i / plane) % depth, r = i / (plane * depth);
    const int64_t d = first + j;
    Store(dst, i, d >= 0 && d < src_depth ? Load(src, (r * src_depth + d) * plane + p) : 0.0f);
  }
}

// Planes first .. first + depth - 1 of dst [rows, dst_depth, plane] (those inside it) set to
// (`add`: increased by) src [rows, depth, plane]'s.
template <typename T>
__global__ void PlaceDepthWindowKernel(T* dst, const T* src, int64_t rows, int64_t dst_depth,
                                       int64_t plane, int64_t first, int64_t depth, bool add) {
  TESSERA_FOR_EACH(i, rows * depth * plane) {
    const int64_t p = i % plane, j = (i / plane) % depth, r = i / (plane * depth);
    const int64_t d = first + j;
    if (d < 0 || d >= dst_depth) continue;
    const int64_t at = (r * dst_depth + d) * plane + p;
    Store(dst, at, add ? Load(dst, at) + Load(src, i) : Load(src, i));
  }
}

template <typename T>
Status CopyDepthWindowT(T* dst, const T* src, int64_t rows, int64_t src_depth, int64_t plane,
                        int64_t first, int64_t depth, cudaStream_t stream) {
  const int64_t n = rows * depth * plane;
  if (n < 1) return Status::Ok();
  CopyDepthWindowKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(
      dst, src, rows, src_depth, plane, first, depth);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template <typename T>
Status PlaceDepthWindowT(T* dst, const T* src, int64_t rows, int64_t dst_depth, int64_t plane,
                         int64_t first, int64_t depth, bool add, cudaStream_t stream) {
  const int64_t n = rows * depth * plane;
  if (n < 1) return Status::Ok();
  PlaceDepthWindowKernel<<<detail::GridSize(n, kBlock), kBlock, 0, stream>>>(
      dst, src, rows, dst_depth, plane, first, depth, add);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace

Status CopyDepthWindow(float* dst, const float* src, int64_t rows, int64_t src_depth, int64_t plane,
                       int64_t first, int64_t depth, cudaStream_t stream) {
  return CopyDepthWindowT(dst, src, rows, src_depth, plane, first, depth, stream);
}
Status CopyDepthWindow(bf16* dst, const bf16* src, int64_t rows, int64_t src_depth, int64_t plane,
                       int64_t first, int64_t depth, cudaStream_t stream) {
  return CopyDepthWindowT(dst, src, rows, src_depth, plane, first, depth, stream);
}
Status PlaceDepthWindow(float* dst, const float* src, int64_t rows, int64_t dst_depth,
                        int64_t plane, int64_t first, int64_t depth, bool add,
                        cudaStream_t stream) {
  return PlaceDepthWindowT(dst, src, rows, dst_depth, plane, first, depth, add, stream);
}
Status PlaceDepthWindow(bf16* dst, const bf16* src, int64_t rows, int64_t dst_depth, int64_t plane,
                        int64_t first, int64_t depth, bool add, cudaStream_t stream) {
  return PlaceDepthWindowT(dst, src, rows, dst_depth, plane, first, depth, add, stream);
}

}  // namespace tessera::cuda

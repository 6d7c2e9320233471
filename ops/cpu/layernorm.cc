// LayerNorm over the last dimension, forward and backward.
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/cpu/kernels.h"
#include "ops/cpu/parallel.h"

namespace tessera::cpu {

using detail::ParallelChunks;
using detail::ParallelFor;

void LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* weight,
                      const float* bias, int64_t rows, int64_t channels) {
  const float inv_c = 1.0f / static_cast<float>(channels);
  ParallelFor(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * channels;
      float sum = 0.0f;
      for (int64_t c = 0; c < channels; ++c) sum += xr[c];
      const float m = sum * inv_c;
      float sum_sq = 0.0f;
      for (int64_t c = 0; c < channels; ++c) {
        const float d = xr[c] - m;
        sum_sq += d * d;
      }
      const float s = 1.0f / std::sqrt(sum_sq * inv_c + kLayerNormEps);
      float* o = out + r * channels;
      for (int64_t c = 0; c < channels; ++c) o[c] = (xr[c] - m) * s * weight[c] + bias[c];
      mean[r] = m;
      rstd[r] = s;
    }
  });
}

void LayerNormBackward(float* dx, float* dweight, float* dbias, const float* dout, const float* x,
                       const float* weight, const float* mean, const float* rstd, int64_t rows,
                       int64_t channels, bool accumulate_dx) {
  // Rows in fixed chunks; each chunk sums its own dweight/dbias partials, combined in order.
  constexpr int64_t kRowChunk = 64;
  const int64_t chunks = (rows + kRowChunk - 1) / kRowChunk;
  std::vector<float> partials(static_cast<size_t>(std::max<int64_t>(chunks, 1) * 2 * channels));
  const float inv_c = 1.0f / static_cast<float>(channels);
  ParallelChunks(rows, kRowChunk, [&](int64_t chunk, int64_t r0, int64_t r1) {
    float* dw_part = partials.data() + chunk * 2 * channels;
    float* db_part = dw_part + channels;
    std::memset(dw_part, 0, static_cast<size_t>(2 * channels) * sizeof(float));
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * channels;
      const float* g = dout + r * channels;
      const float m = mean[r];
      const float s = rstd[r];
      float dnorm_mean = 0.0f;
      float dnorm_norm_mean = 0.0f;
      for (int64_t c = 0; c < channels; ++c) {
        const float norm = (xr[c] - m) * s;
        const float dnorm = weight[c] * g[c];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * norm;
        dw_part[c] += g[c] * norm;
        db_part[c] += g[c];
      }
      dnorm_mean *= inv_c;
      dnorm_norm_mean *= inv_c;
      float* dxr = dx + r * channels;
      for (int64_t c = 0; c < channels; ++c) {
        const float norm = (xr[c] - m) * s;
        const float value = (weight[c] * g[c] - dnorm_mean - norm * dnorm_norm_mean) * s;
        dxr[c] = accumulate_dx ? dxr[c] + value : value;
      }
    }
  });
  std::memset(dweight, 0, static_cast<size_t>(channels) * sizeof(float));
  std::memset(dbias, 0, static_cast<size_t>(channels) * sizeof(float));
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const float* dw_part = partials.data() + chunk * 2 * channels;
    const float* db_part = dw_part + channels;
    for (int64_t c = 0; c < channels; ++c) {
      dweight[c] += dw_part[c];
      dbias[c] += db_part[c];
    }
  }
}

}  // namespace tessera::cpu

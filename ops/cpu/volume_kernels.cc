#include "ops/cpu/volume_kernels.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ops/cpu/blas.h"
#include "ops/cpu/parallel.h"
#include "ops/volume_ops.h"

namespace tessera::cpu {

using detail::ParallelFor;

namespace {

constexpr int64_t kElementGrain = 1 << 14;
// Voxels per task of the segmentation loss and metric (fixed: the basis of their determinism).
constexpr int64_t kVoxelChunk = 1024;

// Calls fn(column, od, oh, ow_begin, ow_end) for each run of output positions [p0, p1) that
// shares (od, oh); `column` is the run's first position minus p0.
template <typename Fn>
void ForEachRun(const Conv3dGeometry& g, int64_t p0, int64_t p1, const Fn& fn) {
  const int64_t plane = g.out_h * g.out_w;
  for (int64_t p = p0; p < p1;) {
    const int64_t od = p / plane, oh = (p / g.out_w) % g.out_h, ow0 = p % g.out_w;
    const int64_t ow1 = std::min(g.out_w, ow0 + (p1 - p));
    fn(p - p0, od, oh, ow0, ow1);
    p += ow1 - ow0;
  }
}

// col [ColumnRows(), p1 - p0]: row (c, a, b, e) holds x[c, o_d*s-pad+a, o_h*s-pad+b, o_w*s-pad+e]
// (zero outside x) for the output positions o in [p0, p1). vol is one sample [Cin, D, H, W].
void Vol2Col(float* col, const float* vol, const Conv3dGeometry& g, int64_t p0, int64_t p1) {
  const int64_t cols = p1 - p0, taps = g.kd * g.kh * g.kw;
  ParallelFor(
      g.ColumnRows(), std::max<int64_t>(1, kElementGrain / cols), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t c = r / taps, tap = r % taps;
          const int64_t a = tap / (g.kh * g.kw), b = (tap / g.kw) % g.kh, e = tap % g.kw;
          const float* v = vol + c * g.InVolume();
          float* out = col + r * cols;
          ForEachRun(g, p0, p1, [&](int64_t j, int64_t od, int64_t oh, int64_t ow0, int64_t ow1) {
            float* dst = out + j - ow0;
            const int64_t id = od * g.stride - g.padding_d + a, ih = oh * g.stride - g.padding + b;
            if (id < 0 || id >= g.in_d || ih < 0 || ih >= g.in_h) {
              std::fill(dst + ow0, dst + ow1, 0.0f);
              return;
            }
            const float* src = v + (id * g.in_h + ih) * g.in_w;
            for (int64_t ow = ow0; ow < ow1; ++ow) {
              const int64_t iw = ow * g.stride - g.padding + e;
              dst[ow] = iw >= 0 && iw < g.in_w ? src[iw] : 0.0f;
            }
          });
        }
      });
}

// The adjoint of Vol2Col, accumulating: vol[c, ...] += each column entry at the voxel Vol2Col
// read it from. One task per channel adds that channel's taps in order: no races, a fixed order.
void Col2Vol(float* vol, const float* col, const Conv3dGeometry& g, int64_t p0, int64_t p1) {
  const int64_t cols = p1 - p0, taps = g.kd * g.kh * g.kw;
  ParallelFor(g.in_channels, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float* v = vol + c * g.InVolume();
      for (int64_t tap = 0; tap < taps; ++tap) {
        const int64_t a = tap / (g.kh * g.kw), b = (tap / g.kw) % g.kh, e = tap % g.kw;
        const float* in = col + (c * taps + tap) * cols;
        ForEachRun(g, p0, p1, [&](int64_t j, int64_t od, int64_t oh, int64_t ow0, int64_t ow1) {
          const float* src = in + j - ow0;
          const int64_t id = od * g.stride - g.padding_d + a, ih = oh * g.stride - g.padding + b;
          if (id < 0 || id >= g.in_d || ih < 0 || ih >= g.in_h) return;
          float* dst = v + (id * g.in_h + ih) * g.in_w;
          for (int64_t ow = ow0; ow < ow1; ++ow) {
            const int64_t iw = ow * g.stride - g.padding + e;
            if (iw >= 0 && iw < g.in_w) dst[iw] += src[ow];
          }
        });
      }
    }
  });
}

// rows [rows, length] of t set to value[row] (or zero when value is null).
void FillRows(float* t, const float* value, int64_t rows, int64_t length, int64_t stride) {
  ParallelFor(rows, std::max<int64_t>(1, kElementGrain / std::max<int64_t>(length, 1)),
              [&](int64_t r0, int64_t r1) {
                for (int64_t r = r0; r < r1; ++r) {
                  std::fill(t + r * stride, t + r * stride + length,
                            value == nullptr ? 0.0f : value[r]);
                }
              });
}

}  // namespace

int64_t DefaultPositionsPerChunk(int64_t column_rows, int64_t out_volume) {
  return Conv3dPositionsPerChunk(column_rows, out_volume);
}

int64_t Conv3dWorkspaceFloats(const Conv3dGeometry& g) {
  return g.ColumnRows() * std::min(g.positions_per_chunk, g.OutVolume());
}

void Conv3dForward(float* y, const float* x, const float* weight, const float* bias,
                   const Conv3dGeometry& g, float* workspace, int64_t split_min_flops) {
  const int64_t rows = g.ColumnRows(), positions = g.OutVolume();
  for (int64_t n = 0; n < g.batch; ++n) {
    const float* xn = x + n * g.in_channels * g.InVolume();
    float* yn = y + n * g.out_channels * positions;
    for (int64_t p0 = 0; p0 < positions; p0 += g.positions_per_chunk) {
      const int64_t p1 = std::min(positions, p0 + g.positions_per_chunk), cols = p1 - p0;
      Vol2Col(workspace, xn, g, p0, p1);
      if (bias != nullptr) FillRows(yn + p0, bias, g.out_channels, cols, positions);
      Gemm(Transpose::kNo, Transpose::kNo, g.out_channels, cols, rows, 1.0f, weight, rows,
           workspace, cols, bias != nullptr ? 1.0f : 0.0f, yn + p0, positions, split_min_flops);
    }
  }
}

void Conv3dInputGradient(float* x, const float* y, const float* weight, const float* bias,
                         const Conv3dGeometry& g, float* workspace, int64_t split_min_flops) {
  const int64_t rows = g.ColumnRows(), positions = g.OutVolume();
  for (int64_t n = 0; n < g.batch; ++n) {
    float* xn = x + n * g.in_channels * g.InVolume();
    const float* yn = y + n * g.out_channels * positions;
    FillRows(xn, bias, g.in_channels, g.InVolume(), g.InVolume());
    for (int64_t p0 = 0; p0 < positions; p0 += g.positions_per_chunk) {
      const int64_t p1 = std::min(positions, p0 + g.positions_per_chunk), cols = p1 - p0;
      // col = weight^T [rows, Cout] @ y[:, p0:p1]
      Gemm(Transpose::kYes, Transpose::kNo, rows, cols, g.out_channels, 1.0f, weight, rows, yn + p0,
           positions, 0.0f, workspace, cols, split_min_flops);
      Col2Vol(xn, workspace, g, p0, p1);
    }
  }
}

void Conv3dWeightGradient(float* dweight, const float* dy, const float* x, const Conv3dGeometry& g,
                          float* workspace, int64_t split_min_flops) {
  const int64_t rows = g.ColumnRows(), positions = g.OutVolume();
  std::memset(dweight, 0, static_cast<size_t>(g.out_channels * rows) * sizeof(float));
  for (int64_t n = 0; n < g.batch; ++n) {
    const float* xn = x + n * g.in_channels * g.InVolume();
    const float* dyn = dy + n * g.out_channels * positions;
    for (int64_t p0 = 0; p0 < positions; p0 += g.positions_per_chunk) {
      const int64_t p1 = std::min(positions, p0 + g.positions_per_chunk), cols = p1 - p0;
      Vol2Col(workspace, xn, g, p0, p1);
      // dweight += dy[:, p0:p1] @ col^T
      Gemm(Transpose::kNo, Transpose::kYes, g.out_channels, rows, cols, 1.0f, dyn + p0, positions,
           workspace, cols, 1.0f, dweight, rows, split_min_flops);
    }
  }
}

void ChannelSums(float* out, const float* t, int64_t batch, int64_t channels, int64_t spatial) {
  ParallelFor(channels, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      double sum = 0;
      for (int64_t n = 0; n < batch; ++n) {
        const float* row = t + (n * channels + c) * spatial;
        for (int64_t s = 0; s < spatial; ++s) sum += row[s];
      }
      out[c] = static_cast<float>(sum);
    }
  });
}

void ChannelBiasAdd(float* y, const float* x, const float* bias, int64_t batch, int64_t channels,
                    int64_t spatial) {
  ParallelFor(batch * channels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float b = bias[p % channels];
      const float* in = x + p * spatial;
      float* out = y + p * spatial;
      for (int64_t s = 0; s < spatial; ++s) out[s] = in[s] + b;
    }
  });
}

// ---- nearest upsampling ----

void UpsampleNearest3dForward(float* y, const float* x, int64_t planes, int64_t d, int64_t h,
                              int64_t w, int64_t scale) {
  const int64_t yh = h * scale, yw = w * scale, rows = planes * d * scale * yh;
  ParallelFor(rows, std::max<int64_t>(1, kElementGrain / yw), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t plane = r / (d * scale * yh), yd = (r / yh) % (d * scale), row = r % yh;
      const float* src = x + ((plane * d + yd / scale) * h + row / scale) * w;
      float* dst = y + r * yw;
      for (int64_t j = 0; j < yw; ++j) dst[j] = src[j / scale];
    }
  });
}

void UpsampleNearest3dBackward(float* dx, const float* dy, int64_t planes, int64_t d, int64_t h,
                               int64_t w, int64_t scale) {
  const int64_t yh = h * scale, yw = w * scale, rows = planes * d * h;
  ParallelFor(rows, std::max<int64_t>(1, kElementGrain / (w * scale * scale * scale)),
              [&](int64_t r0, int64_t r1) {
                for (int64_t r = r0; r < r1; ++r) {
                  const int64_t plane = r / (d * h), i = (r / h) % d, j = r % h;
                  float* dst = dx + r * w;
                  for (int64_t l = 0; l < w; ++l) {
                    float sum = 0.0f;
                    for (int64_t a = 0; a < scale; ++a) {
                      for (int64_t b = 0; b < scale; ++b) {
                        const float* src =
                            dy + ((plane * d * scale + i * scale + a) * yh + j * scale + b) * yw +
                            l * scale;
                        for (int64_t e = 0; e < scale; ++e) sum += src[e];
                      }
                    }
                    dst[l] = sum;
                  }
                }
              });
}

// ---- max pooling ----

void MaxPool3dForward(float* y, int32_t* indices, const float* x, int64_t planes, int64_t d,
                      int64_t h, int64_t w, int64_t k) {
  const int64_t od = d / k, oh = h / k, ow = w / k, rows = planes * od * oh;
  ParallelFor(rows, std::max<int64_t>(1, kElementGrain / (ow * k * k * k)),
              [&](int64_t r0, int64_t r1) {
                for (int64_t r = r0; r < r1; ++r) {
                  const int64_t plane = r / (od * oh), i = (r / oh) % od, j = r % oh;
                  const float* xp = x + plane * d * h * w;
                  for (int64_t l = 0; l < ow; ++l) {
                    // PyTorch's scan: first element's index, -inf, then (v > best || isnan(v)) in
                    // d, h, w order.
                    int64_t best_index = (i * k * h + j * k) * w + l * k;
                    float best = -std::numeric_limits<float>::infinity();
                    for (int64_t a = 0; a < k; ++a) {
                      for (int64_t b = 0; b < k; ++b) {
                        const int64_t base = ((i * k + a) * h + j * k + b) * w + l * k;
                        for (int64_t e = 0; e < k; ++e) {
                          const float v = xp[base + e];
                          if (v > best || std::isnan(v)) {
                            best = v;
                            best_index = base + e;
                          }
                        }
                      }
                    }
                    y[r * ow + l] = best;
                    indices[r * ow + l] = static_cast<int32_t>(best_index);
                  }
                }
              });
}

Status MaxPool3dBackward(float* dx, const float* dy, const int32_t* indices, int64_t planes,
                         int64_t volume, int64_t pooled_volume) {
  for (int64_t o = 0; o < planes * pooled_volume; ++o) {
    if (indices[o] < 0 || indices[o] >= volume) {
      return InvalidArgument("max_pool3d index {} at element {} is outside the volume [0, {})",
                             indices[o], o, volume);
    }
  }
  ParallelFor(planes, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* dxp = dx + p * volume;
      std::fill(dxp, dxp + volume, 0.0f);
      for (int64_t o = p * pooled_volume; o < (p + 1) * pooled_volume; ++o) {
        dxp[indices[o]] += dy[o];
      }
    }
  });
  return Status::Ok();
}

// ---- group normalisation ----

void GroupNormForward(float* y, float* mean, float* rstd, const float* x, const float* weight,
                      const float* bias, int64_t batch, int64_t channels, int64_t spatial,
                      int64_t groups, float eps) {
  const int64_t rows = batch * channels, per_group = channels / groups;
  const double count = static_cast<double>(per_group * spatial);
  std::vector<double> row_sums(static_cast<size_t>(rows));
  // Each (n, c) row sums in double on one thread; groups combine their rows in channel order.
  ParallelFor(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      double sum = 0;
      for (int64_t s = 0; s < spatial; ++s) sum += x[r * spatial + s];
      row_sums[static_cast<size_t>(r)] = sum;
    }
  });
  auto group_total = [&](int64_t n, int64_t g) {
    double total = 0;
    for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
      total += row_sums[static_cast<size_t>(n * channels + c)];
    }
    return total;
  };
  for (int64_t n = 0; n < batch; ++n) {
    for (int64_t g = 0; g < groups; ++g) {
      mean[n * groups + g] = static_cast<float>(group_total(n, g) / count);
    }
  }
  ParallelFor(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const double m = mean[(r / channels) * groups + (r % channels) / per_group];
      double sum = 0;
      for (int64_t s = 0; s < spatial; ++s) {
        const double centred = x[r * spatial + s] - m;
        sum += centred * centred;
      }
      row_sums[static_cast<size_t>(r)] = sum;
    }
  });
  for (int64_t n = 0; n < batch; ++n) {
    for (int64_t g = 0; g < groups; ++g) {
      rstd[n * groups + g] = static_cast<float>(1.0 / std::sqrt(group_total(n, g) / count + eps));
    }
  }
  ParallelFor(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t c = r % channels, stat = (r / channels) * groups + c / per_group;
      const float m = mean[stat], s = rstd[stat], wc = weight[c], bc = bias[c];
      const float* xr = x + r * spatial;
      float* yr = y + r * spatial;
      for (int64_t i = 0; i < spatial; ++i) yr[i] = (xr[i] - m) * s * wc + bc;
    }
  });
}

void GroupNormBackward(float* dx, float* dweight, float* dbias, const float* dy, const float* x,
                       const float* weight, const float* mean, const float* rstd, int64_t batch,
                       int64_t channels, int64_t spatial, int64_t groups) {
  const int64_t rows = batch * channels, per_group = channels / groups;
  const double count = static_cast<double>(per_group * spatial);
  // Per (n, c) row: sum of dy and of dy * xhat, in double.
  std::vector<double> dy_sums(static_cast<size_t>(rows)), dy_xhat_sums(static_cast<size_t>(rows));
  ParallelFor(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t stat = (r / channels) * groups + (r % channels) / per_group;
      const float m = mean[stat], s = rstd[stat];
      double sum = 0, sum_xhat = 0;
      for (int64_t i = 0; i < spatial; ++i) {
        const float g = dy[r * spatial + i];
        sum += g;
        sum_xhat += static_cast<double>(g) * ((x[r * spatial + i] - m) * s);
      }
      dy_sums[static_cast<size_t>(r)] = sum;
      dy_xhat_sums[static_cast<size_t>(r)] = sum_xhat;
    }
  });
  for (int64_t c = 0; c < channels; ++c) {
    double dw = 0, db = 0;
    for (int64_t n = 0; n < batch; ++n) {
      dw += dy_xhat_sums[static_cast<size_t>(n * channels + c)];
      db += dy_sums[static_cast<size_t>(n * channels + c)];
    }
    dweight[c] = static_cast<float>(dw);
    dbias[c] = static_cast<float>(db);
  }
  // Per (n, g): the means over the group of dxhat = dy * weight and of dxhat * xhat.
  std::vector<float> mean_dxhat(static_cast<size_t>(batch * groups));
  std::vector<float> mean_dxhat_xhat(static_cast<size_t>(batch * groups));
  for (int64_t n = 0; n < batch; ++n) {
    for (int64_t g = 0; g < groups; ++g) {
      double a = 0, b = 0;
      for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
        a += weight[c] * dy_sums[static_cast<size_t>(n * channels + c)];
        b += weight[c] * dy_xhat_sums[static_cast<size_t>(n * channels + c)];
      }
      mean_dxhat[static_cast<size_t>(n * groups + g)] = static_cast<float>(a / count);
      mean_dxhat_xhat[static_cast<size_t>(n * groups + g)] = static_cast<float>(b / count);
    }
  }
  ParallelFor(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t c = r % channels, stat = (r / channels) * groups + c / per_group;
      const float m = mean[stat], s = rstd[stat], wc = weight[c];
      const float m1 = mean_dxhat[static_cast<size_t>(stat)];
      const float m2 = mean_dxhat_xhat[static_cast<size_t>(stat)];
      for (int64_t i = 0; i < spatial; ++i) {
        const float xhat = (x[r * spatial + i] - m) * s;
        dx[r * spatial + i] = (wc * dy[r * spatial + i] - m1 - xhat * m2) * s;
      }
    }
  });
}

// ---- activations ----

void ReluForward(float* y, const float* x, int64_t n) {
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
  });
}

void ReluBackward(float* dx, const float* dy, const float* x, int64_t n) {
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
  });
}

void LeakyReluForward(float* y, const float* x, int64_t n) {
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) y[i] = x[i] > 0.0f ? x[i] : kLeakyReluSlope * x[i];
  });
}

void LeakyReluBackward(float* dx, const float* dy, const float* x, int64_t n) {
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dx[i] = x[i] > 0.0f ? dy[i] : kLeakyReluSlope * dy[i];
  });
}

void SiluForward(float* y, const float* x, int64_t n) {
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) y[i] = x[i] / (1.0f + std::exp(-x[i]));
  });
}

void SiluBackward(float* dx, const float* dy, const float* x, int64_t n) {
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float s = 1.0f / (1.0f + std::exp(-x[i]));
      dx[i] = dy[i] * s * (1.0f + x[i] * (1.0f - s));
    }
  });
}

// ---- concatenation ----

void ConcatForward(float* out, const float* a, const float* b, int64_t outer, int64_t a_inner,
                   int64_t b_inner) {
  const int64_t inner = a_inner + b_inner;
  ParallelFor(outer, 1, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) {
      std::memcpy(out + o * inner, a + o * a_inner, static_cast<size_t>(a_inner) * sizeof(float));
      std::memcpy(out + o * inner + a_inner, b + o * b_inner,
                  static_cast<size_t>(b_inner) * sizeof(float));
    }
  });
}

void ConcatBackward(float* da, float* db, const float* dout, int64_t outer, int64_t a_inner,
                    int64_t b_inner) {
  const int64_t inner = a_inner + b_inner;
  ParallelFor(outer, 1, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) {
      std::memcpy(da + o * a_inner, dout + o * inner, static_cast<size_t>(a_inner) * sizeof(float));
      std::memcpy(db + o * b_inner, dout + o * inner + a_inner,
                  static_cast<size_t>(b_inner) * sizeof(float));
    }
  });
}

// ---- segmentation ----

namespace {

Status CheckTargets(const int32_t* targets, int64_t voxels, int64_t classes) {
  for (int64_t v = 0; v < voxels; ++v) {
    if (targets[v] < 0 || targets[v] >= classes) {
      return InvalidArgument("target class {} at voxel {} is outside [0, {})", targets[v], v,
                             classes);
    }
  }
  return Status::Ok();
}

// Voxel chunks per sample of `spatial` voxels (the last may be partial).
int64_t VoxelChunksPerSample(int64_t spatial) { return (spatial + kVoxelChunk - 1) / kVoxelChunk; }

// fn(task, n, s0, s1) for the fixed voxel chunks of each sample, in parallel; task is
// n * VoxelChunksPerSample(spatial) + the chunk's index within sample n.
template <typename Fn>
void ForEachVoxelChunk(int64_t batch, int64_t spatial, const Fn& fn) {
  const int64_t per_sample = VoxelChunksPerSample(spatial);
  ParallelFor(batch * per_sample, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t / per_sample, s0 = (t % per_sample) * kVoxelChunk;
      fn(t, n, s0, std::min(spatial, s0 + kVoxelChunk));
    }
  });
}

}  // namespace

Result<float> VoxelCrossEntropy(float* dlogits, const float* logits, const int32_t* targets,
                                int64_t batch, int64_t classes, int64_t spatial, float grad_scale) {
  const int64_t voxels = batch * spatial;
  TESSERA_RETURN_IF_ERROR(CheckTargets(targets, voxels, classes));
  if (voxels == 0) return 0.0f;
  const float scale = static_cast<float>(grad_scale / static_cast<double>(voxels));
  std::vector<double> partial(static_cast<size_t>(batch * VoxelChunksPerSample(spatial)));
  ForEachVoxelChunk(batch, spatial, [&](int64_t task, int64_t n, int64_t s0, int64_t s1) {
    const int64_t width = s1 - s0;
    const float* l = logits + n * classes * spatial + s0;
    const int32_t* t = targets + n * spatial + s0;
    // Per voxel of the chunk (the first `width` entries): the largest logit, the sum of
    // exp(logit - largest), the target's logit.
    std::array<float, kVoxelChunk> best, sum, target_logit;
    std::fill_n(best.begin(), width, -std::numeric_limits<float>::infinity());
    std::fill_n(sum.begin(), width, 0.0f);
    // Read everything the loss needs before dlogits (possibly the logits) is written.
    for (int64_t s = 0; s < width; ++s) target_logit[s] = l[t[s] * spatial + s];
    for (int64_t c = 0; c < classes; ++c) {
      for (int64_t s = 0; s < width; ++s) best[s] = std::max(best[s], l[c * spatial + s]);
    }
    float* d = dlogits == nullptr ? nullptr : dlogits + n * classes * spatial + s0;
    for (int64_t c = 0; c < classes; ++c) {
      for (int64_t s = 0; s < width; ++s) {
        const float e = std::exp(l[c * spatial + s] - best[s]);
        if (d != nullptr) d[c * spatial + s] = e;
        sum[s] += e;
      }
    }
    double loss = 0;
    for (int64_t s = 0; s < width; ++s) {
      loss +=
          static_cast<double>(best[s]) + std::log(static_cast<double>(sum[s])) - target_logit[s];
    }
    partial[static_cast<size_t>(task)] = loss;
    if (d == nullptr) return;
    for (int64_t s = 0; s < width; ++s) sum[s] = scale / sum[s];
    for (int64_t c = 0; c < classes; ++c) {
      for (int64_t s = 0; s < width; ++s) d[c * spatial + s] *= sum[s];
    }
    for (int64_t s = 0; s < width; ++s) d[t[s] * spatial + s] -= scale;
  });
  double total = 0;
  for (double loss : partial) total += loss;
  return static_cast<float>(total / static_cast<double>(voxels));
}

void DownsampleLabels(int32_t* coarse, const int32_t* targets, int64_t batch, int64_t d, int64_t h,
                      int64_t w, int64_t factor) {
  const int64_t cd = d / factor, ch = h / factor, cw = w / factor, half = factor / 2;
  for (int64_t n = 0; n < batch; ++n) {
    for (int64_t z = 0; z < cd; ++z) {
      for (int64_t y = 0; y < ch; ++y) {
        const int32_t* row = targets + ((n * d + z * factor + half) * h + y * factor + half) * w;
        int32_t* out = coarse + ((n * cd + z) * ch + y) * cw;
        for (int64_t x = 0; x < cw; ++x) out[x] = row[x * factor + half];
      }
    }
  }
}

Result<float> DiceScore(const float* logits, const int32_t* targets, int64_t batch, int64_t classes,
                        int64_t spatial) {
  TESSERA_RETURN_IF_ERROR(CheckTargets(targets, batch * spatial, classes));
  const int64_t per_sample = VoxelChunksPerSample(spatial);
  // Per task and class: [intersection, predicted, target] voxel counts (integers: exact).
  std::vector<int64_t> counts(static_cast<size_t>(batch * per_sample * classes * 3), 0);
  ForEachVoxelChunk(batch, spatial, [&](int64_t task, int64_t n, int64_t s0, int64_t s1) {
    int64_t* count = counts.data() + task * classes * 3;
    const float* l = logits + n * classes * spatial;
    for (int64_t s = s0; s < s1; ++s) {
      int64_t predicted = 0;
      for (int64_t c = 1; c < classes; ++c) {
        if (l[c * spatial + s] > l[predicted * spatial + s]) predicted = c;
      }
      const int64_t target = targets[n * spatial + s];
      count[predicted * 3 + 1] += 1;
      count[target * 3 + 2] += 1;
      if (predicted == target) count[predicted * 3] += 1;
    }
  });
  double total = 0;
  for (int64_t c = 1; c < classes; ++c) {
    int64_t both = 0, predicted = 0, target = 0;
    for (int64_t task = 0; task < batch * per_sample; ++task) {
      const int64_t* count = counts.data() + (task * classes + c) * 3;
      both += count[0];
      predicted += count[1];
      target += count[2];
    }
    total += predicted + target == 0
                 ? 1.0
                 : 2.0 * static_cast<double>(both) / static_cast<double>(predicted + target);
  }
  return static_cast<float>(total / static_cast<double>(classes - 1));
}

}  // namespace tessera::cpu

// The CPU kernels of spatial parallelism's ops (ops/volume_ops.h: slab_planes, halo_join,
// group_norm_stats, group_norm_slab): a slab's boundary planes, a slab joined with its
// neighbours' planes, and group normalisation with the statistics of every slab of the volume.
// Sums run in double in a fixed order per (sample, group), so results do not depend on the
// thread count.
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/cpu/parallel.h"
#include "ops/cpu/volume_kernels.h"
#include "ops/volume_ops.h"

namespace tessera::cpu {

using detail::ParallelFor;

namespace {

// Per (n, c) row of x [batch, channels, spatial]: the sum of f(x) in double.
template <typename Fn>
std::vector<double> RowSums(const float* x, int64_t rows, int64_t spatial, const Fn& f) {
  std::vector<double> sums(static_cast<size_t>(rows));
  ParallelFor(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      double sum = 0;
      for (int64_t s = 0; s < spatial; ++s) sum += f(x[r * spatial + s], r, s);
      sums[static_cast<size_t>(r)] = sum;
    }
  });
  return sums;
}

// A double as a high and a low f32 whose sum is it to ~48 bits.
void SplitDouble(double value, float* high, float* low) {
  *high = static_cast<float>(value);
  *low = static_cast<float>(value - static_cast<double>(*high));
}

}  // namespace

void SlabPlanes(float* first, float* last, const float* x, int64_t rows, int64_t depth,
                int64_t plane) {
  ParallelFor(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* slab = x + r * depth * plane;
      std::memcpy(first + r * plane, slab, static_cast<size_t>(plane) * sizeof(float));
      std::memcpy(last + r * plane, slab + (depth - 1) * plane,
                  static_cast<size_t>(plane) * sizeof(float));
    }
  });
}

void SlabPlanesBackward(float* dx, const float* dfirst, const float* dlast, int64_t rows,
                        int64_t depth, int64_t plane) {
  ParallelFor(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* slab = dx + r * depth * plane;
      std::memset(slab, 0, static_cast<size_t>(depth * plane) * sizeof(float));
      for (int64_t i = 0; i < plane; ++i) slab[i] += dfirst[r * plane + i];
      for (int64_t i = 0; i < plane; ++i) slab[(depth - 1) * plane + i] += dlast[r * plane + i];
    }
  });
}

void HaloJoin(float* out, const float* above, const float* x, const float* below, int64_t rows,
              int64_t depth, int64_t plane) {
  const auto bytes = [](int64_t floats) { return static_cast<size_t>(floats) * sizeof(float); };
  ParallelFor(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* joined = out + r * (depth + 2) * plane;
      std::memcpy(joined, above + r * plane, bytes(plane));
      std::memcpy(joined + plane, x + r * depth * plane, bytes(depth * plane));
      std::memcpy(joined + (depth + 1) * plane, below + r * plane, bytes(plane));
    }
  });
}

void HaloJoinBackward(float* dabove, float* dx, float* dbelow, const float* dout, int64_t rows,
                      int64_t depth, int64_t plane) {
  const auto bytes = [](int64_t floats) { return static_cast<size_t>(floats) * sizeof(float); };
  ParallelFor(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* joined = dout + r * (depth + 2) * plane;
      std::memcpy(dabove + r * plane, joined, bytes(plane));
      std::memcpy(dx + r * depth * plane, joined + plane, bytes(depth * plane));
      std::memcpy(dbelow + r * plane, joined + (depth + 1) * plane, bytes(plane));
    }
  });
}

void GroupNormSlabStats(float* stats, const float* x, const SlabNormShape& s) {
  const int64_t rows = s.batch * s.channels, per_group = s.channels / s.groups;
  const std::vector<double> sums =
      RowSums(x, rows, s.spatial, [](float v, int64_t, int64_t) { return double{v}; });
  const std::vector<double> squares =
      RowSums(x, rows, s.spatial, [](float v, int64_t, int64_t) { return double{v} * double{v}; });
  const int64_t block = s.batch * s.groups * kSlabStatsWidth;
  for (int64_t n = 0; n < s.batch; ++n) {
    for (int64_t g = 0; g < s.groups; ++g) {
      double sum = 0, square = 0;
      for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
        sum += sums[static_cast<size_t>(n * s.channels + c)];
        square += squares[static_cast<size_t>(n * s.channels + c)];
      }
      float* entry = stats + (n * s.groups + g) * kSlabStatsWidth;
      SplitDouble(sum, &entry[0], &entry[1]);
      SplitDouble(square, &entry[2], &entry[3]);
    }
  }
  for (int64_t p = 1; p < s.ranks; ++p) {
    std::memcpy(stats + p * block, stats, static_cast<size_t>(block) * sizeof(float));
  }
}

void GroupNormSlabStatsBackward(float* dx, const float* dstats, const float* x,
                                const SlabNormShape& s) {
  const int64_t rows = s.batch * s.channels, per_group = s.channels / s.groups;
  const int64_t block = s.batch * s.groups * kSlabStatsWidth;
  // Per (n, g): the gradients of the slab's sum and sum of squares, over the P blocks.
  std::vector<float> d_sum(static_cast<size_t>(s.batch * s.groups));
  std::vector<float> twice_d_square(d_sum.size());  // 2 dL/dQ: dQ/dx = 2 x
  for (int64_t i = 0; i < s.batch * s.groups; ++i) {
    double a = 0, b = 0;
    for (int64_t p = 0; p < s.ranks; ++p) {
      a += dstats[p * block + i * kSlabStatsWidth];
      b += dstats[p * block + i * kSlabStatsWidth + 2];
    }
    d_sum[static_cast<size_t>(i)] = static_cast<float>(a);
    twice_d_square[static_cast<size_t>(i)] = static_cast<float>(2 * b);
  }
  ParallelFor(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const auto stat =
          static_cast<size_t>((r / s.channels) * s.groups + (r % s.channels) / per_group);
      const float a = d_sum[stat], b = twice_d_square[stat];
      for (int64_t i = 0; i < s.spatial; ++i) dx[r * s.spatial + i] = a + b * x[r * s.spatial + i];
    }
  });
}

void GroupNormSlabForward(float* y, float* mean, float* rstd, const float* x, const float* stats,
                          const float* weight, const float* bias, const SlabNormShape& s,
                          float eps) {
  const int64_t rows = s.batch * s.channels, per_group = s.channels / s.groups;
  const int64_t block = s.batch * s.groups * kSlabStatsWidth;
  // Every slab holds as many voxels as this one.
  const double count = static_cast<double>(s.ranks * per_group * s.spatial);
  for (int64_t i = 0; i < s.batch * s.groups; ++i) {
    double sum = 0, square = 0;
    for (int64_t p = 0; p < s.ranks; ++p) {
      const float* entry = stats + p * block + i * kSlabStatsWidth;
      sum += double{entry[0]} + double{entry[1]};
      square += double{entry[2]} + double{entry[3]};
    }
    const double m = sum / count;
    const double variance = std::max(0.0, square / count - m * m);
    mean[i] = static_cast<float>(m);
    rstd[i] = static_cast<float>(1.0 / std::sqrt(variance + eps));
  }
  ParallelFor(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t c = r % s.channels, stat = (r / s.channels) * s.groups + c / per_group;
      const float m = mean[stat], sd = rstd[stat], wc = weight[c], bc = bias[c];
      const float* xr = x + r * s.spatial;
      float* yr = y + r * s.spatial;
      for (int64_t i = 0; i < s.spatial; ++i) yr[i] = (xr[i] - m) * sd * wc + bc;
    }
  });
}

void GroupNormSlabBackward(float* dx, float* dstats, float* dweight, float* dbias, const float* dy,
                           const float* x, const float* weight, const float* mean,
                           const float* rstd, const SlabNormShape& s) {
  const int64_t rows = s.batch * s.channels, per_group = s.channels / s.groups;
  const double count = static_cast<double>(s.ranks * per_group * s.spatial);
  const auto stat_of = [&](int64_t r) {
    return (r / s.channels) * s.groups + (r % s.channels) / per_group;
  };
  // Per (n, c) row: the sums of dy and of dy * xhat over this slab.
  const std::vector<double> dy_sums =
      RowSums(dy, rows, s.spatial, [](float g, int64_t, int64_t) { return double{g}; });
  const std::vector<double> dy_xhat_sums =
      RowSums(dy, rows, s.spatial, [&](float g, int64_t r, int64_t i) {
        const int64_t stat = stat_of(r);
        return double{g} * double{(x[r * s.spatial + i] - mean[stat]) * rstd[stat]};
      });
  for (int64_t c = 0; c < s.channels; ++c) {
    double dw = 0, db = 0;
    for (int64_t n = 0; n < s.batch; ++n) {
      dw += dy_xhat_sums[static_cast<size_t>(n * s.channels + c)];
      db += dy_sums[static_cast<size_t>(n * s.channels + c)];
    }
    dweight[c] = static_cast<float>(dw);
    dbias[c] = static_cast<float>(db);
  }
  // Per (n, g), with A = sum of dy * weight and B = sum of dy * weight * xhat over the slab:
  // dL/dmean (the variance held) = -rstd A, dL/dvariance = -rstd^2 B / 2, and through
  // mean = S / count and variance = Q / count - mean^2: dL/dS = (-rstd A + rstd^2 B mean) / count,
  // dL/dQ = -rstd^2 B / (2 count). Every block gets them, in both parts (each sum is its high
  // part plus its low); group_norm_stats_backward reads the high parts.
  const int64_t block = s.batch * s.groups * kSlabStatsWidth;
  for (int64_t n = 0; n < s.batch; ++n) {
    for (int64_t g = 0; g < s.groups; ++g) {
      double a = 0, b = 0;
      for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
        a += weight[c] * dy_sums[static_cast<size_t>(n * s.channels + c)];
        b += weight[c] * dy_xhat_sums[static_cast<size_t>(n * s.channels + c)];
      }
      const int64_t i = n * s.groups + g;
      const double sd = rstd[i], m = mean[i];
      const auto d_sum = static_cast<float>((-sd * a + sd * sd * b * m) / count);
      const auto d_square = static_cast<float>(-sd * sd * b / (2 * count));
      const float entry[kSlabStatsWidth] = {d_sum, d_sum, d_square, d_square};
      for (int64_t p = 0; p < s.ranks; ++p) {
        std::memcpy(dstats + p * block + i * kSlabStatsWidth, entry, sizeof(entry));
      }
    }
  }
  ParallelFor(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float scale = rstd[stat_of(r)] * weight[r % s.channels];
      for (int64_t i = 0; i < s.spatial; ++i) dx[r * s.spatial + i] = scale * dy[r * s.spatial + i];
    }
  });
}

}  // namespace tessera::cpu

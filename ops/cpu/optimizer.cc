// AdamW, 1-bit Adam and SGD on flat parameter groups, gradient norms and the clipping factor.
#include <algorithm>
#include <cmath>
#include <string_view>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/lane_sum.h"
#include "ops/cpu/kernels.h"
#include "ops/cpu/parallel.h"

namespace tessera::cpu {

namespace {
constexpr int64_t kOptimizerGrain = 1 << 15;
constexpr int64_t kNormChunk = 1 << 16;

// Calls segment(begin, end, decays) over [begin, end) of a group's piece in runs of constant
// weight decay: `decay_ranges` holds [begin, end) pairs in the group's coordinates, the piece's
// first element at element_offset.
template <typename Segment>
void ForDecaySegments(int64_t begin, int64_t end, const int64_t* decay_ranges,
                      int64_t num_decay_ranges, int64_t element_offset, Segment&& segment) {
  int64_t position = begin;
  for (int64_t r = 0; r < num_decay_ranges && position < end; ++r) {
    const int64_t decay_begin = std::clamp(decay_ranges[2 * r] - element_offset, position, end);
    const int64_t decay_end =
        std::clamp(decay_ranges[2 * r + 1] - element_offset, decay_begin, end);
    if (decay_begin > position) segment(position, decay_begin, false);
    if (decay_end > decay_begin) segment(decay_begin, decay_end, true);
    position = decay_end;
  }
  if (end > position) segment(position, end, false);
}

// The per-step scalars of an AdamW update, rounded to float once.
struct AdamWScalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float neg_step_size, bias_correction2_sqrt, grad_scale;
};

// One segment of constant weight decay (decay_factor 1 outside the decay ranges: p * 1 == p, so
// one kernel serves both). Every path below computes, per element and in this order:
//   g = grad * grad_scale;  p = param * decay_factor;
//   m' = m * beta1 + (1 - beta1) * g;  v' = v * beta2 + ((1 - beta2) * g) * g;
//   param = p + (neg_step_size * m') / (sqrt(v') / sqrt(bias_correction2) + eps)
// with exact division and square root. The vector paths fuse the m', v' and parameter
// multiply-adds (one rounding fewer), so they agree with the scalar path to an ulp or two, not bit
// for bit; within one path an element's result never depends on where it falls in a vector.
using AdamWSegmentFn = void (*)(const AdamWScalars&, float decay_factor, float* param, float* m,
                                float* v, const float* grad, int64_t n);

void AdamWSegmentScalar(const AdamWScalars& s, float decay_factor, float* param, float* m, float* v,
                        const float* grad, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * s.grad_scale;
    const float p = param[i] * decay_factor;
    const float m_new = m[i] * s.beta1 + s.one_minus_beta1 * g;
    const float v_new = v[i] * s.beta2 + s.one_minus_beta2 * g * g;
    const float denom = std::sqrt(v_new) / s.bias_correction2_sqrt + s.eps;
    m[i] = m_new;
    v[i] = v_new;
    param[i] = p + s.neg_step_size * m_new / denom;
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void AdamWSegmentAvx2(const AdamWScalars& s, float decay_factor,
                                                          float* param, float* m, float* v,
                                                          const float* grad, int64_t n) {
  const __m256 beta1 = _mm256_set1_ps(s.beta1), one_minus_beta1 = _mm256_set1_ps(s.one_minus_beta1);
  const __m256 beta2 = _mm256_set1_ps(s.beta2), one_minus_beta2 = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 eps = _mm256_set1_ps(s.eps), neg_step = _mm256_set1_ps(s.neg_step_size);
  const __m256 bc2 = _mm256_set1_ps(s.bias_correction2_sqrt);
  const __m256 scale = _mm256_set1_ps(s.grad_scale), decay = _mm256_set1_ps(decay_factor);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad + i), scale);
    const __m256 m_new =
        _mm256_fmadd_ps(_mm256_loadu_ps(m + i), beta1, _mm256_mul_ps(one_minus_beta1, g));
    const __m256 v_new = _mm256_fmadd_ps(_mm256_loadu_ps(v + i), beta2,
                                         _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, g), g));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v_new), bc2), eps);
    _mm256_storeu_ps(m + i, m_new);
    _mm256_storeu_ps(v + i, v_new);
    const __m256 step = _mm256_div_ps(_mm256_mul_ps(neg_step, m_new), denom);
    _mm256_storeu_ps(param + i, _mm256_fmadd_ps(_mm256_loadu_ps(param + i), decay, step));
  }
  // The tail with the same fused operations as the vector body, so an element's result does not
  // depend on where a range or shard boundary puts it.
  for (; i < n; ++i) {
    const float g = grad[i] * s.grad_scale;
    const float m_new = std::fma(m[i], s.beta1, s.one_minus_beta1 * g);
    const float v_new = std::fma(v[i], s.beta2, (s.one_minus_beta2 * g) * g);
    const float denom = std::sqrt(v_new) / s.bias_correction2_sqrt + s.eps;
    m[i] = m_new;
    v[i] = v_new;
    param[i] = std::fma(param[i], decay_factor, (s.neg_step_size * m_new) / denom);
  }
}

// GCC 12's avx512fintrin.h seeds _mm512_sqrt_ps with a self-initialised "undefined" vector and then
// warns about it (-Wmaybe-uninitialized); the value is never read.
#if !defined(__clang__)  // a GCC warning, unknown to Clang
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
__attribute__((target("avx512f"))) void AdamWSegmentAvx512(const AdamWScalars& s,
                                                           float decay_factor, float* param,
                                                           float* m, float* v, const float* grad,
                                                           int64_t n) {
  const __m512 beta1 = _mm512_set1_ps(s.beta1), one_minus_beta1 = _mm512_set1_ps(s.one_minus_beta1);
  const __m512 beta2 = _mm512_set1_ps(s.beta2), one_minus_beta2 = _mm512_set1_ps(s.one_minus_beta2);
  const __m512 eps = _mm512_set1_ps(s.eps), neg_step = _mm512_set1_ps(s.neg_step_size);
  const __m512 bc2 = _mm512_set1_ps(s.bias_correction2_sqrt);
  const __m512 scale = _mm512_set1_ps(s.grad_scale), decay = _mm512_set1_ps(decay_factor);
  for (int64_t i = 0; i < n; i += 16) {
    // The tail is the same loop body under a mask: masked lanes are neither read nor written.
    const __mmask16 lanes =
        n - i >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, grad + i), scale);
    const __m512 m_new = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, m + i), beta1,
                                         _mm512_mul_ps(one_minus_beta1, g));
    const __m512 v_new = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, v + i), beta2,
                                         _mm512_mul_ps(_mm512_mul_ps(one_minus_beta2, g), g));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v_new), bc2), eps);
    _mm512_mask_storeu_ps(m + i, lanes, m_new);
    _mm512_mask_storeu_ps(v + i, lanes, v_new);
    const __m512 step = _mm512_div_ps(_mm512_mul_ps(neg_step, m_new), denom);
    _mm512_mask_storeu_ps(param + i, lanes,
                          _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, param + i), decay, step));
  }
}
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

AdamWSegmentFn AdamWSegmentFor(SimdLevel level) {
#if defined(__x86_64__)
  switch (std::min(level, BestSimdLevel())) {
    case SimdLevel::kAvx512:
      return AdamWSegmentAvx512;
    case SimdLevel::kAvx2:
      return AdamWSegmentAvx2;
    case SimdLevel::kScalar:
      break;
  }
#else
  (void)level;
#endif
  return AdamWSegmentScalar;
}
}  // namespace

SimdLevel BestSimdLevel() {
#if defined(__x86_64__)
  static const SimdLevel best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return SimdLevel::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return SimdLevel::kAvx2;
    return SimdLevel::kScalar;
  }();
  return best;
#else
  return SimdLevel::kScalar;
#endif
}

std::string_view SimdLevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512:
      return "avx512";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kScalar:
      break;
  }
  return "scalar";
}

void AdamWUpdate(float* param, float* m, float* v, const float* grad, int64_t n,
                 const AdamWConfig& config, float lr, int64_t step, float grad_scale,
                 const int64_t* decay_ranges, int64_t num_decay_ranges, int64_t element_offset,
                 const KernelExecution& execution) {
  // Scalars computed in double and rounded once, as PyTorch does with its Python floats.
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(config.beta1), step);
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(config.beta2), step);
  const AdamWScalars scalars{
      .beta1 = config.beta1,
      .one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(config.beta1)),
      .beta2 = config.beta2,
      .one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(config.beta2)),
      .eps = config.eps,
      .neg_step_size = static_cast<float>(-(static_cast<double>(lr) / bias_correction1)),
      .bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2)),
      .grad_scale = grad_scale,
  };
  const float decay_factor =
      static_cast<float>(1.0 - static_cast<double>(lr) * static_cast<double>(config.weight_decay));
  const AdamWSegmentFn segment = AdamWSegmentFor(execution.simd);
  auto update_range = [&](int64_t begin, int64_t end) {
    ForDecaySegments(begin, end, decay_ranges, num_decay_ranges, element_offset,
                     [&](int64_t from, int64_t to, bool decays) {
                       segment(scalars, decays ? decay_factor : 1.0f, param + from, m + from,
                               v + from, grad + from, to - from);
                     });
  };
  if (execution.parallel) {
    detail::ParallelFor(n, kOptimizerGrain, update_range);
  } else {
    update_range(0, n);
  }
}

namespace {

// The 1-bit Adam update of [begin, end) (kernels.h): param -= lr * (m / (sqrt(v) + eps) + wd *
// param), wd the config's inside the decay ranges, else 0.
void OneBitAdamUpdateRange(float* param, const float* m, const float* v, int64_t begin, int64_t end,
                           const OneBitAdamConfig& config, float lr, const int64_t* decay_ranges,
                           int64_t num_decay_ranges, int64_t element_offset) {
  ForDecaySegments(begin, end, decay_ranges, num_decay_ranges, element_offset,
                   [&](int64_t from, int64_t to, bool decays) {
                     const float wd = decays ? config.weight_decay : 0.f;
                     for (int64_t i = from; i < to; ++i) {
                       const float update = m[i] / (std::sqrt(v[i]) + config.eps) + wd * param[i];
                       param[i] = param[i] - lr * update;
                     }
                   });
}

}  // namespace

void OneBitAdamWarmup(float* param, float* m, float* v, const float* grad, int64_t n,
                      const OneBitAdamConfig& config, float lr, float grad_scale,
                      const int64_t* decay_ranges, int64_t num_decay_ranges,
                      int64_t element_offset) {
  const auto one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(config.beta1));
  const auto one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(config.beta2));
  // Locals, not config's fields: a store to m or v might alias those (both float), which keeps
  // the loop from vectorising.
  const float beta1 = config.beta1, beta2 = config.beta2;
  detail::ParallelFor(n, kOptimizerGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float g = grad[i] * grad_scale;
      m[i] = m[i] * beta1 + one_minus_beta1 * g;
      v[i] = v[i] * beta2 + one_minus_beta2 * g * g;
    }
    OneBitAdamUpdateRange(param, m, v, begin, end, config, lr, decay_ranges, num_decay_ranges,
                          element_offset);
  });
}

void OneBitAdamMomentum(float* m, const float* grad, int64_t n, float beta1, float grad_scale) {
  const auto one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(beta1));
  detail::ParallelFor(n, kOptimizerGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      m[i] = m[i] * beta1 + one_minus_beta1 * (grad[i] * grad_scale);
  });
}

void OneBitAdamFrozenUpdate(float* param, const float* m, const float* v, int64_t n,
                            const OneBitAdamConfig& config, float lr, const int64_t* decay_ranges,
                            int64_t num_decay_ranges, int64_t element_offset) {
  detail::ParallelFor(n, kOptimizerGrain, [&](int64_t begin, int64_t end) {
    OneBitAdamUpdateRange(param, m, v, begin, end, config, lr, decay_ranges, num_decay_ranges,
                          element_offset);
  });
}

namespace {

// 0/1 Adam's per-element loops over one run of constant weight decay. The arrays are distinct
// buffers: __restrict says so, without which GCC gives up vectorising loops that write three of
// them (5-7x slower on 11M elements).
struct ZeroOneScalars {
  float beta1, one_minus_beta1, eps, wd;
};

void ZeroOneLocalRun(float* __restrict param, float* __restrict m, const float* __restrict v,
                     float* __restrict start, const float* __restrict grad, int64_t n,
                     const ZeroOneScalars& s, float lr, float grad_scale, bool sync) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] = m[i] * s.beta1 + s.one_minus_beta1 * (grad[i] * grad_scale);
    const float denominator = std::sqrt(v[i]) + s.eps;
    const float update = m[i] / denominator + s.wd * param[i];
    param[i] = param[i] - lr * update;
    if (sync) {
      const float delta = param[i] - start[i];
      param[i] = start[i];
      start[i] = delta * denominator;
    }
  }
}

void ZeroOneSyncEndRun(float* __restrict param, float* __restrict m, const float* __restrict v,
                       float* __restrict start, int64_t n, const ZeroOneScalars& s, float lr_sum) {
  for (int64_t i = 0; i < n; ++i) {
    const float denominator = std::sqrt(v[i]) + s.eps;
    m[i] = -start[i] / lr_sum - s.wd * param[i] * denominator;
    param[i] = param[i] + start[i] / denominator;
    start[i] = param[i];
  }
}

ZeroOneScalars ZeroOneScalarsOf(const OneBitAdamConfig& config, bool decays) {
  return {config.beta1, static_cast<float>(1.0 - static_cast<double>(config.beta1)), config.eps,
          decays ? config.weight_decay : 0.f};
}

}  // namespace

void ZeroOneAdamLocal(float* param, float* m, const float* v, float* start, const float* grad,
                      int64_t n, const OneBitAdamConfig& config, float lr, float grad_scale,
                      bool sync, const int64_t* decay_ranges, int64_t num_decay_ranges,
                      int64_t element_offset) {
  detail::ParallelFor(n, kOptimizerGrain, [&](int64_t begin, int64_t end) {
    ForDecaySegments(begin, end, decay_ranges, num_decay_ranges, element_offset,
                     [&](int64_t from, int64_t to, bool decays) {
                       const ZeroOneScalars s = ZeroOneScalarsOf(config, decays);
                       // Two instantiations of the loop, not a branch in it.
                       if (sync) {
                         ZeroOneLocalRun(param + from, m + from, v + from, start + from,
                                         grad + from, to - from, s, lr, grad_scale, true);
                       } else {
                         ZeroOneLocalRun(param + from, m + from, v + from, start + from,
                                         grad + from, to - from, s, lr, grad_scale, false);
                       }
                     });
  });
}

void ZeroOneAdamSyncEnd(float* param, float* m, const float* v, float* start, int64_t n,
                        const OneBitAdamConfig& config, float lr_sum, const int64_t* decay_ranges,
                        int64_t num_decay_ranges, int64_t element_offset) {
  detail::ParallelFor(n, kOptimizerGrain, [&](int64_t begin, int64_t end) {
    ForDecaySegments(begin, end, decay_ranges, num_decay_ranges, element_offset,
                     [&](int64_t from, int64_t to, bool decays) {
                       ZeroOneSyncEndRun(param + from, m + from, v + from, start + from, to - from,
                                         ZeroOneScalarsOf(config, decays), lr_sum);
                     });
  });
}

void ScaleInPlace(float* x, int64_t n, float scale) {
  detail::ParallelFor(n, kOptimizerGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) x[i] *= scale;
  });
}

void SgdUpdate(float* param, const float* grad, int64_t n, float lr, float weight_decay,
               float grad_scale) {
  detail::ParallelFor(n, kOptimizerGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      param[i] -= lr * (grad[i] * grad_scale + weight_decay * param[i]);
    }
  });
}

double SumOfSquares(const float* x, int64_t n) {
  std::vector<double> partial(static_cast<size_t>((n + kNormChunk - 1) / kNormChunk));
  detail::ParallelChunks(n, kNormChunk, [&](int64_t chunk, int64_t begin, int64_t end) {
    const float* chunk_x = x + begin;
    partial[static_cast<size_t>(chunk)] =
        LaneSumOfSquares(end - begin, [chunk_x](int64_t i) { return chunk_x[i]; });
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

float ClipScale(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  return static_cast<float>(std::min(1.0, max_norm / (norm + 1e-6)));
}

}  // namespace tessera::cpu

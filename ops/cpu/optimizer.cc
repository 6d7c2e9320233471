// AdamW and SGD on flat parameter groups, gradient norms and the clipping factor.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/cpu/kernels.h"
#include "ops/cpu/parallel.h"

namespace tessera::cpu {

namespace {
constexpr int64_t kOptimizerGrain = 1 << 15;
constexpr int64_t kNormChunk = 1 << 16;
}  // namespace

void AdamWUpdate(float* param, float* m, float* v, const float* grad, int64_t n,
                 const AdamWConfig& config, float lr, int64_t step, float grad_scale,
                 const int64_t* decay_ranges, int64_t num_decay_ranges, int64_t element_offset) {
  // Scalars computed in double and rounded once, as PyTorch does with its Python floats.
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(config.beta1), step);
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(config.beta2), step);
  const float neg_step_size = static_cast<float>(-(static_cast<double>(lr) / bias_correction1));
  const float bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float decay_factor =
      static_cast<float>(1.0 - static_cast<double>(lr) * static_cast<double>(config.weight_decay));
  const float beta1 = config.beta1;
  const float one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(config.beta1));
  const float one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(config.beta2));
  const float beta2 = config.beta2;
  const float eps = config.eps;

  auto update = [&](int64_t begin, int64_t end, bool decay) {
    for (int64_t i = begin; i < end; ++i) {
      const float g = grad[i] * grad_scale;
      const float p = decay ? param[i] * decay_factor : param[i];
      const float m_new = m[i] * beta1 + one_minus_beta1 * g;
      const float v_new = v[i] * beta2 + one_minus_beta2 * g * g;
      const float denom = std::sqrt(v_new) / bias_correction2_sqrt + eps;
      m[i] = m_new;
      v[i] = v_new;
      param[i] = p + neg_step_size * m_new / denom;
    }
  };
  detail::ParallelFor(n, kOptimizerGrain, [&](int64_t begin, int64_t end) {
    // Walk [begin, end) in segments of constant decay, so each inner loop vectorises.
    int64_t position = begin;
    for (int64_t r = 0; r < num_decay_ranges && position < end; ++r) {
      const int64_t decay_begin = std::clamp(decay_ranges[2 * r] - element_offset, position, end);
      const int64_t decay_end =
          std::clamp(decay_ranges[2 * r + 1] - element_offset, decay_begin, end);
      update(position, decay_begin, false);
      update(decay_begin, decay_end, true);
      position = decay_end;
    }
    update(position, end, false);
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
    double sum = 0.0;
    for (int64_t i = begin; i < end; ++i) sum += static_cast<double>(x[i]) * x[i];
    partial[static_cast<size_t>(chunk)] = sum;
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

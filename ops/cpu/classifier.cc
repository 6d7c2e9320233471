// Fused softmax + cross-entropy over the vocabulary, with its gradient.
#include <cmath>
#include <limits>
#include <vector>

#include "ops/cpu/kernels.h"
#include "ops/cpu/parallel.h"

namespace tessera::cpu {

Result<float> SoftmaxCrossEntropy(float* dlogits, const float* logits, const int32_t* targets,
                                  int64_t rows, int64_t vocab, float grad_scale) {
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] < 0 || targets[r] >= vocab) {
      return InvalidArgument("target id {} at row {} is outside the vocabulary [0, {})", targets[r],
                             r, vocab);
    }
  }
  std::vector<double> row_loss(static_cast<size_t>(rows));
  const float row_grad_scale = grad_scale / static_cast<float>(rows);
  detail::ParallelFor(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* l = logits + r * vocab;
      float max_value = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < vocab; ++j) max_value = std::max(max_value, l[j]);
      const float target_logit = l[targets[r]];
      float sum = 0.0f;
      if (dlogits == nullptr) {
        for (int64_t j = 0; j < vocab; ++j) sum += std::exp(l[j] - max_value);
      } else {
        // Exponentials go straight into dlogits (possibly over the logits themselves).
        float* d = dlogits + r * vocab;
        for (int64_t j = 0; j < vocab; ++j) {
          d[j] = std::exp(l[j] - max_value);
          sum += d[j];
        }
        const float scale = row_grad_scale / sum;
        for (int64_t j = 0; j < vocab; ++j) d[j] *= scale;
        d[targets[r]] -= row_grad_scale;
      }
      row_loss[static_cast<size_t>(r)] =
          static_cast<double>(max_value) + std::log(static_cast<double>(sum)) - target_logit;
    }
  });
  double total = 0.0;
  for (double loss : row_loss) total += loss;
  return rows == 0 ? 0.0f : static_cast<float>(total / static_cast<double>(rows));
}

}  // namespace tessera::cpu

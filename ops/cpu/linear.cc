// Linear layers and plain matrix products, on BLAS.
#include "ops/cpu/kernels.h"
#include "ops/cpu/parallel.h"

namespace tessera::cpu {

void LinearForward(float* out, const float* x, const float* weight, const float* bias,
                   const float* residual, int64_t rows, int64_t in_features, int64_t out_features,
                   int64_t split_min_flops) {
  // Fold the bias and the residual into C before the GEMM (beta = 1), so the output is written
  // by one pass plus the GEMM instead of GEMM + bias pass + residual pass.
  const bool prefill = bias != nullptr || residual != nullptr;
  if (prefill) {
    detail::ParallelFor(rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        float* o = out + r * out_features;
        const float* res = residual ? residual + r * out_features : nullptr;
        for (int64_t c = 0; c < out_features; ++c) {
          o[c] = (res ? res[c] : 0.0f) + (bias ? bias[c] : 0.0f);
        }
      }
    });
  }
  Gemm(Transpose::kNo, Transpose::kYes, rows, out_features, in_features, 1.0f, x, in_features,
       weight, in_features, prefill ? 1.0f : 0.0f, out, out_features, split_min_flops);
}

void LinearBackward(float* dx, float* dweight, float* dbias, const float* dout, const float* x,
                    const float* weight, int64_t rows, int64_t in_features, int64_t out_features,
                    bool accumulate_dx, int64_t split_min_flops) {
  if (dx != nullptr) {
    Gemm(Transpose::kNo, Transpose::kNo, rows, in_features, out_features, 1.0f, dout, out_features,
         weight, in_features, accumulate_dx ? 1.0f : 0.0f, dx, in_features, split_min_flops);
  }
  if (dweight == nullptr) return;
  Gemm(Transpose::kYes, Transpose::kNo, out_features, in_features, rows, 1.0f, dout, out_features,
       x, in_features, 0.0f, dweight, in_features, split_min_flops);
  if (dbias != nullptr) SumRows(dbias, dout, rows, out_features);
}

void MatmulForward(float* c, const float* a, const float* b, int64_t m, int64_t k, int64_t n,
                   int64_t split_min_flops) {
  Gemm(Transpose::kNo, Transpose::kNo, m, n, k, 1.0f, a, k, b, n, 0.0f, c, n, split_min_flops);
}

void MatmulBackward(float* da, float* db, const float* dc, const float* a, const float* b,
                    int64_t m, int64_t k, int64_t n, int64_t split_min_flops) {
  Gemm(Transpose::kNo, Transpose::kYes, m, k, n, 1.0f, dc, n, b, n, 0.0f, da, k, split_min_flops);
  Gemm(Transpose::kYes, Transpose::kNo, k, n, m, 1.0f, a, k, dc, n, 0.0f, db, n, split_min_flops);
}

}  // namespace tessera::cpu

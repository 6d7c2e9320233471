// The one wrapper around BLAS (OpenBLAS set to one thread per call; see cmake/OpenBlas.cmake).
//
// Gemm computes, row-major, C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C. When the
// product is large enough (2*M*N*K >= split_min_flops) it is cut into one piece per thread of
// the current TBB arena along the longer of M and N, and each piece runs on its own thread.
// Each element of C is still computed by one BLAS call over the full K, so the split does not
// change results.
#pragma once

#include <cstdint>
#include <limits>

namespace tessera::cpu {

enum class Transpose : bool { kNo = false, kYes = true };

// Never split (for GEMMs issued from inside an already-parallel loop).
inline constexpr int64_t kNeverSplit = std::numeric_limits<int64_t>::max();

// REQUIRES: leading dimensions are those of the stored (untransposed) matrices, row-major.
void Gemm(Transpose transpose_a, Transpose transpose_b, int64_t m, int64_t n, int64_t k,
          float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
          float* c, int64_t ldc, int64_t split_min_flops);

}  // namespace tessera::cpu

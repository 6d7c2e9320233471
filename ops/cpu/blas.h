// The one wrapper around BLAS (OpenBLAS set to one thread per call; see cmake/OpenBlas.cmake).
//
// Gemm computes, row-major, C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C. When the
// product is large enough (2*M*N*K >= split_min_flops) it is cut along the longer of M and N into
// pieces, which run in parallel on the current TBB arena's threads (in turn on one thread).
//
// Determinism: the pieces depend only on the GEMM's shape and split_min_flops (GemmPieces), never
// on the number of threads, so every element of C is computed by the same BLAS call with the same
// arguments whatever the arena's size: results are bit-identical on 1 or 64 threads, with any
// OpenBLAS kernel. (A BLAS kernel's own edge tiles may sum in another order than its full tiles,
// so a piece boundary that moved with the thread count would change the last bits of C; with
// OpenBLAS's Haswell/Zen kernels it does.)
#pragma once

#include <cstdint>
#include <limits>
#include <string>

namespace tessera::cpu {

enum class Transpose : bool { kNo = false, kYes = true };

// "OpenBLAS, Zen kernels (<its build config>), threaded build, one thread per call": which BLAS
// and which of its kernels this machine runs (OPENBLAS_CORETYPE picks another), for `tessera
// doctor`.
std::string BlasDescription();

// Never split (for GEMMs issued from inside an already-parallel loop).
inline constexpr int64_t kNeverSplit = std::numeric_limits<int64_t>::max();
// A split GEMM has at most this many pieces, each a multiple of kGemmPieceQuantum rows/columns
// long (but the last), and at least kGemmMinPieceExtent long.
inline constexpr int64_t kGemmMaxPieces = 16;
inline constexpr int64_t kGemmPieceQuantum = 16;
// Each piece packs the whole shared operand again (K x N for a piece of rows), so short pieces
// multiply the packing: with 16-row pieces a 50257-word classifier's backward (M=256, K=50257)
// packed its 51 MB operand 16 times and the small bench config ran 12% slower; 128 rows keeps it
// within noise of one piece per thread on 2 cores (the CPU step against PyTorch,
// docs/benchmarks.md).
inline constexpr int64_t kGemmMinPieceExtent = 128;

// How many pieces Gemm cuts an M x N x K product into: a function of the shape only.
int64_t GemmPieces(int64_t m, int64_t n, int64_t k, int64_t split_min_flops);

// REQUIRES: leading dimensions are those of the stored (untransposed) matrices, row-major.
void Gemm(Transpose transpose_a, Transpose transpose_b, int64_t m, int64_t n, int64_t k,
          float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
          float* c, int64_t ldc, int64_t split_min_flops);

}  // namespace tessera::cpu

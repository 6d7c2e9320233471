#include "ops/cpu/blas.h"

#include <algorithm>

#include <cblas.h>
#include <fmt/format.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "core/logging.h"
#include "core/thread_annotations.h"

// OpenBLAS extensions (declared in its cblas.h as well; repeated to keep the dependency explicit).
extern "C" {
void openblas_set_num_threads(int num_threads);
int openblas_get_parallel(void);
char* openblas_get_config(void);
char* openblas_get_corename(void);
}

namespace tessera::cpu {

std::string BlasDescription() {
  const char* core = openblas_get_corename();
  const char* config = openblas_get_config();
  return fmt::format("OpenBLAS, {} kernels ({}), {}", core != nullptr ? core : "?",
                     config != nullptr ? config : "?",
                     openblas_get_parallel() == 0 ? "sequential build: GEMMs serialised"
                                                  : "threaded build, one thread per call");
}

namespace {

// How concurrent calls into BLAS are made safe. OpenBLAS threaded builds lock their buffer
// pool; a sequential build (openblas_get_parallel() == 0) does not, so calls are serialised.
struct BlasState {
  bool serialise = false;
  Mutex mutex;  // held around every call when `serialise`: it guards OpenBLAS's own buffers
};

BlasState& Blas() {
  static BlasState* state = [] {
    auto* s = new BlasState;
    // One thread per call: parallelism comes from the TBB arena, never from a second pool.
    openblas_set_num_threads(1);
    if (openblas_get_parallel() == 0) {
      s->serialise = true;
      GetLogger("ops")->warn(
          "OpenBLAS is a sequential build without locking; GEMMs are serialised. Link the "
          "pthread flavour (libopenblas-pthread-dev) for parallel GEMMs.");
    }
    return s;
  }();
  return *state;
}

void GemmOneThread(Transpose transpose_a, Transpose transpose_b, int64_t m, int64_t n, int64_t k,
                   float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                   float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const auto sgemm = [&] {
    cblas_sgemm(CblasRowMajor, transpose_a == Transpose::kYes ? CblasTrans : CblasNoTrans,
                transpose_b == Transpose::kYes ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
                static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
                static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
                static_cast<blasint>(ldc));
  };
  BlasState& blas = Blas();
  if (blas.serialise) {
    MutexLock lock(&blas.mutex);
    sgemm();
  } else {
    sgemm();
  }
}

}  // namespace

int64_t GemmPieces(int64_t m, int64_t n, int64_t k, int64_t split_min_flops) {
  const double flops =
      2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  const int64_t extent = std::max(m, n);
  if (flops < static_cast<double>(split_min_flops) || extent < 2 * kGemmMinPieceExtent) return 1;
  // As many pieces as the product has split_min_flops-sized parts, within the cap, each at
  // least a quantum long. Nothing here depends on the machine or the thread count.
  const double parts = flops / static_cast<double>(std::max<int64_t>(split_min_flops, 1));
  const int64_t by_flops = parts >= static_cast<double>(kGemmMaxPieces)
                               ? kGemmMaxPieces
                               : std::max<int64_t>(1, static_cast<int64_t>(parts));
  return std::min({by_flops, kGemmMaxPieces, extent / kGemmMinPieceExtent});
}

void Gemm(Transpose transpose_a, Transpose transpose_b, int64_t m, int64_t n, int64_t k,
          float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
          float* c, int64_t ldc, int64_t split_min_flops) {
  const int64_t pieces = GemmPieces(m, n, k, split_min_flops);
  if (pieces == 1) {
    GemmOneThread(transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const bool split_rows = m >= n;
  const int64_t extent = split_rows ? m : n;
  // Piece boundaries on multiples of the quantum keep each piece's edges SIMD-friendly.
  const int64_t step =
      (extent / pieces + kGemmPieceQuantum - 1) / kGemmPieceQuantum * kGemmPieceQuantum;
  const auto run_piece = [&](int64_t piece) {
    const int64_t begin = piece * step;
    const int64_t end = piece == pieces - 1 ? extent : std::min(extent, begin + step);
    if (begin >= end) return;
    if (split_rows) {
      // Rows of op(A): A is [M,K] (offset by rows) or, transposed, [K,M] (by columns).
      const float* a_piece = transpose_a == Transpose::kNo ? a + begin * lda : a + begin;
      GemmOneThread(transpose_a, transpose_b, end - begin, n, k, alpha, a_piece, lda, b, ldb, beta,
                    c + begin * ldc, ldc);
    } else {
      // Columns of op(B): B is [K,N] (offset by columns) or, transposed, [N,K] (by rows).
      const float* b_piece = transpose_b == Transpose::kNo ? b + begin : b + begin * ldb;
      GemmOneThread(transpose_a, transpose_b, m, end - begin, k, alpha, a, lda, b_piece, ldb, beta,
                    c + begin, ldc);
    }
  };
  if (tbb::this_task_arena::max_concurrency() <= 1) {
    for (int64_t piece = 0; piece < pieces; ++piece) run_piece(piece);
    return;
  }
  tbb::parallel_for(int64_t{0}, pieces, run_piece, tbb::simple_partitioner());
}

}  // namespace tessera::cpu

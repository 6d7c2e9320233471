// The GEMM wrapper: the same bits on any number of threads, for every transpose combination and
// awkward sizes, and close to a naive triple loop. Run by the test suite under every
// OPENBLAS_CORETYPE the CI checks (Haswell, SkylakeX, Zen and the machine's own): the kernels sum
// their edge tiles in different orders, so only a split that ignores the thread count holds.
#include <tbb/task_arena.h>

#include "ops/cpu/blas.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using cpu::Gemm;
using cpu::Transpose;

struct GemmCase {
  Transpose ta, tb;
  int64_t m, n, k;
};

class GemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmTest, AnyThreadCountGivesTheSameBitsAndMatchesNaive) {
  const GemmCase c = GetParam();
  const int64_t lda = c.ta == Transpose::kNo ? c.k : c.m;
  const int64_t ldb = c.tb == Transpose::kNo ? c.n : c.k;
  const std::vector<float> a = ToVector(RandomTensor({c.m * c.k}, 1));
  const std::vector<float> b = ToVector(RandomTensor({c.k * c.n}, 2));
  const std::vector<float> c0 = ToVector(RandomTensor({c.m * c.n}, 3));
  const auto run = [&](int threads, int64_t split_min_flops) {
    std::vector<float> out = c0;
    tbb::task_arena arena(threads);
    arena.execute([&] {
      Gemm(c.ta, c.tb, c.m, c.n, c.k, 0.5f, a.data(), lda, b.data(), ldb, 2.0f, out.data(), c.n,
           split_min_flops);
    });
    return out;
  };
  // split_min_flops 1: every case that can be split is, into the same pieces on every arena.
  const std::vector<float> one_thread = run(1, /*split_min_flops=*/1);
  for (int threads : {2, 3, 4, 8}) {
    EXPECT_EQ(run(threads, 1), one_thread)
        << threads << " threads: each element must be computed as on one thread";
  }
  const std::vector<float> unsplit = run(4, cpu::kNeverSplit);
  for (const std::vector<float>* result : {&one_thread, &unsplit}) {
    for (int64_t i = 0; i < c.m; ++i) {
      for (int64_t j = 0; j < c.n; ++j) {
        double sum = 0;
        for (int64_t p = 0; p < c.k; ++p) {
          const float av = c.ta == Transpose::kNo ? a[i * lda + p] : a[p * lda + i];
          const float bv = c.tb == Transpose::kNo ? b[p * ldb + j] : b[j * ldb + p];
          sum += static_cast<double>(av) * bv;
        }
        const double expected = 0.5 * sum + 2.0 * c0[i * c.n + j];
        ASSERT_NEAR((*result)[i * c.n + j], expected, 1e-4 * (1 + std::abs(expected)));
      }
    }
  }
}

TEST(GemmPiecesTest, PiecesDependOnTheShapeOnly) {
  using cpu::GemmPieces;
  EXPECT_EQ(GemmPieces(512, 768, 768, cpu::kNeverSplit), 1);
  EXPECT_EQ(GemmPieces(255, 31, 1000, 1), 1);  // too short for two pieces
  EXPECT_EQ(GemmPieces(515, 33, 17, 1), 4);    // 515 rows / 128
  EXPECT_EQ(GemmPieces(40, 700, 9, 1), 5);     // 700 columns / 128
  EXPECT_EQ(GemmPieces(256, 256, 50257, 4'000'000), 2);
  EXPECT_EQ(GemmPieces(512, 2304, 768, 4'000'000), cpu::kGemmMaxPieces);
  EXPECT_EQ(GemmPieces(512, 512, 2, 400'000), 2);  // 1 Mflop: two 400k parts
  for (int threads : {1, 2, 7}) {
    tbb::task_arena arena(threads);
    arena.execute([] { EXPECT_EQ(cpu::GemmPieces(4096, 64, 64, 1), cpu::kGemmMaxPieces); });
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmTest,
                         ::testing::Values(GemmCase{Transpose::kNo, Transpose::kNo, 515, 33, 17},
                                           GemmCase{Transpose::kNo, Transpose::kYes, 40, 700, 9},
                                           GemmCase{Transpose::kYes, Transpose::kNo, 300, 64, 31},
                                           GemmCase{Transpose::kYes, Transpose::kYes, 41, 300, 5},
                                           GemmCase{Transpose::kNo, Transpose::kNo, 97, 33, 17},
                                           GemmCase{Transpose::kNo, Transpose::kYes, 33, 130, 9},
                                           GemmCase{Transpose::kYes, Transpose::kNo, 64, 50, 31},
                                           GemmCase{Transpose::kYes, Transpose::kYes, 41, 77, 5},
                                           GemmCase{Transpose::kNo, Transpose::kYes, 1, 300, 8},
                                           GemmCase{Transpose::kNo, Transpose::kNo, 300, 1, 8},
                                           GemmCase{Transpose::kYes, Transpose::kNo, 515, 200,
                                                    64}));

}  // namespace
}  // namespace tessera::testing

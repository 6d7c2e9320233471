// The GEMM wrapper: split across threads must equal the unsplit call, for every transpose
// combination and awkward sizes; and both must equal a naive triple loop.
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

TEST_P(GemmTest, SplitEqualsUnsplitAndNaive) {
  const GemmCase c = GetParam();
  const int64_t lda = c.ta == Transpose::kNo ? c.k : c.m;
  const int64_t ldb = c.tb == Transpose::kNo ? c.n : c.k;
  const std::vector<float> a = ToVector(RandomTensor({c.m * c.k}, 1));
  const std::vector<float> b = ToVector(RandomTensor({c.k * c.n}, 2));
  const std::vector<float> c0 = ToVector(RandomTensor({c.m * c.n}, 3));
  std::vector<float> unsplit = c0, split = c0;
  Gemm(c.ta, c.tb, c.m, c.n, c.k, 0.5f, a.data(), lda, b.data(), ldb, 2.0f, unsplit.data(), c.n,
       cpu::kNeverSplit);
  tbb::task_arena arena(4);
  arena.execute([&] {
    Gemm(c.ta, c.tb, c.m, c.n, c.k, 0.5f, a.data(), lda, b.data(), ldb, 2.0f, split.data(), c.n,
         /*split_min_flops=*/1);
  });
  EXPECT_EQ(split, unsplit) << "a split GEMM must compute each element exactly as unsplit";
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      double sum = 0;
      for (int64_t p = 0; p < c.k; ++p) {
        const float av = c.ta == Transpose::kNo ? a[i * lda + p] : a[p * lda + i];
        const float bv = c.tb == Transpose::kNo ? b[p * ldb + j] : b[j * ldb + p];
        sum += static_cast<double>(av) * bv;
      }
      const double expected = 0.5 * sum + 2.0 * c0[i * c.n + j];
      ASSERT_NEAR(unsplit[i * c.n + j], expected, 1e-4 * (1 + std::abs(expected)));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmTest,
                         ::testing::Values(GemmCase{Transpose::kNo, Transpose::kNo, 97, 33, 17},
                                           GemmCase{Transpose::kNo, Transpose::kYes, 33, 130, 9},
                                           GemmCase{Transpose::kYes, Transpose::kNo, 64, 50, 31},
                                           GemmCase{Transpose::kYes, Transpose::kYes, 41, 77, 5},
                                           GemmCase{Transpose::kNo, Transpose::kYes, 1, 300, 8},
                                           GemmCase{Transpose::kNo, Transpose::kNo, 300, 1, 8}));

}  // namespace
}  // namespace tessera::testing

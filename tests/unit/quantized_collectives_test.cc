// ZeRO++-style quantized collectives (collectives/quantized.h) on the loopback transport, and
// their arithmetic (core/block_quantization.h): encodings against a plainly written reference
// (scale = the block's largest magnitude over the largest code, codes rounded to nearest even);
// the error bound; every rank's bits the same; the reduce-scatter's sum in rank order of the
// decoded blocks; the bytes each rank sends (1/2 and 1/4 of a bf16 collective's within 2%);
// bad arguments refused by name.
#include "collectives/quantized.h"

#include <cmath>
#include <limits>
#include <random>
#include <thread>

#include <gmock/gmock.h>

#include "collectives/loopback.h"
#include "core/block_quantization.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

std::vector<float> Random(int64_t count, std::mt19937& rng, float spread = 3.f) {
  std::normal_distribution<float> normal(0.f, spread);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& v : values) v = normal(rng);
  return values;
}

// Encode-then-decode of `values` written plainly, block by block.
std::vector<float> ReferenceRoundTrip(const std::vector<float>& values, int bits) {
  const auto max_code = static_cast<float>((1 << (bits - 1)) - 1);
  std::vector<float> out(values.size());
  for (size_t begin = 0; begin < values.size(); begin += kQuantizationBlock) {
    const size_t end = std::min(values.size(), begin + kQuantizationBlock);
    float largest = 0;
    for (size_t i = begin; i < end; ++i) largest = std::max(largest, std::fabs(values[i]));
    const float scale = largest / max_code;
    for (size_t i = begin; i < end; ++i) {
      out[i] = scale == 0 ? 0.f : std::nearbyint(values[i] / scale) * scale;
    }
  }
  return out;
}

std::vector<float> RoundTrip(const std::vector<float>& values, int bits) {
  const auto count = static_cast<int64_t>(values.size());
  std::vector<uint32_t> words(static_cast<size_t>(QuantizedWords(count, bits)));
  QuantizeBlocks(values.data(), count, bits, words.data());
  std::vector<float> out(values.size(), -1.f);
  DequantizeBlocks(words.data(), count, bits, out.data());
  return out;
}

TEST(BlockQuantizationTest, RoundTripsMatchTheReferenceWithinHalfAScale) {
  std::mt19937 rng(7);
  for (int bits : {8, 4}) {
    for (int64_t count : {int64_t{1}, int64_t{7}, int64_t{511}, int64_t{512}, int64_t{1500}}) {
      SCOPED_TRACE(fmt::format("{} bits, {} elements", bits, count));
      std::vector<float> values = Random(count, rng);
      values[0] = 0.f;
      const std::vector<float> decoded = RoundTrip(values, bits);
      EXPECT_EQ(decoded, ReferenceRoundTrip(values, bits));
      const float max_code = static_cast<float>((1 << (bits - 1)) - 1);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t block = i / kQuantizationBlock * kQuantizationBlock;
        float largest = 0;
        for (int64_t k = block; k < std::min(count, block + kQuantizationBlock); ++k) {
          largest = std::max(largest, std::fabs(values[static_cast<size_t>(k)]));
        }
        ASSERT_LE(std::fabs(decoded[static_cast<size_t>(i)] - values[static_cast<size_t>(i)]),
                  0.5f * largest / max_code * (1 + 1e-6f))
            << i;
      }
    }
  }
  // Zeros stay zeros; the extreme element is exact up to its scale's rounding.
  EXPECT_EQ(RoundTrip(std::vector<float>(9, 0.f), 8), std::vector<float>(9, 0.f));
  EXPECT_FLOAT_EQ(RoundTrip({-2.f, 0.5f, 1.f}, 4)[0], -2.f);
  // A non-finite element poisons its block, visibly.
  std::vector<float> poisoned(10, 1.f);
  poisoned[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(RoundTrip(poisoned, 8)[0]));
  EXPECT_OK(CheckQuantizationBits(8));
  EXPECT_THAT(CheckQuantizationBits(2).message(), HasSubstr("use 8 (int8) or 4 (int4)"));
}

// Runs body(rank, communicator) on a loopback group's threads; each rank's status.
template <typename Body>
std::vector<Status> OnEveryRank(int size, Body body) {
  LoopbackGroup group(size);
  std::vector<Status> statuses(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto communicator = MakeHostCommunicator(group.transport(r));
      statuses[static_cast<size_t>(r)] = body(r, *communicator);
    });
  }
  for (std::thread& thread : threads) thread.join();
  return statuses;
}

class QuantizedCollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(QuantizedCollectivesTest, AllGatherAndReduceScatterMatchTheReferenceOnEveryRank) {
  const int size = GetParam();
  std::mt19937 rng(100 + size);
  for (int bits : {8, 4}) {
    for (int64_t count : {int64_t{1}, int64_t{600}, int64_t{2049}}) {
      SCOPED_TRACE(fmt::format("{} ranks, {} bits, {} elements", size, bits, count));
      std::vector<std::vector<float>> shards, fulls;
      for (int r = 0; r < size; ++r) {
        shards.push_back(Random(count, rng));
        fulls.push_back(Random(count * size, rng));
      }
      std::vector<std::vector<float>> gathered(static_cast<size_t>(size)),
          scattered(static_cast<size_t>(size));
      std::vector<int64_t> sent(static_cast<size_t>(size));
      for (const Status& status : OnEveryRank(size, [&](int r, Communicator&c) {
             const auto at = static_cast<size_t>(r);
             gathered[at].resize(static_cast<size_t>(count * size));
             scattered[at].resize(static_cast<size_t>(count));
             TESSERA_RETURN_IF_ERROR(
                 QuantizedAllGather(c, shards[at].data(), count, bits, gathered[at].data()));
             TESSERA_RETURN_IF_ERROR(
                 QuantizedReduceScatter(c, fulls[at].data(), count, bits, scattered[at].data()));
             sent[at] = c.bytes_sent();
             return Status::Ok();
           })) {
        ASSERT_OK(status);
      }
      // All-gather: every rank's shard, round-tripped, in rank order, on every rank.
      std::vector<float> expected_gather;
      for (const std::vector<float>& shard : shards) {
        const std::vector<float> decoded = ReferenceRoundTrip(shard, bits);
        expected_gather.insert(expected_gather.end(), decoded.begin(), decoded.end());
      }
      for (int r = 0; r < size; ++r) {
        EXPECT_EQ(gathered[static_cast<size_t>(r)], expected_gather) << "rank " << r;
        // Reduce-scatter: block r of every rank's input, round-tripped, summed in rank order.
        std::vector<float> expected(static_cast<size_t>(count), 0.f);
        for (int from = 0; from < size; ++from) {
          const auto& full = fulls[static_cast<size_t>(from)];
          const std::vector<float> block(full.begin() + r * count, full.begin() + (r + 1) * count);
          const std::vector<float> decoded = ReferenceRoundTrip(block, bits);
          for (int64_t i = 0; i < count; ++i) {
            expected[static_cast<size_t>(i)] =
                from == 0 ? decoded[static_cast<size_t>(i)]
                          : expected[static_cast<size_t>(i)] + decoded[static_cast<size_t>(i)];
          }
        }
        EXPECT_EQ(scattered[static_cast<size_t>(r)], expected) << "rank " << r;
        EXPECT_EQ(sent[static_cast<size_t>(r)], 2 * QuantizedCollectiveBytes(count, size, bits))
            << "rank " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, QuantizedCollectivesTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& param_info) {
                           return std::to_string(param_info.param) + "ranks";
                         });

// The bytes against a bf16 collective's ((n-1) blocks of 2 bytes an element): 1/2 for int8 and
// 1/4 for int4, within 2% (a scale word a block of 512).
TEST(QuantizedCollectivesBytesTest, HalfAndAQuarterOfBf16s) {
  constexpr int64_t kCount = 1 << 20;
  constexpr int kSize = 4;
  const auto bf16 = static_cast<double>((kSize - 1) * kCount * 2);
  const double int8 = static_cast<double>(QuantizedCollectiveBytes(kCount, kSize, 8)) / bf16;
  const double int4 = static_cast<double>(QuantizedCollectiveBytes(kCount, kSize, 4)) / bf16;
  RecordProperty("int8_over_bf16", std::to_string(int8));
  RecordProperty("int4_over_bf16", std::to_string(int4));
  EXPECT_NEAR(int8 * 2, 1.0, 0.02);
  EXPECT_NEAR(int4 * 4, 1.0, 0.02);
}

TEST(QuantizedCollectivesBytesTest, BadArgumentsAreRefusedByName) {
  for (const Status& status : OnEveryRank(1, [](int, Communicator& c) {
         float x = 1, y = 0;
         const Status bits = QuantizedAllGather(c, &x, 1, 3, &y);
         EXPECT_THAT(bits.message(), HasSubstr("3-bit quantization does not exist"));
         const Status null = QuantizedReduceScatter(c, nullptr, 1, 8, &y);
         EXPECT_THAT(null.message(), HasSubstr("both buffers must be given"));
         return QuantizedAllGather(c, nullptr, 0, 8, nullptr);  // nothing to do
       })) {
    EXPECT_OK(status);
  }
}

}  // namespace
}  // namespace tessera::testing

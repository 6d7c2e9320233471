// The error-feedback compressed all-reduce (collectives/compressed.h) on the loopback transport:
// against a one-process reference of 1-bit Adam's two-phase arithmetic, call after call with the
// errors carried; the same bits on every rank; error feedback's telescoping sum; the bytes each
// rank sends (1/32 of an f32 ring all-reduce's within 2%); bad arguments.
#include "collectives/compressed.h"

#include <bit>
#include <cmath>
#include <random>
#include <thread>

#include <gmock/gmock.h>

#include "collectives/loopback.h"
#include "core/collective_task.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using Buffers = std::vector<std::vector<float>>;  // per rank

// 1-bit Adam's compressed all-reduce for every rank at once, written plainly: each rank's input
// with its error, per chunk +-its root mean square by sign, the error kept; each chunk's server
// averaging the ranks' (in rank order) with its own error, compressing alike.
class Reference {
 public:
  Reference(int size, int64_t count)
      : size_(size),
        count_(count),
        chunk_(SignChunkElements(count, size)),
        worker_error_(static_cast<size_t>(size), std::vector<float>(static_cast<size_t>(count))),
        server_error_(static_cast<size_t>(size), std::vector<float>(static_cast<size_t>(chunk_))) {}

  std::vector<float> Call(const Buffers& inputs) {
    Buffers sent(inputs.size());
    for (size_t r = 0; r < inputs.size(); ++r) {
      std::vector<float> corrected(static_cast<size_t>(count_));
      for (int64_t i = 0; i < count_; ++i) {
        corrected[Index(i)] = inputs[r][Index(i)] + worker_error_[r][Index(i)];
      }
      sent[r] = Signs(corrected);
      for (int64_t i = 0; i < count_; ++i) {
        worker_error_[r][Index(i)] = corrected[Index(i)] - sent[r][Index(i)];
      }
    }
    std::vector<float> average(static_cast<size_t>(count_));
    for (int64_t i = 0; i < count_; ++i) {
      float sum = 0;
      for (const std::vector<float>& s : sent) sum += s[Index(i)];
      average[Index(i)] =
          sum / static_cast<float>(size_) + server_error_[Index(i / chunk_)][Index(i % chunk_)];
    }
    std::vector<float> out = Signs(average);
    for (int64_t i = 0; i < count_; ++i) {
      server_error_[Index(i / chunk_)][Index(i % chunk_)] = average[Index(i)] - out[Index(i)];
    }
    return out;
  }

  // The ranks' average worker error plus the server errors, per element: what the outputs still
  // owe the true averages.
  std::vector<float> Owed() const {
    std::vector<float> owed(static_cast<size_t>(count_));
    for (int64_t i = 0; i < count_; ++i) {
      double sum = 0;
      for (const std::vector<float>& e : worker_error_) sum += e[Index(i)];
      owed[Index(i)] =
          static_cast<float>(sum / size_) + server_error_[Index(i / chunk_)][Index(i % chunk_)];
    }
    return owed;
  }

 private:
  static size_t Index(int64_t i) { return static_cast<size_t>(i); }

  // Per chunk, +-the root mean square of its elements by each element's sign (its squares summed
  // as core/sign_compression.h fixes).
  std::vector<float> Signs(const std::vector<float>& values) const {
    std::vector<float> out(values.size());
    for (int64_t begin = 0; begin < count_; begin += chunk_) {
      const int64_t end = std::min(count_, begin + chunk_);
      // The squares' partial sums: element i of the chunk into partial i % kSquareLanes.
      std::vector<double> partial(static_cast<size_t>(kSquareLanes), 0.0);
      for (int64_t i = begin; i < end; ++i) {
        partial[Index((i - begin) % kSquareLanes)] +=
            static_cast<double>(values[Index(i)]) * values[Index(i)];
      }
      double squares = 0;
      for (double p : partial) squares += p;
      const auto scale = static_cast<float>(std::sqrt(squares / static_cast<double>(end - begin)));
      for (int64_t i = begin; i < end; ++i) out[Index(i)] = values[Index(i)] >= 0 ? scale : -scale;
    }
    return out;
  }

  int size_;
  int64_t count_, chunk_;
  Buffers worker_error_, server_error_;
};

// Each rank's state for the calls on the loopback transport.
struct Rank {
  std::vector<float> worker_error, server_error;
  int64_t bytes_sent = 0;
};

// One call on every rank (a thread each): `buffers` averaged in place.
std::vector<Status> CallOnEveryRank(LoopbackGroup& group, Buffers& buffers,
                                    std::vector<Rank>& ranks) {
  const int size = static_cast<int>(buffers.size());
  std::vector<Status> results(buffers.size());
  std::vector<std::thread> threads;
  threads.reserve(buffers.size());
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto communicator = MakeHostCommunicator(group.transport(r));
      const auto at = static_cast<size_t>(r);
      results[at] = CompressedAllReduce(
          *communicator, buffers[at].data(), static_cast<int64_t>(buffers[at].size()),
          ranks[at].worker_error.data(), ranks[at].server_error.data());
      ranks[at].bytes_sent = communicator->bytes_sent();
    });
  }
  for (std::thread& thread : threads) thread.join();
  return results;
}

Buffers RandomInputs(int size, int64_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  Buffers inputs(static_cast<size_t>(size), std::vector<float>(static_cast<size_t>(count)));
  for (std::vector<float>& input : inputs) {
    for (float& value : input) value = normal(rng);
  }
  return inputs;
}

std::vector<Rank> FreshRanks(int size, int64_t count) {
  std::vector<Rank> ranks(static_cast<size_t>(size));
  for (Rank& rank : ranks) {
    rank.worker_error.assign(static_cast<size_t>(count), 0.f);
    rank.server_error.assign(static_cast<size_t>(SignChunkElements(count, size)), 0.f);
  }
  return ranks;
}

class CompressedAllReduceTest : public ::testing::TestWithParam<int> {};

TEST_P(CompressedAllReduceTest, EveryCallMatchesTheReferenceOnEveryRankWithTheErrorsCarried) {
  const int size = GetParam();
  std::mt19937 rng(1234 + size);
  for (const int64_t count : {int64_t{1}, int64_t{31}, int64_t{33}, int64_t{1000}, int64_t{4099}}) {
    LoopbackGroup group(size);
    Reference reference(size, count);
    std::vector<Rank> ranks = FreshRanks(size, count);
    std::vector<float> sum_of_averages(static_cast<size_t>(count)),
        sum_of_outputs(static_cast<size_t>(count));
    for (int call = 0; call < 4; ++call) {
      const Buffers inputs = RandomInputs(size, count, rng);
      for (int64_t i = 0; i < count; ++i) {
        double sum = 0;
        for (const std::vector<float>& input : inputs) sum += input[static_cast<size_t>(i)];
        sum_of_averages[static_cast<size_t>(i)] += static_cast<float>(sum / size);
      }
      const std::vector<float> expected = reference.Call(inputs);
      Buffers buffers = inputs;
      for (const Status& status : CallOnEveryRank(group, buffers, ranks)) ASSERT_OK(status);
      for (int r = 0; r < size; ++r) {
        for (int64_t i = 0; i < count; ++i) {
          const auto at = static_cast<size_t>(i);
          ASSERT_EQ(std::bit_cast<uint32_t>(buffers[static_cast<size_t>(r)][at]),
                    std::bit_cast<uint32_t>(expected[at]))
              << "rank " << r << " element " << i << " of " << count << ", call " << call;
        }
      }
      for (int64_t i = 0; i < count; ++i) {
        sum_of_outputs[static_cast<size_t>(i)] += buffers[0][static_cast<size_t>(i)];
      }
    }
    // Error feedback: what was sent over the calls is what was given, less what is still owed.
    const std::vector<float> owed = reference.Owed();
    for (int64_t i = 0; i < count; ++i) {
      const auto at = static_cast<size_t>(i);
      EXPECT_NEAR(sum_of_outputs[at] + owed[at], sum_of_averages[at], 1e-4f)
          << "element " << i << " of " << count;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CompressedAllReduceTest, ::testing::Values(1, 2, 3, 4, 5, 8),
                         [](const auto& param_info) {
                           return std::to_string(param_info.param) + "ranks";
                         });

TEST(CompressedAllReduceBytesTest, ARankSendsAThirtySecondOfAnF32RingAllReduce) {
  constexpr int kSize = 4;
  constexpr int64_t kCount = int64_t{1} << 20;
  std::mt19937 rng(7);
  LoopbackGroup group(kSize);
  std::vector<Rank> ranks = FreshRanks(kSize, kCount);
  Buffers buffers = RandomInputs(kSize, kCount, rng);
  for (const Status& status : CallOnEveryRank(group, buffers, ranks)) ASSERT_OK(status);

  // The same buffers' f32 all-reduce, on another group.
  LoopbackGroup plain_group(kSize);
  std::vector<int64_t> plain_bytes(kSize);
  std::vector<std::thread> threads;
  threads.reserve(kSize);
  for (int r = 0; r < kSize; ++r) {
    threads.emplace_back([&, r] {
      auto communicator = MakeHostCommunicator(plain_group.transport(r));
      EXPECT_OK(communicator->AllReduce(buffers[static_cast<size_t>(r)].data(), kCount, DType::kF32,
                                        ReduceOp::kAvg));
      plain_bytes[static_cast<size_t>(r)] = communicator->bytes_sent();
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int r = 0; r < kSize; ++r) {
    const Rank& rank = ranks[static_cast<size_t>(r)];
    EXPECT_EQ(rank.bytes_sent, CompressedAllReduceBytes(kCount, kSize)) << "rank " << r;
    const double ratio = static_cast<double>(rank.bytes_sent) /
                         static_cast<double>(plain_bytes[static_cast<size_t>(r)]);
    EXPECT_NEAR(ratio * 32, 1.0, 0.02) << "rank " << r << ": " << rank.bytes_sent << " against "
                                       << plain_bytes[static_cast<size_t>(r)];
  }
}

TEST(CompressedAllReduceBytesTest, ChunksAreWholeWordsOfSigns) {
  EXPECT_EQ(SignChunkElements(0, 4), 0);
  EXPECT_EQ(SignChunkElements(1, 4), 32);
  EXPECT_EQ(SignChunkElements(128, 4), 32);
  EXPECT_EQ(SignChunkElements(129, 4), 64);
  EXPECT_EQ(SignChunkElements(1000, 3), 352);  // 334 rounded up to 11 words
}

TEST(CompressedAllReduceBytesTest, BadArgumentsAreRefused) {
  LoopbackGroup group(1);
  auto communicator = MakeHostCommunicator(group.transport(0));
  float value = 1, error = 0;
  EXPECT_EQ(CompressedAllReduce(*communicator, &value, -1, &error, &error).code(),
            StatusCode::kInvalidArgument);
  const Status missing = CompressedAllReduce(*communicator, &value, 1, nullptr, &error);
  EXPECT_EQ(missing.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.message(), ::testing::HasSubstr("error buffers"));
  EXPECT_OK(CompressedAllReduce(*communicator, nullptr, 0, nullptr, nullptr));  // nothing to do
}

// The collective task's op: a one-member group's CPU kernel computes what a group of one does
// (it still compresses, keeping both errors), call after call; errors of the wrong size or dtype
// are refused by name.
TEST(CompressedAllReduceOpTest, AOneMemberKernelComputesTheGroupOfOnesBits) {
  constexpr int64_t kCount = 77;
  std::mt19937 rng(3);
  LoopbackGroup group(1);
  std::vector<Rank> ranks = FreshRanks(1, kCount);
  const int64_t chunk = SignChunkElements(kCount, 1);
  std::vector<float> worker(kCount, 0.f), server(static_cast<size_t>(chunk), 0.f);
  const Attrs attrs{
      {kCollectiveAttr, int64_t{1}}, {kRankAttr, int64_t{0}}, {kGroupSizeAttr, int64_t{1}}};
  for (int call = 0; call < 3; ++call) {
    Buffers buffers = RandomInputs(1, kCount, rng);
    const std::vector<float> input = buffers[0];
    for (const Status& status : CallOnEveryRank(group, buffers, ranks)) ASSERT_OK(status);
    ASSERT_OK_AND_ASSIGN(std::vector<Tensor> out,
                         RunKernel("compressed_all_reduce",
                                   {FloatTensor({kCount}, input), FloatTensor({kCount}, worker),
                                    FloatTensor({chunk}, server)},
                                   attrs));
    ASSERT_EQ(out.size(), 3u);
    EXPECT_EQ(ToVector(out[0]), buffers[0]) << "call " << call;
    worker = ToVector(out[1]);
    server = ToVector(out[2]);
    EXPECT_EQ(worker, ranks[0].worker_error) << "call " << call;
    EXPECT_EQ(server, ranks[0].server_error) << "call " << call;
  }
  const Status wrong = RunKernel("compressed_all_reduce",
                                 {FloatTensor({kCount}, worker), FloatTensor({kCount}, worker),
                                  FloatTensor({kCount}, worker)},
                                 attrs)
                           .status();
  EXPECT_EQ(wrong.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.message(), ::testing::HasSubstr("'server_error'"));
  const Status short_worker = RunKernel("compressed_all_reduce",
                                        {FloatTensor({kCount}, worker), FloatTensor({3}, {0, 0, 0}),
                                         FloatTensor({chunk}, server)},
                                        attrs)
                                  .status();
  EXPECT_EQ(short_worker.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(short_worker.message(), ::testing::HasSubstr("'worker_error'"));
}

// Attribute 'count': the leading elements a padded buffer compresses (a ZeRO-1/2 group padded to
// its shards): their bits are those of an unpadded buffer's, the padding and its worker errors
// pass through, and the server error is a chunk of the count; a count beyond x is refused.
TEST(CompressedAllReduceOpTest, ACountCompressesOnlyTheLeadingElements) {
  constexpr int64_t kCount = 77, kPadded = 96;
  const int64_t chunk = SignChunkElements(kCount, 1);
  std::mt19937 rng(5);
  const std::vector<float> input = RandomInputs(1, kCount, rng)[0];
  std::vector<float> padded = input;
  padded.resize(kPadded, 0.25f);  // padding holds no zeros here: it must pass through
  const std::vector<float> no_error(kPadded, 0.f), chunk_zeros(static_cast<size_t>(chunk), 0.f);
  const Attrs attrs{
      {kCollectiveAttr, int64_t{1}}, {kRankAttr, int64_t{0}}, {kGroupSizeAttr, int64_t{1}}};
  ASSERT_OK_AND_ASSIGN(std::vector<Tensor> plain,
                       RunKernel("compressed_all_reduce",
                                 {FloatTensor({kCount}, input),
                                  FloatTensor({kCount}, std::vector<float>(kCount, 0.f)),
                                  FloatTensor({chunk}, chunk_zeros)},
                                 attrs));
  Attrs counted = attrs;
  counted.Set(kCompressedCountAttr, kCount);
  ASSERT_OK_AND_ASSIGN(std::vector<Tensor> out,
                       RunKernel("compressed_all_reduce",
                                 {FloatTensor({kPadded}, padded), FloatTensor({kPadded}, no_error),
                                  FloatTensor({chunk}, chunk_zeros)},
                                 counted));
  const std::vector<float> value = ToVector(out[0]), worker = ToVector(out[1]);
  EXPECT_EQ(std::vector<float>(value.begin(), value.begin() + kCount), ToVector(plain[0]));
  EXPECT_EQ(std::vector<float>(value.begin() + kCount, value.end()),
            std::vector<float>(kPadded - kCount, 0.25f));
  EXPECT_EQ(std::vector<float>(worker.begin(), worker.begin() + kCount), ToVector(plain[1]));
  EXPECT_EQ(std::vector<float>(worker.begin() + kCount, worker.end()),
            std::vector<float>(kPadded - kCount, 0.f));
  EXPECT_EQ(ToVector(out[2]), ToVector(plain[2]));
  counted.Set(kCompressedCountAttr, kPadded + 1);
  const Status beyond = RunKernel("compressed_all_reduce",
                                  {FloatTensor({kPadded}, padded), FloatTensor({kPadded}, no_error),
                                   FloatTensor({chunk}, chunk_zeros)},
                                  counted)
                            .status();
  EXPECT_EQ(beyond.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(beyond.message(), ::testing::HasSubstr("attribute 'count' is 97"));
}

}  // namespace
}  // namespace tessera::testing

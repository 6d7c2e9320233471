// The collective algorithms on the loopback transport (threads in one process), every op (the
// all-to-all included) and dtype against the naive reference, for groups of 1 to 8 ranks; and
// failures.
#include <bit>
#include <chrono>
#include <limits>
#include <thread>

#include "collectives/collective_suite.h"
#include "collectives/communicator.h"
#include "collectives/loopback.h"
#include "collectives/nccl_communicator.h"
#include "collectives/socket_rendezvous.h"
#include "collectives/ucx_communicator.h"
#include "core/cuda_device.h"
#include "core/half.h"
#include "core/transport/ucx_peer_transport.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

// The bit patterns of `values`: floats compared bit for bit.
std::vector<uint32_t> Bits(const std::vector<float>& values) {
  std::vector<uint32_t> bits;
  bits.reserve(values.size());
  for (float value : values) bits.push_back(std::bit_cast<uint32_t>(value));
  return bits;
}

// Runs `body(rank, communicator)` on one thread per rank; returns each rank's status.
template <typename Body>
std::vector<Status> RunGroup(int size, const CommunicatorOptions& options, Body body,
                             LoopbackGroup* group_out = nullptr) {
  LoopbackGroup local(size);
  LoopbackGroup& group = group_out != nullptr ? *group_out : local;
  std::vector<Status> results(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto communicator = MakeHostCommunicator(group.transport(r), options);
      results[static_cast<size_t>(r)] = body(r, *communicator);
    });
  }
  for (auto& thread : threads) thread.join();
  return results;
}

class CollectivesSuiteTest : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesSuiteTest, EveryOpAndDtypeMatchesTheReference) {
  CollectiveSuiteOptions suite;
  suite.large_bytes = 4 << 20;
  for (const Status& status : RunGroup(
           GetParam(), {}, [&](int, Communicator& c) { return RunCollectiveSuite(c, suite); })) {
    EXPECT_OK(status);
  }
}

TEST_P(CollectivesSuiteTest, SmallChunksPipelineTheRing) {
  // Tiny thresholds push every size but the smallest through the chunked ring and chain.
  CommunicatorOptions options;
  options.small_bytes = 64;
  options.chunk_bytes = 256;
  CollectiveSuiteOptions suite;
  suite.sizes = {3, 64, 1021, 4099};
  for (const Status& status : RunGroup(GetParam(), options, [&](int, Communicator& c) {
         return RunCollectiveSuite(c, suite);
       })) {
    EXPECT_OK(status);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CollectivesSuiteTest, ::testing::Values(1, 2, 3, 4, 5, 8),
                         [](const auto& param_info) {
                           return std::to_string(param_info.param) + "ranks";
                         });

TEST(CollectivesTest, RingResultsAreIdenticalOnEveryRank) {
  // Random floats (not exactly summable): every rank must still hold the same bits.
  const int n = 4;
  const int64_t count = 100'003;
  std::vector<std::vector<float>> buffers(n);
  for (int r = 0; r < n; ++r) {
    buffers[static_cast<size_t>(r)] =
        ToVector(RandomTensor({count}, 17 + static_cast<uint64_t>(r)));
  }
  for (const Status& status : RunGroup(n, {}, [&](int r, Communicator&c) {
         return c.AllReduce(buffers[static_cast<size_t>(r)].data(), count, DType::kF32,
                            ReduceOp::kSum);
       })) {
    ASSERT_OK(status);
  }
  for (int r = 1; r < n; ++r) {
    EXPECT_EQ(Bits(buffers[0]), Bits(buffers[static_cast<size_t>(r)])) << "rank " << r;
  }
}

// Direct (small) reductions sum in rank order: a reduce-scatter's block holds the bits of the
// all-reduce's elements there, whatever the buffer's cut (ZeRO's shards against data
// parallelism's groups and buckets), and sends the ring's bytes, (n-1) blocks.
TEST(CollectivesTest, DirectReduceScatterHasTheAllReducesBitsAndTheRingsBytes) {
  const int n = 4;
  const int64_t block = 1'001;
  std::vector<std::vector<float>> inputs(n);
  for (int r = 0; r < n; ++r) {
    inputs[static_cast<size_t>(r)] =
        ToVector(RandomTensor({block * n}, 29 + static_cast<uint64_t>(r)));
  }
  std::vector<std::vector<float>> reduced = inputs, scattered(n, std::vector<float>(block));
  std::vector<int64_t> sent(n);
  CommunicatorOptions options;
  options.small_bytes = int64_t{1} << 20;
  for (const Status& status : RunGroup(n, options, [&](int r, Communicator&c) {
         const auto at = static_cast<size_t>(r);
         TESSERA_RETURN_IF_ERROR(
             c.AllReduce(reduced[at].data(), block * n, DType::kF32, ReduceOp::kSum));
         const int64_t before = c.bytes_sent();
         Status status = c.ReduceScatter(inputs[at].data(), scattered[at].data(), block,
                                         DType::kF32, ReduceOp::kSum);
         sent[at] = c.bytes_sent() - before;
         return status;
       })) {
    ASSERT_OK(status);
  }
  for (int r = 0; r < n; ++r) {
    const auto at = static_cast<size_t>(r);
    const std::vector<float> own(reduced[at].begin() + r * block,
                                 reduced[at].begin() + (r + 1) * block);
    EXPECT_EQ(Bits(scattered[at]), Bits(own)) << "rank " << r;
    EXPECT_EQ(sent[at], (n - 1) * block * 4) << "rank " << r;
  }
}

TEST(CollectivesTest, BytesSentFollowTheRing) {
  // All-reduce by ring: each rank sends 2(n-1)/n of the buffer.
  const int n = 4;
  const int64_t count = 1 << 20;
  std::vector<int64_t> sent(n);
  RunGroup(n, {}, [&](int r, Communicator& c) {
    std::vector<float> buffer(count, 1.0f);
    Status status = c.AllReduce(buffer.data(), count, DType::kF32, ReduceOp::kSum);
    sent[static_cast<size_t>(r)] = c.bytes_sent();
    return status;
  });
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(sent[static_cast<size_t>(r)], int64_t{2} * (n - 1) * count * 4 / n);
}

TEST(CollectivesTest, AllToAllSendsAllButItsOwnBlock) {
  // Pairwise exchange: each rank sends (n-1)/n of its buffer, its own block is copied locally.
  const int n = 4;
  const int64_t block = 100'003;
  std::vector<int64_t> sent(n);
  for (const Status& status : RunGroup(n, {}, [&](int r, Communicator&c) {
         std::vector<float> send(static_cast<size_t>(block * n), 1.0f);
         std::vector<float> recv(send.size());
         Status result = c.AllToAll(send.data(), recv.data(), block, DType::kF32);
         sent[static_cast<size_t>(r)] = c.bytes_sent();
         return result;
       })) {
    ASSERT_OK(status);
  }
  for (int r = 0; r < n; ++r) EXPECT_EQ(sent[static_cast<size_t>(r)], (n - 1) * block * 4);
}

TEST(CollectivesTest, AllToAllMovesEveryDtypeAsBytes) {
  // Copies take any dtype, i64 and u16 included (the reference suite covers the float ones).
  const int n = 3;
  const int64_t block = 5;
  std::vector<std::vector<int64_t>> received(n);
  for (const Status& status : RunGroup(n, {}, [&](int r, Communicator&c) {
         std::vector<int64_t> send;
         for (int64_t i = 0; i < block * n; ++i) send.push_back((int64_t{r} << 40) | i);
         std::vector<int64_t>& recv = received[static_cast<size_t>(r)];
         recv.assign(send.size(), -1);
         return c.AllToAll(send.data(), recv.data(), block, DType::kI64);
       })) {
    ASSERT_OK(status);
  }
  for (int r = 0; r < n; ++r) {
    std::vector<int64_t> expected;
    for (int source = 0; source < n; ++source) {
      for (int64_t i = 0; i < block; ++i)
        expected.push_back((int64_t{source} << 40) | (r * block + i));
    }
    EXPECT_EQ(received[static_cast<size_t>(r)], expected) << "rank " << r;
  }
}

TEST(CollectivesTest, BadArgumentsAreRefused) {
  LoopbackGroup group(2);
  auto communicator = MakeHostCommunicator(group.transport(0));
  float x = 0;
  Status status = communicator->AllReduce(&x, 1, DType::kI64, ReduceOp::kSum);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("i64"), std::string::npos) << status.ToString();
  status = communicator->Broadcast(&x, 1, DType::kF32, 2);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("root 2"), std::string::npos) << status.ToString();
  EXPECT_EQ(communicator->AllReduce(&x, -1, DType::kF32, ReduceOp::kSum).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(communicator->AllToAll(&x, &x, -1, DType::kF32).code(), StatusCode::kInvalidArgument);
  // All-to-all cannot run in place: the blocks it sends would be overwritten by those it gets.
  std::vector<float> buffer(6);
  status = communicator->AllToAll(buffer.data(), buffer.data() + 2, 2, DType::kF32);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("overlap"), std::string::npos) << status.ToString();
}

TEST(CollectivesTest, ADeadMemberFailsEveryOtherRankNamingIt) {
  const int n = 4;
  LoopbackGroup group(n);
  CommunicatorOptions options;
  options.timeout_ms = 600'000;  // the death must be noticed (Unavailable), not waited out
  std::vector<Status> results = RunGroup(
      n, options,
      [&](int r, Communicator& c) {
        if (r == 2) {
          group.Kill(2);
          return Status::Ok();
        }
        std::vector<float> buffer(1 << 20, 1.0f);
        return c.AllReduce(buffer.data(), 1 << 20, DType::kF32, ReduceOp::kSum);
      },
      &group);
  for (int r : {0, 1, 3}) {
    const Status& status = results[static_cast<size_t>(r)];
    EXPECT_EQ(status.code(), StatusCode::kUnavailable) << "rank " << r << ": " << status.ToString();
    EXPECT_NE(status.message().find("rank 2 died"), std::string::npos) << status.ToString();
  }
}

TEST(CollectivesTest, ASilentPeerTimesOutNamingIt) {
  const int n = 2;
  CommunicatorOptions options;
  options.timeout_ms = 200;
  std::vector<Status> results = RunGroup(n, options, [&](int r, Communicator& c) {
    if (r == 1) return Status::Ok();  // never joins the collective
    float x = 1;
    return c.AllReduce(&x, 1, DType::kF32, ReduceOp::kSum);
  });
  EXPECT_EQ(results[0].code(), StatusCode::kTimedOut) << results[0].ToString();
  EXPECT_NE(results[0].message().find("rank 1"), std::string::npos) << results[0].ToString();
}

TEST(CollectivesTest, AllToAllWithASilentPeerTimesOutNamingIt) {
  // Rank 2 never joins: rank 0 waits on it at step 1, rank 1 (whose step-1 partner is rank 0)
  // at step 2; both name it.
  const int n = 3;
  CommunicatorOptions options;
  options.timeout_ms = 200;
  std::vector<Status> results = RunGroup(n, options, [&](int r, Communicator& c) {
    if (r == 2) return Status::Ok();
    std::vector<float> send(3, 1.0f), recv(3);
    return c.AllToAll(send.data(), recv.data(), 1, DType::kF32);
  });
  for (int r : {0, 1}) {
    const Status& status = results[static_cast<size_t>(r)];
    EXPECT_EQ(status.code(), StatusCode::kTimedOut) << "rank " << r << ": " << status.ToString();
    EXPECT_NE(status.message().find("waiting on rank 2"), std::string::npos) << status.ToString();
  }
}

TEST(CollectivesTest, AbortStopsABlockedCollective) {
  LoopbackGroup group(2);
  auto communicator = MakeHostCommunicator(group.transport(0));
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    communicator->Abort(Unavailable("rank 1 died: the scheduler lost it"));
  });
  float x = 1;
  Status status = communicator->AllReduce(&x, 1, DType::kF32, ReduceOp::kSum);
  aborter.join();
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_NE(status.message().find("rank 1 died"), std::string::npos) << status.ToString();
  // Broken for good: later calls fail with the same reason.
  EXPECT_NE(
      communicator->AllReduce(&x, 1, DType::kF32, ReduceOp::kSum).message().find("rank 1 died"),
      std::string::npos);
}

TEST(HalfTest, RoundTripsAndRoundsToNearestEven) {
  for (float v : {0.0f, 1.0f, -2.5f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f}) {
    EXPECT_EQ(HalfToFloat(FloatToHalf(v)), v) << v;
  }
  EXPECT_TRUE(std::isinf(HalfToFloat(FloatToHalf(1e6f))));
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(NAN))));
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 1.0f / 2048)), 1.0f);  // tie -> even
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 3.0f / 2048)), 1.0f + 2.0f / 1024);
  for (float v : {0.0f, 1.0f, -3.140625f, std::ldexp(1.0f, 100)}) {
    EXPECT_EQ(Bf16ToFloat(FloatToBf16(v)), v) << v;
  }
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 1.0f / 256)), 1.0f);  // tie -> even
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
}

}  // namespace
}  // namespace tessera::testing

namespace tessera::testing {
namespace {

std::string RendezvousPath(const std::string& name) {
  return "unix:" + TempPath("rendezvous_" + name + ".sock");
}

TEST(SocketRendezvousTest, GathersInRankOrder) {
  const int n = 3;
  const std::string address = RendezvousPath("gather");
  std::vector<std::vector<std::string>> results(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto rendezvous = JoinSocketRendezvous({address, r, n, 10'000});
      ASSERT_OK(rendezvous.status());
      for (int round = 0; round < 2; ++round) {
        auto all = (*rendezvous)
                       ->AllGather(fmt::format("r{}x{}", r, round),
                                   Rendezvous::Clock::now() + std::chrono::seconds(10));
        ASSERT_OK(all.status());
        if (round == 1) results[static_cast<size_t>(r)] = *all;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(results[static_cast<size_t>(r)], (std::vector<std::string>{"r0x1", "r1x1", "r2x1"}));
  }
}

TEST(SocketRendezvousTest, BadArgumentsAreRefusedWithTheReason) {
  auto bad_rank = JoinSocketRendezvous({RendezvousPath("bad"), 3, 3, 1000});
  EXPECT_EQ(bad_rank.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_rank.status().message().find("rank 3"), std::string::npos);
  auto bad_address = JoinSocketRendezvous({"not an address", 0, 2, 1000});
  EXPECT_EQ(bad_address.status().code(), StatusCode::kInvalidArgument)
      << bad_address.status().ToString();

  // A member that disagrees about the group's size is refused by rank 0, and says why.
  const std::string address = RendezvousPath("mismatch");
  Status member;
  std::thread joiner([&] { member = JoinSocketRendezvous({address, 1, 3, 5000}).status(); });
  auto root = JoinSocketRendezvous({address, 0, 2, 1500});
  joiner.join();
  EXPECT_EQ(member.code(), StatusCode::kInvalidArgument) << member.ToString();
  EXPECT_NE(member.message().find("thinks the group has 3 ranks"), std::string::npos)
      << member.ToString();
  EXPECT_EQ(root.status().code(), StatusCode::kTimedOut) << root.status().ToString();
  EXPECT_NE(root.status().message().find("ranks 1"), std::string::npos) << root.status().ToString();
}

TEST(SocketRendezvousTest, AMemberWithoutRankZeroTimesOutNamingTheAddress) {
  const std::string address = RendezvousPath("nobody");
  auto member = JoinSocketRendezvous({address, 1, 2, 300});
  EXPECT_EQ(member.status().code(), StatusCode::kTimedOut);
  EXPECT_NE(member.status().message().find(address.substr(5)), std::string::npos)
      << member.status().ToString();
}

// The suite over the UCX backend, every rank a thread of this process (`tag` names its
// rendezvous).
void RunUcxSuiteInThreads(const std::string& tag, const UcxCommunicatorOptions& ucx) {
  const int n = 3;
  const std::string address = RendezvousPath(tag);
  std::vector<Status> results(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto rendezvous = JoinSocketRendezvous({address, r, n, 10'000});
      if (!rendezvous.ok()) {
        results[static_cast<size_t>(r)] = rendezvous.status();
        return;
      }
      auto communicator = ConnectUcxCommunicator(**rendezvous, {}, ucx);
      if (!communicator.ok()) {
        results[static_cast<size_t>(r)] = communicator.status();
        return;
      }
      CollectiveSuiteOptions suite;
      suite.sizes = {0, 1, 1021, 100'003};
      results[static_cast<size_t>(r)] = RunCollectiveSuite(**communicator, suite);
    });
  }
  for (auto& thread : threads) thread.join();
  for (const Status& status : results) EXPECT_OK(status);
}

TEST(UcxCommunicatorTest, ThreadsOfOneProcessRunTheSuite) {
  // The UCX backend (single-copy path included) without separate processes.
  RunUcxSuiteInThreads("ucx", {});
}

TEST(UcxCommunicatorTest, TheSuiteHoldsWithSingleCopiesAboveEightKiB) {
  // What ranks that outnumber their cores use: the ring's segments of 100'003 elements copy
  // once; 1 and 1021 elements (up to 8 KiB) still go through shared memory.
  UcxCommunicatorOptions ucx;
  ucx.single_copy_bytes = kOversubscribedSingleCopyBytes;
  RunUcxSuiteInThreads("ucx8k", ucx);
}

TEST(UcxCommunicatorTest, TheSuiteHoldsWhenEveryWaitSleepsAtOnceOrPollsLong) {
  // collective_spin_us 0: no poll before a wait sleeps on UCX's event fd, so every message that
  // is not there yet arrives through a wake-up; a long poll: nearly none does.
  UcxCommunicatorOptions sleeping;
  sleeping.spin_microseconds = 0;
  RunUcxSuiteInThreads("ucxsleep", sleeping);
  UcxCommunicatorOptions polling;
  polling.spin_microseconds = 100'000;
  RunUcxSuiteInThreads("ucxpoll", polling);
}

TEST(UcxCommunicatorTest, RanksThatOutnumberTheirCoresCopyOnceFromASmallerSize) {
  const int64_t standard = UcxPeerTransportOptions{}.single_copy_bytes;
  const std::vector<std::string> hosts = {"a", "a", "a", "b"};
  // Three ranks on host a: over its two cores, not over four.
  EXPECT_EQ(SingleCopyBytesFor({}, hosts, 0, 2), kOversubscribedSingleCopyBytes);
  EXPECT_EQ(SingleCopyBytesFor({}, hosts, 2, 4), standard);
  // Host b's one rank has cores to itself, whatever its neighbours on a do.
  EXPECT_EQ(SingleCopyBytesFor({}, hosts, 3, 1), standard);
  EXPECT_EQ(SingleCopyBytesFor({}, hosts, 0, 0), kOversubscribedSingleCopyBytes);  // 0 cores: 1
  // The setting wins; network_only copies nothing once.
  UcxCommunicatorOptions set;
  set.single_copy_bytes = 12345;
  EXPECT_EQ(SingleCopyBytesFor(set, hosts, 0, 2), 12345);
  UcxCommunicatorOptions network;
  network.network_only = true;
  network.single_copy_bytes = 12345;
  EXPECT_EQ(SingleCopyBytesFor(network, hosts, 0, 2), std::numeric_limits<int64_t>::max());
}

}  // namespace
}  // namespace tessera::testing

namespace tessera::testing {
namespace {

TEST(NcclCommunicatorTest, TheLibraryLoadsOrSaysHowToPointAtIt) {
  Result<std::string> version = NcclVersion();
  if (version.ok()) {
    EXPECT_EQ(version->rfind("2.", 0), 0u) << *version;
  } else {
    EXPECT_EQ(version.status().code(), StatusCode::kUnavailable);
    EXPECT_TRUE(version.status().message().find("TESSERA_NCCL_LIBRARY") != std::string::npos ||
                version.status().message().find("no CUDA backend") != std::string::npos)
        << version.status().ToString();
  }
}

TEST(NcclCommunicatorTest, WithoutAGpuItSaysWhyInsteadOfFailingLater) {
  if (!ProbeCudaDevices().devices.empty()) GTEST_SKIP() << "a GPU is present (see the gpu tests)";
  auto rendezvous = JoinSocketRendezvous({RendezvousPath("nccl"), 0, 1, 1000});
  ASSERT_OK(rendezvous.status());
  Result<std::unique_ptr<DeviceCommunicator>> communicator = ConnectNcclCommunicator(**rendezvous);
  ASSERT_FALSE(communicator.ok());
  EXPECT_EQ(communicator.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(communicator.status().message().find("no CUDA device") != std::string::npos ||
              communicator.status().message().find("no CUDA backend") != std::string::npos)
      << communicator.status().ToString();
}

}  // namespace
}  // namespace tessera::testing

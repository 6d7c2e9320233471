// core: Status/Result, dtypes, devices, shapes and tensors, allocators, attributes, settings,
// the bounds on pending connections.
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <thread>
#include <vector>

#include <gmock/gmock.h>

#include "core/atomic_file.h"
#include "core/attrs.h"
#include "core/checks.h"
#include "core/cpu_set.h"
#include "core/cpu_use.h"
#include "core/crypto.h"
#include "core/device.h"
#include "core/function_ref.h"
#include "core/pending_connections.h"
#include "core/settings.h"
#include "core/statistics.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgument("{} is odd", x);
  return x / 2;
}

Result<int> Quarter(int x) {
  TESSERA_ASSIGN_OR_RETURN(int half, Half(x));
  TESSERA_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

// The CPU meter: the process's CPU time grows with work, and between two samples the cores it
// kept busy are that CPU time over the wall time (0 at the first sample).
TEST(CpuMeterTest, CountsTheCpuTimeAndTheCoresKeptBusy) {
  CpuMeter meter;
  const CpuUse first = meter.Sample();
  EXPECT_EQ(first.cores_busy, 0);
  // Work until the kernel has counted 20 ms more of this process's CPU time.
  volatile double sink = 0;
  while (ProcessCpuSeconds() < first.seconds + 0.02) {
    for (int i = 0; i < 100000; ++i) sink = sink + std::sqrt(static_cast<double>(i));
  }
  const CpuUse second = meter.Sample();
  EXPECT_GE(second.seconds, first.seconds + 0.02);
  EXPECT_GT(second.cores_busy, 0);
  // One thread worked: the cores busy cannot exceed the threads this process has had running
  // (this test's and the runtime's idle ones), a handful at most.
  EXPECT_LT(second.cores_busy, 64);
}

TEST(StatusTest, CodesMessagesAndContext) {
  EXPECT_TRUE(Status::Ok().ok());
  Status s = NotFound("no op '{}'", "foo");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.ToString(), "NotFound: no op 'foo'");
  EXPECT_EQ(s.WithContext("task 't'").message(), "task 't': no op 'foo'");
  EXPECT_TRUE(Status::Ok().WithContext("ignored").ok());
}

TEST(StatusTest, ResultPropagatesErrorsThroughMacros) {
  EXPECT_EQ(*Quarter(8), 2);
  Result<int> odd = Quarter(6);
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.status().message(), "3 is odd");
}

TEST(StatusTest, ResultIsCopyableAndMovableLikeItsValue) {
  Result<std::vector<int>> a = std::vector<int>{1, 2, 3};
  Result<std::vector<int>> b = a;  // copy
  Result<std::vector<int>> c = std::move(a);
  EXPECT_EQ(b->size(), 3u);
  EXPECT_EQ(c->size(), 3u);
  Result<std::unique_ptr<int>> unique = std::make_unique<int>(7);  // move-only value
  std::unique_ptr<int> taken = std::move(unique).value();
  EXPECT_EQ(*taken, 7);
}

TEST(StatusTest, ResultFromOkStatusBecomesInternalError) {
  Result<int> r = Status::Ok();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(StatusDeathTest, AccessingErrorValueAborts) {
  Result<int> r = InvalidArgument("bad");
  EXPECT_DEATH((void)r.value(), "bad");
}

TEST(DTypeTest, SizesNamesAndParsing) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2);
  EXPECT_EQ(DTypeSize(DType::kI64), 8);
  EXPECT_EQ(DTypeSize(DType::kU16), 2);
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kI64, DType::kU16}) {
    EXPECT_EQ(*ParseDType(DTypeName(d)), d);
  }
  EXPECT_FALSE(ParseDType("f64").ok());
}

TEST(DeviceTest, ParseAndPrint) {
  EXPECT_EQ(*ParseDevice("cpu"), Device::Cpu());
  EXPECT_EQ(*ParseDevice("cuda"), Device::Cuda(0));
  EXPECT_EQ(*ParseDevice("cuda:3"), Device::Cuda(3));
  EXPECT_EQ(Device::Cuda(2).ToString(), "cuda:2");
  for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:1x"}) {
    Result<Device> d = ParseDevice(bad);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_NE(d.status().message().find(bad), std::string::npos);
  }
}

TEST(TensorTest, MetaBytesAndToString) {
  TensorMeta meta{Shape{4, 64, 256}, DType::kBF16, Device::Cuda(1)};
  EXPECT_EQ(meta.numel(), 4 * 64 * 256);
  EXPECT_EQ(meta.bytes(), 4 * 64 * 256 * 2);
  EXPECT_EQ(meta.ToString(), "bf16[4, 64, 256]@cuda:1");
  EXPECT_EQ(Shape{}.numel(), 1);
  EXPECT_EQ((Shape{3, 0}).numel(), 0);
}

TEST(TensorTest, ViewsShareTheBuffer) {
  Tensor flat = FloatTensor({6}, {0, 1, 2, 3, 4, 5});
  ASSERT_OK_AND_ASSIGN(Tensor view, flat.View(Shape{2, 2}, 2));
  EXPECT_EQ(view.data<float>()[0], 2.0f);
  view.data<float>()[3] = 50.0f;
  EXPECT_EQ(flat.data<float>()[5], 50.0f);
  EXPECT_FALSE(flat.View(Shape{4}, 3).ok());
  EXPECT_FALSE(flat.Reshape(Shape{7}).ok());
}

TEST(TensorDeathTest, WrongElementTypeAborts) {
  Tensor t = FloatTensor({1}, {1});
  EXPECT_DEATH((void)t.data<int32_t>(), "accessed as i32");
}

TEST(AllocatorTest, TracksLiveAndPeakBytes) {
  auto allocator = std::make_shared<AlignedHostAllocator>();
  {
    ASSERT_OK_AND_ASSIGN(Tensor a, Tensor::Empty({Shape{1000}, DType::kF32}, allocator));
    ASSERT_OK_AND_ASSIGN(Tensor b, Tensor::Empty({Shape{500}, DType::kF32}, allocator));
    EXPECT_EQ(allocator->stats().live_bytes, 6000);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.raw_data()) % kBufferAlignment, 0u);
  }
  EXPECT_EQ(allocator->stats().live_bytes, 0);
  EXPECT_EQ(allocator->stats().peak_bytes, 6000);
  allocator->ResetPeak();
  EXPECT_EQ(allocator->stats().peak_bytes, 0);
}

TEST(AllocatorTest, CachingAllocatorReusesBlocksOfTheSameSize) {
  auto allocator = std::make_shared<CachingHostAllocator>();
  void* first = nullptr;
  {
    ASSERT_OK_AND_ASSIGN(Tensor a, Tensor::Empty({Shape{4096}, DType::kF32}, allocator));
    first = a.raw_data();
  }
  EXPECT_EQ(allocator->stats().live_bytes, 0);
  EXPECT_EQ(allocator->stats().reserved_bytes, 4096 * 4);
  ASSERT_OK_AND_ASSIGN(Tensor b, Tensor::Empty({Shape{4096}, DType::kF32}, allocator));
  EXPECT_EQ(b.raw_data(), first);
  EXPECT_EQ(allocator->stats().live_bytes, 4096 * 4);
}

// A capped allocator refuses what would take its live bytes past the cap, before taking any
// memory, with a message naming the cap and where it came from; what is freed makes room again.
TEST(AllocatorTest, ACapRefusesWhatWouldPassItAndSaysWhere) {
  for (const std::shared_ptr<Allocator>& allocator :
       {std::shared_ptr<Allocator>(std::make_shared<AlignedHostAllocator>()),
        std::shared_ptr<Allocator>(std::make_shared<CachingHostAllocator>())}) {
    allocator->SetCap(10000, "--host-memory-gib 0.00001");
    EXPECT_EQ(allocator->cap(), 10000);
    ASSERT_OK_AND_ASSIGN(Tensor a, Tensor::Empty({Shape{2000}, DType::kF32}, allocator));
    const Result<Tensor> b = Tensor::Empty({Shape{1000}, DType::kF32}, allocator);  // 12000
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
    EXPECT_THAT(b.status().message(), HasSubstr("allocation of 4000 bytes would pass its cap"));
    EXPECT_THAT(b.status().message(), HasSubstr("8000 bytes live"));
    EXPECT_THAT(b.status().message(), HasSubstr("cap 10000 bytes"));
    EXPECT_THAT(b.status().message(), HasSubstr("from --host-memory-gib 0.00001"));
    EXPECT_EQ(allocator->stats().live_bytes, 8000);  // the refusal took nothing
    EXPECT_EQ(allocator->stats().peak_bytes, 8000);
    ASSERT_OK_AND_ASSIGN(Tensor c, Tensor::Empty({Shape{500}, DType::kF32}, allocator));  // 10000
    EXPECT_EQ(allocator->stats().live_bytes, 10000);
    a = Tensor();
    ASSERT_OK_AND_ASSIGN(Tensor d, Tensor::Empty({Shape{1000}, DType::kF32}, allocator));
    EXPECT_EQ(allocator->stats().live_bytes, 6000);
    allocator->SetCap(0);  // no cap
    EXPECT_OK(Tensor::Empty({Shape{100000}, DType::kF32}, allocator).status());
  }
}

// A buffer lent to a push (the peer copies it out of this process) counts until the borrower
// gives it back. An allocation the cap refuses meanwhile waits for the loan rather than failing:
// it succeeds when the returned loan freed the room, and fails with the cap once no loan is out
// and the room is still not there.
TEST(AllocatorTest, AnAllocationOverTheCapWaitsForLentBuffersToComeBack) {
  auto allocator = std::make_shared<AlignedHostAllocator>();
  allocator->SetCap(10000);
  const auto waits_for = [&](int64_t waits) {
    while (allocator->loan_waits() < waits) std::this_thread::yield();
  };
  ASSERT_OK_AND_ASSIGN(Tensor pushed, Tensor::Empty({Shape{2000}, DType::kF32}, allocator));
  std::shared_ptr<void> loan = Buffer::Lend(pushed.buffer());
  EXPECT_EQ(allocator->loans_out(), 1);
  pushed = Tensor();  // the step is done with it; the push still reads it
  EXPECT_EQ(allocator->stats().live_bytes, 8000);
  Result<Tensor> after_loan = InvalidArgument("not run");
  std::thread allocating([&] {
    after_loan = Tensor::Empty({Shape{1000}, DType::kF32}, allocator);
  });
  waits_for(1);
  loan.reset();  // the peer has read it: the buffer goes, then the loan comes back
  allocating.join();
  ASSERT_OK(after_loan.status());
  EXPECT_EQ(allocator->loans_out(), 0);
  EXPECT_EQ(allocator->stats().live_bytes, 4000);
  EXPECT_LE(allocator->stats().peak_bytes, 10000);

  // A lent buffer the step still holds frees nothing when the loan comes back.
  ASSERT_OK_AND_ASSIGN(Tensor kept, Tensor::Empty({Shape{1000}, DType::kF32}, allocator));
  loan = Buffer::Lend(kept.buffer());
  Result<Tensor> refused = InvalidArgument("not run");
  allocating = std::thread([&] { refused = Tensor::Empty({Shape{1000}, DType::kF32}, allocator); });
  waits_for(2);
  loan.reset();
  allocating.join();
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("would pass its cap (8000 bytes live"));
  // With no loan out, a refusal is at once.
  EXPECT_EQ(Tensor::Empty({Shape{1000}, DType::kF32}, allocator).status().code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(allocator->loan_waits(), 2);
}

// Threads allocating at once never pass the cap together: the reservation is atomic.
TEST(AllocatorTest, ThreadsAllocatingAtOnceNeverPassTheCap) {
  auto allocator = std::make_shared<AlignedHostAllocator>();
  constexpr int64_t kBlock = 4096, kCap = 10 * kBlock;
  allocator->SetCap(kCap);
  std::vector<void*> held;  // 8 blocks held throughout: the threads share the other two
  held.reserve(8);
  for (int i = 0; i < 8; ++i) {
    ASSERT_OK_AND_ASSIGN(void* block, allocator->Allocate(kBlock));
    held.push_back(block);
  }
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        Result<void*> block = allocator->Allocate(kBlock);
        if (!block.ok()) continue;  // the cap's refusal: the other threads hold the room
        static_cast<char*>(*block)[0] = 1;
        allocator->Deallocate(*block, kBlock);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_LE(allocator->stats().peak_bytes, kCap);
  for (void* block : held) allocator->Deallocate(block, kBlock);
  EXPECT_EQ(allocator->stats().live_bytes, 0);
}

// Under a cap the caching allocator's cache counts too: a new block that would take the live and
// cached bytes past it gives the cache back first, so what it holds stays under the cap.
TEST(AllocatorTest, ACappedCacheGivesItsBlocksBackToStayUnderTheCap) {
  auto allocator = std::make_shared<CachingHostAllocator>();
  allocator->SetCap(60000);
  { ASSERT_OK_AND_ASSIGN(Tensor a, Tensor::Empty({Shape{10000}, DType::kF32}, allocator)); }
  EXPECT_EQ(allocator->stats().reserved_bytes, 40000);  // cached
  ASSERT_OK_AND_ASSIGN(Tensor b, Tensor::Empty({Shape{6000}, DType::kF32}, allocator));
  EXPECT_EQ(allocator->stats().live_bytes, 24000);
  EXPECT_EQ(allocator->stats().reserved_bytes, 24000);  // 40000 + 24000 would pass 60000
  ASSERT_OK_AND_ASSIGN(Tensor c, Tensor::Empty({Shape{100}, DType::kF32}, allocator));
  EXPECT_EQ(allocator->stats().reserved_bytes, 24400);
}

// Buffers of 4 MiB and more start on a 2 MiB boundary (transparent huge pages can back them
// whole); smaller ones keep the 64-byte alignment. Both allocators, and the bytes are usable to
// the last one.
TEST(AllocatorTest, LargeBuffersAreHugePageAligned) {
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  for (const std::shared_ptr<Allocator>& allocator :
       {std::shared_ptr<Allocator>(std::make_shared<AlignedHostAllocator>()),
        std::shared_ptr<Allocator>(std::make_shared<CachingHostAllocator>())}) {
    const int64_t large = (int64_t{5} << 20) + 12;  // bytes: not a multiple of anything round
    ASSERT_OK_AND_ASSIGN(Tensor big, Tensor::Empty({Shape{large / 4}, DType::kF32}, allocator));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(big.raw_data()) % kHugePage, 0u);
    std::memset(big.raw_data(), 7, static_cast<size_t>(large));
    EXPECT_EQ(static_cast<const uint8_t*>(big.raw_data())[large - 1], 7);
    EXPECT_EQ(allocator->stats().live_bytes, large);  // accounting counts what was asked for
    ASSERT_OK_AND_ASSIGN(Tensor small, Tensor::Empty({Shape{250}, DType::kF32}, allocator));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(small.raw_data()) % kBufferAlignment, 0u);
  }
}

TEST(AttrsTest, TypedGettersNameTheAttribute) {
  Attrs attrs{{"heads", int64_t{4}},
              {"eps", 1e-5},
              {"mode", std::string("train")},
              {"ranges", std::vector<int64_t>{0, 10}}};
  EXPECT_EQ(*attrs.GetInt("heads"), 4);
  EXPECT_DOUBLE_EQ(*attrs.GetFloat("heads"), 4.0);  // ints convert to float
  EXPECT_EQ(*attrs.GetString("mode"), "train");
  EXPECT_EQ(attrs.GetInts("ranges")->size(), 2u);
  EXPECT_EQ(attrs.GetInt("missing", 9), 9);
  Result<int64_t> wrong = attrs.GetInt("eps");
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("'eps'"), std::string::npos);
  EXPECT_EQ(attrs.ToString(), "{eps=1e-05, heads=4, mode=train, ranges=[0,10]}");
}

TEST(StatisticsTest, TheMedianIsTheMiddleOrTheMeanOfTheMiddleTwo) {
  EXPECT_EQ(Median({3, 1, 2}), 2);
  EXPECT_EQ(Median({4, 1, 3, 2}), 2.5);
  EXPECT_EQ(Median({7}), 7);
  EXPECT_EQ(Median({}), 0);
  // One disturbed repeat does not move it far.
  EXPECT_EQ(Median({10, 11, 1000}), 11);
}

// Lines of one slope through groups of points, by the median of the slopes within each group:
// exact on such lines, one disturbed point leaves them so; points of another group, or of equal
// x, give no slope; a falling slope is held at 0, each intercept then its group's median.
TEST(StatisticsTest, LinesOfOneSlopeByMedians) {
  SharedSlope exact = FitSharedSlope({{1, 10, 1.5}, {1, 20, 2.5}, {4, 40, 6.0}, {4, 80, 10.0}});
  EXPECT_DOUBLE_EQ(exact.slope, 0.1);
  EXPECT_DOUBLE_EQ(exact.intercepts[1], 0.5);
  EXPECT_DOUBLE_EQ(exact.intercepts[4], 2.0);
  // Across the groups the pairs would give other slopes (4.5 / 60): not counted.
  const SharedSlope disturbed =
      FitSharedSlope({{4, 10, 1.5}, {4, 20, 2.5}, {4, 40, 40}, {4, 80, 8.5}, {4, 160, 16.5}});
  EXPECT_DOUBLE_EQ(disturbed.slope, 0.1);
  EXPECT_DOUBLE_EQ(disturbed.intercepts.at(4), 0.5);
  const SharedSlope falling = FitSharedSlope({{1, 10, 3}, {1, 20, 2}, {1, 30, 1}});
  EXPECT_EQ(falling.slope, 0);
  EXPECT_EQ(falling.intercepts.at(1), 2);
  const SharedSlope same = FitSharedSlope({{1, 5, 1}, {1, 5, 2}, {2, 9, 4}});
  EXPECT_EQ(same.slope, 0);
  EXPECT_EQ(same.intercepts.at(1), 1.5);
  EXPECT_EQ(same.intercepts.at(2), 4);
  EXPECT_TRUE(FitSharedSlope({}).intercepts.empty());
}

TEST(SettingsTest, DefaultsAndEnvironmentOverrides) {
  std::map<std::string, std::string> env = {{"TESSERA_CPU_THREADS", "3"},
                                            {"TESSERA_CACHE_HOST_ALLOCATIONS", "off"}};
  auto lookup = [&](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  ASSERT_OK_AND_ASSIGN(Settings settings, Settings::FromEnvironment(lookup));
  EXPECT_EQ(settings.cpu_threads, 3);
  EXPECT_FALSE(settings.cache_host_allocations);
  EXPECT_EQ(settings.log_level, "info");
  env["TESSERA_CPU_THREADS"] = "three";
  Result<Settings> bad = Settings::FromEnvironment(lookup);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("TESSERA_CPU_THREADS"), std::string::npos);
  EXPECT_NE(Settings::Describe().find("TESSERA_GEMM_SPLIT_MIN_FLOPS"), std::string::npos);
}

// Every integer setting has a range; a value outside it, or a heartbeat timeout that is not above
// the interval, is refused naming the variable and what it may be.
TEST(SettingsTest, ValuesOutOfRangeAreRefusedNamingTheVariable) {
  std::map<std::string, std::string> env;
  auto lookup = [&](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  const std::pair<const char*, const char*> refused[] = {
      {"TESSERA_CPU_THREADS", "-1"},          {"TESSERA_SCHEDULER_GRACE_MS", "-5"},
      {"TESSERA_DATA_CHUNK_BYTES", "0"},      {"TESSERA_COLLECTIVE_CHUNK_BYTES", "0"},
      {"TESSERA_HEARTBEAT_INTERVAL_MS", "0"}, {"TESSERA_DASHBOARD_PORT", "70000"},
      {"TESSERA_TRACE_INSTANCES", "0"},       {"TESSERA_PULL_TIMEOUT_MS", "-1"}};
  for (const auto& [variable, value] : refused) {
    env = {{variable, value}};
    Result<Settings> settings = Settings::FromEnvironment(lookup);
    ASSERT_FALSE(settings.ok()) << variable << "=" << value;
    EXPECT_EQ(settings.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(
        settings.status().message().find(fmt::format("{}={} is out of range", variable, value)),
        std::string::npos)
        << settings.status().ToString();
  }
  env = {{"TESSERA_CPU_THREADS", "0"}, {"TESSERA_DASHBOARD_PORT", "-1"}};
  EXPECT_OK(Settings::FromEnvironment(lookup).status());
  env = {{"TESSERA_HEARTBEAT_TIMEOUT_MS", "400"}};  // the interval is 500
  Result<Settings> heartbeat = Settings::FromEnvironment(lookup);
  ASSERT_FALSE(heartbeat.ok());
  EXPECT_NE(heartbeat.status().message().find("must be above TESSERA_HEARTBEAT_INTERVAL_MS"),
            std::string::npos)
      << heartbeat.status().ToString();
  EXPECT_NE(Settings::Describe().find("TESSERA_CPU_THREADS=0 (threads, 0..4096)"),
            std::string::npos)
      << Settings::Describe();
}

TEST(PendingConnectionsTest, CapsEvictTheOldestOfTheAddressThenOfAll) {
  PendingConnections pending({.deadline_ms = 1000, .max_pending = 4, .max_pending_per_address = 2});
  const auto t0 = PendingConnections::Clock::now();
  EXPECT_TRUE(pending.Add(1, "10.0.0.1", t0).empty());
  EXPECT_TRUE(pending.Add(2, "10.0.0.1", t0).empty());
  // A third from the same address: its oldest goes.
  EXPECT_EQ(pending.Add(3, "10.0.0.1", t0), std::vector<uint64_t>{1});
  EXPECT_TRUE(pending.Add(4, "10.0.0.2", t0).empty());
  EXPECT_TRUE(pending.Add(5, "10.0.0.3", t0).empty());
  // Five would exceed the cap in all: the oldest of all (2) goes.
  EXPECT_EQ(pending.Add(6, "10.0.0.4", t0), std::vector<uint64_t>{2});
  EXPECT_EQ(pending.size(), 4u);
  EXPECT_FALSE(pending.contains(1));
  EXPECT_TRUE(pending.contains(6));
  // Authenticated: no longer pending, and no longer counted against its address.
  pending.Remove(3);
  pending.Remove(3);  // a no-op
  EXPECT_TRUE(pending.Add(7, "10.0.0.1", t0).empty());
  EXPECT_EQ(pending.TakeOldest(), std::optional<uint64_t>(4));
  EXPECT_EQ(pending.size(), 3u);
}

TEST(PendingConnectionsTest, DeadlinesExpireOldestFirst) {
  PendingConnections pending(
      {.deadline_ms = 1000, .max_pending = 10, .max_pending_per_address = 10});
  const auto t0 = PendingConnections::Clock::now();
  pending.Add(1, "a", t0);
  pending.Add(2, "a", t0 + std::chrono::milliseconds(500));
  pending.Add(3, "b", t0 + std::chrono::milliseconds(900));
  EXPECT_TRUE(pending.TakeExpired(t0 + std::chrono::milliseconds(999)).empty());
  EXPECT_EQ(pending.TakeExpired(t0 + std::chrono::milliseconds(1500)),
            (std::vector<uint64_t>{1, 2}));
  pending.Remove(3);
  EXPECT_TRUE(pending.TakeExpired(t0 + std::chrono::seconds(10)).empty());
  EXPECT_EQ(pending.size(), 0u);
}

TEST(PendingConnectionsTest, AddressesAreThePeersIpWithoutThePort) {
  EXPECT_EQ(PendingConnections::AddressOf("10.0.0.7:51234"), "10.0.0.7");
  EXPECT_EQ(PendingConnections::AddressOf("::1:6380"), "::1");
  EXPECT_EQ(PendingConnections::AddressOf("[fe80::1]:80"), "fe80::1");
  EXPECT_EQ(PendingConnections::AddressOf("unix:/tmp/s.sock"), "unix:/tmp/s.sock");
  EXPECT_EQ(PendingConnections::AddressOf("host"), "host");
  EXPECT_TRUE(AcceptOutOfResources(EMFILE));
  EXPECT_TRUE(AcceptOutOfResources(ENFILE));
  EXPECT_FALSE(AcceptOutOfResources(ECONNABORTED));
  // The settings carry the limits.
  Settings settings;
  settings.preauth_deadline_ms = 250;
  settings.preauth_max_pending = 9;
  settings.preauth_max_pending_per_address = 3;
  const PendingLimits limits = PendingLimits::FromSettings(settings);
  EXPECT_EQ(limits.deadline_ms, 250);
  EXPECT_EQ(limits.max_pending, 9);
  EXPECT_EQ(limits.max_pending_per_address, 3);
}

TEST(AtomicFileTest, WritesWholeFileAndReplacesAtomically) {
  const std::string path = TempPath("tessera_atomic_test.txt");
  ASSERT_OK(WriteFileAtomically(path, "first"));
  ASSERT_OK(WriteFileAtomically(path, "second version"));
  std::ifstream in(path);
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, "second version");
  Status missing_dir = WriteFileAtomically("/nonexistent-dir/x.txt", "data");
  ASSERT_FALSE(missing_dir.ok());
  EXPECT_NE(missing_dir.message().find("/nonexistent-dir/x.txt"), std::string::npos);
}

std::string Hex(const Sha256Digest& digest) {
  std::string out;
  for (uint8_t byte : digest) out += fmt::format("{:02x}", byte);
  return out;
}

TEST(CryptoTest, HmacSha256MatchesRfc4231) {
  // RFC 4231 test cases 1 and 2.
  const std::string key1(20, '\x0b');
  EXPECT_EQ(Hex(HmacSha256(key1, "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(Hex(HmacSha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(CryptoTest, ConstantTimeEqualsAndRandomBytes) {
  EXPECT_TRUE(ConstantTimeEquals(std::string_view("token"), std::string_view("token")));
  EXPECT_FALSE(ConstantTimeEquals(std::string_view("token"), std::string_view("tokem")));
  EXPECT_FALSE(ConstantTimeEquals(std::string_view("token"), std::string_view("token2")));
  std::array<uint8_t, 32> a{}, b{};
  ASSERT_OK(FillRandom(a));
  ASSERT_OK(FillRandom(b));
  EXPECT_NE(a, b);  // 2^-256 to fail
}

Status FailingSyscall() {
  TESSERA_SYSCALL_RETURN_IF_ERROR((errno = EBADF, -1), "close");
  return Status::Ok();
}

TEST(ChecksTest, SystemErrorsNameTheCallAndWhereItWas) {
  const Status error = SystemError("open", ENOENT);
  EXPECT_EQ(error.code(), StatusCode::kUnavailable);
  EXPECT_EQ(error.message(), fmt::format("open failed: {} (at core_test.cc:{})",
                                         std::strerror(ENOENT), __LINE__ - 3));
  const Status from_macro = FailingSyscall();
  EXPECT_NE(from_macro.message().find("close failed: Bad file descriptor (at core_test.cc:"),
            std::string::npos)
      << from_macro.ToString();
  EXPECT_EQ(SystemError("read", EIO, StatusCode::kDataLoss).code(), StatusCode::kDataLoss);
}

int CallTwice(FunctionRef<int(int)> f) { return f(1) + f(2); }

TEST(FunctionRefTest, CallsTheReferencedCallableItselfNotACopy) {
  int calls = 0;
  auto counting = [&calls](int x) {
    ++calls;
    return 10 * x;
  };
  EXPECT_EQ(CallTwice(counting), 30);
  EXPECT_EQ(calls, 2);  // the lambda's own state changed: referenced, not copied
  struct Stateful {
    int total = 0;
    int operator()(int x) { return total += x; }
  } stateful;
  EXPECT_EQ(CallTwice(stateful), 4);  // 1, then 1 + 2
  EXPECT_EQ(stateful.total, 3);
  const FunctionRef<int(int)> ref = counting;
  const FunctionRef<int(int)> copy = ref;  // a copy refers to the same callable
  EXPECT_EQ(copy(4), 40);
  EXPECT_EQ(calls, 3);
}

// CPU lists as Linux writes them, both ways, and what a wrong one is told.
TEST(CpuSetTest, ListsParseAndFormatAsLinuxWritesThem) {
  ASSERT_OK_AND_ASSIGN(std::vector<int> cpus, ParseCpuList("8,0-3,2,10-11"));
  EXPECT_EQ(cpus, (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(FormatCpuList(cpus), "0-3,8,10-11");
  EXPECT_EQ(FormatCpuList({5}), "5");
  EXPECT_EQ(FormatCpuList({}), "");
  for (const auto& [bad, why] :
       std::vector<std::pair<std::string, std::string>>{{"", "a CPU is missing"},
                                                        {"3-1", "the range 3-1 runs backwards"},
                                                        {"0-", "a range has no end"},
                                                        {"1,", "a CPU is missing"},
                                                        {"a", "expected a CPU number"},
                                                        {"1;2", "unexpected ';'"},
                                                        {"99999", "CPUs end at 4095"}}) {
    const Result<std::vector<int>> parsed = ParseCpuList(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr(why)) << bad;
    EXPECT_THAT(parsed.status().message(), HasSubstr("'" + bad + "'"));
  }
}

// Workers get cores in order, wrapping around evenly when they outnumber them.
TEST(CpuSetTest, CoresAreAssignedInOrderAndSharedEvenly) {
  ASSERT_OK_AND_ASSIGN(auto two_of_one, AssignCores({0, 1}, 4, 1));
  EXPECT_EQ(two_of_one, (std::vector<std::vector<int>>{{0}, {1}, {0}, {1}}));
  ASSERT_OK_AND_ASSIGN(auto pairs, AssignCores({2, 3, 6, 7}, 2, 2));
  EXPECT_EQ(pairs, (std::vector<std::vector<int>>{{2, 3}, {6, 7}}));
  ASSERT_OK_AND_ASSIGN(auto wide, AssignCores({0, 1, 2}, 2, 2));
  EXPECT_EQ(wide, (std::vector<std::vector<int>>{{0, 1}, {0, 2}}));
  EXPECT_EQ(AssignCores({}, 2, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(AssignCores({0}, 0, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(AssignCores({0}, 1, 0).status().code(), StatusCode::kInvalidArgument);
  // The lists workers are started with: the later ones of a host continue the order.
  ASSERT_OK_AND_ASSIGN(const std::vector<int> cpus, ProcessCpus());
  ASSERT_OK_AND_ASSIGN(auto all, AssignCores(cpus, 5, 1));
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> later, WorkerCpuLists(3, 2, 1));
  EXPECT_EQ(later, (std::vector<std::string>{FormatCpuList(all[3]), FormatCpuList(all[4])}));
}

// Binding this process: to one of its CPUs it runs there, threads started afterwards too; a CPU
// it may not use is refused naming the ones it may; then it is put back.
TEST(CpuSetTest, AProcessBindsToItsOwnCpusOnly) {
  ASSERT_OK_AND_ASSIGN(const std::vector<int> before, ProcessCpus());
  ASSERT_FALSE(before.empty());
  ASSERT_OK(BindProcessTo({before.back()}));
  ASSERT_OK_AND_ASSIGN(std::vector<int> now, ProcessCpus());
  EXPECT_EQ(now, std::vector<int>{before.back()});
  std::vector<int> in_thread;
  std::thread([&] { in_thread = ProcessCpus().value(); }).join();
  EXPECT_EQ(in_thread, std::vector<int>{before.back()});
  const Status refused = BindProcessTo({4095});
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("4095: not every one is a CPU this process may run on"));
  EXPECT_THAT(refused.message(), HasSubstr(fmt::format("still runs on {}", before.back())));
  EXPECT_EQ(BindProcessTo({}).code(), StatusCode::kInvalidArgument);
  ASSERT_OK(BindProcessTo(before));
  ASSERT_OK_AND_ASSIGN(now, ProcessCpus());
  EXPECT_EQ(now, before);
}

}  // namespace
}  // namespace tessera::testing

// CudaContext's copies between pageable host memory and the device (ops/cuda/cuda_context.h):
// chunked through double-buffered pinned staging on their own streams, ordered against the
// compute stream by events. With a small staging buffer every size class is exercised: less
// than a chunk, exactly one, one byte over, many with a ragged tail. Ordering: a copy to the
// host sees what the compute stream wrote before it; a device-to-device copy (compute stream)
// right after an upload reads the uploaded bytes. Threads copying at once each get their own
// bytes back. Skips without a device.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "gpu_test_util.h"
#include "ops/cuda/cuda_context.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

constexpr int64_t kStaging = int64_t{1} << 20;

std::vector<uint8_t> Pattern(int64_t bytes, uint32_t seed) {
  std::vector<uint8_t> values(static_cast<size_t>(bytes));
  uint32_t x = seed * 2654435761u + 1;
  for (uint8_t& v : values) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    v = static_cast<uint8_t>(x);
  }
  return values;
}

class CudaContextTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TESSERA_REQUIRE_GPU();
    cuda::CudaContextOptions options;
    options.staging_bytes = kStaging;
    auto context = cuda::CudaContext::Create(options);
    ASSERT_TRUE(context.ok()) << context.status().ToString();
    context_ = *context;
  }
  std::shared_ptr<Buffer> DeviceBytes(int64_t bytes) {
    auto buffer = Buffer::Allocate(bytes, context_->allocator());
    EXPECT_TRUE(buffer.ok()) << buffer.status().ToString();
    return buffer.ok() ? *buffer : nullptr;
  }
  Status Up(void* device, const std::vector<uint8_t>& host) {
    return context_->Copy(device, Device::Cuda(0), host.data(), Device::Cpu(),
                          static_cast<int64_t>(host.size()));
  }
  Status Down(std::vector<uint8_t>& host, const void* device) {
    return context_->Copy(host.data(), Device::Cpu(), device, Device::Cuda(0),
                          static_cast<int64_t>(host.size()));
  }
  std::shared_ptr<cuda::CudaContext> context_;
};

TEST_F(CudaContextTest, EverySizeRoundTripsThroughTheStaging) {
  for (int64_t bytes : {int64_t{1}, int64_t{3}, kStaging - 1, kStaging, kStaging + 1,
                        5 * kStaging / 2, 7 * kStaging + 12345}) {
    SCOPED_TRACE("bytes " + std::to_string(bytes));
    const std::vector<uint8_t> sent = Pattern(bytes, static_cast<uint32_t>(bytes));
    std::shared_ptr<Buffer> device = DeviceBytes(bytes);
    ASSERT_NE(device, nullptr);
    ASSERT_OK(Up(device->data(), sent));
    std::vector<uint8_t> received(sent.size(), 0);
    ASSERT_OK(Down(received, device->data()));
    EXPECT_EQ(received, sent);
  }
}

TEST_F(CudaContextTest, CopiesAreOrderedWithTheComputeStream) {
  // Upload, then at once a device-to-device copy on the compute stream, then download: each
  // step must see the one before, though they run on three streams.
  const int64_t bytes = 6 * kStaging + 77;
  for (uint32_t round = 0; round < 4; ++round) {
    const std::vector<uint8_t> sent = Pattern(bytes, 100 + round);
    std::shared_ptr<Buffer> a = DeviceBytes(bytes), b = DeviceBytes(bytes);
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    std::vector<uint8_t> host = sent;
    ASSERT_OK(Up(a->data(), host));
    // The host buffer may be reused as soon as Copy returns, though the DMA may still run.
    std::fill(host.begin(), host.end(), uint8_t{0});
    ASSERT_OK(context_->Copy(b->data(), Device::Cuda(0), a->data(), Device::Cuda(0), bytes));
    std::vector<uint8_t> received(sent.size(), 0);
    ASSERT_OK(Down(received, b->data()));
    EXPECT_EQ(received, sent) << "round " << round;
  }
}

TEST_F(CudaContextTest, ThreadsCopyingAtOnceGetTheirOwnBytes) {
  constexpr int kThreads = 6;
  const int64_t bytes = 3 * kStaging + 5;
  std::vector<std::vector<uint8_t>> sent(kThreads), received(kThreads);
  std::vector<std::shared_ptr<Buffer>> device(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    sent[t] = Pattern(bytes, 1000 + static_cast<uint32_t>(t));
    received[t].assign(sent[t].size(), 0);
    device[t] = DeviceBytes(bytes);
    ASSERT_NE(device[t], nullptr);
  }
  std::vector<Status> status(kThreads);
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int repeat = 0; repeat < 3 && status[t].ok(); ++repeat) {
        status[t] = Up(device[t]->data(), sent[t]);
        if (status[t].ok()) status[t] = Down(received[t], device[t]->data());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_OK(status[t]);
    EXPECT_EQ(received[t], sent[t]) << "thread " << t;
  }
}

}  // namespace
}  // namespace tessera::testing

// CUDA device discovery. Runs where a GPU is present; skips with the reason elsewhere.
#include "core/cuda_device.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

TEST(CudaDeviceTest, EveryVisibleDeviceReportsItsProperties) {
  const CudaDevices probe = ProbeCudaDevices();
  if (probe.devices.empty()) GTEST_SKIP() << "no usable CUDA device: " << probe.reason;
  EXPECT_TRUE(BuiltWithCuda());
  EXPECT_TRUE(probe.reason.empty());
  for (const CudaDeviceInfo& device : probe.devices) {
    EXPECT_FALSE(device.name.empty());
    EXPECT_GT(device.total_memory_bytes, int64_t{1} << 30) << device.name;
    EXPECT_GE(device.compute_capability_major, 7) << device.name;
  }
}

}  // namespace
}  // namespace tessera::testing

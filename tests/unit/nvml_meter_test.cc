// The NVML meter (worker/nvml_meter.h) against a fake NVML: the device found by PCI bus id, the
// figures converted, every NVML failure named, NVML shut down exactly once per successful start;
// and loading the library where there is none (this machine has no NVIDIA driver).
#include "worker/nvml_meter.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "test_util.h"

namespace tessera::testing {
namespace {

// What the fake NVML answers, and what it was asked.
struct FakeNvml {
  int init_result = 0;
  int lookup_result = 0;
  int utilization_result = 0;
  int memory_result = 0;
  unsigned int gpu_percent = 0;
  NvmlMemory memory;
  std::string known_bus_id = "00000000:1B:00.0";
  int inits = 0;
  int shutdowns = 0;
  std::string looked_up;
};
FakeNvml fake;
int device_token = 0;  // the opaque device handle the fake hands out

NvmlApi FakeApi() {
  NvmlApi api;
  api.init = [] {
    if (fake.init_result == 0) ++fake.inits;
    return fake.init_result;
  };
  api.shutdown = [] {
    ++fake.shutdowns;
    return 0;
  };
  api.error_string = [](int result) {
    return result == 3 ? "Not Supported" : result == 6 ? "Not Found" : "GPU is lost";
  };
  api.device_by_pci_bus_id = [](const char* bus_id, void** device) {
    fake.looked_up = bus_id;
    if (fake.lookup_result != 0) return fake.lookup_result;
    if (fake.known_bus_id != bus_id) return 6;
    *device = &device_token;
    return 0;
  };
  api.utilization = [](void* device, NvmlUtilization* out) {
    EXPECT_EQ(device, &device_token);
    if (fake.utilization_result != 0) return fake.utilization_result;
    out->gpu = fake.gpu_percent;
    out->memory = 10;
    return 0;
  };
  api.memory = [](void* device, NvmlMemory* out) {
    EXPECT_EQ(device, &device_token);
    if (fake.memory_result != 0) return fake.memory_result;
    *out = fake.memory;
    return 0;
  };
  return api;
}

class NvmlMeterTest : public ::testing::Test {
 protected:
  void SetUp() override { fake = FakeNvml{}; }
};

TEST_F(NvmlMeterTest, TheFiguresAreTheDevicesAtItsBusId) {
  fake.gpu_percent = 37;
  fake.memory = {.total = 80ULL << 30, .free = 60ULL << 30, .used = 20ULL << 30};
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMeter> meter,
                         MakeNvmlMeter(FakeApi(), "00000000:1B:00.0"));
    EXPECT_EQ(fake.looked_up, "00000000:1B:00.0");
    ASSERT_OK_AND_ASSIGN(GpuUse use, meter->Sample());
    EXPECT_DOUBLE_EQ(use.utilization, 0.37);
    EXPECT_EQ(use.memory_used, int64_t{20} << 30);
    EXPECT_EQ(use.memory_total, int64_t{80} << 30);
    fake.gpu_percent = 100;
    ASSERT_OK_AND_ASSIGN(use, meter->Sample());
    EXPECT_DOUBLE_EQ(use.utilization, 1.0);
    EXPECT_EQ(fake.shutdowns, 0);
  }
  EXPECT_EQ(fake.inits, 1);
  EXPECT_EQ(fake.shutdowns, 1);  // the meter shuts NVML down when it goes
}

TEST_F(NvmlMeterTest, FiguresOutOfRangeAreBounded) {
  fake.gpu_percent = 250;                            // not a percentage
  fake.memory = {.total = 8, .free = 0, .used = 9};  // more used than there is
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMeter> meter,
                       MakeNvmlMeter(FakeApi(), "00000000:1B:00.0"));
  ASSERT_OK_AND_ASSIGN(GpuUse use, meter->Sample());
  EXPECT_DOUBLE_EQ(use.utilization, 1.0);
  EXPECT_EQ(use.memory_used, 8);
}

TEST_F(NvmlMeterTest, EachFailureIsNamed) {
  fake.init_result = 9;
  Status status = MakeNvmlMeter(FakeApi(), "00000000:1B:00.0").status();
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_NE(status.message().find("NVML could not start: GPU is lost (NVML error 9)"),
            std::string::npos)
      << status.ToString();
  EXPECT_EQ(fake.shutdowns, 0);  // never started

  fake = FakeNvml{};
  status = MakeNvmlMeter(FakeApi(), "00000000:3B:00.0").status();
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_NE(status.message().find("no GPU at PCI bus id 00000000:3B:00.0: Not Found"),
            std::string::npos)
      << status.ToString();
  EXPECT_EQ(fake.shutdowns, 1);  // started, then shut down again

  fake = FakeNvml{};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMeter> meter,
                       MakeNvmlMeter(FakeApi(), "00000000:1B:00.0"));
  fake.utilization_result = 3;
  status = meter->Sample().status();
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_NE(status.message().find("utilisation of the GPU at 00000000:1B:00.0: Not Supported"),
            std::string::npos)
      << status.ToString();
  fake.utilization_result = 0;
  fake.memory_result = 15;
  status = meter->Sample().status();
  EXPECT_NE(status.message().find("memory of the GPU at 00000000:1B:00.0: GPU is lost"),
            std::string::npos)
      << status.ToString();
  fake.memory_result = 0;
  EXPECT_OK(meter->Sample().status());  // a failure does not end the meter

  EXPECT_EQ(MakeNvmlMeter(FakeApi(), "").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeNvmlMeter(NvmlApi{}, "00000000:1B:00.0").status().code(),
            StatusCode::kInvalidArgument);
}

TEST(NvmlLoadTest, AMissingLibraryIsNamedWithWhereItComesFrom) {
  const Status status = LoadNvml("libnvidia-ml-not-here.so.1").status();
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_NE(status.message().find("libnvidia-ml-not-here.so.1"), std::string::npos)
      << status.ToString();
  EXPECT_NE(status.message().find("NVIDIA driver"), std::string::npos) << status.ToString();
}

TEST(NvmlLoadTest, ALibraryWithoutNvmlIsRefusedNamingTheEntryPoint) {
  const Status status = LoadNvml("libm.so.6").status();
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_NE(status.message().find("libm.so.6 has no nvmlInit_v2"), std::string::npos)
      << status.ToString();
}

}  // namespace
}  // namespace tessera::testing

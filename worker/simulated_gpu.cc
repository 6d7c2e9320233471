#include "worker/simulated_gpu.h"

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "worker/task_runner.h"

namespace tessera {

namespace {

constexpr unsigned char kScramble = 0xA5;

void Scramble(void* data, int64_t bytes) {
  auto* p = static_cast<unsigned char*>(data);
  for (int64_t i = 0; i < bytes; ++i) p[i] ^= kScramble;
}

// Host memory handed out as device memory (kind kCuda), capped like a GPU's allocator.
class SimulatedDeviceAllocator final : public Allocator {
 public:
  explicit SimulatedDeviceAllocator(int64_t cap) { SetCap(cap, "the simulated GPU's memory"); }
  std::string Name() const override { return "cuda:0 (simulated)"; }
  DeviceKind kind() const override { return DeviceKind::kCuda; }

 protected:
  void* DoAllocate(int64_t bytes) override {
    const size_t rounded = static_cast<size_t>((std::max<int64_t>(bytes, 1) + 63) / 64 * 64);
    return std::aligned_alloc(64, rounded);
  }
  void DoDeallocate(void* ptr, int64_t) override { std::free(ptr); }
};

class SimulatedGpu final : public DeviceRuntime {
 public:
  explicit SimulatedGpu(int64_t cap)
      : allocator_(std::make_shared<SimulatedDeviceAllocator>(cap)), cap_(cap) {}

  Device device() const override { return Device::Cuda(0); }
  std::string Describe() const override {
    return fmt::format("simulated GPU (cuda:0, host memory, scrambled; allocator cap {:.1f} GiB)",
                       cap_ / double(int64_t{1} << 30));
  }
  std::shared_ptr<Allocator> allocator() const override { return allocator_; }
  DeviceMemoryStats memory() const override {
    const MemoryStats stats = allocator_->stats();
    return {cap_, stats.live_bytes, stats.peak_bytes, stats.reserved_bytes};
  }
  Status Copy(void* dst, Device dst_device, const void* src, Device src_device,
              int64_t bytes) override {
    if (bytes <= 0) return Status::Ok();
    std::memmove(dst, src, static_cast<size_t>(bytes));
    // Scrambled on the device, plain on the host: crossing flips it.
    if (dst_device.is_cpu() != src_device.is_cpu()) Scramble(dst, bytes);
    return Status::Ok();
  }
  Status Synchronize() override { return Status::Ok(); }
  void* native() override { return nullptr; }

 private:
  std::shared_ptr<Allocator> allocator_;
  const int64_t cap_;
};

}  // namespace

bool SimulatedGpuRequested() {
  const char* value = std::getenv("TESSERA_SIMULATED_GPU");
  return value != nullptr && std::string(value) == "1";
}

std::shared_ptr<DeviceRuntime> MakeSimulatedGpu(int64_t memory_cap_bytes) {
  return std::make_shared<SimulatedGpu>(memory_cap_bytes > 0 ? memory_cap_bytes
                                                             : int64_t{64} << 30);
}

Status AddSimulatedGpuKernels(OpRegistry& registry) {
  return AddKernelsOnHostCopies(registry, DeviceKind::kCuda, [](std::string_view) { return true; });
}

}  // namespace tessera

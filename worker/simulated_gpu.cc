#include "worker/simulated_gpu.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/thread_annotations.h"
#include "ops/layer_program.h"
#include "worker/task_runner.h"

namespace tessera {

namespace {

constexpr unsigned char kScramble = 0xA5;
using Clock = std::chrono::steady_clock;

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

  // Busy time: the wall time during which at least one kernel ran (kernels on several threads
  // overlap, as a real GPU's streams do; NVML counts such time once too).
  void KernelStarted() EXCLUDES(busy_mutex_) {
    MutexLock lock(&busy_mutex_);
    if (running_kernels_++ == 0) busy_since_ = Clock::now();
  }
  void KernelFinished() EXCLUDES(busy_mutex_) {
    MutexLock lock(&busy_mutex_);
    if (--running_kernels_ == 0) busy_ += Clock::now() - busy_since_;
  }
  // Busy time so far, up to `now` for a kernel still running.
  Clock::duration Busy(Clock::time_point now) EXCLUDES(busy_mutex_) {
    MutexLock lock(&busy_mutex_);
    return running_kernels_ > 0 ? busy_ + (now - busy_since_) : busy_;
  }

 private:
  std::shared_ptr<Allocator> allocator_;
  const int64_t cap_;
  Mutex busy_mutex_;
  int running_kernels_ GUARDED_BY(busy_mutex_) = 0;
  Clock::time_point busy_since_ GUARDED_BY(busy_mutex_);
  Clock::duration busy_ GUARDED_BY(busy_mutex_){};
};

// The simulated GPU's own figures: the part of each sample period its kernels ran, and its
// allocator's reserved bytes of its cap.
class SimulatedGpuMeter final : public GpuMeter {
 public:
  SimulatedGpuMeter(std::shared_ptr<DeviceRuntime> runtime, SimulatedGpu* gpu)
      : runtime_(std::move(runtime)),
        gpu_(gpu),
        last_wall_(Clock::now()),
        last_busy_(gpu_->Busy(last_wall_)) {}

  Result<GpuUse> Sample() override {
    const Clock::time_point now = Clock::now();
    const Clock::duration busy = gpu_->Busy(now);
    const double wall = std::chrono::duration<double>(now - last_wall_).count();
    const double busy_seconds = std::chrono::duration<double>(busy - last_busy_).count();
    last_wall_ = now;
    last_busy_ = busy;
    const DeviceMemoryStats memory = runtime_->memory();
    GpuUse use;
    use.utilization = wall > 0 ? std::clamp(busy_seconds / wall, 0.0, 1.0) : 0.0;
    use.memory_used = memory.reserved_bytes;
    use.memory_total = memory.capacity_bytes;
    return use;
  }

 private:
  std::shared_ptr<DeviceRuntime> runtime_;
  SimulatedGpu* gpu_;
  Clock::time_point last_wall_;
  Clock::duration last_busy_;
};

// A simulated kernel: the CPU kernel on host copies, its time counted as the GPU's busy time.
KernelFn Timed(KernelFn kernel) {
  return [kernel = std::move(kernel)](
             const KernelContext& context, const std::vector<Tensor>& inputs,
             const std::vector<Tensor>& outputs, const Attrs& attrs) -> Status {
    auto* gpu = dynamic_cast<SimulatedGpu*>(context.device);
    if (gpu == nullptr) return kernel(context, inputs, outputs, attrs);
    gpu->KernelStarted();
    Status status;
    try {
      status = kernel(context, inputs, outputs, attrs);
    } catch (...) {
      gpu->KernelFinished();
      throw;
    }
    gpu->KernelFinished();
    return status;
  };
}

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
  // Layer programs run natively on the device (their ops' kernels are the simulated ones below),
  // as on a real GPU: a host access to a device value inside them reads scrambled bytes.
  TESSERA_RETURN_IF_ERROR(RegisterLayerProgramKernels(registry, DeviceKind::kCuda));
  for (const std::string& op : registry.OpNames()) {
    if (registry.Supports(op, DeviceKind::kCuda) || !registry.Supports(op, DeviceKind::kCpu)) {
      continue;
    }
    TESSERA_ASSIGN_OR_RETURN(const KernelFn* cpu, registry.FindKernel(op, DeviceKind::kCpu));
    TESSERA_RETURN_IF_ERROR(registry.AddKernel(op, DeviceKind::kCuda, Timed(OnHostCopies(*cpu))));
  }
  return Status::Ok();
}

Result<std::unique_ptr<GpuMeter>> MakeSimulatedGpuMeter(std::shared_ptr<DeviceRuntime> runtime) {
  auto* gpu = dynamic_cast<SimulatedGpu*>(runtime.get());
  if (gpu == nullptr) {
    return InvalidArgument("{} is not the simulated GPU",
                           runtime ? runtime->Describe() : std::string("no device"));
  }
  return std::unique_ptr<GpuMeter>(std::make_unique<SimulatedGpuMeter>(std::move(runtime), gpu));
}

}  // namespace tessera

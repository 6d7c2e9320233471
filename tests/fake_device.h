// A stand-in GPU for testing, on machines without one, what a GPU worker does around its device:
// tensors of kind kCuda whose "device memory" is host memory from an allocator of that kind, and
// a Copy that counts the bytes it moves each way. What it cannot show is a host read of device
// memory (here that works); the counts show that every such read went through Copy instead.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "core/allocator.h"
#include "core/device_runtime.h"

namespace tessera::testing {

class FakeDeviceAllocator final : public Allocator {
 public:
  std::string Name() const override { return "fake cuda:0"; }
  DeviceKind kind() const override { return DeviceKind::kCuda; }

 protected:
  void* DoAllocate(int64_t bytes) override {
    return std::aligned_alloc(64,
                              static_cast<size_t>((std::max<int64_t>(bytes, 1) + 63) / 64 * 64));
  }
  void DoDeallocate(void* ptr, int64_t) override { std::free(ptr); }
};

class FakeDevice final : public DeviceRuntime {
 public:
  Device device() const override { return Device::Cuda(0); }
  std::string Describe() const override { return "fake GPU (cuda:0, host memory)"; }
  std::shared_ptr<Allocator> allocator() const override { return allocator_; }
  DeviceMemoryStats memory() const override {
    const MemoryStats stats = allocator_->stats();
    return {int64_t{1} << 40, stats.live_bytes, stats.peak_bytes, stats.reserved_bytes};
  }
  Status Copy(void* dst, Device dst_device, const void* src, Device src_device,
              int64_t bytes) override {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    if (src_device.is_cpu() && !dst_device.is_cpu()) to_device += bytes;
    if (!src_device.is_cpu() && dst_device.is_cpu()) to_host += bytes;
    return Status::Ok();
  }
  Status Synchronize() override { return Status::Ok(); }
  void* native() override { return nullptr; }

  std::atomic<int64_t> to_device{0};  // bytes copied host -> device
  std::atomic<int64_t> to_host{0};    // bytes copied device -> host

 private:
  std::shared_ptr<Allocator> allocator_ = std::make_shared<FakeDeviceAllocator>();
};

}  // namespace tessera::testing

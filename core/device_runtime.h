// DeviceRuntime: what a process that computes on a GPU needs from it, without CUDA headers.
//
// A worker (or an in-process executor) that owns a GPU holds one DeviceRuntime for it
// (ops/cuda/cuda_context.h implements it on CUDA). The executor allocates the outputs of tasks
// whose objects live on the device from allocator(), moves bytes between tiers with Copy, and
// hands the runtime to kCuda kernels through KernelContext::device.
//
// Ordering model: every kernel and copy of the runtime is enqueued on one compute stream, in the
// order the calls are made. A task that produced a device object has, when it returns, enqueued
// the work that writes it; a later task that reads the object enqueues after it, so the stream
// orders them without host waits. Host memory is different: a copy that writes host memory, and
// Synchronize, return only once the bytes are there. Freeing a device buffer is stream-ordered
// too (the allocator returns it to its pool behind the work already enqueued).
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/device.h"
#include "core/status.h"

namespace tessera {

struct DeviceMemoryStats {
  int64_t capacity_bytes = 0;  // the allocator's cap (as opened, e.g. --gpu-memory-gib)
  int64_t live_bytes = 0;      // in tensors now
  int64_t peak_bytes = 0;      // since the last ResetPeak
  int64_t reserved_bytes = 0;  // held from the driver by the allocator's pool
};

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;

  virtual Device device() const = 0;
  // "NVIDIA H200 (cuda:0, sm_90, 139.8 GiB, allocator cap 138.3 GiB)".
  virtual std::string Describe() const = 0;

  // Device memory: buffers from it hold device pointers (never dereference them on the host).
  // ResourceExhausted past the cap, naming the cap and the live bytes.
  virtual std::shared_ptr<Allocator> allocator() const = 0;
  virtual DeviceMemoryStats memory() const = 0;

  // Copies `bytes` from `src` (on `src_device`) to `dst` (on `dst_device`); either side may be
  // the host or this device. Returns once a host destination holds the bytes; device
  // destinations are written in stream order.
  virtual Status Copy(void* dst, Device dst_device, const void* src, Device src_device,
                      int64_t bytes) = 0;
  // Sets `bytes` at `data` (on `device`: the host or this device) to zero, in stream order on the
  // device. The default copies zeros from the host; a GPU's runtime clears on its stream.
  virtual Status Zero(void* data, Device device, int64_t bytes) {
    if (bytes <= 0) return Status::Ok();
    if (device.is_cpu()) {
      std::memset(data, 0, static_cast<size_t>(bytes));
      return Status::Ok();
    }
    const std::vector<char> zeros(static_cast<size_t>(bytes), 0);
    return Copy(data, device, zeros.data(), Device::Cpu(), bytes);
  }
  // Waits until everything enqueued so far has finished; the first asynchronous error of a
  // kernel surfaces here (or at the next host copy).
  virtual Status Synchronize() = 0;

  // The implementation's own context (ops/cuda: CudaContext*), for kernels of that backend.
  virtual void* native() = 0;
};

}  // namespace tessera

// CudaContext: one GPU as a worker owns it (core/device_runtime.h's DeviceRuntime on CUDA).
//
// What it holds:
//   - the compute stream, on which every kernel, GEMM and device-to-device copy of the process is
//     enqueued in the order the calls are made (so device objects need no events between tasks:
//     a reader enqueues after its producer returned);
//   - a host-to-device and a device-to-host stream, ordered against the compute stream by
//     events: a copy to the host starts when the kernels enqueued before it are done and leaves
//     the compute stream running; kernels enqueued after a copy to the device wait for it (an
//     event the compute stream waits on), the host thread does not. The two directions run at
//     once (PCIe is full duplex), each one copy at a time;
//   - a caching, stream-ordered device allocator with a capacity cap: buffers come from a CUDA
//     memory pool (cudaMallocFromPoolAsync on the compute stream) that keeps freed memory for
//     reuse instead of returning it to the driver, so a step graph that allocates the same sizes
//     every step stops paying cudaMalloc after the first; a buffer freed while kernels that use
//     it are still queued is only reused behind them (cudaFreeAsync on the same stream). Past the
//     cap an allocation fails with ResourceExhausted naming the cap, the live bytes and the size;
//   - a cuBLASLt handle and its workspace (ops/cuda/matmul.h);
//   - pinned host staging, two buffers per direction: copies to and from pageable host memory
//     go through them in chunks, double-buffered (the host copies chunk i+1 into one buffer,
//     on several threads, while chunk i's DMA reads the other), so the host buffer may be reused
//     as soon as Copy returns and a large copy runs near the link's speed.
//
// Thread safety: every method may be called from any thread (the executor runs tasks on a TBB
// arena); each call makes the context's device current on the calling thread first. Kernels
// enqueued concurrently from several threads are ordered by the stream in the order their
// launches happened, which is all the executor needs (dependent tasks launch after their
// producers returned).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "core/device_runtime.h"
#include "core/status.h"
#include "core/thread_annotations.h"
#include "ops/cuda/volume_kernels.h"

namespace tessera::cuda {

struct CudaContextOptions {
  int device = 0;
  // Device memory the allocator may hand out; 0: the card's free memory less 1 GiB (for the
  // CUDA context, cuBLAS and NCCL).
  int64_t memory_cap_bytes = 0;
  int64_t blas_workspace_bytes = int64_t{32} << 20;  // cuBLASLt's recommendation for Hopper
  int64_t staging_bytes = int64_t{32} << 20;         // each of the four pinned staging buffers
};

class CudaContext final : public DeviceRuntime, public std::enable_shared_from_this<CudaContext> {
 public:
  // Unavailable naming the reason when the device cannot be used (no driver, no such device).
  static Result<std::shared_ptr<CudaContext>> Create(const CudaContextOptions& options);
  ~CudaContext() override;
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;

  // DeviceRuntime
  Device device() const override { return Device::Cuda(device_); }
  std::string Describe() const override { return description_; }
  std::shared_ptr<Allocator> allocator() const override { return allocator_; }
  DeviceMemoryStats memory() const override;
  Status Copy(void* dst, Device dst_device, const void* src, Device src_device,
              int64_t bytes) override;
  Status Zero(void* data, Device device, int64_t bytes) override;
  Status Synchronize() override;
  void* native() override { return this; }

  // Makes this context's device current on the calling thread.
  Status Activate() const;
  cudaStream_t stream() const { return stream_; }
  cublasLtHandle_t blas() const { return blas_; }
  void* blas_workspace() const { return blas_workspace_; }
  int64_t blas_workspace_bytes() const { return blas_workspace_bytes_; }
  int multiprocessors() const { return multiprocessors_; }

  // Device scratch of `bytes` for one kernel call, returned to the pool (stream-ordered) when
  // the last reference goes. ResourceExhausted past the cap.
  Result<std::shared_ptr<Buffer>> Scratch(int64_t bytes) const;

  // cuDNN's convolutions on the compute stream (volume_kernels.h), made on first use.
  // Unavailable when the build has no cuDNN or it cannot start (asked again on the next call).
  Result<CudnnConvolutions*> Convolutions() EXCLUDES(convolutions_mutex_);

 private:
  CudaContext() = default;

  int device_ = 0;
  std::string description_;
  int multiprocessors_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaMemPool_t pool_ = nullptr;
  std::shared_ptr<Allocator> allocator_;
  cublasLtHandle_t blas_ = nullptr;
  void* blas_workspace_ = nullptr;
  int64_t blas_workspace_bytes_ = 0;
  // One direction of host <-> device copies: its stream, double-buffered pinned staging (a
  // buffer is free again when its event has completed), and the events that order the stream
  // against the compute stream. The mutex keeps one copy per direction at a time.
  struct CopyLane {
    Mutex mutex;
    cudaStream_t stream GUARDED_BY(mutex) = nullptr;
    void* staging[2] GUARDED_BY(mutex) = {nullptr, nullptr};
    // The DMA that last used staging[b] is done.
    cudaEvent_t staged[2] GUARDED_BY(mutex) = {nullptr, nullptr};
    cudaEvent_t computed GUARDED_BY(mutex) = nullptr;  // recorded on the compute stream
    cudaEvent_t copied GUARDED_BY(mutex) = nullptr;    // recorded on the lane's stream
  };
  Status CreateLane(CopyLane& lane) EXCLUDES(lane.mutex);
  void DestroyLane(CopyLane& lane) EXCLUDES(lane.mutex);
  Status ToDevice(char* dst, const char* src, int64_t bytes);
  Status ToHost(char* dst, const char* src, int64_t bytes);

  CopyLane to_device_, to_host_;
  int64_t staging_bytes_ = 0;
  Mutex convolutions_mutex_;
  std::unique_ptr<CudnnConvolutions> convolutions_ GUARDED_BY(convolutions_mutex_);
};

}  // namespace tessera::cuda

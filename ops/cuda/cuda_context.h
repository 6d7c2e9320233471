// CudaContext: one GPU as a worker owns it (core/device_runtime.h's DeviceRuntime on CUDA).
//
// What it holds:
//   - the compute stream, on which every kernel, GEMM and copy of the process is enqueued in the
//     order the calls are made (so device objects need no events between tasks: a reader
//     enqueues after its producer returned);
//   - a caching, stream-ordered device allocator with a capacity cap: buffers come from a CUDA
//     memory pool (cudaMallocFromPoolAsync on the compute stream) that keeps freed memory for
//     reuse instead of returning it to the driver, so a step graph that allocates the same sizes
//     every step stops paying cudaMalloc after the first; a buffer freed while kernels that use
//     it are still queued is only reused behind them (cudaFreeAsync on the same stream). Past the
//     cap an allocation fails with ResourceExhausted naming the cap, the live bytes and the size;
//   - a cuBLASLt handle and its workspace (ops/cuda/matmul.h);
//   - a pinned host staging buffer: copies to and from pageable host memory go through it in
//     chunks, so a device-to-host copy is one DMA per chunk and the host buffer may be reused as
//     soon as Copy returns.
//
// Thread safety: every method may be called from any thread (the executor runs tasks on a TBB
// arena); each call makes the context's device current on the calling thread first. Kernels
// enqueued concurrently from several threads are ordered by the stream in the order their
// launches happened, which is all the executor needs (dependent tasks launch after their
// producers returned).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "core/device_runtime.h"
#include "core/status.h"

namespace tessera::cuda {

struct CudaContextOptions {
  int device = 0;
  // Device memory the allocator may hand out; 0: the card's free memory less 1 GiB (for the
  // CUDA context, cuBLAS and NCCL).
  int64_t memory_cap_bytes = 0;
  int64_t blas_workspace_bytes = int64_t{32} << 20;  // cuBLASLt's recommendation for Hopper
  int64_t staging_bytes = int64_t{64} << 20;         // pinned host staging buffer
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
  std::mutex staging_mutex_;  // one copy through the staging buffer at a time
  void* staging_ = nullptr;
  int64_t staging_bytes_ = 0;
};

}  // namespace tessera::cuda

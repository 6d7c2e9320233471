#include "ops/cuda/cuda_context.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "core/cuda_check.h"

namespace tessera::cuda {

namespace {

std::string GiB(int64_t bytes) { return fmt::format("{:.1f} GiB", bytes / double(1 << 30)); }

// Device memory from a CUDA memory pool, stream-ordered on the compute stream, capped.
class PoolAllocator final : public Allocator {
 public:
  PoolAllocator(int device, cudaStream_t stream, cudaMemPool_t pool, int64_t cap)
      : device_(device), stream_(stream), pool_(pool), cap_(cap) {}

  int64_t cap() const { return cap_; }

 protected:
  void* DoAllocate(int64_t bytes) override {
    if (stats().live_bytes + bytes > cap_) return nullptr;
    if (cudaSetDevice(device_) != cudaSuccess) return nullptr;
    void* ptr = nullptr;
    if (cudaMallocFromPoolAsync(&ptr, static_cast<size_t>(std::max<int64_t>(bytes, 256)), pool_,
                                stream_) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return ptr;
  }
  void DoDeallocate(void* ptr, int64_t) override {
    cudaSetDevice(device_);
    cudaFreeAsync(ptr, stream_);
  }
  int64_t CachedBytes() const override {
    uint64_t reserved = 0, used = 0;
    cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &reserved);
    cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemCurrent, &used);
    return std::max<int64_t>(0, static_cast<int64_t>(reserved) - static_cast<int64_t>(used));
  }
  std::string Name() const override { return fmt::format("cuda:{}", device_); }
  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string Limit() const override { return fmt::format(", cap {}", GiB(cap_)); }

 private:
  int device_;
  cudaStream_t stream_;
  cudaMemPool_t pool_;
  int64_t cap_;
};

}  // namespace

Result<std::shared_ptr<CudaContext>> CudaContext::Create(const CudaContextOptions& options) {
  int count = 0;
  const cudaError_t probe = cudaGetDeviceCount(&count);
  if (probe != cudaSuccess) {
    (void)cudaGetLastError();
    return Unavailable("no usable CUDA device: {} ({})", cudaGetErrorString(probe),
                       cudaGetErrorName(probe));
  }
  if (options.device < 0 || options.device >= count) {
    return InvalidArgument("CUDA device {} does not exist: this machine has {} (cuda:0..cuda:{})",
                           options.device, count, count - 1);
  }
  std::shared_ptr<CudaContext> context(new CudaContext());
  context->device_ = options.device;
  TESSERA_RETURN_IF_ERROR(context->Activate());
  cudaDeviceProp properties{};
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, options.device));
  context->multiprocessors_ = properties.multiProcessorCount;
  size_t free_bytes = 0, total_bytes = 0;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  int64_t cap = options.memory_cap_bytes;
  if (cap <= 0) cap = std::max<int64_t>(0, static_cast<int64_t>(free_bytes) - (int64_t{1} << 30));
  context->description_ = fmt::format(
      "{} (cuda:{}, sm_{}{}, {}, allocator cap {})", properties.name, options.device,
      properties.major, properties.minor, GiB(static_cast<int64_t>(total_bytes)), GiB(cap));

  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&context->stream_, cudaStreamNonBlocking));
  // The device's own pool would do, but a private one keeps its release threshold ours: keep
  // everything freed (the next step allocates the same sizes).
  cudaMemPoolProps pool_props{};
  pool_props.allocType = cudaMemAllocationTypePinned;
  pool_props.handleTypes = cudaMemHandleTypeNone;
  pool_props.location.type = cudaMemLocationTypeDevice;
  pool_props.location.id = options.device;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&context->pool_, &pool_props));
  uint64_t keep_everything = UINT64_MAX;
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaMemPoolSetAttribute(context->pool_, cudaMemPoolAttrReleaseThreshold, &keep_everything));
  context->allocator_ =
      std::make_shared<PoolAllocator>(options.device, context->stream_, context->pool_, cap);

  if (cublasLtCreate(&context->blas_) != CUBLAS_STATUS_SUCCESS) {
    return Unavailable("cuBLASLt could not be initialised on cuda:{}", options.device);
  }
  context->blas_workspace_bytes_ = options.blas_workspace_bytes;
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaMalloc(&context->blas_workspace_, static_cast<size_t>(options.blas_workspace_bytes)));
  context->staging_bytes_ = options.staging_bytes;
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaMallocHost(&context->staging_, static_cast<size_t>(options.staging_bytes)));
  return context;
}

CudaContext::~CudaContext() {
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (blas_ != nullptr) cublasLtDestroy(blas_);
  if (blas_workspace_ != nullptr) cudaFree(blas_workspace_);
  if (staging_ != nullptr) cudaFreeHost(staging_);
  // Buffers still alive (tensors the caller kept) hold the allocator, not the pool: the pool
  // goes with the process then. Destroy it only when nothing is live.
  if (pool_ != nullptr && allocator_ && allocator_.use_count() == 1 &&
      allocator_->stats().live_bytes == 0) {
    allocator_.reset();
    cudaMemPoolDestroy(pool_);
  }
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

Status CudaContext::Activate() const {
  TESSERA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  return Status::Ok();
}

DeviceMemoryStats CudaContext::memory() const {
  const MemoryStats stats = allocator_->stats();
  return DeviceMemoryStats{
      .capacity_bytes = static_cast<const PoolAllocator&>(*allocator_).cap(),
      .live_bytes = stats.live_bytes,
      .peak_bytes = stats.peak_bytes,
      .reserved_bytes = stats.reserved_bytes,
  };
}

Status CudaContext::Copy(void* dst, Device dst_device, const void* src, Device src_device,
                         int64_t bytes) {
  if (bytes == 0) return Status::Ok();
  // Every GPU side is this context's device (a plan's cuda:0 is "the worker's own GPU").
  TESSERA_RETURN_IF_ERROR(Activate());
  if (!dst_device.is_cpu() && !src_device.is_cpu()) {
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, stream_));
    return Status::Ok();
  }
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return Status::Ok();
  }
  // Host <-> device through the pinned staging buffer, chunk by chunk.
  std::lock_guard lock(staging_mutex_);
  const bool to_device = !dst_device.is_cpu();
  for (int64_t done = 0; done < bytes; done += staging_bytes_) {
    const size_t chunk = static_cast<size_t>(std::min(staging_bytes_, bytes - done));
    if (to_device) {
      // The staging buffer may still feed the previous chunk's DMA: wait for it first.
      TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      std::memcpy(staging_, static_cast<const char*>(src) + done, chunk);
      TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(dst) + done, staging_, chunk,
                                                   cudaMemcpyHostToDevice, stream_));
    } else {
      TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging_, static_cast<const char*>(src) + done,
                                                   chunk, cudaMemcpyDeviceToHost, stream_));
      TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      std::memcpy(static_cast<char*>(dst) + done, staging_, chunk);
    }
  }
  // The last host-to-device chunk reads the staging buffer asynchronously; the next Copy waits
  // for it (above) before overwriting, and the lock keeps other copies out meanwhile.
  return Status::Ok();
}

Status CudaContext::Synchronize() {
  TESSERA_RETURN_IF_ERROR(Activate());
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

Result<std::shared_ptr<Buffer>> CudaContext::Scratch(int64_t bytes) const {
  return Buffer::Allocate(bytes, allocator_);
}

}  // namespace tessera::cuda

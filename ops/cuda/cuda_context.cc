#include "ops/cuda/cuda_context.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "core/cuda_check.h"

namespace tessera::cuda {

namespace {

std::string GiB(int64_t bytes) { return fmt::format("{:.1f} GiB", bytes / double(1 << 30)); }

// memcpy between pageable and pinned host memory, on several threads when it is large (one
// thread copies ~10 GB/s, below a PCIe 5 link). Isolated: the waiting thread must not pick up
// another task, which could be a copy that needs the lock its caller holds.
void HostCopy(char* dst, const char* src, int64_t bytes) {
  constexpr int64_t kPiece = int64_t{4} << 20;
  if (bytes < 2 * kPiece) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return;
  }
  tbb::this_task_arena::isolate([&] {
    tbb::parallel_for(int64_t{0}, (bytes + kPiece - 1) / kPiece, [&](int64_t piece) {
      const int64_t begin = piece * kPiece, end = std::min(bytes, begin + kPiece);
      std::memcpy(dst + begin, src + begin, static_cast<size_t>(end - begin));
    });
  });
}

// Device memory from a CUDA memory pool, stream-ordered on the compute stream, capped.
class PoolAllocator final : public Allocator {
 public:
  PoolAllocator(int device, cudaStream_t stream, cudaMemPool_t pool, int64_t cap)
      : device_(device), stream_(stream), pool_(pool) {
    SetCap(cap, "--gpu-memory-gib, or the GPU's free memory");
  }

 protected:
  void* DoAllocate(int64_t bytes) override {
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

 private:
  int device_;
  cudaStream_t stream_;
  cudaMemPool_t pool_;
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
  TESSERA_RETURN_IF_ERROR(context->CreateLane(context->to_device_));
  TESSERA_RETURN_IF_ERROR(context->CreateLane(context->to_host_));
  return context;
}

Status CudaContext::CreateLane(CopyLane& lane) {
  MutexLock lock(&lane.mutex);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking));
  for (int b = 0; b < 2; ++b) {
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMallocHost(&lane.staging[b], static_cast<size_t>(staging_bytes_)));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&lane.staged[b], cudaEventDisableTiming));
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&lane.computed, cudaEventDisableTiming));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&lane.copied, cudaEventDisableTiming));
  return Status::Ok();
}

void CudaContext::DestroyLane(CopyLane& lane) {
  MutexLock lock(&lane.mutex);
  if (lane.stream != nullptr) cudaStreamSynchronize(lane.stream);
  for (int b = 0; b < 2; ++b) {
    if (lane.staging[b] != nullptr) cudaFreeHost(lane.staging[b]);
    if (lane.staged[b] != nullptr) cudaEventDestroy(lane.staged[b]);
  }
  if (lane.computed != nullptr) cudaEventDestroy(lane.computed);
  if (lane.copied != nullptr) cudaEventDestroy(lane.copied);
  if (lane.stream != nullptr) cudaStreamDestroy(lane.stream);
}

CudaContext::~CudaContext() {
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  {
    MutexLock lock(&convolutions_mutex_);
    convolutions_.reset();  // before the stream it runs on
  }
  if (blas_ != nullptr) cublasLtDestroy(blas_);
  if (blas_workspace_ != nullptr) cudaFree(blas_workspace_);
  DestroyLane(to_device_);
  DestroyLane(to_host_);
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
  return dst_device.is_cpu()
             ? ToHost(static_cast<char*>(dst), static_cast<const char*>(src), bytes)
             : ToDevice(static_cast<char*>(dst), static_cast<const char*>(src), bytes);
}

Status CudaContext::ToDevice(char* dst, const char* src, int64_t bytes) {
  CopyLane& lane = to_device_;
  MutexLock lock(&lane.mutex);
  // The destination was allocated on the compute stream (and may have been in use there).
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(lane.computed, stream_));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(lane.stream, lane.computed, 0));
  for (int64_t done = 0, i = 0; done < bytes; done += staging_bytes_, ++i) {
    const int64_t chunk = std::min(staging_bytes_, bytes - done);
    const int b = static_cast<int>(i % 2);
    // The buffer may still feed the DMA two chunks back (or a previous copy's): wait for it.
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(lane.staged[b]));
    HostCopy(static_cast<char*>(lane.staging[b]), src + done, chunk);
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst + done, lane.staging[b],
                                                 static_cast<size_t>(chunk), cudaMemcpyHostToDevice,
                                                 lane.stream));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(lane.staged[b], lane.stream));
  }
  // Kernels enqueued from now on read the destination after its last chunk landed.
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(lane.copied, lane.stream));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, lane.copied, 0));
  return Status::Ok();
}

Status CudaContext::ToHost(char* dst, const char* src, int64_t bytes) {
  CopyLane& lane = to_host_;
  MutexLock lock(&lane.mutex);
  // The source's producers are the kernels enqueued on the compute stream so far.
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(lane.computed, stream_));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(lane.stream, lane.computed, 0));
  const int64_t chunks = (bytes + staging_bytes_ - 1) / staging_bytes_;
  const auto enqueue = [&](int64_t i) REQUIRES(lane.mutex) -> Status {
    const int b = static_cast<int>(i % 2);
    const int64_t begin = i * staging_bytes_;
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        lane.staging[b], src + begin, static_cast<size_t>(std::min(staging_bytes_, bytes - begin)),
        cudaMemcpyDeviceToHost, lane.stream));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(lane.staged[b], lane.stream));
    return Status::Ok();
  };
  TESSERA_RETURN_IF_ERROR(enqueue(0));
  for (int64_t i = 0; i < chunks; ++i) {
    // Chunk i+1's DMA into the other buffer runs while chunk i is copied out of this one (the
    // other buffer's previous chunk, i-1, was copied out in the last round).
    if (i + 1 < chunks) TESSERA_RETURN_IF_ERROR(enqueue(i + 1));
    const int b = static_cast<int>(i % 2);
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(lane.staged[b]));
    const int64_t begin = i * staging_bytes_;
    HostCopy(dst + begin, static_cast<const char*>(lane.staging[b]),
             std::min(staging_bytes_, bytes - begin));
  }
  return Status::Ok();
}

Status CudaContext::Zero(void* data, Device device, int64_t bytes) {
  if (bytes <= 0 || device.is_cpu()) return DeviceRuntime::Zero(data, device, bytes);
  TESSERA_RETURN_IF_ERROR(Activate());
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(data, 0, static_cast<size_t>(bytes), stream_));
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

Result<CudnnConvolutions*> CudaContext::Convolutions() {
  MutexLock lock(&convolutions_mutex_);
  if (convolutions_ == nullptr) {
    TESSERA_ASSIGN_OR_RETURN(convolutions_, CudnnConvolutions::Create(stream_));
  }
  return convolutions_.get();
}

}  // namespace tessera::cuda

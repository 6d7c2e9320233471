// The NCCL backend (see nccl_communicator.h). NCCL is reached only through the NcclLibrary
// table below, filled by dlopen/dlsym: the one thin wrapper around it.
#include "collectives/nccl_communicator.h"

#if TESSERA_HAVE_CUDA

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "core/cuda_check.h"
#include "core/thread_annotations.h"

namespace tessera {

namespace {

using Clock = std::chrono::steady_clock;

// NCCL's entry points, resolved at run time.
struct NcclLibrary {
  decltype(&ncclGetVersion) GetVersion = nullptr;
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRank) CommInitRank = nullptr;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  decltype(&ncclAllReduce) AllReduce = nullptr;
  decltype(&ncclReduceScatter) ReduceScatter = nullptr;
  decltype(&ncclAllGather) AllGather = nullptr;
  decltype(&ncclBroadcast) Broadcast = nullptr;
  decltype(&ncclReduce) Reduce = nullptr;
  decltype(&ncclSend) Send = nullptr;
  decltype(&ncclRecv) Recv = nullptr;
  decltype(&ncclGroupStart) GroupStart = nullptr;
  decltype(&ncclGroupEnd) GroupEnd = nullptr;
  int version = 0;
  bool non_blocking = false;  // the library understands this header's ncclConfig_t
};

Result<const NcclLibrary*> LoadNccl() {
  static std::once_flag once;
  static NcclLibrary library;
  static Status failure;
  std::call_once(once, [] {
    std::vector<std::string> candidates;
    if (const char* path = std::getenv("TESSERA_NCCL_LIBRARY")) candidates.emplace_back(path);
    candidates.emplace_back("libnccl.so.2");
    candidates.emplace_back("/usr/local/cuda/lib/libnccl.so.2");
    candidates.emplace_back("/usr/local/cuda/lib64/libnccl.so.2");
    void* handle = nullptr;
    std::string errors;
    for (const std::string& candidate : candidates) {
      handle = ::dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr) break;
      errors += fmt::format("\n  {}: {}", candidate, ::dlerror());
    }
    if (handle == nullptr) {
      failure = Unavailable(
          "cannot load NCCL (set TESSERA_NCCL_LIBRARY to libnccl.so.2, e.g. the one PyTorch "
          "ships):{}",
          errors);
      return;
    }
    bool missing = false;
    auto resolve = [&](auto& function, const char* name) {
      function =
          reinterpret_cast<std::remove_reference_t<decltype(function)>>(::dlsym(handle, name));
      if (function == nullptr) {
        failure = Unavailable("the NCCL library lacks {}", name);
        missing = true;
      }
    };
    resolve(library.GetVersion, "ncclGetVersion");
    resolve(library.GetUniqueId, "ncclGetUniqueId");
    resolve(library.CommInitRank, "ncclCommInitRank");
    resolve(library.CommInitRankConfig, "ncclCommInitRankConfig");
    resolve(library.CommGetAsyncError, "ncclCommGetAsyncError");
    resolve(library.CommAbort, "ncclCommAbort");
    resolve(library.CommDestroy, "ncclCommDestroy");
    resolve(library.GetErrorString, "ncclGetErrorString");
    resolve(library.AllReduce, "ncclAllReduce");
    resolve(library.ReduceScatter, "ncclReduceScatter");
    resolve(library.AllGather, "ncclAllGather");
    resolve(library.Broadcast, "ncclBroadcast");
    resolve(library.Reduce, "ncclReduce");
    resolve(library.Send, "ncclSend");
    resolve(library.Recv, "ncclRecv");
    resolve(library.GroupStart, "ncclGroupStart");
    resolve(library.GroupEnd, "ncclGroupEnd");
    if (missing) return;
    library.GetVersion(&library.version);
    // An older library may reject this header's (newer) config struct: use blocking init then.
    library.non_blocking = library.version >= NCCL_VERSION_CODE;
  });
  if (!failure.ok()) return failure;
  return &library;
}

Result<ncclDataType_t> NcclType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
    case DType::kU16:
      return ncclUint8;  // copies only: moved as bytes (count doubled by the caller)
  }
  return InvalidArgument("NCCL has no type for {}", DTypeName(dtype));
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

class NcclCommunicator final : public DeviceCommunicator {
 public:
  NcclCommunicator(const NcclLibrary& nccl, int rank, int size,
                   const NcclCommunicatorOptions& options)
      : nccl_(nccl), rank_(rank), size_(size), options_(options) {}
  ~NcclCommunicator() override;

  Status Init(const ncclUniqueId& id);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int64_t bytes_sent() const override { return bytes_sent_; }
  void SetComputeStream(void* stream) override { compute_ = static_cast<cudaStream_t>(stream); }
  void* stream() const override { return stream_; }

  Status AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op) override {
    TESSERA_ASSIGN_OR_RETURN(ncclDataType_t type, ReductionType(dtype, "all-reduce"));
    Account(count * DTypeSize(dtype) * 2 * (size_ - 1) / size_);
    return Enqueue("all-reduce", [&] {
      return nccl_.AllReduce(buffer, buffer, static_cast<size_t>(count), type, NcclOp(op), comm_,
                             stream_);
    });
  }
  Status ReduceScatter(const void* send, void* recv, int64_t count, DType dtype,
                       ReduceOp op) override {
    TESSERA_ASSIGN_OR_RETURN(ncclDataType_t type, ReductionType(dtype, "reduce-scatter"));
    Account(count * DTypeSize(dtype) * (size_ - 1));
    return Enqueue("reduce-scatter", [&] {
      return nccl_.ReduceScatter(send, recv, static_cast<size_t>(count), type, NcclOp(op), comm_,
                                 stream_);
    });
  }
  Status AllGather(const void* send, void* recv, int64_t count, DType dtype) override {
    TESSERA_ASSIGN_OR_RETURN(auto typed, CopyType(count, dtype));
    Account(count * DTypeSize(dtype) * (size_ - 1));
    return Enqueue("all-gather", [&] {
      return nccl_.AllGather(send, recv, typed.first, typed.second, comm_, stream_);
    });
  }
  // One group of a send and a receive per peer (this rank's own block too: NCCL copies it), which
  // NCCL schedules as one exchange. Not ncclAlltoAll: that is NCCL 2.28's, and the library loaded
  // at run time may be older (e.g. the one PyTorch ships).
  Status AllToAll(const void* send, void* recv, int64_t count, DType dtype) override {
    TESSERA_ASSIGN_OR_RETURN(auto typed, CopyType(count, dtype));
    const int64_t block = count * DTypeSize(dtype);
    const auto from = reinterpret_cast<uintptr_t>(send);
    const auto into = reinterpret_cast<uintptr_t>(recv);
    const auto total = static_cast<uintptr_t>(block * size_);
    if (count > 0 && from < into + total && into < from + total) {
      return InvalidArgument(
          "all-to-all of {} x {} per rank: the send and receive buffers overlap (pass separate "
          "buffers of {} bytes each)",
          count, DTypeName(dtype), block * size_);
    }
    Account(block * (size_ - 1));
    const char* input = static_cast<const char*>(send);
    char* output = static_cast<char*>(recv);
    return Enqueue("all-to-all", [&] {
      ncclResult_t result = nccl_.GroupStart();
      for (int peer = 0; peer < size_ && result == ncclSuccess; ++peer) {
        result = nccl_.Send(input + peer * block, typed.first, typed.second, peer, comm_, stream_);
        if (result == ncclSuccess) {
          result =
              nccl_.Recv(output + peer * block, typed.first, typed.second, peer, comm_, stream_);
        }
      }
      const ncclResult_t ended = nccl_.GroupEnd();
      return result != ncclSuccess ? result : ended;
    });
  }
  Status Broadcast(void* buffer, int64_t count, DType dtype, int root) override {
    TESSERA_RETURN_IF_ERROR(CheckPeer(root, "root"));
    TESSERA_ASSIGN_OR_RETURN(auto typed, CopyType(count, dtype));
    if (rank_ == root) Account(count * DTypeSize(dtype));
    return Enqueue("broadcast", [&] {
      return nccl_.Broadcast(buffer, buffer, typed.first, typed.second, root, comm_, stream_);
    });
  }
  Status Reduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp op,
                int root) override {
    TESSERA_RETURN_IF_ERROR(CheckPeer(root, "root"));
    TESSERA_ASSIGN_OR_RETURN(ncclDataType_t type, ReductionType(dtype, "reduce"));
    Account(count * DTypeSize(dtype));
    return Enqueue("reduce", [&] {
      return nccl_.Reduce(send, recv, static_cast<size_t>(count), type, NcclOp(op), root, comm_,
                          stream_);
    });
  }
  Status Send(const void* data, int64_t count, DType dtype, int peer) override {
    return SendRecv(data, count, peer, nullptr, 0, -1, dtype);
  }
  Status Recv(void* data, int64_t count, DType dtype, int peer) override {
    return SendRecv(nullptr, 0, -1, data, count, peer, dtype);
  }
  Status SendRecv(const void* send, int64_t send_count, int dest, void* recv, int64_t recv_count,
                  int source, DType dtype) override {
    if (dest >= 0) TESSERA_RETURN_IF_ERROR(CheckPeer(dest, "destination"));
    if (source >= 0) TESSERA_RETURN_IF_ERROR(CheckPeer(source, "source"));
    if (dest < 0 && source < 0) return InvalidArgument("send/recv with neither peer");
    TESSERA_ASSIGN_OR_RETURN(auto sending, CopyType(send_count, dtype));
    TESSERA_ASSIGN_OR_RETURN(auto receiving, CopyType(recv_count, dtype));
    if (dest >= 0) Account(send_count * DTypeSize(dtype));
    return Enqueue("send/recv", [&] {
      ncclResult_t result = nccl_.GroupStart();
      if (result == ncclSuccess && dest >= 0) {
        result = nccl_.Send(send, sending.first, sending.second, dest, comm_, stream_);
      }
      if (result == ncclSuccess && source >= 0) {
        result = nccl_.Recv(recv, receiving.first, receiving.second, source, comm_, stream_);
      }
      const ncclResult_t ended = nccl_.GroupEnd();
      return result != ncclSuccess ? result : ended;
    });
  }

  void Abort(const Status& reason) override {
    MutexLock lock(&abort_mutex_);
    if (!aborted_.ok() || comm_ == nullptr) return;
    aborted_ = reason.ok() ? Cancelled("the communicator was aborted") : reason;
    nccl_.CommAbort(comm_);
    comm_ = nullptr;
  }

  Status Synchronize() override {
    const Clock::time_point deadline =
        Clock::now() + std::chrono::milliseconds(options_.timeout_ms);
    while (true) {
      TESSERA_RETURN_IF_ERROR(Broken());
      const cudaError_t done = cudaStreamQuery(stream_);
      if (done == cudaSuccess) return Status::Ok();
      if (done != cudaErrorNotReady) return CudaError(done);
      TESSERA_RETURN_IF_ERROR(AsyncError("a collective"));
      if (Clock::now() > deadline) {
        Status timed_out = TimedOut(
            "rank {}: NCCL collectives did not finish within {} ms (a peer is dead or stuck)",
            rank_, options_.timeout_ms);
        Abort(timed_out);
        return timed_out;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  Status Broken() {
    MutexLock lock(&abort_mutex_);
    return aborted_;
  }

  Status CheckPeer(int peer, const char* what) const {
    if (peer < 0 || peer >= size_) {
      return InvalidArgument("{} {} is not a rank of this {}-rank group", what, peer, size_);
    }
    return Status::Ok();
  }

  Result<ncclDataType_t> ReductionType(DType dtype, const char* what) const {
    if (!CollectiveSupports(dtype)) {
      return InvalidArgument("{} does not reduce {} (f32, bf16, f16, i32 only)", what,
                             DTypeName(dtype));
    }
    return NcclType(dtype);
  }

  // Copies move any dtype: u16 (no NCCL type) as twice as many bytes.
  Result<std::pair<size_t, ncclDataType_t>> CopyType(int64_t count, DType dtype) const {
    if (count < 0) return InvalidArgument("{} elements", count);
    TESSERA_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(dtype));
    const size_t n = static_cast<size_t>(dtype == DType::kU16 ? count * 2 : count);
    return std::make_pair(n, type);
  }

  void Account(int64_t bytes) { bytes_sent_ += size_ > 1 ? bytes : 0; }

  Status AsyncError(const char* what) {
    MutexLock lock(&abort_mutex_);
    if (comm_ == nullptr) return aborted_;
    ncclResult_t state = ncclSuccess;
    nccl_.CommGetAsyncError(comm_, &state);
    if (state == ncclSuccess || state == ncclInProgress) return Status::Ok();
    return Unavailable("rank {}: NCCL failed in {}: {}", rank_, what, nccl_.GetErrorString(state));
  }

  // Orders `launch` (an NCCL call on stream_) after the compute stream, and the compute stream
  // after it.
  template <typename Launch>
  Status Enqueue(const char* what, Launch launch) {
    TESSERA_RETURN_IF_ERROR(Broken());
    TESSERA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(inputs_ready_, compute_));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, inputs_ready_, 0));
    ncclResult_t result = launch();
    // Non-blocking communicators may still be enqueuing: wait for that (not for the GPU).
    const Clock::time_point deadline =
        Clock::now() + std::chrono::milliseconds(options_.timeout_ms);
    while (result == ncclInProgress) {
      if (Clock::now() > deadline) {
        Abort(TimedOut("rank {}: enqueuing the {} took more than {} ms", rank_, what,
                       options_.timeout_ms));
        return Broken();
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      MutexLock lock(&abort_mutex_);
      if (comm_ == nullptr) break;
      nccl_.CommGetAsyncError(comm_, &result);
    }
    if (result != ncclSuccess) {
      return Unavailable("rank {}: NCCL {} failed: {}", rank_, what, nccl_.GetErrorString(result));
    }
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_, stream_));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, done_, 0));
    return Status::Ok();
  }

  const NcclLibrary& nccl_;
  const int rank_;
  const int size_;
  const NcclCommunicatorOptions options_;
  // Written under abort_mutex_ once formed (Abort may null it from any thread); the launches
  // read it on the owning thread without the lock, so it is not GUARDED_BY.
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaStream_t compute_ = nullptr;
  cudaEvent_t inputs_ready_ = nullptr;
  cudaEvent_t done_ = nullptr;
  int64_t bytes_sent_ = 0;
  Mutex abort_mutex_;
  Status aborted_ GUARDED_BY(abort_mutex_);
};

Status NcclCommunicator::Init(const ncclUniqueId& id) {
  TESSERA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  ncclResult_t result;
  if (nccl_.non_blocking) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    result = nccl_.CommInitRankConfig(&comm_, size_, id, rank_, &config);
    const Clock::time_point deadline =
        Clock::now() + std::chrono::milliseconds(options_.timeout_ms);
    while (result == ncclInProgress && comm_ != nullptr) {
      if (Clock::now() > deadline) {
        nccl_.CommAbort(comm_);
        comm_ = nullptr;
        return TimedOut("rank {}: NCCL communicator of {} ranks did not form within {} ms", rank_,
                        size_, options_.timeout_ms);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      nccl_.CommGetAsyncError(comm_, &result);
    }
  } else {
    result = nccl_.CommInitRank(&comm_, size_, id, rank_);
  }
  if (result != ncclSuccess) {
    if (comm_ != nullptr) nccl_.CommAbort(comm_);
    comm_ = nullptr;
    return Unavailable("rank {}: NCCL communicator of {} ranks on device {}: {}", rank_, size_,
                       options_.device, nccl_.GetErrorString(result));
  }
  return Status::Ok();
}

NcclCommunicator::~NcclCommunicator() {
  {
    MutexLock lock(&abort_mutex_);
    if (comm_ != nullptr) {
      cudaStreamSynchronize(stream_);
      nccl_.CommDestroy(comm_);
      comm_ = nullptr;
    }
  }
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (inputs_ready_ != nullptr) cudaEventDestroy(inputs_ready_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

}  // namespace

Result<std::string> NcclVersion() {
  TESSERA_ASSIGN_OR_RETURN(const NcclLibrary* nccl, LoadNccl());
  const int v = nccl->version;
  return fmt::format("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100);
}

Result<std::unique_ptr<DeviceCommunicator>> ConnectNcclCommunicator(
    Rendezvous& rendezvous, const NcclCommunicatorOptions& options) {
  int devices = 0;
  const cudaError_t counted = cudaGetDeviceCount(&devices);
  if (counted != cudaSuccess || devices == 0) {
    return Unavailable("rank {}: no CUDA device for NCCL ({})", rendezvous.rank(),
                       counted != cudaSuccess ? cudaGetErrorString(counted) : "none visible");
  }
  if (options.device < 0 || options.device >= devices) {
    return InvalidArgument("rank {}: CUDA device {} does not exist ({} visible)", rendezvous.rank(),
                           options.device, devices);
  }
  TESSERA_ASSIGN_OR_RETURN(const NcclLibrary* nccl, LoadNccl());
  ncclUniqueId id{};
  std::string mine;
  if (rendezvous.rank() == 0) {
    const ncclResult_t made = nccl->GetUniqueId(&id);
    if (made != ncclSuccess) {
      return Unavailable("NCCL unique id: {}", nccl->GetErrorString(made));
    }
    mine.assign(reinterpret_cast<const char*>(&id), sizeof(id));
  }
  const auto deadline = Rendezvous::Clock::now() + std::chrono::milliseconds(options.timeout_ms);
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> all, rendezvous.AllGather(mine, deadline));
  if (all.empty() || all[0].size() != sizeof(id)) {
    return Internal("rank 0 sent an NCCL id of {} bytes", all.empty() ? 0 : all[0].size());
  }
  std::memcpy(&id, all[0].data(), sizeof(id));
  auto communicator =
      std::make_unique<NcclCommunicator>(*nccl, rendezvous.rank(), rendezvous.size(), options);
  TESSERA_RETURN_IF_ERROR(communicator->Init(id));
  return std::unique_ptr<DeviceCommunicator>(std::move(communicator));
}

}  // namespace tessera

#else  // !TESSERA_HAVE_CUDA

namespace tessera {

Result<std::string> NcclVersion() {
  return Unavailable("this build has no CUDA backend, hence no NCCL (nvcc was not found)");
}

Result<std::unique_ptr<DeviceCommunicator>> ConnectNcclCommunicator(
    Rendezvous&, const NcclCommunicatorOptions&) {
  return Unavailable("this build has no CUDA backend, hence no NCCL (nvcc was not found)");
}

}  // namespace tessera

#endif

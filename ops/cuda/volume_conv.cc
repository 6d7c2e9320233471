// Volume convolutions on cuDNN (ops/cuda/volume_kernels.h: CudnnConvolutions), through cuDNN's
// convolution API: descriptors per call (cheap host objects), the algorithm cuDNN's heuristics rank
// first among the deterministic ones (and, for f32, among those that do not round to TF32), a
// workspace that grows to the largest an algorithm asked for.
#include "ops/cuda/volume_kernels.h"

#include <array>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/thread_annotations.h"

#if TESSERA_HAVE_CUDNN
#include <cudnn.h>
#endif

namespace tessera::cuda {

#if TESSERA_HAVE_CUDNN
namespace {

Status CudnnError(cudnnStatus_t status, const char* what) {
  return Unavailable("cuDNN {}: {}", what, cudnnGetErrorString(status));
}

#define TESSERA_CUDNN_RETURN_IF_ERROR(call)              \
  do {                                                   \
    const cudnnStatus_t tessera_cudnn_status_ = (call);  \
    if (tessera_cudnn_status_ != CUDNN_STATUS_SUCCESS) { \
      return CudnnError(tessera_cudnn_status_, #call);   \
    }                                                    \
  } while (0)

template <typename T>
constexpr cudnnDataType_t DataType() {
  return std::is_same_v<T, float> ? CUDNN_DATA_FLOAT : CUDNN_DATA_BFLOAT16;
}

bool Packed5d(cudnnTensorDescriptor_t desc, cudnnDataType_t type, int64_t n, int64_t c, int64_t d,
              int64_t h, int64_t w) {
  const int dims[5] = {static_cast<int>(n), static_cast<int>(c), static_cast<int>(d),
                       static_cast<int>(h), static_cast<int>(w)};
  const int strides[5] = {dims[1] * dims[2] * dims[3] * dims[4], dims[2] * dims[3] * dims[4],
                          dims[3] * dims[4], dims[4], 1};
  return cudnnSetTensorNdDescriptor(desc, type, 5, dims, strides) == CUDNN_STATUS_SUCCESS;
}

// The descriptors of one convolution: x, w, y and the convolution itself.
class Descriptors {
 public:
  Descriptors() {
    cudnnCreateTensorDescriptor(&x);
    cudnnCreateTensorDescriptor(&y);
    cudnnCreateFilterDescriptor(&w);
    cudnnCreateConvolutionDescriptor(&conv);
  }
  ~Descriptors() {
    cudnnDestroyTensorDescriptor(x);
    cudnnDestroyTensorDescriptor(y);
    cudnnDestroyFilterDescriptor(w);
    cudnnDestroyConvolutionDescriptor(conv);
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;

  Status Set(const VolumeConvShape& s, cudnnDataType_t type) {
    for (int64_t size : {s.batch, s.in_channels, s.in_d, s.in_h, s.in_w, s.out_channels, s.out_d,
                         s.out_h, s.out_w, s.kd, s.kh, s.kw, s.stride}) {
      if (size < 1 || size > INT32_MAX) {
        return InvalidArgument("a volume convolution's sizes must be in [1, 2^31)");
      }
    }
    if (s.padding < 0 || s.padding_d < 0) {
      return InvalidArgument("a volume convolution's padding must be >= 0");
    }
    // cuDNN's tensor descriptors take 32-bit strides: a tensor's elements must number fewer
    // than 2^31 (a batch's stride would overflow otherwise).
    for (const auto& [what, dims] :
         {std::pair{"input", std::array{s.batch, s.in_channels, s.in_d, s.in_h, s.in_w}},
          std::pair{"output", std::array{s.batch, s.out_channels, s.out_d, s.out_h, s.out_w}}}) {
      double elements = 1;
      for (const int64_t size : dims) elements *= static_cast<double>(size);
      if (elements > static_cast<double>(INT32_MAX)) {
        return InvalidArgument(
            "a volume convolution's {} of {} x {} x {} x {} x {} holds {:.3g} elements, beyond "
            "the 2^31 cuDNN's 32-bit strides address: use a smaller volume or batch",
            what, dims[0], dims[1], dims[2], dims[3], dims[4], elements);
      }
    }
    if (!Packed5d(x, type, s.batch, s.in_channels, s.in_d, s.in_h, s.in_w) ||
        !Packed5d(y, type, s.batch, s.out_channels, s.out_d, s.out_h, s.out_w)) {
      return InvalidArgument("cuDNN refused a volume of {} x {} x {} x {} x {}", s.batch,
                             s.in_channels, s.in_d, s.in_h, s.in_w);
    }
    const int filter[5] = {static_cast<int>(s.out_channels), static_cast<int>(s.in_channels),
                           static_cast<int>(s.kd), static_cast<int>(s.kh), static_cast<int>(s.kw)};
    TESSERA_CUDNN_RETURN_IF_ERROR(
        cudnnSetFilterNdDescriptor(w, type, CUDNN_TENSOR_NCHW, 5, filter));
    const int pads[3] = {static_cast<int>(s.padding_d), static_cast<int>(s.padding),
                         static_cast<int>(s.padding)};
    const int strides[3] = {static_cast<int>(s.stride), static_cast<int>(s.stride),
                            static_cast<int>(s.stride)};
    const int dilations[3] = {1, 1, 1};
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSetConvolutionNdDescriptor(
        conv, 3, pads, strides, dilations, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    // f32 stays f32 (no TF32 rounding: it is checked against the CPU's fp32); bf16 may use
    // tensor cores.
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSetConvolutionMathType(
        conv, type == CUDNN_DATA_FLOAT ? CUDNN_FMA_MATH : CUDNN_TENSOR_OP_MATH));
    int out[5] = {};
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnGetConvolutionNdForwardOutputDim(conv, x, w, 5, out));
    if (out[0] != s.batch || out[1] != s.out_channels || out[2] != s.out_d || out[3] != s.out_h ||
        out[4] != s.out_w) {
      return InvalidArgument(
          "a convolution of {}^3 kernels, stride {}, padding {} makes {} x {} x {} from {} x {} x "
          "{}, not the {} x {} x {} given",
          s.kd, s.stride, s.padding, out[2], out[3], out[4], s.in_d, s.in_h, s.in_w, s.out_d,
          s.out_h, s.out_w);
    }
    return Status::Ok();
  }

  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
};

// The first deterministic algorithm of cuDNN's ranking (for f32, one that does not use tensor
// cores, which would round the inputs to TF32).
template <typename Perf>
Result<Perf> Choose(const std::vector<Perf>& ranked, int returned, cudnnDataType_t type,
                    const char* what) {
  for (int i = 0; i < returned; ++i) {
    const Perf& perf = ranked[static_cast<size_t>(i)];
    if (perf.status != CUDNN_STATUS_SUCCESS || perf.determinism != CUDNN_DETERMINISTIC) continue;
    if (type == CUDNN_DATA_FLOAT && perf.mathType != CUDNN_DEFAULT_MATH &&
        perf.mathType != CUDNN_FMA_MATH) {
      continue;
    }
    return perf;
  }
  return Unavailable("cuDNN offers no deterministic algorithm for this {}", what);
}

class CudnnConvolutionsImpl final : public CudnnConvolutions {
 public:
  CudnnConvolutionsImpl(cudnnHandle_t handle, cudaStream_t stream)
      : handle_(handle), stream_(stream) {}
  ~CudnnConvolutionsImpl() override {
    if (workspace_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaFree(workspace_);
    }
    cudnnDestroy(handle_);
  }
  CudnnConvolutionsImpl(const CudnnConvolutionsImpl&) = delete;
  CudnnConvolutionsImpl& operator=(const CudnnConvolutionsImpl&) = delete;

  Status Forward(float* y, const float* x, const float* w, const VolumeConvShape& s) override {
    MutexLock lock(&mutex_);
    return ForwardT(y, x, w, s);
  }
  Status Forward(bf16* y, const bf16* x, const bf16* w, const VolumeConvShape& s) override {
    MutexLock lock(&mutex_);
    return ForwardT(y, x, w, s);
  }
  Status BackwardData(float* dx, const float* dy, const float* w,
                      const VolumeConvShape& s) override {
    MutexLock lock(&mutex_);
    return BackwardDataT(dx, dy, w, s);
  }
  Status BackwardData(bf16* dx, const bf16* dy, const bf16* w, const VolumeConvShape& s) override {
    MutexLock lock(&mutex_);
    return BackwardDataT(dx, dy, w, s);
  }
  Status BackwardFilter(float* dw, const float* x, const float* dy,
                        const VolumeConvShape& s) override {
    MutexLock lock(&mutex_);
    return BackwardFilterT(dw, x, dy, s);
  }
  Status BackwardFilter(bf16* dw, const bf16* x, const bf16* dy,
                        const VolumeConvShape& s) override {
    MutexLock lock(&mutex_);
    return BackwardFilterT(dw, x, dy, s);
  }

 private:
  // A workspace of at least `bytes` (the old one freed once the stream is done with it).
  Status Workspace(size_t bytes) {
    if (bytes <= workspace_bytes_) return Status::Ok();
    if (workspace_ != nullptr) {
      TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      TESSERA_CUDA_RETURN_IF_ERROR(cudaFree(workspace_));
      workspace_ = nullptr;
      workspace_bytes_ = 0;
    }
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMalloc(&workspace_, bytes));
    workspace_bytes_ = bytes;
    return Status::Ok();
  }

  // The algorithm to run and its workspace: cuDNN's ranking (`rank(count, &returned, perfs)`),
  // the first acceptable entry (Choose), its workspace size (`size(algo, &bytes)`), grown into.
  template <typename Perf, typename Rank, typename Size>
  Result<std::pair<decltype(Perf::algo), size_t>> Plan(int count, Rank rank, Size size,
                                                       cudnnDataType_t type, const char* what) {
    std::vector<Perf> ranked(static_cast<size_t>(count));
    int returned = 0;
    TESSERA_CUDNN_RETURN_IF_ERROR(rank(count, &returned, ranked.data()));
    TESSERA_ASSIGN_OR_RETURN(Perf chosen, Choose(ranked, returned, type, what));
    size_t bytes = 0;
    TESSERA_CUDNN_RETURN_IF_ERROR(size(chosen.algo, &bytes));
    TESSERA_RETURN_IF_ERROR(Workspace(bytes));
    return std::pair{chosen.algo, bytes};
  }

  template <typename T>
  Status ForwardT(T* y, const T* x, const T* w, const VolumeConvShape& s) {
    Descriptors d;
    TESSERA_RETURN_IF_ERROR(d.Set(s, DataType<T>()));
    int count = 0;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnGetConvolutionForwardAlgorithmMaxCount(handle_, &count));
    TESSERA_ASSIGN_OR_RETURN(auto plan,
                             Plan<cudnnConvolutionFwdAlgoPerf_t>(
                                 count,
                                 [&](int n, int* returned, cudnnConvolutionFwdAlgoPerf_t* perfs) {
                                   return cudnnGetConvolutionForwardAlgorithm_v7(
                                       handle_, d.x, d.w, d.conv, d.y, n, returned, perfs);
                                 },
                                 [&](cudnnConvolutionFwdAlgo_t algo, size_t* bytes) {
                                   return cudnnGetConvolutionForwardWorkspaceSize(
                                       handle_, d.x, d.w, d.conv, d.y, algo, bytes);
                                 },
                                 DataType<T>(), "forward convolution"));
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnConvolutionForward(
        handle_, &one, d.x, x, d.w, w, d.conv, plan.first, workspace_, plan.second, &zero, d.y, y));
    return Status::Ok();
  }

  template <typename T>
  Status BackwardDataT(T* dx, const T* dy, const T* w, const VolumeConvShape& s) {
    Descriptors d;
    TESSERA_RETURN_IF_ERROR(d.Set(s, DataType<T>()));
    int count = 0;
    TESSERA_CUDNN_RETURN_IF_ERROR(
        cudnnGetConvolutionBackwardDataAlgorithmMaxCount(handle_, &count));
    TESSERA_ASSIGN_OR_RETURN(
        auto plan, Plan<cudnnConvolutionBwdDataAlgoPerf_t>(
                       count,
                       [&](int n, int* returned, cudnnConvolutionBwdDataAlgoPerf_t* perfs) {
                         return cudnnGetConvolutionBackwardDataAlgorithm_v7(
                             handle_, d.w, d.y, d.conv, d.x, n, returned, perfs);
                       },
                       [&](cudnnConvolutionBwdDataAlgo_t algo, size_t* bytes) {
                         return cudnnGetConvolutionBackwardDataWorkspaceSize(
                             handle_, d.w, d.y, d.conv, d.x, algo, bytes);
                       },
                       DataType<T>(), "convolution's input gradient"));
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnConvolutionBackwardData(handle_, &one, d.w, w, d.y, dy,
                                                               d.conv, plan.first, workspace_,
                                                               plan.second, &zero, d.x, dx));
    return Status::Ok();
  }

  template <typename T>
  Status BackwardFilterT(T* dw, const T* x, const T* dy, const VolumeConvShape& s) {
    Descriptors d;
    TESSERA_RETURN_IF_ERROR(d.Set(s, DataType<T>()));
    int count = 0;
    TESSERA_CUDNN_RETURN_IF_ERROR(
        cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(handle_, &count));
    TESSERA_ASSIGN_OR_RETURN(
        auto plan, Plan<cudnnConvolutionBwdFilterAlgoPerf_t>(
                       count,
                       [&](int n, int* returned, cudnnConvolutionBwdFilterAlgoPerf_t* perfs) {
                         return cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                             handle_, d.x, d.y, d.conv, d.w, n, returned, perfs);
                       },
                       [&](cudnnConvolutionBwdFilterAlgo_t algo, size_t* bytes) {
                         return cudnnGetConvolutionBackwardFilterWorkspaceSize(
                             handle_, d.x, d.y, d.conv, d.w, algo, bytes);
                       },
                       DataType<T>(), "convolution's weight gradient"));
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnConvolutionBackwardFilter(handle_, &one, d.x, x, d.y, dy,
                                                                 d.conv, plan.first, workspace_,
                                                                 plan.second, &zero, d.w, dw));
    return Status::Ok();
  }

  Mutex mutex_;  // one call at a time: the handle and the workspace are shared
  cudnnHandle_t handle_;
  cudaStream_t stream_;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

}  // namespace

Result<std::unique_ptr<CudnnConvolutions>> CudnnConvolutions::Create(cudaStream_t stream) {
  cudnnHandle_t handle = nullptr;
  TESSERA_CUDNN_RETURN_IF_ERROR(cudnnCreate(&handle));
  if (const cudnnStatus_t status = cudnnSetStream(handle, stream); status != CUDNN_STATUS_SUCCESS) {
    cudnnDestroy(handle);
    return CudnnError(status, "cudnnSetStream");
  }
  return std::unique_ptr<CudnnConvolutions>(
      std::make_unique<CudnnConvolutionsImpl>(handle, stream));
}

#else  // !TESSERA_HAVE_CUDNN

Result<std::unique_ptr<CudnnConvolutions>> CudnnConvolutions::Create(cudaStream_t) {
  return Unavailable(
      "this build has no cuDNN (it was not found next to the CUDA toolkit at configure time): "
      "volume convolutions cannot run on the GPU");
}

#endif  // TESSERA_HAVE_CUDNN

}  // namespace tessera::cuda

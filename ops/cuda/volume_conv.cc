// Volume convolutions on cuDNN (ops/cuda/volume_kernels.h: CudnnConvolutions), through cuDNN's
// convolution API: descriptors per call (cheap host objects), the algorithm cuDNN's heuristics rank
// first among the deterministic ones (and, for f32, among those that do not round to TF32), a
// workspace that grows to the largest an algorithm asked for.
#include "ops/cuda/volume_kernels.h"

#include <algorithm>
#include <array>
#include <cmath>
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

// A stream-ordered device allocation, freed (stream-ordered) when it goes.
class StreamBuffer {
 public:
  StreamBuffer() = default;
  StreamBuffer(void* data, cudaStream_t stream) : data_(data), stream_(stream) {}
  ~StreamBuffer() {
    if (data_ != nullptr) cudaFreeAsync(data_, stream_);
  }
  StreamBuffer(StreamBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), stream_(other.stream_) {}
  StreamBuffer& operator=(StreamBuffer&&) = delete;
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;

  template <typename T>
  T* get() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// The split of a convolution along D (CudnnConvolutions): chunks of `planes` output planes, each
// reading a window of input planes (its depth padding explicit) as a convolution of its own.
struct DepthSplit {
  struct Chunk {
    int64_t first_out = 0, outs = 0;   // output planes [first_out, first_out + outs)
    int64_t first_in = 0, window = 0;  // the input planes they read (some maybe padding)
    VolumeConvShape shape;             // the chunk's convolution: the window to the chunk
  };

  const VolumeConvShape& s;
  int64_t planes = 1;

  Chunk At(int64_t first_out) const {
    Chunk c;
    c.first_out = first_out;
    c.outs = std::min(planes, s.out_d - first_out);
    c.first_in = first_out * s.stride - s.padding_d;
    c.window = (c.outs - 1) * s.stride + s.kd;
    c.shape = s;
    c.shape.in_d = c.window;
    c.shape.out_d = c.outs;
    c.shape.padding_d = 0;
    return c;
  }
  int64_t InRows() const { return s.batch * s.in_channels; }
  int64_t OutRows() const { return s.batch * s.out_channels; }
  int64_t InPlane() const { return s.in_h * s.in_w; }
  int64_t OutPlane() const { return s.out_h * s.out_w; }
  int64_t WindowElements() const { return InRows() * ((planes - 1) * s.stride + s.kd) * InPlane(); }
  int64_t ChunkElements() const { return OutRows() * planes * OutPlane(); }

  // The chunk's input window of x, zeros past the volume's ends (its depth padding).
  template <typename T>
  Status CopyWindow(T* window, const T* x, const Chunk& c, cudaStream_t stream) const {
    return CopyDepthWindow(window, x, InRows(), s.in_d, InPlane(), c.first_in, c.window, stream);
  }
  // The chunk's output planes of y, packed.
  template <typename T>
  Status CopyOutputs(T* out, const T* y, const Chunk& c, cudaStream_t stream) const {
    return CopyDepthWindow(out, y, OutRows(), s.out_d, OutPlane(), c.first_out, c.outs, stream);
  }
  // y's planes of the chunk set to `out`'s.
  template <typename T>
  Status PlaceOutputs(T* y, const T* out, const Chunk& c, cudaStream_t stream) const {
    return PlaceDepthWindow(y, out, OutRows(), s.out_d, OutPlane(), c.first_out, c.outs,
                            /*add=*/false, stream);
  }
  // dx's planes of the chunk's window (those inside the volume) increased by `window`'s.
  template <typename T>
  Status AddWindow(T* dx, const T* window, const Chunk& c, cudaStream_t stream) const {
    return PlaceDepthWindow(dx, window, InRows(), s.in_d, InPlane(), c.first_in, c.window,
                            /*add=*/true, stream);
  }
};

class CudnnConvolutionsImpl final : public CudnnConvolutions {
 public:
  CudnnConvolutionsImpl(cudnnHandle_t handle, cudaStream_t stream, int64_t max_elements)
      : handle_(handle), stream_(stream), max_elements_(max_elements) {}
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

  // ---- the split along D ----

  static double Elements(int64_t n, int64_t c, int64_t d, int64_t h, int64_t w) {
    return static_cast<double>(n) * static_cast<double>(c) * static_cast<double>(d) *
           static_cast<double>(h) * static_cast<double>(w);
  }
  // Whether one call takes the convolution (its input and output within the limit).
  bool OneCall(const VolumeConvShape& s) const {
    const auto limit = static_cast<double>(max_elements_);
    return Elements(s.batch, s.in_channels, s.in_d, s.in_h, s.in_w) <= limit &&
           Elements(s.batch, s.out_channels, s.out_d, s.out_h, s.out_w) <= limit;
  }
  // The split: the most output planes a chunk whose window and output each hold at most
  // min(max_elements_, 2^28) elements; InvalidArgument when not one plane fits.
  Result<DepthSplit> Split(const VolumeConvShape& s) const {
    const double limit = std::min<double>(static_cast<double>(max_elements_), 268435456.0);
    const double in_plane = Elements(s.batch, s.in_channels, 1, s.in_h, s.in_w);
    const double out_plane = Elements(s.batch, s.out_channels, 1, s.out_h, s.out_w);
    double planes = std::floor(limit / out_plane);
    const double window_planes = std::floor(limit / in_plane);  // (planes - 1) * stride + kd
    planes = std::min(planes, window_planes < static_cast<double>(s.kd)
                                  ? 0.0
                                  : std::floor((window_planes - static_cast<double>(s.kd)) /
                                               static_cast<double>(s.stride)) +
                                        1);
    if (planes < 1) {
      return InvalidArgument(
          "a volume convolution of {} x {} x {} x {} x {} to {} x {} x {} x {} x {} cannot split "
          "along D into calls cuDNN's 32-bit strides address: one output plane reads {:.3g} "
          "input elements, beyond {:.3g}",
          s.batch, s.in_channels, s.in_d, s.in_h, s.in_w, s.batch, s.out_channels, s.out_d, s.out_h,
          s.out_w, in_plane * static_cast<double>(s.kd), limit);
    }
    return DepthSplit{.s = s, .planes = std::min<int64_t>(static_cast<int64_t>(planes), s.out_d)};
  }
  template <typename T>
  Result<StreamBuffer> Allocate(int64_t elements) {
    void* data = nullptr;
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMallocAsync(&data, static_cast<size_t>(elements) * sizeof(T), stream_));
    return StreamBuffer(data, stream_);
  }

  // Runs `body(split, chunk, window, out)` for each chunk of `s`'s split along D: `window` and
  // `out` device buffers of T for the chunk's input window and its output planes.
  template <typename T, typename Body>
  Status ForEachChunk(const VolumeConvShape& s, Body body) {
    TESSERA_ASSIGN_OR_RETURN(const DepthSplit split, Split(s));
    TESSERA_ASSIGN_OR_RETURN(StreamBuffer window, Allocate<T>(split.WindowElements()));
    TESSERA_ASSIGN_OR_RETURN(StreamBuffer out, Allocate<T>(split.ChunkElements()));
    for (int64_t first = 0; first < s.out_d; first += split.planes) {
      TESSERA_RETURN_IF_ERROR(body(split, split.At(first), window.get<T>(), out.get<T>()));
    }
    return Status::Ok();
  }

  template <typename T>
  Status ForwardT(T* y, const T* x, const T* w, const VolumeConvShape& s) {
    if (OneCall(s)) return ForwardOnce(y, x, w, s);
    return ForEachChunk<T>(
        s, [&](const DepthSplit& split, const DepthSplit::Chunk& c, T* window, T* out) -> Status {
          TESSERA_RETURN_IF_ERROR(split.CopyWindow(window, x, c, stream_));
          TESSERA_RETURN_IF_ERROR(ForwardOnce(out, window, w, c.shape));
          return split.PlaceOutputs(y, out, c, stream_);
        });
  }

  template <typename T>
  Status BackwardDataT(T* dx, const T* dy, const T* w, const VolumeConvShape& s) {
    if (OneCall(s)) return BackwardDataOnce(dx, dy, w, s);
    // Every window adds into dx (planes two chunks read get both parts): zeros first.
    const int64_t elements = s.batch * s.in_channels * s.in_d * s.in_h * s.in_w;
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dx, 0, static_cast<size_t>(elements) * sizeof(T),
                                                 stream_));  // zeros in both types
    return ForEachChunk<T>(
        s, [&](const DepthSplit& split, const DepthSplit::Chunk& c, T* window, T* out) -> Status {
          TESSERA_RETURN_IF_ERROR(split.CopyOutputs(out, dy, c, stream_));
          TESSERA_RETURN_IF_ERROR(BackwardDataOnce(window, out, w, c.shape));
          return split.AddWindow(dx, window, c, stream_);
        });
  }

  template <typename T>
  Status BackwardFilterT(T* dw, const T* x, const T* dy, const VolumeConvShape& s) {
    if (OneCall(s)) return BackwardFilterOnce(dw, x, dy, s, /*beta=*/0.0f);
    return ForEachChunk<T>(
        s, [&](const DepthSplit& split, const DepthSplit::Chunk& c, T* window, T* out) -> Status {
          TESSERA_RETURN_IF_ERROR(split.CopyWindow(window, x, c, stream_));
          TESSERA_RETURN_IF_ERROR(split.CopyOutputs(out, dy, c, stream_));
          // The first chunk's gradient overwrites dw; the others add to it.
          return BackwardFilterOnce(dw, window, out, c.shape, c.first_out == 0 ? 0.0f : 1.0f);
        });
  }

  // ---- one call ----

  template <typename T>
  Status ForwardOnce(T* y, const T* x, const T* w, const VolumeConvShape& s) {
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
  Status BackwardDataOnce(T* dx, const T* dy, const T* w, const VolumeConvShape& s) {
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

  // dw = beta * dw + the gradient (beta 1: the split's chunks after the first).
  template <typename T>
  Status BackwardFilterOnce(T* dw, const T* x, const T* dy, const VolumeConvShape& s, float beta) {
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
    const float one = 1.0f;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnConvolutionBackwardFilter(handle_, &one, d.x, x, d.y, dy,
                                                                 d.conv, plan.first, workspace_,
                                                                 plan.second, &beta, d.w, dw));
    return Status::Ok();
  }

  Mutex mutex_;  // one call at a time: the handle and the workspace are shared
  cudnnHandle_t handle_;
  cudaStream_t stream_;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  const int64_t max_elements_;  // per tensor of one call (beyond: the split along D)
};

}  // namespace

Result<std::unique_ptr<CudnnConvolutions>> CudnnConvolutions::Create(cudaStream_t stream,
                                                                     int64_t max_elements) {
  if (max_elements < 1 || max_elements > INT32_MAX) {
    return InvalidArgument("max_elements {} must be in [1, 2^31)", max_elements);
  }
  cudnnHandle_t handle = nullptr;
  TESSERA_CUDNN_RETURN_IF_ERROR(cudnnCreate(&handle));
  if (const cudnnStatus_t status = cudnnSetStream(handle, stream); status != CUDNN_STATUS_SUCCESS) {
    cudnnDestroy(handle);
    return CudnnError(status, "cudnnSetStream");
  }
  return std::unique_ptr<CudnnConvolutions>(
      std::make_unique<CudnnConvolutionsImpl>(handle, stream, max_elements));
}

#else  // !TESSERA_HAVE_CUDNN

Result<std::unique_ptr<CudnnConvolutions>> CudnnConvolutions::Create(cudaStream_t, int64_t) {
  return Unavailable(
      "this build has no cuDNN (it was not found next to the CUDA toolkit at configure time): "
      "volume convolutions cannot run on the GPU");
}

#endif  // TESSERA_HAVE_CUDNN

}  // namespace tessera::cuda

// Small kernels a plan places around the layers on a GPU: gradient accumulation (sum += x, f32 or
// bf16) and the sum of fp32 scalar objects (the mean loss over micro-batches). See scalars.h.
#include "ops/cuda/common.cuh"  // first: see there
#include "ops/cuda/scalars.h"

#include <algorithm>

#include "core/cuda_check.h"

namespace tessera::cuda {

// ---- kernels ----

namespace {

// sum += x, in f32 (bf16: read as f32, added, rounded once).
template <typename T>
__global__ void AccumulateKernel(T* sum, const T* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    detail::Store(sum, i, detail::Load(sum, i) + detail::Load(x, i));
  }
}

template <typename T>
Status AccumulateT(T* sum, const T* x, int64_t n, cudaStream_t stream) {
  if (n == 0) return Status::Ok();
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 65536);
  AccumulateKernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(sum, x, n);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

// One thread: adds the scalars in order (as the CPU kernel does), in double.
__global__ void SumScalarsKernel(float* out, ScalarPointers inputs, float scale) {
  double sum = 0;
  for (int i = 0; i < inputs.count; ++i) sum += *inputs.values[i];
  *out = static_cast<float>(sum * scale);
}

__global__ void FillKernel(float* out, float value) { *out = value; }

__global__ void CastRowsKernel(float* out, const __nv_bfloat16* in, int64_t rows, int64_t cols,
                               int64_t ld_in) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    out[i] = __bfloat162float(in[r * ld_in + c]);
  }
}

}  // namespace

// ---- launchers ----

Status Accumulate(float* sum, const float* x, int64_t n, cudaStream_t stream) {
  return AccumulateT(sum, x, n, stream);
}

Status Accumulate(__nv_bfloat16* sum, const __nv_bfloat16* x, int64_t n, cudaStream_t stream) {
  return AccumulateT(sum, x, n, stream);
}

Status SumScalars(float* out, const ScalarPointers& inputs, float scale, cudaStream_t stream) {
  if (inputs.count < 0 || inputs.count > kMaxScalarInputs) {
    return InvalidArgument("sum_scalars on the GPU adds at most {} scalars, got {}",
                           kMaxScalarInputs, inputs.count);
  }
  SumScalarsKernel<<<1, 1, 0, stream>>>(out, inputs, scale);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

Status CastRowsBf16ToF32(float* out, const __nv_bfloat16* in, int64_t rows, int64_t cols,
                         int64_t ld_in, cudaStream_t stream) {
  if (ld_in < cols) return InvalidArgument("row stride {} < columns {}", ld_in, cols);
  if (rows * cols == 0) return Status::Ok();
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((rows * cols + threads - 1) / threads, 65536);
  CastRowsKernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(out, in, rows, cols, ld_in);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

Status Fill(float* out, float value, cudaStream_t stream) {
  FillKernel<<<1, 1, 0, stream>>>(out, value);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tessera::cuda

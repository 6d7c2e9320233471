// Casts between fp32 and bf16 (round to nearest even), for parameters that kernels read as bf16
// and activations that the CPU side reads back as fp32.
#include "ops/cuda/common.cuh"  // first: see there

#include <cuda_bf16.h>

#include "core/cuda_check.h"
#include "ops/cuda/kernels.h"

namespace tessera::cuda {
namespace {

// ---- kernels ----

struct F32ToBf16Op {
  bf16* out;
  const float* in;
  __device__ void Vector(int64_t i) const {
    float v[8];
    detail::LoadF32x8(in + i, v);
    detail::StoreBf16x8(out + i, v);
  }
  __device__ void Scalar(int64_t i) const { out[i] = __float2bfloat16_rn(in[i]); }
};

struct Bf16ToF32Op {
  float* out;
  const bf16* in;
  __device__ void Vector(int64_t i) const {
    float v[8];
    detail::LoadBf16x8(in + i, v);
    detail::StoreF32x8(out + i, v);
  }
  __device__ void Scalar(int64_t i) const { out[i] = __bfloat162float(in[i]); }
};

}  // namespace

// ---- launchers ----

Status CastF32ToBf16(bf16* out, const float* in, int64_t n, cudaStream_t stream) {
  if (n < 0) return InvalidArgument("CastF32ToBf16: n = {} must be >= 0", n);
  if (n == 0) return Status::Ok();
  detail::LaunchMap(F32ToBf16Op{out, in}, n, detail::IsAligned16(out) && detail::IsAligned16(in),
                    stream);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

Status CastBf16ToF32(float* out, const bf16* in, int64_t n, cudaStream_t stream) {
  if (n < 0) return InvalidArgument("CastBf16ToF32: n = {} must be >= 0", n);
  if (n == 0) return Status::Ok();
  detail::LaunchMap(Bf16ToF32Op{out, in}, n, detail::IsAligned16(out) && detail::IsAligned16(in),
                    stream);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tessera::cuda

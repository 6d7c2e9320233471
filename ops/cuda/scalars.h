// Small fp32 kernels a plan places around the layers on a GPU (launchers; kernels in
// scalars.cu). Conventions as in kernels.h.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "core/status.h"

namespace tessera::cuda {

// sum[i] += x[i] (gradient accumulation over micro-batches).
Status Accumulate(float* sum, const float* x, int64_t n, cudaStream_t stream);
// sum += x in bf16: each element read as f32, added, rounded to nearest even once.
Status Accumulate(__nv_bfloat16* sum, const __nv_bfloat16* x, int64_t n, cudaStream_t stream);

// Device pointers to fp32 scalars, passed by value to the kernel.
inline constexpr int kMaxScalarInputs = 256;
struct ScalarPointers {
  int count = 0;
  const float* values[kMaxScalarInputs] = {};
};
// *out = (sum of *inputs.values[i], in order, in double) * scale.
Status SumScalars(float* out, const ScalarPointers& inputs, float scale, cudaStream_t stream);
// *out = value.
Status Fill(float* out, float value, cudaStream_t stream);

// out[r, c] = in[r * ld_in + c] for c < cols: a padded bf16 matrix to a dense fp32 one (logits
// of the padded vocabulary to the model's).
Status CastRowsBf16ToF32(float* out, const __nv_bfloat16* in, int64_t rows, int64_t cols,
                         int64_t ld_in, cudaStream_t stream);

}  // namespace tessera::cuda

// GEMMs on cuBLASLt: the linear layers of a model, bf16 operands, fp32 accumulation.
//
// Row-major, as the CPU kernels (ops/cpu/kernels.h): x [N, K], weight [OC, K], out [N, OC].
// cuBLASLt is column-major, so each call is the transposed product (out^T = W x^T), which
// needs no copies. Each distinct problem (sizes, leading dimensions, epilogue, accumulation)
// gets its descriptors and the heuristic's best algorithm once, cached in the context's
// MatmulCache; later calls only launch.
//
// Errors: InvalidArgument for sizes cuBLASLt cannot take; Unavailable with cuBLAS's status name
// when a call fails.
#pragma once

#include <cstdint>

#include "core/status.h"
#include "ops/cuda/cuda_context.h"
#include "ops/cuda/kernels.h"

namespace tessera::cuda {

// out[N,OC] (row stride ld_out, >= OC) = x[N,K] @ weight[OC,K]^T (+ bias[OC]) (+ residual[N,OC],
// same stride as out; may alias out). bias and residual may be null.
Status LinearForward(CudaContext& context, bf16* out, const bf16* x, const bf16* weight,
                     const bf16* bias, const bf16* residual, int64_t rows, int64_t in_features,
                     int64_t out_features, int64_t ld_out);
// dx[N,K] = dout[N,OC] (row stride ld_dout) @ weight[OC,K]; accumulates when accumulate.
Status LinearBackwardInput(CudaContext& context, bf16* dx, const bf16* dout, const bf16* weight,
                           int64_t rows, int64_t in_features, int64_t out_features, int64_t ld_dout,
                           bool accumulate);
// dweight[OC,K] (fp32) = dout^T @ x; accumulates when accumulate.
Status LinearBackwardWeight(CudaContext& context, float* dweight, const bf16* dout, const bf16* x,
                            int64_t rows, int64_t in_features, int64_t out_features,
                            int64_t ld_dout, bool accumulate);

}  // namespace tessera::cuda

// CUDA runtime errors (core/checks.h says how errors from C libraries are reported). Include only
// from code built with the CUDA toolkit (TESSERA_HAVE_CUDA).
#pragma once

#include <cuda_runtime_api.h>

#include "core/checks.h"

namespace tessera {

// Unavailable: "CUDA error: <text> (<name>) (at file:line)". Clears CUDA's sticky last error.
inline Status CudaError(cudaError_t error, const char* file = __builtin_FILE(),
                        int line = __builtin_LINE()) {
  (void)cudaGetLastError();
  return Unavailable("CUDA error: {} ({}) (at {})", cudaGetErrorString(error),
                     cudaGetErrorName(error), CallSite(file, line));
}

// Returns CudaError from the enclosing function when `call` does not yield cudaSuccess.
#define TESSERA_CUDA_RETURN_IF_ERROR(call)              \
  do {                                                  \
    const cudaError_t tessera_cuda_error_ = (call);     \
    if (tessera_cuda_error_ != cudaSuccess) {           \
      return ::tessera::CudaError(tessera_cuda_error_); \
    }                                                   \
  } while (0)

}  // namespace tessera

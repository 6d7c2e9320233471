// CUDA runtime errors (core/checks.h says how errors from C libraries are reported). Include only
// from code built with the CUDA toolkit (TESSERA_HAVE_CUDA).
#pragma once

#include <source_location>

#include <cuda_runtime_api.h>

#include "core/checks.h"

namespace tessera {

// Unavailable: "CUDA error: <text> (<name>) (at file:line)". Clears CUDA's sticky last error.
inline Status CudaError(cudaError_t error,
                        std::source_location where = std::source_location::current()) {
  (void)cudaGetLastError();
  return Unavailable("CUDA error: {} ({}) (at {})", cudaGetErrorString(error),
                     cudaGetErrorName(error), CallSite(where));
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

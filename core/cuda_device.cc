#include "core/cuda_device.h"

#include <fmt/format.h>

#if TESSERA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tessera {

bool BuiltWithCuda() { return TESSERA_HAVE_CUDA != 0; }

CudaDevices ProbeCudaDevices() {
  CudaDevices result;
#if TESSERA_HAVE_CUDA
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    result.reason =
        fmt::format("CUDA runtime: {} ({})", cudaGetErrorString(error), cudaGetErrorName(error));
    return result;
  }
  if (count == 0) {
    result.reason = "CUDA runtime reports no devices";
    return result;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp properties{};
    if (cudaGetDeviceProperties(&properties, i) != cudaSuccess) continue;
    result.devices.push_back(
        CudaDeviceInfo{i, properties.name, static_cast<int64_t>(properties.totalGlobalMem),
                       properties.major, properties.minor,
                       fmt::format("{:08X}:{:02X}:{:02X}.0", properties.pciDomainID,
                                   properties.pciBusID, properties.pciDeviceID)});
  }
  if (result.devices.empty()) result.reason = "no CUDA device answered a properties query";
#else
  result.reason = "this build has no CUDA backend (nvcc was not found at configure time)";
#endif
  return result;
}

}  // namespace tessera

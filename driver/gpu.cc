#include "driver/gpu.h"

#if TESSERA_HAVE_CUDA
#include "ops/cuda/cuda_op_kernels.h"
#endif

namespace tessera {

Result<std::shared_ptr<DeviceRuntime>> OpenGpu(int index, int64_t memory_cap_bytes) {
#if TESSERA_HAVE_CUDA
  return cuda::OpenCudaDevice(index, memory_cap_bytes);
#else
  (void)index;
  (void)memory_cap_bytes;
  return Unavailable(
      "this build of Tessera has no CUDA backend (configure with nvcc present and "
      "TESSERA_ENABLE_CUDA=ON)");
#endif
}

Status AddGpuKernels(OpRegistry& registry) {
#if TESSERA_HAVE_CUDA
  return cuda::RegisterCudaKernels(registry);
#else
  (void)registry;
  return Unavailable("this build of Tessera has no CUDA backend");
#endif
}

}  // namespace tessera

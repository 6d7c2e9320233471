// The GPU a driver trains on in its own process (train_gpt2 --device cuda): opening it and
// adding the CUDA kernels to a registry, in a build with or without the CUDA backend.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/device_runtime.h"
#include "core/dtype.h"
#include "core/gpu_use.h"
#include "core/status.h"
#include "ops/op_registry.h"

namespace tessera {

// Opens CUDA device `index` (ops/cuda/cuda_context.h). Unavailable naming the reason when the
// build has no CUDA backend or the machine no usable device. With TESSERA_SIMULATED_GPU=1 these
// functions give the simulated GPU instead (worker/simulated_gpu.h).
Result<std::shared_ptr<DeviceRuntime>> OpenGpu(int index, int64_t memory_cap_bytes = 0);
// The meter of the GPU `index` that `gpu` (OpenGpu's) runs on: NVML's figures for a CUDA device
// (worker/nvml_meter.h), the simulated GPU's own for it. Unavailable naming why there is none (no
// NVML library, no driver, a device NVML does not know).
Result<std::unique_ptr<GpuMeter>> OpenGpuMeter(int index, std::shared_ptr<DeviceRuntime> gpu);
// Adds the CUDA kernels (ops/cuda/cuda_op_kernels.h); Unavailable in a build without CUDA.
Status AddGpuKernels(OpRegistry& registry);
// The GPUs a spec names: "all" (every usable device), or a list "0,2". Unavailable naming why
// when there are none (no CUDA backend, no driver, no device); InvalidArgument for a malformed
// list or an index this machine does not have (naming the ones it has).
Result<std::vector<int>> ResolveGpus(const std::string& spec);
// The activations' dtype of a GPU plan: bf16 (f32 on the simulated GPU, whose kernels are the
// CPU's).
DType GpuActivations();

}  // namespace tessera

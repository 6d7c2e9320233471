// The GPU a driver trains on in its own process (train_gpt2 --device cuda): opening it and
// adding the CUDA kernels to a registry, in a build with or without the CUDA backend.
#pragma once

#include <cstdint>
#include <memory>

#include "core/device_runtime.h"
#include "core/status.h"
#include "ops/op_registry.h"

namespace tessera {

// Opens CUDA device `index` (ops/cuda/cuda_context.h). Unavailable naming the reason when the
// build has no CUDA backend or the machine no usable device.
Result<std::shared_ptr<DeviceRuntime>> OpenGpu(int index, int64_t memory_cap_bytes = 0);
// Adds the CUDA kernels (ops/cuda/cuda_op_kernels.h); Unavailable in a build without CUDA.
Status AddGpuKernels(OpRegistry& registry);

}  // namespace tessera

// Registers the CUDA kernels of the built-in ops (ops/standard_ops.h) that a GPU process runs, and
// opens a GPU as a DeviceRuntime.
//
// Ops with a kCuda kernel: the transformer layer ops (token_position_embedding,
// transformer_block and tied_lm_head forward and backward, tied_lm_head_logits for sampling,
// with activation_dtype = "bf16"), the optimizer and clipping ops (adamw, sum_of_squares,
// clip_scale), the transfer op (copy, any direction between the host and the GPU), and the small
// ops a plan adds around them (accumulate, sum_scalars, constant), and the volume ops of the 3D
// U-Net (ops/volume_ops.h: convolutions on cuDNN, norms, activations, pooling, upsampling,
// concatenation, the voxel loss and Dice; ops/cuda/volume_kernels.h), on f32 or bf16 activations.
// Every kernel runs on the DeviceRuntime in its KernelContext (FailedPrecondition-style Infeasible
// without one).
#pragma once

#include <memory>

#include "core/device_runtime.h"
#include "core/status.h"
#include "ops/op_registry.h"

namespace tessera::cuda {

// REQUIRES: RegisterStandardOps(registry) ran first. AlreadyExists if called twice.
Status RegisterCudaKernels(OpRegistry& registry);

// Opens GPU `device` (cuda_context.h): Unavailable with the reason when it cannot be used.
// memory_cap_bytes 0: the card's free memory less 1 GiB.
Result<std::shared_ptr<DeviceRuntime>> OpenCudaDevice(int device, int64_t memory_cap_bytes = 0);

}  // namespace tessera::cuda

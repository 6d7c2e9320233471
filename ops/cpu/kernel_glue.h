// What the files that register CPU kernels on an op registry share (cpu_kernels.cc,
// volume_registration.cc): short names for a kernel's tensors and their data, registration, and
// workspaces. Internal to ops/cpu.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "ops/op_registry.h"

namespace tessera::cpu::detail {

using Tensors = std::vector<Tensor>;

// A tensor's data as f32 or i32. REQUIRES: the tensor has that dtype (checked by Tensor::data).
inline float* F(const Tensor& t) { return t.data<float>(); }
inline const int32_t* I(const Tensor& t) { return t.data<int32_t>(); }

// Adds `kernel` as op's CPU kernel: NotFound for an unknown op, AlreadyExists for a second one.
inline Status Register(OpRegistry& r, std::string_view op, KernelFn kernel) {
  return r.AddKernel(op, DeviceKind::kCpu, std::move(kernel));
}

// Scratch memory for a kernel, from the executor's allocator so it counts toward the peak.
inline Result<Tensor> Workspace(const KernelContext& context, int64_t floats) {
  return Tensor::Empty(TensorMeta{Shape{floats}, DType::kF32, Device::Cpu()}, context.allocator);
}

}  // namespace tessera::cpu::detail

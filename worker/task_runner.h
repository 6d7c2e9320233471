// Running one task's kernel: what the in-process executor and the worker process share.
//
// RunTaskKernel allocates the task's outputs from the context's allocator, honours the task's
// in-place pairs (the output takes over the input's buffer when `can_donate(input)` says the
// caller allows it, and starts as a copy otherwise), runs the kernel, and converts exceptions
// from kernel code into Statuses. Errors carry TaskContext(task).
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/function_ref.h"
#include "core/graph.h"
#include "core/status.h"
#include "core/tensor.h"
#include "ops/op_registry.h"

namespace tessera {

// "task 'h.3/forward' (layer h.3, op transformer_block_forward)": the prefix of a task's errors;
// `name`, when given, instead of the task's own (an instance's name for the task of a graph many
// instances share: a submitted task's).
std::string TaskContext(const TaskSpec& task, std::string_view name = {});

struct TaskRunCounters {
  int donations_taken = 0;
  int donations_copied = 0;
  // RunTaskKernel: the most scratch its kernel held at once (KernelContext::allocator).
  int64_t scratch_peak_bytes = 0;
};

// Allocates a task's outputs; an output in an in-place pair takes over its input's buffer when
// can_donate(input) allows, and starts as a copy of it otherwise.
// REQUIRES: inputs and output_metas match the task; can_donate(i) is only true when nothing
// else will read input i's buffer.
Result<std::vector<Tensor>> PrepareTaskOutputs(const TaskSpec& task,
                                               const std::vector<Tensor>& inputs,
                                               const std::vector<TensorMeta>& output_metas,
                                               const KernelContext& context,
                                               FunctionRef<bool(int input_index)> can_donate,
                                               TaskRunCounters* counters,
                                               std::string_view name = {});

// A tensor of `meta` from the allocator of its device: the context's host allocator, its GPU's,
// or its swap file's (Infeasible naming the device when the process has no such GPU or file).
Result<Tensor> AllocateOn(const TensorMeta& meta, const KernelContext& context);
// Copies src's bytes into dst across devices (host, the context's GPU or swap file). REQUIRES:
// same bytes.
Status CopyTensor(const Tensor& dst, const Tensor& src, const KernelContext& context);

// The same shape and dtype on the host: where bytes from the network land (a GPU worker's pulled,
// pushed or inline inputs; the executor moves them to the device when it takes them).
TensorMeta OnHost(TensorMeta meta);
// `tensor` where `meta` says it lives: itself when it is there already, else a copy across
// devices. InvalidArgument when shape or dtype differ (naming both).
Result<Tensor> MoveTo(const TensorMeta& meta, Tensor tensor, const KernelContext& context);
// `tensor` in host memory: itself, or a copy of a device tensor (what a GPU worker serves,
// pushes, reports inline or sends through a host communicator).
Result<Tensor> HostCopyOf(const Tensor& tensor, const KernelContext& context);

// A device kernel made of a CPU one: the CPU kernel runs on host copies of the operands (through
// the context's DeviceRuntime, a real GPU's or the simulated one's) and device outputs get the
// results back.
KernelFn OnHostCopies(KernelFn cpu);
// For every op `which` selects that has a CPU kernel and none for `device`: OnHostCopies of the
// CPU kernel as its `device` kernel.
Status AddKernelsOnHostCopies(OpRegistry& registry, DeviceKind device,
                              const std::function<bool(std::string_view)>& which);

// PrepareTaskOutputs, then the kernel, its scratch counted (counters->scratch_peak_bytes).
Result<std::vector<Tensor>> RunTaskKernel(const KernelFn& kernel, const TaskSpec& task,
                                          const std::vector<Tensor>& inputs,
                                          const std::vector<TensorMeta>& output_metas,
                                          const KernelContext& context,
                                          FunctionRef<bool(int input_index)> can_donate,
                                          TaskRunCounters* counters, std::string_view name = {});
// The kernel alone, on outputs PrepareTaskOutputs made (exceptions as Statuses, with the context).
Status CallKernel(const KernelFn& kernel, const TaskSpec& task, const std::vector<Tensor>& inputs,
                  const std::vector<Tensor>& outputs, const KernelContext& context,
                  std::string_view name = {});

}  // namespace tessera

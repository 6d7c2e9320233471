#include "worker/task_runner.h"

#include <cstring>

namespace tessera {

std::string TaskContext(const TaskSpec& task, std::string_view name) {
  const std::string_view shown = name.empty() ? std::string_view(task.name) : name;
  return task.layer.empty()
             ? fmt::format("task '{}' (op {})", shown, task.op)
             : fmt::format("task '{}' (layer {}, op {})", shown, task.layer, task.op);
}

Result<std::vector<Tensor>> PrepareTaskOutputs(const TaskSpec& task,
                                               const std::vector<Tensor>& inputs,
                                               const std::vector<TensorMeta>& output_metas,
                                               const KernelContext& context,
                                               FunctionRef<bool(int input_index)> can_donate,
                                               TaskRunCounters* counters, std::string_view name) {
  std::vector<Tensor> outputs(output_metas.size());
  for (const Donation& donation : task.donations) {
    const Tensor& source = inputs[donation.input_index];
    const TensorMeta& meta = output_metas[donation.output_index];
    if (can_donate(donation.input_index) && source.dtype() == meta.dtype) {
      Result<Tensor> view = source.View(meta.shape);
      if (view.ok()) {
        outputs[donation.output_index] = *std::move(view);
        ++counters->donations_taken;
        continue;
      }
    }
    Result<Tensor> copy = AllocateOn(meta, context);
    if (!copy.ok()) return copy.status().WithContext(TaskContext(task, name));
    Status copied = CopyTensor(*copy, source, context);
    if (!copied.ok()) return copied.WithContext(TaskContext(task, name));
    outputs[donation.output_index] = *std::move(copy);
    ++counters->donations_copied;
  }
  for (size_t j = 0; j < outputs.size(); ++j) {
    if (outputs[j].defined()) continue;
    Result<Tensor> tensor = AllocateOn(output_metas[j], context);
    if (!tensor.ok()) return tensor.status().WithContext(TaskContext(task, name));
    outputs[j] = *std::move(tensor);
  }
  return outputs;
}

Result<Tensor> AllocateOn(const TensorMeta& meta, const KernelContext& context) {
  if (meta.device.is_cpu()) return Tensor::Empty(meta, context.allocator);
  if (meta.device.kind == DeviceKind::kDisk) {
    if (context.disk == nullptr) {
      return Infeasible(
          "{} is swapped to the disk, but this process has no swap file: give it one (--swap-dir) "
          "or plan without a disk link",
          meta.ToString());
    }
    return Tensor::Empty(meta, context.disk->allocator());
  }
  // A plan's Device::Cuda(0) is "the worker's own GPU", whichever ordinal it has here.
  if (context.device == nullptr || context.device->device().kind != meta.device.kind) {
    return Infeasible(
        "{} lives on {}, but this process has {}: run the GPU plan where a GPU was opened "
        "(train_gpt2 --device cuda) or plan for the devices there are",
        meta.ToString(), meta.device.ToString(),
        context.device == nullptr ? std::string("no GPU") : context.device->Describe());
  }
  return Tensor::Empty(meta, context.device->allocator());
}

Status CopyTensor(const Tensor& dst, const Tensor& src, const KernelContext& context) {
  if (dst.bytes() != src.bytes()) {
    return Internal("copy of {} into {}: sizes differ", src.meta().ToString(),
                    dst.meta().ToString());
  }
  return CopyAcrossTiers(dst, src, context);
}

TensorMeta OnHost(TensorMeta meta) {
  meta.device = Device::Cpu();
  return meta;
}

Result<Tensor> MoveTo(const TensorMeta& meta, Tensor tensor, const KernelContext& context) {
  if (tensor.meta().shape != meta.shape || tensor.dtype() != meta.dtype) {
    return InvalidArgument("{} cannot stand for {}", tensor.meta().ToString(), meta.ToString());
  }
  if (tensor.meta().device.kind == meta.device.kind) return tensor;
  TESSERA_ASSIGN_OR_RETURN(Tensor moved, AllocateOn(meta, context));
  TESSERA_RETURN_IF_ERROR(CopyTensor(moved, tensor, context));
  return moved;
}

Result<Tensor> HostCopyOf(const Tensor& tensor, const KernelContext& context) {
  return MoveTo(OnHost(tensor.meta()), tensor, context);
}

KernelFn OnHostCopies(KernelFn cpu) {
  return [cpu = std::move(cpu)](const KernelContext& context, const std::vector<Tensor>& inputs,
                                const std::vector<Tensor>& outputs, const Attrs& attrs) -> Status {
    KernelContext host = context;
    host.device = nullptr;  // every operand the CPU kernel sees is on the host
    std::vector<Tensor> host_inputs, host_outputs;
    for (const Tensor& input : inputs) {
      TESSERA_ASSIGN_OR_RETURN(Tensor copy, HostCopyOf(input, context));
      host_inputs.push_back(std::move(copy));
    }
    for (const Tensor& output : outputs) {  // in-place outputs hold their input on entry
      TESSERA_ASSIGN_OR_RETURN(Tensor copy, HostCopyOf(output, context));
      host_outputs.push_back(std::move(copy));
    }
    TESSERA_RETURN_IF_ERROR(cpu(host, host_inputs, host_outputs, attrs));
    for (size_t j = 0; j < outputs.size(); ++j) {
      if (outputs[j].meta().device.is_cpu()) continue;
      TESSERA_RETURN_IF_ERROR(CopyTensor(outputs[j], host_outputs[j], context));
    }
    return Status::Ok();
  };
}

Status AddKernelsOnHostCopies(OpRegistry& registry, DeviceKind device,
                              const std::function<bool(std::string_view)>& which) {
  for (const std::string& op : registry.OpNames()) {
    if (!which(op) || registry.Supports(op, device) || !registry.Supports(op, DeviceKind::kCpu)) {
      continue;
    }
    TESSERA_ASSIGN_OR_RETURN(const KernelFn* cpu, registry.FindKernel(op, DeviceKind::kCpu));
    TESSERA_RETURN_IF_ERROR(registry.AddKernel(op, device, OnHostCopies(*cpu)));
  }
  return Status::Ok();
}

Result<std::vector<Tensor>> RunTaskKernel(const KernelFn& kernel, const TaskSpec& task,
                                          const std::vector<Tensor>& inputs,
                                          const std::vector<TensorMeta>& output_metas,
                                          const KernelContext& context,
                                          FunctionRef<bool(int input_index)> can_donate,
                                          TaskRunCounters* counters, std::string_view name) {
  TESSERA_ASSIGN_OR_RETURN(
      std::vector<Tensor> outputs,
      PrepareTaskOutputs(task, inputs, output_metas, context, can_donate, counters, name));
  if (context.allocator == nullptr) {
    TESSERA_RETURN_IF_ERROR(CallKernel(kernel, task, inputs, outputs, context, name));
    return outputs;
  }
  // The kernel's scratch comes from an allocator of its own, whose peak is the task's scratch.
  KernelContext counted = context;
  auto scratch = std::make_shared<CountingAllocator>(context.allocator);
  counted.allocator = scratch;
  TESSERA_RETURN_IF_ERROR(CallKernel(kernel, task, inputs, outputs, counted, name));
  counters->scratch_peak_bytes = scratch->stats().peak_bytes;
  return outputs;
}

Status CallKernel(const KernelFn& kernel, const TaskSpec& task, const std::vector<Tensor>& inputs,
                  const std::vector<Tensor>& outputs, const KernelContext& context,
                  std::string_view name) {
  Status status;
  try {
    status = kernel(context, inputs, outputs, task.attrs);
  } catch (const std::bad_alloc&) {
    status = ResourceExhausted("out of host memory in a kernel workspace");
  } catch (const std::exception& e) {
    status = Internal("kernel threw: {}", e.what());
  }
  if (!status.ok()) return status.WithContext(TaskContext(task, name));
  return Status::Ok();
}

}  // namespace tessera

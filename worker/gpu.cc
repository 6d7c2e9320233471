#include "worker/gpu.h"

#include <algorithm>
#include <charconv>

#include <fmt/ranges.h>

#include "core/collective_task.h"
#include "core/cuda_device.h"
#include "ops/layer_program.h"
#include "ops/plugin.h"
#include "worker/nvml_meter.h"
#include "worker/simulated_gpu.h"
#include "worker/task_runner.h"

#if TESSERA_HAVE_CUDA
#include "ops/cuda/cuda_op_kernels.h"
#endif

namespace tessera {

Result<std::shared_ptr<DeviceRuntime>> OpenGpu(int index, int64_t memory_cap_bytes) {
  if (SimulatedGpuRequested()) {
    if (index != 0) {
      return InvalidArgument("there is one simulated GPU (TESSERA_SIMULATED_GPU=1), cuda:0; not {}",
                             index);
    }
    return MakeSimulatedGpu(memory_cap_bytes);
  }
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

Result<std::unique_ptr<GpuMeter>> OpenGpuMeter(int index, std::shared_ptr<DeviceRuntime> gpu) {
  if (SimulatedGpuRequested()) return MakeSimulatedGpuMeter(std::move(gpu));
  const CudaDevices probed = ProbeCudaDevices();
  const auto device = std::find_if(probed.devices.begin(), probed.devices.end(),
                                   [&](const CudaDeviceInfo& d) { return d.index == index; });
  if (device == probed.devices.end()) {
    return Unavailable("no CUDA device {} to read utilisation from{}{}", index,
                       probed.reason.empty() ? "" : ": ", probed.reason);
  }
  TESSERA_ASSIGN_OR_RETURN(NvmlApi nvml, LoadNvml());
  return MakeNvmlMeter(std::move(nvml), device->pci_bus_id);
}

Status AddGpuKernels(OpRegistry& registry) {
  if (SimulatedGpuRequested()) return AddSimulatedGpuKernels(registry);
#if TESSERA_HAVE_CUDA
  TESSERA_RETURN_IF_ERROR(cuda::RegisterCudaKernels(registry));
  // The model API's layers run their programs' ops with the CUDA kernels.
  TESSERA_RETURN_IF_ERROR(RegisterLayerProgramKernels(registry, DeviceKind::kCuda));
  // Collectives: members of a group larger than one run on the worker's collective engine,
  // which stages device buffers through host memory; a kernel is still what a worker needs to
  // prepare a graph with them, and what a one-member group runs (the CPU's, on host copies).
  TESSERA_RETURN_IF_ERROR(AddKernelsOnHostCopies(registry, DeviceKind::kCuda, IsCollectiveOp));
  return AddLoadedPluginKernels(registry, DeviceKind::kCuda);  // ops/plugin.h
#else
  (void)registry;
  return Unavailable("this build of Tessera has no CUDA backend");
#endif
}

Result<std::vector<int>> ResolveGpus(const std::string& spec) {
  std::vector<int> listed;  // empty for "all"
  if (spec != "all") {
    size_t begin = 0;
    while (begin <= spec.size()) {
      const size_t end = std::min(spec.find(',', begin), spec.size());
      const std::string item = spec.substr(begin, end - begin);
      int index = -1;
      const auto [rest, error] = std::from_chars(item.data(), item.data() + item.size(), index);
      if (item.empty() || error != std::errc() || rest != item.data() + item.size() || index < 0) {
        return InvalidArgument("'{}' in '{}' is not a GPU index; give 'all' or a list like 0,1",
                               item, spec);
      }
      listed.push_back(index);
      begin = end + 1;
    }
  }
  const CudaDevices probed =
      SimulatedGpuRequested() ? CudaDevices{{CudaDeviceInfo{.index = 0}}, ""} : ProbeCudaDevices();
  std::vector<int> present;
  present.reserve(probed.devices.size());
  for (const CudaDeviceInfo& device : probed.devices) present.push_back(device.index);
  if (present.empty()) return Unavailable("no usable GPU for '{}': {}", spec, probed.reason);
  if (listed.empty()) return present;
  for (int index : listed) {
    if (std::find(present.begin(), present.end(), index) == present.end()) {
      return InvalidArgument("GPU {} in '{}' is not on this machine (it has {})", index, spec,
                             fmt::join(present, ","));
    }
  }
  return listed;
}

DType GpuActivations() { return SimulatedGpuRequested() ? DType::kF32 : DType::kBF16; }

}  // namespace tessera

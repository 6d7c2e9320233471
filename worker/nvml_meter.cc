#include "worker/nvml_meter.h"

#include <dlfcn.h>

#include <algorithm>

#include <fmt/format.h>

namespace tessera {

namespace {

constexpr int kNvmlSuccess = 0;

std::string NvmlError(const NvmlApi& api, int result) {
  const char* text = api.error_string != nullptr ? api.error_string(result) : nullptr;
  return fmt::format("{} (NVML error {})", text != nullptr ? text : "unknown error", result);
}

class NvmlMeter final : public GpuMeter {
 public:
  NvmlMeter(NvmlApi api, void* device, std::string pci_bus_id)
      : api_(std::move(api)), device_(device), pci_bus_id_(std::move(pci_bus_id)) {}
  ~NvmlMeter() override { api_.shutdown(); }
  NvmlMeter(const NvmlMeter&) = delete;
  NvmlMeter& operator=(const NvmlMeter&) = delete;

  Result<GpuUse> Sample() override {
    NvmlUtilization utilization;
    if (const int result = api_.utilization(device_, &utilization); result != kNvmlSuccess) {
      return Unavailable("NVML could not read the utilisation of the GPU at {}: {}", pci_bus_id_,
                         NvmlError(api_, result));
    }
    NvmlMemory memory;
    if (const int result = api_.memory(device_, &memory); result != kNvmlSuccess) {
      return Unavailable("NVML could not read the memory of the GPU at {}: {}", pci_bus_id_,
                         NvmlError(api_, result));
    }
    GpuUse use;
    use.utilization = std::min(utilization.gpu, 100U) / 100.0;
    use.memory_total = static_cast<int64_t>(memory.total);
    use.memory_used = std::min(static_cast<int64_t>(memory.used), use.memory_total);
    return use;
  }

 private:
  NvmlApi api_;
  void* device_;
  std::string pci_bus_id_;
};

}  // namespace

Result<NvmlApi> LoadNvml(const std::string& library) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    return Unavailable(
        "cannot open {} (NVML, installed with the NVIDIA driver): {}; GPU utilisation is not "
        "reported",
        library, error != nullptr ? error : "unknown error");
  }
  NvmlApi api;
  api.library = std::shared_ptr<void>(handle, [](void* h) { dlclose(h); });
  const auto find = [&](const char* name, auto& slot) -> Status {
    void* symbol = dlsym(handle, name);
    if (symbol == nullptr)
      return Unavailable("{} has no {}: the NVIDIA driver is too old", library, name);
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(symbol);
    return Status::Ok();
  };
  TESSERA_RETURN_IF_ERROR(find("nvmlInit_v2", api.init));
  TESSERA_RETURN_IF_ERROR(find("nvmlShutdown", api.shutdown));
  TESSERA_RETURN_IF_ERROR(find("nvmlErrorString", api.error_string));
  TESSERA_RETURN_IF_ERROR(find("nvmlDeviceGetHandleByPciBusId_v2", api.device_by_pci_bus_id));
  TESSERA_RETURN_IF_ERROR(find("nvmlDeviceGetUtilizationRates", api.utilization));
  TESSERA_RETURN_IF_ERROR(find("nvmlDeviceGetMemoryInfo", api.memory));
  return api;
}

Result<std::unique_ptr<GpuMeter>> MakeNvmlMeter(NvmlApi api, const std::string& pci_bus_id) {
  if (api.init == nullptr || api.shutdown == nullptr || api.device_by_pci_bus_id == nullptr ||
      api.utilization == nullptr || api.memory == nullptr) {
    return InvalidArgument("an NVML API without all of its entry points");
  }
  if (pci_bus_id.empty()) return InvalidArgument("no PCI bus id to find the GPU by in NVML");
  if (const int result = api.init(); result != kNvmlSuccess) {
    return Unavailable("NVML could not start: {}", NvmlError(api, result));
  }
  void* device = nullptr;
  if (const int result = api.device_by_pci_bus_id(pci_bus_id.c_str(), &device);
      result != kNvmlSuccess) {
    const std::string error = NvmlError(api, result);
    api.shutdown();
    return Unavailable("NVML has no GPU at PCI bus id {}: {}", pci_bus_id, error);
  }
  return std::unique_ptr<GpuMeter>(std::make_unique<NvmlMeter>(std::move(api), device, pci_bus_id));
}

}  // namespace tessera

// A GPU's utilisation and memory from NVML, the NVIDIA driver's management library (what
// nvidia-smi, Ray's dashboard and DCGM read).
//
// NVML ships with the driver, not with the CUDA toolkit: a build machine without a driver has no
// libnvidia-ml.so.1 (and no nvml.h), so the library is opened at run time (LoadNvml) and the few
// entry points used are declared here from NVML's documented C API. A worker without the library
// runs on and reports no GPU figures.
//
// The device is found by its PCI bus id, which names the same card in CUDA and in NVML whatever
// CUDA_VISIBLE_DEVICES renumbers.
#pragma once

#include <memory>
#include <string>

#include "core/gpu_use.h"
#include "core/status.h"

namespace tessera {

// NVML's nvmlUtilization_t and nvmlMemory_t.
struct NvmlUtilization {
  unsigned int gpu = 0;     // percent of the sample period a kernel was running
  unsigned int memory = 0;  // percent of it device memory was read or written
};
struct NvmlMemory {
  unsigned long long total = 0;  // NOLINT(google-runtime-int): NVML's type
  unsigned long long free = 0;   // NOLINT(google-runtime-int)
  unsigned long long used = 0;   // NOLINT(google-runtime-int)
};

// The NVML entry points a meter calls: the library's (LoadNvml), or a test's. Each returns an
// nvmlReturn_t (0: success); a device is an opaque nvmlDevice_t.
struct NvmlApi {
  int (*init)() = nullptr;  // nvmlInit_v2
  int (*shutdown)() = nullptr;
  const char* (*error_string)(int result) = nullptr;
  int (*device_by_pci_bus_id)(const char* pci_bus_id, void** device) = nullptr;  // ..._v2
  int (*utilization)(void* device, NvmlUtilization* out) = nullptr;
  int (*memory)(void* device, NvmlMemory* out) = nullptr;
  std::shared_ptr<void> library;  // keeps the shared library loaded while the API is in use
};

// dlopens `library` and finds the entry points. Unavailable naming the library (and that it comes
// with the NVIDIA driver) when it cannot be opened, or the symbol it lacks.
Result<NvmlApi> LoadNvml(const std::string& library = "libnvidia-ml.so.1");

// A meter for the GPU at `pci_bus_id` ("00000000:1B:00.0"): initialises NVML (shut down again
// when the meter goes) and finds the device. Unavailable naming NVML's error otherwise.
Result<std::unique_ptr<GpuMeter>> MakeNvmlMeter(NvmlApi api, const std::string& pci_bus_id);

}  // namespace tessera

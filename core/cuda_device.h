// Which CUDA devices this process can use.
//
// The one place core touches the CUDA runtime. A build without CUDA, a machine without a driver,
// and a machine without devices all give zero devices with the reason, so callers (GPU tests,
// device selection) can say why there is no GPU instead of failing obscurely.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  int64_t total_memory_bytes = 0;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  // "00000000:1B:00.0" (domain:bus:device.function): the same card in NVML, whatever index
  // CUDA_VISIBLE_DEVICES gives it here.
  std::string pci_bus_id;
};

struct CudaDevices {
  std::vector<CudaDeviceInfo> devices;  // empty when none is usable
  std::string reason;                   // why none is usable; empty otherwise
};

// True when this build includes the CUDA backend.
bool BuiltWithCuda();
CudaDevices ProbeCudaDevices();

}  // namespace tessera

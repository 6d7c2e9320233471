// How busy a GPU is: the fraction of the last sample period in which a kernel ran on it, and its
// memory in use of its total. A GPU worker reports one sample with each heartbeat (`tessera
// status`, the dashboard's workers table, /metrics tessera_worker_gpu_utilization_ratio).
//
// The figures are the device's, as NVML reports them for a real GPU (worker/nvml_meter.h): they
// count every process on it, not only this worker's kernels and allocations. The simulated GPU
// measures its own kernels (worker/simulated_gpu.h).
//
// Thread safety: a GpuMeter is sampled from one thread (the worker's io thread).
#pragma once

#include <cstdint>

#include "core/status.h"

namespace tessera {

struct GpuUse {
  double utilization = 0;    // 0..1: the part of the last sample period a kernel was running
  int64_t memory_used = 0;   // bytes in use on the device, every process's
  int64_t memory_total = 0;  // the device's memory
};

class GpuMeter {
 public:
  virtual ~GpuMeter() = default;
  // The figures now; Unavailable naming why when the device cannot say (a lost driver).
  virtual Result<GpuUse> Sample() = 0;
};

}  // namespace tessera

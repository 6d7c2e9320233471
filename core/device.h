// Where a tensor lives or a task runs: the host CPU, or CUDA device N; objects (never tasks) may
// also live on the disk: a CPU worker's swap file (worker/swap_file.h), where the memory plan swaps
// activations that its host tier cannot hold.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace tessera {

enum class DeviceKind : uint8_t { kCpu, kCuda, kDisk };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;  // CUDA ordinal; always 0 for the CPU.

  static constexpr Device Cpu() { return {DeviceKind::kCpu, 0}; }
  static constexpr Device Cuda(int index) { return {DeviceKind::kCuda, index}; }
  static constexpr Device Disk() { return {DeviceKind::kDisk, 0}; }

  bool is_cpu() const { return kind == DeviceKind::kCpu; }
  friend bool operator==(const Device&, const Device&) = default;

  // "cpu", "cuda:N" or "disk".
  std::string ToString() const;
};

std::string_view DeviceKindName(DeviceKind kind);

// Parses "cpu", "cuda" (= cuda:0) or "cuda:N"; InvalidArgument otherwise.
Result<Device> ParseDevice(std::string_view text);

}  // namespace tessera

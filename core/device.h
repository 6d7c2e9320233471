// Where a tensor lives or a task runs: the host CPU, or CUDA device N.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace tessera {

enum class DeviceKind : uint8_t { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;  // CUDA ordinal; always 0 for the CPU.

  static constexpr Device Cpu() { return {DeviceKind::kCpu, 0}; }
  static constexpr Device Cuda(int index) { return {DeviceKind::kCuda, index}; }

  bool is_cpu() const { return kind == DeviceKind::kCpu; }
  friend bool operator==(const Device&, const Device&) = default;

  // "cpu" or "cuda:N".
  std::string ToString() const;
};

std::string_view DeviceKindName(DeviceKind kind);

// Parses "cpu", "cuda" (= cuda:0) or "cuda:N"; InvalidArgument otherwise.
Result<Device> ParseDevice(std::string_view text);

}  // namespace tessera

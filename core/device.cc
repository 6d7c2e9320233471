#include "core/device.h"

#include <charconv>

namespace tessera {

std::string_view DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kCuda:
      return "cuda";
    case DeviceKind::kDisk:
      return "disk";
  }
  return "unknown";
}

std::string Device::ToString() const {
  return kind == DeviceKind::kCuda ? fmt::format("cuda:{}", index)
                                   : std::string(DeviceKindName(kind));
}

Result<Device> ParseDevice(std::string_view text) {
  if (text == "cpu") return Device::Cpu();
  if (text == "cuda") return Device::Cuda(0);
  constexpr std::string_view kCudaPrefix = "cuda:";
  if (text.starts_with(kCudaPrefix)) {
    std::string_view digits = text.substr(kCudaPrefix.size());
    int index = -1;
    auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (error == std::errc() && end == digits.data() + digits.size() && index >= 0) {
      return Device::Cuda(index);
    }
  }
  return InvalidArgument("unknown device '{}' (expected cpu, cuda or cuda:N)", text);
}

}  // namespace tessera

#include "core/device.h"

#include <charconv>

namespace tessera {

std::string_view DeviceKindName(DeviceKind kind) {
  return kind == DeviceKind::kCpu ? "cpu" : "cuda";
}

std::string Device::ToString() const {
  return is_cpu() ? std::string("cpu") : fmt::format("cuda:{}", index);
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

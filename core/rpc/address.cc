#include "core/rpc/address.h"

#include <charconv>

namespace tessera::rpc {

Result<Address> Address::Parse(std::string_view text) {
  constexpr std::string_view kUnixPrefix = "unix:";
  if (text.starts_with(kUnixPrefix)) {
    std::string_view path = text.substr(kUnixPrefix.size());
    if (path.empty()) return InvalidArgument("address '{}' has an empty socket path", text);
    return Unix(std::string(path));
  }
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == text.size()) {
    return InvalidArgument("address '{}' is not HOST:PORT or unix:/PATH", text);
  }
  std::string_view port_text = text.substr(colon + 1);
  unsigned port = 0;
  auto [end, error] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (error != std::errc() || end != port_text.data() + port_text.size() || port > 65535) {
    return InvalidArgument("address '{}' has an invalid port '{}' (0-65535)", text, port_text);
  }
  return Tcp(std::string(text.substr(0, colon)), static_cast<uint16_t>(port));
}

std::string Address::ToString() const {
  return kind == Kind::kUnix ? "unix:" + path : fmt::format("{}:{}", host, port);
}

}  // namespace tessera::rpc

#include "core/rpc/address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>

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

Result<std::string> LocalHostToward(const Address& peer) {
  if (peer.kind == Address::Kind::kUnix || peer.host == "localhost")
    return std::string("127.0.0.1");
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (int error = ::getaddrinfo(peer.host.c_str(), "9", &hints, &found); error != 0) {
    return Unavailable("cannot resolve '{}': {}", peer.host, ::gai_strerror(error));
  }
  const sockaddr_in target = *reinterpret_cast<const sockaddr_in*>(found->ai_addr);
  ::freeaddrinfo(found);
  if ((ntohl(target.sin_addr.s_addr) >> 24) == 127) return std::string("127.0.0.1");
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Unavailable("socket: {}", std::strerror(errno));
  sockaddr_in local{};
  socklen_t length = sizeof(local);
  const bool routed =
      ::connect(fd, reinterpret_cast<const sockaddr*>(&target), sizeof(target)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
  const int error = errno;
  ::close(fd);
  if (!routed) {
    return Unavailable("no route from this host to {}: {}", peer.host, std::strerror(error));
  }
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text));
  return std::string(text);
}

}  // namespace tessera::rpc

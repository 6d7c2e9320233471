// Network addresses of Tessera processes: "host:port" for TCP, "unix:/path" for a Unix socket.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace tessera::rpc {

struct Address {
  enum class Kind { kTcp, kUnix };
  Kind kind = Kind::kTcp;
  std::string host;   // TCP
  uint16_t port = 0;  // TCP; 0 asks the system for a free port when listening
  std::string path;   // Unix

  static Address Tcp(std::string host, uint16_t port) {
    return {Kind::kTcp, std::move(host), port, {}};
  }
  static Address Unix(std::string path) { return {Kind::kUnix, {}, 0, std::move(path)}; }
  // InvalidArgument naming the text and the accepted forms otherwise.
  static Result<Address> Parse(std::string_view text);
  std::string ToString() const;
  friend bool operator==(const Address&, const Address&) = default;
};

// The IP address this host uses to reach `peer`: the one to advertise to processes that reach
// this one the same way (a data plane's listener). "127.0.0.1" for a Unix socket or a loopback
// peer; otherwise the source address the kernel picks for the route to the peer (a UDP socket
// connected to it: nothing is sent), e.g. the address of a network namespace's own interface.
// Unavailable naming the peer when its host does not resolve or no route leads to it.
Result<std::string> LocalHostToward(const Address& peer);

}  // namespace tessera::rpc

// Joining a cluster: connect to the scheduler, say Hello with the cluster token, and wait for
// Welcome (or Refused). The one handshake drivers, workers and admin clients share.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/proto/tessera.capnp.h"
#include "core/rpc/address.h"
#include "core/rpc/asio.h"
#include "core/rpc/connection.h"
#include "core/status.h"

namespace tessera::rpc {

struct HelloFields {
  proto::Role role = proto::Role::DRIVER;
  std::string token;
  std::string data_address;  // where peers pull this process's objects ("" for none)
  int cpu_threads = 0;
  int64_t host_capacity = 0;
  std::string gpu;   // a worker's GPU (DeviceRuntime::Describe); empty for a CPU worker
  std::string cpus;  // the CPUs the process may run on (core/cpu_set.h); empty: not said
};

struct Joined {
  std::shared_ptr<Connection> connection;
  uint64_t id = 0;  // this process's participant id
  uint32_t heartbeat_interval_ms = 0;
};

// REQUIRES: a thread runs `io` (the handshake completes on it). After Welcome, messages go to
// `on_message`; `on_close` runs when the connection ends. `on_welcome`, when given, runs on the
// io thread with the Joined as soon as Welcome arrives, before any later message is handled:
// state the handlers need (this process's id, the connection to answer on) must be set there,
// not after Join returns, because the scheduler may send work right behind the Welcome.
// Unavailable when nothing answers at `address` within timeout_ms; the scheduler's reason when
// it refuses.
Result<Joined> Join(asio::io_context& io, const Address& address, const HelloFields& hello,
                    int timeout_ms, Connection::MessageHandler on_message,
                    std::function<void(const Status&)> on_close,
                    std::function<void(const Joined&)> on_welcome = nullptr);

// How long a participant hears nothing from the scheduler before it takes it for gone (a stopped
// process, or a host that vanished without closing the connection). The scheduler sends every
// participant at least a keepalive each heartbeat interval (its own, from Welcome), so the limit
// is this process's heartbeat_timeout_ms, but never under four of the scheduler's intervals.
inline std::chrono::milliseconds SchedulerSilenceLimit(int64_t heartbeat_timeout_ms,
                                                       uint32_t scheduler_interval_ms) {
  return std::chrono::milliseconds(
      std::max<int64_t>(heartbeat_timeout_ms, 4 * int64_t{scheduler_interval_ms}));
}

}  // namespace tessera::rpc

// PendingConnections: the bounds on connections that have not yet authenticated.
//
// Every listener that strangers can reach (the scheduler's control plane, each data plane, the
// dashboard) accepts connections before it knows who is on the other end. Until a connection
// proves the cluster token (or, for the dashboard, sends a whole request) it costs memory and a
// file descriptor and has given nothing back, so it is *pending* and bounded three ways:
//   - a deadline: a connection still pending `deadline_ms` after it was accepted is closed;
//   - a cap per peer address: one address holds at most `max_pending_per_address`;
//   - a cap in all: at most `max_pending` at once.
// At a cap the *oldest* pending connection (of that address, then of all) makes room for the new
// one. Refusing the newcomer instead would let a flood that holds the cap lock everyone out for
// as long as it keeps renewing its connections; evicting the oldest means a legitimate peer,
// which authenticates within a round trip, is displaced only if a cap's worth of connections
// arrives during its own handshake.
//
// This class is only the bookkeeping (no sockets, no clock of its own: callers pass `now`), so
// every transport applies one policy and it is tested without a network. Ids are the caller's
// (a participant id, a session number, an endpoint pointer).
//
// Thread safety: none; the owner's thread (an io or progress thread) uses it.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tessera {

struct Settings;

struct PendingLimits {
  int64_t deadline_ms = 5000;
  int max_pending = 512;
  int max_pending_per_address = 64;

  // The preauth_* settings (core/settings_def.h).
  static PendingLimits FromSettings(const Settings& settings);
};

class PendingConnections {
 public:
  using Clock = std::chrono::steady_clock;

  explicit PendingConnections(PendingLimits limits) : limits_(limits) {}

  // A new pending connection `id` from `address` (a peer's IP, without the port: see
  // AddressOf). Returns the ids of the pending connections the caller must now close to stay
  // within the caps, oldest first; they are no longer tracked. REQUIRES: `id` is not pending.
  std::vector<uint64_t> Add(uint64_t id, std::string address, Clock::time_point now);
  // `id` authenticated, or closed: no longer pending. A no-op for an id that is not pending.
  void Remove(uint64_t id);
  // The pending connections whose deadline passed by `now`, oldest first; no longer tracked.
  std::vector<uint64_t> TakeExpired(Clock::time_point now);
  // The oldest pending connection, no longer tracked; nullopt when none is pending. For an
  // owner whose own cap (all connections, pending or not) is reached.
  std::optional<uint64_t> TakeOldest();

  bool contains(uint64_t id) const { return by_id_.contains(id); }
  size_t size() const { return by_id_.size(); }

  // The address part of a peer as rpc::Listener names it: "10.0.0.7:51234" -> "10.0.0.7",
  // "::1:80" or "[::1]:80" -> "::1"; without a numeric port suffix ("unix:/path") it is whole.
  static std::string AddressOf(std::string_view peer);

 private:
  struct Entry {
    std::string address;
    Clock::time_point accepted;
    uint64_t order = 0;
  };
  // Drops `id` from every index. REQUIRES: `id` is pending.
  void Erase(uint64_t id);

  PendingLimits limits_;
  uint64_t next_order_ = 0;
  std::map<uint64_t, Entry> by_id_;
  // Arrival order -> id, oldest first: in all, and per address.
  std::map<uint64_t, uint64_t> by_age_;
  std::map<std::string, std::map<uint64_t, uint64_t>> by_address_;
};

// Whether accept(2) failed for want of descriptors or kernel memory (EMFILE, ENFILE, ENOBUFS,
// ENOMEM, as `errno` values): it fails again at once until that changes, so a listener must pause
// rather than retry (rpc::Listener and the dashboard's server do).
bool AcceptOutOfResources(int error_number);

}  // namespace tessera

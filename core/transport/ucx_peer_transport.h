// UcxPeerTransport: PeerTransport between processes, over UCX's tag matching, with single-copy
// transfers between processes on one host.
//
// Each transport owns a UCX context and worker of its own (one per communicator), so its tags
// never meet another group's. Setting up a group takes two phases, with an exchange in
// between that the caller provides (a rendezvous, or the scheduler):
//   1. Create(rank, size) -> address(): this rank's host, pid and UCX worker address;
//   2. Connect(addresses): endpoints to every peer from their addresses, wired before it returns.
//
// How bytes move:
//   - small messages, and everything between hosts: UCX tag messages (shared memory on one host,
//     TCP or RDMA between hosts);
//   - large messages (>= single_copy_bytes) to a peer on this host: single copy. The sender
//     sends a small descriptor (its pid, the buffer's address and length); the receiver copies
//     the bytes straight out of the sender's memory with process_vm_readv and acknowledges, which
//     completes the send. Only the receiver spends CPU on the transfer, once, so ranks that share
//     cores (more ranks than cores) do not need to be scheduled together, as a shared-memory
//     pipeline needs both sides at once. Where the ranks outnumber the host's cores, messages
//     above 8 KiB take this path (kOversubscribedSingleCopyBytes), else from 64 KiB. Connect checks
//     the permission (ptrace scope) with a probe read and falls back to UCX for a peer it cannot
//     read.
//   UCX's own CMA transport is left out (unless UCX_TLS asks for it): without UCX's peer-failure
//   mode a peer dying under a CMA transfer makes UCX abort the survivor, and with that mode UCX
//   1.13 moves the bytes over TCP loopback instead. Here a vanished peer is an error.
//
// Progress happens in the caller's thread inside Wait: it polls for a few microseconds, then
// sleeps on UCX's event fd, so oversubscribed ranks do not steal each other's cores.
//
// Failures: endpoints to other hosts run in UCX's peer-failure mode, so a dead peer or a broken
// link fails the transfers with it; on one host a single-copy read from a dead peer fails. A
// peer that is silent (stuck, or dead under shared memory) is learned through Abort (from the
// group's watcher: the rendezvous or the scheduler) or the deadline. A failed Wait cancels
// receives and force-closes every endpoint: the transport is then broken and every later call
// returns the same error.
//
// Thread safety: see PeerTransport (Abort from any thread; the rest from one).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/settings.h"
#include "core/transport/peer_transport.h"

namespace tessera {

// The single-copy threshold for ranks that outnumber their host's cores (collectives/
// ucx_communicator.cc sets it): above 8 KiB, what UCX's shared memory sends eagerly (beyond it,
// its handshakes wait for the peer's turn on a core). Measured with bench_collectives, 4 ranks on
// 2 cores, a 96 KiB all-reduce (a ring of 24 KiB segments): 1.7-1.9 ms at the default threshold,
// 0.6 at 8 KiB; 2 ranks on 2 cores are 25-35% faster through shared memory at 32-96 KiB, so the
// default stays for ranks with cores of their own. From 8 KiB itself, a sequence-parallel GPT-2
// step of 8 KiB blocks ran 11% slower than through shared memory; above it, as fast. Those
// figures predate the waits that yield their core (spin_microseconds below): since, the same
// all-reduce takes 0.07 ms at 8 KiB and 0.08-0.09 at the default (bench_collectives, 2026-12-07).
inline constexpr int64_t kOversubscribedSingleCopyBytes = int64_t{8} * 1024 + 1;

struct UcxPeerTransportOptions {
  // A wait polls this long without events, yielding its core between polls, before it sleeps
  // on the event fd (the collective_spin_us setting's default; the workers' groups take the
  // setting). Polls that yield keep a rank's wake-up off a collective's path without taking the
  // core from the rank it waits for, where ranks take turns on cores. Measured
  // (bench_plan_search's calibration, 4 workers on 2 cores, 2026-12-07): a group of 4 tensor
  // ranks' step 65-76 ms polling 50 us without yielding, 37-44 ms yielding at 50-5000 us;
  // polling 1 ms without yielding, 418 ms.
  int spin_microseconds = static_cast<int>(Settings{}.collective_spin_us);
  // Messages this large to local peers: single copy (kOversubscribedSingleCopyBytes where the
  // ranks take turns on the cores).
  int64_t single_copy_bytes = int64_t{64} * 1024;
  // Every peer is on this host: UCX gets shared memory only (it would otherwise also stripe
  // large messages over TCP loopback).
  bool local_only = false;
  // UCX's network transports only (TCP, RDMA), even to peers on this host: the path between
  // hosts, for tests on one machine.
  bool network_only = false;
};

struct PeerTransportStats {
  int64_t bytes_sent = 0;
  int64_t single_copy_bytes_received = 0;  // read straight from local peers' memory
};

class UcxPeerTransport : public PeerTransport {
 public:
  // Unavailable when UCX cannot start.
  static Result<std::unique_ptr<UcxPeerTransport>> Create(
      int rank, int size, const UcxPeerTransportOptions& options = {});

  // This rank's address, for every peer's Connect.
  virtual const std::string& address() const = 0;

  // REQUIRES: addresses.size() == size(), addresses[r] is rank r's address(); called once.
  // Unavailable naming the peer whose endpoint cannot be created or wired by `deadline`.
  virtual Status Connect(const std::vector<std::string>& addresses, Clock::time_point deadline) = 0;

  virtual PeerTransportStats stats() const = 0;

  // When the transport broke on a deadline: how long the peer it waited on had been silent
  // (since the last transfer with it completed); 0 otherwise.
  virtual int64_t failure_silence_ms() const = 0;
  // ... and which peer that was (its rank); -1 otherwise.
  virtual int failure_silent_peer() const = 0;
};

}  // namespace tessera

// UcxPeerTransport: PeerTransport between processes over UCX's tag-matching API.
//
// Each transport owns a UCX context and worker of its own (one per communicator), so its tags
// never meet another group's. Setting up a group takes two phases, with an exchange in
// between that the caller provides (a rendezvous, or the scheduler):
//   1. Create(rank, size) -> address(): this rank's UCX worker address, an opaque blob;
//   2. Connect(addresses): endpoints to every peer from their blobs, wired up before it returns.
// UCX picks the transport per peer: shared memory and CMA (single-copy) on one host, TCP or RDMA
// between hosts. Large messages use UCX's rendezvous protocol, so the bytes are copied once.
//
// Progress happens in the caller's thread inside Wait: it polls for a few microseconds, then
// sleeps on UCX's event fd (so oversubscribed ranks do not steal each other's cores).
//
// Failures: UCX runs without peer-failure detection here (in UCX 1.13 that mode gives up shared
// memory), so a dead peer is learned through Abort (from the group's watcher) or a deadline.
// A failed Wait cancels receives and force-closes every endpoint: the transport is then broken
// and every later call returns the same error.
//
// Thread safety: see PeerTransport (Abort from any thread; the rest from one).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/transport/peer_transport.h"

namespace tessera {

struct UcxPeerTransportOptions {
  int spin_microseconds = 50;  // busy-poll this long without events before sleeping on the fd
};

class UcxPeerTransport : public PeerTransport {
 public:
  // Unavailable when UCX cannot start.
  static Result<std::unique_ptr<UcxPeerTransport>> Create(
      int rank, int size, const UcxPeerTransportOptions& options = {});

  // This rank's worker address, for every peer's Connect.
  virtual const std::string& address() const = 0;

  // REQUIRES: addresses.size() == size(), addresses[r] is rank r's address(); called once.
  // Unavailable naming the peer whose endpoint cannot be created or wired by `deadline`.
  virtual Status Connect(const std::vector<std::string>& addresses, Clock::time_point deadline) = 0;

  // Bytes handed to Isend so far.
  virtual int64_t bytes_sent() const = 0;
};

}  // namespace tessera

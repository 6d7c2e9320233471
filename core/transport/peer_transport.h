// PeerTransport: the point-to-point primitive collective algorithms are written over.
//
// A group of `size` ranks; each rank holds one transport. Isend/Irecv start a transfer to or
// from a peer under a tag (sender and receiver use the same tag; messages with one tag between
// one pair arrive in order); Wait completes a set of them. Algorithms see nothing else, so the
// ring all-reduce reads as its phases whatever carries the bytes (threads in one process, or
// UCX between processes: ucx_peer_transport.h).
//
// Tags are below kMaxTag (48 bits): the transport adds the sender's rank above them.
//
// Failures: Wait fails with TimedOut naming the peer it waits for when the deadline passes, or
// Unavailable when the transport knows the peer is gone or Abort was called (the reason says
// which peer died, as the caller of Abort learned it). After a failed Wait the transport is
// broken: every outstanding request is cancelled (the caller may free its buffers) and every
// later call fails with the same error. Never hangs.
//
// Thread safety: Isend/Irecv/Wait from one thread at a time (the communicator's); Abort from any
// thread, at any time.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "core/status.h"

namespace tessera {

class PeerTransport {
 public:
  using Clock = std::chrono::steady_clock;
  using RequestId = uint64_t;
  static constexpr uint64_t kMaxTag = uint64_t{1} << 48;

  virtual ~PeerTransport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // REQUIRES: tag < kMaxTag; `data` stays valid until the request completes or Wait fails.
  virtual Result<RequestId> Isend(int peer, uint64_t tag, const void* data, int64_t bytes) = 0;
  virtual Result<RequestId> Irecv(int peer, uint64_t tag, void* data, int64_t bytes) = 0;
  // Completes every request in `requests` (in any order) by `deadline`.
  virtual Status Wait(const std::vector<RequestId>& requests, Clock::time_point deadline) = 0;

  // Breaks the transport: a Wait in progress or to come fails with `reason` (e.g. "rank 2 died",
  // from whoever watches the group's members).
  virtual void Abort(const Status& reason) = 0;
};

}  // namespace tessera

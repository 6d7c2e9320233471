// Communicator: collective operations over a group of ranks.
//
// One interface for every backend: HostCommunicator (host buffers, over a PeerTransport: UCX
// between worker processes, or loopback threads in tests) and, with the CUDA backend, NCCL for
// device buffers. All ranks call the same collectives in the same order, with the same counts
// and dtypes (f32, bf16, f16, i32) and ops (sum, avg, max, min).
//
// Algorithms (HostCommunicator), chosen by size:
//   - small messages (<= small_bytes, the whole buffer): direct. Every rank sends its buffer (a
//     reduce-scatter: each rank's block of it) to every other and reduces all of them in rank
//     order, so every rank gets bitwise-identical results, the same bits whatever the
//     segmentation (an element's sum does not depend on which block or bucket it is in).
//   - large messages: ring. All-reduce = reduce-scatter + all-gather, each n-1 steps passing one
//     of n segments to the right neighbour; a segment moves in chunks of chunk_bytes so reducing a
//     chunk overlaps receiving the next. Each rank sends 2(n-1)/n of the buffer: bandwidth-optimal.
//   - broadcast: direct when small, a pipelined chain from the root when large.
//   - all-to-all: pairwise exchange over n-1 steps; at step k rank r sends its block for rank
//     (r+k)%n and receives rank (r-k+n)%n's block for it, so each step pairs every rank with one
//     sender and one receiver (no rank is flooded). Its own block is copied locally: each rank
//     sends (n-1)/n of its buffer.
// Every segment is reduced once and then copied, so ring results are identical on all ranks too.
//
// Failures: every call has a deadline (timeout_ms); a peer that is dead or silent makes the call
// fail with an error naming it, on every rank that waits for it. Never hangs.
// Thread safety: one call at a time per communicator.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "collectives/reduce.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/transport/peer_transport.h"

namespace tessera {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // In place: afterwards `buffer` (count elements) holds op over every rank's buffer.
  virtual Status AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op) = 0;
  // `send` holds size()*count elements (block r for rank r); `recv` (count elements) receives
  // op over every rank's block rank().
  virtual Status ReduceScatter(const void* send, void* recv, int64_t count, DType dtype,
                               ReduceOp op) = 0;
  // `send` (count elements) from every rank lands in `recv` (size()*count), block r from rank r.
  virtual Status AllGather(const void* send, void* recv, int64_t count, DType dtype) = 0;
  // `send` holds size()*count elements, block j (count elements) for rank j; `recv`
  // (size()*count) receives block j from rank j: recv block j = rank j's send block rank(). Any
  // dtype (nothing is reduced). REQUIRES: `send` and `recv` do not overlap (InvalidArgument
  // otherwise). Sequence parallelism (Ulysses) uses it to trade a sequence split for a head split.
  virtual Status AllToAll(const void* send, void* recv, int64_t count, DType dtype) = 0;
  // Root's `buffer` is copied into every rank's.
  virtual Status Broadcast(void* buffer, int64_t count, DType dtype, int root) = 0;
  // op over every rank's `send` lands in root's `recv` (other ranks' recv is untouched).
  virtual Status Reduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp op,
                        int root) = 0;
  // Point to point: messages between one pair arrive in the order they were sent.
  virtual Status Send(const void* data, int64_t count, DType dtype, int peer) = 0;
  virtual Status Recv(void* data, int64_t count, DType dtype, int peer) = 0;
  // Sends to `dest` and receives from `source` at the same time (a ring shift when every rank
  // calls it with its neighbours; pipeline stages exchanging activations and gradients).
  virtual Status SendRecv(const void* send, int64_t send_count, int dest, void* recv,
                          int64_t recv_count, int source, DType dtype) = 0;

  // Bytes this rank has sent so far (for communication accounting).
  virtual int64_t bytes_sent() const = 0;

  // Fails the collective in progress, and every later one, with `reason` (a member died).
  // Thread-safe: this is how a watcher stops a communicator another thread is blocked in.
  virtual void Abort(const Status& reason) = 0;
};

struct CommunicatorOptions {
  int64_t small_bytes = int64_t{64} * 1024;  // direct algorithms up to this size
  int64_t chunk_bytes = 1 << 20;             // pipelining granularity of the ring and the chain
  int timeout_ms = 30'000;                   // per call: a silent peer fails the call after this
  // Runs once with the first failure a call of this rank meets, and returns the error the call
  // reports instead: the group's verdict (Rendezvous::ReportFailure), which may name another
  // rank than the one this rank happened to wait on.
  std::function<Status(const Status&)> on_failure;
};

// REQUIRES: `transport` outlives the communicator.
std::unique_ptr<Communicator> MakeHostCommunicator(PeerTransport& transport,
                                                   const CommunicatorOptions& options = {});
// The communicator owns the transport.
std::unique_ptr<Communicator> MakeHostCommunicator(std::shared_ptr<PeerTransport> transport,
                                                   const CommunicatorOptions& options = {});

}  // namespace tessera

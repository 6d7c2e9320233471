// DataPlane: moves objects between processes, peer to peer, over UCX.
//
// Every process that holds objects (workers, and drivers for what they Put) runs one DataPlane:
// it serves its objects to peers that ask, and pulls objects from peers. The scheduler never
// sees the bytes; it only tells a puller where an object lives (the holder's address()).
//
// Protocol (UCX active messages; UCX is behind this one wrapper; wire format and handshake in
// data_plane_wire.h):
//   both ways          a token handshake once per endpoint (challenge, hello, welcome): each
//                       side proves it holds the cluster token without sending it
//   pusher -> peer     kPush {key, length, ...} + the bytes (rendezvous): an object the peer needs
//   puller -> holder   kGetChunk {request, object, offset, length, flags}
//   holder -> puller   kChunk    {request, status, length} + the bytes, sent with UCX's
//                       rendezvous protocol (shared memory on one host, TCP between hosts); or,
//                       on error, the message text and no bytes.
// A pull is cut into chunks of `chunk_bytes`, at most `chunks_in_flight` outstanding, so the
// holder's sends and the puller's receives overlap (pipelining).
//
// Trust: nothing but the handshake is accepted from an endpoint whose peer has not proved the
// token, and replies are accepted only from the peer asked. Chunk ranges are checked against the
// object without overflow; every length is checked against what was asked or announced.
//
// Single copy on one host (local_memory.h): the handshake names each side's process. Once a
// puller has checked that it can read the holder's memory, it asks for chunks by address: the
// holder lends the chunk (kChunk with its address, no payload) and keeps the object alive until
// the puller has copied it out of the holder's memory and said so (kChunkRead). Pushes work
// alike when the receiver said in the handshake that it can read the pusher: the pusher lends,
// the receiver copies and acknowledges with kPushRead, which completes the push. Only the reader
// spends CPU, once, and only from the process the handshake named. UCX's CMA transport, which
// does the same, is left out: without peer-failure mode UCX aborts the process when a peer dies
// under a CMA transfer. A loan nobody returns (the borrower died) is released after
// pull_timeout_ms.
//
// Threads: one progress thread owns the UCX worker and does every UCX call. It sleeps on UCX's
// wakeup file descriptor and an eventfd for commands, so an idle data plane uses no CPU. Pull and
// ForgetPeer may be called from any thread; callbacks run on the progress thread and must not
// block.
//
// Strangers are bounded (core/pending_connections.h, the policy the control plane applies too):
// an endpoint a peer opened to this process's listener is pending until its Hello proves the
// token. One still pending `preauth.deadline_ms` after it connected is closed (so is one whose
// Hello was refused, once the refusal had that long to reach it), and at the caps on pending
// endpoints (per client address, in all) the oldest pending one is closed for a newcomer. Each
// endpoint's handshake runs on its own: a flood of silent endpoints costs each one its own
// deadline and never holds up another's handshake.
//
// Failures: a pull fails (never hangs) when the holder reports an error (unknown object), when
// the holder refuses this process's token or cannot prove its own, when its deadline passes,
// when the peer's endpoint fails, or when ForgetPeer is called for the peer (the control plane's
// verdict that it died). Peer-failure detection by UCX itself
// (`detect_peer_failure`) costs shared-memory transports in UCX 1.13, so on one host the default
// relies on the control plane and deadlines instead.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/ids.h"
#include "core/pending_connections.h"
#include "core/status.h"

namespace tessera {

// What a holder serves for one object: a readable range kept alive by `keepalive` until the
// transfer completes.
struct ServedObject {
  const void* data = nullptr;
  int64_t bytes = 0;
  std::shared_ptr<void> keepalive;
};
// Called on the progress thread; must be thread-safe with the caller's own use of the objects.
using ObjectLookup = std::function<Result<ServedObject>(ObjectId)>;

// Pushes: a producer sends an object to a peer that will need it (the parts of a registered graph
// on different workers), without the peer asking. The key says what it is to the receiver.
struct PushKey {
  uint64_t graph = 0;
  uint64_t instance = 0;
  uint64_t object = 0;
  friend bool operator==(const PushKey&, const PushKey&) = default;
};
struct PushHandlers {
  // Where an arriving push of `bytes` goes: a buffer that stays valid until `delivered` runs
  // for the key. An error refuses the push (its bytes are dropped) and is passed to delivered.
  std::function<Result<void*>(const PushKey&, int64_t bytes)> accept;
  std::function<void(const PushKey&, const Status&)> delivered;
};

struct DataPlaneOptions {
  // The cluster token (required): this data plane serves and sends only to processes that prove
  // they hold it, and pulls and pushes only from and to such processes.
  std::string token;
  std::string host = "127.0.0.1";  // where the listener binds; peers connect here
  uint16_t port = 0;               // 0: any free port
  int64_t chunk_bytes = 8 << 20;
  int chunks_in_flight = 4;
  int pull_timeout_ms = 30'000;
  bool detect_peer_failure = false;  // UCX peer-failure mode (TCP only in UCX 1.13)
  // Bounds on endpoints peers opened that have not proved the token (the preauth_* settings).
  PendingLimits preauth;
};

struct DataPlaneStats {
  int64_t bytes_pulled = 0;
  int64_t bytes_served = 0;
  int64_t pulls = 0;
  int64_t serves = 0;
  int64_t pull_micros = 0;  // summed over completed pulls, from Pull() to the last byte
  // Messages refused: from processes that did not prove the token, malformed, out of range, or
  // replies from someone other than the peer asked.
  int64_t refused = 0;
  // Endpoints peers opened that have not proved the token yet (now), and those closed because
  // they did not in time or were the oldest over a cap (so far).
  int64_t pending_connections = 0;
  int64_t shed_connections = 0;
};

class DataPlane {
 public:
  using PullCallback = std::function<void(const Status&)>;

  // Unavailable naming the address when UCX cannot start or listen.
  static Result<std::unique_ptr<DataPlane>> Start(const DataPlaneOptions& options,
                                                  ObjectLookup lookup,
                                                  PushHandlers push_handlers = {});
  virtual ~DataPlane() = default;

  // "host:port" peers use to reach this process.
  virtual const std::string& address() const = 0;

  // Copies bytes [0, bytes) of `object` held by the peer at `address` into `dest`, then calls
  // `done` (on the progress thread). REQUIRES: dest stays valid until `done` runs.
  virtual void Pull(const std::string& address, ObjectId object, void* dest, int64_t bytes,
                    PullCallback done) = 0;
  // Blocking form of Pull.
  Status PullAndWait(const std::string& address, ObjectId object, void* dest, int64_t bytes);

  // Sends bytes [0, bytes) at `data` to the peer at `address` under `key`; `keepalive` holds the
  // bytes until the send completes, then `done` runs (progress thread).
  virtual void Push(const std::string& address, const PushKey& key, const void* data, int64_t bytes,
                    std::shared_ptr<void> keepalive, PullCallback done) = 0;

  // Fails every pull from the peer and closes its endpoint (the peer died).
  virtual void ForgetPeer(const std::string& address, const Status& reason) = 0;

  virtual DataPlaneStats stats() const = 0;
};

}  // namespace tessera

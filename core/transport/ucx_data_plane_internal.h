// The UCX data plane's internals (the DataPlane behind DataPlane::Start; data_plane.h says what
// it does, data_plane_wire.h what it sends): the class, its per-peer and per-transfer state, and
// small helpers for UCX's request parameters. Internal to core/transport; its sources are
//   ucx_data_plane.cc            start-up, the progress thread, endpoints, deadlines, shutdown
//   ucx_data_plane_handshake.cc  the token handshake (both sides)
//   ucx_data_plane_transfer.cc   serving chunks, pulling them, and pushes
// Every member runs on the progress thread, except the DataPlane interface's entry points (which
// post to it) and stats().
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <ucp/api/ucp.h>

#include "core/pending_connections.h"
#include "core/thread_annotations.h"
#include "core/transport/data_plane.h"
#include "core/transport/data_plane_wire.h"

namespace tessera::detail {

// Request parameters of an active-message send (`flags`: UCP_AM_SEND_FLAG_*) and of a receive
// of an active message's data, completing through `callback` with `user_data`, never inline.
// Every send names its endpoint to the receiver (REPLY): handlers act on who sent a message.
inline ucp_request_param_t AmSendParams(ucp_send_nbx_callback_t callback, void* user_data,
                                        uint32_t flags) {
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  params.cb.send = callback;
  params.user_data = user_data;
  params.flags = flags | UCP_AM_SEND_FLAG_REPLY;
  return params;
}
inline ucp_request_param_t AmReceiveParams(ucp_am_recv_data_nbx_callback_t callback,
                                           void* user_data) {
  ucp_request_param_t params{};
  params.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  params.cb.recv_am = callback;
  params.user_data = user_data;
  return params;
}

// The endpoint an active message came on (every sender sets REPLY), or null.
inline ucp_ep_h SenderOf(const ucp_am_recv_param_t* param) {
  return (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
}

// An error text carried in a reply's payload (never a rendezvous descriptor), cut to a bound.
inline std::string ErrorText(const void* data, size_t length, const ucp_am_recv_param_t* param) {
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return "(error text sent by rendezvous)";
  return std::string(static_cast<const char*>(data), std::min(length, kMaxErrorText));
}

// An endpoint as a PendingConnections id, and back.
inline uint64_t PendingId(ucp_ep_h ep) { return reinterpret_cast<uintptr_t>(ep); }
inline ucp_ep_h PendingEndpoint(uint64_t id) {
  // NOLINTNEXTLINE(performance-no-int-to-ptr): the id is an endpoint's address (PendingId).
  return reinterpret_cast<ucp_ep_h>(static_cast<uintptr_t>(id));
}

inline Status WireStatus(int32_t code, std::string text) {
  return Status(static_cast<StatusCode>(SanitizeWireStatus(code)), std::move(text));
}

class UcxDataPlane final : public DataPlane {
 public:
  UcxDataPlane(DataPlaneOptions options, ObjectLookup lookup, PushHandlers push)
      : options_(std::move(options)),
        lookup_(std::move(lookup)),
        push_(std::move(push)),
        pending_(options_.preauth) {}
  ~UcxDataPlane() override { Shutdown(); }

  Status Init();
  const std::string& address() const override { return address_; }
  void Pull(const std::string& address, ObjectId object, void* dest, int64_t bytes,
            PullCallback done) override;
  void ForgetPeer(const std::string& address, const Status& reason) override;
  void Push(const std::string& address, const PushKey& key, const void* data, int64_t bytes,
            std::shared_ptr<void> keepalive, PullCallback done) override;
  DataPlaneStats stats() const override {
    MutexLock lock(&stats_mutex_);
    return stats_;
  }

 private:
  using Clock = std::chrono::steady_clock;

  // An endpoint this process opened to a peer's listener: pulls and pushes go out on it. Usable
  // once the handshake proved that the peer holds the token and the endpoint is wired up.
  struct Peer {
    enum class Stage : int8_t {
      kHandshake,  // waiting for the peer's challenge, then its welcome
      kWiring,     // authenticated; a flush waits for UCX's wire-up (UCX 1.13 asserts when a
                   // client endpoint sends rendezvous data before it completes)
      kReady,
    };
    ucp_ep_h ep = nullptr;
    Status failure;  // set when the endpoint failed, the handshake failed or the peer was forgotten
    Stage stage = Stage::kHandshake;
    Clock::time_point deadline;  // for the handshake
    bool challenged = false;
    Nonce nonce{};         // ours, in Hello
    Nonce holder_nonce{};  // the peer's, from its challenge
    WireProcess holder{};  // the peer process; trusted once its welcome proves the token
    // Single copy (same host): can this process read the peer's memory (lent chunks), and can the
    // peer read ours (lent pushes)?
    bool reads_peer = false;
    bool peer_reads_us = false;
    std::vector<std::function<void(const Status&)>> waiting;  // until kReady or failure
  };
  // An endpoint a peer opened to this process's listener: it may pull and push once its Hello
  // proved the token. Until then it is in pending_, which closes it at its deadline.
  struct Connection {
    Nonce nonce{};  // our challenge
    bool authenticated = false;
    bool refused = false;  // a bad Hello was answered; nothing more is read from it
    WireProcess client{};
    bool reads_client = false;  // this process can read the client's memory (lent pushes)
  };
  // Memory lent to a peer (a chunk or a push it reads itself), held until it says it is done.
  struct Loan {
    std::shared_ptr<void> keepalive;
    Clock::time_point deadline;
  };
  struct LentPush {
    std::string address;
    std::shared_ptr<void> keepalive;
    PullCallback done;
    int64_t bytes = 0;
    Clock::time_point deadline;
  };
  struct PullState {
    uint64_t id;
    std::string address;
    ObjectId object;
    char* dest;
    int64_t bytes;
    int64_t next_offset = 0;
    int outstanding = 0;
    Status error;
    Clock::time_point deadline;
    Clock::time_point started;
    PullCallback done;
  };
  struct ChunkRequest {
    uint64_t pull;
    int64_t offset;
    int64_t length;
    bool lent;  // asked the holder to lend it (kByAddress)
  };
  struct ServeRequest {
    ucp_ep_h reply_ep;
    GetChunkHeader header;
  };
  struct ReceiveRequest {
    uint64_t request;
    void* descriptor;  // rendezvous descriptor, received with ucp_am_recv_data_nbx
    int64_t length;
  };
  struct PushReceive {
    PushKey key;
    void* descriptor;  // rendezvous descriptor; null for a lent push
    int64_t length;
    ucp_ep_h reply_ep = nullptr;
    PushHeader header{};
    int32_t sender_pid = 0;  // a lent push: the authenticated sender, read by address
  };
  // One outstanding UCX operation, owned by the progress thread until its callback fires.
  struct Operation {
    UcxDataPlane* plane;
    std::shared_ptr<void> keepalive;
    std::vector<char> payload;   // header or error text that must outlive the send
    uint64_t chunk_request = 0;  // for receives: which chunk completes
    int64_t bytes = 0;
    PullCallback done;  // pushes: the sender's callback
    PushKey push_key;   // push receives: what arrived
  };

  void Run();  // progress thread
  void Post(std::function<void()> command);
  void Wake();
  void DrainCommands();
  void ServePending();
  void ReceivePending();
  void CheckDeadlines();
  // Frees endpoint-close requests that have completed.
  void ReapClosing();
  // Closes `ep` at the end of this turn of the progress loop, outside every UCX callback (UCX has
  // completed a request twice when an endpoint was closed from its own error callback). The
  // caller has already forgotten the endpoint: no new message is taken from it meanwhile.
  void CloseEndpoint(ucp_ep_h ep);
  void CloseDeferred();
  void CloseNow(ucp_ep_h ep);
  // Forgets a connection a peer opened and closes its endpoint (not proved in time, or the
  // oldest pending over a cap).
  void DropConnection(ucp_ep_h ep);
  // Closes the pending connections past their deadline; logs how many were shed, at most every
  // kShedLogInterval.
  void ShedPending(Clock::time_point now);
  void UpdatePendingStats(int64_t shed);
  void Shutdown();
  void CountRefused();
  // Receives and discards rendezvous data nobody wants any more.
  void DropRendezvous(void* descriptor, int64_t length);

  Result<ucp_ep_h> PeerEndpoint(const std::string& address);
  // Runs `then` once the peer is ready (authenticated and wired up), at once if it is, or with
  // the reason it never will be.
  void WhenReady(const std::string& address, std::function<void(const Status&)> then);
  void Settled(const std::string& address, const Status& status);
  // The peer behind an endpoint this process opened, and its address.
  Peer* PeerOfEndpoint(ucp_ep_h ep, std::string* address = nullptr);
  Peer* PeerOf(const std::string& address);
  // The authenticated connection behind an endpoint a peer opened, or null.
  Connection* AuthenticatedConnection(ucp_ep_h ep);
  void Refuse(ucp_ep_h ep, Connection& connection, const Status& reason);

  void IssueChunks(PullState& pull);
  void ChunkDone(uint64_t request, const Status& status, int64_t bytes);
  void FinishPull(uint64_t pull_id);
  void FailPullsTo(const std::string& address, const Status& reason);
  // `lend`: reply with the bytes' address for a same-host puller to read itself.
  void SendReply(ucp_ep_h ep, uint64_t request, const Status& status, const void* data,
                 int64_t length, std::shared_ptr<void> keepalive, bool lend = false);
  // Small control messages (handshake, lent chunks and pushes, acknowledgements), with an
  // optional payload (an error text).
  void SendControl(ucp_ep_h ep, uint16_t id, const void* header, size_t length,
                   std::string_view payload = {});
  void AcknowledgePush(const PushReceive& push, const Status& status);
  void ReceivePushes();
  void SendPush(const std::string& address, ucp_ep_h ep, const PushKey& key, const void* data,
                int64_t bytes, std::shared_ptr<void> keepalive, PullCallback done);

  static ucs_status_t OnChallenge(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnHello(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnWelcome(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnGetChunk(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnChunk(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnPush(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnChunkRead(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnPushRead(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static void OnPushSent(void* request, ucs_status_t status, void* user_data);
  static void OnPushReceived(void* request, ucs_status_t status, size_t length, void* user_data);
  static void OnConnection(ucp_conn_request_h request, void* arg);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void OnSendDone(void* request, ucs_status_t status, void* user_data);
  static void OnReceiveDone(void* request, ucs_status_t status, size_t length, void* user_data);

  const DataPlaneOptions options_;
  ObjectLookup lookup_;
  PushHandlers push_;
  std::string address_;
  Sha256Digest key_{};  // derived from the cluster token (data_plane_wire.h)
  WireProcess self_{};

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  int ucx_fd_ = -1;
  int event_fd_ = -1;
  int epoll_fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stopping_{false};

  Mutex command_mutex_;
  std::vector<std::function<void()>> commands_ GUARDED_BY(command_mutex_);

  // Progress-thread state.
  std::unordered_map<std::string, Peer> peers_;
  std::unordered_map<ucp_ep_h, std::string> peer_addresses_;  // open endpoint -> peers_ key
  std::unordered_map<ucp_ep_h, Connection> connections_;
  // The connections still proving the token, by endpoint (core/pending_connections.h).
  PendingConnections pending_;
  static constexpr std::chrono::seconds kShedLogInterval{10};
  int64_t shed_unlogged_ = 0;
  Clock::time_point shed_logged_{};
  std::vector<ucp_ep_h> to_close_;  // CloseEndpoint's, until CloseDeferred
  std::vector<void*> closing_;      // endpoint closes in progress
  std::unordered_map<uint64_t, PullState> pulls_;
  std::unordered_map<uint64_t, ChunkRequest> chunks_;
  std::vector<ServeRequest> serves_;
  std::vector<ReceiveRequest> receives_;
  std::vector<PushReceive> push_receives_;
  uint64_t next_pull_ = 1;
  uint64_t next_request_ = 1;
  uint64_t next_push_ = 1;
  std::map<std::pair<ucp_ep_h, uint64_t>, Loan> lent_chunks_;  // (puller's ep, request)
  std::unordered_map<uint64_t, LentPush> lent_pushes_;         // push id -> the lent push

  mutable Mutex stats_mutex_;
  DataPlaneStats stats_ GUARDED_BY(stats_mutex_);
};

}  // namespace tessera::detail

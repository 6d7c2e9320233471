// The UCX implementation of DataPlane (see data_plane.h for the protocol and threading).
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <thread>
#include <unordered_map>
#include <vector>

#include <ucp/api/ucp.h>

#include "core/transport/ucx_common.h"

#include "core/logging.h"
#include "core/thread_annotations.h"
#include "core/transport/data_plane.h"
#include "core/transport/data_plane_wire.h"
#include "core/transport/local_memory.h"

namespace tessera {

namespace {

using detail::UcxError;

using Clock = std::chrono::steady_clock;

using detail::kByAddress;
using detail::kChallenge;
using detail::kChunk;
using detail::kChunkRead;
using detail::kGetChunk;
using detail::kHello;
using detail::kMaxErrorText;
using detail::kPush;
using detail::kPushRead;
using detail::kWelcome;
using detail::kWireMagic;
using detail::kWireVersion;
using detail::Nonce;
using detail::WireProcess;

// Request parameters of an active-message send (`flags`: UCP_AM_SEND_FLAG_*) and of a receive
// of an active message's data, completing through `callback` with `user_data`, never inline.
// Every send names its endpoint to the receiver (REPLY): handlers act on who sent a message.
ucp_request_param_t AmSendParams(ucp_send_nbx_callback_t callback, void* user_data,
                                 uint32_t flags) {
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  params.cb.send = callback;
  params.user_data = user_data;
  params.flags = flags | UCP_AM_SEND_FLAG_REPLY;
  return params;
}
ucp_request_param_t AmReceiveParams(ucp_am_recv_data_nbx_callback_t callback, void* user_data) {
  ucp_request_param_t params{};
  params.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  params.cb.recv_am = callback;
  params.user_data = user_data;
  return params;
}

// The endpoint an active message came on (every sender sets REPLY), or null.
ucp_ep_h SenderOf(const ucp_am_recv_param_t* param) {
  return (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
}

// An error text carried in a reply's payload (never a rendezvous descriptor), cut to a bound.
std::string ErrorText(const void* data, size_t length, const ucp_am_recv_param_t* param) {
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return "(error text sent by rendezvous)";
  return std::string(static_cast<const char*>(data), std::min(length, kMaxErrorText));
}

Status WireStatus(int32_t code, std::string text) {
  return Status(static_cast<StatusCode>(detail::SanitizeWireStatus(code)), std::move(text));
}

Result<sockaddr_storage> Resolve(const std::string& host, uint16_t port, socklen_t* length) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int error = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &result);
  if (error != 0 || result == nullptr) {
    return Unavailable("cannot resolve data-plane host '{}': {}", host, gai_strerror(error));
  }
  sockaddr_storage storage{};
  std::memcpy(&storage, result->ai_addr, result->ai_addrlen);
  *length = result->ai_addrlen;
  ::freeaddrinfo(result);
  return storage;
}

Result<std::pair<std::string, uint16_t>> SplitAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return InvalidArgument("data-plane address '{}' is not HOST:PORT", address);
  }
  const int port = std::atoi(address.c_str() + colon + 1);
  if (port <= 0 || port > 65535) {
    return InvalidArgument("data-plane address '{}' has a bad port", address);
  }
  return std::make_pair(address.substr(0, colon), static_cast<uint16_t>(port));
}

class UcxDataPlane final : public DataPlane {
 public:
  UcxDataPlane(DataPlaneOptions options, ObjectLookup lookup, PushHandlers push)
      : options_(std::move(options)), lookup_(std::move(lookup)), push_(std::move(push)) {}
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
  // proved the token.
  struct Connection {
    Nonce nonce{};               // our challenge
    Clock::time_point deadline;  // to prove the token; then the endpoint is closed
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
    detail::GetChunkHeader header;
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
    detail::PushHeader header{};
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
  void CloseEndpoint(ucp_ep_h ep);
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
  std::vector<void*> closing_;  // endpoint closes in progress
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

Status UcxDataPlane::Init() {
  if (options_.token.empty()) {
    return InvalidArgument(
        "the data plane needs the cluster token (DataPlaneOptions::token): it serves only "
        "processes that prove they hold it");
  }
  key_ = detail::DataPlaneKey(options_.token);
  self_ = detail::ToWire(ThisProcess());
  // Without peer-failure mode, UCX aborts the process when a peer dies under a CMA transfer
  // (a worker killed while another pulls from it): CMA stays out unless UCX_TLS asks for it.
  TESSERA_ASSIGN_OR_RETURN(detail::UcxHandles handles,
                           detail::CreateUcxWorker(UCP_FEATURE_AM, "tessera", "^cma"));
  context_ = handles.context;
  worker_ = handles.worker;
  ucx_fd_ = handles.event_fd;

  for (auto [id, callback] :
       {std::pair{kChallenge, &OnChallenge}, std::pair{kHello, &OnHello},
        std::pair{kWelcome, &OnWelcome}, std::pair{kGetChunk, &OnGetChunk},
        std::pair{kChunk, &OnChunk}, std::pair{kPush, &OnPush}, std::pair{kChunkRead, &OnChunkRead},
        std::pair{kPushRead, &OnPushRead}}) {
    ucp_am_handler_param_t handler{};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                         UCP_AM_HANDLER_PARAM_FIELD_ARG;
    handler.id = id;
    handler.cb = callback;
    handler.arg = this;
    TESSERA_UCX_RETURN_IF_ERROR(ucp_worker_set_am_recv_handler(worker_, &handler),
                                "set active-message handler");
  }

  socklen_t length = 0;
  TESSERA_ASSIGN_OR_RETURN(sockaddr_storage bind_address,
                           Resolve(options_.host, options_.port, &length));
  ucp_listener_params_t listener_params{};
  listener_params.field_mask =
      UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  listener_params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&bind_address);
  listener_params.sockaddr.addrlen = length;
  listener_params.conn_handler.cb = &OnConnection;
  listener_params.conn_handler.arg = this;
  const ucs_status_t listen = ucp_listener_create(worker_, &listener_params, &listener_);
  if (listen != UCS_OK) {
    return Unavailable("data plane cannot listen on {}:{}: {}", options_.host, options_.port,
                       ucs_status_string(listen));
  }
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  TESSERA_UCX_RETURN_IF_ERROR(ucp_listener_query(listener_, &attr), "listener query");
  const uint16_t port = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
  address_ = fmt::format("{}:{}", options_.host, port);

  event_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (event_fd_ < 0 || epoll_fd_ < 0) return SystemError("eventfd/epoll_create1");
  for (int fd : {ucx_fd_, event_fd_}) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    TESSERA_SYSCALL_RETURN_IF_ERROR(::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event), "epoll_ctl");
  }
  thread_ = std::thread([this] { Run(); });
  return Status::Ok();
}

void UcxDataPlane::Run() {
  while (!stopping_.load()) {
    while (ucp_worker_progress(worker_) != 0) {
    }
    DrainCommands();
    ServePending();
    ReceivePending();
    ReceivePushes();
    CheckDeadlines();
    if (!serves_.empty() || !receives_.empty() || !push_receives_.empty()) continue;
    const ucs_status_t armed = ucp_worker_arm(worker_);
    if (armed == UCS_ERR_BUSY) continue;  // more events arrived: progress again
    epoll_event events[2];
    // Deadlines (pulls, handshakes, loans) are checked at least this often.
    const bool waiting = !pulls_.empty() || !connections_.empty() || !peers_.empty();
    ::epoll_wait(epoll_fd_, events, 2, waiting ? 50 : 500);
    uint64_t drained;
    while (::read(event_fd_, &drained, sizeof(drained)) > 0) {
    }
  }
}

void UcxDataPlane::Post(std::function<void()> command) {
  {
    MutexLock lock(&command_mutex_);
    commands_.push_back(std::move(command));
  }
  Wake();
}

void UcxDataPlane::Wake() {
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t written = ::write(event_fd_, &one, sizeof(one));
}

void UcxDataPlane::DrainCommands() {
  std::vector<std::function<void()>> commands;
  {
    MutexLock lock(&command_mutex_);
    commands.swap(commands_);
  }
  for (auto& command : commands) command();
}

void UcxDataPlane::CountRefused() {
  MutexLock lock(&stats_mutex_);
  ++stats_.refused;
}

// ---- Handshake ----

void UcxDataPlane::OnConnection(ucp_conn_request_h request, void* arg) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.conn_request = request;
  params.err_handler.cb = &OnEndpointError;
  params.err_handler.arg = self;
  if (self->options_.detect_peer_failure) {
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  }
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(self->worker_, &params, &ep) != UCS_OK) return;
  Connection& connection = self->connections_[ep];
  connection.deadline = Clock::now() + std::chrono::milliseconds(self->options_.pull_timeout_ms);
  if (const Status random = FillRandom(connection.nonce); !random.ok()) {
    GetLogger("data_plane")->error("refusing a data-plane connection: {}", random.ToString());
    connection.refused = true;  // closed at its deadline
    return;
  }
  const detail::ChallengeHeader challenge{kWireMagic, kWireVersion, connection.nonce, self->self_};
  self->SendControl(ep, kChallenge, &challenge, sizeof(challenge));
}

ucs_status_t UcxDataPlane::OnChallenge(void* arg, const void* header, size_t header_length,
                                       void* /*data*/, size_t /*length*/,
                                       const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  std::string address;
  Peer* peer = self->PeerOfEndpoint(SenderOf(param), &address);
  if (peer == nullptr || peer->challenged || header_length != sizeof(detail::ChallengeHeader)) {
    self->CountRefused();
    return UCS_OK;
  }
  detail::ChallengeHeader challenge;
  std::memcpy(&challenge, header, sizeof(challenge));
  if (challenge.magic != kWireMagic || challenge.version != kWireVersion) {
    self->FailPullsTo(address,
                      InvalidArgument("data-plane peer {} speaks protocol version {}, this process "
                                      "{}: are both the same Tessera build?",
                                      address, challenge.version, kWireVersion));
    return UCS_OK;
  }
  peer->challenged = true;
  peer->holder_nonce = challenge.nonce;
  peer->holder = challenge.holder;
  if (const Status random = FillRandom(peer->nonce); !random.ok()) {
    self->FailPullsTo(address, random);
    return UCS_OK;
  }
  const detail::HelloHeader hello{kWireMagic, kWireVersion, peer->nonce, self->self_,
                                  detail::HandshakeProof(self->key_, "client", peer->holder_nonce,
                                                         peer->nonce, peer->holder, self->self_)};
  self->SendControl(peer->ep, kHello, &hello, sizeof(hello));
  return UCS_OK;
}

ucs_status_t UcxDataPlane::OnHello(void* arg, const void* header, size_t header_length,
                                   void* /*data*/, size_t /*length*/,
                                   const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  const ucp_ep_h ep = SenderOf(param);
  auto it = self->connections_.find(ep);
  if (it == self->connections_.end() || it->second.authenticated || it->second.refused) {
    self->CountRefused();
    return UCS_OK;
  }
  Connection& connection = it->second;
  detail::HelloHeader hello{};
  if (header_length != sizeof(hello)) {
    self->Refuse(ep, connection, InvalidArgument("malformed data-plane hello"));
    return UCS_OK;
  }
  std::memcpy(&hello, header, sizeof(hello));
  if (hello.magic != kWireMagic || hello.version != kWireVersion) {
    self->Refuse(ep, connection,
                 InvalidArgument("data-plane protocol version {} asked of {}, which speaks {}: "
                                 "are both the same Tessera build?",
                                 hello.version, self->address_, kWireVersion));
    return UCS_OK;
  }
  const Sha256Digest expected = detail::HandshakeProof(self->key_, "client", connection.nonce,
                                                       hello.nonce, self->self_, hello.client);
  if (!ConstantTimeEquals(expected, hello.proof)) {
    GetLogger("data_plane")
        ->warn("refused a data-plane peer (pid {} by its own account): invalid cluster token",
               hello.client.pid);
    self->Refuse(ep, connection,
                 Unavailable("invalid cluster token: the data plane at {} serves only processes "
                             "of its cluster (pass the token the head printed)",
                             self->address_));
    return UCS_OK;
  }
  connection.authenticated = true;
  connection.client = hello.client;
  connection.reads_client = CanReadMemoryOf(detail::FromWire(hello.client));
  const detail::WelcomeHeader welcome{
      0, connection.reads_client ? 1u : 0u,
      detail::HandshakeProof(self->key_, "holder", connection.nonce, hello.nonce, self->self_,
                             hello.client)};
  self->SendControl(ep, kWelcome, &welcome, sizeof(welcome));
  return UCS_OK;
}

void UcxDataPlane::Refuse(ucp_ep_h ep, Connection& connection, const Status& reason) {
  CountRefused();
  connection.refused = true;  // the endpoint is closed at its deadline, after the answer went out
  const detail::WelcomeHeader welcome{static_cast<int32_t>(reason.code()), 0, {}};
  SendControl(ep, kWelcome, &welcome, sizeof(welcome),
              std::string_view(reason.message()).substr(0, kMaxErrorText));
}

ucs_status_t UcxDataPlane::OnWelcome(void* arg, const void* header, size_t header_length,
                                     void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  std::string address;
  Peer* peer = self->PeerOfEndpoint(SenderOf(param), &address);
  if (peer == nullptr || !peer->challenged || peer->stage != Peer::Stage::kHandshake ||
      header_length != sizeof(detail::WelcomeHeader)) {
    self->CountRefused();
    return UCS_OK;
  }
  detail::WelcomeHeader welcome;
  std::memcpy(&welcome, header, sizeof(welcome));
  if (welcome.status != 0) {
    self->FailPullsTo(address, WireStatus(welcome.status, ErrorText(data, length, param))
                                   .WithContext(fmt::format("data-plane peer {}", address)));
    return UCS_OK;
  }
  const Sha256Digest expected = detail::HandshakeProof(self->key_, "holder", peer->holder_nonce,
                                                       peer->nonce, peer->holder, self->self_);
  if (!ConstantTimeEquals(expected, welcome.proof)) {
    self->FailPullsTo(address, Unavailable("data-plane peer {} did not prove it holds the cluster "
                                           "token: nothing is taken from or sent to it",
                                           address));
    return UCS_OK;
  }
  peer->reads_peer = CanReadMemoryOf(detail::FromWire(peer->holder));
  peer->peer_reads_us = welcome.can_read_you != 0;
  peer->stage = Peer::Stage::kWiring;
  // A flush completes once wire-up has; it never blocks the progress thread.
  struct FlushDone {
    UcxDataPlane* plane;
    std::string address;
  };
  ucp_request_param_t params{};
  params.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  params.cb.send = [](void* request, ucs_status_t status, void* user_data) {
    std::unique_ptr<FlushDone> done(static_cast<FlushDone*>(user_data));
    done->plane->Settled(done->address,
                         status == UCS_OK ? Status::Ok() : UcxError("endpoint wire-up", status));
    ucp_request_free(request);
  };
  params.user_data = new FlushDone{self, address};
  ucs_status_ptr_t flushing = ucp_ep_flush_nbx(peer->ep, &params);
  if (UCS_PTR_IS_ERR(flushing)) {
    delete static_cast<FlushDone*>(params.user_data);
    self->Settled(address, UcxError("endpoint wire-up", UCS_PTR_STATUS(flushing)));
  }
  return UCS_OK;
}

void UcxDataPlane::Settled(const std::string& address, const Status& status) {
  Peer* peer = PeerOf(address);
  if (peer == nullptr || !peer->failure.ok()) return;  // failed meanwhile: waiters were told
  if (!status.ok()) return FailPullsTo(address, status);
  peer->stage = Peer::Stage::kReady;
  std::vector<std::function<void(const Status&)>> waiting;
  waiting.swap(peer->waiting);
  for (auto& then : waiting) then(Status::Ok());
}

UcxDataPlane::Peer* UcxDataPlane::PeerOfEndpoint(ucp_ep_h ep, std::string* address) {
  if (ep == nullptr) return nullptr;
  auto it = peer_addresses_.find(ep);
  if (it == peer_addresses_.end()) return nullptr;
  if (address != nullptr) *address = it->second;
  return PeerOf(it->second);
}

UcxDataPlane::Peer* UcxDataPlane::PeerOf(const std::string& address) {
  auto it = peers_.find(address);
  return it == peers_.end() ? nullptr : &it->second;
}

UcxDataPlane::Connection* UcxDataPlane::AuthenticatedConnection(ucp_ep_h ep) {
  if (ep == nullptr) return nullptr;
  auto it = connections_.find(ep);
  return it != connections_.end() && it->second.authenticated ? &it->second : nullptr;
}

void UcxDataPlane::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  std::string address;
  if (Peer* peer = self->PeerOfEndpoint(ep, &address); peer != nullptr && peer->failure.ok()) {
    self->FailPullsTo(
        address, Unavailable("data-plane peer {} failed: {}", address, ucs_status_string(status)));
  }
}

// ---- Serving (the holder's side) ----

ucs_status_t UcxDataPlane::OnGetChunk(void* arg, const void* header, size_t header_length,
                                      void* /*data*/, size_t /*length*/,
                                      const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  const ucp_ep_h ep = SenderOf(param);
  if (header_length != sizeof(detail::GetChunkHeader) || !self->connections_.contains(ep)) {
    self->CountRefused();
    return UCS_OK;  // malformed, or not from a connection to this process: drop it
  }
  ServeRequest serve;
  serve.reply_ep = ep;
  std::memcpy(&serve.header, header, sizeof(serve.header));
  if (self->AuthenticatedConnection(ep) == nullptr) {
    self->CountRefused();
    self->SendReply(ep, serve.header.request,
                    Unavailable("the data plane at {} serves only processes of its cluster: "
                                "prove the cluster token first",
                                self->address_),
                    nullptr, 0, nullptr);
    return UCS_OK;
  }
  self->serves_.push_back(serve);  // answered from the progress loop, not inside the callback
  return UCS_OK;
}

void UcxDataPlane::ServePending() {
  std::vector<ServeRequest> serves;
  serves.swap(serves_);
  for (const ServeRequest& serve : serves) {
    const detail::GetChunkHeader& h = serve.header;
    Result<ServedObject> object = lookup_(ObjectId(h.object));
    if (!object.ok()) {
      SendReply(serve.reply_ep, h.request, object.status(), nullptr, 0, nullptr);
      continue;
    }
    // [offset, offset + length) must lie in [0, bytes); written so that nothing can overflow.
    if (h.offset < 0 || h.length < 0 || h.offset > object->bytes ||
        h.length > object->bytes - h.offset) {
      CountRefused();
      SendReply(serve.reply_ep, h.request,
                InvalidArgument("chunk [{}, +{}) is outside obj{} of {} bytes", h.offset, h.length,
                                h.object, object->bytes),
                nullptr, 0, nullptr);
      continue;
    }
    SendReply(serve.reply_ep, h.request, Status::Ok(),
              static_cast<const char*>(object->data) + h.offset, h.length,
              std::move(object->keepalive), /*lend=*/(h.flags & kByAddress) != 0);
    MutexLock lock(&stats_mutex_);
    stats_.bytes_served += h.length;
    ++stats_.serves;
  }
}

void UcxDataPlane::SendReply(ucp_ep_h ep, uint64_t request, const Status& status, const void* data,
                             int64_t length, std::shared_ptr<void> keepalive, bool lend) {
  if (status.ok() && lend) {
    // Lend the chunk: the puller reads it from here and says when; keep it alive till then.
    lent_chunks_[{ep, request}] = Loan{
        std::move(keepalive), Clock::now() + std::chrono::milliseconds(options_.pull_timeout_ms)};
    const detail::ChunkHeader header{request, 0, kByAddress, length,
                                     reinterpret_cast<uint64_t>(data)};
    SendControl(ep, kChunk, &header, sizeof(header));
    return;
  }
  if (!status.ok()) {
    // No bytes of any object: the header says the error and the payload is its text.
    const std::string_view text = std::string_view(status.message()).substr(0, kMaxErrorText);
    const detail::ChunkHeader header{request, static_cast<int32_t>(status.code()), 0,
                                     static_cast<int64_t>(text.size()), 0};
    SendControl(ep, kChunk, &header, sizeof(header), text);
    return;
  }
  auto* operation = new Operation{this, std::move(keepalive), {}, 0, length};
  const detail::ChunkHeader header{request, 0, 0, length, 0};
  operation->payload.resize(sizeof(header));
  std::memcpy(operation->payload.data(), &header, sizeof(header));
  ucp_request_param_t params =
      AmSendParams(&OnSendDone, operation, length > 0 ? UCP_AM_SEND_FLAG_RNDV : 0);
  ucs_status_ptr_t sent = ucp_am_send_nbx(ep, kChunk, operation->payload.data(), sizeof(header),
                                          data, static_cast<size_t>(length), &params);
  if (UCS_PTR_IS_ERR(sent)) {
    GetLogger("data_plane")->warn("reply send failed: {}", ucs_status_string(UCS_PTR_STATUS(sent)));
    delete operation;
  }
}

ucs_status_t UcxDataPlane::OnChunkRead(void* arg, const void* header, size_t header_length,
                                       void* /*data*/, size_t /*length*/,
                                       const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  const ucp_ep_h ep = SenderOf(param);
  if (header_length != sizeof(detail::ChunkReadHeader) ||
      self->AuthenticatedConnection(ep) == nullptr) {
    self->CountRefused();
    return UCS_OK;
  }
  detail::ChunkReadHeader read;
  std::memcpy(&read, header, sizeof(read));
  self->lent_chunks_.erase({ep, read.request});  // releases the object
  return UCS_OK;
}

// ---- Pulling (the puller's side) ----

void UcxDataPlane::Pull(const std::string& address, ObjectId object, void* dest, int64_t bytes,
                        PullCallback done) {
  Post([this, address, object, dest, bytes, done = std::move(done)]() mutable {
    const uint64_t id = next_pull_++;
    PullState& pull = pulls_[id];
    pull.id = id;
    pull.address = address;
    pull.object = object;
    pull.dest = static_cast<char*>(dest);
    pull.bytes = bytes;
    pull.started = Clock::now();
    pull.deadline = pull.started + std::chrono::milliseconds(options_.pull_timeout_ms);
    pull.done = std::move(done);
    if (bytes <= 0) {
      if (bytes < 0) pull.error = InvalidArgument("a pull of {} bytes", bytes);
      return FinishPull(id);  // nothing to move: no peer is asked
    }
    WhenReady(address, [this, id](const Status& ready) {
      auto it = pulls_.find(id);
      if (it == pulls_.end()) return;  // already failed (its deadline)
      if (!ready.ok() && it->second.error.ok()) it->second.error = ready;
      IssueChunks(it->second);
      if (it->second.outstanding == 0) FinishPull(id);
    });
  });
}

void UcxDataPlane::IssueChunks(PullState& pull) {
  while (pull.error.ok() && pull.next_offset < pull.bytes &&
         pull.outstanding < options_.chunks_in_flight) {
    const Peer* holder = PeerOf(pull.address);
    if (holder == nullptr || !holder->failure.ok() || holder->ep == nullptr) {
      pull.error = holder != nullptr && !holder->failure.ok()
                       ? holder->failure
                       : Unavailable("no endpoint to data-plane peer {}", pull.address);
      return;
    }
    const int64_t length = std::min(options_.chunk_bytes, pull.bytes - pull.next_offset);
    const uint64_t request = next_request_++;
    const bool lend = holder->reads_peer;
    chunks_[request] = ChunkRequest{pull.id, pull.next_offset, length, lend};
    auto* operation = new Operation{this, nullptr, {}, 0, 0};
    operation->payload.resize(sizeof(detail::GetChunkHeader));
    const detail::GetChunkHeader header{request, pull.object.value(),   pull.next_offset,
                                        length,  lend ? kByAddress : 0, 0};
    std::memcpy(operation->payload.data(), &header, sizeof(header));
    ucp_request_param_t params = AmSendParams(&OnSendDone, operation, 0);
    ucs_status_ptr_t sent = ucp_am_send_nbx(holder->ep, kGetChunk, operation->payload.data(),
                                            sizeof(header), nullptr, 0, &params);
    if (UCS_PTR_IS_ERR(sent)) {
      delete operation;
      chunks_.erase(request);
      pull.error = UcxError("chunk request", UCS_PTR_STATUS(sent));
      return;
    }
    pull.next_offset += length;
    ++pull.outstanding;
  }
}

ucs_status_t UcxDataPlane::OnChunk(void* arg, const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  if (header_length != sizeof(detail::ChunkHeader)) {
    self->CountRefused();
    return UCS_OK;
  }
  detail::ChunkHeader chunk_header;
  std::memcpy(&chunk_header, header, sizeof(chunk_header));
  auto chunk = self->chunks_.find(chunk_header.request);
  // A reply for a pull that already failed (deadline, forgotten peer): its data is dropped.
  if (chunk == self->chunks_.end()) return UCS_OK;
  const ChunkRequest asked = chunk->second;
  PullState& owner = self->pulls_.at(asked.pull);
  Peer* holder = self->PeerOf(owner.address);
  if (holder == nullptr || holder->ep == nullptr || holder->ep != SenderOf(param) ||
      holder->stage != Peer::Stage::kReady) {
    self->CountRefused();  // a reply from someone other than the holder asked
    return UCS_OK;
  }
  const uint64_t request = chunk_header.request;
  if (chunk_header.status != 0) {
    self->ChunkDone(request, WireStatus(chunk_header.status, ErrorText(data, length, param)), 0);
    return UCS_OK;
  }
  if ((chunk_header.flags & kByAddress) != 0) {
    if (!asked.lent || chunk_header.length != asked.length) {
      self->ChunkDone(request,
                      DataLoss("the holder lent a chunk of {} bytes, not the {}-byte "
                               "chunk asked for{}",
                               chunk_header.length, asked.length,
                               asked.lent ? "" : " (this process asked for the bytes)"),
                      0);
      return UCS_OK;
    }
    // A lent chunk: copy it out of the holder's memory, then tell the holder it may let go. The
    // process read is the one the handshake named, never one a reply names.
    const int error = ReadMemoryOf(holder->holder.pid, chunk_header.address,
                                   owner.dest + asked.offset, asked.length);
    const detail::ChunkReadHeader read{request};
    self->SendControl(holder->ep, kChunkRead, &read, sizeof(read));
    self->ChunkDone(request,
                    error == 0
                        ? Status::Ok()
                        : Unavailable("the holder (pid {}) vanished while lending a chunk: {}",
                                      holder->holder.pid, std::strerror(error)),
                    error == 0 ? asked.length : 0);
    return UCS_OK;
  }
  if (static_cast<int64_t>(length) != asked.length || chunk_header.length != asked.length) {
    self->ChunkDone(request,
                    DataLoss("peer sent {} bytes for a {}-byte chunk", length, asked.length), 0);
    return UCS_OK;
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    self->receives_.push_back(ReceiveRequest{request, data, static_cast<int64_t>(length)});
    return UCS_INPROGRESS;
  }
  // Eager: the bytes are here already.
  std::memcpy(owner.dest + asked.offset, data, length);
  self->ChunkDone(request, Status::Ok(), static_cast<int64_t>(length));
  return UCS_OK;
}

void UcxDataPlane::OnSendDone(void* request, ucs_status_t /*status*/, void* user_data) {
  // The bytes (or the error text) may be released now; a failed send surfaces on the puller.
  delete static_cast<Operation*>(user_data);
  ucp_request_free(request);
}

void UcxDataPlane::OnReceiveDone(void* request, ucs_status_t status, size_t length,
                                 void* user_data) {
  auto* operation = static_cast<Operation*>(user_data);
  operation->plane->ChunkDone(operation->chunk_request,
                              status == UCS_OK ? Status::Ok() : UcxError("chunk receive", status),
                              static_cast<int64_t>(length));
  delete operation;
  ucp_request_free(request);
}

void UcxDataPlane::ReceivePending() {
  std::vector<ReceiveRequest> receives;
  receives.swap(receives_);
  for (const ReceiveRequest& receive : receives) {
    auto chunk = chunks_.find(receive.request);
    if (chunk == chunks_.end()) {
      DropRendezvous(receive.descriptor, receive.length);  // the pull already failed
      continue;
    }
    PullState& pull = pulls_.at(chunk->second.pull);
    auto* operation = new Operation{this, nullptr, {}, receive.request, receive.length};
    ucp_request_param_t params = AmReceiveParams(&OnReceiveDone, operation);
    ucs_status_ptr_t started =
        ucp_am_recv_data_nbx(worker_, receive.descriptor, pull.dest + chunk->second.offset,
                             static_cast<size_t>(receive.length), &params);
    if (UCS_PTR_IS_ERR(started)) {
      delete operation;
      ChunkDone(receive.request, UcxError("chunk receive", UCS_PTR_STATUS(started)), 0);
    }
  }
}

void UcxDataPlane::DropRendezvous(void* descriptor, int64_t length) {
  // Received into a scratch buffer and thrown away: releasing a rendezvous descriptor unreceived
  // does not complete the sender's request in every UCX version.
  auto* scratch =
      new Operation{this, nullptr, std::vector<char>(static_cast<size_t>(length)), 0, length};
  ucp_request_param_t params = AmReceiveParams(
      [](void* request, ucs_status_t, size_t, void* user_data) {
        delete static_cast<Operation*>(user_data);
        ucp_request_free(request);
      },
      scratch);
  ucs_status_ptr_t started = ucp_am_recv_data_nbx(worker_, descriptor, scratch->payload.data(),
                                                  static_cast<size_t>(length), &params);
  if (UCS_PTR_IS_ERR(started)) delete scratch;
}

void UcxDataPlane::ChunkDone(uint64_t request, const Status& status, int64_t bytes) {
  auto chunk = chunks_.find(request);
  if (chunk == chunks_.end()) return;
  const uint64_t pull_id = chunk->second.pull;
  chunks_.erase(chunk);
  auto it = pulls_.find(pull_id);
  if (it == pulls_.end()) return;
  PullState& pull = it->second;
  --pull.outstanding;
  if (!status.ok() && pull.error.ok()) pull.error = status;
  if (status.ok()) {
    MutexLock lock(&stats_mutex_);
    stats_.bytes_pulled += bytes;
  }
  IssueChunks(pull);
  if (pull.outstanding == 0 && (pull.next_offset >= pull.bytes || !pull.error.ok())) {
    FinishPull(pull_id);
  }
}

void UcxDataPlane::FinishPull(uint64_t pull_id) {
  auto it = pulls_.find(pull_id);
  if (it == pulls_.end()) return;
  PullState pull = std::move(it->second);
  pulls_.erase(it);
  // Forget chunks still outstanding (a failed pull): late replies are dropped by OnChunk.
  for (auto chunk = chunks_.begin(); chunk != chunks_.end();) {
    chunk = chunk->second.pull == pull_id ? chunks_.erase(chunk) : std::next(chunk);
  }
  if (pull.error.ok()) {
    MutexLock lock(&stats_mutex_);
    ++stats_.pulls;
    stats_.pull_micros +=
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - pull.started).count();
  }
  Status result =
      pull.error.ok()
          ? Status::Ok()
          : pull.error.WithContext(fmt::format("pulling {} ({} bytes) from {}",
                                               pull.object.ToString(), pull.bytes, pull.address));
  pull.done(result);
}

// ---- Pushing ----

void UcxDataPlane::Push(const std::string& address, const PushKey& key, const void* data,
                        int64_t bytes, std::shared_ptr<void> keepalive, PullCallback done) {
  Post([this, address, key, data, bytes, keepalive = std::move(keepalive),
        done = std::move(done)]() mutable {
    WhenReady(address, [this, address, key, data, bytes, keepalive = std::move(keepalive),
                        done = std::move(done)](const Status& ready) mutable {
      if (!ready.ok()) return done(ready);
      SendPush(address, peers_.at(address).ep, key, data, bytes, std::move(keepalive),
               std::move(done));
    });
  });
}

void UcxDataPlane::SendPush(const std::string& address, ucp_ep_h ep, const PushKey& key,
                            const void* data, int64_t bytes, std::shared_ptr<void> keepalive,
                            PullCallback done) {
  const Peer& peer = peers_.at(address);
  const uint64_t push_id = next_push_++;
  const detail::WirePushKey wire_key{key.graph, key.instance, key.object};
  if (peer.peer_reads_us && bytes > 0) {
    // Lend it: the receiver reads it from here and acknowledges (OnPushRead).
    lent_pushes_[push_id] =
        LentPush{address, std::move(keepalive), std::move(done), bytes,
                 Clock::now() + std::chrono::milliseconds(options_.pull_timeout_ms)};
    const detail::PushHeader header{wire_key,   bytes, push_id, reinterpret_cast<uint64_t>(data),
                                    kByAddress, 0};
    SendControl(ep, kPush, &header, sizeof(header));
    return;
  }
  auto* operation = new Operation{this, std::move(keepalive), {}, 0, bytes};
  operation->done = std::move(done);
  operation->payload.resize(sizeof(detail::PushHeader));
  const detail::PushHeader header{wire_key, bytes, push_id, 0, 0, 0};
  std::memcpy(operation->payload.data(), &header, sizeof(header));
  // No forced rendezvous here: UCX 1.13 asserts when a fresh client endpoint is forced into it
  // before wire-up completes. It picks rendezvous for large messages by itself.
  ucp_request_param_t params = AmSendParams(&OnPushSent, operation, 0);
  ucs_status_ptr_t sent = ucp_am_send_nbx(ep, kPush, operation->payload.data(), sizeof(header),
                                          data, static_cast<size_t>(bytes), &params);
  if (UCS_PTR_IS_ERR(sent)) {
    PullCallback failed = std::move(operation->done);
    delete operation;
    failed(UcxError("push send", UCS_PTR_STATUS(sent)));
  }
}

void UcxDataPlane::OnPushSent(void* request, ucs_status_t status, void* user_data) {
  auto* operation = static_cast<Operation*>(user_data);
  if (operation->done) {
    operation->done(status == UCS_OK ? Status::Ok() : UcxError("push send", status));
  }
  if (status == UCS_OK) {
    MutexLock lock(&operation->plane->stats_mutex_);
    operation->plane->stats_.bytes_served += operation->bytes;
  }
  delete operation;
  ucp_request_free(request);
}

ucs_status_t UcxDataPlane::OnPush(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  const ucp_ep_h ep = SenderOf(param);
  const Connection* connection = self->AuthenticatedConnection(ep);
  const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (connection == nullptr || header_length != sizeof(detail::PushHeader) || !self->push_.accept) {
    // Not from a member of the cluster (or malformed): nothing is delivered, and a rendezvous
    // sender's send fails.
    self->CountRefused();
    return rendezvous ? UCS_ERR_REJECTED : UCS_OK;
  }
  detail::PushHeader push;
  std::memcpy(&push, header, sizeof(push));
  const PushKey key{push.key.graph, push.key.instance, push.key.object};
  PushReceive receive{key, nullptr, push.length, ep, push};
  if (push.length < 0) {
    self->push_.delivered(key, InvalidArgument("a push of {} bytes", push.length));
    return rendezvous ? UCS_ERR_REJECTED : UCS_OK;
  }
  if (push.flags & kByAddress) {
    if (!connection->reads_client) {
      const Status refused = InvalidArgument("a push lent by a process this one cannot read");
      self->AcknowledgePush(receive, refused);
      self->push_.delivered(key, refused);
      return UCS_OK;
    }
    // A lent push: read it in the progress loop (accept may take locks), from the process the
    // handshake named.
    receive.sender_pid = connection->client.pid;
    self->push_receives_.push_back(receive);
    return UCS_OK;
  }
  if (push.length != static_cast<int64_t>(length)) {
    self->push_.delivered(key, DataLoss("push of {} bytes announced {}", length, push.length));
    return rendezvous ? UCS_ERR_REJECTED : UCS_OK;
  }
  if (rendezvous) {
    receive.descriptor = data;
    self->push_receives_.push_back(receive);
    return UCS_INPROGRESS;
  }
  Result<void*> dest = self->push_.accept(key, push.length);
  if (!dest.ok()) {
    self->push_.delivered(key, dest.status());
    return UCS_OK;
  }
  if (length > 0) std::memcpy(*dest, data, length);
  self->push_.delivered(key, Status::Ok());
  return UCS_OK;
}

void UcxDataPlane::ReceivePushes() {
  std::vector<PushReceive> pushes;
  pushes.swap(push_receives_);
  for (const PushReceive& push : pushes) {
    if (push.descriptor == nullptr) {  // lent: copy it out of the sender's memory
      Result<void*> dest = push_.accept(push.key, push.length);
      Status status = dest.status();
      if (status.ok()) {
        const int error = ReadMemoryOf(push.sender_pid, push.header.address, *dest, push.length);
        if (error != 0) {
          status = Unavailable("the sender (pid {}) vanished while lending a push: {}",
                               push.sender_pid, std::strerror(error));
        } else {
          MutexLock lock(&stats_mutex_);
          stats_.bytes_pulled += push.length;
        }
      }
      AcknowledgePush(push, status);
      push_.delivered(push.key, status);
      continue;
    }
    Result<void*> dest = push_.accept(push.key, push.length);
    if (!dest.ok()) {
      DropRendezvous(push.descriptor, push.length);
      push_.delivered(push.key, dest.status());
      continue;
    }
    auto* operation = new Operation{this, nullptr, {}, 0, push.length};
    operation->push_key = push.key;
    ucp_request_param_t params = AmReceiveParams(&OnPushReceived, operation);
    ucs_status_ptr_t started = ucp_am_recv_data_nbx(worker_, push.descriptor, *dest,
                                                    static_cast<size_t>(push.length), &params);
    if (UCS_PTR_IS_ERR(started)) {
      delete operation;
      push_.delivered(push.key, UcxError("push receive", UCS_PTR_STATUS(started)));
    }
  }
}

void UcxDataPlane::OnPushReceived(void* request, ucs_status_t status, size_t length,
                                  void* user_data) {
  auto* operation = static_cast<Operation*>(user_data);
  UcxDataPlane* self = operation->plane;
  self->push_.delivered(operation->push_key,
                        status == UCS_OK ? Status::Ok() : UcxError("push receive", status));
  {
    MutexLock lock(&self->stats_mutex_);
    self->stats_.bytes_pulled += static_cast<int64_t>(length);
  }
  delete operation;
  ucp_request_free(request);
}

void UcxDataPlane::AcknowledgePush(const PushReceive& push, const Status& status) {
  const detail::PushReadHeader ack{push.header.push_id, static_cast<int32_t>(status.code()), 0};
  SendControl(push.reply_ep, kPushRead, &ack, sizeof(ack));
}

ucs_status_t UcxDataPlane::OnPushRead(void* arg, const void* header, size_t header_length,
                                      void* /*data*/, size_t /*length*/,
                                      const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  if (header_length != sizeof(detail::PushReadHeader)) {
    self->CountRefused();
    return UCS_OK;
  }
  detail::PushReadHeader ack;
  std::memcpy(&ack, header, sizeof(ack));
  auto lent = self->lent_pushes_.find(ack.push_id);
  if (lent == self->lent_pushes_.end()) return UCS_OK;
  const Peer* receiver = self->PeerOf(lent->second.address);
  if (receiver == nullptr || receiver->ep == nullptr || receiver->ep != SenderOf(param)) {
    self->CountRefused();  // only the receiver of a push may say it is done with it
    return UCS_OK;
  }
  LentPush push = std::move(lent->second);
  self->lent_pushes_.erase(lent);
  const Status status =
      ack.status == 0
          ? Status::Ok()
          : WireStatus(ack.status,
                       fmt::format("the receiver could not read the push from {}", self->address_));
  if (status.ok()) {
    MutexLock lock(&self->stats_mutex_);
    self->stats_.bytes_served += push.bytes;
  }
  push.done(status);
  return UCS_OK;
}

// ---- Endpoints, deadlines, shutdown ----

void UcxDataPlane::SendControl(ucp_ep_h ep, uint16_t id, const void* header, size_t length,
                               std::string_view payload) {
  auto* operation = new Operation{this, nullptr, {}, 0, 0};
  operation->payload.assign(static_cast<const char*>(header),
                            static_cast<const char*>(header) + length);
  operation->payload.insert(operation->payload.end(), payload.begin(), payload.end());
  ucp_request_param_t params = AmSendParams(&OnSendDone, operation, 0);
  ucs_status_ptr_t sent =
      ucp_am_send_nbx(ep, id, operation->payload.data(), length, operation->payload.data() + length,
                      payload.size(), &params);
  if (UCS_PTR_IS_ERR(sent)) {
    GetLogger("data_plane")
        ->warn("control message {} failed: {}", id, ucs_status_string(UCS_PTR_STATUS(sent)));
    delete operation;
  }
}

Result<ucp_ep_h> UcxDataPlane::PeerEndpoint(const std::string& address) {
  auto it = peers_.find(address);
  if (it != peers_.end()) {
    if (!it->second.failure.ok()) return it->second.failure;
    return it->second.ep;
  }
  TESSERA_ASSIGN_OR_RETURN(auto host_port, SplitAddress(address));
  socklen_t length = 0;
  TESSERA_ASSIGN_OR_RETURN(sockaddr_storage peer_address,
                           Resolve(host_port.first, host_port.second, &length));
  ucp_ep_params_t params{};
  params.field_mask =
      UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&peer_address);
  params.sockaddr.addrlen = length;
  params.err_handler.cb = &OnEndpointError;
  params.err_handler.arg = this;
  if (options_.detect_peer_failure) {
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  }
  ucp_ep_h ep = nullptr;
  const ucs_status_t created = ucp_ep_create(worker_, &params, &ep);
  if (created != UCS_OK) {
    return Unavailable("cannot reach data-plane peer {}: {}", address, ucs_status_string(created));
  }
  Peer& peer = peers_[address];
  peer.ep = ep;
  peer.deadline = Clock::now() + std::chrono::milliseconds(options_.pull_timeout_ms);
  peer_addresses_[ep] = address;
  return ep;  // the peer speaks first: its challenge (OnChallenge)
}

void UcxDataPlane::WhenReady(const std::string& address, std::function<void(const Status&)> then) {
  Result<ucp_ep_h> ep = PeerEndpoint(address);
  if (!ep.ok()) return then(ep.status());
  Peer& peer = peers_.at(address);
  if (peer.stage == Peer::Stage::kReady) return then(Status::Ok());
  peer.waiting.push_back(std::move(then));
}

void UcxDataPlane::CloseEndpoint(ucp_ep_h ep) {
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  params.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t closing = ucp_ep_close_nbx(ep, &params);
  // Completed later by progress; the worker must not be destroyed before (UCX asserts).
  if (closing != nullptr && !UCS_PTR_IS_ERR(closing)) closing_.push_back(closing);
}

void UcxDataPlane::FailPullsTo(const std::string& address, const Status& reason) {
  Peer& peer = peers_[address];
  if (peer.failure.ok()) peer.failure = reason;
  if (peer.ep != nullptr) {
    peer_addresses_.erase(peer.ep);
    CloseEndpoint(peer.ep);
    peer.ep = nullptr;
  }
  std::vector<std::function<void(const Status&)>> waiting;
  waiting.swap(peer.waiting);
  for (auto& then : waiting) then(reason);
  std::vector<uint64_t> failed;
  for (auto& [id, pull] : pulls_) {
    if (pull.address == address) {
      if (pull.error.ok()) pull.error = reason;
      failed.push_back(id);
    }
  }
  for (uint64_t id : failed) FinishPull(id);
}

void UcxDataPlane::ForgetPeer(const std::string& address, const Status& reason) {
  Post([this, address, reason] { FailPullsTo(address, reason); });
}

void UcxDataPlane::ReapClosing() {
  std::erase_if(closing_, [](void* request) {
    if (ucp_request_check_status(request) == UCS_INPROGRESS) return false;
    ucp_request_free(request);
    return true;
  });
}

void UcxDataPlane::CheckDeadlines() {
  if (!closing_.empty()) ReapClosing();
  const Clock::time_point now = Clock::now();
  // Connections that never proved the token (or were refused): close them.
  std::vector<ucp_ep_h> unproven;
  for (const auto& [ep, connection] : connections_) {
    if (!connection.authenticated && now > connection.deadline) unproven.push_back(ep);
  }
  for (ucp_ep_h ep : unproven) {
    connections_.erase(ep);
    CloseEndpoint(ep);
  }
  // Peers that never completed the handshake.
  std::vector<std::string> silent;
  for (const auto& [address, peer] : peers_) {
    if (peer.failure.ok() && peer.stage != Peer::Stage::kReady && now > peer.deadline) {
      silent.push_back(address);
    }
  }
  for (const std::string& address : silent) {
    FailPullsTo(address, TimedOut("data-plane peer {} did not complete the token handshake within "
                                  "{} ms: is a Tessera process of this cluster listening there?",
                                  address, options_.pull_timeout_ms));
  }
  // Loans whose borrower never said it was done (it died): let go.
  std::erase_if(lent_chunks_, [&](const auto& loan) { return now > loan.second.deadline; });
  std::vector<uint64_t> overdue;
  for (auto& [id, push] : lent_pushes_) {
    if (now > push.deadline) overdue.push_back(id);
  }
  for (uint64_t id : overdue) {
    LentPush push = std::move(lent_pushes_.at(id));
    lent_pushes_.erase(id);
    push.done(TimedOut("the receiver at {} did not take a push within {} ms", push.address,
                       options_.pull_timeout_ms));
  }
  std::vector<uint64_t> expired;
  for (auto& [id, pull] : pulls_) {
    if (now > pull.deadline) expired.push_back(id);
  }
  for (uint64_t id : expired) {
    auto it = pulls_.find(id);
    if (it == pulls_.end()) continue;  // failed with an earlier one to the same peer
    const std::string address = it->second.address;
    // The peer is unresponsive: stop using it, so late data cannot land in freed buffers.
    it->second.error = TimedOut("no answer within {} ms", options_.pull_timeout_ms);
    FailPullsTo(address, it->second.error);
  }
}

void UcxDataPlane::Shutdown() {
  if (thread_.joinable()) {
    Post([this] {
      for (auto& [address, pull] : pulls_) pull.error = Cancelled("data plane shutting down");
      for (auto& [id, push] : lent_pushes_) push.done(Cancelled("data plane shutting down"));
      lent_pushes_.clear();
      lent_chunks_.clear();
      std::vector<uint64_t> ids;
      ids.reserve(pulls_.size());
      for (auto& [id, pull] : pulls_) ids.push_back(id);
      for (uint64_t id : ids) FinishPull(id);
      for (auto& [address, peer] : peers_) {
        std::vector<std::function<void(const Status&)>> waiting;
        waiting.swap(peer.waiting);
        for (auto& then : waiting) then(Cancelled("data plane shutting down"));
        if (peer.ep != nullptr) CloseEndpoint(peer.ep);
      }
      for (const auto& [ep, connection] : connections_) CloseEndpoint(ep);
      // Every close (these, and earlier ones for failed peers) finishes before the worker goes.
      const Clock::time_point deadline = Clock::now() + std::chrono::seconds(2);
      while (!closing_.empty() && Clock::now() < deadline) {
        ucp_worker_progress(worker_);
        ReapClosing();
      }
      peers_.clear();
      peer_addresses_.clear();
      connections_.clear();
      stopping_.store(true);
    });
    thread_.join();
  }
  if (listener_ != nullptr) ucp_listener_destroy(listener_);
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
  if (event_fd_ >= 0) ::close(event_fd_);
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  listener_ = nullptr;
  worker_ = nullptr;
  context_ = nullptr;
  event_fd_ = epoll_fd_ = -1;
}

}  // namespace

Result<std::unique_ptr<DataPlane>> DataPlane::Start(const DataPlaneOptions& options,
                                                    ObjectLookup lookup,
                                                    PushHandlers push_handlers) {
  auto plane = std::make_unique<UcxDataPlane>(options, std::move(lookup), std::move(push_handlers));
  TESSERA_RETURN_IF_ERROR(plane->Init());
  return std::unique_ptr<DataPlane>(std::move(plane));
}

Status DataPlane::PullAndWait(const std::string& address, ObjectId object, void* dest,
                              int64_t bytes) {
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> future = promise->get_future();
  Pull(address, object, dest, bytes,
       [promise](const Status& status) { promise->set_value(status); });
  return future.get();
}

}  // namespace tessera

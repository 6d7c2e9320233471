// The UCX implementation of DataPlane (see data_plane.h for the protocol and threading).
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include <ucp/api/ucp.h>

#include "core/transport/ucx_common.h"

#include "core/logging.h"
#include "core/transport/data_plane.h"
#include "core/transport/local_memory.h"

namespace tessera {

namespace {

using detail::UcxError;

using Clock = std::chrono::steady_clock;

// Active message ids.
constexpr uint16_t kGetChunk = 11;
constexpr uint16_t kChunk = 12;
constexpr uint16_t kPush = 13;
constexpr uint16_t kChunkRead = 14;  // puller -> holder: done reading a lent chunk
constexpr uint16_t kPushRead = 15;   // receiver -> pusher: done with a push (and can it read us)

// A process on the wire: lets a peer on the same host read its memory (local_memory.h).
struct WireProcess {
  int32_t pid;
  int32_t reserved;
  uint64_t probe;
};

WireProcess ThisWireProcess() {
  const LocalProcess self = ThisProcess();
  return WireProcess{self.pid, 0, self.probe};
}

// Request parameters of an active-message send (`flags`: UCP_AM_SEND_FLAG_*) and of a receive
// of an active message's data, completing through `callback` with `user_data`, never inline.
ucp_request_param_t AmSendParams(ucp_send_nbx_callback_t callback, void* user_data,
                                 uint32_t flags) {
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  params.cb.send = callback;
  params.user_data = user_data;
  params.flags = flags;
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

struct PushHeader {
  PushKey key;
  int64_t length;
  WireProcess sender;
  uint64_t push_id;
  uint64_t address;  // with kByAddress: where the bytes are in the sender
  uint32_t flags;    // kByAddress, kAskCanRead
  uint32_t reserved;
};
constexpr uint32_t kByAddress = 1;   // no payload: read the bytes from the sender's memory
constexpr uint32_t kAskCanRead = 2;  // tell the sender whether it may lend from now on

struct PushReadHeader {
  uint64_t push_id;
  int32_t status;     // StatusCode of reading a lent push
  uint32_t can_read;  // the receiver can read the sender's memory
};

struct GetChunkHeader {
  uint64_t request;
  uint64_t object;
  int64_t offset;
  int64_t length;
  uint32_t flags;  // kByAddress: lend the chunk (reply with its address)
  uint32_t reserved;
};

struct ChunkHeader {
  uint64_t request;
  int32_t status;  // StatusCode; 0 = OK and the payload is the bytes, else the error text
  uint32_t flags;  // kByAddress: no payload; the bytes are at `address` in the holder
  int64_t length;
  WireProcess holder;
  uint64_t address;
};

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
    std::lock_guard lock(stats_mutex_);
    return stats_;
  }

 private:
  struct Peer {
    ucp_ep_h ep = nullptr;
    Status failure;  // set when the endpoint failed or the peer was forgotten
    // Pushes send rendezvous data from this (client) endpoint; UCX 1.13 asserts if that happens
    // before wire-up completes, so pushes wait for a flush (WhenWired).
    bool wired = false;
    bool flushing = false;
    std::vector<std::function<void(const Status&)>> waiting;
    // Single copy (same host): can this process read the peer's memory (pulls), and can the
    // peer read ours (pushes)? Unknown until the first reply says.
    enum class Reads : int8_t { kUnknown, kYes, kNo };
    Reads reads_peer = Reads::kUnknown;
    Reads peer_reads_us = Reads::kUnknown;
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
  void Shutdown();

  Result<ucp_ep_h> PeerEndpoint(const std::string& address);
  // Runs `then` once the endpoint to the peer is wired up (at once if it is).
  void WhenWired(const std::string& address, std::function<void(const Status&)> then);
  void Wired(const std::string& address, const Status& status);
  void IssueChunks(PullState& pull);
  void ChunkDone(uint64_t request, const Status& status, int64_t bytes);
  void FinishPull(uint64_t pull_id);
  void FailPullsTo(const std::string& address, const Status& reason);
  // `lend`: reply with the bytes' address for a same-host puller to read itself.
  void SendReply(ucp_ep_h ep, uint64_t request, const Status& status, const void* data,
                 int64_t length, std::shared_ptr<void> keepalive, bool lend = false);

  static ucs_status_t OnGetChunk(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnChunk(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnPush(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  static void OnPushSent(void* request, ucs_status_t status, void* user_data);
  static ucs_status_t OnChunkRead(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnPushRead(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  // Small control messages (lent chunks and pushes, acknowledgements). `reply`: the receiver
  // may answer on the endpoint it got it from.
  void SendControl(ucp_ep_h ep, uint16_t id, const void* header, size_t length, bool reply = false);
  void AcknowledgePush(const PushReceive& push, const Status& status);
  // The peer behind an endpoint this process created (pulls and pushes go out on those).
  Peer* PeerOf(const std::string& address);
  static void OnPushReceived(void* request, ucs_status_t status, size_t length, void* user_data);
  void ReceivePushes();
  void SendPush(const std::string& address, ucp_ep_h ep, const PushKey& key, const void* data,
                int64_t bytes, std::shared_ptr<void> keepalive, PullCallback done);
  static void OnConnection(ucp_conn_request_h request, void* arg);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void OnSendDone(void* request, ucs_status_t status, void* user_data);
  static void OnReceiveDone(void* request, ucs_status_t status, size_t length, void* user_data);

  const DataPlaneOptions options_;
  ObjectLookup lookup_;
  PushHandlers push_;
  std::string address_;

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  int ucx_fd_ = -1;
  int event_fd_ = -1;
  int epoll_fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stopping_{false};

  std::mutex command_mutex_;
  std::vector<std::function<void()>> commands_;  // under command_mutex_

  // Progress-thread state.
  std::unordered_map<std::string, Peer> peers_;
  std::vector<ucp_ep_h> accepted_;
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
  std::unordered_map<uint64_t, std::string> asking_pushes_;    // push id -> receiver address

  mutable std::mutex stats_mutex_;
  DataPlaneStats stats_;
};

Status UcxDataPlane::Init() {
  // Without peer-failure mode, UCX aborts the process when a peer dies under a CMA transfer
  // (a worker killed while another pulls from it): CMA stays out unless UCX_TLS asks for it.
  TESSERA_ASSIGN_OR_RETURN(detail::UcxHandles handles,
                           detail::CreateUcxWorker(UCP_FEATURE_AM, "tessera", "^cma"));
  context_ = handles.context;
  worker_ = handles.worker;
  ucx_fd_ = handles.event_fd;

  for (auto [id, callback] :
       {std::pair{kGetChunk, &OnGetChunk}, std::pair{kChunk, &OnChunk}, std::pair{kPush, &OnPush},
        std::pair{kChunkRead, &OnChunkRead}, std::pair{kPushRead, &OnPushRead}}) {
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
  if (event_fd_ < 0 || epoll_fd_ < 0) return Internal("eventfd/epoll: {}", std::strerror(errno));
  for (int fd : {ucx_fd_, event_fd_}) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event) != 0) {
      return Internal("epoll_ctl: {}", std::strerror(errno));
    }
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
    const int timeout_ms = pulls_.empty() ? 500 : 50;  // deadlines are checked at least this often
    ::epoll_wait(epoll_fd_, events, 2, timeout_ms);
    uint64_t drained;
    while (::read(event_fd_, &drained, sizeof(drained)) > 0) {
    }
  }
}

void UcxDataPlane::Post(std::function<void()> command) {
  {
    std::lock_guard lock(command_mutex_);
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
    std::lock_guard lock(command_mutex_);
    commands.swap(commands_);
  }
  for (auto& command : commands) command();
}

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
  if (ucp_ep_create(self->worker_, &params, &ep) == UCS_OK) self->accepted_.push_back(ep);
}

void UcxDataPlane::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  for (auto& [address, peer] : self->peers_) {
    if (peer.ep == ep && peer.failure.ok()) {
      self->FailPullsTo(address, Unavailable("data-plane peer {} failed: {}", address,
                                             ucs_status_string(status)));
    }
  }
}

ucs_status_t UcxDataPlane::OnGetChunk(void* arg, const void* header, size_t header_length,
                                      void* /*data*/, size_t /*length*/,
                                      const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  if (header_length != sizeof(GetChunkHeader) ||
      !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    return UCS_OK;  // malformed request: drop it
  }
  ServeRequest serve;
  serve.reply_ep = param->reply_ep;
  std::memcpy(&serve.header, header, sizeof(GetChunkHeader));
  self->serves_.push_back(serve);  // answered from the progress loop, not inside the callback
  return UCS_OK;
}

ucs_status_t UcxDataPlane::OnChunk(void* arg, const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  if (header_length != sizeof(ChunkHeader)) return UCS_OK;
  ChunkHeader chunk_header;
  std::memcpy(&chunk_header, header, sizeof(ChunkHeader));
  auto chunk = self->chunks_.find(chunk_header.request);
  if (chunk == self->chunks_.end()) {
    // A reply for a pull that already failed (deadline, forgotten peer): drop its data.
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) ucp_am_data_release(self->worker_, data);
    return UCS_OK;
  }
  PullState& owner = self->pulls_.at(chunk->second.pull);
  Peer* holder = self->PeerOf(owner.address);
  if (holder != nullptr && holder->reads_peer == Peer::Reads::kUnknown) {
    // The first reply from this holder: may this process read its memory (same host)?
    holder->reads_peer =
        CanReadMemoryOf(LocalProcess{chunk_header.holder.pid, chunk_header.holder.probe})
            ? Peer::Reads::kYes
            : Peer::Reads::kNo;
  }
  if (chunk_header.status == 0 && (chunk_header.flags & kByAddress)) {
    // A lent chunk: copy it out of the holder's memory, then tell the holder it may let go.
    const int error = ReadMemoryOf(chunk_header.holder.pid, chunk_header.address,
                                   owner.dest + chunk->second.offset, chunk->second.length);
    if (holder != nullptr && holder->ep != nullptr) {
      self->SendControl(holder->ep, kChunkRead, &chunk_header.request, sizeof(uint64_t),
                        /*reply=*/true);
    }
    self->ChunkDone(chunk_header.request,
                    error == 0
                        ? Status::Ok()
                        : Unavailable("the holder (pid {}) vanished while lending a chunk: {}",
                                      chunk_header.holder.pid, std::strerror(error)),
                    error == 0 ? chunk->second.length : 0);
    return UCS_OK;
  }
  if (chunk_header.status != 0) {
    const std::string text(static_cast<const char*>(data), length);
    self->ChunkDone(chunk_header.request,
                    Status(static_cast<StatusCode>(chunk_header.status), text), 0);
    return UCS_OK;
  }
  if (static_cast<int64_t>(length) != chunk->second.length) {
    self->ChunkDone(
        chunk_header.request,
        DataLoss("peer sent {} bytes for a {}-byte chunk", length, chunk->second.length), 0);
    return UCS_OK;
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    self->receives_.push_back(
        ReceiveRequest{chunk_header.request, data, static_cast<int64_t>(length)});
    return UCS_INPROGRESS;
  }
  // Eager: the bytes are here already.
  std::memcpy(owner.dest + chunk->second.offset, data, length);
  self->ChunkDone(chunk_header.request, Status::Ok(), static_cast<int64_t>(length));
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

void UcxDataPlane::SendReply(ucp_ep_h ep, uint64_t request, const Status& status, const void* data,
                             int64_t length, std::shared_ptr<void> keepalive, bool lend) {
  if (status.ok() && lend) {
    // Lend the chunk: the puller reads it from here and says when; keep it alive till then.
    lent_chunks_[{ep, request}] = Loan{
        std::move(keepalive), Clock::now() + std::chrono::milliseconds(options_.pull_timeout_ms)};
    const ChunkHeader header{
        request, 0, kByAddress, length, ThisWireProcess(), reinterpret_cast<uint64_t>(data)};
    SendControl(ep, kChunk, &header, sizeof(header));
    return;
  }
  auto* operation = new Operation{this, std::move(keepalive), {}, 0, length};
  // The payload holds the header and, for an error, its text (sent in place of the bytes).
  const std::string& text = status.ok() ? std::string() : status.message();
  if (!status.ok()) length = static_cast<int64_t>(text.size());
  const ChunkHeader header{
      request, static_cast<int32_t>(status.code()), 0, length, ThisWireProcess(), 0};
  operation->payload.resize(sizeof(ChunkHeader) + text.size());
  std::memcpy(operation->payload.data(), &header, sizeof(ChunkHeader));
  if (!text.empty())
    std::memcpy(operation->payload.data() + sizeof(ChunkHeader), text.data(), text.size());
  const void* body = status.ok() ? data : operation->payload.data() + sizeof(ChunkHeader);
  ucp_request_param_t params =
      AmSendParams(&OnSendDone, operation, status.ok() && length > 0 ? UCP_AM_SEND_FLAG_RNDV : 0);
  ucs_status_ptr_t sent =
      ucp_am_send_nbx(ep, kChunk, operation->payload.data(), sizeof(ChunkHeader), body,
                      static_cast<size_t>(length), &params);
  if (UCS_PTR_IS_ERR(sent)) {
    GetLogger("data_plane")->warn("reply send failed: {}", ucs_status_string(UCS_PTR_STATUS(sent)));
    delete operation;
  }
}

void UcxDataPlane::ServePending() {
  std::vector<ServeRequest> serves;
  serves.swap(serves_);
  for (const ServeRequest& serve : serves) {
    const GetChunkHeader& h = serve.header;
    Result<ServedObject> object = lookup_(ObjectId(h.object));
    if (!object.ok()) {
      SendReply(serve.reply_ep, h.request, object.status(), nullptr, 0, nullptr);
      continue;
    }
    if (h.offset < 0 || h.length < 0 || h.offset + h.length > object->bytes) {
      SendReply(serve.reply_ep, h.request,
                InvalidArgument("chunk [{}, +{}) is outside obj{} of {} bytes", h.offset, h.length,
                                h.object, object->bytes),
                nullptr, 0, nullptr);
      continue;
    }
    SendReply(serve.reply_ep, h.request, Status::Ok(),
              static_cast<const char*>(object->data) + h.offset, h.length,
              std::move(object->keepalive), /*lend=*/(h.flags & kByAddress) != 0);
    std::lock_guard lock(stats_mutex_);
    stats_.bytes_served += h.length;
    ++stats_.serves;
  }
}

void UcxDataPlane::ReceivePending() {
  std::vector<ReceiveRequest> receives;
  receives.swap(receives_);
  for (const ReceiveRequest& receive : receives) {
    auto chunk = chunks_.find(receive.request);
    if (chunk == chunks_.end()) continue;  // pull already failed; UCX drops the descriptor
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

ucs_status_t UcxDataPlane::OnPush(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  if (header_length != sizeof(PushHeader) || !self->push_.accept) return UCS_OK;
  PushHeader push;
  std::memcpy(&push, header, sizeof(PushHeader));
  const ucp_ep_h reply_ep =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  if (push.flags & kByAddress) {
    // A lent push: read it in the progress loop (accept may take locks).
    self->push_receives_.push_back(PushReceive{push.key, nullptr, push.length, reply_ep, push});
    return UCS_OK;
  }
  if ((push.flags & kAskCanRead) && reply_ep != nullptr) {
    self->AcknowledgePush(PushReceive{push.key, nullptr, push.length, reply_ep, push},
                          Status::Ok());
  }
  if (push.length != static_cast<int64_t>(length)) {
    self->push_.delivered(push.key, DataLoss("push of {} bytes announced {}", length, push.length));
    return UCS_OK;
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    self->push_receives_.push_back(PushReceive{push.key, data, push.length});
    return UCS_INPROGRESS;
  }
  Result<void*> dest = self->push_.accept(push.key, push.length);
  if (!dest.ok()) {
    self->push_.delivered(push.key, dest.status());
    return UCS_OK;
  }
  if (length > 0) std::memcpy(*dest, data, length);
  self->push_.delivered(push.key, Status::Ok());
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
        const int error =
            ReadMemoryOf(push.header.sender.pid, push.header.address, *dest, push.length);
        if (error != 0) {
          status = Unavailable("the sender (pid {}) vanished while lending a push: {}",
                               push.header.sender.pid, std::strerror(error));
        } else {
          std::lock_guard lock(stats_mutex_);
          stats_.bytes_pulled += push.length;
        }
      }
      AcknowledgePush(push, status);
      push_.delivered(push.key, status);
      continue;
    }
    Result<void*> dest = push_.accept(push.key, push.length);
    if (!dest.ok()) {
      // Drop the bytes: receiving into a scratch buffer keeps UCX's rendezvous protocol whole.
      auto* scratch = new Operation{
          this, nullptr, std::vector<char>(static_cast<size_t>(push.length)), 0, push.length};
      scratch->push_key = push.key;
      ucp_request_param_t params = AmReceiveParams(
          [](void* request, ucs_status_t, size_t, void* user_data) {
            delete static_cast<Operation*>(user_data);
            ucp_request_free(request);
          },
          scratch);
      ucs_status_ptr_t started =
          ucp_am_recv_data_nbx(worker_, push.descriptor, scratch->payload.data(),
                               static_cast<size_t>(push.length), &params);
      if (UCS_PTR_IS_ERR(started)) delete scratch;
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
    std::lock_guard lock(self->stats_mutex_);
    self->stats_.bytes_pulled += static_cast<int64_t>(length);
  }
  delete operation;
  ucp_request_free(request);
}

void UcxDataPlane::OnPushSent(void* request, ucs_status_t status, void* user_data) {
  auto* operation = static_cast<Operation*>(user_data);
  if (operation->done) {
    operation->done(status == UCS_OK ? Status::Ok() : UcxError("push send", status));
  }
  if (status == UCS_OK) {
    std::lock_guard lock(operation->plane->stats_mutex_);
    operation->plane->stats_.bytes_served += operation->bytes;
  }
  delete operation;
  ucp_request_free(request);
}

void UcxDataPlane::Push(const std::string& address, const PushKey& key, const void* data,
                        int64_t bytes, std::shared_ptr<void> keepalive, PullCallback done) {
  Post([this, address, key, data, bytes, keepalive = std::move(keepalive),
        done = std::move(done)]() mutable {
    WhenWired(address, [this, address, key, data, bytes, keepalive = std::move(keepalive),
                        done = std::move(done)](const Status& wired) mutable {
      if (!wired.ok()) return done(wired);
      SendPush(address, peers_.at(address).ep, key, data, bytes, std::move(keepalive),
               std::move(done));
    });
  });
}

void UcxDataPlane::SendPush(const std::string& address, ucp_ep_h ep, const PushKey& key,
                            const void* data, int64_t bytes, std::shared_ptr<void> keepalive,
                            PullCallback done) {
  Peer& peer = peers_[address];
  const uint64_t push_id = next_push_++;
  if (peer.peer_reads_us == Peer::Reads::kYes && bytes > 0) {
    // Lend it: the receiver reads it from here and acknowledges (OnPushRead).
    lent_pushes_[push_id] =
        LentPush{address, std::move(keepalive), std::move(done), bytes,
                 Clock::now() + std::chrono::milliseconds(options_.pull_timeout_ms)};
    const PushHeader header{
        key, bytes, ThisWireProcess(), push_id, reinterpret_cast<uint64_t>(data), kByAddress, 0};
    SendControl(ep, kPush, &header, sizeof(header), /*reply=*/true);
    return;
  }
  uint32_t flags = 0;
  if (peer.peer_reads_us == Peer::Reads::kUnknown) {
    flags = kAskCanRead;
    asking_pushes_[push_id] = address;
  }
  {
    auto* operation = new Operation{this, std::move(keepalive), {}, 0, bytes};
    operation->done = std::move(done);
    operation->payload.resize(sizeof(PushHeader));
    const PushHeader header{key, bytes, ThisWireProcess(), push_id, 0, flags, 0};
    std::memcpy(operation->payload.data(), &header, sizeof(header));
    // No forced rendezvous here: UCX 1.13 asserts when a fresh client endpoint is forced into it
    // before wire-up completes. It picks rendezvous for large messages by itself. REPLY lets the
    // receiver answer the push (kPushRead).
    ucp_request_param_t params = AmSendParams(&OnPushSent, operation, UCP_AM_SEND_FLAG_REPLY);
    ucs_status_ptr_t sent =
        ucp_am_send_nbx(ep, kPush, operation->payload.data(), sizeof(PushHeader), data,
                        static_cast<size_t>(bytes), &params);
    if (UCS_PTR_IS_ERR(sent)) {
      PullCallback failed = std::move(operation->done);
      delete operation;
      failed(UcxError("push send", UCS_PTR_STATUS(sent)));
    }
  }
}

void UcxDataPlane::SendControl(ucp_ep_h ep, uint16_t id, const void* header, size_t length,
                               bool reply) {
  auto* operation = new Operation{this, nullptr, {}, 0, 0};
  operation->payload.assign(static_cast<const char*>(header),
                            static_cast<const char*>(header) + length);
  ucp_request_param_t params =
      AmSendParams(&OnSendDone, operation, reply ? UCP_AM_SEND_FLAG_REPLY : 0);
  ucs_status_ptr_t sent =
      ucp_am_send_nbx(ep, id, operation->payload.data(), length, nullptr, 0, &params);
  if (UCS_PTR_IS_ERR(sent)) {
    GetLogger("data_plane")
        ->warn("control message {} failed: {}", id, ucs_status_string(UCS_PTR_STATUS(sent)));
    delete operation;
  }
}

void UcxDataPlane::AcknowledgePush(const PushReceive& push, const Status& status) {
  if (push.reply_ep == nullptr) return;
  const PushReadHeader ack{
      push.header.push_id, static_cast<int32_t>(status.code()),
      CanReadMemoryOf(LocalProcess{push.header.sender.pid, push.header.sender.probe}) ? 1u : 0u};
  SendControl(push.reply_ep, kPushRead, &ack, sizeof(ack));
}

ucs_status_t UcxDataPlane::OnChunkRead(void* arg, const void* header, size_t header_length,
                                       void* /*data*/, size_t /*length*/,
                                       const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  if (header_length != sizeof(uint64_t) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    return UCS_OK;
  }
  uint64_t request;
  std::memcpy(&request, header, sizeof(request));
  self->lent_chunks_.erase({param->reply_ep, request});  // releases the object
  return UCS_OK;
}

ucs_status_t UcxDataPlane::OnPushRead(void* arg, const void* header, size_t header_length,
                                      void* /*data*/, size_t /*length*/,
                                      const ucp_am_recv_param_t* /*param*/) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  if (header_length != sizeof(PushReadHeader)) return UCS_OK;
  PushReadHeader ack;
  std::memcpy(&ack, header, sizeof(ack));
  if (auto asked = self->asking_pushes_.find(ack.push_id); asked != self->asking_pushes_.end()) {
    if (Peer* peer = self->PeerOf(asked->second)) {
      peer->peer_reads_us = ack.can_read ? Peer::Reads::kYes : Peer::Reads::kNo;
    }
    self->asking_pushes_.erase(asked);
  }
  auto lent = self->lent_pushes_.find(ack.push_id);
  if (lent == self->lent_pushes_.end()) return UCS_OK;
  LentPush push = std::move(lent->second);
  self->lent_pushes_.erase(lent);
  const Status status =
      ack.status == 0
          ? Status::Ok()
          : Status(static_cast<StatusCode>(ack.status),
                   fmt::format("the receiver could not read the push from {}", self->address_));
  if (status.ok()) {
    std::lock_guard lock(self->stats_mutex_);
    self->stats_.bytes_served += push.bytes;
  }
  push.done(status);
  return UCS_OK;
}

UcxDataPlane::Peer* UcxDataPlane::PeerOf(const std::string& address) {
  auto it = peers_.find(address);
  return it == peers_.end() ? nullptr : &it->second;
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
  peers_[address].ep = ep;
  return ep;
}

void UcxDataPlane::WhenWired(const std::string& address, std::function<void(const Status&)> then) {
  Result<ucp_ep_h> ep = PeerEndpoint(address);
  if (!ep.ok()) return then(ep.status());
  Peer& peer = peers_[address];
  if (peer.wired) return then(Status::Ok());
  peer.waiting.push_back(std::move(then));
  if (peer.flushing) return;
  peer.flushing = true;
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
    done->plane->Wired(done->address,
                       status == UCS_OK ? Status::Ok() : UcxError("endpoint wire-up", status));
    ucp_request_free(request);
  };
  params.user_data = new FlushDone{this, address};
  ucs_status_ptr_t flushing = ucp_ep_flush_nbx(*ep, &params);
  if (UCS_PTR_IS_ERR(flushing)) {
    delete static_cast<FlushDone*>(params.user_data);
    Wired(address, UcxError("endpoint wire-up", UCS_PTR_STATUS(flushing)));
  }
}

void UcxDataPlane::Wired(const std::string& address, const Status& status) {
  Peer& peer = peers_[address];
  peer.flushing = false;
  peer.wired = status.ok();
  std::vector<std::function<void(const Status&)>> waiting;
  waiting.swap(peer.waiting);
  for (auto& then : waiting) then(status);
}

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
    IssueChunks(pull);
    if (pull.outstanding == 0) FinishPull(id);  // zero bytes, or the first send failed
  });
}

void UcxDataPlane::IssueChunks(PullState& pull) {
  while (pull.error.ok() && pull.next_offset < pull.bytes &&
         pull.outstanding < options_.chunks_in_flight) {
    Result<ucp_ep_h> ep = PeerEndpoint(pull.address);
    if (!ep.ok()) {
      pull.error = ep.status();
      return;
    }
    const int64_t length = std::min(options_.chunk_bytes, pull.bytes - pull.next_offset);
    const uint64_t request = next_request_++;
    chunks_[request] = ChunkRequest{pull.id, pull.next_offset, length};
    auto* operation = new Operation{this, nullptr, {}, 0, 0};
    operation->payload.resize(sizeof(GetChunkHeader));
    const Peer* holder = PeerOf(pull.address);
    const uint32_t flags =
        holder != nullptr && holder->reads_peer == Peer::Reads::kYes ? kByAddress : 0;
    const GetChunkHeader header{request, pull.object.value(), pull.next_offset, length, flags, 0};
    std::memcpy(operation->payload.data(), &header, sizeof(header));
    ucp_request_param_t params = AmSendParams(&OnSendDone, operation, UCP_AM_SEND_FLAG_REPLY);
    ucs_status_ptr_t sent = ucp_am_send_nbx(*ep, kGetChunk, operation->payload.data(),
                                            sizeof(GetChunkHeader), nullptr, 0, &params);
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
    std::lock_guard lock(stats_mutex_);
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
    std::lock_guard lock(stats_mutex_);
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

void UcxDataPlane::FailPullsTo(const std::string& address, const Status& reason) {
  Peer& peer = peers_[address];
  peer.failure = reason;
  if (!peer.waiting.empty()) Wired(address, reason);
  if (peer.ep != nullptr) {
    ucp_request_param_t params{};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    params.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t closing = ucp_ep_close_nbx(peer.ep, &params);
    // Completed later by progress; the worker must not be destroyed before (UCX asserts).
    if (closing != nullptr && !UCS_PTR_IS_ERR(closing)) closing_.push_back(closing);
    peer.ep = nullptr;
  }
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
    PullState& pull = pulls_.at(id);
    pull.error = TimedOut("no answer within {} ms", options_.pull_timeout_ms);
    // The peer is unresponsive: stop using it, so late data cannot land in freed buffers.
    FailPullsTo(pull.address, pull.error);
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
      for (auto& [id, pull] : pulls_) ids.push_back(id);
      for (uint64_t id : ids) FinishPull(id);
      std::vector<ucp_ep_h> eps = accepted_;
      for (auto& [address, peer] : peers_) {
        if (peer.ep != nullptr) eps.push_back(peer.ep);
      }
      for (ucp_ep_h ep : eps) {
        ucp_request_param_t params{};
        params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        params.flags = UCP_EP_CLOSE_FLAG_FORCE;
        ucs_status_ptr_t closing = ucp_ep_close_nbx(ep, &params);
        if (closing != nullptr && !UCS_PTR_IS_ERR(closing)) closing_.push_back(closing);
      }
      // Every close (these, and earlier ones for failed peers) finishes before the worker goes.
      const Clock::time_point deadline = Clock::now() + std::chrono::seconds(2);
      while (!closing_.empty() && Clock::now() < deadline) {
        ucp_worker_progress(worker_);
        ReapClosing();
      }
      peers_.clear();
      accepted_.clear();
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

// The UCX implementation of DataPlane (see data_plane.h for the protocol and threading): start-up,
// the progress thread and its commands, endpoints to peers, deadlines and shutdown. The handshake
// is in ucx_data_plane_handshake.cc, transfers in ucx_data_plane_transfer.cc.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <future>

#include "core/transport/ucx_data_plane_internal.h"

#include "core/logging.h"
#include "core/transport/ucx_common.h"

namespace tessera {
namespace detail {
namespace {

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

}  // namespace

Status UcxDataPlane::Init() {
  if (options_.token.empty()) {
    return InvalidArgument(
        "the data plane needs the cluster token (DataPlaneOptions::token): it serves only "
        "processes that prove they hold it");
  }
  key_ = DataPlaneKey(options_.token);
  self_ = ToWire(ThisProcess());
  // Without peer-failure mode, UCX aborts the process when a peer dies under a CMA transfer
  // (a worker killed while another pulls from it): CMA stays out unless UCX_TLS asks for it.
  TESSERA_ASSIGN_OR_RETURN(UcxHandles handles, CreateUcxWorker(UCP_FEATURE_AM, "tessera", "^cma",
                                                               /*indirect_ids=*/true));
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
    CloseDeferred();
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

void UcxDataPlane::CloseEndpoint(ucp_ep_h ep) { to_close_.push_back(ep); }

void UcxDataPlane::CloseDeferred() {
  std::vector<ucp_ep_h> endpoints;
  endpoints.swap(to_close_);
  for (ucp_ep_h ep : endpoints) CloseNow(ep);
}

void UcxDataPlane::CloseNow(ucp_ep_h ep) {
  // UCX forces a close (cancelling what is in flight) only on an endpoint in peer-failure mode,
  // which an accepted endpoint inherits from its client: it refuses the force otherwise, and the
  // endpoint would stay open (a leak of its sockets, then trouble when the worker is destroyed).
  // Such an endpoint is closed the way its mode allows: flushed, then disconnected.
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  params.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t closing = ucp_ep_close_nbx(ep, &params);
  if (UCS_PTR_IS_ERR(closing) && UCS_PTR_STATUS(closing) == UCS_ERR_INVALID_PARAM) {
    params.flags = 0;
    closing = ucp_ep_close_nbx(ep, &params);
  }
  if (UCS_PTR_IS_ERR(closing)) {
    // UCX released the endpoint anyway.
    GetLogger("data_plane")
        ->debug("closing a data-plane endpoint: {}", ucs_status_string(UCS_PTR_STATUS(closing)));
    return;
  }
  // Completed later by progress; the worker must not be destroyed before (UCX asserts).
  if (closing != nullptr) closing_.push_back(closing);
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

void UcxDataPlane::DropConnection(ucp_ep_h ep) {
  pending_.Remove(PendingId(ep));
  if (connections_.erase(ep) == 0) return;
  ++shed_unlogged_;
  CloseEndpoint(ep);
}

void UcxDataPlane::UpdatePendingStats(int64_t shed) {
  MutexLock lock(&stats_mutex_);
  stats_.pending_connections = static_cast<int64_t>(pending_.size());
  stats_.shed_connections += shed;
}

void UcxDataPlane::ShedPending(Clock::time_point now) {
  // Connections that never proved the token (or were refused): close them.
  const std::vector<uint64_t> expired = pending_.TakeExpired(now);
  for (uint64_t id : expired) DropConnection(PendingEndpoint(id));
  if (!expired.empty()) UpdatePendingStats(static_cast<int64_t>(expired.size()));
  if (shed_unlogged_ > 0 && now - shed_logged_ >= kShedLogInterval) {
    GetLogger("data_plane")
        ->warn(
            "closed {} data-plane connection(s) that did not prove the cluster token within "
            "{} ms or were the oldest over the caps ({} pending in all, {} per address); {} "
            "pending now",
            shed_unlogged_, options_.preauth.deadline_ms, options_.preauth.max_pending,
            options_.preauth.max_pending_per_address, pending_.size());
    shed_unlogged_ = 0;
    shed_logged_ = now;
  }
}

void UcxDataPlane::CheckDeadlines() {
  if (!closing_.empty()) ReapClosing();
  const Clock::time_point now = Clock::now();
  ShedPending(now);
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
      // Every close (these, and earlier ones for failed peers) finishes before the worker goes,
      // or is released.
      const Clock::time_point deadline = Clock::now() + std::chrono::seconds(2);
      CloseDeferred();
      while (!closing_.empty() && Clock::now() < deadline) {
        ucp_worker_progress(worker_);
        CloseDeferred();
        ReapClosing();
      }
      // Closes still flushing to a peer that does not answer: handed back to UCX, which frees
      // them with the worker (it asserts on close requests nobody released).
      for (void* request : closing_) ucp_request_free(request);
      closing_.clear();
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

}  // namespace detail

Result<std::unique_ptr<DataPlane>> DataPlane::Start(const DataPlaneOptions& options,
                                                    ObjectLookup lookup,
                                                    PushHandlers push_handlers) {
  auto plane =
      std::make_unique<detail::UcxDataPlane>(options, std::move(lookup), std::move(push_handlers));
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

// The UCX implementation of PeerTransport (see ucx_peer_transport.h).
#include "core/transport/ucx_peer_transport.h"

#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>

#include <ucp/api/ucp.h>

namespace tessera {

namespace {

using Clock = PeerTransport::Clock;

Status UcxError(std::string_view what, ucs_status_t status) {
  return Unavailable("UCX {} failed: {}", what, ucs_status_string(status));
}

#define TESSERA_UCX_RETURN_IF_ERROR(call, what)                    \
  do {                                                             \
    const ucs_status_t ucx_status_ = (call);                       \
    if (ucx_status_ != UCS_OK) return UcxError(what, ucx_status_); \
  } while (0)

// The sender's rank rides above the caller's 48-bit tag, so a receive matches one peer.
constexpr int kRankShift = 48;
uint64_t WireTag(int sender, uint64_t tag) {
  return (static_cast<uint64_t>(sender) << kRankShift) | tag;
}

int64_t MillisecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(to - from).count();
}

class UcxPeerTransportImpl final : public UcxPeerTransport {
 public:
  UcxPeerTransportImpl(int rank, int size, const UcxPeerTransportOptions& options)
      : rank_(rank), size_(size), options_(options), endpoints_(static_cast<size_t>(size)) {}
  ~UcxPeerTransportImpl() override;

  Status Init();
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& address() const override { return address_; }
  int64_t bytes_sent() const override { return bytes_sent_; }
  Status Connect(const std::vector<std::string>& addresses, Clock::time_point deadline) override;
  Result<RequestId> Isend(int peer, uint64_t tag, const void* data, int64_t bytes) override;
  Result<RequestId> Irecv(int peer, uint64_t tag, void* data, int64_t bytes) override;
  Status Wait(const std::vector<RequestId>& requests, Clock::time_point deadline) override;
  void Abort(const Status& reason) override;

 private:
  struct Pending {
    void* request = nullptr;  // UCX's, until it completes
    int peer = 0;
    bool receive = false;
    int64_t bytes = 0;
    uint64_t tag = 0;
  };

  Status CheckRequest(int peer, uint64_t tag) const;
  // Progresses UCX until it has nothing more to do right now.
  bool Progress();
  // Sleeps on UCX's event fd for at most `timeout_ms` (returns at once if events are pending).
  void Sleep(int timeout_ms);
  // OK when done (and released), an error when it failed, nullopt while in flight.
  std::optional<Status> Poll(Pending& pending);
  Status Break(const Status& reason);
  void CloseEndpoints(bool force);
  void ProgressUntil(void* request, Clock::time_point deadline);

  const int rank_;
  const int size_;
  const UcxPeerTransportOptions options_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  std::string address_;
  std::vector<ucp_ep_h> endpoints_;
  bool connected_ = false;
  RequestId next_id_ = 1;
  std::unordered_map<RequestId, Pending> pending_;
  int64_t bytes_sent_ = 0;
  Status broken_;

  std::atomic<bool> aborted_{false};
  std::mutex abort_mutex_;
  Status abort_reason_;  // under abort_mutex_
};

Status UcxPeerTransportImpl::Init() {
  ucp_config_t* config = nullptr;
  TESSERA_UCX_RETURN_IF_ERROR(ucp_config_read(nullptr, nullptr, &config), "config read");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.name = "tessera-collectives";
  const ucs_status_t init = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  TESSERA_UCX_RETURN_IF_ERROR(init, "init");

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  TESSERA_UCX_RETURN_IF_ERROR(ucp_worker_create(context_, &worker_params, &worker_),
                              "worker create");
  TESSERA_UCX_RETURN_IF_ERROR(ucp_worker_get_efd(worker_, &event_fd_), "get event fd");
  ucp_address_t* address = nullptr;
  size_t length = 0;
  TESSERA_UCX_RETURN_IF_ERROR(ucp_worker_get_address(worker_, &address, &length),
                              "get worker address");
  address_.assign(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(worker_, address);
  return Status::Ok();
}

UcxPeerTransportImpl::~UcxPeerTransportImpl() {
  if (worker_ != nullptr) {
    // Outstanding requests (a caller that gave up) are cancelled with the endpoints.
    CloseEndpoints(/*force=*/!broken_.ok() || !pending_.empty());
    for (auto& [id, pending] : pending_) {
      if (pending.request != nullptr) ucp_request_free(pending.request);
    }
    ucp_worker_destroy(worker_);
  }
  if (context_ != nullptr) ucp_cleanup(context_);
}

Status UcxPeerTransportImpl::Connect(const std::vector<std::string>& addresses,
                                     Clock::time_point deadline) {
  if (connected_) return InvalidArgument("transport of rank {} is connected already", rank_);
  if (static_cast<int>(addresses.size()) != size_) {
    return InvalidArgument("rank {} got {} addresses for a group of {}", rank_, addresses.size(),
                           size_);
  }
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.address =
        reinterpret_cast<const ucp_address_t*>(addresses[static_cast<size_t>(peer)].data());
    params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    const ucs_status_t status =
        ucp_ep_create(worker_, &params, &endpoints_[static_cast<size_t>(peer)]);
    if (status != UCS_OK) {
      return Break(Unavailable("rank {} cannot reach rank {}: UCX endpoint: {}", rank_, peer,
                               ucs_status_string(status)));
    }
  }
  connected_ = true;
  // Wire every endpoint up front (a flush completes once the peer has answered), so the first
  // collective does not pay for it and UCX 1.13 never starts a rendezvous on a half-wired
  // endpoint.
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    ucp_request_param_t param{};
    void* request = ucp_ep_flush_nbx(endpoints_[static_cast<size_t>(peer)], &param);
    if (UCS_PTR_IS_ERR(request)) {
      return Break(Unavailable("rank {} cannot wire up rank {}: {}", rank_, peer,
                               ucs_status_string(UCS_PTR_STATUS(request))));
    }
    if (request == nullptr) continue;
    const RequestId id = next_id_++;
    pending_[id] = Pending{request, peer, false, 0, 0};
    TESSERA_RETURN_IF_ERROR(Wait({id}, deadline).WithContext("wiring up the group"));
  }
  return Status::Ok();
}

Status UcxPeerTransportImpl::CheckRequest(int peer, uint64_t tag) const {
  if (!broken_.ok()) return broken_;
  if (!connected_) return InvalidArgument("transport of rank {} is not connected", rank_);
  if (peer < 0 || peer >= size_ || peer == rank_) {
    return InvalidArgument("rank {} cannot address rank {} in a group of {}", rank_, peer, size_);
  }
  if (tag >= kMaxTag) return InvalidArgument("tag {:#x} does not fit 48 bits", tag);
  return Status::Ok();
}

Result<PeerTransport::RequestId> UcxPeerTransportImpl::Isend(int peer, uint64_t tag,
                                                             const void* data, int64_t bytes) {
  TESSERA_RETURN_IF_ERROR(CheckRequest(peer, tag));
  ucp_request_param_t param{};
  void* request = ucp_tag_send_nbx(endpoints_[static_cast<size_t>(peer)], data,
                                   static_cast<size_t>(bytes), WireTag(rank_, tag), &param);
  if (UCS_PTR_IS_ERR(request)) {
    return Break(Unavailable("rank {} cannot send to rank {}: {}", rank_, peer,
                             ucs_status_string(UCS_PTR_STATUS(request))));
  }
  bytes_sent_ += bytes;
  const RequestId id = next_id_++;
  if (request != nullptr) pending_[id] = Pending{request, peer, false, bytes, tag};
  return id;
}

Result<PeerTransport::RequestId> UcxPeerTransportImpl::Irecv(int peer, uint64_t tag, void* data,
                                                             int64_t bytes) {
  TESSERA_RETURN_IF_ERROR(CheckRequest(peer, tag));
  ucp_request_param_t param{};
  // Always a request (never immediate completion), so its length can be checked in Poll.
  param.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  void* request = ucp_tag_recv_nbx(worker_, data, static_cast<size_t>(bytes), WireTag(peer, tag),
                                   ~uint64_t{0}, &param);
  if (UCS_PTR_IS_ERR(request)) {
    return Break(Unavailable("rank {} cannot receive from rank {}: {}", rank_, peer,
                             ucs_status_string(UCS_PTR_STATUS(request))));
  }
  const RequestId id = next_id_++;
  pending_[id] = Pending{request, peer, true, bytes, tag};
  return id;
}

bool UcxPeerTransportImpl::Progress() {
  bool any = false;
  while (ucp_worker_progress(worker_) != 0) any = true;
  return any;
}

void UcxPeerTransportImpl::Sleep(int timeout_ms) {
  if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) return;  // events are pending: progress instead
  pollfd fd{event_fd_, POLLIN, 0};
  ::poll(&fd, 1, timeout_ms);
}

std::optional<Status> UcxPeerTransportImpl::Poll(Pending& pending) {
  ucs_status_t status;
  ucp_tag_recv_info_t info{};
  if (pending.receive) {
    status = ucp_tag_recv_request_test(pending.request, &info);
  } else {
    status = ucp_request_check_status(pending.request);
  }
  if (status == UCS_INPROGRESS) return std::nullopt;
  ucp_request_free(pending.request);
  pending.request = nullptr;
  if (status == UCS_ERR_MESSAGE_TRUNCATED ||
      (status == UCS_OK && pending.receive && static_cast<int64_t>(info.length) != pending.bytes)) {
    return Internal(
        "rank {} sent a message of another size than rank {} expected ({} bytes, tag "
        "{:#x}): the ranks disagree about the collective",
        pending.peer, rank_, pending.bytes, pending.tag);
  }
  if (status != UCS_OK) {
    return Unavailable("transfer between rank {} and rank {} failed: {}", rank_, pending.peer,
                       ucs_status_string(status));
  }
  return Status::Ok();
}

Status UcxPeerTransportImpl::Wait(const std::vector<RequestId>& requests,
                                  Clock::time_point deadline) {
  if (!broken_.ok()) return broken_;
  std::vector<RequestId> waiting(requests);
  const Clock::time_point started = Clock::now();
  Clock::time_point last_event = started;
  while (true) {
    if (Progress()) last_event = Clock::now();
    if (aborted_.load(std::memory_order_acquire)) {
      std::lock_guard lock(abort_mutex_);
      return Break(abort_reason_);
    }
    auto done = [&](RequestId id) {
      auto it = pending_.find(id);
      if (it == pending_.end()) return true;  // completed at once, or waited for before
      std::optional<Status> status = Poll(it->second);
      if (!status) return false;
      pending_.erase(it);
      if (!status->ok() && broken_.ok()) (void)Break(*status);
      return true;
    };
    waiting.erase(std::remove_if(waiting.begin(), waiting.end(), done), waiting.end());
    if (!broken_.ok()) return broken_;
    if (waiting.empty()) return Status::Ok();
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      const Pending& stuck = pending_.at(waiting.front());
      return Break(
          TimedOut("rank {} heard nothing from rank {} for {} ms (a {} of {} bytes is "
                   "still open): rank {} is dead or stuck",
                   rank_, stuck.peer, MillisecondsBetween(started, now),
                   stuck.receive ? "receive" : "send", stuck.bytes, stuck.peer));
    }
    if (now - last_event > std::chrono::microseconds(options_.spin_microseconds)) {
      Sleep(static_cast<int>(std::clamp<int64_t>(MillisecondsBetween(now, deadline) + 1, 1, 100)));
      last_event = Clock::now();  // spin again after waking
    }
  }
}

void UcxPeerTransportImpl::Abort(const Status& reason) {
  {
    std::lock_guard lock(abort_mutex_);
    if (aborted_.load()) return;
    abort_reason_ = reason.ok() ? Cancelled("the group was aborted") : reason;
  }
  aborted_.store(true, std::memory_order_release);
  if (worker_ != nullptr) ucp_worker_signal(worker_);  // wakes a Wait asleep on the event fd
}

Status UcxPeerTransportImpl::Break(const Status& reason) {
  if (!broken_.ok()) return broken_;
  broken_ = reason;
  for (auto& [id, pending] : pending_) {
    if (pending.receive && pending.request != nullptr) ucp_request_cancel(worker_, pending.request);
  }
  // Forcing the endpoints closed completes the sends with an error; no request then touches
  // the caller's buffers.
  CloseEndpoints(/*force=*/true);
  for (auto& [id, pending] : pending_) {
    if (pending.request == nullptr) continue;
    ProgressUntil(pending.request, Clock::now() + std::chrono::seconds(1));
    ucp_request_free(pending.request);
    pending.request = nullptr;
  }
  pending_.clear();
  return broken_;
}

void UcxPeerTransportImpl::ProgressUntil(void* request, Clock::time_point deadline) {
  while (ucp_request_check_status(request) == UCS_INPROGRESS && Clock::now() < deadline) {
    Progress();
  }
}

void UcxPeerTransportImpl::CloseEndpoints(bool force) {
  for (ucp_ep_h& endpoint : endpoints_) {
    if (endpoint == nullptr) continue;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* request = ucp_ep_close_nbx(endpoint, &param);
    if (request != nullptr && !UCS_PTR_IS_ERR(request)) {
      // A graceful close flushes; a dead peer must not hold the process forever.
      ProgressUntil(request, Clock::now() + std::chrono::seconds(force ? 1 : 5));
      ucp_request_free(request);
    }
    endpoint = nullptr;
  }
}

}  // namespace

Result<std::unique_ptr<UcxPeerTransport>> UcxPeerTransport::Create(
    int rank, int size, const UcxPeerTransportOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return InvalidArgument("rank {} of a group of {} is not a rank", rank, size);
  }
  if (size > (1 << (64 - kRankShift))) {
    return InvalidArgument("a group of {} ranks is larger than UCX tags can address", size);
  }
  auto transport = std::make_unique<UcxPeerTransportImpl>(rank, size, options);
  TESSERA_RETURN_IF_ERROR(transport->Init());
  return std::unique_ptr<UcxPeerTransport>(std::move(transport));
}

}  // namespace tessera

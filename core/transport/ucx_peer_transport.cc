// The UCX implementation of PeerTransport (see ucx_peer_transport.h).
#include "core/transport/ucx_peer_transport.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>
#include <unordered_map>

#include <ucp/api/ucp.h>

#include "core/transport/ucx_common.h"

#include "core/thread_annotations.h"
#include "core/transport/local_memory.h"

namespace tessera {

namespace {

using detail::UcxError;

using Clock = PeerTransport::Clock;

// Wire tags: the sender's rank above the caller's 48-bit tag, so a receive matches one peer.
// Acknowledgements of single-copy transfers use the rank field's last value (no rank has it)
// and the sender's transfer number.
constexpr int kRankShift = 48;
constexpr uint64_t kAckRank = 0xffff;
uint64_t WireTag(int sender, uint64_t tag) {
  return (static_cast<uint64_t>(sender) << kRankShift) | tag;
}
uint64_t AckTag(uint64_t transfer) {
  return (kAckRank << kRankShift) | (transfer & (PeerTransport::kMaxTag - 1));
}
constexpr uint64_t kFullMask = ~uint64_t{0};

// What a single-copy sender sends instead of the bytes.
struct Descriptor {
  uint64_t magic;
  uint64_t address;  // in the sender's address space
  int64_t bytes;
  uint64_t ack_tag;
};
constexpr uint64_t kDescriptorMagic = 0x3173736573736574;  // "tessess1"
constexpr uint64_t kAckWord = 1;

// A peer's address: host name, pid, the address of its probe word, its UCX worker address.
struct PeerAddress {
  std::string host;
  int32_t pid = 0;
  uint64_t probe = 0;
  std::string worker;
};

std::string EncodeAddress(const PeerAddress& address) {
  std::string out;
  auto put = [&](const void* data, size_t bytes) {
    out.append(static_cast<const char*>(data), bytes);
  };
  const uint16_t host_length = static_cast<uint16_t>(address.host.size());
  put(&host_length, sizeof(host_length));
  put(address.host.data(), address.host.size());
  put(&address.pid, sizeof(address.pid));
  put(&address.probe, sizeof(address.probe));
  put(address.worker.data(), address.worker.size());
  return out;
}

Result<PeerAddress> DecodeAddress(const std::string& blob) {
  PeerAddress address;
  uint16_t host_length = 0;
  if (blob.size() < sizeof(host_length)) return InvalidArgument("empty peer address");
  std::memcpy(&host_length, blob.data(), sizeof(host_length));
  const size_t fixed =
      sizeof(host_length) + host_length + sizeof(address.pid) + sizeof(address.probe);
  if (blob.size() <= fixed)
    return InvalidArgument("truncated peer address ({} bytes)", blob.size());
  size_t offset = sizeof(host_length);
  address.host = blob.substr(offset, host_length);
  offset += host_length;
  std::memcpy(&address.pid, blob.data() + offset, sizeof(address.pid));
  offset += sizeof(address.pid);
  std::memcpy(&address.probe, blob.data() + offset, sizeof(address.probe));
  offset += sizeof(address.probe);
  address.worker = blob.substr(offset);
  return address;
}

int64_t MillisecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(to - from).count();
}

class UcxPeerTransportImpl final : public UcxPeerTransport {
 public:
  UcxPeerTransportImpl(int rank, int size, const UcxPeerTransportOptions& options)
      : rank_(rank), size_(size), options_(options), peers_(static_cast<size_t>(size)) {}
  ~UcxPeerTransportImpl() override;

  Status Init();
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& address() const override { return address_; }
  PeerTransportStats stats() const override { return stats_; }
  int64_t failure_silence_ms() const override { return failure_silence_ms_; }
  int failure_silent_peer() const override { return failure_silent_peer_; }
  Status Connect(const std::vector<std::string>& addresses, Clock::time_point deadline) override;
  Result<RequestId> Isend(int peer, uint64_t tag, const void* data, int64_t bytes) override;
  Result<RequestId> Irecv(int peer, uint64_t tag, void* data, int64_t bytes) override;
  Status Wait(const std::vector<RequestId>& requests, Clock::time_point deadline) override;
  void Abort(const Status& reason) override;

 private:
  struct Peer;
  struct EndpointContext {
    UcxPeerTransportImpl* self;
    int peer;
  };
  struct Peer {
    ucp_ep_h endpoint = nullptr;
    PeerAddress address;
    bool single_copy = false;      // on this host, and its memory is readable
    Clock::time_point last_heard;  // the last completed transfer with it
    EndpointContext context{};
  };
  enum class Kind {
    kSend,         // request: UCX send
    kReceive,      // request: UCX receive
    kCopySend,     // request: receive of the acknowledgement; descriptor_send: its send
    kCopyReceive,  // request: receive of the descriptor; then the copy, then the ack
    kFlush,        // request: endpoint flush (wire-up)
  };
  struct Pending {
    Kind kind = Kind::kSend;
    int peer = 0;
    int64_t bytes = 0;
    uint64_t tag = 0;
    void* request = nullptr;
    void* descriptor_send = nullptr;
    char* data = nullptr;
    Descriptor descriptor{};
    uint64_t ack = 0;
  };

  Status CheckRequest(int peer, uint64_t tag) const;
  Result<RequestId> Track(std::unique_ptr<Pending> pending);
  // OK when done, an error when it failed, nullopt while in flight. Frees what completed.
  std::optional<Status> Poll(Pending& pending);
  Status FinishCopyReceive(Pending& pending);
  static void OnEndpointError(void* arg, ucp_ep_h endpoint, ucs_status_t status);
  // Progresses UCX until it has nothing more to do right now.
  bool Progress();
  // Sleeps on UCX's event fd for at most `timeout_ms` (returns at once if events are pending).
  void Sleep(int timeout_ms);
  Status Break(const Status& reason);
  void CloseEndpoints(bool force);
  void Release(void* request, Clock::time_point deadline);
  void ReleaseLoose(bool wait);

  const int rank_;
  const int size_;
  const UcxPeerTransportOptions options_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  std::string host_;
  std::string address_;
  std::vector<Peer> peers_;
  bool connected_ = false;
  RequestId next_id_ = 1;
  uint64_t next_transfer_ = 1;
  std::unordered_map<RequestId, std::unique_ptr<Pending>> pending_;
  std::vector<void*> loose_;  // requests nobody waits for (acks sent), freed when complete
  PeerTransportStats stats_;
  Status broken_;
  Status peer_failure_;  // set by OnEndpointError
  int64_t failure_silence_ms_ = 0;
  int failure_silent_peer_ = -1;

  std::atomic<bool> aborted_{false};
  Mutex abort_mutex_;
  Status abort_reason_ GUARDED_BY(abort_mutex_);
};

Status UcxPeerTransportImpl::Init() {
  // No CMA (see the header): shared memory on one host, the network between hosts.
  TESSERA_ASSIGN_OR_RETURN(detail::UcxHandles handles,
                           detail::CreateUcxWorker(UCP_FEATURE_TAG, "tessera-collectives",
                                                   options_.network_only ? "tcp,self"
                                                   : options_.local_only ? "posix,sysv,self"
                                                                         : "^cma"));
  context_ = handles.context;
  worker_ = handles.worker;
  event_fd_ = handles.event_fd;
  ucp_address_t* worker_address = nullptr;
  size_t length = 0;
  TESSERA_UCX_RETURN_IF_ERROR(ucp_worker_get_address(worker_, &worker_address, &length),
                              "get worker address");
  PeerAddress mine;
  char hostname[256] = {};
  ::gethostname(hostname, sizeof(hostname) - 1);
  host_ = hostname;
  mine.host = host_;
  const LocalProcess self = ThisProcess();
  mine.pid = self.pid;
  mine.probe = self.probe;
  mine.worker.assign(reinterpret_cast<const char*>(worker_address), length);
  ucp_worker_release_address(worker_, worker_address);
  address_ = EncodeAddress(mine);
  return Status::Ok();
}

UcxPeerTransportImpl::~UcxPeerTransportImpl() {
  if (worker_ != nullptr) {
    if (!pending_.empty() && broken_.ok()) (void)Break(Cancelled("the transport was destroyed"));
    ReleaseLoose(/*wait=*/true);
    CloseEndpoints(/*force=*/!broken_.ok());
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
  for (int r = 0; r < size_; ++r) {
    Result<PeerAddress> decoded = DecodeAddress(addresses[static_cast<size_t>(r)]);
    if (!decoded.ok()) return decoded.status().WithContext(fmt::format("rank {}'s address", r));
    peers_[static_cast<size_t>(r)].address = std::move(decoded).value();
    peers_[static_cast<size_t>(r)].context = EndpointContext{this, r};
  }
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    Peer& peer = peers_[static_cast<size_t>(r)];
    const bool local = peer.address.host == host_ && !options_.network_only;
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(peer.address.worker.data());
    // Peer-failure mode costs shared memory in UCX 1.13: only for other hosts.
    params.err_mode = local ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &OnEndpointError;
    params.err_handler.arg = &peer.context;
    const ucs_status_t status = ucp_ep_create(worker_, &params, &peer.endpoint);
    if (status != UCS_OK) {
      return Break(Unavailable("rank {} cannot reach rank {}: UCX endpoint: {}", rank_, r,
                               ucs_status_string(status)));
    }
    if (local) {
      peer.single_copy = CanReadMemoryOf(LocalProcess{peer.address.pid, peer.address.probe});
    }
  }
  connected_ = true;
  const Clock::time_point now = Clock::now();
  for (Peer& peer : peers_) peer.last_heard = now;
  // Wire every endpoint up front (a flush completes once the peer has answered), so the first
  // collective does not pay for it and UCX 1.13 never starts a rendezvous on a half-wired
  // endpoint.
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    ucp_request_param_t param{};
    void* request = ucp_ep_flush_nbx(peers_[static_cast<size_t>(r)].endpoint, &param);
    if (UCS_PTR_IS_ERR(request)) {
      return Break(Unavailable("rank {} cannot wire up rank {}: {}", rank_, r,
                               ucs_status_string(UCS_PTR_STATUS(request))));
    }
    if (request == nullptr) continue;
    auto pending = std::make_unique<Pending>();
    pending->kind = Kind::kFlush;
    pending->peer = r;
    pending->request = request;
    TESSERA_ASSIGN_OR_RETURN(RequestId id, Track(std::move(pending)));
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

Result<PeerTransport::RequestId> UcxPeerTransportImpl::Track(std::unique_ptr<Pending> pending) {
  const RequestId id = next_id_++;
  pending_.emplace(id, std::move(pending));
  return id;
}

Result<PeerTransport::RequestId> UcxPeerTransportImpl::Isend(int peer, uint64_t tag,
                                                             const void* data, int64_t bytes) {
  TESSERA_RETURN_IF_ERROR(CheckRequest(peer, tag));
  Peer& target = peers_[static_cast<size_t>(peer)];
  stats_.bytes_sent += bytes;
  auto pending = std::make_unique<Pending>();
  pending->peer = peer;
  pending->bytes = bytes;
  pending->tag = tag;
  const void* payload = data;
  size_t payload_bytes = static_cast<size_t>(bytes);
  if (target.single_copy && bytes >= options_.single_copy_bytes) {
    // Single copy: the receiver reads the bytes itself and acknowledges under ack_tag.
    pending->kind = Kind::kCopySend;
    const uint64_t transfer = next_transfer_++;
    pending->descriptor =
        Descriptor{kDescriptorMagic, reinterpret_cast<uint64_t>(data), bytes, AckTag(transfer)};
    ucp_request_param_t receive{};
    receive.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    pending->request = ucp_tag_recv_nbx(worker_, &pending->ack, sizeof(pending->ack),
                                        AckTag(transfer), kFullMask, &receive);
    if (UCS_PTR_IS_ERR(pending->request)) {
      return Break(Unavailable("rank {} cannot post an acknowledgement receive: {}", rank_,
                               ucs_status_string(UCS_PTR_STATUS(pending->request))));
    }
    payload = &pending->descriptor;
    payload_bytes = sizeof(Descriptor);
  } else {
    pending->kind = Kind::kSend;
  }
  ucp_request_param_t param{};
  void* request =
      ucp_tag_send_nbx(target.endpoint, payload, payload_bytes, WireTag(rank_, tag), &param);
  if (UCS_PTR_IS_ERR(request)) {
    if (pending->request != nullptr) loose_.push_back(pending->request);
    return Break(Unavailable("rank {} cannot send to rank {}: {}", rank_, peer,
                             ucs_status_string(UCS_PTR_STATUS(request))));
  }
  if (pending->kind == Kind::kCopySend) {
    pending->descriptor_send = request;
  } else if (request == nullptr) {
    return next_id_++;  // sent already
  } else {
    pending->request = request;
  }
  return Track(std::move(pending));
}

Result<PeerTransport::RequestId> UcxPeerTransportImpl::Irecv(int peer, uint64_t tag, void* data,
                                                             int64_t bytes) {
  TESSERA_RETURN_IF_ERROR(CheckRequest(peer, tag));
  auto pending = std::make_unique<Pending>();
  pending->peer = peer;
  pending->bytes = bytes;
  pending->tag = tag;
  pending->data = static_cast<char*>(data);
  void* into = data;
  size_t capacity = static_cast<size_t>(bytes);
  // Both sides know the size, so both pick the same path.
  if (peers_[static_cast<size_t>(peer)].single_copy && bytes >= options_.single_copy_bytes) {
    pending->kind = Kind::kCopyReceive;
    into = &pending->descriptor;
    capacity = sizeof(Descriptor);
  } else {
    pending->kind = Kind::kReceive;
  }
  ucp_request_param_t param{};
  // Always a request (never immediate completion), so its length can be checked in Poll.
  param.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  pending->request =
      ucp_tag_recv_nbx(worker_, into, capacity, WireTag(peer, tag), kFullMask, &param);
  if (UCS_PTR_IS_ERR(pending->request)) {
    return Break(Unavailable("rank {} cannot receive from rank {}: {}", rank_, peer,
                             ucs_status_string(UCS_PTR_STATUS(pending->request))));
  }
  return Track(std::move(pending));
}

std::optional<Status> UcxPeerTransportImpl::Poll(Pending& pending) {
  auto size_mismatch = [&] {
    return Internal(
        "rank {} sent a message of another size than rank {} expected ({} bytes, tag "
        "{:#x}): the ranks disagree about the collective",
        pending.peer, rank_, pending.bytes, pending.tag);
  };
  auto failed = [&](ucs_status_t status) {
    return Unavailable("transfer between rank {} and rank {} failed: {}", rank_, pending.peer,
                       ucs_status_string(status));
  };
  if (pending.kind == Kind::kCopySend && pending.descriptor_send != nullptr) {
    const ucs_status_t sent = ucp_request_check_status(pending.descriptor_send);
    if (sent != UCS_INPROGRESS) {
      ucp_request_free(pending.descriptor_send);
      pending.descriptor_send = nullptr;
      if (sent != UCS_OK) return failed(sent);
    }
  }
  ucs_status_t status;
  ucp_tag_recv_info_t info{};
  const bool receive = pending.kind == Kind::kReceive || pending.kind == Kind::kCopyReceive ||
                       pending.kind == Kind::kCopySend;
  status = receive ? ucp_tag_recv_request_test(pending.request, &info)
                   : ucp_request_check_status(pending.request);
  if (status == UCS_INPROGRESS) return std::nullopt;
  ucp_request_free(pending.request);
  pending.request = nullptr;
  if (pending.kind == Kind::kCopySend && pending.descriptor_send != nullptr) {
    // Acknowledged, so the descriptor arrived; UCX may still be completing its send.
    loose_.push_back(pending.descriptor_send);
    pending.descriptor_send = nullptr;
  }
  if (status == UCS_ERR_MESSAGE_TRUNCATED) return size_mismatch();
  if (status != UCS_OK) return failed(status);
  switch (pending.kind) {
    case Kind::kReceive:
      if (static_cast<int64_t>(info.length) != pending.bytes) return size_mismatch();
      return Status::Ok();
    case Kind::kCopyReceive:
      if (info.length != sizeof(Descriptor) || pending.descriptor.magic != kDescriptorMagic ||
          pending.descriptor.bytes != pending.bytes) {
        return size_mismatch();
      }
      return FinishCopyReceive(pending);
    default:
      return Status::Ok();
  }
}

Status UcxPeerTransportImpl::FinishCopyReceive(Pending& pending) {
  Peer& peer = peers_[static_cast<size_t>(pending.peer)];
  const int error =
      ReadMemoryOf(peer.address.pid, pending.descriptor.address, pending.data, pending.bytes);
  if (error != 0) {
    return Unavailable("rank {} died or vanished: rank {} cannot read its memory (pid {}): {}",
                       pending.peer, rank_, peer.address.pid, std::strerror(error));
  }
  stats_.single_copy_bytes_received += pending.bytes;
  ucp_request_param_t param{};
  void* ack = ucp_tag_send_nbx(peer.endpoint, &kAckWord, sizeof(kAckWord),
                               pending.descriptor.ack_tag, &param);
  if (UCS_PTR_IS_ERR(ack)) {
    return Unavailable("rank {} cannot acknowledge rank {}: {}", rank_, pending.peer,
                       ucs_status_string(UCS_PTR_STATUS(ack)));
  }
  if (ack != nullptr) loose_.push_back(ack);
  return Status::Ok();
}

void UcxPeerTransportImpl::OnEndpointError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* context = static_cast<EndpointContext*>(arg);
  UcxPeerTransportImpl& self = *context->self;
  if (!self.peer_failure_.ok()) return;
  self.peer_failure_ = Unavailable(
      "rank {} died or its link broke: rank {} lost its connection "
      "to it ({})",
      context->peer, self.rank_, ucs_status_string(status));
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

void UcxPeerTransportImpl::ReleaseLoose(bool wait) {
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(1);
  std::erase_if(loose_, [&](void* request) {
    if (wait) Release(request, deadline);
    if (ucp_request_check_status(request) == UCS_INPROGRESS) return false;
    ucp_request_free(request);
    return true;
  });
}

Status UcxPeerTransportImpl::Wait(const std::vector<RequestId>& requests,
                                  Clock::time_point deadline) {
  if (!broken_.ok()) return broken_;
  std::vector<RequestId> waiting(requests);
  Clock::time_point last_event = Clock::now();
  while (true) {
    if (Progress()) last_event = Clock::now();
    if (aborted_.load(std::memory_order_acquire)) {
      MutexLock lock(&abort_mutex_);
      return Break(abort_reason_);
    }
    if (!peer_failure_.ok()) return Break(peer_failure_);
    auto done = [&](RequestId id) {
      auto it = pending_.find(id);
      if (it == pending_.end()) return true;  // completed at once, or waited for before
      Pending& pending = *it->second;
      std::optional<Status> status = Poll(pending);
      if (!status) return false;
      peers_[static_cast<size_t>(pending.peer)].last_heard = Clock::now();
      if (!status->ok() && broken_.ok()) (void)Break(*status);
      pending_.erase(id);
      return true;
    };
    std::erase_if(waiting, done);
    if (!loose_.empty()) ReleaseLoose(/*wait=*/false);
    if (!broken_.ok()) return broken_;
    if (waiting.empty()) return Status::Ok();
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      // Blame the peer silent the longest among those this wait needs.
      int peer = pending_.at(waiting.front())->peer;
      for (RequestId id : waiting) {
        const int candidate = pending_.at(id)->peer;
        if (peers_[static_cast<size_t>(candidate)].last_heard <
            peers_[static_cast<size_t>(peer)].last_heard) {
          peer = candidate;
        }
      }
      failure_silence_ms_ = MillisecondsBetween(peers_[static_cast<size_t>(peer)].last_heard, now);
      failure_silent_peer_ = peer;
      return Break(
          TimedOut("rank {} heard nothing from rank {} for {} ms: rank {} is stuck, or "
                   "the link to it is down",
                   rank_, peer, failure_silence_ms_, peer));
    }
    if (now - last_event > std::chrono::microseconds(options_.spin_microseconds)) {
      Sleep(static_cast<int>(std::clamp<int64_t>(MillisecondsBetween(now, deadline) + 1, 1, 100)));
      last_event = Clock::now();  // spin again after waking
    } else {
      // Between polls the core goes to whoever else can run on it: where ranks outnumber the
      // cores, that is often the peer this wait is for (UcxPeerTransportOptions).
      std::this_thread::yield();
    }
  }
}

void UcxPeerTransportImpl::Abort(const Status& reason) {
  {
    MutexLock lock(&abort_mutex_);
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
    if (pending->request != nullptr && pending->kind != Kind::kSend &&
        pending->kind != Kind::kFlush) {
      ucp_request_cancel(worker_, pending->request);
    }
  }
  // Forcing the endpoints closed completes the sends with an error; no request then touches
  // the caller's buffers through UCX. (A local peer may still be reading a single-copy send's
  // buffer; it is failing too, and a read of freed memory fails rather than crashes.)
  CloseEndpoints(/*force=*/true);
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(1);
  for (auto& [id, pending] : pending_) {
    for (void* request : {pending->request, pending->descriptor_send}) {
      if (request == nullptr) continue;
      Release(request, deadline);
      ucp_request_free(request);
    }
  }
  pending_.clear();
  return broken_;
}

void UcxPeerTransportImpl::Release(void* request, Clock::time_point deadline) {
  while (ucp_request_check_status(request) == UCS_INPROGRESS && Clock::now() < deadline) {
    if (!Progress()) std::this_thread::yield();
  }
}

void UcxPeerTransportImpl::CloseEndpoints(bool force) {
  for (Peer& peer : peers_) {
    if (peer.endpoint == nullptr) continue;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* request = ucp_ep_close_nbx(peer.endpoint, &param);
    if (request != nullptr && !UCS_PTR_IS_ERR(request)) {
      // A graceful close flushes; a dead peer must not hold the process forever.
      Release(request, Clock::now() + std::chrono::seconds(force ? 1 : 5));
      ucp_request_free(request);
    }
    peer.endpoint = nullptr;
  }
}

}  // namespace

Result<std::unique_ptr<UcxPeerTransport>> UcxPeerTransport::Create(
    int rank, int size, const UcxPeerTransportOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return InvalidArgument("rank {} of a group of {} is not a rank", rank, size);
  }
  if (static_cast<uint64_t>(size) >= kAckRank) {
    return InvalidArgument("a group of {} ranks is larger than UCX tags can address", size);
  }
  auto transport = std::make_unique<UcxPeerTransportImpl>(rank, size, options);
  TESSERA_RETURN_IF_ERROR(transport->Init());
  return std::unique_ptr<UcxPeerTransport>(std::move(transport));
}

}  // namespace tessera

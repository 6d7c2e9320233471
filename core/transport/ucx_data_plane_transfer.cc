// The UCX data plane's transfers: serving chunks (the holder's side), pulling them (the
// puller's side), and pushes (both sides), lent by address on one host or sent by UCX.
#include <cstring>

#include "core/transport/ucx_data_plane_internal.h"

#include "core/logging.h"
#include "core/transport/ucx_common.h"

namespace tessera::detail {

// ---- Serving (the holder's side) ----

ucs_status_t UcxDataPlane::OnGetChunk(void* arg, const void* header, size_t header_length,
                                      void* /*data*/, size_t /*length*/,
                                      const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  const ucp_ep_h ep = SenderOf(param);
  const std::optional<GetChunkHeader> request = ReadHeader<GetChunkHeader>(header, header_length);
  if (!request || !self->connections_.contains(ep)) {
    self->CountRefused();
    return UCS_OK;  // malformed, or not from a connection to this process: drop it
  }
  ServeRequest serve;
  serve.reply_ep = ep;
  serve.header = *request;
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
    // The requester's connection failed after it asked (OnEndpointError closed its endpoint in
    // the same progress): no one to answer, and its endpoint must not be used.
    if (!connections_.contains(serve.reply_ep)) continue;
    const GetChunkHeader& h = serve.header;
    Result<ServedObject> object = lookup_(ObjectId(h.object));
    if (!object.ok()) {
      SendReply(serve.reply_ep, h.request, object.status(), nullptr, 0, nullptr);
      continue;
    }
    if (Status inside = CheckChunkRequest(h, object->bytes); !inside.ok()) {
      CountRefused();
      SendReply(serve.reply_ep, h.request, inside, nullptr, 0, nullptr);
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
    const ChunkHeader header{request, 0, kByAddress, length, reinterpret_cast<uint64_t>(data)};
    SendControl(ep, kChunk, &header, sizeof(header));
    return;
  }
  if (!status.ok()) {
    // No bytes of any object: the header says the error and the payload is its text.
    const std::string_view text = std::string_view(status.message()).substr(0, kMaxErrorText);
    const ChunkHeader header{request, static_cast<int32_t>(status.code()), 0,
                             static_cast<int64_t>(text.size()), 0};
    SendControl(ep, kChunk, &header, sizeof(header), text);
    return;
  }
  auto* operation = new Operation{this, std::move(keepalive), {}, 0, length};
  const ChunkHeader header{request, 0, 0, length, 0};
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
  const std::optional<ChunkReadHeader> decoded = ReadHeader<ChunkReadHeader>(header, header_length);
  if (!decoded || self->AuthenticatedConnection(ep) == nullptr) {
    self->CountRefused();
    return UCS_OK;
  }
  self->lent_chunks_.erase({ep, decoded->request});  // releases the object
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
    operation->payload.resize(sizeof(GetChunkHeader));
    const GetChunkHeader header{request, pull.object.value(),   pull.next_offset,
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
  const std::optional<ChunkHeader> decoded = ReadHeader<ChunkHeader>(header, header_length);
  if (!decoded) {
    self->CountRefused();
    return UCS_OK;
  }
  const ChunkHeader& chunk_header = *decoded;
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
  if (Status fits = CheckChunkReply(chunk_header, length, AskedChunk{asked.length, asked.lent});
      !fits.ok()) {
    self->ChunkDone(request, fits, 0);
    return UCS_OK;
  }
  if ((chunk_header.flags & kByAddress) != 0) {
    // A lent chunk: copy it out of the holder's memory, then tell the holder it may let go. The
    // process read is the one the handshake named, never one a reply names.
    const int error = ReadMemoryOf(holder->holder.pid, chunk_header.address,
                                   owner.dest + asked.offset, asked.length);
    const ChunkReadHeader read{request};
    self->SendControl(holder->ep, kChunkRead, &read, sizeof(read));
    self->ChunkDone(request,
                    error == 0
                        ? Status::Ok()
                        : Unavailable("the holder (pid {}) vanished while lending a chunk: {}",
                                      holder->holder.pid, std::strerror(error)),
                    error == 0 ? asked.length : 0);
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
  const WirePushKey wire_key{key.graph, key.instance, key.object};
  if (peer.peer_reads_us && bytes > 0) {
    // Lend it: the receiver reads it from here and acknowledges (OnPushRead).
    lent_pushes_[push_id] =
        LentPush{address, std::move(keepalive), std::move(done), bytes,
                 Clock::now() + std::chrono::milliseconds(options_.pull_timeout_ms)};
    const PushHeader header{wire_key,   bytes, push_id, reinterpret_cast<uint64_t>(data),
                            kByAddress, 0};
    SendControl(ep, kPush, &header, sizeof(header));
    return;
  }
  auto* operation = new Operation{this, std::move(keepalive), {}, 0, bytes};
  operation->done = std::move(done);
  operation->payload.resize(sizeof(PushHeader));
  const PushHeader header{wire_key, bytes, push_id, 0, 0, 0};
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
  const std::optional<PushHeader> decoded = ReadHeader<PushHeader>(header, header_length);
  if (connection == nullptr || !decoded || !self->push_.accept) {
    // Not from a member of the cluster (or malformed): nothing is delivered, and a rendezvous
    // sender's send fails.
    self->CountRefused();
    return rendezvous ? UCS_ERR_REJECTED : UCS_OK;
  }
  const PushHeader& push = *decoded;
  const PushKey key{push.key.graph, push.key.instance, push.key.object};
  PushReceive receive{key, nullptr, push.length, ep, push};
  // A negative length, unknown flags, or a payload that is not the announced length.
  if (Status valid = CheckPush(push, length); !valid.ok()) {
    self->push_.delivered(key, valid);
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
  // As for serves: a sender whose connection has failed since is not answered.
  if (!connections_.contains(push.reply_ep)) return;
  const PushReadHeader ack{push.header.push_id, static_cast<int32_t>(status.code()), 0};
  SendControl(push.reply_ep, kPushRead, &ack, sizeof(ack));
}

ucs_status_t UcxDataPlane::OnPushRead(void* arg, const void* header, size_t header_length,
                                      void* /*data*/, size_t /*length*/,
                                      const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  const std::optional<PushReadHeader> decoded = ReadHeader<PushReadHeader>(header, header_length);
  if (!decoded) {
    self->CountRefused();
    return UCS_OK;
  }
  const PushReadHeader& ack = *decoded;
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

}  // namespace tessera::detail

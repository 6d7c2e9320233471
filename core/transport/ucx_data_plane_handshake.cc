// The UCX data plane's token handshake (data_plane_wire.h): the holder's side (OnConnection,
// OnHello) and the client's (OnChallenge, OnWelcome, then wire-up), and looking up peers and
// connections by endpoint.
#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>
#include <memory>
#include <string>

#include "core/transport/ucx_data_plane_internal.h"

#include "core/logging.h"
#include "core/transport/ucx_common.h"

namespace tessera::detail {

// ---- Handshake ----

namespace {

// The client's IP address ("?" when UCX cannot say): pending connections are capped per address.
std::string ClientAddressOf(ucp_conn_request_h request) {
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  if (ucp_conn_request_query(request, &attr) != UCS_OK) return "?";
  char text[INET6_ADDRSTRLEN] = {};
  const auto* address = reinterpret_cast<const sockaddr*>(&attr.client_address);
  const void* bytes =
      address->sa_family == AF_INET6
          ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr)
          : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(address)->sin_addr);
  if (::inet_ntop(address->sa_family, bytes, text, sizeof(text)) == nullptr) return "?";
  return text;
}

}  // namespace

void UcxDataPlane::OnConnection(ucp_conn_request_h request, void* arg) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  std::string client = ClientAddressOf(request);
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
  // Pending until its Hello proves the token: at a cap, the oldest pending one makes room.
  int64_t evicted = 0;
  for (uint64_t oldest : self->pending_.Add(PendingId(ep), std::move(client), Clock::now())) {
    self->DropConnection(PendingEndpoint(oldest));
    ++evicted;
  }
  self->UpdatePendingStats(evicted);
  if (const Status random = FillRandom(connection.nonce); !random.ok()) {
    GetLogger("data_plane")->error("refusing a data-plane connection: {}", random.ToString());
    connection.refused = true;  // closed at its deadline
    return;
  }
  const ChallengeHeader challenge{kWireMagic, kWireVersion, connection.nonce, self->self_};
  self->SendControl(ep, kChallenge, &challenge, sizeof(challenge));
}

ucs_status_t UcxDataPlane::OnChallenge(void* arg, const void* header, size_t header_length,
                                       void* /*data*/, size_t /*length*/,
                                       const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  std::string address;
  Peer* peer = self->PeerOfEndpoint(SenderOf(param), &address);
  const std::optional<ChallengeHeader> decoded = ReadHeader<ChallengeHeader>(header, header_length);
  if (peer == nullptr || peer->challenged || !decoded) {
    self->CountRefused();
    return UCS_OK;
  }
  const ChallengeHeader& challenge = *decoded;
  if (Status spoken = CheckHandshake(challenge.magic, challenge.version); !spoken.ok()) {
    self->FailPullsTo(address, spoken.WithContext(fmt::format("data-plane peer {}", address)));
    return UCS_OK;
  }
  peer->challenged = true;
  peer->holder_nonce = challenge.nonce;
  peer->holder = challenge.holder;
  if (const Status random = FillRandom(peer->nonce); !random.ok()) {
    self->FailPullsTo(address, random);
    return UCS_OK;
  }
  const HelloHeader hello{kWireMagic, kWireVersion, peer->nonce, self->self_,
                          HandshakeProof(self->key_, "client", peer->holder_nonce, peer->nonce,
                                         peer->holder, self->self_)};
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
  const std::optional<HelloHeader> decoded = ReadHeader<HelloHeader>(header, header_length);
  if (!decoded) {
    self->Refuse(ep, connection, InvalidArgument("malformed data-plane hello"));
    return UCS_OK;
  }
  const HelloHeader& hello = *decoded;
  if (Status spoken = CheckHandshake(hello.magic, hello.version); !spoken.ok()) {
    self->Refuse(ep, connection, spoken.WithContext(fmt::format("asked of {}", self->address_)));
    return UCS_OK;
  }
  const Sha256Digest expected = HandshakeProof(self->key_, "client", connection.nonce, hello.nonce,
                                               self->self_, hello.client);
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
  self->pending_.Remove(PendingId(ep));
  self->UpdatePendingStats(0);
  connection.client = hello.client;
  connection.reads_client = CanReadMemoryOf(FromWire(hello.client));
  const WelcomeHeader welcome{0, connection.reads_client ? 1u : 0u,
                              HandshakeProof(self->key_, "holder", connection.nonce, hello.nonce,
                                             self->self_, hello.client)};
  self->SendControl(ep, kWelcome, &welcome, sizeof(welcome));
  return UCS_OK;
}

void UcxDataPlane::Refuse(ucp_ep_h ep, Connection& connection, const Status& reason) {
  CountRefused();
  connection.refused = true;  // still pending: closed at its deadline, after the answer went out
  const WelcomeHeader welcome{static_cast<int32_t>(reason.code()), 0, {}};
  SendControl(ep, kWelcome, &welcome, sizeof(welcome),
              std::string_view(reason.message()).substr(0, kMaxErrorText));
}

ucs_status_t UcxDataPlane::OnWelcome(void* arg, const void* header, size_t header_length,
                                     void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxDataPlane*>(arg);
  std::string address;
  Peer* peer = self->PeerOfEndpoint(SenderOf(param), &address);
  const std::optional<WelcomeHeader> decoded = ReadHeader<WelcomeHeader>(header, header_length);
  if (peer == nullptr || !peer->challenged || peer->stage != Peer::Stage::kHandshake || !decoded) {
    self->CountRefused();
    return UCS_OK;
  }
  const WelcomeHeader& welcome = *decoded;
  if (welcome.status != 0) {
    self->FailPullsTo(address, WireStatus(welcome.status, ErrorText(data, length, param))
                                   .WithContext(fmt::format("data-plane peer {}", address)));
    return UCS_OK;
  }
  const Sha256Digest expected = HandshakeProof(self->key_, "holder", peer->holder_nonce,
                                               peer->nonce, peer->holder, self->self_);
  if (!ConstantTimeEquals(expected, welcome.proof)) {
    self->FailPullsTo(address, Unavailable("data-plane peer {} did not prove it holds the cluster "
                                           "token: nothing is taken from or sent to it",
                                           address));
    return UCS_OK;
  }
  peer->reads_peer = CanReadMemoryOf(FromWire(peer->holder));
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
  } else if (self->connections_.erase(ep) > 0) {
    // A peer's connection to this process failed (the peer went away): its endpoint is closed,
    // not kept until the worker stops.
    self->pending_.Remove(PendingId(ep));
    self->UpdatePendingStats(0);
    self->CloseEndpoint(ep);
  }
}

}  // namespace tessera::detail

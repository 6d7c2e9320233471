#include "raw_data_plane_peer.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <chrono>
#include <cstring>

#include "core/transport/local_memory.h"
#include "core/transport/ucx_common.h"

namespace tessera::testing {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint16_t kFirstId = detail::kGetChunk;
constexpr uint16_t kLastId = detail::kWelcome;

struct RendezvousReceive {
  RawDataPlanePeer::Message message;
  std::deque<RawDataPlanePeer::Message>* into;
  int* in_flight;
};

Result<sockaddr_in> Parse(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return InvalidArgument("'{}' is not HOST:PORT", address);
  sockaddr_in where{};
  where.sin_family = AF_INET;
  where.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  if (::inet_pton(AF_INET, address.substr(0, colon).c_str(), &where.sin_addr) != 1) {
    return InvalidArgument("'{}' is not an IPv4 address", address);
  }
  return where;
}

}  // namespace

Status RawDataPlanePeer::Init() {
  TESSERA_ASSIGN_OR_RETURN(
      detail::UcxHandles handles,
      detail::CreateUcxWorker(UCP_FEATURE_AM, "raw-peer", "^cma", /*indirect_ids=*/true));
  context_ = handles.context;
  worker_ = handles.worker;
  for (uint16_t id = kFirstId; id <= kLastId; ++id) {
    handlers_.push_back(std::make_unique<Handler>(Handler{this, id}));
    ucp_am_handler_param_t handler{};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                         UCP_AM_HANDLER_PARAM_FIELD_ARG;
    handler.id = id;
    handler.cb = &OnMessage;
    handler.arg = handlers_.back().get();
    TESSERA_UCX_RETURN_IF_ERROR(ucp_worker_set_am_recv_handler(worker_, &handler), "handler");
  }
  return Status::Ok();
}

Result<std::unique_ptr<RawDataPlanePeer>> RawDataPlanePeer::Connect(const std::string& address) {
  std::unique_ptr<RawDataPlanePeer> peer(new RawDataPlanePeer());
  TESSERA_RETURN_IF_ERROR(peer->Init());
  peer->address_ = address;
  TESSERA_ASSIGN_OR_RETURN(peer->endpoint_, peer->OpenEndpoint());
  return peer;
}

Result<ucp_ep_h> RawDataPlanePeer::OpenEndpoint() {
  TESSERA_ASSIGN_OR_RETURN(sockaddr_in where, Parse(address_));
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&where);
  params.sockaddr.addrlen = sizeof(where);
  ucp_ep_h ep = nullptr;
  TESSERA_UCX_RETURN_IF_ERROR(ucp_ep_create(worker_, &params, &ep), "endpoint create");
  endpoints_.push_back(ep);
  return ep;
}

Status RawDataPlanePeer::OpenMore(int count) {
  if (listener_ != nullptr) return InvalidArgument("OpenMore is for a peer made by Connect");
  for (int i = 0; i < count; ++i) TESSERA_RETURN_IF_ERROR(OpenEndpoint().status());
  return Status::Ok();
}

Result<std::unique_ptr<RawDataPlanePeer>> RawDataPlanePeer::Listen() {
  std::unique_ptr<RawDataPlanePeer> peer(new RawDataPlanePeer());
  TESSERA_RETURN_IF_ERROR(peer->Init());
  sockaddr_in where{};
  where.sin_family = AF_INET;
  where.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ucp_listener_params_t params{};
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&where);
  params.sockaddr.addrlen = sizeof(where);
  params.conn_handler.cb = &OnConnection;
  params.conn_handler.arg = peer.get();
  TESSERA_UCX_RETURN_IF_ERROR(ucp_listener_create(peer->worker_, &params, &peer->listener_),
                              "listen");
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  TESSERA_UCX_RETURN_IF_ERROR(ucp_listener_query(peer->listener_, &attr), "listener query");
  peer->address_ = fmt::format(
      "127.0.0.1:{}", ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port));
  return peer;
}

RawDataPlanePeer::~RawDataPlanePeer() {
  std::vector<void*> closing;
  for (ucp_ep_h ep : endpoints_) {
    // Forced where UCX allows it (peer-failure mode), else flushed (data_plane.h says why).
    ucp_request_param_t params{};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    params.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* request = ucp_ep_close_nbx(ep, &params);
    if (UCS_PTR_IS_ERR(request) && UCS_PTR_STATUS(request) == UCS_ERR_INVALID_PARAM) {
      params.flags = 0;
      request = ucp_ep_close_nbx(ep, &params);
    }
    if (request != nullptr && !UCS_PTR_IS_ERR(request)) closing.push_back(request);
  }
  const auto until = Clock::now() + std::chrono::seconds(2);
  while ((!closing.empty() || rendezvous_in_flight_ > 0) && Clock::now() < until) {
    ucp_worker_progress(worker_);
    std::erase_if(closing, [](void* request) {
      if (ucp_request_check_status(request) == UCS_INPROGRESS) return false;
      ucp_request_free(request);
      return true;
    });
  }
  for (void* request : closing) ucp_request_free(request);  // UCX frees them with the worker
  if (listener_ != nullptr) ucp_listener_destroy(listener_);
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

detail::WireProcess RawDataPlanePeer::process() const { return detail::ToWire(ThisProcess()); }

void RawDataPlanePeer::OnConnection(ucp_conn_request_h request, void* arg) {
  auto* self = static_cast<RawDataPlanePeer*>(arg);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
  params.conn_request = request;
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(self->worker_, &params, &ep) == UCS_OK) {
    self->endpoints_.push_back(ep);
    self->endpoint_ = ep;
  }
}

ucs_status_t RawDataPlanePeer::OnMessage(void* arg, const void* header, size_t header_length,
                                         void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* handler = static_cast<Handler*>(arg);
  RawDataPlanePeer* self = handler->peer;
  Message message;
  message.id = handler->id;
  const auto* header_bytes = static_cast<const uint8_t*>(header);
  message.header.assign(header_bytes, header_bytes + header_length);
  message.from = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    auto* receive =
        new RendezvousReceive{std::move(message), &self->received_, &self->rendezvous_in_flight_};
    receive->message.rendezvous = true;
    receive->message.payload.resize(length);
    ucp_request_param_t params{};
    params.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    params.cb.recv_am = [](void* request, ucs_status_t, size_t, void* user_data) {
      std::unique_ptr<RendezvousReceive> done(static_cast<RendezvousReceive*>(user_data));
      --*done->in_flight;
      done->into->push_back(std::move(done->message));
      ucp_request_free(request);
    };
    params.user_data = receive;
    ++self->rendezvous_in_flight_;
    ucs_status_ptr_t started =
        ucp_am_recv_data_nbx(self->worker_, data, receive->message.payload.data(), length, &params);
    if (UCS_PTR_IS_ERR(started)) {
      --self->rendezvous_in_flight_;
      delete receive;
      return UCS_OK;
    }
    return UCS_INPROGRESS;
  }
  const auto* bytes = static_cast<const uint8_t*>(data);
  message.payload.assign(bytes, bytes + length);
  self->received_.push_back(std::move(message));
  return UCS_OK;
}

Status RawDataPlanePeer::Send(ucp_ep_h ep, uint16_t id, const void* header, size_t header_length,
                              const void* payload, size_t payload_length, bool reply,
                              uint32_t flags, int timeout_ms) {
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  params.flags = flags | (reply ? UCP_AM_SEND_FLAG_REPLY : 0);
  ucs_status_ptr_t request =
      ucp_am_send_nbx(ep, id, header, header_length, payload, payload_length, &params);
  if (request == nullptr) return Status::Ok();
  if (UCS_PTR_IS_ERR(request))
    return Unavailable("send: {}", ucs_status_string(UCS_PTR_STATUS(request)));
  const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
  ucs_status_t status = UCS_INPROGRESS;
  while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS && Clock::now() < until) {
    ucp_worker_progress(worker_);
  }
  if (status == UCS_INPROGRESS) {
    ucp_request_cancel(worker_, request);
    while (ucp_request_check_status(request) == UCS_INPROGRESS) ucp_worker_progress(worker_);
  }
  ucp_request_free(request);
  if (status == UCS_INPROGRESS) return TimedOut("send of message {} did not complete", id);
  if (status != UCS_OK) return Unavailable("send of message {}: {}", id, ucs_status_string(status));
  return Status::Ok();
}

std::optional<RawDataPlanePeer::Message> RawDataPlanePeer::Next(uint16_t id, int timeout_ms) {
  const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    for (auto it = received_.begin(); it != received_.end(); ++it) {
      if (it->id == id) {
        Message message = std::move(*it);
        received_.erase(it);
        return message;
      }
    }
    if (Clock::now() >= until) return std::nullopt;
    ucp_worker_progress(worker_);
  }
}

void RawDataPlanePeer::ProgressFor(int ms) {
  const auto until = Clock::now() + std::chrono::milliseconds(ms);
  while (Clock::now() < until) ucp_worker_progress(worker_);
}

std::vector<ucp_ep_h> RawDataPlanePeer::TakeNewConnections(int timeout_ms) {
  const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
  do {
    ucp_worker_progress(worker_);
  } while (endpoints_.size() == connections_taken_ && Clock::now() < until);
  std::vector<ucp_ep_h> fresh(endpoints_.begin() + static_cast<ptrdiff_t>(connections_taken_),
                              endpoints_.end());
  connections_taken_ = endpoints_.size();
  return fresh;
}

std::vector<RawDataPlanePeer::Message> RawDataPlanePeer::TakeAll() {
  std::vector<Message> all(std::make_move_iterator(received_.begin()),
                           std::make_move_iterator(received_.end()));
  received_.clear();
  return all;
}

Result<RawDataPlanePeer::Welcomed> RawDataPlanePeer::Handshake(std::string_view token) {
  std::optional<Message> challenge_message = Next(detail::kChallenge);
  if (!challenge_message) return TimedOut("no challenge from {}", address_);
  const auto challenge = challenge_message->As<detail::ChallengeHeader>();
  const Sha256Digest key = detail::DataPlaneKey(token);
  detail::HelloHeader hello{detail::kWireMagic, detail::kWireVersion, {}, process(), {}};
  TESSERA_RETURN_IF_ERROR(FillRandom(hello.nonce));
  hello.proof = detail::HandshakeProof(key, "client", challenge.nonce, hello.nonce,
                                       challenge.holder, hello.client);
  TESSERA_RETURN_IF_ERROR(Send(detail::kHello, hello));
  std::optional<Message> welcome_message = Next(detail::kWelcome);
  if (!welcome_message) return TimedOut("no welcome from {}", address_);
  Welcomed welcomed;
  welcomed.header = welcome_message->As<detail::WelcomeHeader>();
  welcomed.text = welcome_message->text();
  welcomed.holder_proved = ConstantTimeEquals(
      welcomed.header.proof, detail::HandshakeProof(key, "holder", challenge.nonce, hello.nonce,
                                                    challenge.holder, hello.client));
  return welcomed;
}

}  // namespace tessera::testing

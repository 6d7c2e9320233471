// RawDataPlanePeer: speaks raw UCX active messages to a Tessera data plane, the way an attacker or
// a broken client would. It sends whatever header and payload bytes it is given and records every
// message that comes back, so tests can check what a data plane does with bad input. It can
// connect to a data plane (a client: puller or pusher) or listen for one (posing as a holder).
//
// Single-threaded: every method runs the UCX worker itself; the data plane under test runs its
// own progress thread, in this process or another.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ucp/api/ucp.h>

#include "core/status.h"
#include "core/transport/data_plane_wire.h"

namespace tessera::testing {

class RawDataPlanePeer {
 public:
  struct Message {
    uint16_t id = 0;
    std::vector<uint8_t> header;
    std::vector<uint8_t> payload;  // eager bytes, or rendezvous data received in full
    bool rendezvous = false;
    ucp_ep_h from = nullptr;  // the endpoint it came on (reply endpoint), if the sender named it
    template <typename Header>
    Header As() const {
      Header value{};
      std::memcpy(&value, header.data(), std::min(header.size(), sizeof(Header)));
      return value;
    }
    std::string text() const { return std::string(payload.begin(), payload.end()); }
  };

  // Connects to the data plane at `address` ("host:port").
  static Result<std::unique_ptr<RawDataPlanePeer>> Connect(const std::string& address);
  // Connect(): opens `count` more endpoints to the same data plane, from this one UCX worker,
  // which then say nothing (a flood of silent peers). endpoint() stays the first one. UCX
  // connects them as this peer's worker progresses (ProgressFor) and, partly, on its own thread.
  Status OpenMore(int count);
  // Listens on 127.0.0.1 (any port): data planes that pull from address() connect here.
  static Result<std::unique_ptr<RawDataPlanePeer>> Listen();
  ~RawDataPlanePeer();

  const std::string& address() const { return address_; }
  // Connect(): the endpoint to the data plane. Listen(): the latest accepted endpoint.
  ucp_ep_h endpoint() const { return endpoint_; }
  // What this peer claims to be in handshakes.
  detail::WireProcess process() const;

  // Sends one active message and progresses until it is sent (or `timeout_ms` passes). `reply`:
  // name this endpoint to the receiver (UCP_AM_SEND_FLAG_REPLY); `flags`: more UCP_AM_SEND_FLAG_*.
  Status Send(ucp_ep_h ep, uint16_t id, const void* header, size_t header_length,
              const void* payload = nullptr, size_t payload_length = 0, bool reply = true,
              uint32_t flags = 0, int timeout_ms = 5000);
  template <typename Header>
  Status Send(uint16_t id, const Header& header, std::string_view payload = {}) {
    return Send(endpoint_, id, &header, sizeof(header), payload.data(), payload.size());
  }

  // The next message with `id`, waiting up to `timeout_ms`; nullopt if none came.
  std::optional<Message> Next(uint16_t id, int timeout_ms = 5000);
  // Progresses for `ms` milliseconds, recording what arrives.
  void ProgressFor(int ms);
  // Listen(): endpoints data planes opened to this peer since the last call, waiting up to
  // `timeout_ms` for at least one.
  std::vector<ucp_ep_h> TakeNewConnections(int timeout_ms = 0);
  // Every message received so far that no Next() took, and forgets them.
  std::vector<Message> TakeAll();

  // Client side of the handshake (data_plane_wire.h) with `token`: waits for the challenge,
  // sends Hello, returns the Welcome (check its status; `holder_proved` says whether its proof
  // was right for the token).
  struct Welcomed {
    detail::WelcomeHeader header{};
    std::string text;
    bool holder_proved = false;
  };
  Result<Welcomed> Handshake(std::string_view token);

 private:
  RawDataPlanePeer() = default;
  Status Init();
  // A new endpoint to address_ (a client's).
  Result<ucp_ep_h> OpenEndpoint();
  static ucs_status_t OnMessage(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  static void OnConnection(ucp_conn_request_h request, void* arg);

  struct Handler {
    RawDataPlanePeer* peer;
    uint16_t id;
  };
  std::vector<std::unique_ptr<Handler>> handlers_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  ucp_ep_h endpoint_ = nullptr;
  std::vector<ucp_ep_h> endpoints_;
  size_t connections_taken_ = 0;
  std::string address_;
  std::deque<Message> received_;
  int rendezvous_in_flight_ = 0;
};

}  // namespace tessera::testing

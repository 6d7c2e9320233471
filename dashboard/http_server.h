// HttpServer: a small HTTP/1.1 server (Boost.Beast) for the dashboard, on the caller's
// io_context: every handler runs on the thread that runs that context, so the handler may read
// state owned by that thread (the scheduler's io thread) without locks.
//
// Hostile or broken clients are bounded, never fatal: a request's header and body are capped (an
// oversized or malformed request gets 400 or 413 and the connection closes), and a connection
// that has not sent a whole request within `idle_timeout_ms` (of connecting, or of the previous
// response on a kept-alive connection) is closed. At most `max_connections` are open at once,
// and at most `max_pending_per_address` of one client address wait for a request; at either cap
// the connection that has waited longest for a request is closed to make room (a kept-alive
// browser just reconnects), so slow or silent clients cannot lock others out. Only when every
// connection is busy answering is a new one closed on accept. Out of descriptors, accepting
// pauses 100 ms at a time instead of spinning. Waiting connections are tracked by
// core/pending_connections.h, the policy the control and data planes apply too.
//
// The response comes from the injected handler (http_handler.h); the server adds
// Content-Length, Cache-Control: no-store and conservative security headers.
//
// Thread safety: Start and Close from any thread before/after the context runs, or on its
// thread; the handler is called on the context's thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/status.h"
#include "dashboard/http_handler.h"

namespace boost::asio {
class io_context;
}

namespace tessera::dashboard {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0: any free port
  int max_connections = 64;
  uint32_t header_limit_bytes = 16 * 1024;
  uint32_t body_limit_bytes = 4 * 1024;  // the dashboard's requests carry no body
  int64_t idle_timeout_ms = 5'000;       // the scheduler passes the preauth_deadline_ms setting
  int max_pending_per_address = 64;      // the preauth_max_pending_per_address setting
};

class HttpServer {
 public:
  using Handler = std::function<HttpResponse(const HttpRequest&)>;

  // Binds and starts accepting (once `io` runs). The host is an IP address or a name this machine
  // resolves ("localhost": its IPv4 address first). Unavailable naming the address when it cannot
  // listen; InvalidArgument for a host that is neither.
  static Result<std::unique_ptr<HttpServer>> Start(boost::asio::io_context& io,
                                                   const HttpServerOptions& options,
                                                   Handler handler);
  virtual ~HttpServer() = default;
  // HOST:PORT it listens on (the port it got when asked for 0).
  virtual std::string address() const = 0;
  virtual uint16_t port() const = 0;
  // Stops accepting and closes every connection. Call on the context's thread (or once it has
  // stopped).
  virtual void Close() = 0;
};

}  // namespace tessera::dashboard

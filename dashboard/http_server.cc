#include "dashboard/http_server.h"

// Boost 1.74's Asio under GCC 12 in C++20 uses std::exchange without including <utility>.
#include <utility>

#include <algorithm>
#include <boost/asio/error.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/socket_base.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <map>
#include <optional>

#include "core/logging.h"
#include "core/pending_connections.h"
#include "dashboard/http_parse.h"

namespace tessera::dashboard {

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

class Session;

// What the server and its sessions share: a session may outlive the server by a few handlers.
struct ServerState {
  explicit ServerState(const HttpServerOptions& server_options)
      : options(server_options),
        waiting(PendingLimits{
            .deadline_ms = server_options.idle_timeout_ms,
            .max_pending = std::max(1, server_options.max_connections),
            .max_pending_per_address = std::clamp(server_options.max_pending_per_address, 1,
                                                  std::max(1, server_options.max_connections))}) {}

  // Closes session `id` if it is still open.
  void CloseSession(uint64_t id);

  HttpServerOptions options;
  HttpServer::Handler handler;
  bool closed = false;
  uint64_t next_session = 1;
  std::map<uint64_t, std::weak_ptr<Session>> sessions;  // the open ones
  // The open sessions waiting for a request (the deadline is the stream's own timer).
  PendingConnections waiting;
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, std::shared_ptr<ServerState> state, uint64_t id)
      : stream_(std::move(socket)),
        state_(std::move(state)),
        id_(id),
        buffer_(state_->options.header_limit_bytes + state_->options.body_limit_bytes) {
    beast::error_code ignored;
    address_ = stream_.socket().remote_endpoint(ignored).address().to_string();
  }

  ~Session() { Forget(); }

  void Start() { ReadRequest(); }

  void Close() {
    Forget();
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

 private:
  std::chrono::milliseconds Timeout() const {
    return std::chrono::milliseconds(state_->options.idle_timeout_ms);
  }

  // No longer open: out of the server's tables (the handlers in flight end it).
  void Forget() {
    state_->sessions.erase(id_);
    state_->waiting.Remove(id_);
  }

  void ReadRequest() {
    // Waiting for a request: room for it may close the session that has waited longest.
    for (uint64_t evicted : state_->waiting.Add(id_, address_, PendingConnections::Clock::now())) {
      state_->CloseSession(evicted);
    }
    parser_.emplace();
    parser_->header_limit(state_->options.header_limit_bytes);
    parser_->body_limit(state_->options.body_limit_bytes);
    stream_.expires_after(Timeout());
    http::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code error, size_t) { self->OnRead(error); });
  }

  void OnRead(beast::error_code error) {
    state_->waiting.Remove(id_);
    if (error == http::error::end_of_stream || error == beast::error::timeout ||
        error == asio::error::operation_aborted || error == asio::error::connection_reset ||
        error == asio::error::eof || state_->closed) {
      Close();
      return;
    }
    if (error) {
      // Malformed or oversized: say so once, then close (the stream's state is unknown).
      const bool too_large = error == http::error::header_limit ||
                             error == http::error::body_limit ||
                             error == http::error::buffer_overflow;
      HttpResponse refused{.status = too_large ? 413 : 400,
                           .content_type = "text/plain; charset=utf-8",
                           .body = too_large ? "request too large\n" : "bad request\n"};
      Respond(refused, /*head=*/false, /*version=*/11, /*keep_alive=*/false);
      return;
    }
    if (!parser_) return;  // never: ReadRequest made it before this read
    const auto& request = parser_->get();
    HttpResponse response = state_->handler(PlainRequest(request));
    Respond(response, request.method() == http::verb::head, request.version(),
            request.keep_alive());
  }

  template <class Body>
  void Fill(http::response<Body>& out, const HttpResponse& response, bool keep_alive) {
    out.set(http::field::server, "tessera");
    out.set(http::field::content_type, response.content_type);
    out.set(http::field::cache_control, "no-store");
    out.set("X-Content-Type-Options", "nosniff");
    out.set("X-Frame-Options", "DENY");
    out.set("Content-Security-Policy",
            "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'");
    out.set("Referrer-Policy", "no-referrer");
    for (const auto& [name, value] : response.headers) out.set(name, value);
    out.keep_alive(keep_alive);
  }

  void Respond(const HttpResponse& response, bool head, unsigned version, bool keep_alive) {
    const auto status = static_cast<http::status>(response.status);
    if (head) {
      auto out = std::make_shared<http::response<http::empty_body>>(status, version);
      Fill(*out, response, keep_alive);
      out->content_length(response.body.size());
      Write(out, keep_alive);
    } else {
      auto out = std::make_shared<http::response<http::string_body>>(status, version);
      Fill(*out, response, keep_alive);
      out->body() = response.body;
      out->prepare_payload();
      Write(out, keep_alive);
    }
  }

  template <class Message>
  void Write(std::shared_ptr<Message> message, bool keep_alive) {
    stream_.expires_after(Timeout());
    http::async_write(
        stream_, *message,
        [self = shared_from_this(), message, keep_alive](beast::error_code error, size_t) {
          if (error || !keep_alive || self->state_->closed) {
            self->Close();
            return;
          }
          self->ReadRequest();
        });
  }

  beast::tcp_stream stream_;
  std::shared_ptr<ServerState> state_;
  const uint64_t id_;
  std::string address_;  // the client's IP
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
};

void ServerState::CloseSession(uint64_t id) {
  auto it = sessions.find(id);
  if (it == sessions.end()) return;
  if (std::shared_ptr<Session> session = it->second.lock()) {
    session->Close();
  } else {
    sessions.erase(it);
  }
}

class HttpServerImpl final : public HttpServer {
 public:
  HttpServerImpl(asio::io_context& io, std::shared_ptr<ServerState> state)
      : acceptor_(io), backoff_(io), state_(std::move(state)) {}

  ~HttpServerImpl() override { CloseAcceptor(); }

  Status Listen() {
    beast::error_code error;
    asio::ip::address ip = asio::ip::make_address(state_->options.host, error);
    if (error) {
      // A host name ("localhost", this machine's name): the address it resolves to, IPv4 first.
      tcp::resolver resolver(acceptor_.get_executor());
      const tcp::resolver::results_type found = resolver.resolve(state_->options.host, "", error);
      if (error || found.empty()) {
        return InvalidArgument(
            "dashboard host '{}' is neither an IP address nor a name this machine resolves ({}): "
            "give an address of this host, or a name for one",
            state_->options.host, error ? error.message() : "no address");
      }
      ip = found.begin()->endpoint().address();
      for (const tcp::resolver::results_type::value_type& entry : found) {
        if (entry.endpoint().address().is_v4()) {
          ip = entry.endpoint().address();
          break;
        }
      }
    }
    const tcp::endpoint endpoint(ip, state_->options.port);
    const std::string where = fmt::format("{}:{}", state_->options.host, state_->options.port);
    if (acceptor_.open(endpoint.protocol(), error) ||
        acceptor_.set_option(asio::socket_base::reuse_address(true), error) ||
        acceptor_.bind(endpoint, error) ||
        acceptor_.listen(asio::socket_base::max_listen_connections, error)) {
      return Unavailable("the dashboard cannot listen on {}: {}", where, error.message());
    }
    port_ = acceptor_.local_endpoint(error).port();
    Accept();
    return Status::Ok();
  }

  std::string address() const override { return fmt::format("{}:{}", state_->options.host, port_); }
  uint16_t port() const override { return port_; }

  void Close() override {
    CloseAcceptor();
    state_->closed = true;
    // Copy first: closing a session may end it and erase it from the map.
    std::vector<std::shared_ptr<Session>> open;
    for (auto& [id, weak] : state_->sessions) {
      if (auto session = weak.lock()) open.push_back(std::move(session));
    }
    for (auto& session : open) session->Close();
  }

 private:
  void CloseAcceptor() {
    beast::error_code ignored;
    if (acceptor_.is_open()) acceptor_.close(ignored);  // a pending backoff then does nothing
  }

  void Accept() {
    acceptor_.async_accept([this, state = state_](beast::error_code error, tcp::socket socket) {
      if (state->closed || error == asio::error::operation_aborted) return;
      if (error) return AcceptFailed(error);
      exhausted_ = false;
      Admit(std::move(socket));
      if (acceptor_.is_open()) Accept();
    });
  }

  void Admit(tcp::socket socket) {
    // Full: the session that has waited longest for a request makes room.
    while (static_cast<int>(state_->sessions.size()) >= state_->options.max_connections) {
      const std::optional<uint64_t> oldest = state_->waiting.TakeOldest();
      if (!oldest) break;
      state_->CloseSession(*oldest);
    }
    if (static_cast<int>(state_->sessions.size()) >= state_->options.max_connections) {
      beast::error_code ignored;
      socket.close(ignored);  // every one is busy answering: the client may try again
      return;
    }
    const uint64_t id = state_->next_session++;
    auto session = std::make_shared<Session>(std::move(socket), state_, id);
    state_->sessions.emplace(id, session);
    session->Start();
  }

  // Out of descriptors or memory, accept fails at once until that changes: pause rather than
  // spin (the scheduler's io thread serves this server), and say so once.
  void AcceptFailed(const beast::error_code& error) {
    const bool exhausted =
        error.category() == boost::system::system_category() && AcceptOutOfResources(error.value());
    if (!exhausted) {
      if (acceptor_.is_open()) Accept();
      return;
    }
    if (!exhausted_) {
      exhausted_ = true;
      GetLogger("dashboard")
          ->warn("the dashboard cannot accept connections ({}): retrying every {} ms",
                 error.message(), kAcceptBackoff.count());
    }
    backoff_.expires_after(kAcceptBackoff);
    backoff_.async_wait([this](const beast::error_code& waited) {
      if (!waited && acceptor_.is_open()) Accept();
    });
  }

  static constexpr std::chrono::milliseconds kAcceptBackoff{100};
  tcp::acceptor acceptor_;
  asio::steady_timer backoff_;
  bool exhausted_ = false;  // accepts are failing for want of resources (logged once)
  std::shared_ptr<ServerState> state_;
  uint16_t port_ = 0;
};

}  // namespace

Result<std::unique_ptr<HttpServer>> HttpServer::Start(asio::io_context& io,
                                                      const HttpServerOptions& options,
                                                      Handler handler) {
  auto state = std::make_shared<ServerState>(options);
  state->handler = std::move(handler);
  auto server = std::make_unique<HttpServerImpl>(io, std::move(state));
  TESSERA_RETURN_IF_ERROR(server->Listen());
  return std::unique_ptr<HttpServer>(std::move(server));
}

}  // namespace tessera::dashboard

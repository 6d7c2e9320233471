#include "core/rpc/connection.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>

#include "core/logging.h"
#include "core/pending_connections.h"

namespace tessera::rpc {

namespace {
constexpr size_t kReadChunkBytes = size_t{256} * 1024;
// A connection limited to small frames (not authenticated yet) reads in small pieces: an idle
// stranger costs this much, not a full read chunk.
constexpr size_t kSmallReadChunkBytes = size_t{16} * 1024;

size_t ReadChunkFor(uint32_t max_frame_bytes) {
  return max_frame_bytes >= kReadChunkBytes ? kReadChunkBytes : kSmallReadChunkBytes;
}
}  // namespace

std::shared_ptr<Connection> Connection::Create(GenericSocket socket, std::string peer,
                                               uint32_t max_frame_bytes) {
  return std::shared_ptr<Connection>(
      new Connection(std::move(socket), std::move(peer), max_frame_bytes));
}

Connection::Connection(GenericSocket socket, std::string peer, uint32_t max_frame_bytes)
    : socket_(std::move(socket)),
      peer_(std::move(peer)),
      decoder_(max_frame_bytes),
      read_buffer_(ReadChunkFor(max_frame_bytes)) {}

Connection::~Connection() {
  boost::system::error_code ignored;
  socket_.close(ignored);
}

void Connection::Start(MessageHandler on_message, CloseHandler on_close) {
  on_message_ = std::move(on_message);
  on_close_ = std::move(on_close);
  asio::post(socket_.get_executor(), [self = shared_from_this()] { self->ReadMore(); });
}

void Connection::ReadMore() {
  if (closed_) return;
  socket_.async_read_some(asio::buffer(read_buffer_), [self = shared_from_this()](
                                                          const boost::system::error_code& error,
                                                          size_t n) {
    if (self->closed_) return;
    if (error) {
      self->CloseOnIoThread(error == asio::error::eof
                                ? Unavailable("{} closed the connection", self->peer_)
                                : Unavailable("reading from {}: {}", self->peer_, error.message()));
      return;
    }
    self->bytes_received_ += static_cast<int64_t>(n);
    Status fed = self->decoder_.Feed({self->read_buffer_.data(), n});
    do {
      while (self->decoder_.HasMessage() && !self->closed_) {
        std::unique_ptr<ReceivedMessage> message = self->decoder_.PopMessage();
        Status handled = CatchMalformed([&] { return self->on_message_(*self, *message); });
        if (!handled.ok()) {
          self->CloseOnIoThread(handled.WithContext("message from " + self->peer_));
          return;
        }
      }
      if (!fed.ok() || self->closed_) break;
      fed = self->decoder_.Feed({});  // frames held back until those before them were handled
    } while (self->decoder_.HasMessage());
    if (!fed.ok()) {
      self->CloseOnIoThread(fed.WithContext("stream from " + self->peer_));
      return;
    }
    self->ReadMore();
  });
}

void Connection::Send(capnp::MessageBuilder& message) { SendFrame(EncodeFrame(message)); }

void Connection::SendFrame(std::vector<uint8_t> frame) {
  if (closed_) return;
  bool start = false;
  {
    MutexLock lock(&write_mutex_);
    // Off the io thread, with nothing queued or being written: write on this thread now rather
    // than wake the io thread to do it (a hand-off between threads costs more than the write).
    // On the io thread frames are queued and written together after the handler.
    if (!writing_ && queued_.empty() && !closed_ && !OnIoThread()) {
      const Result<size_t> written = WriteNow(frame);
      if (!written.ok()) {
        lock.Unlock();
        Close(written.status());
        return;
      }
      if (*written == frame.size()) return;
      frame.erase(frame.begin(), frame.begin() + static_cast<std::ptrdiff_t>(*written));
    }
    queued_.push_back(std::move(frame));
    if (!writing_) {
      writing_ = true;
      start = true;
    }
  }
  if (start)
    asio::post(socket_.get_executor(), [self = shared_from_this()] { self->WriteQueued(); });
}

bool Connection::OnIoThread() {
  // The executor held here: target() points into it.
  const auto executor = socket_.get_executor();
  const auto* io = executor.target<asio::io_context::executor_type>();
  return io != nullptr && io->running_in_this_thread();
}

Result<size_t> Connection::WriteNow(const std::vector<uint8_t>& frame) {
  size_t written = 0;
  while (written < frame.size()) {
    const ssize_t n = ::send(socket_.native_handle(), frame.data() + written,
                             frame.size() - written, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      written += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      break;  // the socket's buffer is full: the io thread writes the rest when it drains
    } else {
      return Unavailable("writing to {}: {}", peer_, std::strerror(errno));
    }
  }
  return written;
}

void Connection::WriteQueued() {
  {
    MutexLock lock(&write_mutex_);
    if (closed_ || queued_.empty()) {
      writing_ = false;
      if (close_when_flushed_ && !closed_) {
        const Status reason = close_reason_;
        lock.Unlock();
        CloseOnIoThread(reason);
      }
      return;
    }
    in_flight_.swap(queued_);
  }
  std::vector<asio::const_buffer> buffers;
  buffers.reserve(in_flight_.size());
  for (const std::vector<uint8_t>& frame : in_flight_) buffers.push_back(asio::buffer(frame));
  asio::async_write(
      socket_, buffers,
      [self = shared_from_this()](const boost::system::error_code& error, size_t) {
        self->in_flight_.clear();
        if (error) {
          self->CloseOnIoThread(Unavailable("writing to {}: {}", self->peer_, error.message()));
          return;
        }
        self->WriteQueued();
      });
}

void Connection::Close(const Status& reason) {
  asio::post(socket_.get_executor(),
             [self = shared_from_this(), reason] { self->CloseOnIoThread(reason); });
}

void Connection::CloseWhenFlushed(const Status& reason) {
  {
    MutexLock lock(&write_mutex_);
    close_when_flushed_ = true;
    close_reason_ = reason;
    if (writing_) return;  // the write loop closes when the queue drains
    writing_ = true;
  }
  asio::post(socket_.get_executor(), [self = shared_from_this()] { self->WriteQueued(); });
}

void Connection::Admit(uint32_t max_frame_bytes) {
  decoder_.set_max_frame_bytes(max_frame_bytes);
  // No read is in flight while a handler runs: the buffer may change size.
  read_buffer_.resize(ReadChunkFor(max_frame_bytes));
}

void Connection::CloseOnIoThread(const Status& reason) {
  if (closed_.exchange(true)) return;
  {
    // Under the write lock: a sender writing on its own thread (SendFrame) is done with the
    // descriptor before it is closed, and none starts after.
    MutexLock lock(&write_mutex_);
    boost::system::error_code ignored;
    socket_.shutdown(asio::socket_base::shutdown_both, ignored);
    socket_.close(ignored);
    queued_.clear();
    writing_ = false;
  }
  if (on_close_) on_close_(*this, reason);
  on_message_ = nullptr;
  on_close_ = nullptr;
}

Result<GenericSocket> ConnectSocket(asio::io_context& io, const Address& address, int timeout_ms) {
  // A private io_context runs the connect with a deadline; the socket then moves to `io`.
  asio::io_context connect_io;
  boost::system::error_code error = asio::error::timed_out;
  GenericSocket socket(connect_io);
  asio::steady_timer timer(connect_io, std::chrono::milliseconds(timeout_ms));
  bool done = false;
  auto finish = [&](const boost::system::error_code& e) {
    if (done) return;
    done = true;
    error = e;
    timer.cancel();
  };
  if (address.kind == Address::Kind::kUnix) {
    asio::local::stream_protocol::socket unix_socket(connect_io);
    unix_socket.async_connect(asio::local::stream_protocol::endpoint(address.path), finish);
    timer.async_wait([&](const boost::system::error_code& e) {
      if (!e && !done) {
        done = true;
        unix_socket.close();
      }
    });
    connect_io.run();
    if (error) {
      return Unavailable("cannot connect to {}: {}", address.ToString(), error.message());
    }
    socket = GenericSocket(std::move(unix_socket));
  } else {
    asio::ip::tcp::resolver resolver(connect_io);
    boost::system::error_code resolve_error;
    auto endpoints = resolver.resolve(address.host, std::to_string(address.port), resolve_error);
    if (resolve_error) {
      return Unavailable("cannot resolve {}: {}", address.ToString(), resolve_error.message());
    }
    asio::ip::tcp::socket tcp_socket(connect_io);
    asio::async_connect(
        tcp_socket, endpoints,
        [&](const boost::system::error_code& e, const asio::ip::tcp::endpoint&) { finish(e); });
    timer.async_wait([&](const boost::system::error_code& e) {
      if (!e && !done) {
        done = true;
        tcp_socket.close();
      }
    });
    connect_io.run();
    if (error) {
      return Unavailable("cannot connect to {}: {}", address.ToString(), error.message());
    }
    tcp_socket.set_option(asio::ip::tcp::no_delay(true));
    socket = GenericSocket(std::move(tcp_socket));
  }
  // Re-home the file descriptor on the caller's io_context.
  const int fd = ::dup(socket.native_handle());
  const auto protocol = socket.local_endpoint().protocol();
  boost::system::error_code assign_error;
  GenericSocket result(io);
  result.assign(protocol, fd, assign_error);
  if (assign_error) {
    ::close(fd);
    return Internal("adopting the socket to {} failed: {}", address.ToString(),
                    assign_error.message());
  }
  return result;
}

Listener::Listener(asio::io_context& io, Address address, AcceptHandler on_accept)
    : address_(std::move(address)),
      on_accept_(std::move(on_accept)),
      backoff_(io),
      reserve_fd_(::open("/dev/null", O_RDONLY | O_CLOEXEC)) {}

Listener::~Listener() {
  Close();
  if (reserve_fd_ >= 0) ::close(reserve_fd_);
}

Result<std::unique_ptr<Listener>> Listener::Listen(asio::io_context& io, const Address& address,
                                                   AcceptHandler on_accept) {
  std::unique_ptr<Listener> listener(new Listener(io, address, std::move(on_accept)));
  boost::system::error_code error;
  if (address.kind == Address::Kind::kUnix) {
    ::unlink(address.path.c_str());  // a stale socket file from a dead process
    listener->unix_ = std::make_unique<asio::local::stream_protocol::acceptor>(io);
    asio::local::stream_protocol::endpoint endpoint(address.path);
    listener->unix_->open(endpoint.protocol(), error);
    if (!error) listener->unix_->bind(endpoint, error);
    if (!error) listener->unix_->listen(asio::socket_base::max_listen_connections, error);
  } else {
    listener->tcp_ = std::make_unique<asio::ip::tcp::acceptor>(io);
    asio::ip::tcp::resolver resolver(io);
    auto endpoints = resolver.resolve(address.host, std::to_string(address.port), error);
    if (!error) {
      const asio::ip::tcp::endpoint endpoint = *endpoints.begin();
      listener->tcp_->open(endpoint.protocol(), error);
      if (!error) listener->tcp_->set_option(asio::socket_base::reuse_address(true), error);
      if (!error) listener->tcp_->bind(endpoint, error);
      if (!error) listener->tcp_->listen(asio::socket_base::max_listen_connections, error);
      if (!error) listener->address_.port = listener->tcp_->local_endpoint().port();
    }
  }
  // ShedOne accepts synchronously and must never block.
  if (!error && listener->tcp_) listener->tcp_->native_non_blocking(true, error);
  if (!error && listener->unix_) listener->unix_->native_non_blocking(true, error);
  if (error) {
    return Unavailable("cannot listen on {}: {}", address.ToString(), error.message());
  }
  listener->AcceptNext();
  return listener;
}

void Listener::AcceptNext() {
  if (tcp_) {
    tcp_->async_accept(
        [this](const boost::system::error_code& error, asio::ip::tcp::socket socket) {
          if (error == asio::error::operation_aborted) return;
          if (error) return AcceptFailed(error);
          Accepted();
          boost::system::error_code ignored;
          socket.set_option(asio::ip::tcp::no_delay(true), ignored);
          std::string peer = socket.remote_endpoint(ignored).address().to_string() + ":" +
                             std::to_string(socket.remote_endpoint(ignored).port());
          on_accept_(GenericSocket(std::move(socket)), std::move(peer));
          AcceptNext();
        });
  } else if (unix_) {
    unix_->async_accept([this](const boost::system::error_code& error,
                               asio::local::stream_protocol::socket socket) {
      if (error == asio::error::operation_aborted) return;
      if (error) return AcceptFailed(error);
      Accepted();
      on_accept_(GenericSocket(std::move(socket)), "unix:" + address_.path);
      AcceptNext();
    });
  }
}

void Listener::Accepted() {
  if (!exhausted_) return;
  exhausted_ = false;
  GetLogger("rpc")->info("{}: accepting connections again", address_.ToString());
}

void Listener::AcceptFailed(const boost::system::error_code& error) {
  const bool exhausted =
      error.category() == boost::system::system_category() && AcceptOutOfResources(error.value());
  if (!exhausted) return AcceptNext();  // e.g. a client that reset before it was accepted
  if (!exhausted_) {
    exhausted_ = true;
    GetLogger("rpc")->warn(
        "{}: cannot accept connections ({}): shedding new ones and retrying every {} ms until "
        "descriptors free up (raise `ulimit -n`, or lower the preauth_max_pending setting)",
        address_.ToString(), error.message(), kAcceptBackoff.count());
  }
  ShedOne();
  backoff_.expires_after(kAcceptBackoff);
  // Not cancelled by Close (cancel may throw; the destructor must not): the acceptor's state says.
  backoff_.async_wait([this](const boost::system::error_code& waited) {
    if (!waited && ((tcp_ && tcp_->is_open()) || (unix_ && unix_->is_open()))) AcceptNext();
  });
}

void Listener::ShedOne() {
  const int listen_fd = tcp_ ? tcp_->native_handle() : unix_ ? unix_->native_handle() : -1;
  if (listen_fd < 0 || reserve_fd_ < 0) return;
  ::close(reserve_fd_);
  // The acceptor's descriptor is non-blocking (Listen): nothing waits here.
  const int shed = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (shed >= 0) ::close(shed);
  reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
}

void Listener::Close() {
  boost::system::error_code ignored;
  if (tcp_) tcp_->close(ignored);
  if (unix_) {
    unix_->close(ignored);
    ::unlink(address_.path.c_str());
  }
}

}  // namespace tessera::rpc

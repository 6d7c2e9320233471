// Connection: a framed, bidirectional message stream over a connected socket (TCP or Unix).
//
// Every control-plane link (driver <-> scheduler, worker <-> scheduler) is a Connection. It owns
// its socket, decodes incoming frames into messages and hands each to the message handler on
// the io thread, and sends messages queued from any thread.
//
// Ordering and batching: messages are sent in the order Send was called. While a write is in
// flight, further Sends queue up and go out together in the next gather-write, so a burst of
// small messages costs few system calls.
//
// Errors: a read or write failure, a malformed frame, or a handler returning an error closes the
// connection; the close handler runs exactly once, on the io thread, with the reason. Peers that
// send garbage therefore lose their own connection and nothing else.
//
// Authentication: a server creates each accepted connection with a small frame limit and a small
// read buffer (a stranger can make it hold little), and calls Admit once the peer proved itself,
// which raises both to their full size.
//
// Thread safety: Send and Close may be called from any thread; the handlers run on the io thread.
// Lifetime: the io_context must outlive the connection; handlers hold it by shared_ptr.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/rpc/address.h"
#include "core/rpc/asio.h"
#include "core/rpc/frame.h"
#include "core/status.h"
#include "core/thread_annotations.h"

namespace tessera::rpc {

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // Returns an error to close the connection (a protocol violation by the peer).
  using MessageHandler = std::function<Status(Connection&, ReceivedMessage&)>;
  using CloseHandler = std::function<void(Connection&, const Status& reason)>;

  // `max_frame_bytes`: larger incoming frames close the connection (until Admit).
  static std::shared_ptr<Connection> Create(GenericSocket socket, std::string peer,
                                            uint32_t max_frame_bytes = kDefaultMaxFrameBytes);
  ~Connection();

  // Starts reading. REQUIRES: called once.
  void Start(MessageHandler on_message, CloseHandler on_close);
  // Sends one message; a no-op after Close. Called off the io thread with nothing else on its
  // way out, it writes on the calling thread what the socket takes at once (no hand-off to the
  // io thread); otherwise, and for the rest, it queues for the io thread.
  void Send(capnp::MessageBuilder& message);
  // Send of encoded frames (EncodeFrame): one, or several back to back (written together).
  void SendFrame(std::vector<uint8_t> frame) EXCLUDES(write_mutex_);
  // Closes the socket; the close handler gets `reason`. Idempotent.
  void Close(const Status& reason);
  // Closes once every message queued so far has been written (e.g. after a refusal).
  void CloseWhenFlushed(const Status& reason) EXCLUDES(write_mutex_);
  // The peer authenticated: frames up to `max_frame_bytes` from now on, including those already
  // received behind the message being handled, and full-sized reads. REQUIRES: called on the io
  // thread (from the message handler).
  void Admit(uint32_t max_frame_bytes = kDefaultMaxFrameBytes);

  bool closed() const { return closed_.load(); }
  const std::string& peer() const { return peer_; }
  // A value the owner attaches (e.g. the worker id behind this connection).
  uint64_t tag() const { return tag_.load(); }
  void set_tag(uint64_t tag) { tag_.store(tag); }
  int64_t bytes_received() const { return bytes_received_.load(); }

 private:
  Connection(GenericSocket socket, std::string peer, uint32_t max_frame_bytes);
  void ReadMore();
  void WriteQueued() EXCLUDES(write_mutex_);  // io thread
  bool OnIoThread();
  // Writes what the socket takes without blocking; the bytes written, or Unavailable for a
  // broken connection.
  Result<size_t> WriteNow(const std::vector<uint8_t>& frame) REQUIRES(write_mutex_);
  void CloseOnIoThread(const Status& reason) EXCLUDES(write_mutex_);

  GenericSocket socket_;
  std::string peer_;
  FrameDecoder decoder_;
  std::vector<uint8_t> read_buffer_;
  MessageHandler on_message_;
  CloseHandler on_close_;

  Mutex write_mutex_;
  std::vector<std::vector<uint8_t>> queued_ GUARDED_BY(write_mutex_);
  bool writing_ GUARDED_BY(write_mutex_) = false;
  bool close_when_flushed_ GUARDED_BY(write_mutex_) = false;
  Status close_reason_ GUARDED_BY(write_mutex_);
  std::vector<std::vector<uint8_t>> in_flight_;  // io thread only

  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> tag_{0};
  std::atomic<int64_t> bytes_received_{0};
};

// Connects (blocking, from any thread other than the io thread) with a timeout. Unavailable
// naming the address and the system error when nothing answers.
Result<GenericSocket> ConnectSocket(asio::io_context& io, const Address& address, int timeout_ms);

// Accepts connections on a TCP or Unix address and hands each socket to the accept handler on
// the io thread. Port 0 picks a free port (see address()); a Unix path is replaced if stale.
//
// Out of file descriptors (EMFILE, ENFILE) or kernel memory, accept fails at once for as long as
// the condition lasts, so retrying at once would spin. The listener then sheds the connection
// waiting at the head of the backlog (a descriptor kept in reserve makes room to accept and
// close it, so that client hears a close instead of hanging), pauses `kAcceptBackoff`, and tries
// again; it logs once per episode. Meanwhile the owner's deadlines free descriptors.
class Listener {
 public:
  using AcceptHandler = std::function<void(GenericSocket socket, std::string peer)>;
  static constexpr std::chrono::milliseconds kAcceptBackoff{100};

  static Result<std::unique_ptr<Listener>> Listen(asio::io_context& io, const Address& address,
                                                  AcceptHandler on_accept);
  ~Listener();
  const Address& address() const { return address_; }
  void Close();

 private:
  Listener(asio::io_context& io, Address address, AcceptHandler on_accept);
  void AcceptNext();
  // After a failed accept: go on at once, or shed and pause when out of resources.
  void AcceptFailed(const boost::system::error_code& error);
  // After a successful one: ends an episode of failures.
  void Accepted();
  // Accepts and closes one waiting connection with the reserve descriptor's room.
  void ShedOne();

  Address address_;
  AcceptHandler on_accept_;
  std::unique_ptr<asio::ip::tcp::acceptor> tcp_;
  std::unique_ptr<asio::local::stream_protocol::acceptor> unix_;
  asio::steady_timer backoff_;
  int reserve_fd_ = -1;     // /dev/null, closed to make room for ShedOne
  bool exhausted_ = false;  // in an episode of failed accepts (logged once)
};

}  // namespace tessera::rpc

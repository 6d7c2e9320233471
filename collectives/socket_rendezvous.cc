#include "collectives/socket_rendezvous.h"

#include "core/checks.h"
#include "core/rendezvous_rules.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <thread>

#include <fmt/ranges.h>

#include "core/rpc/address.h"
#include "core/thread_annotations.h"

namespace tessera {

namespace {

using Clock = Rendezvous::Clock;

enum class Kind : uint8_t {
  kHello = 1,         // member -> 0: i32 rank, i32 size
  kWelcome = 2,       // 0 -> member: the group is complete
  kRefused = 3,       // 0 -> member: why it cannot join (text)
  kContribution = 4,  // member -> 0: u32 round, bytes
  kAll = 5,           // 0 -> member: u32 round, u32 count, count x (u32 length, bytes)
  kFailure = 6,       // 0 -> member: the group's verdict: u8 code, text (naming the rank)
  kBye = 7,           // either way: leaving normally
  kReport = 8,        // member -> 0: what it found: u8 code, u32 silent ms, u32 peer, text
};
// Reports arriving within this window of the first are weighed together (see ReportFailure).
constexpr auto kVerdictWindow = FailureVerdict::kDefaultWindow;
constexpr uint32_t kMaxFrameBytes = 64 << 20;

struct Frame {
  Kind kind;
  std::string payload;
};

void PutU32(std::string& out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}
uint32_t GetU32(std::string_view in, size_t offset) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) {
    value |= static_cast<uint32_t>(static_cast<uint8_t>(in[offset + static_cast<size_t>(i)]))
             << (8 * i);
  }
  return value;
}

int RemainingMs(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1'000'000));
}

Status SendFrame(int fd, Kind kind, std::string_view payload) {
  std::string frame;
  PutU32(frame, static_cast<uint32_t>(payload.size() + 1));
  frame.push_back(static_cast<char>(kind));
  frame.append(payload);
  size_t sent = 0;
  while (sent < frame.size()) {
    const ssize_t n = ::send(fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return SystemError("rendezvous send", n == 0 ? EPIPE : errno);
    sent += static_cast<size_t>(n);
  }
  return Status::Ok();
}

// Accumulates bytes from one socket and cuts them into frames.
class FrameReader {
 public:
  // Reads what is available. NotFound at end of stream; Unavailable on a socket error.
  Status ReadSome(int fd) {
    char chunk[64 * 1024];
    const ssize_t n = ::recv(fd, chunk, sizeof(chunk), 0);
    if (n == 0) return NotFound("end of stream");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) return Status::Ok();
      return SystemError("rendezvous recv");
    }
    buffer_.append(chunk, static_cast<size_t>(n));
    return Status::Ok();
  }
  // The next complete frame, if any; DataLoss for a malformed one.
  Result<std::optional<Frame>> Next() {
    if (buffer_.size() < 4) return std::optional<Frame>();
    const uint32_t length = GetU32(buffer_, 0);
    if (length == 0 || length > kMaxFrameBytes) {
      return DataLoss("malformed rendezvous frame of {} bytes", length);
    }
    if (buffer_.size() < 4 + length) return std::optional<Frame>();
    Frame frame{static_cast<Kind>(buffer_[4]), buffer_.substr(5, length - 1)};
    buffer_.erase(0, 4 + length);
    return std::optional<Frame>(std::move(frame));
  }

 private:
  std::string buffer_;
};

// Blocking read of one frame by `deadline`.
Result<Frame> ReadFrame(int fd, FrameReader& reader, Clock::time_point deadline,
                        std::string_view from) {
  while (true) {
    TESSERA_ASSIGN_OR_RETURN(std::optional<Frame> frame, reader.Next());
    if (frame) return std::move(*frame);
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, RemainingMs(deadline));
    if (ready == 0) return TimedOut("no answer from {} in time", from);
    if (ready < 0 && errno != EINTR) return SystemError("poll");
    Status status = reader.ReadSome(fd);
    if (status.code() == StatusCode::kNotFound)
      return Unavailable("{} closed the connection", from);
    TESSERA_RETURN_IF_ERROR(status);
  }
}

// A socket address for an rpc::Address.
struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  int family = AF_INET;
};

Result<SocketAddress> Resolve(const rpc::Address& address) {
  SocketAddress out;
  if (address.kind == rpc::Address::Kind::kUnix) {
    sockaddr_un un{};
    un.sun_family = AF_UNIX;
    if (address.path.size() >= sizeof(un.sun_path)) {
      return InvalidArgument("unix socket path '{}' is longer than {} bytes", address.path,
                             sizeof(un.sun_path) - 1);
    }
    std::memcpy(un.sun_path, address.path.c_str(), address.path.size() + 1);
    std::memcpy(&out.storage, &un, sizeof(un));
    out.length = sizeof(un);
    out.family = AF_UNIX;
    return out;
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int error =
      ::getaddrinfo(address.host.c_str(), std::to_string(address.port).c_str(), &hints, &result);
  if (error != 0 || result == nullptr) {
    return Unavailable("cannot resolve '{}': {}", address.host, gai_strerror(error));
  }
  std::memcpy(&out.storage, result->ai_addr, result->ai_addrlen);
  out.length = result->ai_addrlen;
  ::freeaddrinfo(result);
  return out;
}

class SocketRendezvous final : public Rendezvous {
 public:
  SocketRendezvous(int rank, int size) : rank_(rank), size_(size), contributions_(size) {
    fds_.assign(static_cast<size_t>(size), -1);
    said_bye_.assign(static_cast<size_t>(size), false);
  }
  ~SocketRendezvous() override;

  Status JoinAsRoot(const rpc::Address& address, Clock::time_point deadline);
  Status JoinAsMember(const rpc::Address& address, Clock::time_point deadline);
  void StartWatching();

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Result<std::vector<std::string>> AllGather(const std::string& mine,
                                             Clock::time_point deadline) override;
  void OnMemberFailure(FailureHandler on_failure) override;
  Status ReportFailure(const Status& reason, int64_t silent_ms, int silent_peer) override;

 private:
  void Watch();
  // Handles one frame from `from` (rank 0 hears members; members hear rank 0). Watch thread.
  Status Handle(int from, Frame frame);
  void MemberLost(int rank, const std::string& why);  // watch thread
  // Rank 0: collects `reporter`'s report for the verdict window.
  void AddReport(int reporter, int silent_peer, const Status& reason, int64_t silent_ms);
  // Rank 0: at the window's end, the verdict is the report whose silence began first.
  void DecideFromReports();
  // Records the verdict (the first one stands) and tells the handler; rank 0 also tells every
  // member.
  void SetVerdict(const Status& verdict);
  // Tells the handler, and on rank 0 every member, the verdict just decided.
  void Announce(const Status& verdict);
  // Waits (a bounded time) for the group's verdict; `fallback` if none comes.
  Status AwaitVerdict(Clock::time_point until, const Status& fallback);
  void Wake();
  Status SendTo(int rank, Kind kind, std::string_view payload);

  const int rank_;
  const int size_;
  std::vector<int> fds_;  // rank 0: one per member; a member: fds_[0], to rank 0
  std::vector<Mutex> write_mutexes_ = std::vector<Mutex>(static_cast<size_t>(size_));  // per fd
  int wake_[2] = {-1, -1};
  std::thread watcher_;
  uint32_t next_round_ = 0;

  Mutex mutex_;
  CondVar changed_;
  std::vector<bool> said_bye_ GUARDED_BY(mutex_);
  GatherRounds contributions_ GUARDED_BY(mutex_);  // rank 0
  // Complete rounds, until taken.
  std::map<uint32_t, std::vector<std::string>> results_ GUARDED_BY(mutex_);
  // The group's verdict (the first one stands); on rank 0 also the reports it weighs.
  FailureVerdict verdict_ GUARDED_BY(mutex_) = FailureVerdict(kVerdictWindow);
  FailureHandler on_failure_ GUARDED_BY(mutex_);
  bool stopping_ GUARDED_BY(mutex_) = false;
};

std::string EncodeStatus(const Status& status) {
  return std::string(1, static_cast<char>(status.code())) + status.message();
}
Status DecodeStatus(std::string_view payload) {
  if (payload.empty()) return Unavailable("a member failed");
  const auto code = static_cast<StatusCode>(static_cast<uint8_t>(payload[0]));
  return Status(code == StatusCode::kOk ? StatusCode::kUnavailable : code,
                std::string(payload.substr(1)));
}

Status SocketRendezvous::JoinAsRoot(const rpc::Address& address, Clock::time_point deadline) {
  TESSERA_ASSIGN_OR_RETURN(SocketAddress where, Resolve(address));
  const int listener = ::socket(where.family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return SystemError("socket");
  const int one = 1;
  if (where.family == AF_INET) ::setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (where.family == AF_UNIX) ::unlink(address.path.c_str());
  if (::bind(listener, reinterpret_cast<sockaddr*>(&where.storage), where.length) != 0 ||
      ::listen(listener, 128) != 0) {
    const std::string error = std::strerror(errno);
    ::close(listener);
    return Unavailable("rank 0 cannot listen on {}: {} (is another group using it?)",
                       address.ToString(), error);
  }
  int joined = 1;
  Status status;
  while (joined < size_) {
    pollfd p{listener, POLLIN, 0};
    const int ready = ::poll(&p, 1, RemainingMs(deadline));
    if (ready == 0) {
      std::vector<int> missing;
      for (int r = 1; r < size_; ++r) {
        if (fds_[static_cast<size_t>(r)] < 0) missing.push_back(r);
      }
      status = TimedOut("rank 0 waited for ranks {} to join at {}; they never came",
                        fmt::join(missing, ", "), address.ToString());
      break;
    }
    const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    FrameReader reader;
    Result<Frame> hello = ReadFrame(
        fd, reader, std::min(deadline, Clock::now() + std::chrono::seconds(5)), "a joining member");
    if (!hello.ok() || hello->kind != Kind::kHello || hello->payload.size() != 8) {
      ::close(fd);
      continue;
    }
    const int rank = static_cast<int>(GetU32(hello->payload, 0));
    const int size = static_cast<int>(GetU32(hello->payload, 4));
    std::string refusal;
    if (size != size_) {
      refusal =
          fmt::format("rank {} thinks the group has {} ranks; rank 0 has {}", rank, size, size_);
    } else if (rank <= 0 || rank >= size_) {
      refusal = fmt::format("rank {} is not a member rank of a group of {}", rank, size_);
    } else if (fds_[static_cast<size_t>(rank)] >= 0) {
      refusal = fmt::format("rank {} joined twice (two members were given the same rank)", rank);
    }
    if (!refusal.empty()) {
      (void)SendFrame(fd, Kind::kRefused, refusal);
      ::close(fd);
      continue;
    }
    fds_[static_cast<size_t>(rank)] = fd;
    ++joined;
  }
  ::close(listener);
  if (where.family == AF_UNIX) ::unlink(address.path.c_str());
  if (!status.ok()) return status;
  for (int r = 1; r < size_; ++r) TESSERA_RETURN_IF_ERROR(SendTo(r, Kind::kWelcome, ""));
  return Status::Ok();
}

Status SocketRendezvous::JoinAsMember(const rpc::Address& address, Clock::time_point deadline) {
  TESSERA_ASSIGN_OR_RETURN(SocketAddress where, Resolve(address));
  std::string last_error;
  int fd = -1;
  while (true) {  // rank 0 may not be listening yet: retry until the deadline
    fd = ::socket(where.family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return SystemError("socket");
    if (::connect(fd, reinterpret_cast<sockaddr*>(&where.storage), where.length) == 0) break;
    last_error = std::strerror(errno);
    ::close(fd);
    fd = -1;
    if (Clock::now() >= deadline) {
      return TimedOut("rank {} could not reach rank 0 at {}: {}", rank_, address.ToString(),
                      last_error);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (where.family == AF_INET) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  fds_[0] = fd;
  std::string hello;
  PutU32(hello, static_cast<uint32_t>(rank_));
  PutU32(hello, static_cast<uint32_t>(size_));
  TESSERA_RETURN_IF_ERROR(SendTo(0, Kind::kHello, hello));
  FrameReader reader;
  TESSERA_ASSIGN_OR_RETURN(
      Frame answer,
      ReadFrame(fd, reader, deadline, fmt::format("rank 0 at {}", address.ToString())));
  if (answer.kind == Kind::kRefused)
    return InvalidArgument("rank 0 refused rank {}: {}", rank_, answer.payload);
  if (answer.kind != Kind::kWelcome)
    return DataLoss("rank 0 answered rank {}'s hello with frame kind {}", rank_,
                    static_cast<int>(answer.kind));
  return Status::Ok();
}

void SocketRendezvous::StartWatching() {
  if (::pipe2(wake_, O_CLOEXEC) != 0) return;
  watcher_ = std::thread([this] { Watch(); });
}

SocketRendezvous::~SocketRendezvous() {
  // Goodbye first, so the others do not take this exit for a death.
  if (rank_ == 0) {
    for (int r = 1; r < size_; ++r) (void)SendTo(r, Kind::kBye, "");
  } else {
    (void)SendTo(0, Kind::kBye, "");
  }
  if (watcher_.joinable()) {
    {
      MutexLock lock(&mutex_);
      stopping_ = true;
    }
    Wake();
    watcher_.join();
  }
  for (int fd : wake_) {
    if (fd >= 0) ::close(fd);
  }
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

void SocketRendezvous::Wake() {
  const char byte = 0;
  (void)!::write(wake_[1], &byte, 1);
}

Status SocketRendezvous::SendTo(int rank, Kind kind, std::string_view payload) {
  const int fd = fds_[static_cast<size_t>(rank)];
  if (fd < 0) return Unavailable("rank {} is not connected", rank);
  MutexLock lock(&write_mutexes_[static_cast<size_t>(rank)]);
  return SendFrame(fd, kind, payload);
}

void SocketRendezvous::Watch() {
  std::vector<FrameReader> readers(static_cast<size_t>(size_));
  std::vector<bool> open(static_cast<size_t>(size_), false);
  for (int r = 0; r < size_; ++r) open[static_cast<size_t>(r)] = fds_[static_cast<size_t>(r)] >= 0;
  while (true) {
    std::vector<pollfd> polled{{wake_[0], POLLIN, 0}};
    std::vector<int> ranks{-1};
    for (int r = 0; r < size_; ++r) {
      if (!open[static_cast<size_t>(r)]) continue;
      polled.push_back({fds_[static_cast<size_t>(r)], POLLIN, 0});
      ranks.push_back(r);
    }
    int timeout_ms = -1;
    {
      MutexLock lock(&mutex_);
      if (const auto window_end = verdict_.window_end()) timeout_ms = RemainingMs(*window_end);
    }
    if (::poll(polled.data(), polled.size(), timeout_ms) < 0 && errno != EINTR) return;
    if (polled[0].revents != 0) {
      char drain[64];
      (void)!::read(wake_[0], drain, sizeof(drain));
      MutexLock lock(&mutex_);
      if (stopping_) return;
    }
    DecideFromReports();
    for (size_t i = 1; i < polled.size(); ++i) {
      if (polled[i].revents == 0) continue;
      const int from = ranks[i];
      FrameReader& reader = readers[static_cast<size_t>(from)];
      Status status = reader.ReadSome(polled[i].fd);
      while (status.ok()) {
        Result<std::optional<Frame>> frame = reader.Next();
        if (!frame.ok()) {
          status = frame.status();
          break;
        }
        std::optional<Frame>& next = *frame;
        if (!next) break;
        status = Handle(from, std::move(*next));
      }
      if (status.ok()) continue;
      open[static_cast<size_t>(from)] = false;
      bool left;
      {
        MutexLock lock(&mutex_);
        left = said_bye_[static_cast<size_t>(from)];
        changed_.NotifyAll();
      }
      if (!left) {
        MemberLost(from, status.code() == StatusCode::kNotFound
                             ? "its rendezvous connection closed without a goodbye"
                             : status.message());
      }
    }
  }
}

Status SocketRendezvous::Handle(int from, Frame frame) {
  switch (frame.kind) {
    case Kind::kContribution: {
      if (rank_ != 0 || frame.payload.size() < 4) return DataLoss("unexpected contribution");
      const uint32_t round = GetU32(frame.payload, 0);
      MutexLock lock(&mutex_);
      if (auto all = contributions_.Contribute(round, from, frame.payload.substr(4))) {
        results_[round] = std::move(*all);  // rank 0's AllGather relays it
      }
      changed_.NotifyAll();
      return Status::Ok();
    }
    case Kind::kAll: {
      if (rank_ == 0 || frame.payload.size() < 8) return DataLoss("unexpected all-gather result");
      const uint32_t round = GetU32(frame.payload, 0);
      const uint32_t count = GetU32(frame.payload, 4);
      std::vector<std::string> all;
      size_t offset = 8;
      for (uint32_t i = 0; i < count; ++i) {
        if (offset + 4 > frame.payload.size()) return DataLoss("truncated all-gather result");
        const uint32_t length = GetU32(frame.payload, offset);
        offset += 4;
        if (offset + length > frame.payload.size()) return DataLoss("truncated all-gather result");
        all.push_back(frame.payload.substr(offset, length));
        offset += length;
      }
      MutexLock lock(&mutex_);
      results_[round] = std::move(all);
      changed_.NotifyAll();
      return Status::Ok();
    }
    case Kind::kFailure:
      if (rank_ == 0) return DataLoss("a member sent a verdict");
      SetVerdict(DecodeStatus(frame.payload));
      return Status::Ok();
    case Kind::kReport: {
      if (rank_ != 0 || frame.payload.size() < 9) return DataLoss("unexpected failure report");
      const int64_t silent_ms = GetU32(frame.payload, 1);
      const uint32_t peer = GetU32(frame.payload, 5);
      AddReport(from, peer < static_cast<uint32_t>(size_) ? static_cast<int>(peer) : -1,
                DecodeStatus(frame.payload.substr(0, 1) + frame.payload.substr(9)), silent_ms);
      return Status::Ok();
    }
    case Kind::kBye: {
      MutexLock lock(&mutex_);
      said_bye_[static_cast<size_t>(from)] = true;
      changed_.NotifyAll();
      return Status::Ok();
    }
    default:
      return DataLoss("unexpected rendezvous frame kind {}", static_cast<int>(frame.kind));
  }
}

void SocketRendezvous::MemberLost(int rank, const std::string& why) {
  // A death is certain: it needs no window. On a member, the lost connection is rank 0's.
  SetVerdict(Unavailable("rank {} died: {}", rank, why));
}

void SocketRendezvous::AddReport(int reporter, int silent_peer, const Status& reason,
                                 int64_t silent_ms) {
  {
    MutexLock lock(&mutex_);
    verdict_.Report(reporter, silent_peer, reason, silent_ms, Clock::now());
  }
  Wake();
}

void SocketRendezvous::DecideFromReports() {
  Status verdict;
  {
    MutexLock lock(&mutex_);
    if (!verdict_.DecideIfDue(Clock::now())) return;
    verdict = verdict_.verdict();
    changed_.NotifyAll();
  }
  Announce(verdict);
}

void SocketRendezvous::SetVerdict(const Status& verdict) {
  {
    MutexLock lock(&mutex_);
    if (!verdict_.Decide(verdict)) return;
    changed_.NotifyAll();
  }
  Announce(verdict);
}

void SocketRendezvous::Announce(const Status& verdict) {
  FailureHandler handler;
  {
    MutexLock lock(&mutex_);
    handler = on_failure_;
  }
  if (rank_ == 0) {
    for (int r = 1; r < size_; ++r) (void)SendTo(r, Kind::kFailure, EncodeStatus(verdict));
  }
  if (handler) handler(verdict);
}

Status SocketRendezvous::AwaitVerdict(Clock::time_point until, const Status& fallback) {
  MutexLock lock(&mutex_);
  while (!verdict_.decided() && changed_.WaitUntil(&mutex_, until)) {
  }
  return verdict_.decided() ? verdict_.verdict() : fallback;
}

void SocketRendezvous::OnMemberFailure(FailureHandler on_failure) {
  Status known;
  {
    MutexLock lock(&mutex_);
    on_failure_ = on_failure;
    known = verdict_.verdict();
  }
  if (!known.ok()) on_failure(known);
}

Status SocketRendezvous::ReportFailure(const Status& reason, int64_t silent_ms, int silent_peer) {
  if (size_ == 1 || reason.ok()) return reason;
  {
    MutexLock lock(&mutex_);
    // What this member found follows from a known failure.
    if (verdict_.decided()) return verdict_.verdict();
  }
  const Clock::time_point until = Clock::now() + kVerdictWindow + std::chrono::seconds(2);
  if (rank_ == 0) {
    AddReport(0, silent_peer, reason, silent_ms);
  } else {
    std::string payload = EncodeStatus(reason);
    std::string header(1, payload[0]);
    PutU32(header, static_cast<uint32_t>(std::clamp<int64_t>(silent_ms, 0, UINT32_MAX)));
    PutU32(header, silent_peer >= 0 ? static_cast<uint32_t>(silent_peer) : UINT32_MAX);
    if (!SendTo(0, Kind::kReport, header + payload.substr(1)).ok()) return reason;
  }
  return AwaitVerdict(until, reason);
}

Result<std::vector<std::string>> SocketRendezvous::AllGather(const std::string& mine,
                                                             Clock::time_point deadline) {
  const uint32_t round = next_round_++;
  if (size_ == 1) return std::vector<std::string>{mine};
  MutexLock lock(&mutex_);
  if (rank_ != 0) {
    lock.Unlock();
    std::string payload;
    PutU32(payload, round);
    payload += mine;
    TESSERA_RETURN_IF_ERROR(SendTo(0, Kind::kContribution, payload));
    lock.Lock();
    while (!results_.contains(round) && !verdict_.decided() && !said_bye_[0] &&
           changed_.WaitUntil(&mutex_, deadline)) {
    }
    if (results_.contains(round)) {
      std::vector<std::string> all = std::move(results_[round]);
      results_.erase(round);
      return all;
    }
    if (verdict_.decided()) return verdict_.verdict();
    if (said_bye_[0]) return Unavailable("rank 0 left the group before round {} completed", round);
    return TimedOut("rank {} got no all-gather result from rank 0 in time", rank_);
  }
  if (auto all = contributions_.Contribute(round, 0, mine)) results_[round] = std::move(*all);
  while (!results_.contains(round) && !verdict_.decided() &&
         changed_.WaitUntil(&mutex_, deadline)) {
  }
  if (!results_.contains(round)) {
    if (verdict_.decided()) return verdict_.verdict();
    return TimedOut("rank 0 waited in vain for ranks {} to contribute",
                    fmt::join(contributions_.Missing(round), ", "));
  }
  std::vector<std::string> all = std::move(results_[round]);
  results_.erase(round);
  lock.Unlock();
  std::string payload;
  PutU32(payload, round);
  PutU32(payload, static_cast<uint32_t>(all.size()));
  for (const std::string& one : all) {
    PutU32(payload, static_cast<uint32_t>(one.size()));
    payload += one;
  }
  for (int r = 1; r < size_; ++r) TESSERA_RETURN_IF_ERROR(SendTo(r, Kind::kAll, payload));
  return all;
}

}  // namespace

Result<std::unique_ptr<Rendezvous>> JoinSocketRendezvous(const SocketRendezvousOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return InvalidArgument("rank {} of a group of {} is not a rank (0 <= rank < size)",
                           options.rank, options.size);
  }
  TESSERA_ASSIGN_OR_RETURN(rpc::Address address, rpc::Address::Parse(options.address));
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options.timeout_ms);
  auto rendezvous = std::make_unique<SocketRendezvous>(options.rank, options.size);
  if (options.size > 1) {
    if (options.rank == 0) {
      TESSERA_RETURN_IF_ERROR(rendezvous->JoinAsRoot(address, deadline));
    } else {
      TESSERA_RETURN_IF_ERROR(rendezvous->JoinAsMember(address, deadline));
    }
    rendezvous->StartWatching();
  }
  return std::unique_ptr<Rendezvous>(std::move(rendezvous));
}

}  // namespace tessera

// Connections that never say Hello, thrown at a real scheduler process (a local cluster's) whose
// preauth_* settings the environment shortens, as an operator would:
//   - a thousand idle connections are all closed within the deadline, while `tessera status` (a
//     new client, which must say Hello like anyone) answers meanwhile;
//   - a frame over the pre-Hello limit closes that connection only; after Hello the full limit;
//   - at the caps on pending connections the oldest are closed, a new client still gets in, and
//     once the idle ones expired clients join as before.
// Figures are printed; bounds are generous (several times the expected), for loaded machines.
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "client/cluster.h"
#include "core/rpc/connection.h"
#include "core/rpc/join.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using Clock = std::chrono::steady_clock;
using Socket = rpc::asio::ip::tcp::socket;

double MillisecondsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Whether the peer closed `socket` (end of stream or reset), without waiting.
bool ClosedByPeer(Socket& socket) {
  pollfd polled{socket.native_handle(), POLLIN | POLLRDHUP, 0};
  if (::poll(&polled, 1, 0) <= 0) return false;
  char byte;
  const ssize_t n = ::recv(socket.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

class PreauthLimitsTest : public ::testing::Test {
 protected:
  // A local cluster of one worker whose processes read these limits from the environment.
  void Start(int64_t deadline_ms, int64_t max_pending, int64_t max_pending_per_address) {
    ::setenv("TESSERA_PREAUTH_DEADLINE_MS", std::to_string(deadline_ms).c_str(), 1);
    ::setenv("TESSERA_PREAUTH_MAX_PENDING", std::to_string(max_pending).c_str(), 1);
    ::setenv("TESSERA_PREAUTH_MAX_PENDING_PER_ADDRESS",
             std::to_string(max_pending_per_address).c_str(), 1);
    LocalClusterOptions options;
    options.cpu_workers = 1;
    options.threads_per_worker = 1;
    options.host_capacity_bytes = int64_t{256} << 20;
    options.tessera_binary = BinaryPath("tessera");
    auto cluster = Cluster::StartLocal(options);
    ASSERT_OK(cluster.status());
    cluster_ = std::move(*cluster);
    auto address = rpc::Address::Parse(cluster_->address());
    ASSERT_OK(address.status());
    address_ = *address;
  }

  // `tessera status`: a new client that says Hello like any other.
  ProcessResult RunStatus() {
    return RunBinary("tessera", "status --address " + cluster_->address() + " --token-file " +
                                    cluster_->session_dir() + "/token");
  }
  void ExpectStatusAnswers(const char* when) {
    const Clock::time_point start = Clock::now();
    const ProcessResult status = RunStatus();
    std::printf("`tessera status` %s: exit %d in %.0f ms\n", when, status.exit_code,
                MillisecondsSince(start));
    EXPECT_EQ(status.exit_code, 0) << status.output;
    EXPECT_NE(status.output.find("1 of 1 workers alive"), std::string::npos) << status.output;
  }

  // A TCP connection to the scheduler that says nothing.
  Socket Idle() {
    Socket socket(io_);
    socket.connect(
        {rpc::asio::ip::make_address(address_.host == "localhost" ? "127.0.0.1" : address_.host),
         address_.port});
    return socket;
  }

  rpc::asio::io_context io_;
  std::unique_ptr<Cluster> cluster_;
  rpc::Address address_;
};

TEST_F(PreauthLimitsTest, IdleConnectionsAreClosedAtTheDeadlineWhileStatusAnswers) {
  // Both ends are descriptors: this process's, and the scheduler's (it inherits the limit).
  const int count = AffordableWithDescriptors(1000, 1, 256, "idle connections");
  constexpr int64_t kDeadlineMs = 2000;
  // Caps above the flood: only the deadline closes these.
  Start(kDeadlineMs, int64_t{4} * count, int64_t{4} * count);
  const Clock::time_point opened = Clock::now();
  std::vector<Socket> idle;
  idle.reserve(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) idle.push_back(Idle());
  std::printf("%d idle connections opened in %.0f ms\n", count, MillisecondsSince(opened));
  ExpectStatusAnswers("with them open");
  int closed = 0;
  const bool all_closed = Eventually(
      [&] {
        closed = 0;
        for (Socket& socket : idle) closed += ClosedByPeer(socket);
        return closed == count;
      },
      std::chrono::seconds(30), std::chrono::milliseconds(50));
  const double ms = MillisecondsSince(opened);
  std::printf(
      "%d of %d closed by the scheduler %.0f ms after the first was opened (deadline %lld "
      "ms)\n",
      closed, count, ms, static_cast<long long>(kDeadlineMs));
  EXPECT_TRUE(all_closed);
  EXPECT_LT(ms, 15'000) << "generous: the deadline plus the time to open them is expected";
  // The cluster's own participants were never pending: it works as before.
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster_->Info());
  EXPECT_EQ(info.workers.size(), 1u);
  ExpectStatusAnswers("after they were closed");
}

TEST_F(PreauthLimitsTest, AFrameOverThePreHelloLimitClosesThatConnectionOnly) {
  Start(/*deadline_ms=*/600'000, 64, 64);  // no deadline within the test
  Socket bystander = Idle();
  Socket large = Idle();
  // A frame header announcing 1 MiB (over the 64 KiB before Hello), and the start of it.
  std::vector<uint8_t> frame(8 + 4096, 0);
  const uint32_t magic = rpc::kFrameMagic, length = 1 << 20;
  std::memcpy(frame.data(), &magic, 4);
  std::memcpy(frame.data() + 4, &length, 4);
  rpc::asio::write(large, rpc::asio::buffer(frame));
  EXPECT_TRUE(Eventually([&] { return ClosedByPeer(large); }, std::chrono::seconds(10)));
  EXPECT_FALSE(ClosedByPeer(bystander));

  // After Hello the full limit: a frame of 1.6 MiB (releases of objects this driver never had:
  // harmless), then a status request, on one admitted connection.
  rpc::asio::io_context io;
  auto work = rpc::asio::make_work_guard(io);
  std::thread thread([&] { io.run(); });
  auto replied = std::make_shared<std::atomic<bool>>(false);
  rpc::HelloFields hello;
  hello.role = proto::Role::DRIVER;
  hello.token = ReadFileText(cluster_->session_dir() + "/token");
  while (!hello.token.empty() && hello.token.back() == '\n') hello.token.pop_back();
  auto joined = rpc::Join(
      io, address_, hello, 5000,
      [replied](rpc::Connection&, rpc::ReceivedMessage& message) {
        auto body = message.reader().getRoot<proto::Envelope>().getBody();
        if (body.which() == proto::Envelope::Body::STATUS_REPLY) replied->store(true);
        return Status::Ok();
      },
      [](const Status&) {});
  ASSERT_OK(joined.status());
  capnp::MallocMessageBuilder releases;
  auto ids = releases.initRoot<proto::Envelope>().initBody().initReleaseObjects().initIds(200'000);
  for (unsigned i = 0; i < ids.size(); ++i) ids.set(i, (uint64_t{1} << 62) + i);
  joined->connection->Send(releases);
  capnp::MallocMessageBuilder status;
  status.initRoot<proto::Envelope>().initBody().initStatusRequest();
  joined->connection->Send(status);
  EXPECT_TRUE(Eventually([&] { return replied->load(); }))
      << "the admitted connection did not survive a large frame";
  joined->connection->Close(Cancelled("test over"));
  work.reset();
  thread.join();
  ExpectStatusAnswers("after the large pre-Hello frame");
}

TEST_F(PreauthLimitsTest, AtTheCapsTheOldestPendingAreClosedAndClientsStillJoin) {
  constexpr int64_t kDeadlineMs = 3000;
  Start(kDeadlineMs, /*max_pending=*/16, /*max_pending_per_address=*/8);
  std::vector<Socket> idle;
  idle.reserve(20);
  for (int i = 0; i < 20; ++i) idle.push_back(Idle());
  // All from this host: 8 stay pending, the 12 oldest are closed.
  std::vector<bool> closed(idle.size());
  EXPECT_TRUE(Eventually([&] {
    int count = 0;
    for (size_t i = 0; i < idle.size(); ++i) count += closed[i] = ClosedByPeer(idle[i]);
    return count == 12;
  })) << "not 12 of 20 closed";
  for (size_t i = 0; i < idle.size(); ++i) EXPECT_EQ(closed[i], i < 12) << "connection " << i;
  // A client still gets in: its connection displaces the oldest idle one.
  ExpectStatusAnswers("with the caps full");
  // Once the idle ones expired, clients join as before.
  const Clock::time_point start = Clock::now();
  EXPECT_TRUE(Eventually(
      [&] {
        for (Socket& socket : idle) {
          if (!ClosedByPeer(socket)) return false;
        }
        return true;
      },
      std::chrono::seconds(30)));
  std::printf("the idle connections were all closed %.0f ms later (deadline %lld ms)\n",
              MillisecondsSince(start), static_cast<long long>(kDeadlineMs));
  ExpectStatusAnswers("after the idle ones expired");
}

}  // namespace
}  // namespace tessera::testing

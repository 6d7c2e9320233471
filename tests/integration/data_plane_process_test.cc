// The data plane between two processes on this host, where pulls and pushes are single copies
// out of the peer's memory: a holder killed in the middle of pulls makes them fail with an error
// (never a crash of the puller, as UCX's own CMA transport would cause).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/transport/data_plane.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

constexpr int64_t kBytes = 64 << 20;
constexpr uint64_t kObject = 7;
constexpr const char* kToken = "data-plane-process-test";

// The child: serves a 64 MiB pattern, tells the parent its address, then waits to be killed.
[[noreturn]] void RunHolder(int address_pipe) {
  auto data = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(kBytes));
  for (int64_t i = 0; i < kBytes; ++i)
    (*data)[static_cast<size_t>(i)] = static_cast<uint8_t>(i % 251);
  auto plane = DataPlane::Start({.token = kToken}, [data](ObjectId id) -> Result<ServedObject> {
    if (id.value() != kObject) return NotFound("no {}", id.ToString());
    return ServedObject{data->data(), kBytes, data};
  });
  if (!plane.ok()) _exit(2);
  const std::string& address = (*plane)->address();
  if (::write(address_pipe, address.data(), address.size()) < 0) _exit(3);
  ::close(address_pipe);
  while (true) ::pause();
}

TEST(DataPlaneProcessTest, PullsFromAKilledHolderFailWithoutCrashingThePuller) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t child = ::fork();  // before this process starts UCX
  if (child == 0) {
    ::close(fds[0]);
    RunHolder(fds[1]);
  }
  ::close(fds[1]);
  char buffer[256] = {};
  const ssize_t n = ::read(fds[0], buffer, sizeof(buffer) - 1);
  ::close(fds[0]);
  ASSERT_GT(n, 0) << "the holder did not start";
  const std::string address(buffer, static_cast<size_t>(n));

  DataPlaneOptions options;
  options.token = kToken;
  options.pull_timeout_ms = 10'000;
  auto puller = DataPlane::Start(
      options, [](ObjectId id) -> Result<ServedObject> { return NotFound("{}", id.ToString()); });
  ASSERT_OK(puller.status());
  std::vector<uint8_t> dest(static_cast<size_t>(kBytes));
  // One complete pull: the bytes arrive intact.
  ASSERT_OK((*puller)->PullAndWait(address, ObjectId(kObject), dest.data(), kBytes));
  for (int64_t i = 0; i < kBytes; i += 4099) {
    ASSERT_EQ(dest[static_cast<size_t>(i)], static_cast<uint8_t>(i % 251)) << i;
  }
  // Pull again and again while the holder is killed.
  std::atomic<bool> stop{false}, failed{false};
  Status failure;
  int pulls = 0;
  std::thread pulling([&] {
    while (!stop.load()) {
      Status status = (*puller)->PullAndWait(address, ObjectId(kObject), dest.data(), kBytes);
      ++pulls;
      if (!status.ok()) {
        failure = status;
        failed.store(true);
        return;
      }
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  // A hang guard beyond the pull deadline: the failure itself comes at once.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(12);
  while (!failed.load() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  stop.store(true);
  pulling.join();
  EXPECT_FALSE(failure.ok()) << "pulls from a dead holder kept succeeding (" << pulls << ")";
  EXPECT_NE(failure.message().find(address), std::string::npos) << failure.ToString();
  std::printf("after %d pulls: %s\n", pulls, failure.ToString().c_str());
}

}  // namespace
}  // namespace tessera::testing

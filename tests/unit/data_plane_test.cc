// The UCX data plane, with two instances in one process: pulls of every size, errors, and
// peers that disappear.
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include <spdlog/sinks/ostream_sink.h>
#include <ucs/config/global_opts.h>
#include <ucs/debug/log_def.h>

#include "core/logging.h"
#include "core/transport/data_plane.h"
#include "core/transport/ucx_common.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

constexpr const char* kToken = "data-plane-test-token";

// A holder serving byte patterns from a map.
class Holder {
 public:
  Holder() {
    DataPlaneOptions options;
    options.token = kToken;
    options.chunk_bytes = 1 << 20;  // small chunks: exercises pipelining
    auto plane = DataPlane::Start(options, [this](ObjectId id) -> Result<ServedObject> {
      std::lock_guard lock(mutex_);
      auto it = objects_.find(id.value());
      if (it == objects_.end()) return NotFound("{} is not here", id.ToString());
      return ServedObject{it->second->data(), static_cast<int64_t>(it->second->size()), it->second};
    });
    TESSERA_CHECK(plane.ok(), "{}", plane.status().ToString());
    plane_ = std::move(*plane);
  }
  void Add(uint64_t id, int64_t bytes) {
    auto data = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(bytes));
    for (int64_t i = 0; i < bytes; ++i) (*data)[i] = static_cast<uint8_t>(i * 7 + id);
    std::lock_guard lock(mutex_);
    objects_[id] = data;
  }
  DataPlane& plane() { return *plane_; }

 private:
  std::mutex mutex_;
  std::map<uint64_t, std::shared_ptr<std::vector<uint8_t>>> objects_;
  std::unique_ptr<DataPlane> plane_;
};

std::unique_ptr<DataPlane> Puller(int timeout_ms = 30'000) {
  DataPlaneOptions options;
  options.token = kToken;
  options.pull_timeout_ms = timeout_ms;
  auto plane = DataPlane::Start(
      options, [](ObjectId id) -> Result<ServedObject> { return NotFound("{}", id.ToString()); });
  TESSERA_CHECK(plane.ok(), "{}", plane.status().ToString());
  return std::move(*plane);
}

bool PatternMatches(const std::vector<uint8_t>& data, uint64_t id) {
  for (size_t i = 0; i < data.size(); ++i) {
    if (data[i] != static_cast<uint8_t>(i * 7 + id)) return false;
  }
  return true;
}

// UCX's own log lines go to the "ucx" logger: an error as an error, a warning as a warning; the
// lines a flush writes when the peer's endpoint is already gone as debug.
TEST(UcxLogTest, UcxLinesGoToTheUcxLoggerAndAGoneEndpointsFlushLinesAreDebug) {
  detail::RouteUcxLogging();
  std::ostringstream captured;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(captured);
  sink->set_pattern("%l|%v");
  const std::shared_ptr<spdlog::logger> logger = GetLogger("ucx");
  const spdlog::level::level_enum level = logger->level();
  logger->sinks().push_back(sink);
  logger->set_level(spdlog::level::debug);
  ucs_log_component_config_t* component = &ucs_global_opts.log_component;
  ucs_log_dispatch("made.c", 7, "f", UCS_LOG_LEVEL_ERROR, component, "no route to %s", "peer");
  ucs_log_dispatch("made.c", 8, "f", UCS_LOG_LEVEL_WARN, component, "slow %d", 3);
  ucs_log_dispatch("flush.c", 26, "f", UCS_LOG_LEVEL_ERROR, component,
                   "req %s: error during flush: %s, flush comp count reduced to %d", "0x10",
                   "Endpoint timeout", 0);
  logger->sinks().pop_back();
  logger->set_level(level);
  const std::string text = captured.str();
  EXPECT_NE(text.find("error|no route to peer (made.c:7)"), std::string::npos) << text;
  EXPECT_NE(text.find("warning|slow 3 (made.c:8)"), std::string::npos) << text;
  EXPECT_NE(text.find("debug|req 0x10: error during flush: Endpoint timeout"), std::string::npos)
      << text;
}

TEST(DataPlaneTest, PullsObjectsOfEverySizeIntact) {
  Holder holder;
  auto puller = Puller();
  const std::vector<int64_t> sizes = {
      0, 1, 7, 4096, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 5'000'011, 64 << 20};
  for (size_t i = 0; i < sizes.size(); ++i) holder.Add(100 + i, sizes[i]);
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<uint8_t> dest(static_cast<size_t>(sizes[i]));
    ASSERT_OK(
        puller->PullAndWait(holder.plane().address(), ObjectId(100 + i), dest.data(), sizes[i]));
    EXPECT_TRUE(PatternMatches(dest, 100 + i)) << "size " << sizes[i];
  }
  EXPECT_EQ(puller->stats().pulls, static_cast<int64_t>(sizes.size()));
}

TEST(DataPlaneTest, UnknownObjectsAndBadRangesAreErrorsFromTheHolder) {
  Holder holder;
  holder.Add(1, 1000);
  auto puller = Puller();
  std::vector<uint8_t> dest(5000);
  Status unknown = puller->PullAndWait(holder.plane().address(), ObjectId(99), dest.data(), 10);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.code(), StatusCode::kNotFound);
  EXPECT_NE(unknown.message().find("obj99 is not here"), std::string::npos) << unknown.ToString();
  Status too_long = puller->PullAndWait(holder.plane().address(), ObjectId(1), dest.data(), 5000);
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.message().find("outside"), std::string::npos) << too_long.ToString();
  // The connection still works afterwards.
  EXPECT_OK(puller->PullAndWait(holder.plane().address(), ObjectId(1), dest.data(), 1000));
}

TEST(DataPlaneTest, ConcurrentPullsFromSeveralThreads) {
  Holder holder;
  for (uint64_t id = 1; id <= 8; ++id) holder.Add(id, 3 << 20);
  auto puller = Puller();
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (uint64_t id = 1; id <= 8; ++id) {
    threads.emplace_back([&, id] {
      std::vector<uint8_t> dest(3 << 20);
      if (puller->PullAndWait(holder.plane().address(), ObjectId(id), dest.data(), 3 << 20).ok() &&
          PatternMatches(dest, id)) {
        ++good;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(good.load(), 8);
}

TEST(DataPlaneTest, UnreachableAndForgottenPeersFailInsteadOfHanging) {
  auto puller = Puller(/*timeout_ms=*/3000);
  std::vector<uint8_t> dest(100);
  // Nothing listens on port 1.
  Status unreachable = puller->PullAndWait("127.0.0.1:1", ObjectId(1), dest.data(), 100);
  ASSERT_FALSE(unreachable.ok());
  EXPECT_NE(unreachable.message().find("127.0.0.1:1"), std::string::npos) << unreachable.ToString();

  Holder holder;
  holder.Add(1, 100);
  puller->ForgetPeer(holder.plane().address(), Unavailable("worker3 died"));
  Status forgotten = puller->PullAndWait(holder.plane().address(), ObjectId(1), dest.data(), 100);
  ASSERT_FALSE(forgotten.ok());
  EXPECT_NE(forgotten.message().find("worker3 died"), std::string::npos) << forgotten.ToString();
}

TEST(DataPlaneTest, PushesArriveWhereTheReceiverPutsThem) {
  std::mutex mutex;
  std::condition_variable arrived;
  std::map<uint64_t, std::vector<uint8_t>> buffers;
  std::map<uint64_t, Status> delivered;
  PushHandlers handlers;
  handlers.accept = [&](const PushKey& key, int64_t bytes) -> Result<void*> {
    if (key.graph != 7) return InvalidArgument("unknown graph {}", key.graph);
    std::lock_guard lock(mutex);
    auto& buffer = buffers[key.object];
    buffer.resize(static_cast<size_t>(bytes));
    return static_cast<void*>(buffer.data());
  };
  handlers.delivered = [&](const PushKey& key, const Status& status) {
    std::lock_guard lock(mutex);
    delivered[key.graph * 1000 + key.object] = status;
    arrived.notify_all();
  };
  auto receiver = DataPlane::Start(
      {.token = kToken}, [](ObjectId) -> Result<ServedObject> { return NotFound("x"); }, handlers);
  ASSERT_TRUE(receiver.ok());
  auto sender = Puller();
  const std::vector<int64_t> sizes = {0, 100, 3 << 20, 64 << 20};
  std::atomic<int> sent{0};
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto data = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(sizes[i]));
    for (int64_t b = 0; b < sizes[i]; ++b) (*data)[b] = static_cast<uint8_t>(b * 7 + i);
    sender->Push((*receiver)->address(), PushKey{7, 1, i}, data->data(), sizes[i], data,
                 [&](const Status& status) {
                   EXPECT_OK(status);
                   ++sent;
                 });
  }
  // A push the receiver refuses is reported to its delivered handler, not lost silently.
  auto junk = std::make_shared<std::vector<uint8_t>>(4 << 20);
  sender->Push((*receiver)->address(), PushKey{99, 1, 0}, junk->data(), 4 << 20, junk,
               [](const Status&) {});
  std::unique_lock lock(mutex);
  ASSERT_TRUE(arrived.wait_for(lock, std::chrono::seconds(20),
                               [&] { return delivered.size() == sizes.size() + 1; }));
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_OK(delivered.at(7000 + i));
    EXPECT_TRUE(PatternMatches(buffers.at(i), i)) << "size " << sizes[i];
  }
  EXPECT_NE(delivered.at(99000).message().find("unknown graph 99"), std::string::npos);
}

}  // namespace
}  // namespace tessera::testing

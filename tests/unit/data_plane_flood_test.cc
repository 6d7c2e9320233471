// A data plane flooded with endpoints that connect and never prove the cluster token (a raw UCX
// peer, raw_data_plane_peer.h, opening them from one worker). Each is closed at its own deadline
// or as the oldest over a cap on pending endpoints, and meanwhile a member's handshake and pull
// take what they take on a quiet data plane: no wait behind the flood. The figures are printed;
// the bounds are generous (a loaded machine), the expected times are milliseconds.
#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "core/transport/data_plane.h"
#include "raw_data_plane_peer.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kToken = "data-plane-flood-test";
constexpr uint64_t kObject = 1;
constexpr int64_t kObjectBytes = 4096;
// Descriptors one silent endpoint costs this process (its side and, in process, the data
// plane's): UCX's connection-manager socket and transport sockets on each side, with margin.
constexpr int kDescriptorsPerEndpoint = 8;

double MillisecondsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

DataPlaneOptions Options(PendingLimits preauth) {
  DataPlaneOptions options;
  options.token = kToken;
  options.pull_timeout_ms = 60'000;  // a pull that waits for the flood shows as a slow pull
  options.preauth = preauth;
  return options;
}

// A data plane holding one 4 KiB object.
std::unique_ptr<DataPlane> Holder(PendingLimits preauth) {
  auto object = std::make_shared<std::vector<uint8_t>>(kObjectBytes, 0x5a);
  auto plane = DataPlane::Start(Options(preauth), [object](ObjectId id) -> Result<ServedObject> {
    if (id.value() != kObject) return NotFound("{} is not here", id.ToString());
    return ServedObject{object->data(), kObjectBytes, object};
  });
  TESSERA_CHECK(plane.ok(), "{}", plane.status().ToString());
  return std::move(*plane);
}

// A new member of the cluster pulls the object: its endpoint, handshake and pull. Returns the
// milliseconds it took.
double TimeMembersPull(const DataPlane& holder) {
  auto member = DataPlane::Start(Options(PendingLimits{}), [](ObjectId) -> Result<ServedObject> {
    return NotFound("nothing here");
  });
  TESSERA_CHECK(member.ok(), "{}", member.status().ToString());
  std::vector<uint8_t> dest(kObjectBytes);
  const Clock::time_point start = Clock::now();
  const Status pulled =
      (*member)->PullAndWait(holder.address(), ObjectId(kObject), dest.data(), kObjectBytes);
  const double ms = MillisecondsSince(start);
  EXPECT_OK(pulled);
  EXPECT_EQ(dest[kObjectBytes - 1], 0x5a);
  return ms;
}

// Floods `holder` with `count` silent endpoints (they connect and receive the challenge, then say
// nothing more) and waits until it counts at least `expect_pending` of them.
std::unique_ptr<RawDataPlanePeer> Flood(const DataPlane& holder, int count, int expect_pending) {
  auto flood = RawDataPlanePeer::Connect(holder.address());
  TESSERA_CHECK(flood.ok(), "{}", flood.status().ToString());
  TESSERA_CHECK((*flood)->OpenMore(count - 1).ok(), "opening the flood");
  const bool landed = Eventually(
      [&] {
        (*flood)->ProgressFor(20);  // lets UCX connect them
        return holder.stats().pending_connections + holder.stats().shed_connections >=
               expect_pending;
      },
      std::chrono::seconds(30));
  EXPECT_TRUE(landed) << holder.stats().pending_connections << " pending, "
                      << holder.stats().shed_connections << " shed";
  return std::move(*flood);
}

TEST(DataPlaneFloodTest, SilentEndpointsDoNotDelayAMembersHandshake) {
  const int count =
      AffordableWithDescriptors(1000, kDescriptorsPerEndpoint, 512, "silent endpoints");
  // Caps above the flood: only the deadline closes them; the member must not wait behind them.
  const PendingLimits preauth{
      .deadline_ms = 3000, .max_pending = 2 * count, .max_pending_per_address = 2 * count};
  auto holder = Holder(preauth);
  const double quiet_ms = TimeMembersPull(*holder);
  const Clock::time_point flooded = Clock::now();
  auto flood = Flood(*holder, count, count);
  std::printf("%d silent endpoints connected in %.0f ms; %lld pending\n", count,
              MillisecondsSince(flooded),
              static_cast<long long>(holder->stats().pending_connections));
  const double busy_ms = TimeMembersPull(*holder);
  std::printf("a member's handshake and pull: %.1f ms quiet, %.1f ms behind the flood\n", quiet_ms,
              busy_ms);
  EXPECT_LT(busy_ms, 5000) << "generous: a second at most is expected, never the deadline";
  // Every silent endpoint is closed at its deadline (3 s), without a word from the flood.
  EXPECT_TRUE(Eventually([&] { return holder->stats().pending_connections == 0; },
                         std::chrono::seconds(30)));
  std::printf("all closed %.0f ms after the flood began (deadline %lld ms); %lld shed\n",
              MillisecondsSince(flooded), static_cast<long long>(preauth.deadline_ms),
              static_cast<long long>(holder->stats().shed_connections));
  EXPECT_GE(holder->stats().shed_connections, count);
  // Serving as before.
  TimeMembersPull(*holder);
}

TEST(DataPlaneFloodTest, PendingEndpointsOverTheCapsAreShedOldestFirst) {
  // A deadline far beyond the test: only the caps act.
  const PendingLimits preauth{
      .deadline_ms = 600'000, .max_pending = 32, .max_pending_per_address = 16};
  auto holder = Holder(preauth);
  auto flood = Flood(*holder, 40, 40);
  // All from this host's address: at most 16 stay pending, the 24 oldest were closed.
  EXPECT_TRUE(Eventually([&] {
    flood->ProgressFor(10);
    return holder->stats().pending_connections == 16 && holder->stats().shed_connections == 24;
  })) << holder->stats().pending_connections
      << " pending, " << holder->stats().shed_connections << " shed";
  // A member from the same address gets in: the oldest silent one makes room.
  const double ms = TimeMembersPull(*holder);
  std::printf("a member's handshake and pull with the caps full: %.1f ms\n", ms);
  EXPECT_LT(ms, 5000);
  EXPECT_LE(holder->stats().pending_connections, 16);
}

}  // namespace
}  // namespace tessera::testing

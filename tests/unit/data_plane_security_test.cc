// The data plane against peers that do not play by its rules: processes without the cluster
// token, a wrong token on either side, chunk requests whose range overflows, and seeded fuzzing
// of every field of every message in both directions. A raw UCX peer (raw_data_plane_peer.h)
// sends the bytes; each case checks what the data plane answered, what it served or delivered,
// and that it still serves a member of the cluster afterwards.
#include <climits>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <set>

#include "core/transport/data_plane.h"
#include "core/transport/data_plane_wire.h"
#include "raw_data_plane_peer.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using detail::ChallengeHeader;
using detail::ChunkHeader;
using detail::ChunkReadHeader;
using detail::GetChunkHeader;
using detail::HelloHeader;
using detail::kByAddress;
using detail::kChallenge;
using detail::kChunk;
using detail::kChunkRead;
using detail::kGetChunk;
using detail::kHello;
using detail::kPush;
using detail::kPushRead;
using detail::kWelcome;
using detail::kWireMagic;
using detail::kWireVersion;
using detail::PushHeader;
using detail::PushReadHeader;
using detail::WelcomeHeader;

constexpr const char* kToken = "data-plane-security-test";
constexpr uint64_t kObject = 1;
constexpr int64_t kObjectBytes = 1 << 20;  // 1 MiB, the size in the report
constexpr uint64_t kPushGraph = 7;         // the graph the holder accepts pushes for
constexpr uint64_t kStrangerGraph = 8;     // pushes of peers without the token are marked so
constexpr uint64_t kFuzzSeed = 20261124;

uint8_t PatternByte(uint64_t object, int64_t i) {
  return static_cast<uint8_t>(i * 7 + static_cast<int64_t>(object) * 13);
}

// `timeout_ms`: the pull deadline, and how long a connection may take to prove the token.
DataPlaneOptions MemberOptions(int timeout_ms = 5000) {
  DataPlaneOptions options;
  options.token = kToken;
  options.pull_timeout_ms = timeout_ms;
  options.preauth.deadline_ms = timeout_ms;
  return options;
}

std::unique_ptr<DataPlane> Member(int timeout_ms = 5000) {
  auto plane = DataPlane::Start(MemberOptions(timeout_ms), [](ObjectId id) -> Result<ServedObject> {
    return NotFound("{}", id.ToString());
  });
  TESSERA_CHECK(plane.ok(), "{}", plane.status().ToString());
  return std::move(*plane);
}

// A holder of objects 1 (1 MiB), 2 (4096 bytes) and 3 (1 byte) that accepts pushes for graph 7 and
// records every push it is asked to accept or told was delivered.
class Holder {
 public:
  // `timeout_ms`: how long a connection may take to prove the token (and the pull deadline).
  explicit Holder(int timeout_ms = 60'000) {
    for (auto [id, bytes] : {std::pair<uint64_t, int64_t>{1, kObjectBytes}, {2, 4096}, {3, 1}}) {
      auto data = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(bytes));
      for (int64_t i = 0; i < bytes; ++i) (*data)[static_cast<size_t>(i)] = PatternByte(id, i);
      objects_[id] = data;
    }
    PushHandlers handlers;
    handlers.accept = [this](const PushKey& key, int64_t bytes) -> Result<void*> {
      std::lock_guard lock(mutex_);
      accepted_graphs_.insert(key.graph);
      if (key.graph != kPushGraph || bytes > (1 << 20)) {
        return InvalidArgument("no push of {} bytes for graph {} is expected", bytes, key.graph);
      }
      auto& buffer = pushed_[key.object];
      buffer.assign(static_cast<size_t>(bytes), 0);
      return static_cast<void*>(buffer.data());
    };
    handlers.delivered = [this](const PushKey& key, const Status& status) {
      std::lock_guard lock(mutex_);
      delivered_graphs_.insert(key.graph);
      if (status.ok()) ++delivered_ok_;
    };
    auto plane = DataPlane::Start(
        MemberOptions(timeout_ms),
        [this](ObjectId id) -> Result<ServedObject> {
          auto it = objects_.find(id.value());
          if (it == objects_.end()) return NotFound("{} is not here", id.ToString());
          return ServedObject{it->second->data(), static_cast<int64_t>(it->second->size()),
                              it->second};
        },
        handlers);
    TESSERA_CHECK(plane.ok(), "{}", plane.status().ToString());
    plane_ = std::move(*plane);
  }

  DataPlane& plane() { return *plane_; }
  const std::string& address() const { return plane_->address(); }
  int64_t size(uint64_t object) const {
    auto it = objects_.find(object);
    return it == objects_.end() ? -1 : static_cast<int64_t>(it->second->size());
  }
  // Whether [offset, offset + length) of `object` equals `bytes`.
  bool Matches(uint64_t object, int64_t offset, const uint8_t* bytes, int64_t length) const {
    for (int64_t i = 0; i < length; ++i) {
      if (bytes[i] != PatternByte(object, offset + i)) return false;
    }
    return true;
  }
  std::set<uint64_t> accepted_graphs() {
    std::lock_guard lock(mutex_);
    return accepted_graphs_;
  }
  std::set<uint64_t> delivered_graphs() {
    std::lock_guard lock(mutex_);
    return delivered_graphs_;
  }
  int delivered_ok() {
    std::lock_guard lock(mutex_);
    return delivered_ok_;
  }
  std::vector<uint8_t> pushed(uint64_t object) {
    std::lock_guard lock(mutex_);
    return pushed_[object];
  }

 private:
  std::map<uint64_t, std::shared_ptr<std::vector<uint8_t>>> objects_;
  std::mutex mutex_;
  std::set<uint64_t> accepted_graphs_;
  std::set<uint64_t> delivered_graphs_;
  std::map<uint64_t, std::vector<uint8_t>> pushed_;
  int delivered_ok_ = 0;
  std::unique_ptr<DataPlane> plane_;
};

// The holder's reply carries an error and nothing of any object.
void ExpectErrorWithoutBytes(const RawDataPlanePeer::Message& reply, StatusCode code,
                             const std::string& says) {
  const auto header = reply.As<ChunkHeader>();
  EXPECT_EQ(header.status, static_cast<int32_t>(code)) << reply.text();
  EXPECT_EQ(header.flags, 0u);
  EXPECT_EQ(header.address, 0u);
  EXPECT_FALSE(reply.rendezvous);
  EXPECT_EQ(header.length, static_cast<int64_t>(reply.payload.size()));
  EXPECT_LE(reply.payload.size(), detail::kMaxErrorText);
  EXPECT_NE(reply.text().find(says), std::string::npos) << reply.text();
}

void ExpectMemberIsServed(Holder& holder) {
  auto member = Member();
  std::vector<uint8_t> dest(static_cast<size_t>(kObjectBytes));
  ASSERT_OK(member->PullAndWait(holder.address(), ObjectId(kObject), dest.data(), kObjectBytes));
  EXPECT_TRUE(holder.Matches(kObject, 0, dest.data(), kObjectBytes));
}

TEST(DataPlaneSecurityTest, StartingWithoutATokenIsRefused) {
  auto plane = DataPlane::Start({}, [](ObjectId) -> Result<ServedObject> { return NotFound("x"); });
  ASSERT_FALSE(plane.ok());
  EXPECT_EQ(plane.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(plane.status().message().find("cluster token"), std::string::npos)
      << plane.status().ToString();
}

TEST(DataPlaneSecurityTest, PeersWithoutTheTokenAreRefusedAndGetNoBytes) {
  Holder holder;
  ASSERT_OK_AND_ASSIGN(auto stranger, RawDataPlanePeer::Connect(holder.address()));
  // The holder speaks first (its challenge); the stranger ignores it and asks for the object
  // whole, as bytes and as a loan of its address. Object ids are easy to guess: it is refused
  // for not holding the token, not for asking the wrong id.
  for (uint32_t flags : {0u, kByAddress}) {
    const GetChunkHeader ask{flags + 1, kObject, 0, kObjectBytes, flags, 0};
    ASSERT_OK(stranger->Send(kGetChunk, ask));
    auto reply = stranger->Next(kChunk);
    ASSERT_TRUE(reply.has_value()) << "no answer to an unauthenticated request";
    EXPECT_EQ(reply->As<ChunkHeader>().request, ask.request);
    ExpectErrorWithoutBytes(*reply, StatusCode::kUnavailable, "prove the cluster token");
  }
  // A request that does not name its endpoint gets no answer at all.
  const GetChunkHeader anonymous{9, kObject, 0, kObjectBytes, 0, 0};
  ASSERT_OK(stranger->Send(stranger->endpoint(), kGetChunk, &anonymous, sizeof(anonymous), nullptr,
                           0, /*reply=*/false));
  // Its pushes are never accepted or delivered: a large one's send is rejected, a small one
  // dropped.
  std::vector<uint8_t> junk(256 << 10, 0xab);
  const PushHeader large{{kStrangerGraph, 1, 1}, static_cast<int64_t>(junk.size()), 1, 0, 0, 0};
  EXPECT_FALSE(stranger
                   ->Send(stranger->endpoint(), kPush, &large, sizeof(large), junk.data(),
                          junk.size(), true, UCP_AM_SEND_FLAG_RNDV)
                   .ok());
  const PushHeader small{{kStrangerGraph, 1, 2}, 16, 2, 0, 0, 0};
  ASSERT_OK(stranger->Send(stranger->endpoint(), kPush, &small, sizeof(small), junk.data(), 16));
  // Nor can it lend one for the holder to read out of it, or end others' loans.
  const PushHeader lent{
      {kStrangerGraph, 1, 3}, 64, 3, reinterpret_cast<uint64_t>(junk.data()), kByAddress, 0};
  ASSERT_OK(stranger->Send(kPush, lent));
  ASSERT_OK(stranger->Send(kChunkRead, ChunkReadHeader{1}));
  stranger->ProgressFor(300);
  for (const auto& message : stranger->TakeAll()) {
    EXPECT_NE(message.id, kChunk) << "answered a request that did not name its endpoint";
    EXPECT_NE(message.id, kPushRead);
  }

  const DataPlaneStats stats = holder.plane().stats();
  EXPECT_EQ(stats.bytes_served, 0);
  EXPECT_EQ(stats.serves, 0);
  EXPECT_GE(stats.refused, 7);
  EXPECT_TRUE(holder.accepted_graphs().empty());
  EXPECT_TRUE(holder.delivered_graphs().empty());
  ExpectMemberIsServed(holder);
}

TEST(DataPlaneSecurityTest, AWrongTokenIsRefusedAtTheHandshake) {
  Holder holder;
  ASSERT_OK_AND_ASSIGN(auto impostor, RawDataPlanePeer::Connect(holder.address()));
  ASSERT_OK_AND_ASSIGN(auto welcomed, impostor->Handshake("another cluster's token"));
  EXPECT_EQ(welcomed.header.status, static_cast<int32_t>(StatusCode::kUnavailable));
  EXPECT_NE(welcomed.text.find("invalid cluster token"), std::string::npos) << welcomed.text;
  EXPECT_FALSE(welcomed.holder_proved);  // a refusal proves nothing
  // Refused once, refused for good on that endpoint; a second Hello is not considered.
  const GetChunkHeader ask{1, kObject, 0, 4096, 0, 0};
  ASSERT_OK(impostor->Send(kGetChunk, ask));
  auto reply = impostor->Next(kChunk);
  ASSERT_TRUE(reply.has_value());
  ExpectErrorWithoutBytes(*reply, StatusCode::kUnavailable, "prove the cluster token");

  // A data plane of another cluster: its pull fails with the holder's reason (not at the
  // deadline, which is far), naming the holder.
  DataPlaneOptions options = MemberOptions(/*timeout_ms=*/600'000);
  options.token = "another cluster's token";
  auto other =
      DataPlane::Start(options, [](ObjectId) -> Result<ServedObject> { return NotFound("x"); });
  ASSERT_OK(other.status());
  std::vector<uint8_t> dest(4096);
  const Status pulled =
      (*other)->PullAndWait(holder.address(), ObjectId(kObject), dest.data(), 4096);
  ASSERT_FALSE(pulled.ok());
  EXPECT_EQ(pulled.code(), StatusCode::kUnavailable);
  EXPECT_NE(pulled.message().find("invalid cluster token"), std::string::npos) << pulled.ToString();
  EXPECT_NE(pulled.message().find(holder.address()), std::string::npos) << pulled.ToString();
  EXPECT_EQ(holder.plane().stats().bytes_served, 0);
  ExpectMemberIsServed(holder);
}

// Plays a holder's side of the handshake on `ep` as `fake` (its challenge, then the welcome).
// `proof`: the right one for kToken, or garbage. Returns the client's Hello.
std::optional<RawDataPlanePeer::Message> PoseAsHolder(RawDataPlanePeer& fake, ucp_ep_h ep,
                                                      bool right_proof) {
  ChallengeHeader challenge{kWireMagic, kWireVersion, {}, fake.process()};
  TESSERA_CHECK(FillRandom(challenge.nonce).ok(), "random");
  if (!fake.Send(ep, kChallenge, &challenge, sizeof(challenge)).ok()) return std::nullopt;
  auto hello = fake.Next(kHello);
  if (!hello) return std::nullopt;
  const auto client = hello->As<HelloHeader>();
  WelcomeHeader welcome{0, 0, {}};
  welcome.proof.fill(0x5a);
  if (right_proof) {
    welcome.proof = detail::HandshakeProof(detail::DataPlaneKey(kToken), "holder", challenge.nonce,
                                           client.nonce, challenge.holder, client.client);
  }
  if (!fake.Send(hello->from, kWelcome, &welcome, sizeof(welcome)).ok()) return std::nullopt;
  return hello;
}

// Waits for `pulled` while progressing `fake` (whose UCX worker only moves when called).
std::optional<Status> AwaitPull(RawDataPlanePeer& fake, std::future<Status>& pulled) {
  for (int i = 0; i < 2000; ++i) {
    if (pulled.wait_for(std::chrono::milliseconds(0)) == std::future_status::ready) {
      return pulled.get();
    }
    fake.ProgressFor(5);
  }
  return std::nullopt;
}

TEST(DataPlaneSecurityTest, AHolderThatCannotProveTheTokenIsNeverAsked) {
  ASSERT_OK_AND_ASSIGN(auto fake, RawDataPlanePeer::Listen());
  auto puller = Member(/*timeout_ms=*/600'000);
  std::vector<uint8_t> dest(64);
  std::promise<Status> promise;
  std::future<Status> pulled = promise.get_future();
  puller->Pull(fake->address(), ObjectId(kObject), dest.data(), 64,
               [&](const Status& status) { promise.set_value(status); });
  const std::vector<ucp_ep_h> connections = fake->TakeNewConnections(/*timeout_ms=*/5000);
  ASSERT_EQ(connections.size(), 1u);
  auto hello = PoseAsHolder(*fake, connections[0], /*right_proof=*/false);
  ASSERT_TRUE(hello.has_value()) << "the puller did not answer the challenge";
  // The token itself is not on the wire, only a proof of it.
  const std::string_view token(kToken);
  EXPECT_EQ(std::search(hello->header.begin(), hello->header.end(), token.begin(), token.end()),
            hello->header.end());

  std::optional<Status> status = AwaitPull(*fake, pulled);
  ASSERT_TRUE(status.has_value()) << "the pull hangs on a holder that proved nothing";
  ASSERT_FALSE(status->ok());
  EXPECT_NE(status->message().find("did not prove it holds the cluster token"), std::string::npos)
      << status->ToString();
  fake->ProgressFor(200);
  for (const auto& message : fake->TakeAll()) {
    EXPECT_NE(message.id, kGetChunk) << "the puller asked an unproven holder for data";
  }
}

TEST(DataPlaneSecurityTest, OverflowingAndOutOfRangeChunkRequestsAreRefusedWithNoBytes) {
  Holder holder;
  ASSERT_OK_AND_ASSIGN(auto member, RawDataPlanePeer::Connect(holder.address()));
  ASSERT_OK_AND_ASSIGN(auto welcomed, member->Handshake(kToken));
  ASSERT_EQ(welcomed.header.status, 0) << welcomed.text;
  EXPECT_TRUE(welcomed.holder_proved);

  const int64_t size = kObjectBytes;
  const std::vector<std::pair<int64_t, int64_t>> outside = {
      {4096, INT64_MAX - 4095},  // the reported request: offset + length overflows
      {0, INT64_MAX},
      {1, INT64_MAX},
      {INT64_MAX, 1},
      {INT64_MAX, INT64_MAX},
      {INT64_MIN, 0},
      {INT64_MIN, INT64_MAX},
      {-1, 2},
      {0, -1},
      {-4096, 8192},
      {size, 1},
      {size - 1, 2},
      {1, size},
      {size + 1, 0},
      {0, size + 1},
  };
  uint64_t request = 100;
  for (uint32_t flags : {0u, kByAddress}) {
    for (auto [offset, length] : outside) {
      const GetChunkHeader ask{++request, kObject, offset, length, flags, 0};
      ASSERT_OK(member->Send(kGetChunk, ask));
      auto reply = member->Next(kChunk);
      ASSERT_TRUE(reply.has_value()) << offset << " +" << length;
      EXPECT_EQ(reply->As<ChunkHeader>().request, ask.request);
      SCOPED_TRACE(fmt::format("offset {} length {} flags {}", offset, length, flags));
      ExpectErrorWithoutBytes(*reply, StatusCode::kInvalidArgument,
                              "outside obj1 of 1048576 bytes");
    }
  }
  DataPlaneStats stats = holder.plane().stats();
  EXPECT_EQ(stats.bytes_served, 0);
  EXPECT_EQ(stats.serves, 0);
  EXPECT_GE(stats.refused, static_cast<int64_t>(2 * outside.size()));

  // The edges inside the object are served exactly.
  int64_t served = 0;
  for (auto [offset, length] : std::vector<std::pair<int64_t, int64_t>>{
           {0, size}, {size - 1, 1}, {size, 0}, {0, 0}, {12345, 4096}}) {
    const GetChunkHeader ask{++request, kObject, offset, length, 0, 0};
    ASSERT_OK(member->Send(kGetChunk, ask));
    auto reply = member->Next(kChunk);
    ASSERT_TRUE(reply.has_value());
    const auto header = reply->As<ChunkHeader>();
    ASSERT_EQ(header.status, 0) << reply->text();
    ASSERT_EQ(static_cast<int64_t>(reply->payload.size()), length);
    EXPECT_TRUE(holder.Matches(kObject, offset, reply->payload.data(), length)) << offset;
    served += length;
  }
  // A loan: the reply names an address in the holder (this process) and carries no bytes.
  const GetChunkHeader lend{++request, kObject, 4096, 4096, kByAddress, 0};
  ASSERT_OK(member->Send(kGetChunk, lend));
  auto lent = member->Next(kChunk);
  ASSERT_TRUE(lent.has_value());
  const auto lent_header = lent->As<ChunkHeader>();
  ASSERT_EQ(lent_header.status, 0);
  EXPECT_EQ(lent_header.flags, kByAddress);
  EXPECT_TRUE(lent->payload.empty());
  // The holder's buffer (in this process), whose address came as an integer on the wire.
  // NOLINTNEXTLINE(performance-no-int-to-ptr)
  const auto* lent_bytes = reinterpret_cast<const uint8_t*>(lent_header.address);
  EXPECT_TRUE(holder.Matches(kObject, 4096, lent_bytes, 4096));
  ASSERT_OK(member->Send(kChunkRead, ChunkReadHeader{lend.request}));
  served += 4096;
  member->ProgressFor(100);
  stats = holder.plane().stats();
  EXPECT_EQ(stats.bytes_served, served);
  EXPECT_EQ(stats.serves, 6);
  ExpectMemberIsServed(holder);
}

// Seeded fuzzing: values that break range checks, and random bytes.
class Fuzz {
 public:
  explicit Fuzz(uint64_t seed) : rng_(seed) {}
  uint64_t Below(uint64_t n) { return rng_() % n; }
  bool Chance(int percent) { return Below(100) < static_cast<uint64_t>(percent); }
  int64_t Edgy(int64_t size) {
    const int64_t values[] = {0,         1,         -1,
                              7,         4095,      4096,
                              4097,      size - 1,  size,
                              size + 1,  INT64_MAX, INT64_MAX - 4095,
                              INT64_MIN, INT32_MAX, int64_t{1} << 40};
    if (Chance(15)) return static_cast<int64_t>(rng_());
    return values[Below(std::size(values))];
  }
  void Fill(void* bytes, size_t length) {
    auto* out = static_cast<uint8_t*>(bytes);
    for (size_t i = 0; i < length; ++i) out[i] = static_cast<uint8_t>(rng_());
  }
  std::vector<uint8_t> Bytes(size_t length) {
    std::vector<uint8_t> out(length);
    Fill(out.data(), length);
    return out;
  }

 private:
  std::mt19937_64 rng_;
};

TEST(DataPlaneSecurityTest, FuzzedRequestsLeaveTheHolderServing) {
  Holder holder;
  ASSERT_OK_AND_ASSIGN(auto stranger, RawDataPlanePeer::Connect(holder.address()));
  ASSERT_OK_AND_ASSIGN(auto member, RawDataPlanePeer::Connect(holder.address()));
  ASSERT_OK_AND_ASSIGN(auto welcomed, member->Handshake(kToken));
  ASSERT_EQ(welcomed.header.status, 0) << welcomed.text;
  stranger->Next(kChallenge, 2000);  // taken, unanswered

  struct Asked {
    bool member;
    GetChunkHeader header;
  };
  std::map<uint64_t, Asked> asked;  // request -> what was asked, for every request that names its
                                    // endpoint and has a well-formed header
  Fuzz fuzz(kFuzzSeed);
  const uint16_t ids[] = {kGetChunk, kPush,    kChunkRead, kHello,
                          kChunk,    kWelcome, kChallenge, kPushRead};
  const size_t sizes[] = {sizeof(GetChunkHeader),  sizeof(PushHeader),    sizeof(ChunkReadHeader),
                          sizeof(HelloHeader),     sizeof(ChunkHeader),   sizeof(WelcomeHeader),
                          sizeof(ChallengeHeader), sizeof(PushReadHeader)};
  uint64_t next_request = 1;
  constexpr int kMessages = 1500;
  for (int i = 0; i < kMessages; ++i) {
    const bool from_member = fuzz.Chance(60);
    RawDataPlanePeer& peer = from_member ? *member : *stranger;
    const size_t which = fuzz.Below(std::size(ids));
    const bool well_formed = fuzz.Chance(85);
    std::vector<uint8_t> header =
        fuzz.Bytes(well_formed ? sizes[which] : static_cast<size_t>(fuzz.Below(100)));
    std::vector<uint8_t> payload;
    uint32_t send_flags = 0;
    const bool reply = fuzz.Chance(90);
    if (well_formed && ids[which] == kGetChunk) {
      uint64_t objects[] = {1, 2, 3, 4, fuzz.Below(UINT64_MAX)};
      GetChunkHeader get{next_request++, objects[fuzz.Below(std::size(objects))], 0, 0, 0, 0};
      const int64_t size = holder.size(get.object) < 0 ? 4096 : holder.size(get.object);
      get.offset = fuzz.Edgy(size);
      // Often the rest of the object from the offset (wrapping like the wire would, not UB).
      get.length = fuzz.Chance(30) ? static_cast<int64_t>(static_cast<uint64_t>(size) -
                                                          static_cast<uint64_t>(get.offset))
                                   : fuzz.Edgy(size);
      const uint32_t flag_choices[] = {0, kByAddress,
                                       static_cast<uint32_t>(fuzz.Below(UINT32_MAX))};
      get.flags = flag_choices[fuzz.Below(3)];
      std::memcpy(header.data(), &get, sizeof(get));
      if (reply) asked[get.request] = Asked{from_member, get};
    } else if (well_formed && ids[which] == kPush) {
      PushHeader push{};
      fuzz.Fill(&push, sizeof(push));
      push.key.graph = from_member ? (fuzz.Chance(50) ? kPushGraph : 9) : kStrangerGraph;
      push.flags = fuzz.Chance(30) ? kByAddress : (fuzz.Chance(50) ? 0 : push.flags);
      if (fuzz.Chance(50)) push.length = fuzz.Edgy(4096);
      if (!(push.flags & kByAddress)) {
        const size_t length = fuzz.Chance(10) ? (300 << 10) : fuzz.Below(4097);
        payload = fuzz.Bytes(length);
        if (fuzz.Chance(70)) push.length = static_cast<int64_t>(length);
        if (length > (64 << 10)) send_flags = UCP_AM_SEND_FLAG_RNDV;
      }
      std::memcpy(header.data(), &push, sizeof(push));
    } else if (!well_formed && fuzz.Chance(20)) {
      payload = fuzz.Bytes(fuzz.Below(2048));
    }
    // A send the holder rejects (a stranger's rendezvous push) fails here; that is its answer.
    (void)peer.Send(peer.endpoint(), ids[which], header.data(), header.size(), payload.data(),
                    payload.size(), reply, send_flags, /*timeout_ms=*/2000);
  }
  member->ProgressFor(500);
  stranger->ProgressFor(500);

  // Every well-formed request that named its endpoint got exactly one answer: the bytes asked
  // for if a member asked within an object, else an error and nothing of any object.
  std::map<uint64_t, int> answers;
  int served_ok = 0, refused = 0;
  for (RawDataPlanePeer* peer : {member.get(), stranger.get()}) {
    for (const auto& message : peer->TakeAll()) {
      if (message.id != kChunk) continue;
      const auto header = message.As<ChunkHeader>();
      auto it = asked.find(header.request);
      ASSERT_NE(it, asked.end()) << "an answer to a request nobody asked: " << header.request;
      ++answers[header.request];
      const Asked& ask = it->second;
      EXPECT_EQ(ask.member, peer == member.get());
      const GetChunkHeader& h = ask.header;
      const int64_t size = holder.size(h.object);
      const bool inside = ask.member && size >= 0 && h.offset >= 0 && h.length >= 0 &&
                          h.offset <= size && h.length <= size - h.offset;
      SCOPED_TRACE(fmt::format("object {} offset {} length {} flags {} member {}", h.object,
                               h.offset, h.length, h.flags, ask.member));
      if (!inside) {
        ASSERT_NE(header.status, 0);
        EXPECT_EQ(header.flags, 0u);
        EXPECT_EQ(header.address, 0u);
        EXPECT_EQ(header.length, static_cast<int64_t>(message.payload.size()));
        EXPECT_FALSE(message.rendezvous);
        ++refused;
        continue;
      }
      ASSERT_EQ(header.status, 0) << message.text();
      ASSERT_EQ(header.length, h.length);
      if (h.flags & kByAddress) {
        // The holder's buffer (in this process), whose address came as an integer on the wire.
        // NOLINTNEXTLINE(performance-no-int-to-ptr)
        const auto* lent_bytes = reinterpret_cast<const uint8_t*>(header.address);
        EXPECT_TRUE(holder.Matches(h.object, h.offset, lent_bytes, h.length));
        ASSERT_OK(member->Send(kChunkRead, ChunkReadHeader{h.request}));
      } else {
        ASSERT_EQ(static_cast<int64_t>(message.payload.size()), h.length);
        EXPECT_TRUE(holder.Matches(h.object, h.offset, message.payload.data(), h.length));
      }
      ++served_ok;
    }
  }
  EXPECT_EQ(answers.size(), asked.size()) << "requests went unanswered";
  for (const auto& [request, count] : answers) EXPECT_EQ(count, 1) << request;
  std::printf(
      "fuzz seed %llu: %d messages, %zu well-formed requests answered: %d served, "
      "%d refused; holder refused %lld messages in all\n",
      static_cast<unsigned long long>(kFuzzSeed), kMessages, asked.size(), served_ok, refused,
      static_cast<long long>(holder.plane().stats().refused));
  EXPECT_GT(served_ok, 0);
  EXPECT_GT(refused, 0);
  // Nothing from the stranger was ever taken in.
  EXPECT_FALSE(holder.accepted_graphs().contains(kStrangerGraph));
  EXPECT_FALSE(holder.delivered_graphs().contains(kStrangerGraph));

  // The holder still serves and receives for members.
  ExpectMemberIsServed(holder);
  auto pusher = Member();
  auto data = std::make_shared<std::vector<uint8_t>>(3000);
  for (size_t i = 0; i < data->size(); ++i) (*data)[i] = static_cast<uint8_t>(i * 3);
  std::promise<Status> promise;
  const int delivered_before = holder.delivered_ok();
  pusher->Push(holder.address(), PushKey{kPushGraph, 99, 42}, data->data(), 3000, data,
               [&](const Status& status) { promise.set_value(status); });
  ASSERT_OK(promise.get_future().get());
  for (int i = 0; i < 400 && holder.delivered_ok() == delivered_before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(holder.pushed(42), *data);
}

TEST(DataPlaneSecurityTest, FuzzedRepliesFailPullsWithoutHarmingThePuller) {
  ASSERT_OK_AND_ASSIGN(auto fake, RawDataPlanePeer::Listen());
  auto puller = Member(/*timeout_ms=*/600'000);
  std::vector<uint8_t> source(8192);
  for (size_t i = 0; i < source.size(); ++i) source[i] = PatternByte(5, static_cast<int64_t>(i));
  Fuzz fuzz(kFuzzSeed + 1);
  enum Answer {
    kBytes,             // the bytes asked for: OK
    kRendezvousBytes,   // the same, by rendezvous: OK
    kLent,              // a loan of the right bytes: OK
    kLentBadAddress,    // a loan of an unmapped address: Unavailable
    kLentWrongLength,   // a loan of another length: DataLoss
    kShortPayload,      // fewer bytes than asked: DataLoss
    kLongPayload,       // more bytes than asked: DataLoss
    kWrongLengthField,  // the right bytes under a header claiming another length: DataLoss
    kError,             // an error with a random code and text: that error
    kRendezvousError,   // an error whose "text" comes by rendezvous: an error, text not read
    kAnswers,
  };
  std::map<int, int> seen;
  bool handshaken = false;
  for (int i = 0; i < 300; ++i) {
    const int64_t bytes_choices[] = {1, 7, 100, 4096, 8192};
    const int64_t bytes = bytes_choices[fuzz.Below(std::size(bytes_choices))];
    std::vector<uint8_t> dest(static_cast<size_t>(bytes), 0xee);
    std::promise<Status> promise;
    std::future<Status> pulled = promise.get_future();
    puller->Pull(fake->address(), ObjectId(5), dest.data(), bytes,
                 [&](const Status& status) { promise.set_value(status); });
    if (!handshaken) {
      const std::vector<ucp_ep_h> connections = fake->TakeNewConnections(5000);
      ASSERT_EQ(connections.size(), 1u);
      ASSERT_TRUE(PoseAsHolder(*fake, connections[0], /*right_proof=*/true).has_value());
      handshaken = true;
    }
    auto get = fake->Next(kGetChunk);
    ASSERT_TRUE(get.has_value()) << "no chunk request in round " << i;
    const auto ask = get->As<GetChunkHeader>();
    ASSERT_EQ(ask.object, 5u);
    ASSERT_EQ(ask.offset, 0);
    ASSERT_EQ(ask.length, bytes);
    ASSERT_EQ(ask.flags, kByAddress);  // the puller can read this process: it asks for loans
    // Noise first: replies to requests nobody made, malformed headers, handshake messages out
    // of turn, acknowledgements of pushes never lent. All are dropped.
    for (uint64_t noise = fuzz.Below(3); noise > 0; --noise) {
      ChunkHeader unknown{ask.request + 1000, 0, 0, 4, 0};
      const std::vector<uint8_t> junk = fuzz.Bytes(64);
      switch (fuzz.Below(4)) {
        case 0:
          ASSERT_OK(fake->Send(get->from, kChunk, &unknown, sizeof(unknown), "abcd", 4));
          break;
        case 1:
          ASSERT_OK(fake->Send(get->from, kChunk, junk.data(), 31));
          break;
        case 2:
          ASSERT_OK(fake->Send(get->from, kWelcome, junk.data(), sizeof(WelcomeHeader)));
          break;
        default: {
          const PushReadHeader ack{fuzz.Below(UINT64_MAX), 0, 0};
          ASSERT_OK(fake->Send(get->from, kPushRead, &ack, sizeof(ack)));
        }
      }
    }
    const auto answer = static_cast<Answer>(fuzz.Below(kAnswers));
    ++seen[answer];
    ChunkHeader reply{ask.request, 0, 0, bytes, 0};
    std::vector<uint8_t> payload(source.begin(), source.begin() + bytes);
    uint32_t send_flags = 0;
    StatusCode expected = StatusCode::kOk;
    std::string says;
    switch (answer) {
      case kBytes:
        break;
      case kRendezvousBytes:
        send_flags = UCP_AM_SEND_FLAG_RNDV;
        break;
      case kLent:
        reply.flags = kByAddress;
        reply.address = reinterpret_cast<uint64_t>(source.data());
        payload.clear();
        break;
      case kLentBadAddress: {
        const uint64_t addresses[] = {0, 8, 0xdead0000, 0xffffffffffff0000};
        reply.flags = kByAddress;
        reply.address = addresses[fuzz.Below(std::size(addresses))];
        payload.clear();
        expected = StatusCode::kUnavailable;
        says = "vanished while lending";
        break;
      }
      case kLentWrongLength:
        reply.flags = kByAddress;
        reply.length = fuzz.Chance(50) ? bytes + 1 : INT64_MAX;
        reply.address = reinterpret_cast<uint64_t>(source.data());
        payload.clear();
        expected = StatusCode::kDataLoss;
        says = "not the";
        break;
      case kShortPayload:
        payload.pop_back();
        expected = StatusCode::kDataLoss;
        break;
      case kLongPayload:
        payload.resize(payload.size() + 5);
        expected = StatusCode::kDataLoss;
        break;
      case kWrongLengthField:
        reply.length = fuzz.Chance(50) ? -1 : bytes + 3;
        expected = StatusCode::kDataLoss;
        break;
      case kError: {
        const int32_t codes[] = {1, 2, 4, 7, 9, 10, 11, 999, -5, INT32_MIN};
        reply.status = codes[fuzz.Below(std::size(codes))];
        expected = static_cast<StatusCode>(detail::SanitizeWireStatus(reply.status));
        const size_t text_length = fuzz.Chance(10) ? 10'000 : fuzz.Below(100);
        payload.assign(text_length, 'x');
        for (auto& c : payload) c = static_cast<uint8_t>('a' + fuzz.Below(26));
        reply.length = static_cast<int64_t>(payload.size());
        says = std::string(payload.begin(), payload.begin() + std::min<size_t>(payload.size(), 50));
        send_flags = UCP_AM_SEND_FLAG_EAGER;  // a long text arrives whole and is cut by the puller
        break;
      }
      case kRendezvousError:
        reply.status = static_cast<int32_t>(StatusCode::kNotFound);
        payload.assign(64 << 10, 'z');
        send_flags = UCP_AM_SEND_FLAG_RNDV;
        expected = StatusCode::kNotFound;
        says = "sent by rendezvous";
        break;
      case kAnswers:
        break;
    }
    ASSERT_OK(fake->Send(get->from, kChunk, &reply, sizeof(reply), payload.data(), payload.size(),
                         true, send_flags));
    std::optional<Status> status = AwaitPull(*fake, pulled);
    ASSERT_TRUE(status.has_value()) << "the pull hangs after answer " << answer;
    SCOPED_TRACE(fmt::format("round {} answer {} bytes {}", i, static_cast<int>(answer), bytes));
    ASSERT_EQ(status->code(), expected) << status->ToString();
    if (expected == StatusCode::kOk) {
      EXPECT_TRUE(std::equal(dest.begin(), dest.end(), source.begin()));
    } else {
      EXPECT_NE(status->message().find(says), std::string::npos) << status->ToString();
      EXPECT_LE(status->message().size(), detail::kMaxErrorText + 200);
    }
    fake->TakeAll();  // acknowledgements of loans
  }
  for (int answer = 0; answer < kAnswers; ++answer) EXPECT_GT(seen[answer], 0) << answer;
  EXPECT_GT(puller->stats().refused, 0);  // the noise
  // The puller still pulls from a real holder.
  Holder holder;
  std::vector<uint8_t> dest(4096);
  ASSERT_OK(puller->PullAndWait(holder.address(), ObjectId(2), dest.data(), 4096));
  EXPECT_TRUE(holder.Matches(2, 0, dest.data(), 4096));
}

}  // namespace
}  // namespace tessera::testing

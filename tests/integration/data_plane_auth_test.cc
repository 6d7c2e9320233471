// The data plane of real worker processes, as the fault report measured it: a process with raw
// UCX that knows a worker's data-plane address (from the cluster status) and guesses an object
// id. Without the cluster token it gets an error and no bytes; with the token, a chunk request
// whose range overflows is refused; the cluster keeps working for its driver throughout.
#include <climits>
#include <fstream>

#include "client/cluster.h"
#include "core/transport/data_plane_wire.h"
#include "raw_data_plane_peer.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using detail::ChunkHeader;
using detail::GetChunkHeader;
using detail::kChunk;
using detail::kGetChunk;

std::string ReadToken(const std::string& session_dir) {
  std::ifstream file(session_dir + "/token");
  std::string token;
  std::getline(file, token);
  return token;
}

// Asks the worker at `address` for [offset, +length) of `object` and returns its answer.
std::optional<RawDataPlanePeer::Message> Ask(RawDataPlanePeer& peer, uint64_t request,
                                             ObjectId object, int64_t offset, int64_t length) {
  const GetChunkHeader ask{request, object.value(), offset, length, 0, 0};
  if (!peer.Send(kGetChunk, ask).ok()) return std::nullopt;
  return peer.Next(kChunk, 10'000);
}

TEST(DataPlaneAuthTest, AWorkersDataPlaneServesOnlyItsCluster) {
  LocalClusterOptions options;
  options.cpu_workers = 2;
  options.threads_per_worker = 1;
  options.tessera_binary = BinaryPath("tessera");
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::StartLocal(options));
  // A 1 MiB object made by a task, so it lives on a worker.
  Tensor x = RandomTensor({1 << 18}, 3, 2.0f);
  ASSERT_OK_AND_ASSIGN(ObjectRef input, cluster->Put(x));
  ASSERT_OK_AND_ASSIGN(auto out, cluster->Submit("gelu_forward", {input}));
  ASSERT_OK(cluster->Wait(out, 20'000));
  const ObjectId object = out[0].id();
  const int64_t bytes = out[0].meta().bytes();
  ASSERT_EQ(bytes, 1 << 20);
  ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
  ASSERT_EQ(info.workers.size(), 2u);
  const std::string token = ReadToken(cluster->session_dir());
  ASSERT_FALSE(token.empty());

  int outside = 0;
  for (const WorkerInfo& worker : info.workers) {
    SCOPED_TRACE(worker.id.ToString() + " at " + worker.data_address);
    // No token: the object whole, by its id, is refused with an error and no bytes.
    ASSERT_OK_AND_ASSIGN(auto stranger, RawDataPlanePeer::Connect(worker.data_address));
    auto refused = Ask(*stranger, 1, object, 0, bytes);
    ASSERT_TRUE(refused.has_value()) << "no answer";
    auto header = refused->As<ChunkHeader>();
    EXPECT_EQ(header.status, static_cast<int32_t>(StatusCode::kUnavailable)) << refused->text();
    EXPECT_EQ(header.length, static_cast<int64_t>(refused->payload.size()));
    EXPECT_LT(refused->payload.size(), 4096u);
    EXPECT_NE(refused->text().find("prove the cluster token"), std::string::npos);
    // A wrong token: refused at the handshake.
    ASSERT_OK_AND_ASSIGN(auto impostor, RawDataPlanePeer::Connect(worker.data_address));
    ASSERT_OK_AND_ASSIGN(auto welcomed, impostor->Handshake("0123456789abcdef"));
    EXPECT_EQ(welcomed.header.status, static_cast<int32_t>(StatusCode::kUnavailable));
    EXPECT_NE(welcomed.text.find("invalid cluster token"), std::string::npos) << welcomed.text;
    // The token, and the reported overflowing request: refused by the worker that holds the
    // object ("outside"), unknown to the other; never served.
    ASSERT_OK_AND_ASSIGN(auto member, RawDataPlanePeer::Connect(worker.data_address));
    ASSERT_OK_AND_ASSIGN(auto joined, member->Handshake(token));
    ASSERT_EQ(joined.header.status, 0) << joined.text;
    EXPECT_TRUE(joined.holder_proved);
    auto overflow = Ask(*member, 2, object, 4096, INT64_MAX - 4095);
    ASSERT_TRUE(overflow.has_value()) << "no answer";
    header = overflow->As<ChunkHeader>();
    ASSERT_NE(header.status, 0) << "served an overflowing range";
    EXPECT_EQ(header.length, static_cast<int64_t>(overflow->payload.size()));
    EXPECT_LT(overflow->payload.size(), 4096u);
    if (header.status == static_cast<int32_t>(StatusCode::kInvalidArgument)) {
      EXPECT_NE(overflow->text().find("outside"), std::string::npos) << overflow->text();
      ++outside;
      // The same member gets the object when it asks within it.
      auto whole = Ask(*member, 3, object, 0, bytes);
      ASSERT_TRUE(whole.has_value());
      EXPECT_EQ(whole->As<ChunkHeader>().status, 0) << whole->text();
      EXPECT_EQ(static_cast<int64_t>(whole->payload.size()), bytes);
    } else {
      EXPECT_EQ(header.status, static_cast<int32_t>(StatusCode::kNotFound)) << overflow->text();
    }
  }
  EXPECT_EQ(outside, 1) << "exactly one worker holds the object";
  // The driver is served as before.
  ASSERT_OK_AND_ASSIGN(Tensor y, cluster->Get(out[0], 10'000));
  ASSERT_OK_AND_ASSIGN(auto expected, RunKernel("gelu_forward", {x}));
  EXPECT_EQ(ToVector(y), ToVector(expected[0]));
}

}  // namespace
}  // namespace tessera::testing

// The data plane's decoding layer (core/transport/data_plane_wire.h): what a peer controls in a
// header is range-checked before anything is sized, indexed or copied by it. The handlers that
// use these checks are exercised end to end in data_plane_test and data_plane_security_test.
#include <cstdint>
#include <limits>
#include <string>

#include "core/transport/data_plane_wire.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using detail::AskedChunk;
using detail::ChunkHeader;
using detail::GetChunkHeader;
using detail::PushHeader;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

TEST(DataPlaneWireTest, AHeaderIsReadOnlyAtItsOwnLength) {
  const GetChunkHeader sent{7, 9, 0, 16, 0, 0};
  EXPECT_TRUE(detail::ReadHeader<GetChunkHeader>(&sent, sizeof(sent)).has_value());
  EXPECT_FALSE(detail::ReadHeader<GetChunkHeader>(&sent, sizeof(sent) - 1).has_value());
  EXPECT_FALSE(detail::ReadHeader<GetChunkHeader>(nullptr, sizeof(sent)).has_value());
  EXPECT_EQ(detail::ReadHeader<GetChunkHeader>(&sent, sizeof(sent))->length, 16);
}

TEST(DataPlaneWireTest, AChunkRequestMustLieInsideItsObjectWithoutOverflow) {
  EXPECT_OK(detail::CheckChunkRequest(GetChunkHeader{1, 2, 0, 100, 0, 0}, 100));
  EXPECT_OK(detail::CheckChunkRequest(GetChunkHeader{1, 2, 100, 0, 0, 0}, 100));
  EXPECT_OK(detail::CheckChunkRequest(GetChunkHeader{1, 2, 0, 8, detail::kByAddress, 0}, 8));
  const Status past = detail::CheckChunkRequest(GetChunkHeader{1, 2, 96, 8, 0, 0}, 100);
  EXPECT_EQ(past.message(), "chunk [96, +8) is outside obj2 of 100 bytes");
  // offset + length would overflow int64: refused without computing it.
  EXPECT_FALSE(detail::CheckChunkRequest(GetChunkHeader{1, 2, 50, kMax, 0, 0}, 100).ok());
  EXPECT_FALSE(detail::CheckChunkRequest(GetChunkHeader{1, 2, kMax, 1, 0, 0}, 100).ok());
  EXPECT_FALSE(detail::CheckChunkRequest(GetChunkHeader{1, 2, -1, 1, 0, 0}, 100).ok());
  EXPECT_FALSE(detail::CheckChunkRequest(GetChunkHeader{1, 2, 0, -1, 0, 0}, 100).ok());
  EXPECT_TRUE(detail::CheckChunkRequest(GetChunkHeader{1, 2, 0, 1, 6, 0}, 100).ok())
      << "flags this build does not know are ignored";
}

TEST(DataPlaneWireTest, AChunkReplyMustBeTheChunkAskedFor) {
  const AskedChunk bytes{64, false}, lent{64, true};
  EXPECT_OK(detail::CheckChunkReply(ChunkHeader{1, 0, 0, 64, 0}, 64, bytes));
  EXPECT_OK(detail::CheckChunkReply(ChunkHeader{1, 0, detail::kByAddress, 64, 0x1000}, 0, lent));
  EXPECT_TRUE(detail::CheckChunkReply(ChunkHeader{1, 0, 0, 64, 0}, 64, lent).ok()) << "not lent";
  EXPECT_EQ(detail::CheckChunkReply(ChunkHeader{1, 0, 0, 64, 0}, 63, bytes).message(),
            "peer sent 63 bytes (announced 64) for a 64-byte chunk");
  EXPECT_EQ(detail::CheckChunkReply(ChunkHeader{1, 0, 0, kMax, 0}, 64, bytes).code(),
            StatusCode::kDataLoss);
  EXPECT_EQ(
      detail::CheckChunkReply(ChunkHeader{1, 0, detail::kByAddress, 64, 0x1000}, 0, bytes)
          .message(),
      "the holder lent a chunk of 64 bytes, not the 64-byte chunk asked for (this process asked "
      "for the bytes)");
  EXPECT_FALSE(
      detail::CheckChunkReply(ChunkHeader{1, 0, detail::kByAddress, 128, 0x1000}, 0, lent).ok());
  EXPECT_FALSE(
      detail::CheckChunkReply(ChunkHeader{1, 0, detail::kByAddress, 64, 0x1000}, 8, lent).ok());
}

TEST(DataPlaneWireTest, APushHasALengthItsPayloadMatches) {
  EXPECT_OK(detail::CheckPush(PushHeader{{1, 2, 3}, 16, 5, 0, 0, 0}, 16));
  EXPECT_OK(detail::CheckPush(PushHeader{{1, 2, 3}, 16, 5, 0x1000, detail::kByAddress, 0}, 0));
  EXPECT_EQ(detail::CheckPush(PushHeader{{1, 2, 3}, -1, 5, 0, 0, 0}, 0).message(),
            "a push of -1 bytes");
  EXPECT_EQ(detail::CheckPush(PushHeader{{1, 2, 3}, 16, 5, 0, 0, 0}, 15).message(),
            "push of 15 bytes announced 16");
  EXPECT_TRUE(detail::CheckPush(PushHeader{{1, 2, 3}, 16, 5, 0, 2, 0}, 16).ok())
      << "flags this build does not know are ignored";
}

TEST(DataPlaneWireTest, DecodeMessageChecksEveryKindAndRefusesTheUnknown) {
  const detail::HelloHeader hello{detail::kWireMagic, detail::kWireVersion, {}, {}, {}};
  EXPECT_OK(detail::DecodeMessage(detail::kHello, &hello, sizeof(hello), 0, {}));
  detail::HelloHeader old = hello;
  old.version = 1;
  const Status refused = detail::DecodeMessage(detail::kHello, &old, sizeof(old), 0, {});
  EXPECT_NE(refused.message().find("protocol version 1"), std::string::npos) << refused.ToString();
  EXPECT_EQ(detail::DecodeMessage(detail::kHello, &hello, 3, 0, {}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(detail::DecodeMessage(99, &hello, sizeof(hello), 0, {}).message(),
            "unknown data-plane message 99");
  const ChunkHeader error{1, 12345, 0, 5, 0};
  EXPECT_EQ(detail::DecodeMessage(detail::kChunk, &error, sizeof(error), 5, {}).code(),
            StatusCode::kInternal)
      << "an unknown status code becomes Internal";
  EXPECT_EQ(detail::ErrorTextOf("abc", 3), "abc");
  const std::string long_text(detail::kMaxErrorText + 10, 'x');
  EXPECT_EQ(detail::ErrorTextOf(long_text.data(), long_text.size()).size(), detail::kMaxErrorText);
}

}  // namespace
}  // namespace tessera::testing

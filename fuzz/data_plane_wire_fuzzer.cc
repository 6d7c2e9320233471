// libFuzzer target: the data plane's wire decoding (core/transport/data_plane_wire.h).
//
// The data plane's handlers read every header through ReadHeader and the Check* functions before
// anything is sized, indexed or copied by it; this target runs exactly those on fuzzed messages.
// An input is: the active-message id (first byte: one of the protocol's, or any), then the
// header's bytes (the struct's own length unless the fuzzer asks for another), then what the
// receiver knows (the payload's length, the chunk it asked for, the object's size), drawn from
// the remaining bytes. Structure-aware in that the header usually has the right length, so the
// checks behind the length check run; the handshake's proofs are computed on hello headers as
// the holder does.
//
// Findings: crashes and sanitizer reports (ASan, UBSan: an overflowing range check, a read past
// a header). The seeds are one valid message of each kind and the boundary cases of the checks.
#include <fuzzer/FuzzedDataProvider.h>

#include <array>
#include <cstring>
#include <limits>
#include <vector>

#include "core/transport/data_plane_wire.h"
#include "fuzz/fuzz_util.h"

namespace tessera::fuzz {
namespace {

using namespace tessera::detail;  // NOLINT(google-build-using-namespace): the wire's names

constexpr std::array<uint16_t, 8> kIds = {kGetChunk, kChunk,     kPush,  kChunkRead,
                                          kPushRead, kChallenge, kHello, kWelcome};

size_t HeaderSize(uint16_t id) {
  switch (id) {
    case kGetChunk:
      return sizeof(GetChunkHeader);
    case kChunk:
      return sizeof(ChunkHeader);
    case kPush:
      return sizeof(PushHeader);
    case kChunkRead:
      return sizeof(ChunkReadHeader);
    case kPushRead:
      return sizeof(PushReadHeader);
    case kChallenge:
      return sizeof(ChallengeHeader);
    case kHello:
      return sizeof(HelloHeader);
    case kWelcome:
      return sizeof(WelcomeHeader);
    default:
      return 16;
  }
}

void Run(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const uint8_t pick = in.ConsumeIntegral<uint8_t>();
  const uint16_t id = pick < 240 ? kIds[pick % kIds.size()] : in.ConsumeIntegral<uint16_t>();
  const size_t header_length = in.ConsumeIntegralInRange(0, 7) == 0
                                   ? in.ConsumeIntegralInRange<size_t>(0, 128)
                                   : HeaderSize(id);
  std::vector<uint8_t> header = in.ConsumeBytes<uint8_t>(header_length);
  header.resize(header_length);  // short input: zeros
  const size_t payload_length =
      in.ConsumeBool() ? in.ConsumeIntegral<uint32_t>() : in.ConsumeIntegralInRange<size_t>(0, 64);
  AskedChunk asked;
  asked.length =
      in.ConsumeBool() ? in.ConsumeIntegral<int64_t>() : in.ConsumeIntegralInRange<int64_t>(0, 64);
  asked.lent = in.ConsumeBool();
  (void)DecodeMessage(id, header.data(), header.size(), payload_length, asked);
  // What the handlers do with the pieces, beyond DecodeMessage.
  if (auto hello = ReadHeader<HelloHeader>(header.data(), header.size())) {
    const Sha256Digest key = DataPlaneKey("token");
    const Sha256Digest proof =
        HandshakeProof(key, "client", hello->nonce, hello->nonce, hello->client, hello->client);
    (void)(proof == hello->proof);
  }
  if (auto chunk = ReadHeader<ChunkHeader>(header.data(), header.size())) {
    (void)SanitizeWireStatus(chunk->status);
  }
  const std::vector<uint8_t> rest = in.ConsumeRemainingBytes<uint8_t>();
  (void)ErrorTextOf(rest.data(), rest.size());
}

template <typename H>
Seed SeedOf(uint8_t pick, const H& header, std::vector<uint8_t> tail) {
  Seed seed = {pick};
  const auto* bytes = reinterpret_cast<const uint8_t*>(&header);
  seed.insert(seed.end(), bytes, bytes + sizeof(header));
  seed.insert(seed.end(), tail.begin(), tail.end());
  return seed;
}

std::vector<Seed> Seeds() {
  // FuzzedDataProvider takes integers from the end: the tail is read backwards (the header-length
  // choice, then the payload's length, the chunk asked for, whether it was lent).
  const std::vector<uint8_t> tail = {0, 64, 1, 64, 1, 1};
  const int64_t max = std::numeric_limits<int64_t>::max();
  std::vector<Seed> seeds;
  seeds.push_back(SeedOf(0, GetChunkHeader{1, 2, 0, 64, 0, 0}, tail));
  seeds.push_back(SeedOf(0, GetChunkHeader{1, 2, 50, max, 0, 0}, tail));
  seeds.push_back(SeedOf(0, GetChunkHeader{1, 2, max, 1, kByAddress, 0}, tail));
  seeds.push_back(SeedOf(1, ChunkHeader{1, 0, 0, 64, 0}, tail));
  seeds.push_back(SeedOf(1, ChunkHeader{1, 0, kByAddress, 64, 0x1000}, tail));
  seeds.push_back(SeedOf(1, ChunkHeader{1, 9999, 0, 5, 0}, tail));
  seeds.push_back(SeedOf(2, PushHeader{{1, 2, 3}, 64, 7, 0, 0, 0}, tail));
  seeds.push_back(SeedOf(2, PushHeader{{1, 2, 3}, -1, 7, 0, 0, 0}, tail));
  seeds.push_back(SeedOf(2, PushHeader{{1, 2, 3}, 64, 7, 0x1000, kByAddress, 0}, tail));
  seeds.push_back(SeedOf(3, ChunkReadHeader{5}, tail));
  seeds.push_back(SeedOf(4, PushReadHeader{7, 0, 0}, tail));
  seeds.push_back(SeedOf(5, ChallengeHeader{kWireMagic, kWireVersion, {}, {}}, tail));
  seeds.push_back(SeedOf(6, HelloHeader{kWireMagic, kWireVersion, {}, {}, {}}, tail));
  seeds.push_back(SeedOf(6, HelloHeader{kWireMagic, 1, {}, {}, {}}, tail));
  seeds.push_back(SeedOf(7, WelcomeHeader{0, 1, {}}, tail));
  seeds.push_back(SeedOf(7, WelcomeHeader{-7, 0, {}}, {'n', 'o', 0, 64, 1, 64, 1, 1}));
  return seeds;
}

}  // namespace
}  // namespace tessera::fuzz

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  tessera::fuzz::InitializeTarget(tessera::fuzz::Seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tessera::fuzz::Run(data, size);
  return 0;
}

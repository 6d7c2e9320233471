// The data plane's wire format: active-message ids, their headers, and the token handshake.
// Internal to core/transport (and to tests, which craft raw messages with it).
//
// Every message is a UCX active message whose header is one of the structs below, copied as
// bytes (both ends are the same build on x86-64: little-endian, same layout; a handshake with a
// different kWireVersion is refused). Every message is sent with UCP_AM_SEND_FLAG_REPLY, so the
// receiver knows the endpoint it came on, and every handler checks that endpoint's state before
// acting: nothing but the handshake is accepted from an endpoint that has not proved the token.
//
// Handshake (once per endpoint; the token itself never crosses the wire):
//   holder (accepting side) -> client   kChallenge {magic, version, holder nonce, holder process}
//   client -> holder                    kHello     {magic, version, client nonce, client process,
//                                                   client proof}
//   holder -> client                    kWelcome   {status, can_read_you, holder proof}
//                                                   (+ the error text when status != 0)
// with key = HMAC(token, kKeyLabel) and
//   client proof = HMAC(key, "client" | holder nonce | client nonce | holder process | client
//   process) holder proof = HMAC(key, "holder" | holder nonce | client nonce | holder process |
//   client process)
// Fresh 16-byte nonces from both sides make a recorded handshake useless on a new connection, and
// each side proves the token to the other: a process without it can neither pull nor push, nor
// pose as a holder (which matters because a puller copies lent chunks out of the holder's
// memory by address). The processes named in the handshake are covered by the proofs and are the
// only ones a side ever reads memory from; later headers carry no process identity.
//
// Decoding (the end of this file) is the one way a handler reads a header: ReadHeader copies it
// out when its length is the struct's, and the Check* functions range-check what it carries
// before anything is sized, indexed or copied by it (a chunk's range inside its object, a
// reply's length against the chunk asked for and the payload that came, a push's length and
// flags). Every handler drops or refuses what they refuse; DecodeMessage runs the checks that
// need no endpoint state on any message (tests, the data-plane fuzzer: fuzz/).
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

#include "core/crypto.h"
#include "core/status.h"
#include "core/transport/local_memory.h"

namespace tessera::detail {

// Active-message ids.
inline constexpr uint16_t kGetChunk = 11;   // puller -> holder
inline constexpr uint16_t kChunk = 12;      // holder -> puller
inline constexpr uint16_t kPush = 13;       // pusher -> receiver
inline constexpr uint16_t kChunkRead = 14;  // puller -> holder: done reading a lent chunk
inline constexpr uint16_t kPushRead = 15;   // receiver -> pusher: done with a lent push
inline constexpr uint16_t kChallenge = 16;  // holder -> client
inline constexpr uint16_t kHello = 17;      // client -> holder
inline constexpr uint16_t kWelcome = 18;    // holder -> client

inline constexpr uint32_t kWireMagic = 0x70647374;  // "tsdp"
inline constexpr uint32_t kWireVersion = 2;         // 1: before the handshake
inline constexpr std::string_view kKeyLabel = "tessera data plane key v2";

// Header flag: no payload; the bytes are at `address` in the sending process, for a same-host
// peer to copy itself (local_memory.h). In kGetChunk: "lend me the chunk".
inline constexpr uint32_t kByAddress = 1;
// The longest error text a reply carries; longer texts are cut.
inline constexpr size_t kMaxErrorText = 4096;

using Nonce = std::array<uint8_t, 16>;

// A process on the wire (local_memory.h).
struct WireProcess {
  int32_t pid;
  int32_t reserved;
  uint64_t probe;
};

struct ChallengeHeader {
  uint32_t magic;
  uint32_t version;
  Nonce nonce;
  WireProcess holder;
};

struct HelloHeader {
  uint32_t magic;
  uint32_t version;
  Nonce nonce;
  WireProcess client;
  Sha256Digest proof;
};

struct WelcomeHeader {
  int32_t status;         // StatusCode; 0 = OK, else the payload is the error text
  uint32_t can_read_you;  // the holder can read the client's memory (lent pushes)
  Sha256Digest proof;
};

struct GetChunkHeader {
  uint64_t request;
  uint64_t object;
  int64_t offset;
  int64_t length;
  uint32_t flags;  // kByAddress: lend the chunk (reply with its address)
  uint32_t reserved;
};

struct ChunkHeader {
  uint64_t request;
  int32_t status;  // StatusCode; 0 = OK and the payload is the bytes, else the error text
  uint32_t flags;  // kByAddress: no payload; the bytes are at `address` in the holder
  int64_t length;
  uint64_t address;
};

// What a push is to its receiver (mirrors data_plane.h's PushKey).
struct WirePushKey {
  uint64_t graph;
  uint64_t instance;
  uint64_t object;
};

struct PushHeader {
  WirePushKey key;
  int64_t length;
  uint64_t push_id;
  uint64_t address;  // with kByAddress: where the bytes are in the sender
  uint32_t flags;    // kByAddress
  uint32_t reserved;
};

struct PushReadHeader {
  uint64_t push_id;
  int32_t status;  // StatusCode of reading a lent push
  uint32_t reserved;
};

struct ChunkReadHeader {
  uint64_t request;
};

inline WireProcess ToWire(const LocalProcess& process) {
  return WireProcess{process.pid, 0, process.probe};
}
inline LocalProcess FromWire(const WireProcess& process) {
  return LocalProcess{process.pid, process.probe};
}

// The data plane's key, derived from the cluster token.
inline Sha256Digest DataPlaneKey(std::string_view token) { return HmacSha256(token, kKeyLabel); }

// The proofs of the handshake (see the header comment). `role` is "client" or "holder".
Sha256Digest HandshakeProof(const Sha256Digest& key, std::string_view role,
                            const Nonce& holder_nonce, const Nonce& client_nonce,
                            const WireProcess& holder, const WireProcess& client);

// A status code read off the wire: codes this build does not know become kInternal.
int32_t SanitizeWireStatus(int32_t code);

// ---- Decoding ----

// The header as the struct it claims to be; nullopt when its length is not the struct's.
template <typename Header>
std::optional<Header> ReadHeader(const void* header, size_t header_length) {
  if (header == nullptr || header_length != sizeof(Header)) return std::nullopt;
  Header out{};
  std::memcpy(&out, header, sizeof(out));
  return out;
}

// A handshake header of this protocol: its magic and version (InvalidArgument naming the
// version otherwise).
Status CheckHandshake(uint32_t magic, uint32_t version);

// A chunk request against the object it asks of (`object_bytes`): [offset, offset + length)
// inside [0, object_bytes), without overflow. InvalidArgument naming the range and the object's
// size. (Flags other than kByAddress are ignored, here and below: room for later versions.)
Status CheckChunkRequest(const GetChunkHeader& header, int64_t object_bytes);

// What the puller asked for one chunk.
struct AskedChunk {
  int64_t length = 0;
  bool lent = false;  // asked the holder to lend it (kByAddress)
};
// A successful chunk reply (status 0) against what was asked and the payload that came
// (`payload_length`; a rendezvous payload's announced length): a lent chunk only when asked,
// of the length asked, with no payload; otherwise exactly the length asked, in the header and
// in the payload. DataLoss naming both lengths.
Status CheckChunkReply(const ChunkHeader& header, size_t payload_length, const AskedChunk& asked);

// A push: a length that is not negative and (unless lent by address) a payload of exactly that
// length. InvalidArgument or DataLoss naming the lengths.
Status CheckPush(const PushHeader& header, size_t payload_length);

// An error text carried as a payload: at most kMaxErrorText bytes of it.
inline std::string_view ErrorTextOf(const void* data, size_t length) {
  if (data == nullptr) return {};
  return {static_cast<const char*>(data), length < kMaxErrorText ? length : kMaxErrorText};
}

// Every check above that needs no endpoint state, for a message of active-message id `id`: its
// header's length, its handshake version, a chunk request's range (in an object of
// `asked.length` bytes), a chunk reply's error or lengths (against the chunk `asked`), a push's
// length. InvalidArgument for an unknown id or a malformed header; the checks' errors
// otherwise. For tests and fuzzers: the handlers call the pieces.
Status DecodeMessage(uint16_t id, const void* header, size_t header_length, size_t payload_length,
                     const AskedChunk& asked);

}  // namespace tessera::detail

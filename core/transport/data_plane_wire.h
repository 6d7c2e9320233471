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
#pragma once

#include <cstdint>
#include <string_view>

#include "core/crypto.h"
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

}  // namespace tessera::detail

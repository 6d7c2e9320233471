#include "core/transport/data_plane_wire.h"

#include <cstring>
#include <vector>

#include "core/status.h"

namespace tessera::detail {

Sha256Digest HandshakeProof(const Sha256Digest& key, std::string_view role,
                            const Nonce& holder_nonce, const Nonce& client_nonce,
                            const WireProcess& holder, const WireProcess& client) {
  std::vector<uint8_t> message(role.begin(), role.end());
  const auto append = [&](const void* bytes, size_t size) {
    const auto* begin = static_cast<const uint8_t*>(bytes);
    message.insert(message.end(), begin, begin + size);
  };
  append(holder_nonce.data(), holder_nonce.size());
  append(client_nonce.data(), client_nonce.size());
  append(&holder, sizeof(holder));
  append(&client, sizeof(client));
  return HmacSha256(key, message);
}

int32_t SanitizeWireStatus(int32_t code) {
  return code >= static_cast<int32_t>(StatusCode::kOk) &&
                 code <= static_cast<int32_t>(StatusCode::kInternal)
             ? code
             : static_cast<int32_t>(StatusCode::kInternal);
}

Status CheckHandshake(uint32_t magic, uint32_t version) {
  if (magic != kWireMagic || version != kWireVersion) {
    return InvalidArgument(
        "data-plane handshake of protocol version {} (magic 0x{:08x}); this process speaks {}: "
        "are both the same Tessera build?",
        version, magic, kWireVersion);
  }
  return Status::Ok();
}

Status CheckChunkRequest(const GetChunkHeader& header, int64_t object_bytes) {
  // [offset, offset + length) must lie in [0, bytes); written so that nothing can overflow.
  if (header.offset < 0 || header.length < 0 || header.offset > object_bytes ||
      header.length > object_bytes - header.offset) {
    return InvalidArgument("chunk [{}, +{}) is outside obj{} of {} bytes", header.offset,
                           header.length, header.object, object_bytes);
  }
  return Status::Ok();
}

Status CheckChunkReply(const ChunkHeader& header, size_t payload_length, const AskedChunk& asked) {
  if ((header.flags & kByAddress) != 0) {
    if (!asked.lent || header.length != asked.length || payload_length != 0) {
      return DataLoss("the holder lent a chunk of {} bytes, not the {}-byte chunk asked for{}",
                      header.length, asked.length,
                      asked.lent ? "" : " (this process asked for the bytes)");
    }
    return Status::Ok();
  }
  if (header.length != asked.length || payload_length != static_cast<uint64_t>(asked.length)) {
    return DataLoss("peer sent {} bytes (announced {}) for a {}-byte chunk", payload_length,
                    header.length, asked.length);
  }
  return Status::Ok();
}

Status CheckPush(const PushHeader& header, size_t payload_length) {
  if (header.length < 0) return InvalidArgument("a push of {} bytes", header.length);
  if ((header.flags & kByAddress) == 0 && payload_length != static_cast<uint64_t>(header.length)) {
    return DataLoss("push of {} bytes announced {}", payload_length, header.length);
  }
  return Status::Ok();
}

namespace {

// A header of type H, or InvalidArgument naming the message.
template <typename H>
Result<H> DecodeHeader(const void* header, size_t header_length, std::string_view what) {
  std::optional<H> decoded = ReadHeader<H>(header, header_length);
  if (!decoded) {
    return InvalidArgument("malformed data-plane {}: a header of {} bytes, not {}", what,
                           header_length, sizeof(H));
  }
  return *decoded;
}

}  // namespace

Status DecodeMessage(uint16_t id, const void* header, size_t header_length, size_t payload_length,
                     const AskedChunk& asked) {
  switch (id) {
    case kChallenge: {
      TESSERA_ASSIGN_OR_RETURN(auto h,
                               DecodeHeader<ChallengeHeader>(header, header_length, "challenge"));
      return CheckHandshake(h.magic, h.version);
    }
    case kHello: {
      TESSERA_ASSIGN_OR_RETURN(auto h, DecodeHeader<HelloHeader>(header, header_length, "hello"));
      return CheckHandshake(h.magic, h.version);
    }
    case kWelcome: {
      TESSERA_ASSIGN_OR_RETURN(auto h,
                               DecodeHeader<WelcomeHeader>(header, header_length, "welcome"));
      if (h.status == 0) return Status::Ok();
      return Status(static_cast<StatusCode>(SanitizeWireStatus(h.status)), "welcome refused");
    }
    case kGetChunk: {
      TESSERA_ASSIGN_OR_RETURN(auto h, DecodeHeader<GetChunkHeader>(header, header_length, "get"));
      return CheckChunkRequest(h, asked.length);
    }
    case kChunk: {
      TESSERA_ASSIGN_OR_RETURN(auto h, DecodeHeader<ChunkHeader>(header, header_length, "chunk"));
      if (h.status != 0) {
        return Status(static_cast<StatusCode>(SanitizeWireStatus(h.status)), "chunk refused");
      }
      return CheckChunkReply(h, payload_length, asked);
    }
    case kPush: {
      TESSERA_ASSIGN_OR_RETURN(auto h, DecodeHeader<PushHeader>(header, header_length, "push"));
      return CheckPush(h, payload_length);
    }
    case kChunkRead:
      return DecodeHeader<ChunkReadHeader>(header, header_length, "chunk read").status();
    case kPushRead:
      return DecodeHeader<PushReadHeader>(header, header_length, "push read").status();
    default:
      return InvalidArgument("unknown data-plane message {}", id);
  }
}

}  // namespace tessera::detail

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

}  // namespace tessera::detail

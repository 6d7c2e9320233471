#include "core/crypto.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

namespace tessera {

Sha256Digest HmacSha256(std::span<const uint8_t> key, std::span<const uint8_t> message) {
  Sha256Digest digest{};
  unsigned int length = 0;
  const unsigned char* done = HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
                                   message.data(), message.size(), digest.data(), &length);
  // HMAC fails only on allocation failure or a broken libcrypto: a bug, never bad input.
  TESSERA_CHECK(done != nullptr && length == digest.size(), "HMAC-SHA256 failed: {}",
                ERR_error_string(ERR_get_error(), nullptr));
  return digest;
}

Sha256Digest HmacSha256(std::string_view key, std::string_view message) {
  return HmacSha256(std::span(reinterpret_cast<const uint8_t*>(key.data()), key.size()),
                    std::span(reinterpret_cast<const uint8_t*>(message.data()), message.size()));
}

bool ConstantTimeEquals(std::span<const uint8_t> a, std::span<const uint8_t> b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  return ConstantTimeEquals(std::span(reinterpret_cast<const uint8_t*>(a.data()), a.size()),
                            std::span(reinterpret_cast<const uint8_t*>(b.data()), b.size()));
}

Status FillRandom(std::span<uint8_t> out) {
  if (RAND_bytes(out.data(), static_cast<int>(out.size())) != 1) {
    return Unavailable("the system's random generator failed: {}",
                       ERR_error_string(ERR_get_error(), nullptr));
  }
  return Status::Ok();
}

}  // namespace tessera

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

std::string Sha256Hex(std::string_view data) {
  Sha256Digest digest{};
  unsigned int length = 0;
  // Fails only on allocation failure or a broken libcrypto, as HMAC above.
  TESSERA_CHECK(
      EVP_Digest(data.data(), data.size(), digest.data(), &length, EVP_sha256(), nullptr) == 1 &&
          length == digest.size(),
      "SHA-256 failed: {}", ERR_error_string(ERR_get_error(), nullptr));
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * digest.size());
  for (uint8_t byte : digest) {
    hex.push_back(kHex[byte >> 4]);
    hex.push_back(kHex[byte & 15]);
  }
  return hex;
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

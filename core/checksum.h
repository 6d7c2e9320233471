// Checksums of bytes on disk and on the wire (checkpoint pieces, spilled objects).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace tessera {

// 64-bit FNV-1a: cheap, good enough to detect truncation and corruption (not tampering).
inline uint64_t Fnv1a(const void* data, size_t bytes) {
  uint64_t hash = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    hash ^= p[i];
    hash *= 1099511628211ull;
  }
  return hash;
}

// FNV-1a over 8-byte words (then the tail's bytes): about eight times faster than Fnv1a, with
// different values (spill files use it).
inline uint64_t Fnv1aWords(const void* data, size_t bytes) {
  uint64_t hash = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);
    hash = (hash ^ word) * 1099511628211ull;
  }
  for (; i < bytes; ++i) hash = (hash ^ p[i]) * 1099511628211ull;
  return hash;
}

}  // namespace tessera

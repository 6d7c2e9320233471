#include "core/block_quantization.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>

namespace tessera {
namespace {

constexpr int kCodeWordBits = 32;

// The largest code of `bits`-bit two's complement codes, used symmetrically.
int MaxCode(int bits) { return (1 << (bits - 1)) - 1; }

// The words of one block of n elements: its scale, then its codes.
int64_t BlockWords(int64_t n, int bits) {
  const int64_t per_word = kCodeWordBits / bits;
  return 1 + (n + per_word - 1) / per_word;
}

// Elements of block b of a buffer of `count`.
int64_t BlockElements(int64_t count, int64_t b) {
  return std::min(kQuantizationBlock, count - b * kQuantizationBlock);
}

// Decodes the block at `words` (n elements) into out[0, n); returns the words it took.
int64_t DecodeBlock(const uint32_t* words, int64_t n, int bits, float* out) {
  const int per_word = kCodeWordBits / bits;
  const uint32_t mask = (1u << bits) - 1;
  const int shift_back = kCodeWordBits - bits;  // sign-extends a code from the word's top bits
  const float scale = std::bit_cast<float>(words[0]);
  const uint32_t* codes = words + 1;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t raw = (codes[i / per_word] >> ((i % per_word) * bits)) & mask;
    const int32_t code = static_cast<int32_t>(raw << shift_back) >> shift_back;
    out[i] = static_cast<float>(code) * scale;
  }
  return BlockWords(n, bits);
}

}  // namespace

Status CheckQuantizationBits(int64_t bits) {
  if (bits != 8 && bits != 4) {
    return InvalidArgument("{}-bit quantization does not exist here: use 8 (int8) or 4 (int4)",
                           bits);
  }
  return Status::Ok();
}

int64_t QuantizedWords(int64_t count, int bits) {
  if (count <= 0) return 0;
  const int64_t full = count / kQuantizationBlock, rest = count % kQuantizationBlock;
  return full * BlockWords(kQuantizationBlock, bits) + (rest > 0 ? BlockWords(rest, bits) : 0);
}

void QuantizeBlocks(const float* x, int64_t count, int bits, uint32_t* words) {
  const int per_word = kCodeWordBits / bits;
  const uint32_t mask = (1u << bits) - 1;
  const auto max_code = static_cast<float>(MaxCode(bits));
  for (int64_t b = 0, begin = 0; begin < count; ++b, begin += kQuantizationBlock) {
    const int64_t n = BlockElements(count, b);
    const float* values = x + begin;
    float largest = 0.f;
    // NaN propagates through the scale (std::max would drop it).
    for (int64_t i = 0; i < n; ++i) {
      const float magnitude = std::fabs(values[i]);
      largest = magnitude > largest || std::isnan(magnitude) ? magnitude : largest;
    }
    const float scale = largest / max_code;
    words[0] = std::bit_cast<uint32_t>(scale);
    uint32_t* codes = words + 1;
    const int64_t code_words = BlockWords(n, bits) - 1;
    std::fill(codes, codes + code_words, 0u);
    if (scale > 0.f && std::isfinite(scale)) {
      for (int64_t i = 0; i < n; ++i) {
        const float code = std::clamp(std::nearbyint(values[i] / scale), -max_code, max_code);
        const auto raw = static_cast<uint32_t>(static_cast<int32_t>(code)) & mask;
        codes[i / per_word] |= raw << ((i % per_word) * bits);
      }
    }
    words += 1 + code_words;
  }
}

void DequantizeBlocks(const uint32_t* words, int64_t count, int bits, float* out) {
  for (int64_t b = 0, begin = 0; begin < count; ++b, begin += kQuantizationBlock) {
    words += DecodeBlock(words, BlockElements(count, b), bits, out + begin);
  }
}

void AccumulateDequantized(const uint32_t* words, int64_t count, int bits, float* out) {
  // Each block decoded (rounded to f32) first, then added: code * scale + out in one expression
  // may be contracted into a fused multiply-add, whose single rounding is not the decoded value's.
  std::array<float, kQuantizationBlock> decoded;
  for (int64_t b = 0, begin = 0; begin < count; ++b, begin += kQuantizationBlock) {
    const int64_t n = BlockElements(count, b);
    words += DecodeBlock(words, n, bits, decoded.data());
    for (int64_t i = 0; i < n; ++i) out[begin + i] += decoded[static_cast<size_t>(i)];
  }
}

}  // namespace tessera

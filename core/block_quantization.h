// Block quantization: the arithmetic of ZeRO++-style quantized collectives (collectives/
// quantized.h has the exchanges), here in core so that a collective and a one-member group's
// kernel compute the same bits.
//
// A buffer of `count` f32 elements is cut into blocks of kQuantizationBlock elements (the last
// one shorter). A block is encoded as words of 32 bits: its scale's bits (the largest magnitude
// in the block over the largest code, 2^(bits-1) - 1: 127 for int8, 7 for int4; 0 for a block of
// zeros), then one code an element, round-to-nearest-even of element / scale, two's complement
// in `bits` bits, packed 32 / bits to a word from the low bits up (the last word's spare bits
// clear). Decoded, an element is code * scale. Symmetric and per block, as ZeRO++'s weight and
// gradient quantization; a non-finite element makes its block's scale non-finite, which decodes
// to non-finite values (a diverged step stays visible, it is not clamped away).
//
// Sizes: 8-bit codes cost count / 4 words plus a word a block, 4-bit ones count / 8 plus a word
// a block: with blocks of 512, 1/2 and 1/4 of bf16's bytes to within 0.8% and 1.6%.
//
// Thread safety: pure functions of their arguments.
#pragma once

#include <cstdint>

#include "core/status.h"

namespace tessera {

inline constexpr int64_t kQuantizationBlock = 512;

// OK for 8 and 4; InvalidArgument naming the choices otherwise.
Status CheckQuantizationBits(int64_t bits);
// The words `count` elements encode to.
int64_t QuantizedWords(int64_t count, int bits);
// Encodes x[0, count) into `words` (QuantizedWords(count, bits) of them).
void QuantizeBlocks(const float* x, int64_t count, int bits, uint32_t* words);
// Decodes `words` into out[0, count).
void DequantizeBlocks(const uint32_t* words, int64_t count, int bits, float* out);
// out[i] += decoded element i, for i in [0, count): a reduction of quantized pieces in order.
void AccumulateDequantized(const uint32_t* words, int64_t count, int bits, float* out);

}  // namespace tessera

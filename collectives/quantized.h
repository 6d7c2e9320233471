// Quantized collectives: ZeRO++'s (Wang et al. 2023) quantized weight all-gather (qwZ) and
// quantized gradient reduce-scatter (qgZ), over any Communicator.
//
// Both send block-quantized codes (core/block_quantization.h: int8 or int4, a scale a block of
// 512) instead of f32 elements:
//   - all-gather: each rank encodes its block of `count` elements; the ranks all-gather the
//     encodings and every rank decodes every block, its own too, so that every rank holds the
//     same bits (a forward computed on them is the same everywhere).
//   - reduce-scatter: each rank encodes each of the `size` blocks of its input (block j for rank
//     j); an all-to-all sends block j to rank j, which decodes the blocks and sums them in rank
//     order (ZeRO++'s all-to-all reduce-scatter, one hop: a ring would quantize again at every
//     hop).
// Bytes: each rank sends (size - 1) encodings of `count` elements: with 8-bit codes 1/4 of an f32
// collective's and 1/2 of a bf16 one's, with 4-bit codes 1/8 and 1/4, plus a word a block.
// Lossy: an element is off by at most half its block's scale (the block's largest magnitude /
// 254 for int8, / 14 for int4) each time it is encoded.
//
// Thread safety: as the communicator (one call at a time).
#pragma once

#include <cstdint>

#include "collectives/communicator.h"
#include "core/status.h"

namespace tessera {

// What one rank sends for a quantized all-gather or reduce-scatter of blocks of `count`
// elements over `size` ranks, in bytes.
int64_t QuantizedCollectiveBytes(int64_t count, int size, int bits);

// out (size * count f32) = every rank's `in` (count f32), quantized to `bits`, in rank order.
Status QuantizedAllGather(Communicator& communicator, const float* in, int64_t count, int bits,
                          float* out);
// out (count f32) = the sum over ranks of block rank() of their `in` (size * count f32), each
// block quantized to `bits`, summed in rank order.
Status QuantizedReduceScatter(Communicator& communicator, const float* in, int64_t count, int bits,
                              float* out);

}  // namespace tessera

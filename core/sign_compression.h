// Sign compression with error feedback: the arithmetic of 1-bit Adam's compressed all-reduce
// (collectives/compressed.h has the algorithm and its exchanges), here in core so that the
// collective and a one-member group's kernel compute the same bits.
//
// A buffer of `count` f32 elements over `size` ranks is cut into `size` chunks of
// SignChunkElements each (the last one padded with zeros). A chunk compresses to a block of
// SignBlockWords 32-bit words: its scale's bits (the root mean square of its real elements,
// DeepSpeed's scale), then one bit an element (set: the element is >= 0, -0 included), packed
// 32 to a word, the padding's bits clear. Decoded, an element is +-scale by its bit.
//
// The scale's sum of squares is fixed to the bit, so that every rank and the one-member kernel
// agree on every CPU: each square in double (exact), element i of the chunk added to partial sum
// i % kSquareLanes in element order, the partials then added in lane order, the root of that
// over the real elements' count rounded to f32. (Independent partial sums: the additions overlap
// instead of waiting on one another; a serial sum would be a quarter of the speed.)
//
// The passes are loops over whole words the compiler vectorises, in place (no allocation): the
// worker's half adds the error into worker_error, sums its squares, then packs the signs while
// turning it into the new error; the server sums the ranks' decoded blocks a tile at a time.
//
// Thread safety: pure functions of their arguments.
#pragma once

#include <cstdint>

#include "core/lane_sum.h"  // kSquareLanes: the partial sums of a chunk's squares (above)

namespace tessera {

// count / size rounded up to a whole number of 32-bit words of signs; 0 for no elements.
int64_t SignChunkElements(int64_t count, int size);
// The words of one chunk's block: its scale, then its signs.
int64_t SignBlockWords(int64_t chunk);

// The worker half: per chunk j, (buffer + worker_error) compressed into block j of `blocks`
// (size blocks), and worker_error set to what the compression dropped.
void CompressWorkerChunks(const float* buffer, int64_t count, int size, float* worker_error,
                          uint32_t* blocks);
// The server half for chunk `index`: the blocks of that chunk from every rank (`ranks` blocks,
// in rank order) averaged in rank order, plus server_error (a chunk long), compressed into
// `out`; server_error set to what that dropped (zero on the padding).
void ServeSignChunk(const uint32_t* blocks, int ranks, int64_t count, int size, int index,
                    float* server_error, uint32_t* out);
// Every chunk's block (size blocks, in chunk order) decoded into `buffer` (count elements).
void DecodeSignChunks(const uint32_t* blocks, int64_t count, int size, float* buffer);

}  // namespace tessera

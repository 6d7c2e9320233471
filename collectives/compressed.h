// Error-feedback compressed all-reduce: 1-bit Adam's collective (Tang et al. 2021; DeepSpeed's
// compressed_allreduce), over any Communicator.
//
// An average of every rank's f32 buffer, sent as signs: each element one bit, each chunk one f32
// scale, with the error of every compression kept and added to the next call's input (error
// feedback), so that what a compression drops is sent later instead of lost. Two phases:
//   1. worker: c = buffer + worker_error; the buffer in `size` chunks, chunk j for rank j (the
//      chunk's server); each chunk compressed to scale_j * sign(c) with scale_j the root mean
//      square of its elements (DeepSpeed's scale); worker_error = c - that. Every rank sends
//      chunk j's bits and scale to rank j (an all-to-all of packed words).
//   2. server: rank j averages its chunk over the ranks (in rank order: the same bits on every
//      rank), adds server_error (one chunk long), compresses it alike, keeps its error, and the
//      ranks all-gather every chunk's bits and scale. Every rank decodes the same average.
// Signs: an element >= 0 (and -0) is +1, else -1. A chunk is a whole number of 32-bit words; the
// last chunk's padding is zero and in no scale. The arithmetic is core/sign_compression.h's (the
// collective task compressed_all_reduce's one-member kernel computes the same bits).
//
// Bytes: each rank sends (size - 1) blocks of (chunk / 32 + 1) words in each phase, about
// 2 (size - 1) / size x count / 8 bytes in all: 1/32 of an f32 ring all-reduce's (1/16 of a
// bf16 one's), less the scales and padding.
//
// Invariant (error feedback telescopes): over calls t, the sum of the outputs equals the sum of
// the true averages less the ranks' average worker_error and the server errors now held.
//
// Thread safety: as the communicator (one call at a time).
#pragma once

#include <cstdint>

#include "collectives/communicator.h"
#include "core/sign_compression.h"
#include "core/status.h"

namespace tessera {

// What one rank sends for a call of `count` over `size` ranks, in bytes (both phases).
int64_t CompressedAllReduceBytes(int64_t count, int size);

// Averages `buffer` (count f32 elements) over the communicator's ranks, compressed, in place.
// `worker_error` holds count elements, `server_error` SignChunkElements(count, size())
// (core/sign_compression.h);
// both are read and updated (zero them before the first call). Every rank calls it with the
// same count. InvalidArgument for a negative count or null buffers with a positive count.
Status CompressedAllReduce(Communicator& communicator, float* buffer, int64_t count,
                           float* worker_error, float* server_error);

}  // namespace tessera

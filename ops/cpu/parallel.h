// Small parallel-loop helpers over the calling thread's TBB arena (internal to ops/cpu).
#pragma once

#include <cstdint>
#include <vector>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

namespace tessera::cpu::detail {

// fn(begin, end) over [0, n) in ranges of about `grain` elements, in parallel.
template <typename Fn>
void ParallelFor(int64_t n, int64_t grain, const Fn& fn) {
  if (n <= 0) return;
  if (n <= grain) {
    fn(int64_t{0}, n);
    return;
  }
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, n, grain),
      [&](const tbb::blocked_range<int64_t>& range) { fn(range.begin(), range.end()); });
}

// fn(chunk_index, begin, end) for the fixed chunks [i*chunk, min(n, (i+1)*chunk)), in parallel.
// Chunk boundaries depend only on n and chunk, so per-chunk partial results combined in index
// order give the same answer whatever the thread count: the basis of deterministic reductions.
template <typename Fn>
int64_t ParallelChunks(int64_t n, int64_t chunk, const Fn& fn) {
  const int64_t chunks = n <= 0 ? 0 : (n + chunk - 1) / chunk;
  if (chunks == 1) {
    fn(int64_t{0}, int64_t{0}, n);
  } else if (chunks > 1) {
    tbb::parallel_for(int64_t{0}, chunks, [&](int64_t i) {
      const int64_t begin = i * chunk;
      fn(i, begin, begin + chunk < n ? begin + chunk : n);
    });
  }
  return chunks;
}

}  // namespace tessera::cpu::detail

#include "core/sign_compression.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>

namespace tessera {
namespace {

constexpr int64_t kBitsPerWord = 32;
// The server's sums are made a tile at a time (on the stack: no allocation per call).
constexpr int64_t kTileElements = 2048;
static_assert(kTileElements % kBitsPerWord == 0);

// A chunk's elements that are the buffer's (the last chunk's tail is padding).
int64_t RealElements(int64_t count, int64_t chunk, int index) {
  return std::clamp<int64_t>(count - chunk * index, 0, chunk);
}

// +scale where bit `k` of `word` is set, else -scale. Written as a select of the whole word's
// elements at once (the loops below run over a word's 32 elements with constant bounds, which
// the compiler vectorises: a variable shift, a compare and a blend per lane).
inline float Signed(float scale, uint32_t word, int64_t k) {
  return ((word >> k) & 1u) != 0 ? scale : -scale;
}

// The root mean square of n values, their squares summed in lanes (core/lane_sum.h: the same
// bits on every CPU that follows IEEE double arithmetic). With kAdd, values[i] = addend[i] +
// values[i] first (the worker's error feedback, fused into the same pass).
template <bool kAdd>
float RootMeanSquare(float* values, const float* addend, int64_t n) {
  if (n <= 0) return 0.f;
  const double squares = LaneSumOfSquares(n, [&](int64_t i) {
    if constexpr (kAdd) values[i] = addend[i] + values[i];
    return values[i];
  });
  return static_cast<float>(std::sqrt(squares / static_cast<double>(n)));
}

// One word's signs of 32 values, each value replaced by what the compression drops (value -
// +-scale).
inline uint32_t PackWord(float* values, float scale) {
  uint32_t word = 0;
  for (int64_t k = 0; k < kBitsPerWord; ++k) {
    const bool positive = values[k] >= 0.f;
    word |= static_cast<uint32_t>(positive) << k;
    values[k] -= positive ? scale : -scale;
  }
  return word;
}

// `values` (n real elements of a chunk; plus `addend`'s when given) compressed into `block`, in
// place: each value becomes its error (value - decoded).
void CompressInPlace(float* values, const float* addend, int64_t n, int64_t chunk,
                     uint32_t* block) {
  const float scale = addend != nullptr ? RootMeanSquare<true>(values, addend, n)
                                        : RootMeanSquare<false>(values, nullptr, n);
  block[0] = std::bit_cast<uint32_t>(scale);
  uint32_t* words = block + 1;
  const int64_t whole = n / kBitsPerWord;
  for (int64_t w = 0; w < whole; ++w) words[w] = PackWord(values + w * kBitsPerWord, scale);
  std::fill(words + whole, words + chunk / kBitsPerWord, 0u);
  uint32_t tail = 0;
  for (int64_t i = whole * kBitsPerWord; i < n; ++i) {
    const bool positive = values[i] >= 0.f;
    tail |= static_cast<uint32_t>(positive) << (i % kBitsPerWord);
    values[i] -= positive ? scale : -scale;
  }
  if (whole * kBitsPerWord < n) words[whole] = tail;
}

// Elements [begin, begin + n) of a block decoded: out[i] = decoded (assign) or += decoded (add).
template <bool kAdd>
void Decode(const uint32_t* block, int64_t begin, int64_t n, float* out) {
  const float scale = std::bit_cast<float>(block[0]);
  const uint32_t* words = block + 1 + begin / kBitsPerWord;  // begin: a whole number of words
  const int64_t whole = n / kBitsPerWord;
  for (int64_t w = 0; w < whole; ++w) {
    const uint32_t word = words[w];
    float* o = out + w * kBitsPerWord;
    for (int64_t k = 0; k < kBitsPerWord; ++k) {
      if constexpr (kAdd) {
        o[k] += Signed(scale, word, k);
      } else {
        o[k] = Signed(scale, word, k);
      }
    }
  }
  for (int64_t i = whole * kBitsPerWord; i < n; ++i) {
    const float v = Signed(scale, words[i / kBitsPerWord], i % kBitsPerWord);
    if constexpr (kAdd) {
      out[i] += v;
    } else {
      out[i] = v;
    }
  }
}

}  // namespace

int64_t SignChunkElements(int64_t count, int size) {
  if (count <= 0 || size <= 0) return 0;
  const int64_t per_rank = (count + size - 1) / size;
  return (per_rank + kBitsPerWord - 1) / kBitsPerWord * kBitsPerWord;
}

int64_t SignBlockWords(int64_t chunk) { return 1 + chunk / kBitsPerWord; }

void CompressWorkerChunks(const float* buffer, int64_t count, int size, float* worker_error,
                          uint32_t* blocks) {
  const int64_t chunk = SignChunkElements(count, size);
  const int64_t words = SignBlockWords(chunk);
  for (int j = 0; j < size; ++j) {
    const int64_t begin = chunk * j;
    const int64_t n = RealElements(count, chunk, j);
    // worker_error: the input with its error, then the new error.
    CompressInPlace(worker_error + begin, buffer + begin, n, chunk, blocks + words * j);
  }
}

void ServeSignChunk(const uint32_t* blocks, int ranks, int64_t count, int size, int index,
                    float* server_error, uint32_t* out) {
  const int64_t chunk = SignChunkElements(count, size);
  const int64_t words = SignBlockWords(chunk);
  const int64_t n = RealElements(count, chunk, index);
  // Each element's sum over the ranks in rank order, a tile at a time; then / ranks, plus the
  // server's error (held in server_error, compressed in place into the new error).
  std::array<float, kTileElements> sums;
  for (int64_t begin = 0; begin < n; begin += kTileElements) {
    const int64_t m = std::min(kTileElements, n - begin);
    std::fill_n(sums.begin(), m, 0.f);
    for (int r = 0; r < ranks; ++r) Decode<true>(blocks + words * r, begin, m, sums.data());
    float* average = server_error + begin;
    for (int64_t i = 0; i < m; ++i) average[i] = sums[i] / static_cast<float>(ranks) + average[i];
  }
  CompressInPlace(server_error, nullptr, n, chunk, out);
  std::fill(server_error + n, server_error + chunk, 0.f);
}

void DecodeSignChunks(const uint32_t* blocks, int64_t count, int size, float* buffer) {
  const int64_t chunk = SignChunkElements(count, size);
  const int64_t words = SignBlockWords(chunk);
  for (int j = 0; j < size; ++j) {
    Decode<false>(blocks + words * j, 0, RealElements(count, chunk, j), buffer + chunk * j);
  }
}

}  // namespace tessera

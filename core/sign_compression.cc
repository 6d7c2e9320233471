#include "core/sign_compression.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

namespace tessera {
namespace {

constexpr int64_t kBitsPerWord = 32;

// A chunk's elements that are the buffer's (the last chunk's tail is padding).
int64_t RealElements(int64_t count, int64_t chunk, int index) {
  return std::clamp<int64_t>(count - chunk * index, 0, chunk);
}

// +scale where `bit` is set, else -scale, without a branch (the bits are random: a branch on
// them mispredicts half the time): the scale's sign bit flipped where `bit` is clear.
inline float Signed(uint32_t scale_bits, uint32_t bit) {
  return std::bit_cast<float>(scale_bits ^ ((~bit & 1u) << 31));
}

// `values` (n real elements of a chunk) into `block`; `error` receives values - decoded.
void Compress(const float* values, int64_t n, int64_t chunk, uint32_t* block, float* error) {
  double squares = 0;
  for (int64_t i = 0; i < n; ++i) squares += static_cast<double>(values[i]) * values[i];
  const auto scale = n > 0 ? static_cast<float>(std::sqrt(squares / static_cast<double>(n))) : 0.f;
  const auto scale_bits = std::bit_cast<uint32_t>(scale);
  block[0] = scale_bits;
  uint32_t* words = block + 1;
  std::fill(words, words + chunk / kBitsPerWord, 0u);
  for (int64_t w = 0; w * kBitsPerWord < n; ++w) {
    const int64_t begin = w * kBitsPerWord, end = std::min(n, begin + kBitsPerWord);
    uint32_t word = 0;
    for (int64_t i = begin; i < end; ++i) {
      const auto bit = static_cast<uint32_t>(values[i] >= 0.f);
      word |= bit << (i - begin);
      error[i] = values[i] - Signed(scale_bits, bit);
    }
    words[w] = word;
  }
}

// Elements [begin, end) of a compressed block added to `sums` (sums[i - begin]).
void AddDecoded(const uint32_t* block, int64_t begin, int64_t end, float* sums) {
  const uint32_t scale_bits = block[0];
  for (int64_t i = begin; i < end; ++i) {
    sums[i - begin] += Signed(scale_bits, block[1 + i / kBitsPerWord] >> (i % kBitsPerWord));
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
  std::vector<float> corrected(static_cast<size_t>(chunk));
  for (int j = 0; j < size; ++j) {
    const int64_t begin = chunk * j;
    const int64_t n = RealElements(count, chunk, j);
    for (int64_t i = 0; i < n; ++i) {
      corrected[static_cast<size_t>(i)] = buffer[begin + i] + worker_error[begin + i];
    }
    Compress(corrected.data(), n, chunk, blocks + words * j, worker_error + begin);
  }
}

void ServeSignChunk(const uint32_t* blocks, int ranks, int64_t count, int size, int index,
                    float* server_error, uint32_t* out) {
  const int64_t chunk = SignChunkElements(count, size);
  const int64_t words = SignBlockWords(chunk);
  const int64_t n = RealElements(count, chunk, index);
  // Each element's sum over the ranks in rank order, a word's 32 elements at a time.
  std::vector<float> average(static_cast<size_t>(chunk), 0.f);
  for (int64_t begin = 0; begin < n; begin += kBitsPerWord) {
    const int64_t end = std::min(n, begin + kBitsPerWord);
    float* sums = average.data() + begin;
    for (int r = 0; r < ranks; ++r) AddDecoded(blocks + words * r, begin, end, sums);
    for (int64_t i = begin; i < end; ++i) {
      average[static_cast<size_t>(i)] =
          average[static_cast<size_t>(i)] / static_cast<float>(ranks) + server_error[i];
    }
  }
  Compress(average.data(), n, chunk, out, server_error);
  std::fill(server_error + n, server_error + chunk, 0.f);
}

void DecodeSignChunks(const uint32_t* blocks, int64_t count, int size, float* buffer) {
  const int64_t chunk = SignChunkElements(count, size);
  const int64_t words = SignBlockWords(chunk);
  for (int j = 0; j < size; ++j) {
    const int64_t begin = chunk * j;
    const uint32_t* block = blocks + words * j;
    for (int64_t i = 0, n = RealElements(count, chunk, j); i < n; ++i) {
      buffer[begin + i] = Signed(block[0], block[1 + i / kBitsPerWord] >> (i % kBitsPerWord));
    }
  }
}

}  // namespace tessera

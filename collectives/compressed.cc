#include "collectives/compressed.h"

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

// Compresses `values` (n real elements of a chunk) into `block`: its scale's bits, then the
// signs packed 32 to a word (bit k of word w: element 32w + k is >= 0); `error` (n elements)
// receives values - scale * sign. `block` holds 1 + chunk / 32 words, the padding's bits zero.
void Compress(const float* values, int64_t n, int64_t chunk, uint32_t* block, float* error) {
  double squares = 0;
  for (int64_t i = 0; i < n; ++i) squares += static_cast<double>(values[i]) * values[i];
  const auto scale = n > 0 ? static_cast<float>(std::sqrt(squares / static_cast<double>(n))) : 0.f;
  block[0] = std::bit_cast<uint32_t>(scale);
  uint32_t* words = block + 1;
  std::fill(words, words + chunk / kBitsPerWord, 0u);
  for (int64_t i = 0; i < n; ++i) {
    const bool positive = values[i] >= 0.f;
    if (positive) words[i / kBitsPerWord] |= 1u << (i % kBitsPerWord);
    error[i] = values[i] - (positive ? scale : -scale);
  }
}

// Element i of a compressed block: +-scale.
float Decoded(const uint32_t* block, int64_t i) {
  const float scale = std::bit_cast<float>(block[0]);
  const bool positive = ((block[1 + i / kBitsPerWord] >> (i % kBitsPerWord)) & 1u) != 0;
  return positive ? scale : -scale;
}

}  // namespace

int64_t CompressedChunkElements(int64_t count, int size) {
  if (count <= 0 || size <= 0) return 0;
  const int64_t per_rank = (count + size - 1) / size;
  return (per_rank + kBitsPerWord - 1) / kBitsPerWord * kBitsPerWord;
}

int64_t CompressedAllReduceBytes(int64_t count, int size) {
  const int64_t block_words = 1 + CompressedChunkElements(count, size) / kBitsPerWord;
  return 2 * int64_t{size - 1} * block_words * int64_t{sizeof(uint32_t)};
}

Status CompressedAllReduce(Communicator& communicator, float* buffer, int64_t count,
                           float* worker_error, float* server_error) {
  if (count < 0) return InvalidArgument("compressed all-reduce of {} elements", count);
  if (count == 0) return Status::Ok();
  if (buffer == nullptr || worker_error == nullptr || server_error == nullptr) {
    return InvalidArgument(
        "compressed all-reduce of {} elements: the buffer and both error buffers must be given",
        count);
  }
  const int size = communicator.size();
  const int rank = communicator.rank();
  const int64_t chunk = CompressedChunkElements(count, size);
  const int64_t block_words = 1 + chunk / kBitsPerWord;
  const auto blocks = static_cast<size_t>(size);
  const auto words = static_cast<size_t>(block_words);

  // 1. Worker: the input with its error, compressed per chunk, chunk j to rank j.
  std::vector<uint32_t> sent(blocks * words), received(blocks * words);
  std::vector<float> corrected(static_cast<size_t>(chunk));
  for (int j = 0; j < size; ++j) {
    const int64_t begin = chunk * j;
    const int64_t n = RealElements(count, chunk, j);
    for (int64_t i = 0; i < n; ++i) {
      corrected[static_cast<size_t>(i)] = buffer[begin + i] + worker_error[begin + i];
    }
    Compress(corrected.data(), n, chunk, sent.data() + static_cast<size_t>(j) * words,
             worker_error + begin);
  }
  TESSERA_RETURN_IF_ERROR(
      communicator.AllToAll(sent.data(), received.data(), block_words, DType::kI32));

  // 2. Server: this rank's chunk averaged over the ranks in rank order, with its error,
  // compressed again; every chunk's block gathered and decoded.
  const int64_t mine = RealElements(count, chunk, rank);
  for (int64_t i = 0; i < mine; ++i) {
    float sum = 0;
    for (size_t r = 0; r < blocks; ++r) sum += Decoded(received.data() + r * words, i);
    corrected[static_cast<size_t>(i)] = sum / static_cast<float>(size) + server_error[i];
  }
  std::vector<uint32_t> block(words);
  Compress(corrected.data(), mine, chunk, block.data(), server_error);
  std::fill(server_error + mine, server_error + chunk, 0.f);
  TESSERA_RETURN_IF_ERROR(
      communicator.AllGather(block.data(), received.data(), block_words, DType::kI32));
  for (int j = 0; j < size; ++j) {
    const int64_t begin = chunk * j;
    const uint32_t* gathered = received.data() + static_cast<size_t>(j) * words;
    for (int64_t i = 0, n = RealElements(count, chunk, j); i < n; ++i) {
      buffer[begin + i] = Decoded(gathered, i);
    }
  }
  return Status::Ok();
}

}  // namespace tessera

#include "collectives/compressed.h"

#include <vector>

#include "core/sign_compression.h"

namespace tessera {

int64_t CompressedAllReduceBytes(int64_t count, int size) {
  const int64_t block_words = SignBlockWords(SignChunkElements(count, size));
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
  const int64_t words = SignBlockWords(SignChunkElements(count, size));
  const auto total = static_cast<size_t>(words) * static_cast<size_t>(size);
  // 1. Worker: the input with its error, compressed per chunk, chunk j to rank j.
  std::vector<uint32_t> sent(total), received(total);
  CompressWorkerChunks(buffer, count, size, worker_error, sent.data());
  TESSERA_RETURN_IF_ERROR(communicator.AllToAll(sent.data(), received.data(), words, DType::kI32));
  // 2. Server: this rank's chunk averaged over the ranks with its error, compressed again;
  // every chunk's block gathered and decoded.
  std::vector<uint32_t> served(static_cast<size_t>(words));
  ServeSignChunk(received.data(), size, count, size, communicator.rank(), server_error,
                 served.data());
  TESSERA_RETURN_IF_ERROR(
      communicator.AllGather(served.data(), received.data(), words, DType::kI32));
  DecodeSignChunks(received.data(), count, size, buffer);
  return Status::Ok();
}

}  // namespace tessera

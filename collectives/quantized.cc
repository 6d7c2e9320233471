#include "collectives/quantized.h"

#include <vector>

#include "core/block_quantization.h"

namespace tessera {
namespace {

Status CheckArguments(const char* what, const void* in, int64_t count, int bits, const void* out) {
  TESSERA_RETURN_IF_ERROR(CheckQuantizationBits(bits));
  if (count < 0) return InvalidArgument("quantized {} of {} elements", what, count);
  if (count > 0 && (in == nullptr || out == nullptr)) {
    return InvalidArgument("quantized {} of {} elements: both buffers must be given", what, count);
  }
  return Status::Ok();
}

}  // namespace

int64_t QuantizedCollectiveBytes(int64_t count, int size, int bits) {
  return int64_t{size - 1} * QuantizedWords(count, bits) * int64_t{sizeof(uint32_t)};
}

Status QuantizedAllGather(Communicator& communicator, const float* in, int64_t count, int bits,
                          float* out) {
  TESSERA_RETURN_IF_ERROR(CheckArguments("all-gather", in, count, bits, out));
  if (count == 0) return Status::Ok();
  const int size = communicator.size();
  const int64_t words = QuantizedWords(count, bits);
  std::vector<uint32_t> encoded(static_cast<size_t>(words) * static_cast<size_t>(size));
  uint32_t* own = encoded.data() + words * communicator.rank();
  QuantizeBlocks(in, count, bits, own);
  if (size > 1) {
    TESSERA_RETURN_IF_ERROR(communicator.AllGather(own, encoded.data(), words, DType::kI32));
  }
  for (int r = 0; r < size; ++r) {
    DequantizeBlocks(encoded.data() + words * r, count, bits, out + count * r);
  }
  return Status::Ok();
}

Status QuantizedReduceScatter(Communicator& communicator, const float* in, int64_t count, int bits,
                              float* out) {
  TESSERA_RETURN_IF_ERROR(CheckArguments("reduce-scatter", in, count, bits, out));
  if (count == 0) return Status::Ok();
  const int size = communicator.size();
  const int64_t words = QuantizedWords(count, bits);
  const auto total = static_cast<size_t>(words) * static_cast<size_t>(size);
  std::vector<uint32_t> sent(total);
  for (int j = 0; j < size; ++j) {
    QuantizeBlocks(in + count * j, count, bits, sent.data() + words * j);
  }
  std::vector<uint32_t> received;  // every rank's block for this rank, in rank order
  if (size > 1) {
    received.resize(total);
    TESSERA_RETURN_IF_ERROR(
        communicator.AllToAll(sent.data(), received.data(), words, DType::kI32));
  }
  const uint32_t* blocks = size > 1 ? received.data() : sent.data();
  DequantizeBlocks(blocks, count, bits, out);
  for (int r = 1; r < size; ++r) AccumulateDequantized(blocks + words * r, count, bits, out);
  return Status::Ok();
}

}  // namespace tessera

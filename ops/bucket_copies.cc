#include "ops/bucket_copies.h"

namespace tessera {

Status PackShards(const std::vector<Tensor>& inputs, const Tensor& out, int64_t ranks,
                  ByteCopy copy) {
  if (ranks < 1) return InvalidArgument("pack_shards over {} ranks: use 1 or more", ranks);
  int64_t total = 0;
  for (const Tensor& input : inputs) {
    if (input.bytes() % ranks != 0) {
      return InvalidArgument("pack_shards: an input of {} bytes does not split into {} shards",
                             input.bytes(), ranks);
    }
    total += input.bytes();
  }
  if (total != out.bytes()) {
    return InvalidArgument("pack_shards: the inputs hold {} bytes but the output {}", total,
                           out.bytes());
  }
  char* to = static_cast<char*>(out.raw_data());
  for (int64_t shard = 0; shard < ranks; ++shard) {
    for (const Tensor& input : inputs) {
      const int64_t bytes = input.bytes() / ranks;
      if (bytes == 0) continue;
      TESSERA_RETURN_IF_ERROR(
          copy(to, static_cast<const char*>(input.raw_data()) + shard * bytes, bytes));
      to += bytes;
    }
  }
  return Status::Ok();
}

Status SplitInto(const Tensor& input, const std::vector<Tensor>& outputs, ByteCopy copy) {
  int64_t total = 0;
  for (const Tensor& output : outputs) total += output.bytes();
  if (total != input.bytes()) {
    return InvalidArgument("split: the outputs hold {} bytes but the input {}", total,
                           input.bytes());
  }
  const char* from = static_cast<const char*>(input.raw_data());
  for (const Tensor& output : outputs) {
    if (output.bytes() == 0) continue;
    TESSERA_RETURN_IF_ERROR(copy(output.raw_data(), from, output.bytes()));
    from += output.bytes();
  }
  return Status::Ok();
}

}  // namespace tessera

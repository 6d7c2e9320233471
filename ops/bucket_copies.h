// The byte copies of the gradient-bucket ops (pack_shards, split; ops/standard_ops_collective.cc),
// written once for every device: a kernel passes the copy its device makes (memcpy on the CPU,
// an asynchronous device copy on a GPU).
//
// pack_shards over R ranks lays out shard 0 of every input in order, then shard 1 of every input,
// and so on, so that member r of a reduce-scatter of the packed buffer holds shard r of every
// input, in order; split cuts a buffer into consecutive pieces. Both check the tensors' sizes
// against each other and say what does not fit (a kernel called with tensors inference did not
// produce).
//
// Internal to ops and its kernels. Pure functions of their arguments.
#pragma once

#include <cstdint>
#include <vector>

#include "core/function_ref.h"
#include "core/status.h"
#include "core/tensor.h"

namespace tessera {

// Copies `bytes` bytes from src to dst (not overlapping).
using ByteCopy = FunctionRef<Status(void* dst, const void* src, int64_t bytes)>;

// out = inputs packed shard by shard over `ranks`.
Status PackShards(const std::vector<Tensor>& inputs, const Tensor& out, int64_t ranks,
                  ByteCopy copy);
// outputs = consecutive pieces of `input`.
Status SplitInto(const Tensor& input, const std::vector<Tensor>& outputs, ByteCopy copy);

}  // namespace tessera

// Elementwise reductions for collectives, over every dtype a collective accepts.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/dtype.h"
#include "core/status.h"

namespace tessera {

enum class ReduceOp : uint8_t { kSum, kAvg, kMax, kMin };

std::string_view ReduceOpName(ReduceOp op);

// True for f32, bf16, f16 and i32.
bool CollectiveSupports(DType dtype);

// dst[i] = op(dst[i], src[i]) for `count` elements (kAvg accumulates as a sum; see Finish).
// bf16/f16 are combined in float and rounded once per call. InvalidArgument for an unsupported
// dtype.
Status Accumulate(void* dst, const void* src, int64_t count, DType dtype, ReduceOp op);

// After accumulating `ranks` contributions: divides by `ranks` for kAvg (integer division for
// i32); a no-op for the other ops.
Status Finish(void* data, int64_t count, DType dtype, ReduceOp op, int ranks);

}  // namespace tessera

// The reference for every collective: a naive computation any rank can do alone.
//
// Every rank's input is a cheap function of (rank, element index), so a rank can compute the
// reference result of any collective at any size without holding the other ranks' buffers —
// the same check works for threads on the loopback transport and for processes over UCX.
// Inputs are multiples of 1/8 in [-12.5, 12.5] (exact in every float dtype) or integers in
// [-1000, 1000] for i32. Reduced results are compared with a dtype-aware tolerance: i32 and
// max/min exactly; sums within eps(dtype) x (ranks + 1) x sum of |inputs|, since every partial
// sum may round once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "collectives/communicator.h"

namespace tessera::testing {

// Rank `rank`'s input element `index`, as a double (exactly representable in `dtype`).
double CollectiveInput(int rank, int64_t index, DType dtype);

struct CollectiveSuiteOptions {
  std::vector<int64_t> sizes = {0, 1, 2, 7, 13, 127, 1021, 65537};
  std::vector<DType> dtypes = {DType::kF32, DType::kBF16, DType::kF16, DType::kI32};
  // Also run every op on f32 buffers of this many bytes (0: not), and all-reduce and all-to-all
  // on every dtype.
  int64_t large_bytes = 0;
};

// Runs every collective (all-reduce, reduce-scatter and reduce with each reduce op; all-gather;
// all-to-all; broadcast from two roots; a ring shift by send-recv; a chain of send/recv) for
// every dtype and size (for all-to-all, the size of each rank's block for each peer), checking
// each result against the reference. All ranks must call it with the same options.
// Returns the first mismatch or communicator error, naming the collective, dtype, size and element.
Status RunCollectiveSuite(Communicator& communicator, const CollectiveSuiteOptions& options);

// One all-reduce (sum, f32) of `count` elements, checked. For failure tests and benchmarks.
Status CheckedAllReduce(Communicator& communicator, int64_t count);

}  // namespace tessera::testing

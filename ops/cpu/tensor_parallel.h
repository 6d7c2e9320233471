// CPU kernels of the tensor-parallel ops (ops/standard_ops_tensor_parallel.cc): the
// vocabulary-parallel embedding and cross-entropy. Deterministic: every sum runs in a fixed order
// whatever the thread count.
#pragma once

#include "core/status.h"
#include "ops/op_registry.h"

namespace tessera {

// REQUIRES: RegisterStandardOps(registry) ran first.
Status RegisterTensorParallelKernels(OpRegistry& registry);

}  // namespace tessera

// Registers the CPU kernel of every built-in op (ops/standard_ops.h) on a registry.
#pragma once

#include "core/status.h"
#include "ops/op_registry.h"

namespace tessera {

// Every built-in op's CPU kernel, then the CPU kernels of every plugin this process loaded
// (ops/plugin.h). REQUIRES: RegisterStandardOps(registry) ran first. AlreadyExists if called
// twice.
Status RegisterCpuKernels(OpRegistry& registry);

// A registry with every built-in op and its CPU kernel: what a CPU worker uses.
Result<OpRegistry> MakeCpuOpRegistry();

}  // namespace tessera

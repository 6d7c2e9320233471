// SimulatedGpu: a stand-in GPU, so the runtime's GPU paths (GPU workers, the device tier, host
// copies of device objects, collectives over device buffers) run and are tested on machines
// without one. Chosen by TESSERA_SIMULATED_GPU=1 in the environment: OpenGpu, AddGpuKernels and
// ResolveGpus (worker/gpu.h) then give one simulated GPU, 0, to every process that asks
// (workers started by a driver inherit the variable).
//
// Device memory is host memory holding every byte XOR-scrambled. Copy to and from the host
// unscrambles; nothing else does, so host code that reads a device buffer directly instead of
// copying it down — what a real GPU turns into a crash — reads garbage here, and a test that
// compares numbers sees it. Kernels are the CPU kernels, run on unscrambled host copies of their
// device operands (the results are scrambled back), so activations stay f32: the CPU kernels'
// type (worker/gpu.h: GpuActivations). The time its kernels run is its busy time, which its meter
// reports as utilisation (MakeSimulatedGpuMeter).
#pragma once

#include <cstdint>
#include <memory>

#include "core/device_runtime.h"
#include "core/gpu_use.h"
#include "core/status.h"
#include "ops/op_registry.h"

namespace tessera {

// Whether TESSERA_SIMULATED_GPU=1 (read each call: tests set it before starting processes).
bool SimulatedGpuRequested();

// A simulated cuda:0 with an allocator cap (0: 64 GiB).
std::shared_ptr<DeviceRuntime> MakeSimulatedGpu(int64_t memory_cap_bytes = 0);

// Registers the layer programs' kernels for the device (ops/layer_program.h: they run their ops
// with the device's kernels), then, for every other op that has a CPU kernel and no kCuda one, a
// kCuda kernel that runs the CPU kernel on host copies of its device operands.
Status AddSimulatedGpuKernels(OpRegistry& registry);

// The simulated GPU's meter: utilisation is the part of each sample period in which at least one
// of its kernels ran; memory is its allocator's reserved bytes of its cap. InvalidArgument for a
// runtime that is not the simulated GPU.
Result<std::unique_ptr<GpuMeter>> MakeSimulatedGpuMeter(std::shared_ptr<DeviceRuntime> runtime);

}  // namespace tessera

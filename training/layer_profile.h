// Balancing pipeline stages by measured layer times, and the other figures plans are calibrated
// by (the host link's bandwidth).
//
// The planner cuts a model into stages by per-layer costs and orders zb-h1 by the costs of F, B
// and W, by default the op cost model's estimates. ProfileLayerTimes measures them instead
// (ParallelConfig::layer_op_costs): a short run of the model in this process, on one worker at
// the plan's micro-batch shape, with every backward that can split split in halves, whose trace
// gives each layer's forward, backward (input half or whole) and weight-half times. The inputs
// are zeros (a valid token, class and volume for any model: the times of dense kernels do not
// depend on the values), so the profile needs no data.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device_runtime.h"
#include "core/status.h"
#include "core/timeline.h"
#include "model/model_spec.h"
#include "planner/step_graph.h"
#include "worker/in_process_executor.h"

namespace tessera {

// Per layer of `model`, the milliseconds its forward, backward (whole, or input half) and weight
// half tasks ran in `timeline` over `steps` steps: the means per step. A task that ran beside
// others on its worker's compute slots counts its share of that time (its duration divided by
// how many ran at each moment), so that a worker's tasks' times add up to its busy time. Spans
// of other layers and of no layer (optimizer, collectives) are left out. InvalidArgument if
// steps < 1.
Result<std::vector<OpCosts>> LayerTimesFromTimeline(const ModelSpec& model,
                                                    const Timeline& timeline, int steps);

struct LayerProfileOptions {
  int warmup_steps = 1;  // untimed (first-touch allocation, caches)
  int steps = 2;         // timed
  // Split every backward that can be, timing the halves (what zero-bubble schedules need); false:
  // whole backwards, as a plan without split backwards runs them (the weight times are then 0).
  bool split_backwards = true;
};

// Runs the model in this process at the micro-batch shape of `plan` (its batch over its data
// ranks and micro-batches, its seq_len, device and optimizer; one worker, no pipeline, split
// backwards unless the options say otherwise), and returns LayerTimesFromTimeline of the timed
// steps. Errors name what failed
// ("profiling the layers: ...").
Result<std::vector<OpCosts>> ProfileLayerTimes(const ModelSpec& model, const TrainingPlan& plan,
                                               const ExecutorOptions& executor,
                                               const LayerProfileOptions& options = {});

// The same run, with what a step-time prediction needs besides (planner/step_time.h): per timed
// step, the measured step time, the time its tasks computed (each its share, as above), and how
// many tasks it ran.
struct StepProfile {
  std::vector<OpCosts> layer_ms;
  double step_ms = 0;  // StepReport::step_ms, the mean of the timed steps
  double busy_ms = 0;
  double tasks = 0;
  // The tasks that are no layer's (optimizer updates, gradient norms, accumulations): their
  // time (each its share, as above) over the op cost model's estimate of them (TaskCostUnits),
  // in milliseconds per unit; 0 when the step ran none. What the step time model prices such
  // tasks by (EstimateTaskTimes' other_ms_per_unit).
  double other_ms_per_unit = 0;
  // What a step spends per task beyond the tasks' own time (dispatch, waits on the scheduler):
  // (step_ms - busy_ms) / tasks, at least 0.
  double TaskOverheadMs() const;
};
Result<StepProfile> ProfileStep(const ModelSpec& model, const TrainingPlan& plan,
                                const ExecutorOptions& executor,
                                const LayerProfileOptions& options = {});

// The host link of `device` (MemoryCaps::host_link_bytes_per_us, what the memory plan times
// swaps by; of a swap file, MemoryCaps::disk_link_bytes_per_us): `bytes` copied host -> device
// and device -> host `repeats` times each (after one untimed copy each way), each direction's
// median, the slower of the two, in bytes per microsecond. InvalidArgument for bytes < 1 or repeats
// < 1; errors of the copies as they come.
Result<double> MeasureHostLink(DeviceRuntime& device, int64_t bytes = int64_t{64} << 20,
                               int repeats = 5);

// What copies over `link` take from a step's compute, in microseconds a byte copied (at least 0):
// the step profiled again (ProfileStep with `options`) while a thread copies 16 MiB host -> link
// -> host back to back, as the executor's I/O thread copies a swap beside the compute, against
// `alone` (the same profile without): the step's extra time over the bytes copied during it.
// Of a CPU worker's swap file, MemoryCaps::disk_copy_compute_us_per_byte: the kernel's block I/O
// work, interrupts, a virtual machine's copies on the cores the kernels run on, memory bandwidth.
// Errors of the profile, or of a copy (a link too small for the 16 MiB buffer), with context.
Result<double> MeasureCopyCompute(const ModelSpec& model, const TrainingPlan& plan,
                                  const ExecutorOptions& executor, DeviceRuntime& link,
                                  const StepProfile& alone,
                                  const LayerProfileOptions& options = {});

}  // namespace tessera

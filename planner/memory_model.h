// The memory model: every object's size, tier and live interval on the worker that holds it, and
// from them each worker's peak per tier, by role, before anything runs.
//
// A step is a known graph: every object's producer, readers and size are fixed when it is
// planned, so what a worker holds at each moment follows from the order it runs its tasks in.
// The model takes that order (SimulateWorkerOrders: the executor's own choice, or an order a
// plan imposes) and replays the executor's accounting (worker/role_meter.h) over it:
//   * the graph inputs a worker reads are bound when the step starts; an object another worker
//     produces is pushed to it as soon as its producer finishes, and the other workers' speeds
//     decide when that is: it is live from right after the last task of this worker's order
//     that its producer waits for, directly or not (before the first task when none), the
//     earliest it can come whatever the timing (with a simulated step's finishing times
//     instead: when its producer finishes);
//   * a task's outputs are live from the moment it runs; each object is freed after its last
//     reader on that worker, unless it is a graph output (kept after the step); an output nobody
//     reads there is freed as soon as it is made. One pushed to another worker is lent to the
//     push until the peer has read it: an allocation the cap would refuse meanwhile waits for
//     the loan (core/allocator.h), so the plan's figure holds under the cap;
//   * an output donated from an input the task frees (an in-place update) takes that input's
//     place instead of adding to it;
//   * an object read last by a task that reaches the disk (a swap out, core/disk_tasks.h: the
//     executor's I/O thread runs it beside the compute) stays live until the next task in the
//     order that does not, the compute the copy overlaps, has run too. RoleMeter, which counts
//     at each task's end, sees it freed earlier when the copy ends first (the measured peak is
//     then lower); and since the copies' timing is the drive's, two ready tasks may run in the
//     other order than the model's (a few scalars over it, seen on a loaded machine).
// So while a task runs, the live set is what was live before it plus its outputs, less the
// donated inputs it replaces, plus the scratch its kernel holds (TaskSpec::workspace_bytes,
// from OpDef::workspace: the CPU kernels'; GPU kernels' is not counted yet); the peak of a tier
// is the largest such sum. The role figures are the step's objects alone (RoleMeter's); the
// tiers' peaks and total_with_scratch_peak count the scratch too (RoleMeter's
// total_with_scratch_peak measures the same). Allocator slack comes on top.
//
// Tiers: an object lives on its TensorMeta's device: the device tier (a GPU's memory, or the
// simulated GPU's), the disk tier (a CPU worker's swap file: what the memory plan swapped out),
// else the host tier. Role figures count the device and host tiers (memory), not the disk.
//
// The order (SimulateWorkerOrders) is the in-process executor's with one slot per worker: ready
// tasks by priority, first ready first among equals (worker/in_process_executor.h), every task
// taking one unit of time, a collective's members finishing together once every member is
// ready and every collective before it in its channel's order has run on their workers (the
// runtime's order: planner/channel_order.h; before that round's task on their worker: they run
// beside it, off its slot), and
// objects reaching other workers at once (for the order; the memory counts them from the
// earliest they can come, above). Tasks that reach the disk take a round of their
// worker's slot like any other (the I/O thread runs them beside the compute: which of two ready
// tasks finishes first then follows the drive's speed too, so a swapping plan's figures are
// near the prediction, not exact). It is exact for one worker running one
// task at a time (a step on a one-thread executor); with more threads, independent ready tasks
// may overlap, and across workers the real durations may reorder what waits on another worker.
// A plan that relies on the figures fixes the order with control edges (TaskSpec::after).
//
// Thread safety: pure functions of their arguments.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/graph.h"
#include "core/ids.h"
#include "core/status.h"

namespace tessera {

enum class MemoryTier : uint8_t { kDevice, kHost, kDisk };
inline constexpr size_t kMemoryTiers = 3;
const char* MemoryTierName(MemoryTier tier);
// The tier an object of this meta lives in: the device tier off the host, else the host tier.
MemoryTier TierOf(const TensorMeta& meta);
// The tier a device's memory is: a CPU's the host tier, a GPU's the device tier, the disk's its own
// (a plan's compute tier: TierOf(plan.device)).
MemoryTier TierOf(const Device& device);

using RoleArray = std::array<int64_t, kObjectRoles>;

// The tasks one worker runs, in the order it runs them. Worker index: the workers in the order
// their first task appears in the graph (tasks without a pinned worker share one).
struct WorkerOrder {
  WorkerId worker;  // invalid: the tasks nobody pinned
  std::vector<TaskId> tasks;
};

// One object on one worker: live while tasks[first] .. tasks[last] run (positions in the
// worker's order). first is -1 for an object bound or received before the worker's first task;
// last is the order's size for an object kept after the step (a graph output).
struct ObjectLifetime {
  ObjectId object;
  int64_t bytes = 0;
  ObjectRole role = ObjectRole::kActivation;
  MemoryTier tier = MemoryTier::kHost;
  int first = -1, last = -1;
  bool received = false;  // produced on another worker, pushed here
  bool replaced = false;  // its last reader's output took over its buffer (donation)

  // The last position it is live during: a replaced object is not live during its last
  // reader's run (that reader's output holds its buffer). Below `first` when never live.
  int last_live() const { return replaced ? last - 1 : last; }
  bool LiveAt(int p) const { return first <= p && p <= last_live(); }
};

// A tier's peak on one worker: the bytes, the task at whose run it was reached, and what was
// live then, by role and by object (largest first).
struct TierPeak {
  MemoryTier tier = MemoryTier::kHost;
  int64_t bytes = 0;
  int position = -1;  // in the worker's order; -1: before the first task
  RoleArray by_role{};
  int64_t scratch = 0;  // the running task's kernel scratch (counted in bytes, not by_role)
  std::vector<ObjectId> live;
};

struct WorkerMemory {
  WorkerOrder order;
  std::vector<ObjectLifetime> objects;  // in object id order
  std::array<TierPeak, kMemoryTiers> peaks;
  // What RoleMeter reports for the step (RoleBytes): each role at its own peak, the largest
  // parameters + gradients + optimizer state, gathered parameters + gradient buckets, and the
  // largest total; in memory (the device and host tiers; not the disk's).
  RoleArray role_peaks{};
  int64_t model_state_peak = 0, transient_peak = 0, total_peak = 0;
  // The largest total with the running task's kernel scratch on top.
  int64_t total_with_scratch_peak = 0;
  // Per position in the order: live bytes per tier while that task runs (its scratch included).
  std::vector<std::array<int64_t, kMemoryTiers>> during;
  // Per position: the running task's kernel scratch per tier (on its device's; in `during`).
  std::vector<std::array<int64_t, kMemoryTiers>> scratch;
  // Bytes its tasks copy between tiers in a step (swaps, parameter uploads, gradient downloads:
  // every task reading an object of one tier and making one of another).
  int64_t tier_copy_bytes = 0;
};

struct MemoryProfile {
  std::vector<WorkerMemory> workers;  // by worker index
};

// Each worker's tasks in the order the executor would run them (see the header).
// InvalidArgument when the graph cannot finish (a cycle, a collective some member of which
// never becomes ready).
Result<std::vector<WorkerOrder>> SimulateWorkerOrders(const Graph& graph);

// The memory of each worker running `orders` (every task of the graph exactly once, each
// after what it waits for on its worker, else InvalidArgument naming the task).
Result<MemoryProfile> PredictMemory(const Graph& graph, const std::vector<WorkerOrder>& orders);
// The same with each task finishing at `finish_ms` (per task; a simulated step's: the orders
// should end their tasks in that time order, step_simulation.h's PredictTimedMemory): an object
// another worker produces arrives when its producer finishes, live there from the first task of
// the order that finishes after it (the one running then, else the next), not after a unit of
// time per task. A reader slower than its producer holds what piles up (a pipeline stage whose
// next stage sends its backward inputs faster than it takes them). InvalidArgument for orders
// PredictMemory refuses or not one time per task.
Result<MemoryProfile> PredictMemory(const Graph& graph, const std::vector<WorkerOrder>& orders,
                                    const std::vector<double>& finish_ms);
// SimulateWorkerOrders, then PredictMemory.
Result<MemoryProfile> PredictMemory(const Graph& graph);

// --explain-memory's text: per worker and tier, the predicted peak, the task it is reached at,
// what is live then by role and the largest objects, and a timeline of `timeline_points`
// positions (the peak's among them).
std::string ExplainMemory(const Graph& graph, const MemoryProfile& profile,
                          int timeline_points = 16);

}  // namespace tessera

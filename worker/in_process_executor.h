// InProcessExecutor: runs a task graph inside one process on a TBB arena.
//
// This is the single-worker runtime: the step graph a planner built runs here task by task,
// kernels from the op registry, objects as host tensors. The distributed runtime (scheduler +
// worker processes) will run the same graphs; this executor is also what each worker uses for
// its share of a graph.
//
// Lifecycle of a graph:
//   1. Prepare(graph) once: validates it, resolves every task's kernel, counts each object's
//      consumers and lists each task's dependents. A graph is registered once ...
//   2. Run(prepared, inputs) per step: ... and instantiated per step with new input objects.
//      A task starts when all its inputs exist; independent tasks run concurrently, and each
//      kernel parallelises inside the same arena. Every object that is not a graph output is
//      freed right after its last consumer finishes (reference counts), so a step's memory is
//      the live set of the schedule, not the sum of all objects.
//   3. Donation: when a task has an in-place pair (input i -> output j) and it is input i's last
//      consumer, and nothing outside the run holds input i's buffer (the caller moved it in, it
//      is not a graph output), output j takes over the buffer: no allocation, no copy. Otherwise
//      output j is allocated and initialised with a copy of input i, so kernels see the same
//      contents either way.
//
// Errors: the first failing task stops the run (no new tasks start; running ones finish) and
// Run returns that task's error prefixed with the task, layer and op. A missing or misshapen
// input binding is InvalidArgument naming the object.
//
// Late inputs (RunHooks): a worker running its part of a registered graph starts before the
// objects other workers produce have arrived; Provide delivers them as they come, and tasks that
// read them start then. on_produced hands out objects other workers need as soon as they exist.
//
// Thread safety: Run may be called from one thread at a time per executor; Provide and Cancel
// from any thread. The executor owns its arena and allocator; tensors it returns hold the
// allocator alive.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include <tbb/task_arena.h>

#include "core/allocator.h"
#include "core/device_runtime.h"
#include "core/graph.h"
#include "core/settings.h"
#include "core/status.h"
#include "core/tensor.h"
#include "ops/op_registry.h"
#include "worker/role_meter.h"

namespace tessera {

using ObjectMap = std::unordered_map<ObjectId, Tensor>;

struct ExecutorOptions {
  int threads = 0;  // 0: one per core
  int64_t gemm_split_min_flops = Settings{}.gemm_split_min_flops;
  bool cache_host_allocations = Settings{}.cache_host_allocations;
  // Host memory the executor's state may take (a trainer refuses a plan whose host-tier state
  // exceeds it, instead of the kernel's out-of-memory killer ending the process mid-step);
  // 0: what the machine has available (core/allocator.h's AvailableHostMemoryBytes).
  int64_t host_memory_bytes = 0;
  // The GPU the executor runs kCuda tasks on (worker/gpu.h's OpenGpu), or null. Inputs bound
  // as host tensors to objects that live on it are copied there when the run starts.
  std::shared_ptr<DeviceRuntime> device;

  static ExecutorOptions FromSettings(const Settings& settings);
};

// When a task ran, relative to the start of its run (RunStats::start_unix_us; for traces and
// per-layer timing). An offloaded task (a collective member) runs from when it was handed out
// until it was done, its wait for the communication stream included.
struct TaskTiming {
  TaskId task;
  double start_us = 0;
  double end_us = 0;
  int thread_slot = 0;  // TBB arena slot that ran it
};

struct RunStats {
  double wall_ms = 0;
  int64_t start_unix_us = 0;  // the run's start: system clock, microseconds since the Unix epoch
  int64_t peak_bytes = 0;     // max bytes live in this executor's allocator during the run
  int64_t device_peak_bytes = 0;  // max bytes live on the executor's GPU during the run (0: none)
  int64_t live_bytes_after = 0;
  int tasks_run = 0;
  int donations_taken = 0;          // in-place pairs that reused the input's buffer
  int donations_copied = 0;         // in-place pairs that had to copy
  RoleBytes role_bytes;             // the plan's objects by role (worker/role_meter.h)
  std::vector<TaskTiming> timings;  // one per task, in task-id order
};

struct RunResult {
  ObjectMap outputs;  // the graph's output objects
  RunStats stats;
};

// Extensions of a run for graphs split across processes (a worker's part of a registered graph).
struct RunHooks {
  // Graph inputs that are not bound at the start but arrive during the run through Provide
  // (objects produced by other workers). Tasks reading them wait for them.
  std::vector<ObjectId> late_inputs;
  // Objects to hand to `on_produced` as soon as their producer finishes (to send them to the
  // workers that need them), from the thread that produced them. The callback may keep the
  // tensor; the run never reuses a buffer someone else still holds.
  std::vector<ObjectId> watched;
  std::function<void(ObjectId, const Tensor&)> on_produced;
  // Called once the run accepts Provide (late inputs that arrived early can be handed over).
  std::function<void()> on_started;
  // Tasks run by someone else instead of a kernel (collective members, which the worker's
  // collective engine runs on its communicators): when such a task is ready, its outputs are
  // prepared (allocated; in-place outputs initialised, donated when possible) and `offload`
  // gets them with the inputs, on the thread that made the task ready. It must not block;
  // `done` (once, from any thread) finishes the task, which then releases its inputs and
  // starts its dependents like any other.
  using OffloadDone = std::function<void(const Status&)>;
  std::function<bool(const TaskSpec&)> offloaded;
  std::function<void(const TaskSpec&, std::vector<Tensor> inputs, std::vector<Tensor> outputs,
                     OffloadDone done)>
      offload;
  // Called once if the run fails, with the error, while offloaded tasks may still be out: the
  // owner should make them finish soon (abort their collectives). The run returns only after
  // every offloaded task is done.
  std::function<void(const Status&)> on_failed;
};

// A graph made ready to run repeatedly: resolved kernels and dependency structure.
class PreparedGraph {
 public:
  const Graph& graph() const { return *graph_; }

 private:
  friend class InProcessExecutor;
  std::shared_ptr<const Graph> graph_;
  std::vector<const KernelFn*> kernels_;           // per task index
  std::vector<std::vector<int>> dependents_;       // task index -> tasks reading its outputs
  std::vector<int> initial_pending_;               // task index -> number of produced inputs
  std::vector<int> initial_refcount_;              // object index -> number of input slots
  std::vector<bool> is_output_;                    // object index -> graph output
  std::vector<int> input_objects_;                 // object indices bound by the caller
  std::vector<std::vector<int>> input_consumers_;  // object index -> tasks reading it
};

class InProcessExecutor {
 public:
  // REQUIRES: registry outlives the executor.
  InProcessExecutor(const OpRegistry& registry, const ExecutorOptions& options);
  ~InProcessExecutor();

  // Validates the graph and resolves kernels (NotFound naming a task whose op has no CPU
  // kernel).
  Result<PreparedGraph> Prepare(Graph graph) const;

  // Runs one instance. `inputs` must bind every graph input with a tensor of its meta (except
  // hooks->late_inputs). On error, when `intact_inputs` is given, it receives the graph inputs
  // that no task had taken over to update in place (donation; tasks that only read an input
  // leave it intact), so a caller that moved its state in can take it back.
  Result<RunResult> Run(const PreparedGraph& prepared, ObjectMap inputs,
                        ObjectMap* intact_inputs = nullptr, const RunHooks* hooks = nullptr);
  // During a Run with late inputs, from any thread: delivers one (a host tensor for an object
  // on the GPU is copied there). InvalidArgument for an object that is not an awaited late input
  // or has the wrong shape or dtype; FailedPrecondition-like Unavailable when no run is in
  // progress.
  Status Provide(ObjectId id, Tensor tensor);
  // Makes the run in progress fail with `reason` (no new tasks start); a no-op when none runs.
  void Cancel(const Status& reason);

  // What the run in progress is doing, from any thread (tessera status --waits): the tasks whose
  // kernels run now and the late inputs it still waits for (graph-local ids). nullopt when no
  // run is in progress. Offloaded tasks are not listed: their host (the collective engine) says.
  struct RunActivity {
    std::vector<std::string> running;
    std::vector<ObjectId> awaited;
  };
  std::optional<RunActivity> Activity();

  // Allocator for tensors the caller creates for this executor (parameters, batches), so they
  // count toward the peak the executor reports.
  const std::shared_ptr<Allocator>& allocator() const { return allocator_; }
  const std::shared_ptr<DeviceRuntime>& device() const { return options_.device; }
  int threads() const { return threads_; }
  // A context for moving tensors between the host and this executor's GPU (task_runner.h's
  // MoveTo / HostCopyOf).
  KernelContext Copier() const { return {allocator_, 0, &registry_, options_.device.get()}; }

 private:
  const OpRegistry& registry_;
  ExecutorOptions options_;
  int threads_;
  std::shared_ptr<Allocator> allocator_;
  std::unique_ptr<tbb::task_arena> arena_;

  // The run in progress, for Provide and Cancel from other threads.
  struct ActiveRun;
  std::mutex active_mutex_;
  ActiveRun* active_ = nullptr;  // under active_mutex_
};

}  // namespace tessera

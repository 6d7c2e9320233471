// InProcessExecutor: runs task graphs inside one process on a TBB arena.
//
// This is the single-worker runtime: the step graph a planner built runs here task by task,
// kernels from the op registry, objects as host tensors. The distributed runtime (scheduler +
// worker processes) runs the same graphs: each worker's graph runner runs its part of every
// registered graph's instances on an executor.
//
// Lifecycle of a graph:
//   1. Prepare(graph) once: validates it, resolves every task's kernel, counts each object's
//      consumers and lists each task's dependents. A graph is registered once ...
//   2. Start(prepared, inputs, hooks, done) per instance: ... and instantiated per step with new
//      input objects, as a GraphExecution (worker/graph_run.h: binding, reference counts, donation,
//      late inputs, errors). Start returns at once; `done` says how the run ended. Any number
//      of runs may be in flight on one executor (different prepared graphs, or one twice).
//      Run(prepared, inputs) is Start and a wait for the end, for callers that run one step at
//      a time (the trainer's in-process backend).
//   3. Every object that is not a graph output is freed right after its last consumer finishes
//      (reference counts), so a step's memory is the live set of the schedule, not the sum of
//      all objects.
//
// Scheduling. The ready tasks of every run go through one queue, ordered by TaskSpec::priority
// (higher first) and first come, first served among equals; at most `threads` of them run at
// once, each on an arena thread that takes the next task from the queue when it is done (a
// "slot"). Kernels parallelise inside the same arena. Offloaded tasks (collective members, see
// RunHooks) take no slot, nor do I/O tasks: those that read or write an object on the disk tier
// (a swap to or from the swap file), which the executor's I/O thread runs one after another, so
// that a compute slot never sits waiting for the drive. The executor owns one thread besides TBB's
// workers: while a run is in flight it lends itself to the arena (which reserves it a slot), so
// runs get `threads` threads whoever started them, never more, and a synchronous Run's caller just
// waits. With one thread there are no TBB workers at all: the executor's thread runs every task in
// an arena of one and sleeps on a condition variable between them (TBB's workers spin and yield
// between tasks, taking a small machine's CPU from the processes that the next task waits on).
//
// Thread safety: every method may be called from any thread. Prepare is const and may run
// concurrently with runs. The executor owns its arena and allocator; tensors it returns hold the
// allocator alive.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include <tbb/task_arena.h>
#include <tbb/task_group.h>

#include "core/allocator.h"
#include "core/device_runtime.h"
#include "core/graph.h"
#include "core/settings.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/thread_annotations.h"
#include "ops/op_registry.h"
#include "worker/graph_run.h"

namespace tessera {

struct ExecutorOptions {
  int threads = 0;  // 0: one per core
  int64_t gemm_split_min_flops = Settings{}.gemm_split_min_flops;
  bool cache_host_allocations = Settings{}.cache_host_allocations;
  // With one thread: how long the executor's thread looks for the next task before it sleeps
  // (core/idle_spin.h).
  int64_t idle_spin_us = Settings{}.idle_spin_us;
  // Host memory the executor's state may take (a trainer refuses a plan whose host-tier state
  // exceeds it, instead of the kernel's out-of-memory killer ending the process mid-step);
  // 0: what the machine has available (core/allocator.h's AvailableHostMemoryBytes).
  int64_t host_memory_bytes = 0;
  // The GPU the executor runs kCuda tasks on (worker/gpu.h's OpenGpu), or null. Inputs bound
  // as host tensors to objects that live on it are copied there when the run starts.
  std::shared_ptr<DeviceRuntime> device;
  // The swap file (worker/swap_file.h) objects on the disk tier live in, or null (a plan that
  // swaps to the disk then fails at its first swap, naming --swap-dir).
  std::shared_ptr<DeviceRuntime> disk;
  // The host allocator for the executor's buffers, shared with whoever else gives it (a worker's
  // object store: one allocator, one count and one cap for the worker's host memory); null: one
  // of its own (caching as cache_host_allocations says).
  std::shared_ptr<Allocator> host_allocator;

  static ExecutorOptions FromSettings(const Settings& settings);
};

class InProcessExecutor {
 public:
  // REQUIRES: registry outlives the executor.
  InProcessExecutor(const OpRegistry& registry, const ExecutorOptions& options);
  // Cancels the runs still in flight and waits for them to end.
  // REQUIRES: their offloaded tasks end when on_failed says so.
  ~InProcessExecutor() noexcept;

  // Validates the graph and resolves kernels (NotFound naming a task whose op has no CPU
  // kernel).
  Result<PreparedGraph> Prepare(Graph graph) const;

  // Starts one instance and returns it at once; `done` gets its result (from whichever thread
  // ends it: maybe this one, before Start returns, when an input cannot be bound). `inputs` must
  // bind every graph input with a tensor of its meta, except hooks.late_inputs (InvalidArgument
  // naming the object otherwise). The run keeps itself alive until `done` returned.
  // REQUIRES: `prepared` (from this executor) outlives the run's end.
  std::shared_ptr<GraphExecution> Start(const PreparedGraph& prepared, ObjectMap inputs,
                                        RunHooks hooks, GraphExecution::Done done);

  // Start, then waits for the end: the result, or the first error. On error, when
  // `intact_inputs` is given, it receives the graph inputs that no task had taken over to update
  // in place (GraphExecution::Done), so a caller that moved its state in can take it back.
  Result<RunResult> Run(const PreparedGraph& prepared, ObjectMap inputs,
                        ObjectMap* intact_inputs = nullptr, const RunHooks* hooks = nullptr);

  // Conveniences for callers with one run in flight at a time (a synchronous Run on another
  // thread); with several, use the GraphExecution that Start returned.
  // Provide: GraphExecution::Provide of the run in flight that awaits `id` (Unavailable when no run
  // is in flight; InvalidArgument when none awaits it, or when several do).
  Status Provide(ObjectId id, Tensor tensor);
  // Cancels every run in flight.
  void Cancel(const Status& reason);
  // The activity of the oldest run in flight; nullopt when none is.
  using RunActivity = tessera::RunActivity;
  std::optional<RunActivity> Activity();

  // Allocator for tensors the caller creates for this executor (parameters, batches), so they
  // count toward the peak the executor reports.
  const std::shared_ptr<Allocator>& allocator() const { return allocator_; }
  const std::shared_ptr<DeviceRuntime>& device() const { return options_.device; }
  int threads() const { return threads_; }
  // A context for moving tensors between the host and this executor's GPU (task_runner.h's
  // MoveTo / HostCopyOf).
  KernelContext Copier() const {
    return {allocator_, 0, &registry_, options_.device.get(), options_.disk.get()};
  }

 private:
  friend class GraphExecution;

  // The ready tasks of every run: by priority (higher first), first in first out among equals.
  // Not thread-safe: under queue_mutex_.
  struct ReadyTask {
    GraphExecution* run = nullptr;  // alive while queued: its busy count holds it open
    int task = 0;
  };
  class ReadyQueue {
   public:
    void Push(GraphExecution* run, int task);
    bool Pop(ReadyTask* next);
    // Removes every task of `run`; returns how many.
    int Remove(const GraphExecution* run);
    size_t size() const { return size_; }

   private:
    std::map<int32_t, std::deque<ReadyTask>, std::greater<>> by_priority_;  // no empty entry
    size_t size_ = 0;
  };

  // For GraphExecution.
  const KernelContext& context() const { return context_; }
  // In flight (accepts the executor-level calls).
  void Register(GraphExecution* run) EXCLUDES(runs_mutex_);
  void Unregister(GraphExecution* run) EXCLUDES(runs_mutex_);  // ended
  // Queues ready tasks of `run` and starts slots for them.
  void Queue(GraphExecution* run, const std::vector<int>& tasks) EXCLUDES(queue_mutex_);
  // Takes `run`'s tasks out of the queue (it failed); returns how many.
  int Unqueue(const GraphExecution* run) EXCLUDES(queue_mutex_);

  // A slot: runs the best ready task, then the next, until the queue is empty.
  void SlotLoop();
  // Queues `ready` (of `finished`), then takes the next task for this slot; false (and the slot
  // is given up) when there is none.
  bool NextTask(GraphExecution* finished, const std::vector<int>& ready, ReadyTask* next)
      EXCLUDES(queue_mutex_);
  // Claims slots for queued tasks; returns how many to start.
  int ClaimSlots() REQUIRES(queue_mutex_);
  void StartSlots(int count);
  // The executor's own thread: in the arena while runs are in flight.
  void LendLoop() EXCLUDES(runs_mutex_);
  // With one thread, the executor's own thread instead: runs the slot whenever one is claimed.
  void SerialLoop() EXCLUDES(queue_mutex_);
  std::vector<std::shared_ptr<GraphExecution>> RunsInFlight() EXCLUDES(runs_mutex_);
  // For GraphExecution: runs `work` on the I/O thread (started on first use), after the I/O
  // work queued before it.
  void RunIo(std::function<void()> work) EXCLUDES(io_mutex_);
  void IoLoop() EXCLUDES(io_mutex_);

  const OpRegistry& registry_;
  ExecutorOptions options_;
  int threads_;
  std::shared_ptr<Allocator> allocator_;
  KernelContext context_;
  std::unique_ptr<tbb::task_arena> arena_;
  tbb::task_group slots_group_;  // every slot; waited for by the destructor

  Mutex queue_mutex_;
  ReadyQueue ready_ GUARDED_BY(queue_mutex_);
  int slots_busy_ GUARDED_BY(queue_mutex_) = 0;  // slots started and not given up
  CondVar queue_changed_;                        // a slot claimed, or stopping (one thread)
  bool serial_stopping_ GUARDED_BY(queue_mutex_) = false;

  Mutex runs_mutex_;
  CondVar runs_changed_;
  std::vector<GraphExecution*> runs_ GUARDED_BY(runs_mutex_);  // in flight, oldest first
  // Wakes the lending thread out of the arena when the last run ends.
  std::optional<tbb::task_handle> lend_wake_ GUARDED_BY(runs_mutex_);
  bool stopping_ GUARDED_BY(runs_mutex_) = false;
  std::thread lender_;

  Mutex io_mutex_;
  CondVar io_changed_;
  std::deque<std::function<void()>> io_queue_ GUARDED_BY(io_mutex_);
  bool io_stopping_ GUARDED_BY(io_mutex_) = false;
  std::thread io_thread_ GUARDED_BY(io_mutex_);
};

}  // namespace tessera

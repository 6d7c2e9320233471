// GraphExecution: one run (instance) of a prepared graph on an InProcessExecutor, as an object.
// (Not "GraphRun": scheduler/messages.h has a struct of that name, and both modules link into
// one binary.)
//
// A run owns everything one instance needs: an object slot per object of the graph, the pending
// count of every task (producers and late inputs it still waits for), the reference count of
// every object (the task inputs still to read it), the statistics, the role meter and timings,
// the offloaded tasks still out, and the first error. It is started by
// InProcessExecutor::Start, which returns it; the caller then talks to it (Provide, Cancel,
// Activity, Wait) and is told once, through `done`, how it ended.
//
// Steps of a run (the methods below are named after them):
//   1. Bind the inputs (checked against their metas; host tensors for GPU objects are copied
//      there) and count what every task waits for. A binding error ends the run at once, every
//      input handed back.
//   2. Start the ready tasks: a kernel task goes to the executor's ready queue (one queue for
//      every run on the executor, ordered by TaskSpec::priority, at most `threads` tasks at
//      once); an offloaded task (a collective member) is prepared and handed out on the thread
//      that made it ready, without taking one of those slots.
//   3. Run one task: its kernel, its outputs allocated first (in-place outputs take their
//      input's buffer when a donation is possible, else start as a copy).
//   4. Finish a task: publish its outputs, release its inputs (an object is freed after its
//      last reader unless it is a graph output), and start the dependents that became ready.
//   5. Late inputs (Provide) and cancels (Cancel) come from any thread while the run is on.
//   6. The run ends when every task ran, or when it failed and nothing of it runs any more (no
//      kernel, no offloaded task: on_failed tells the owner to end those first). Then the
//      result is collected (outputs and statistics, or the first error and the graph inputs
//      that are still intact) and `done` gets it.
//
// Thread safety: every public method may be called from any thread at any time, also after the
// run ended (Provide then says so). `done` and the hooks are called from the executor's threads
// or from the thread that called Provide/Cancel or completed an offloaded task, never under a
// lock of the run; `done` is called exactly once.
//
// Invariants: `busy_` counts what may still change the run (queued and running tasks, calls in
// progress); the run ends only when it is zero and no offloaded task is out, and nothing
// enters it afterwards. An object's slot is written once (by its producer, the binding or
// Provide) before its readers' pending counts reach zero, and cleared by its last reader.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/graph.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/thread_annotations.h"
#include "ops/op_registry.h"
#include "worker/role_meter.h"

namespace tessera {

class InProcessExecutor;

using ObjectMap = std::unordered_map<ObjectId, Tensor>;

// When a task ran, relative to the start of its run (RunStats::start_unix_us; for traces and
// per-layer timing). An offloaded task (a collective member) runs from when it was handed out
// until it was done, its wait for the communication stream included.
struct TaskTiming {
  TaskId task;
  double start_us = 0;
  double end_us = 0;
  int thread_slot = 0;  // TBB arena slot that ran it
  int64_t bytes = 0;    // a copy between tiers (host <-> device): the bytes it copied
};

// With several runs in flight on one executor the allocator figures (peaks, live bytes) are the
// executor's: they count every run in flight, from the start of the oldest.
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
  // workers that need them), from the thread that produced them, after the role meter has
  // counted that end (a peer's quick reply is counted after it). The callback may keep the
  // tensor; the run never reuses a buffer someone else still holds.
  std::vector<ObjectId> watched;
  std::function<void(ObjectId, const Tensor&)> on_produced;
  // Tasks run by someone else instead of a kernel (collective members, which the worker's
  // collective engine runs on its communicators): when such a task is ready, its outputs are
  // prepared (allocated; in-place outputs initialised, donated when possible) and `offload`
  // gets them with the inputs, on the thread that made the task ready. It must not block;
  // `done` (once, from any thread, also from inside `offload`) finishes the task, which then
  // releases its inputs and starts its dependents like any other.
  using OffloadDone = std::function<void(const Status&)>;
  std::function<bool(const TaskSpec&)> offloaded;
  std::function<void(const TaskSpec&, std::vector<Tensor> inputs, std::vector<Tensor> outputs,
                     OffloadDone done)>
      offload;
  // Per task index, the name errors and activity give it instead of the graph's own (an
  // instance's names for the tasks of a graph many instances share: a submitted task's own
  // name); empty: the graph's names.
  std::vector<std::string> task_names;
  // Called once if the run fails, with the error, once no kernel of the run runs any more but
  // offloaded tasks may still be out: the owner should make them finish soon (abort their
  // collectives). The run ends only after every offloaded task is done.
  std::function<void(const Status&)> on_failed;
};

// Graph-local ids count from 1; a prepared graph's per-task and per-object tables from 0.
inline int IndexOf(ObjectId id) { return static_cast<int>(id.value()) - 1; }
inline int IndexOf(TaskId id) { return static_cast<int>(id.value()) - 1; }

// A graph made ready to run repeatedly: resolved kernels and dependency structure. Read-only
// once prepared: any number of runs may use it at once.
class PreparedGraph {
 public:
  const Graph& graph() const { return *graph_; }

 private:
  friend class InProcessExecutor;
  friend class GraphExecution;
  std::shared_ptr<const Graph> graph_;
  std::vector<const KernelFn*> kernels_;               // per task index
  std::vector<std::vector<int>> dependents_;           // task index -> tasks reading its outputs
  std::vector<std::vector<TensorMeta>> output_metas_;  // task index -> its outputs' metas
  std::vector<bool> io_task_;  // task index -> reaches the disk (core/disk_tasks.h): I/O thread
  std::vector<int> initial_pending_;               // task index -> number of produced inputs
  std::vector<int> initial_refcount_;              // object index -> number of input slots
  std::vector<bool> is_output_;                    // object index -> graph output
  std::vector<int> input_objects_;                 // object indices bound by the caller
  std::vector<std::vector<int>> input_consumers_;  // object index -> tasks reading it
};

// What a run is doing (tessera status --waits): the tasks whose kernels run now and the late
// inputs it still waits for (graph-local ids). Offloaded tasks are not listed: their host (the
// collective engine) says.
struct RunActivity {
  std::vector<std::string> running;
  std::vector<ObjectId> awaited;
};

class GraphExecution : public std::enable_shared_from_this<GraphExecution> {
 private:
  struct Passkey {};  // only the executor constructs runs

 public:
  // How the run ended: its result, or its first error and then the graph inputs that no task
  // had taken over to update in place (tasks that only read an input leave it intact), so a
  // caller that moved its state in can take it back. After a binding error every input comes
  // back.
  using Done = std::function<void(Result<RunResult> result, ObjectMap intact_inputs)>;

  // REQUIRES: `prepared` and `executor` outlive the run's end (its `done`).
  GraphExecution(Passkey, InProcessExecutor& executor, const PreparedGraph& prepared,
                 RunHooks hooks, Done done);
  GraphExecution(const GraphExecution&) = delete;
  GraphExecution& operator=(const GraphExecution&) = delete;
  ~GraphExecution();

  // Delivers a late input (a host tensor for an object on the GPU is copied there); the tasks
  // reading it start when nothing else holds them back. InvalidArgument for an object that is
  // not an awaited late input (never one, or provided already) or has the wrong shape or dtype;
  // Unavailable once the run has ended.
  Status Provide(ObjectId id, Tensor tensor) EXCLUDES(mutex_);
  // Makes the run fail with `reason` (the first error wins): no new task starts, running ones
  // finish. A no-op once the run has ended.
  void Cancel(const Status& reason) EXCLUDES(mutex_);
  // What the run is doing now; empty once it has ended.
  RunActivity Activity() const EXCLUDES(mutex_);
  // Blocks until the run has ended and its `done` has returned.
  void Wait() EXCLUDES(mutex_);
  bool ended() const EXCLUDES(mutex_);

  const Graph& graph() const { return prepared_.graph(); }
  // Task t's name for this run's errors and activity: the hooks' override, else empty (the
  // graph's own).
  std::string_view NameOf(int t) const {
    return static_cast<size_t>(t) < hooks_.task_names.size()
               ? std::string_view(hooks_.task_names[static_cast<size_t>(t)])
               : std::string_view();
  }
  int32_t priority(int task) const { return prepared_.graph().tasks()[task].priority; }

 private:
  friend class InProcessExecutor;
  using Clock = std::chrono::steady_clock;

  // Step 1 (from InProcessExecutor::Start): binds `inputs`, then starts the ready tasks.
  void Begin(ObjectMap inputs);
  // Checks the late inputs and marks them and the watched objects.
  Status ReadHooks();
  Status BindInputs(ObjectMap& inputs);
  Status BindInput(int index, ObjectMap& inputs);
  // Ends a run that could not start: every input goes back.
  void Refuse(const Status& error, ObjectMap inputs) EXCLUDES(mutex_);
  void InitCounters() EXCLUDES(mutex_);
  std::vector<int> InitiallyReady() const;

  // Step 2: hands out the offloaded tasks among `ready` (the owner's, and the I/O tasks, to the
  // executor's I/O thread) and keeps the others in it, counted as busy (the caller queues them).
  void TakeReady(std::vector<int>& ready);
  // TakeReady, then into the executor's ready queue.
  void StartReady(std::vector<int> ready);
  bool Offloaded(int task) const;
  // Whether the task reads or writes an object on the disk tier (a swap).
  bool IoTask(int task) const;
  void Offload(int task) EXCLUDES(mutex_);
  void OffloadDone(int task, std::vector<Tensor>& outputs, const Status& status) EXCLUDES(mutex_);

  // Steps 3 and 4 (from the executor's slots): runs one task; `ready` gets its dependents that
  // became ready and are to be queued (already counted as busy).
  void RunTask(int task, std::vector<int>* ready);
  // `scratch`: the most its kernel held (TaskRunCounters::scratch_peak_bytes; 0 when unknown).
  void FinishTask(int task, std::vector<Tensor>& outputs, std::vector<int>* ready,
                  int64_t scratch = 0);
  // Whether a produced object is kept in its slot: something here reads it, or it is a graph
  // output (else it is dropped once made, after its push when a peer reads it).
  bool Kept(int object) const;
  // Releases one use of an object; frees it after its last use unless it is a graph output.
  // Returns whether it freed it.
  bool ReleaseObject(int object);
  // Whether input `input_index` of `task` may lend its buffer to an in-place output: this task
  // is its last reader and nothing outside the run holds its buffer (the slot and `in`, once
  // per use here, are the only references). Marks the object donated when it may.
  bool TakeDonation(const TaskSpec& task, const std::vector<Tensor>& in, int input_index);
  std::vector<Tensor> InputsOf(const TaskSpec& task) const;
  const std::vector<TensorMeta>& OutputMetasOf(int task) const;
  void StartTiming(int task);
  double MicrosSinceStart() const;

  // Step 5.
  Status Deliver(ObjectId id, Tensor tensor) EXCLUDES(mutex_);
  // Records the first error and stops the run starting tasks (its queued ones leave the
  // executor's queue). REQUIRES: the caller holds a busy count.
  void Fail(Status status) EXCLUDES(mutex_);
  // A task's failure; a refused allocation also says what the step's objects held then.
  void FailTask(Status status) EXCLUDES(mutex_);

  // Step 6. Enter takes a busy count unless the run has ended; Leave returns it, and the last
  // one out decides whether the run waits (late inputs, offloaded tasks), has failed (then
  // on_failed, once), or has ended.
  bool Enter() EXCLUDES(mutex_);
  void Leave() EXCLUDES(mutex_);
  void End() EXCLUDES(mutex_);
  RunResult CollectResult();
  ObjectMap CollectIntactInputs();

  InProcessExecutor& executor_;
  const PreparedGraph& prepared_;
  const RunHooks hooks_;
  Done done_;
  std::shared_ptr<GraphExecution> self_;  // the run keeps itself alive until it has ended

  const int num_tasks_;
  const int num_objects_;
  std::vector<bool> late_;     // object index -> bound late (Provide)
  std::vector<bool> watched_;  // object index -> handed to on_produced

  // Object slots: written once by the producer (or the binding, or Provide), read by consumers
  // after the producer finished (ordered by the pending counters), cleared by the last consumer.
  std::vector<Tensor> slots_;
  std::unique_ptr<std::atomic<int>[]> pending_;          // task index -> inputs and tasks not done
  std::unique_ptr<std::atomic<int>[]> refcount_;         // object index -> reads still to come
  std::unique_ptr<std::atomic<bool>[]> donated_;         // object index -> taken over in place
  std::unique_ptr<std::atomic<bool>[]> kernel_running_;  // task index (for Activity)

  RunStats stats_;
  RoleMeter meter_;
  Clock::time_point start_;
  std::atomic<int> tasks_run_{0};
  std::atomic<int> donations_taken_{0};
  std::atomic<int> donations_copied_{0};
  std::atomic<bool> failed_{false};
  std::atomic<int> busy_{0};

  mutable Mutex mutex_;
  CondVar ended_changed_;  // done_returned_ became true
  Status first_error_ GUARDED_BY(mutex_);
  // Object index -> a late input not provided yet.
  std::vector<bool> awaited_ GUARDED_BY(mutex_);
  int awaited_count_ GUARDED_BY(mutex_) = 0;
  int offloads_ GUARDED_BY(mutex_) = 0;  // offloaded tasks out
  bool on_failed_called_ GUARDED_BY(mutex_) = false;
  bool ended_ GUARDED_BY(mutex_) = false;  // nothing enters any more
  bool done_returned_ GUARDED_BY(mutex_) = false;
};

}  // namespace tessera

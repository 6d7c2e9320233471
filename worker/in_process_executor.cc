#include "worker/in_process_executor.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "core/disk_tasks.h"
#include "core/idle_spin.h"
#include "core/logging.h"
#include "worker/task_runner.h"

namespace tessera {

ExecutorOptions ExecutorOptions::FromSettings(const Settings& settings) {
  ExecutorOptions options;
  options.threads = static_cast<int>(settings.cpu_threads);
  options.gemm_split_min_flops = settings.gemm_split_min_flops;
  options.cache_host_allocations = settings.cache_host_allocations;
  options.idle_spin_us = settings.idle_spin_us;
  return options;
}

InProcessExecutor::InProcessExecutor(const OpRegistry& registry, const ExecutorOptions& options)
    : registry_(registry), options_(options) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads_ = options.threads > 0 ? options.threads : cores;
  if (options.host_allocator != nullptr) {
    allocator_ = options.host_allocator;
  } else if (options.cache_host_allocations) {
    allocator_ = std::make_shared<CachingHostAllocator>();
  } else {
    allocator_ = std::make_shared<AlignedHostAllocator>();
  }
  context_ = KernelContext{allocator_, options_.gemm_split_min_flops, &registry_,
                           options_.device.get(), options_.disk.get()};
  if (threads_ == 1) {
    // One thread: the executor's own runs every task, inside an arena of one slot reserved for
    // it, so kernels' parallel loops run serially there and no TBB worker ever joins (nothing is
    // enqueued). It sleeps on queue_changed_ when nothing is ready: TBB's workers spin and
    // yield between tasks, which on a machine with few cores takes the CPU from the processes
    // the next task waits on (the scheduler, the driver).
    arena_ = std::make_unique<tbb::task_arena>(1, /*reserved_for_masters=*/1);
    arena_->initialize();
    lender_ = std::thread([this] { arena_->execute([this] { SerialLoop(); }); });
    return;
  }
  // One slot reserved for an outside thread, the lending thread's.
  arena_ = std::make_unique<tbb::task_arena>(threads_, /*reserved_for_masters=*/1);
  // Initialized here, before the lending thread exists: left lazy, the lending thread's first
  // execute and a caller's first enqueue both initialize it, and TSan saw TBB's process-wide
  // affinity mask written by one while the other read it.
  arena_->initialize();
  lender_ = std::thread([this] { LendLoop(); });
}

InProcessExecutor::~InProcessExecutor() noexcept {
  Cancel(Cancelled("the executor is being destroyed"));
  {
    MutexLock lock(&runs_mutex_);
    while (!runs_.empty()) runs_changed_.Wait(&runs_mutex_);
    stopping_ = true;
  }
  runs_changed_.NotifyAll();
  {
    MutexLock lock(&queue_mutex_);
    serial_stopping_ = true;
  }
  queue_changed_.NotifyAll();
  lender_.join();
  arena_->execute([this] { slots_group_.wait(); });
  std::thread io_thread;
  {
    MutexLock lock(&io_mutex_);
    io_stopping_ = true;  // no run is in flight: nothing is queued
    io_thread = std::move(io_thread_);
  }
  io_changed_.NotifyAll();
  if (io_thread.joinable()) io_thread.join();
}

void InProcessExecutor::RunIo(std::function<void()> work) {
  {
    MutexLock lock(&io_mutex_);
    io_queue_.push_back(std::move(work));
    if (!io_thread_.joinable()) io_thread_ = std::thread([this] { IoLoop(); });
  }
  io_changed_.NotifyOne();
}

void InProcessExecutor::IoLoop() {
  while (true) {
    std::function<void()> work;
    {
      MutexLock lock(&io_mutex_);
      while (io_queue_.empty() && !io_stopping_) io_changed_.Wait(&io_mutex_);
      if (io_queue_.empty()) return;
      work = std::move(io_queue_.front());
      io_queue_.pop_front();
    }
    work();
  }
}

Result<PreparedGraph> InProcessExecutor::Prepare(Graph graph) const {
  TESSERA_RETURN_IF_ERROR(graph.Validate());
  PreparedGraph prepared;
  const int num_tasks = graph.num_tasks();
  const int num_objects = graph.num_objects();
  prepared.kernels_.resize(num_tasks);
  prepared.dependents_.resize(num_tasks);
  prepared.output_metas_.resize(num_tasks);
  prepared.io_task_.assign(num_tasks, false);
  prepared.initial_pending_.assign(num_tasks, 0);
  prepared.initial_refcount_.assign(num_objects, 0);
  prepared.is_output_.assign(num_objects, false);
  prepared.input_consumers_.resize(num_objects);
  for (ObjectId output : graph.OutputObjects()) prepared.is_output_[IndexOf(output)] = true;
  for (ObjectId input : graph.InputObjects()) prepared.input_objects_.push_back(IndexOf(input));

  for (const TaskSpec& task : graph.tasks()) {
    const int t = IndexOf(task.id);
    Result<const KernelFn*> kernel = registry_.FindKernel(task.op, task.device_kind);
    if (!kernel.ok()) return kernel.status().WithContext(TaskContext(task));
    prepared.kernels_[t] = *kernel;
    prepared.io_task_[t] = TouchesDisk(graph, task);
    for (ObjectId output : task.outputs) {
      prepared.output_metas_[t].push_back(graph.object(output).meta);
    }
    for (ObjectId input : task.inputs) {
      ++prepared.initial_refcount_[IndexOf(input)];
      prepared.input_consumers_[IndexOf(input)].push_back(t);
      const TaskId producer = graph.object(input).producer;
      if (producer.valid()) {
        ++prepared.initial_pending_[t];
        prepared.dependents_[IndexOf(producer)].push_back(t);
      }
    }
    for (TaskId earlier : task.after) {
      ++prepared.initial_pending_[t];
      prepared.dependents_[IndexOf(earlier)].push_back(t);
    }
  }
  prepared.graph_ = std::make_shared<const Graph>(std::move(graph));
  return prepared;
}

std::shared_ptr<GraphExecution> InProcessExecutor::Start(const PreparedGraph& prepared,
                                                         ObjectMap inputs, RunHooks hooks,
                                                         GraphExecution::Done done) {
  auto run = std::make_shared<GraphExecution>(GraphExecution::Passkey{}, *this, prepared,
                                              std::move(hooks), std::move(done));
  run->Begin(std::move(inputs));
  return run;
}

Result<RunResult> InProcessExecutor::Run(const PreparedGraph& prepared, ObjectMap inputs,
                                         ObjectMap* intact_inputs, const RunHooks* hooks) {
  std::optional<Result<RunResult>> result;
  std::shared_ptr<GraphExecution> run =
      Start(prepared, std::move(inputs), hooks != nullptr ? *hooks : RunHooks{},
            [&result, intact_inputs](Result<RunResult> outcome, ObjectMap intact) {
              if (intact_inputs != nullptr) intact_inputs->merge(intact);
              result = std::move(outcome);
            });
  run->Wait();  // until `done` returned
  TESSERA_CHECK(result.has_value(), "a run ended without calling its `done`");
  return *std::move(result);
}

std::vector<std::shared_ptr<GraphExecution>> InProcessExecutor::RunsInFlight() {
  MutexLock lock(&runs_mutex_);
  std::vector<std::shared_ptr<GraphExecution>> runs;
  runs.reserve(runs_.size());
  // Registered runs are alive: they unregister before they let go of themselves.
  for (GraphExecution* run : runs_) runs.push_back(run->shared_from_this());
  return runs;
}

Status InProcessExecutor::Provide(ObjectId id, Tensor tensor) {
  std::vector<std::shared_ptr<GraphExecution>> runs = RunsInFlight();
  if (runs.empty()) return Unavailable("no run is waiting for {}", id.ToString());
  std::vector<std::shared_ptr<GraphExecution>> waiting;
  for (const std::shared_ptr<GraphExecution>& run : runs) {
    const std::vector<ObjectId> awaited = run->Activity().awaited;
    if (std::find(awaited.begin(), awaited.end(), id) != awaited.end()) waiting.push_back(run);
  }
  if (waiting.size() > 1) {
    return InvalidArgument(
        "{} runs in flight await {}: provide it through the run (GraphExecution)", waiting.size(),
        id.ToString());
  }
  // None awaits it: the run's own answer says why (runs.front() when there is one run).
  return (waiting.empty() ? runs.front() : waiting.front())->Provide(id, std::move(tensor));
}

void InProcessExecutor::Cancel(const Status& reason) {
  for (const std::shared_ptr<GraphExecution>& run : RunsInFlight()) run->Cancel(reason);
}

std::optional<InProcessExecutor::RunActivity> InProcessExecutor::Activity() {
  std::vector<std::shared_ptr<GraphExecution>> runs = RunsInFlight();
  if (runs.empty()) return std::nullopt;
  return runs.front()->Activity();
}

void InProcessExecutor::Register(GraphExecution* run) {
  {
    MutexLock lock(&runs_mutex_);
    if (runs_.empty()) {
      // Peaks from the start of the oldest run in flight (one run at a time: of that run).
      allocator_->ResetPeak();
      if (options_.device != nullptr) options_.device->allocator()->ResetPeak();
    }
    runs_.push_back(run);
  }
  runs_changed_.NotifyAll();
}

void InProcessExecutor::Unregister(GraphExecution* run) {
  {
    MutexLock lock(&runs_mutex_);
    runs_.erase(std::find(runs_.begin(), runs_.end(), run));
    if (runs_.empty() && lend_wake_.has_value()) {
      arena_->enqueue(std::move(*lend_wake_));  // the lending thread leaves the arena
      lend_wake_.reset();
    }
  }
  runs_changed_.NotifyAll();
}

void InProcessExecutor::LendLoop() {
  MutexLock lock(&runs_mutex_);
  while (true) {
    while (!stopping_ && runs_.empty()) runs_changed_.Wait(&runs_mutex_);
    if (stopping_) return;
    // In the arena until the last run in flight ends: this thread takes slots like TBB's
    // workers and helps kernels' parallel loops; it sleeps there when nothing is ready.
    tbb::task_group lending;
    lend_wake_ = lending.defer([] {});
    lock.Unlock();
    arena_->execute([&lending] { lending.wait(); });
    lock.Lock();
  }
}

void InProcessExecutor::ReadyQueue::Push(GraphExecution* run, int task) {
  by_priority_[run->priority(task)].push_back(ReadyTask{run, task});
  ++size_;
}

bool InProcessExecutor::ReadyQueue::Pop(ReadyTask* next) {
  if (by_priority_.empty()) return false;
  auto best = by_priority_.begin();
  *next = best->second.front();
  best->second.pop_front();
  if (best->second.empty()) by_priority_.erase(best);
  --size_;
  return true;
}

int InProcessExecutor::ReadyQueue::Remove(const GraphExecution* run) {
  int removed = 0;
  for (auto it = by_priority_.begin(); it != by_priority_.end();) {
    removed += static_cast<int>(
        std::erase_if(it->second, [run](const ReadyTask& task) { return task.run == run; }));
    it = it->second.empty() ? by_priority_.erase(it) : std::next(it);
  }
  size_ -= static_cast<size_t>(removed);
  return removed;
}

void InProcessExecutor::Queue(GraphExecution* run, const std::vector<int>& tasks) {
  if (tasks.empty()) return;
  int start;
  {
    MutexLock lock(&queue_mutex_);
    for (int task : tasks) ready_.Push(run, task);
    start = ClaimSlots();
  }
  StartSlots(start);
}

void InProcessExecutor::SerialLoop() {
  IdleSpinner spinner(std::chrono::microseconds(options_.idle_spin_us));
  while (true) {
    const bool found = spinner.Spin([this] {
      MutexLock lock(&queue_mutex_);
      return slots_busy_ > 0 || serial_stopping_;
    });
    {
      MutexLock lock(&queue_mutex_);
      // A claimed slot (ClaimSlots in Queue) is this thread's to run.
      while (!serial_stopping_ && slots_busy_ == 0) queue_changed_.Wait(&queue_mutex_);
      if (slots_busy_ == 0) return;  // stopping, nothing claimed
    }
    if (!found) spinner.Woke();
    SlotLoop();
  }
}

int InProcessExecutor::Unqueue(const GraphExecution* run) {
  MutexLock lock(&queue_mutex_);
  return ready_.Remove(run);
}

int InProcessExecutor::ClaimSlots() {
  const int count = std::min(static_cast<int>(ready_.size()), threads_ - slots_busy_);
  if (count <= 0) return 0;
  slots_busy_ += count;
  return count;
}

void InProcessExecutor::StartSlots(int count) {
  if (count <= 0) return;
  if (threads_ == 1) {  // the executor's own thread runs the one slot (SerialLoop)
    queue_changed_.NotifyOne();
    return;
  }
  // Enqueued, not spawned: a thread waiting inside a kernel's parallel loop does not take them
  // (TBB runs enqueued tasks only at a thread's outermost level), so a slot never runs nested
  // inside another task's kernel.
  for (int i = 0; i < count; ++i) arena_->enqueue(slots_group_.defer([this] { SlotLoop(); }));
}

bool InProcessExecutor::NextTask(GraphExecution* finished, const std::vector<int>& ready,
                                 ReadyTask* next) {
  bool taken;
  int start;
  {
    MutexLock lock(&queue_mutex_);
    for (int task : ready) ready_.Push(finished, task);
    taken = ready_.Pop(next);
    if (!taken) --slots_busy_;
    start = ClaimSlots();
  }
  StartSlots(start);
  return taken;
}

void InProcessExecutor::SlotLoop() {
  ReadyTask current;
  if (!NextTask(nullptr, {}, &current)) return;
  std::vector<int> ready;
  while (true) {
    ready.clear();
    try {  // kernels' exceptions are Statuses already (RunTaskKernel): this is a bug
      current.run->RunTask(current.task, &ready);
    } catch (const std::exception& e) {
      TESSERA_CHECK(false, "task {} of a run threw outside its kernel: {}", current.task, e.what());
    }
    GraphExecution* finished = current.run;
    const bool more = NextTask(finished, ready, &current);
    finished->Leave();  // after its ready dependents are queued (they keep it busy)
    if (!more) return;
  }
}

}  // namespace tessera

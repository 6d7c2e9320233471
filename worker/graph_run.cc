#include "worker/graph_run.h"

#include <algorithm>

#include <tbb/task_arena.h>

#include "core/timeline.h"
#include "worker/in_process_executor.h"
#include "worker/task_runner.h"

namespace tessera {

GraphExecution::GraphExecution(Passkey, InProcessExecutor& executor, const PreparedGraph& prepared,
                               RunHooks hooks, Done done)
    : executor_(executor),
      prepared_(prepared),
      hooks_(std::move(hooks)),
      done_(std::move(done)),
      num_tasks_(prepared.graph().num_tasks()),
      num_objects_(prepared.graph().num_objects()),
      late_(static_cast<size_t>(num_objects_), false),
      watched_(static_cast<size_t>(num_objects_), false),
      slots_(static_cast<size_t>(num_objects_)) {}

GraphExecution::~GraphExecution() = default;

// ---- Step 1: binding and the first ready tasks ----

void GraphExecution::Begin(ObjectMap inputs) {
  Status bound = ReadHooks();
  if (bound.ok()) bound = BindInputs(inputs);
  if (!bound.ok()) return Refuse(bound, std::move(inputs));
  inputs.clear();
  InitCounters();
  const std::vector<int> ready = InitiallyReady();
  self_ = shared_from_this();
  busy_.store(1);  // this call, until the first tasks are out
  start_ = Clock::now();
  stats_.start_unix_us = SystemMicrosNow();
  executor_.Register(this);  // from here on Provide and Cancel may come from other threads
  StartReady(ready);
  Leave();
}

Status GraphExecution::ReadHooks() {
  for (ObjectId id : hooks_.late_inputs) {
    if (!id.valid() || IndexOf(id) >= num_objects_ || graph().object(id).producer.valid()) {
      return InvalidArgument("late input {} is not an input of the graph", id.ToString());
    }
    late_[static_cast<size_t>(IndexOf(id))] = true;
  }
  for (ObjectId id : hooks_.watched) {
    if (id.valid() && IndexOf(id) < num_objects_) watched_[static_cast<size_t>(IndexOf(id))] = true;
  }
  return Status::Ok();
}

Status GraphExecution::BindInputs(ObjectMap& inputs) {
  for (int index : prepared_.input_objects_) {
    if (late_[static_cast<size_t>(index)]) continue;
    TESSERA_RETURN_IF_ERROR(BindInput(index, inputs));
  }
  return Status::Ok();
}

Status GraphExecution::BindInput(int index, ObjectMap& inputs) {
  const ObjectSpec& spec = graph().objects()[static_cast<size_t>(index)];
  auto it = inputs.find(spec.id);
  if (it == inputs.end() || !it->second.defined()) {
    return InvalidArgument("graph input '{}' ({}) is not bound", spec.name, spec.meta.ToString());
  }
  const TensorMeta& bound = it->second.meta();
  if (bound.shape != spec.meta.shape || bound.dtype != spec.meta.dtype) {
    return InvalidArgument("graph input '{}' is bound to {} but the graph expects {}", spec.name,
                           bound.ToString(), spec.meta.ToString());
  }
  if (bound.device.kind != spec.meta.device.kind) {  // e.g. a host batch for a GPU graph
    Result<Tensor> moved = MoveTo(spec.meta, it->second, executor_.Copier());
    if (!moved.ok()) return moved.status().WithContext(fmt::format("graph input '{}'", spec.name));
    it->second = *std::move(moved);
  }
  slots_[static_cast<size_t>(index)] = std::move(it->second);
  inputs.erase(it);
  return Status::Ok();
}

void GraphExecution::Refuse(const Status& error, ObjectMap inputs) {
  // Nothing ran: every input goes back, bound or not.
  ObjectMap intact;
  for (int index : prepared_.input_objects_) {
    Tensor& slot = slots_[static_cast<size_t>(index)];
    if (slot.defined()) {
      intact.emplace(graph().objects()[static_cast<size_t>(index)].id, std::move(slot));
    }
  }
  slots_.clear();
  intact.merge(inputs);  // and those never bound
  {
    MutexLock lock(&mutex_);
    ended_ = true;
  }
  Done done = std::move(done_);
  if (done) done(error, std::move(intact));
  {
    MutexLock lock(&mutex_);
    done_returned_ = true;
  }
  ended_changed_.NotifyAll();
}

void GraphExecution::InitCounters() {
  pending_.reset(new std::atomic<int>[static_cast<size_t>(num_tasks_)]);
  for (int t = 0; t < num_tasks_; ++t) pending_[t].store(prepared_.initial_pending_[t]);
  refcount_.reset(new std::atomic<int>[static_cast<size_t>(num_objects_)]);
  donated_.reset(new std::atomic<bool>[static_cast<size_t>(num_objects_)]);
  for (int o = 0; o < num_objects_; ++o) {
    refcount_[o].store(prepared_.initial_refcount_[o]);
    donated_[o].store(false);
  }
  kernel_running_.reset(new std::atomic<bool>[static_cast<size_t>(num_tasks_)]);
  for (int t = 0; t < num_tasks_; ++t) kernel_running_[t].store(false);
  {
    // Before the run is registered nothing else reads these; the lock is for the analysis.
    MutexLock lock(&mutex_);
    awaited_ = late_;
    awaited_count_ = static_cast<int>(std::count(late_.begin(), late_.end(), true));
  }
  for (int index = 0; index < num_objects_; ++index) {
    if (!late_[static_cast<size_t>(index)]) continue;
    for (int consumer : prepared_.input_consumers_[static_cast<size_t>(index)]) {
      ++pending_[consumer];
    }
  }
  for (int index : prepared_.input_objects_) {
    if (late_[static_cast<size_t>(index)]) continue;
    const ObjectSpec& spec = graph().objects()[static_cast<size_t>(index)];
    meter_.Add(spec.role, spec.meta.bytes());
  }
  stats_.timings.resize(static_cast<size_t>(num_tasks_));
}

std::vector<int> GraphExecution::InitiallyReady() const {
  // Collected before any starts: a running task decrements its dependents' counters, and a
  // dependent reaching zero is started by that task, not here.
  std::vector<int> ready;
  for (int t = 0; t < num_tasks_; ++t) {
    if (pending_[t].load() == 0) ready.push_back(t);
  }
  return ready;
}

// ---- Step 2: starting ready tasks ----

bool GraphExecution::Offloaded(int task) const {
  return IoTask(task) ||
         (hooks_.offloaded && hooks_.offloaded(graph().tasks()[static_cast<size_t>(task)]));
}

bool GraphExecution::IoTask(int task) const {
  return prepared_.io_task_[static_cast<size_t>(task)];
}

void GraphExecution::TakeReady(std::vector<int>& ready) {
  if (failed_.load()) {
    ready.clear();  // a failed run starts nothing
    return;
  }
  size_t kept = 0;
  for (int task : ready) {
    if (Offloaded(task)) {
      Offload(task);  // on this thread, without a slot
    } else {
      ready[kept++] = task;
    }
  }
  ready.resize(kept);
  busy_.fetch_add(static_cast<int>(kept));
}

void GraphExecution::StartReady(std::vector<int> ready) {
  TakeReady(ready);
  executor_.Queue(this, ready);
}

void GraphExecution::Offload(int t) {
  const TaskSpec& task = graph().tasks()[static_cast<size_t>(t)];
  if (IoTask(t)) {
    {
      MutexLock lock(&mutex_);
      ++offloads_;
    }
    // Prepared and run on the I/O thread: its queue's wait is not the task's time.
    executor_.RunIo([run = shared_from_this(), t, &task] {
      run->StartTiming(t);
      run->stats_.timings[static_cast<size_t>(t)].thread_slot = run->executor_.threads();
      std::vector<Tensor> in = run->InputsOf(task);
      TaskRunCounters counters;
      Result<std::vector<Tensor>> outputs = RunTaskKernel(
          *run->prepared_.kernels_[static_cast<size_t>(t)], task, in, run->OutputMetasOf(t),
          run->executor_.context(), [](int) { return false; }, &counters, run->NameOf(t));
      in.clear();  // our references go before the inputs are released
      const Status status = outputs.status();
      std::vector<Tensor> made = outputs.ok() ? *std::move(outputs) : std::vector<Tensor>();
      run->OffloadDone(t, made, status);
    });
    return;
  }
  StartTiming(t);
  std::vector<Tensor> in = InputsOf(task);
  TaskRunCounters counters;
  Result<std::vector<Tensor>> outputs = PrepareTaskOutputs(
      task, in, OutputMetasOf(t), executor_.context(),
      [&](int input_index) { return TakeDonation(task, in, input_index); }, &counters, NameOf(t));
  donations_taken_ += counters.donations_taken;
  donations_copied_ += counters.donations_copied;
  if (!outputs.ok()) return FailTask(outputs.status());
  {
    MutexLock lock(&mutex_);
    ++offloads_;
  }
  // The run stays busy (this call) until `offload` returned: on_failed, which ends the
  // offloaded work, never comes before the work was handed out.
  auto shared_outputs = std::make_shared<std::vector<Tensor>>(*outputs);
  hooks_.offload(task, std::move(in), *std::move(outputs),
                 [run = shared_from_this(), t, shared_outputs](const Status& status) {
                   run->OffloadDone(t, *shared_outputs, status);
                 });
}

void GraphExecution::OffloadDone(int t, std::vector<Tensor>& outputs, const Status& status) {
  const bool entered = Enter();
  TESSERA_CHECK(entered, "a run ended with an offloaded task out");
  std::vector<int> ready;
  if (!status.ok()) {
    // The I/O thread's errors come from RunTaskKernel, which names the task already.
    Fail(IoTask(t)
             ? status
             : status.WithContext(TaskContext(graph().tasks()[static_cast<size_t>(t)], NameOf(t))));
  } else if (!failed_.load()) {
    FinishTask(t, outputs, &ready);
  }
  outputs.clear();
  executor_.Queue(this, ready);
  {
    MutexLock lock(&mutex_);
    --offloads_;
  }
  Leave();
}

// ---- Steps 3 and 4: running and finishing tasks ----

std::vector<Tensor> GraphExecution::InputsOf(const TaskSpec& task) const {
  std::vector<Tensor> in;
  in.reserve(task.inputs.size());
  for (ObjectId input : task.inputs) in.push_back(slots_[static_cast<size_t>(IndexOf(input))]);
  return in;
}

const std::vector<TensorMeta>& GraphExecution::OutputMetasOf(int task) const {
  return prepared_.output_metas_[static_cast<size_t>(task)];
}

double GraphExecution::MicrosSinceStart() const {
  return std::chrono::duration<double, std::micro>(Clock::now() - start_).count();
}

void GraphExecution::StartTiming(int t) {
  TaskTiming& timing = stats_.timings[static_cast<size_t>(t)];
  timing.task = graph().tasks()[static_cast<size_t>(t)].id;
  timing.start_us = MicrosSinceStart();
  timing.thread_slot = tbb::this_task_arena::current_thread_index();
}

void GraphExecution::RunTask(int t, std::vector<int>* ready) {
  if (failed_.load()) return;
  const TaskSpec& task = graph().tasks()[static_cast<size_t>(t)];
  StartTiming(t);
  std::vector<Tensor> in = InputsOf(task);
  TaskRunCounters counters;
  kernel_running_[t].store(true, std::memory_order_relaxed);
  Result<std::vector<Tensor>> ran = RunTaskKernel(
      *prepared_.kernels_[static_cast<size_t>(t)], task, in, OutputMetasOf(t), executor_.context(),
      [&](int input_index) { return TakeDonation(task, in, input_index); }, &counters, NameOf(t));
  kernel_running_[t].store(false, std::memory_order_relaxed);
  donations_taken_ += counters.donations_taken;
  donations_copied_ += counters.donations_copied;
  in.clear();  // drop our references before releasing inputs
  if (!ran.ok()) return FailTask(ran.status());
  FinishTask(t, *ran, ready, counters.scratch_peak_bytes);
}

bool GraphExecution::TakeDonation(const TaskSpec& task, const std::vector<Tensor>& in,
                                  int input_index) {
  const int object = IndexOf(task.inputs[static_cast<size_t>(input_index)]);
  int uses_here = 0;
  for (ObjectId input : task.inputs) uses_here += IndexOf(input) == object;
  const bool donate = !prepared_.is_output_[static_cast<size_t>(object)] &&
                      refcount_[object].load() == uses_here &&
                      in[static_cast<size_t>(input_index)].buffer().use_count() == 1 + uses_here;
  if (donate) donated_[object].store(true);
  return donate;
}

bool GraphExecution::Kept(int object) const {
  return prepared_.initial_refcount_[static_cast<size_t>(object)] > 0 ||
         prepared_.is_output_[static_cast<size_t>(object)];
}

bool GraphExecution::ReleaseObject(int object) {
  if (refcount_[object].fetch_sub(1) == 1 && !prepared_.is_output_[static_cast<size_t>(object)]) {
    slots_[static_cast<size_t>(object)] = Tensor();
    return true;
  }
  return false;
}

namespace {

// What an object takes in memory (the role meter's figures): nothing on the disk tier.
int64_t InMemoryBytes(const ObjectSpec& spec) {
  return spec.meta.device.kind == DeviceKind::kDisk ? 0 : spec.meta.bytes();
}

}  // namespace

void GraphExecution::FinishTask(int t, std::vector<Tensor>& out, std::vector<int>* ready,
                                int64_t scratch) {
  const TaskSpec& task = graph().tasks()[static_cast<size_t>(t)];
  RoleMeter::Change change;
  change.scratch = scratch;
  TaskTiming& timing = stats_.timings[static_cast<size_t>(t)];
  const bool from_host =
      !task.inputs.empty() && graph().object(task.inputs[0]).meta.device.is_cpu();
  for (size_t j = 0; j < out.size(); ++j) {
    const int object = IndexOf(task.outputs[j]);
    const ObjectSpec& spec = graph().objects()[static_cast<size_t>(object)];
    const int64_t bytes = InMemoryBytes(spec);
    change.Add(spec.role, bytes);
    // A transfer between tiers: what it copied, as made (core/timeline.h span bytes).
    if (!task.inputs.empty() && out[j].defined() && out[j].meta().device.is_cpu() != from_host) {
      timing.bytes += out[j].meta().bytes();
    }
    if (!Kept(object)) change.Free(spec.role, bytes);  // nobody reads it
  }
  for (ObjectId input : task.inputs) {
    const ObjectSpec& spec = graph().object(input);
    if (!ReleaseObject(IndexOf(input))) continue;
    change.Free(spec.role, InMemoryBytes(spec));
    for (const Donation& donation : task.donations) {  // an in-place output took its place
      if (task.inputs[static_cast<size_t>(donation.input_index)] == input) {
        change.Replace(spec.role, InMemoryBytes(spec));
        break;
      }
    }
  }
  // The task's end is counted before its outputs leave: a peer's reply to one (an object this
  // worker awaits, made from it) then arrives after it, as the memory model counts it
  // (planner/memory_model.h); counted after the push, a quick reply would overlap this task.
  meter_.Apply(change);
  for (size_t j = 0; j < out.size(); ++j) {
    const int object = IndexOf(task.outputs[j]);
    if (watched_[static_cast<size_t>(object)]) hooks_.on_produced(task.outputs[j], out[j]);
    if (Kept(object)) slots_[static_cast<size_t>(object)] = std::move(out[j]);
  }
  timing.end_us = MicrosSinceStart();
  ++tasks_run_;
  for (int dependent : prepared_.dependents_[static_cast<size_t>(t)]) {
    if (pending_[dependent].fetch_sub(1) == 1) ready->push_back(dependent);
  }
  TakeReady(*ready);
}

// ---- Step 5: late inputs, cancels, failures ----

Status GraphExecution::Provide(ObjectId id, Tensor tensor) {
  if (!Enter()) return Unavailable("the run has ended: nothing waits for {}", id.ToString());
  Status status = Deliver(id, std::move(tensor));
  Leave();
  return status;
}

Status GraphExecution::Deliver(ObjectId id, Tensor tensor) {
  const int index = IndexOf(id);
  const auto awaited = [&] {
    MutexLock lock(&mutex_);
    return id.valid() && index < num_objects_ && awaited_[static_cast<size_t>(index)];
  };
  if (!awaited()) return InvalidArgument("{} is not an awaited input of the run", id.ToString());
  const ObjectSpec& spec = graph().object(id);
  if (tensor.meta().shape != spec.meta.shape || tensor.dtype() != spec.meta.dtype) {
    return InvalidArgument("{} arrived as {} but the graph expects {}", spec.name,
                           tensor.meta().ToString(), spec.meta.ToString());
  }
  if (tensor.meta().device.kind != spec.meta.device.kind) {  // bytes from the network, for a GPU
    Result<Tensor> moved = MoveTo(spec.meta, std::move(tensor), executor_.Copier());
    if (!moved.ok()) return moved.status().WithContext(spec.name);
    tensor = *std::move(moved);
  }
  {
    MutexLock lock(&mutex_);
    if (!awaited_[static_cast<size_t>(index)]) {  // another Provide of it came first
      return InvalidArgument("{} is not an awaited input of the run", id.ToString());
    }
    awaited_[static_cast<size_t>(index)] = false;
    --awaited_count_;
    slots_[static_cast<size_t>(index)] = std::move(tensor);
  }
  meter_.Add(spec.role, spec.meta.bytes());
  std::vector<int> ready;
  for (int consumer : prepared_.input_consumers_[static_cast<size_t>(index)]) {
    if (pending_[consumer].fetch_sub(1) == 1) ready.push_back(consumer);
  }
  StartReady(std::move(ready));
  return Status::Ok();
}

void GraphExecution::Cancel(const Status& reason) {
  if (!Enter()) return;
  Fail(reason);
  Leave();
}

void GraphExecution::Fail(Status status) {
  {
    MutexLock lock(&mutex_);
    if (first_error_.ok()) first_error_ = std::move(status);
  }
  if (failed_.exchange(true)) return;
  // Its queued tasks will not run: they no longer keep the run busy. (The caller's count keeps
  // it above zero.)
  busy_.fetch_sub(executor_.Unqueue(this));
}

void GraphExecution::FailTask(Status status) {
  if (status.code() != StatusCode::kResourceExhausted) return Fail(std::move(status));
  // The allocator counts every buffer; the role meter the step's objects as its plan does (at
  // task ends, an in-place update the worker had to copy once): what is over the plan's figure
  // shows in the difference.
  Fail(Status(status.code(),
              fmt::format("{} (when refused, this step's objects held {} bytes as its plan counts "
                          "them after its last finished task; the rest of what was live: the "
                          "running tasks' outputs and scratch, objects in flight between "
                          "workers, copies where an in-place update could not take its input's "
                          "buffer, and what other runs and the object store hold)",
                          status.message(), meter_.live_total())));
}

RunActivity GraphExecution::Activity() const {
  RunActivity activity;
  MutexLock lock(&mutex_);
  if (ended_) return activity;
  for (int t = 0; t < num_tasks_; ++t) {
    if (kernel_running_[t].load(std::memory_order_relaxed)) {
      activity.running.emplace_back(NameOf(t).empty() ? graph().tasks()[static_cast<size_t>(t)].name
                                                      : std::string(NameOf(t)));
    }
  }
  for (int index = 0; index < num_objects_; ++index) {
    if (awaited_[static_cast<size_t>(index)]) {
      activity.awaited.push_back(graph().objects()[static_cast<size_t>(index)].id);
    }
  }
  return activity;
}

// ---- Step 6: the end ----

bool GraphExecution::Enter() {
  MutexLock lock(&mutex_);
  if (ended_) return false;
  busy_.fetch_add(1);
  return true;
}

void GraphExecution::Leave() {
  if (busy_.fetch_sub(1) != 1) return;
  MutexLock lock(&mutex_);
  // Whoever finds the count at zero decides; a later Enter and Leave decide again.
  if (busy_.load() != 0 || ended_) return;
  if (!failed_.load() && tasks_run_.load() < num_tasks_) {
    if (offloads_ > 0 || awaited_count_ > 0) return;  // waiting, as it should
    // Nothing runs, is queued or awaited, yet tasks remain: no task can ever start. A bug.
    first_error_ = Internal("run stalled: {} of {} tasks ran and no input is awaited",
                            tasks_run_.load(), num_tasks_);
    failed_.store(true);
  }
  if (failed_.load() && !on_failed_called_ && hooks_.on_failed) {
    on_failed_called_ = true;
    busy_.fetch_add(1);  // the run does not end while on_failed runs
    const Status error = first_error_;
    lock.Unlock();
    // Not under the lock: on_failed ends offloaded work, whose completions enter the run.
    hooks_.on_failed(error);
    return Leave();
  }
  if (offloads_ > 0) return;  // failed: offloaded tasks hold references into the run
  ended_ = true;
  lock.Unlock();
  End();
}

void GraphExecution::End() {
  std::shared_ptr<GraphExecution> keep = std::move(self_);  // released last: it may destroy the run
  executor_.Unregister(this);
  Result<RunResult> result = Status::Ok();
  ObjectMap intact;
  if (failed_.load()) {
    {
      MutexLock lock(&mutex_);
      result = first_error_;
    }
    intact = CollectIntactInputs();
  } else {
    result = CollectResult();
  }
  Done done = std::move(done_);
  if (done) done(std::move(result), std::move(intact));
  {
    MutexLock lock(&mutex_);
    done_returned_ = true;
  }
  ended_changed_.NotifyAll();
}

RunResult GraphExecution::CollectResult() {
  RunResult result;
  for (ObjectId output : graph().OutputObjects()) {
    result.outputs.emplace(output, std::move(slots_[static_cast<size_t>(IndexOf(output))]));
  }
  slots_.clear();
  const std::shared_ptr<Allocator>& allocator = executor_.allocator();
  stats_.wall_ms = std::chrono::duration<double, std::milli>(Clock::now() - start_).count();
  stats_.peak_bytes = allocator->stats().peak_bytes;
  if (executor_.device() != nullptr) {
    stats_.device_peak_bytes = executor_.device()->memory().peak_bytes;
  }
  stats_.live_bytes_after = allocator->stats().live_bytes;
  stats_.tasks_run = tasks_run_.load();
  stats_.donations_taken = donations_taken_.load();
  stats_.donations_copied = donations_copied_.load();
  stats_.role_bytes = meter_.bytes();
  result.stats = std::move(stats_);
  return result;
}

ObjectMap GraphExecution::CollectIntactInputs() {
  ObjectMap intact;
  for (int index : prepared_.input_objects_) {
    // Still in its slot and never handed to a task that updates it in place: unchanged (tasks
    // that only read it may have run).
    Tensor& slot = slots_[static_cast<size_t>(index)];
    if (slot.defined() && !donated_[index].load()) {
      intact.emplace(graph().objects()[static_cast<size_t>(index)].id, std::move(slot));
    }
  }
  slots_.clear();
  return intact;
}

void GraphExecution::Wait() {
  MutexLock lock(&mutex_);
  while (!done_returned_) ended_changed_.Wait(&mutex_);
}

bool GraphExecution::ended() const {
  MutexLock lock(&mutex_);
  return ended_;
}

}  // namespace tessera

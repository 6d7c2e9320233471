#include "worker/in_process_executor.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include <fmt/ranges.h>
#include <tbb/task_group.h>

#include "core/logging.h"
#include "core/timeline.h"
#include "worker/task_runner.h"

namespace tessera {

namespace {

using Clock = std::chrono::steady_clock;

int Index(ObjectId id) { return static_cast<int>(id.value()) - 1; }
int Index(TaskId id) { return static_cast<int>(id.value()) - 1; }

}  // namespace

ExecutorOptions ExecutorOptions::FromSettings(const Settings& settings) {
  ExecutorOptions options;
  options.threads = static_cast<int>(settings.cpu_threads);
  options.gemm_split_min_flops = settings.gemm_split_min_flops;
  options.cache_host_allocations = settings.cache_host_allocations;
  return options;
}

InProcessExecutor::InProcessExecutor(const OpRegistry& registry, const ExecutorOptions& options)
    : registry_(registry), options_(options) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads_ = options.threads > 0 ? options.threads : cores;
  if (options.cache_host_allocations) {
    allocator_ = std::make_shared<CachingHostAllocator>();
  } else {
    allocator_ = std::make_shared<AlignedHostAllocator>();
  }
  arena_ = std::make_unique<tbb::task_arena>(threads_);
}

InProcessExecutor::~InProcessExecutor() = default;

Result<PreparedGraph> InProcessExecutor::Prepare(Graph graph) const {
  TESSERA_RETURN_IF_ERROR(graph.Validate());
  PreparedGraph prepared;
  const int num_tasks = graph.num_tasks();
  const int num_objects = graph.num_objects();
  prepared.kernels_.resize(num_tasks);
  prepared.dependents_.resize(num_tasks);
  prepared.initial_pending_.assign(num_tasks, 0);
  prepared.initial_refcount_.assign(num_objects, 0);
  prepared.is_output_.assign(num_objects, false);
  prepared.input_consumers_.resize(num_objects);
  for (ObjectId output : graph.OutputObjects()) prepared.is_output_[Index(output)] = true;
  for (ObjectId input : graph.InputObjects()) prepared.input_objects_.push_back(Index(input));

  for (const TaskSpec& task : graph.tasks()) {
    const int t = Index(task.id);
    Result<const KernelFn*> kernel = registry_.FindKernel(task.op, task.device_kind);
    if (!kernel.ok()) return kernel.status().WithContext(TaskContext(task));
    prepared.kernels_[t] = *kernel;
    for (ObjectId input : task.inputs) {
      ++prepared.initial_refcount_[Index(input)];
      prepared.input_consumers_[Index(input)].push_back(t);
      const TaskId producer = graph.object(input).producer;
      if (producer.valid()) {
        ++prepared.initial_pending_[t];
        prepared.dependents_[Index(producer)].push_back(t);
      }
    }
    for (TaskId earlier : task.after) {
      ++prepared.initial_pending_[t];
      prepared.dependents_[Index(earlier)].push_back(t);
    }
  }
  prepared.graph_ = std::make_shared<const Graph>(std::move(graph));
  return prepared;
}

// What Provide and Cancel need to reach the run in progress.
struct InProcessExecutor::ActiveRun {
  const PreparedGraph* prepared;
  std::vector<Tensor>* slots;
  std::atomic<int>* pending;
  std::vector<bool> awaited;  // object index -> a late input not provided yet
  std::function<void(int)> spawn;
  std::function<void(Status)> fail;
  std::mutex mutex;  // orders Provide/Cancel/offload completions with the run's waiting loop
  std::condition_variable changed;
  int provided = 0;
  int events = 0;                // provides and offload completions, for the waiting loop
  int offloads_outstanding = 0;  // offloaded tasks not done yet
  RoleMeter* meter = nullptr;
  // task index -> its kernel runs now (read by Activity from other threads).
  std::unique_ptr<std::atomic<bool>[]> kernel_running;
};

Result<RunResult> InProcessExecutor::Run(const PreparedGraph& prepared, ObjectMap inputs,
                                         ObjectMap* intact_inputs, const RunHooks* hooks) {
  const Graph& graph = prepared.graph();
  const int num_tasks = graph.num_tasks();
  const int num_objects = graph.num_objects();
  std::vector<bool> late(num_objects, false);
  std::vector<bool> watched(num_objects, false);
  if (hooks != nullptr) {
    for (ObjectId id : hooks->late_inputs) {
      if (!id.valid() || Index(id) >= num_objects || graph.object(id).producer.valid()) {
        return InvalidArgument("late input {} is not an input of the graph", id.ToString());
      }
      late[Index(id)] = true;
    }
    for (ObjectId id : hooks->watched) {
      if (id.valid() && Index(id) < num_objects) watched[Index(id)] = true;
    }
  }

  // Object slots: written once by the producer (or here, for inputs), read by consumers after
  // the producer finished (ordered by the pending counters), cleared by the last consumer.
  std::vector<Tensor> slots(num_objects);
  auto bind = [&](int index) -> Status {
    const ObjectSpec& spec = graph.objects()[index];
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
      Result<Tensor> moved = MoveTo(spec.meta, it->second, Copier());
      if (!moved.ok())
        return moved.status().WithContext(fmt::format("graph input '{}'", spec.name));
      it->second = *std::move(moved);
    }
    slots[index] = std::move(it->second);
    inputs.erase(it);
    return Status::Ok();
  };
  for (int index : prepared.input_objects_) {
    if (late[index]) continue;
    if (Status bound = bind(index); !bound.ok()) {
      // Nothing ran: every input goes back, bound or not.
      if (intact_inputs != nullptr) {
        for (int taken : prepared.input_objects_) {
          if (slots[taken].defined()) {
            intact_inputs->emplace(graph.objects()[taken].id, std::move(slots[taken]));
          }
        }
        for (auto& [id, tensor] : inputs) intact_inputs->emplace(id, std::move(tensor));
      }
      return bound;
    }
  }
  inputs.clear();

  std::unique_ptr<std::atomic<int>[]> pending(new std::atomic<int>[num_tasks]);
  for (int t = 0; t < num_tasks; ++t) pending[t].store(prepared.initial_pending_[t]);
  for (int index = 0; index < num_objects; ++index) {
    if (!late[index]) continue;
    for (int consumer : prepared.input_consumers_[index]) ++pending[consumer];
  }
  std::unique_ptr<std::atomic<int>[]> refcount(new std::atomic<int>[num_objects]);
  for (int o = 0; o < num_objects; ++o) refcount[o].store(prepared.initial_refcount_[o]);
  // Objects whose buffer a task took over to update in place (donation).
  std::unique_ptr<std::atomic<bool>[]> donated(new std::atomic<bool>[num_objects]);
  for (int o = 0; o < num_objects; ++o) donated[o].store(false);

  RunStats stats;
  stats.timings.resize(num_tasks);
  std::atomic<bool> failed{false};
  std::atomic<int> tasks_run{0}, donations_taken{0}, donations_copied{0};
  std::mutex error_mutex;
  Status first_error;
  const KernelContext context{allocator_, options_.gemm_split_min_flops, &registry_,
                              options_.device.get()};

  allocator_->ResetPeak();
  if (options_.device != nullptr) options_.device->allocator()->ResetPeak();
  const Clock::time_point start = Clock::now();
  stats.start_unix_us = SystemMicrosNow();
  auto micros_since_start = [&] {
    return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  };

  auto fail = [&](Status status) {
    std::lock_guard lock(error_mutex);
    if (first_error.ok()) first_error = std::move(status);
    failed.store(true);
  };

  // Releases one use of an object; frees it after its last use unless it is a graph output.
  // Returns whether it freed it.
  auto release = [&](int object) {
    if (refcount[object].fetch_sub(1) == 1 && !prepared.is_output_[object]) {
      slots[object] = Tensor();
      return true;
    }
    return false;
  };

  tbb::task_group group;
  RoleMeter meter;
  for (int index : prepared.input_objects_) {
    if (!late[index]) {
      const ObjectSpec& spec = graph.objects()[index];
      meter.Add(spec.role, spec.meta.bytes());
    }
  }
  ActiveRun active{&prepared,
                   &slots,
                   pending.get(),
                   late,
                   {},
                   {},
                   {},
                   {},
                   0,
                   0,
                   0,
                   &meter,
                   std::make_unique<std::atomic<bool>[]>(static_cast<size_t>(num_tasks))};
  auto offloaded = [&](const TaskSpec& task) {
    return hooks != nullptr && hooks->offloaded && hooks->offloaded(task);
  };

  // The end of a task, kernel or offloaded: publish its outputs, release its inputs, start the
  // dependents that became ready (through `spawn`).
  auto finish_task = [&](int t, std::vector<Tensor>& out, const std::function<void(int)>& spawn) {
    const TaskSpec& task = graph.tasks()[t];
    std::vector<RoleMeter::Entry> added, freed, replaced;
    for (size_t j = 0; j < out.size(); ++j) {
      const int object = Index(task.outputs[j]);
      const ObjectSpec& spec = graph.objects()[object];
      added.emplace_back(spec.role, spec.meta.bytes());
      if (watched[object]) hooks->on_produced(task.outputs[j], out[j]);
      if (prepared.initial_refcount_[object] > 0 || prepared.is_output_[object]) {
        slots[object] = std::move(out[j]);
      } else {
        freed.emplace_back(spec.role, spec.meta.bytes());  // nobody reads it
      }
    }
    for (ObjectId input : task.inputs) {
      const ObjectSpec& spec = graph.object(input);
      if (!release(Index(input))) continue;
      freed.emplace_back(spec.role, spec.meta.bytes());
      for (const Donation& donation : task.donations) {  // an in-place output took its place
        if (task.inputs[donation.input_index] == input) {
          replaced.emplace_back(spec.role, spec.meta.bytes());
          break;
        }
      }
    }
    meter.Apply(added, freed, replaced);
    stats.timings[t].end_us = micros_since_start();
    ++tasks_run;
    for (int dependent : prepared.dependents_[t]) {
      if (pending[dependent].fetch_sub(1) == 1) spawn(dependent);
    }
  };

  std::function<void(int)> run_task = [&](int t) {
    if (failed.load()) return;
    const TaskSpec& task = graph.tasks()[t];
    TaskTiming& timing = stats.timings[t];
    timing.task = task.id;
    timing.start_us = micros_since_start();
    timing.thread_slot = tbb::this_task_arena::current_thread_index();

    std::vector<Tensor> in;
    in.reserve(task.inputs.size());
    for (ObjectId input : task.inputs) in.push_back(slots[Index(input)]);

    std::vector<TensorMeta> output_metas;
    output_metas.reserve(task.outputs.size());
    for (ObjectId output : task.outputs) output_metas.push_back(graph.object(output).meta);
    // An input may be donated when this task is its last reader and nothing outside the run
    // holds its buffer: the slot and `in` (once per use here) are the only references.
    auto can_donate = [&](int input_index) {
      const int object = Index(task.inputs[input_index]);
      int uses_here = 0;
      for (ObjectId input : task.inputs) uses_here += Index(input) == object;
      const bool donate = !prepared.is_output_[object] && refcount[object].load() == uses_here &&
                          in[input_index].buffer().use_count() == 1 + uses_here;
      if (donate) donated[object].store(true);
      return donate;
    };
    TaskRunCounters counters;
    if (offloaded(task)) {
      Result<std::vector<Tensor>> outputs =
          PrepareTaskOutputs(task, in, output_metas, context, can_donate, &counters);
      donations_taken += counters.donations_taken;
      donations_copied += counters.donations_copied;
      if (!outputs.ok()) return fail(outputs.status());
      {
        std::lock_guard lock(active.mutex);
        ++active.offloads_outstanding;
      }
      auto shared_outputs = std::make_shared<std::vector<Tensor>>(*outputs);
      hooks->offload(
          task, std::move(in), std::move(*outputs), [&, t, shared_outputs](const Status& status) {
            if (!status.ok()) {
              fail(status.WithContext(TaskContext(graph.tasks()[t])));
            } else if (!failed.load()) {
              arena_->execute([&] {
                finish_task(t, *shared_outputs, [&](int d) { group.run([&, d] { run_task(d); }); });
              });
            }
            shared_outputs->clear();
            // Notified under the lock: once the count is zero the run may end and destroy
            // `active`, so nothing here may touch it after unlocking (TSan found it did).
            std::lock_guard lock(active.mutex);
            --active.offloads_outstanding;
            ++active.events;
            active.changed.notify_all();
          });
      return;
    }
    active.kernel_running[t].store(true, std::memory_order_relaxed);
    Result<std::vector<Tensor>> ran = RunTaskKernel(*prepared.kernels_[t], task, in, output_metas,
                                                    context, can_donate, &counters);
    active.kernel_running[t].store(false, std::memory_order_relaxed);
    donations_taken += counters.donations_taken;
    donations_copied += counters.donations_copied;
    in.clear();  // drop our references before releasing inputs
    if (!ran.ok()) return fail(ran.status());
    finish_task(t, *ran, [&](int d) { group.run([&, d] { run_task(d); }); });
  };

  active.spawn = [&](int t) { group.run([&, t] { run_task(t); }); };
  active.fail = [&](Status status) {
    fail(std::move(status));
    std::lock_guard lock(active.mutex);
    active.changed.notify_all();
  };
  int late_count = 0;
  for (bool is_late : late) late_count += is_late;
  {
    std::lock_guard lock(active_mutex_);
    active_ = &active;
  }
  // Collect the initially ready tasks before starting any: a running task decrements its
  // dependents' counters, and a dependent reaching zero is spawned by that task, not here.
  std::vector<int> initially_ready;
  for (int t = 0; t < num_tasks; ++t) {
    if (pending[t].load() == 0) initially_ready.push_back(t);
  }
  arena_->execute([&] {
    for (int t : initially_ready) group.run([&, t] { run_task(t); });
  });
  if (hooks != nullptr && hooks->on_started) hooks->on_started();
  // Run until every task ran or the run failed. Between rounds, wait for what can start more
  // tasks: late inputs (Provide) and offloaded tasks finishing. `events` is read before each
  // round, so an event that lands while the round finishes is never missed.
  int idle_rounds = 0;
  while (true) {
    const int ran_before = tasks_run.load();
    int events_before;
    {
      std::lock_guard lock(active.mutex);
      events_before = active.events;
    }
    arena_->execute([&] { group.wait(); });
    std::unique_lock lock(active.mutex);
    if (failed.load() || tasks_run.load() == num_tasks) break;
    if (active.events != events_before) continue;
    if (active.provided == late_count && active.offloads_outstanding == 0) {
      // Nothing is awaited: tasks a last event spawned run in the next round. Two rounds in a
      // row without progress mean no task can ever start: a bug, not a wait.
      idle_rounds = tasks_run.load() == ran_before ? idle_rounds + 1 : 0;
      if (idle_rounds > 2) {
        fail(Internal("run stalled: {} of {} tasks ran and no input is awaited", tasks_run.load(),
                      num_tasks));
        break;
      }
      continue;
    }
    // Waiting is normal (a peer's producer may take long); a long wait says what it waits for.
    while (!active.changed.wait_for(lock, std::chrono::seconds(10), [&] {
      return failed.load() || active.events != events_before;
    })) {
      std::vector<std::string> awaited;
      for (int index = 0; index < num_objects; ++index) {
        if (active.awaited[static_cast<size_t>(index)])
          awaited.push_back(graph.objects()[index].name);
      }
      GetLogger("executor")
          ->warn("{} of {} tasks ran; still waiting for {} offloaded task(s) and for {}",
                 tasks_run.load(), num_tasks, active.offloads_outstanding,
                 fmt::join(awaited, ", "));
    }
  }
  if (failed.load() && hooks != nullptr && hooks->on_failed) {
    Status error;
    {
      std::lock_guard lock(error_mutex);
      error = first_error;
    }
    // Not under error_mutex: on_failed ends offloaded work, whose completions call fail().
    hooks->on_failed(error);
  }
  {
    // Offloaded tasks hold references into this run: wait for every one.
    std::unique_lock lock(active.mutex);
    active.changed.wait(lock, [&] { return active.offloads_outstanding == 0; });
  }
  {
    std::lock_guard lock(active_mutex_);
    active_ = nullptr;
  }
  arena_->execute([&] { group.wait(); });  // tasks spawned by a last Provide

  if (failed.load()) {
    if (intact_inputs != nullptr) {
      for (int index : prepared.input_objects_) {
        // Still in its slot and never handed to a task that updates it in place: unchanged
        // (tasks that only read it may have run).
        if (slots[index].defined() && !donated[index].load()) {
          intact_inputs->emplace(graph.objects()[index].id, std::move(slots[index]));
        }
      }
    }
    return first_error;
  }
  if (tasks_run.load() != num_tasks) {
    return Internal("only {} of {} tasks ran", tasks_run.load(), num_tasks);
  }

  RunResult result;
  for (ObjectId output : graph.OutputObjects()) {
    result.outputs.emplace(output, std::move(slots[Index(output)]));
  }
  slots.clear();
  stats.wall_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  stats.peak_bytes = allocator_->stats().peak_bytes;
  if (options_.device != nullptr) stats.device_peak_bytes = options_.device->memory().peak_bytes;
  stats.live_bytes_after = allocator_->stats().live_bytes;
  stats.tasks_run = tasks_run.load();
  stats.donations_taken = donations_taken.load();
  stats.donations_copied = donations_copied.load();
  stats.role_bytes = meter.bytes();
  result.stats = std::move(stats);
  return result;
}

std::optional<InProcessExecutor::RunActivity> InProcessExecutor::Activity() {
  std::lock_guard active_lock(active_mutex_);
  if (active_ == nullptr) return std::nullopt;
  const ActiveRun& run = *active_;
  const Graph& graph = run.prepared->graph();
  RunActivity activity;
  for (int t = 0; t < graph.num_tasks(); ++t) {
    if (run.kernel_running[t].load(std::memory_order_relaxed)) {
      activity.running.push_back(graph.tasks()[t].name);
    }
  }
  std::lock_guard lock(active_->mutex);
  for (int index = 0; index < graph.num_objects(); ++index) {
    if (run.awaited[static_cast<size_t>(index)]) {
      activity.awaited.push_back(graph.objects()[static_cast<size_t>(index)].id);
    }
  }
  return activity;
}

Status InProcessExecutor::Provide(ObjectId id, Tensor tensor) {
  std::lock_guard active_lock(active_mutex_);
  if (active_ == nullptr) return Unavailable("no run is waiting for {}", id.ToString());
  ActiveRun& run = *active_;
  const Graph& graph = run.prepared->graph();
  const int index = Index(id);
  if (!id.valid() || index >= graph.num_objects() || !run.awaited[index]) {
    return InvalidArgument("{} is not an awaited input of the run", id.ToString());
  }
  const TensorMeta& expected = graph.object(id).meta;
  if (tensor.meta().shape != expected.shape || tensor.dtype() != expected.dtype) {
    return InvalidArgument("{} arrived as {} but the graph expects {}", graph.object(id).name,
                           tensor.meta().ToString(), expected.ToString());
  }
  if (tensor.meta().device.kind != expected.device.kind) {  // bytes from the network, for a GPU
    Result<Tensor> moved = MoveTo(expected, std::move(tensor), Copier());
    if (!moved.ok()) return moved.status().WithContext(graph.object(id).name);
    tensor = *std::move(moved);
  }
  std::vector<int> ready;
  {
    std::lock_guard lock(run.mutex);
    run.awaited[index] = false;
    (*run.slots)[index] = std::move(tensor);
    run.meter->Add(graph.object(id).role, graph.object(id).meta.bytes());
    for (int consumer : run.prepared->input_consumers_[index]) {
      if (run.pending[consumer].fetch_sub(1) == 1) ready.push_back(consumer);
    }
  }
  if (!ready.empty()) {
    arena_->execute([&] {
      for (int t : ready) run.spawn(t);
    });
  }
  std::lock_guard lock(run.mutex);
  ++run.provided;
  ++run.events;
  run.changed.notify_all();
  return Status::Ok();
}

void InProcessExecutor::Cancel(const Status& reason) {
  std::lock_guard active_lock(active_mutex_);
  if (active_ != nullptr) active_->fail(reason);
}

}  // namespace tessera

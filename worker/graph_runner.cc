#include "worker/graph_runner.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "core/logging.h"
#include "core/rpc/frame.h"
#include "core/rpc/wire.h"
#include "worker/graph_runner_part.h"
#include "worker/task_runner.h"

namespace tessera {

namespace {

bool PushKeyLess(const PushKey& a, const PushKey& b) {
  return std::tie(a.graph, a.instance, a.object) < std::tie(b.graph, b.instance, b.object);
}

constexpr size_t kRememberedInstances = 256;

}  // namespace

struct GraphRunner::Instance {
  Key key;
  std::vector<ObjectId> output_ids;                // cluster ids, per graph output
  std::vector<std::pair<ObjectId, Tensor>> ready;  // local id, tensor: inputs at hand
  struct Pull {
    ObjectId local;
    std::string address;
    ObjectId cluster;
    TensorMeta meta;
  };
  std::vector<Pull> pulls;
  Status error;  // failed before it started
  std::shared_ptr<Part> part;
  // This worker's places of the instance's collective members in its channels' orders of
  // collectives (the part's places plus the instance's bases here).
  std::vector<CollectivePlace> places;
  std::array<int64_t, kCollectiveChannels> collective_bases{};
  // Per graph task, this instance's own name and collective id for it (a submitted task's, a
  // submitted collective's); empty: the part's.
  std::vector<std::string> task_names;
  std::vector<int64_t> collective_ids;
  // Bound inputs this worker took over (RunGraph's takeOver: moved out of its store), local id ->
  // cluster id: put back into the store when the run fails without having updated them.
  std::map<ObjectId, ObjectId> taken_over;
  uint64_t sequence = 0;  // arrival order
  // Once started on the executor. Under the runner's mutex_ (which the analysis cannot name
  // from here): set once by Begin, read by those that find the instance in in_flight_.
  std::shared_ptr<GraphExecution> run;

  std::shared_ptr<Outcome> outcome = std::make_shared<Outcome>();
};

// An instance's report in the making. It goes out once the run has ended and every push of the
// instance's exports has completed.
struct GraphRunner::Outcome {
  Mutex mutex;
  int pushes GUARDED_BY(mutex) = 0;  // out
  bool run_done GUARDED_BY(mutex) = false;
  Status error GUARDED_BY(mutex);
  std::vector<std::pair<ObjectId, Tensor>> sealed GUARDED_BY(mutex);
  std::vector<ObjectId> restored GUARDED_BY(mutex);  // taken-over inputs put back (a failure)
  InstanceFigures figures GUARDED_BY(mutex);
  // Local task -> when it ran on the engine.
  std::map<TaskId, WorkerSpans::Task> collectives GUARDED_BY(mutex);

  // The instance's figures once its run ended: the run's statistics with the pushes so far
  // and the members' time on the engine.
  InstanceFigures FiguresOf(const Part& part, const RunStats& stats) const REQUIRES(mutex);
};

GraphRunner::GraphRunner(const OpRegistry& registry, const ExecutorOptions& executor_options,
                         ObjectStore& store, const Settings& settings, SendToScheduler send)
    : registry_(registry),
      settings_(settings),
      store_(store),
      send_(std::move(send)),
      executor_(registry, executor_options),
      incoming_(&PushKeyLess) {}

GraphRunner::~GraphRunner() {
  std::vector<std::shared_ptr<GraphExecution>> runs;
  {
    MutexLock lock(&mutex_);
    stopping_ = true;
    for (const auto& [key, instance] : in_flight_) {
      if (instance->run != nullptr) runs.push_back(instance->run);
    }
  }
  // Instances still launching see stopping_ when they start and cancel themselves.
  for (const std::shared_ptr<GraphExecution>& run : runs) run->Cancel(Cancelled("worker stopping"));
  MutexLock lock(&mutex_);
  while (!in_flight_.empty()) retired_.Wait(&mutex_);
}

// ---- Parts ----

void GraphRunner::AddPart(uint64_t self, proto::GraphPart::Reader wire, Status prepared) {
  {
    MutexLock lock(&mutex_);
    self_ = self;
  }
  auto part = std::make_shared<Part>();
  part->id = wire.getGraphId();
  Status status = prepared.ok()
                      ? part->Build(self, wire, executor_, rpc::WireLimits::FromSettings(settings_))
                      : std::move(prepared);
  if (!status.ok()) {
    part->error = status.WithContext(fmt::format("preparing graph {}", part->id));
    GetLogger("worker")->warn("{}", part->error.ToString());
  }
  const uint64_t id = part->id;
  {
    MutexLock lock(&mutex_);
    parts_[id] = std::move(part);
  }
  DeliverEarlyPushes(id);
}

void GraphRunner::DeliverEarlyPushes(uint64_t graph) {
  std::vector<std::pair<PushKey, Status>> delivered;
  {
    MutexLock lock(&mutex_);
    const std::shared_ptr<Part>& part = parts_.at(graph);
    for (auto early = early_pushes_.begin(); early != early_pushes_.end();) {
      if (early->key.graph != graph || !early->delivered) {
        ++early;
        continue;
      }
      const PushKey key = early->key;
      Result<Tensor> tensor =
          InvalidArgument("push of object {} of unknown graph {}", key.object, key.graph);
      if (key.object > 0 && key.object <= part->objects.size()) {
        const TensorMeta& meta = part->objects[key.object - 1].meta;
        if (meta.bytes() != static_cast<int64_t>(early->bytes.size())) {
          tensor = InvalidArgument("push of {} bytes for {} ({})", early->bytes.size(),
                                   part->objects[key.object - 1].name, meta.ToString());
        } else {
          tensor = Tensor::Empty(OnHost(meta), executor_.allocator());
          if (tensor.ok())
            std::memcpy(tensor->raw_data(), early->bytes.data(), early->bytes.size());
        }
      }
      early_push_bytes_ -= static_cast<int64_t>(early->bytes.size());
      early = early_pushes_.erase(early);
      Status status = tensor.status();
      if (tensor.ok()) incoming_[key] = *std::move(tensor);
      delivered.emplace_back(key, std::move(status));
    }
  }
  for (const auto& [key, status] : delivered) PushDelivered(key, status);
}

// ---- Instances ----

void GraphRunner::Start(proto::RunGraph::Reader run) {
  auto instance = std::make_shared<Instance>();
  instance->key = {run.getGraphId(), run.getInstance()};
  std::shared_ptr<Part> part;
  uint64_t self = 0;
  {
    MutexLock lock(&mutex_);
    self = self_;
    auto it = parts_.find(instance->key.first);
    if (it != parts_.end()) part = it->second;
  }
  for (uint64_t id : run.getOutputIds()) instance->output_ids.push_back(ObjectId(id));
  for (proto::CollectiveBase::Reader base : run.getCollectiveBases()) {
    if (base.getWorker() == self && base.getChannel() < kCollectiveChannels) {
      instance->collective_bases[base.getChannel()] = base.getBase();
    }
  }
  for (capnp::Text::Reader name : run.getTaskNames()) instance->task_names.push_back(name);
  for (int64_t id : run.getCollectiveIds()) instance->collective_ids.push_back(id);
  if (part == nullptr) {
    instance->error = NotFound("graph {} has no part on this worker", instance->key.first);
  } else if (!part->error.ok()) {
    instance->error = part->error;
  } else {
    instance->part = part;
    for (const CollectivePlace& place : part->collective_places) {
      instance->places.push_back(
          {place.channel,
           instance->collective_bases[static_cast<size_t>(place.channel)] + place.position});
    }
    auto local_input = [&](uint64_t graph_local) -> ObjectId {
      if (graph_local == 0 || graph_local > part->local_of.size()) return ObjectId();
      return part->local_of[graph_local - 1];
    };
    // Inline inputs by local id: a small object bound as well is read from this worker's store
    // when it holds it (no second copy), else from its bytes.
    std::map<ObjectId, capnp::Data::Reader> inline_bytes;
    for (proto::SealedObject::Reader input : run.getInlineInputs()) {
      const ObjectId local = local_input(input.getId());
      if (local.valid()) inline_bytes.emplace(local, input.getInline());  // else another worker's
    }
    for (proto::Binding::Reader binding : run.getInputs()) {
      const ObjectId local = local_input(binding.getObject());
      if (!local.valid()) continue;
      const ObjectId cluster(binding.getSource().getObject());
      const TensorMeta& meta = part->local.object(local).meta;
      if (store_.Contains(cluster)) {
        Result<PinnedObject> pinned = store_.Get(cluster);
        if (pinned.ok()) {
          instance->ready.emplace_back(local, pinned->tensor());
          inline_bytes.erase(local);
          // Taken over (the run is its last user here): out of the store, so the run holds its
          // only copy and may update it in place. The scheduler frees it once the run ends,
          // unless the run fails without having updated it (PutBack).
          if (binding.getTakeOver() && store_.Delete(cluster).ok()) {
            instance->taken_over.emplace(local, cluster);
          }
          continue;
        }
      }
      if (inline_bytes.contains(local)) continue;  // made from its bytes below
      instance->pulls.push_back(
          Instance::Pull{local, rpc::ToString(binding.getSource().getAddress()), cluster, meta});
    }
    for (const auto& [local, data] : inline_bytes) {
      const TensorMeta& meta = part->local.object(local).meta;
      if (static_cast<int64_t>(data.size()) != meta.bytes()) {
        instance->error = InvalidArgument("inline input {} has {} bytes, not those of {}",
                                          local.ToString(), data.size(), meta.ToString());
        break;
      }
      Result<Tensor> tensor = Tensor::Empty(OnHost(meta), executor_.allocator());
      if (!tensor.ok()) {
        instance->error = tensor.status().WithContext("an inline input of the instance");
        break;
      }
      std::memcpy(tensor->raw_data(), data.begin(), data.size());
      instance->ready.emplace_back(local, *std::move(tensor));
    }
  }
  Admit(instance);
}

void GraphRunner::Admit(const std::shared_ptr<Instance>& instance) {
  {
    MutexLock lock(&mutex_);
    if (stopping_) return;
    instance->sequence = next_sequence_++;
    in_flight_[instance->key] = instance;
  }
  Launch(instance);
}

void GraphRunner::Launch(const std::shared_ptr<Instance>& instance) {
  {
    MutexLock lock(&mutex_);
    std::optional<Status> cancel = TakeCancel(instance->key);
    if (cancel.has_value() && instance->error.ok()) instance->error = *std::move(cancel);
  }
  if (instance->error.ok()) instance->error = Begin(instance);
  if (instance->error.ok()) return;  // on the executor; Ended takes it from there
  // Its collectives never come: the worker's order moves past them.
  if (engine_ != nullptr) engine_->EndInstance(instance->key, instance->places, instance->error);
  CountDone(0);
  ObjectMap unused;
  for (auto& [local, tensor] : instance->ready) unused.emplace(local, std::move(tensor));
  instance->ready.clear();
  Report(instance->key, instance->error, {}, {}, PutBack(*instance, unused));
  Retire(*instance);
}

std::vector<ObjectId> GraphRunner::PutBack(const Instance& instance, const ObjectMap& intact) {
  std::vector<ObjectId> restored;
  for (const auto& [local, cluster] : instance.taken_over) {
    auto it = intact.find(local);
    if (it == intact.end()) continue;  // updated in place (or never read): lost
    Status put = store_.Put(cluster, it->second);
    if (put.ok()) {
      restored.push_back(cluster);
    } else {
      GetLogger("worker")->warn("could not put {} back into the store after a failed run: {}",
                                cluster.ToString(), put.ToString());
    }
  }
  return restored;
}

std::vector<GraphRunActivity> GraphRunner::Activity() {
  std::vector<std::pair<std::shared_ptr<Instance>, std::shared_ptr<GraphExecution>>> running;
  {
    MutexLock lock(&mutex_);
    for (const auto& [key, instance] : in_flight_) {
      if (instance->run != nullptr) running.emplace_back(instance, instance->run);
    }
  }
  std::sort(running.begin(), running.end(),
            [](const auto& a, const auto& b) { return a.first->sequence < b.first->sequence; });
  std::vector<GraphRunActivity> activities;
  for (const auto& [instance, execution] : running) {
    // Outside mutex_: a run's lock is never taken under it. An instance whose run has ended
    // is reporting (its pushes may still be out): not in progress any more.
    if (execution->ended()) continue;
    const RunActivity run = execution->Activity();
    const Part& part = *instance->part;
    GraphRunActivity activity{.graph = instance->key.first, .instance = instance->key.second};
    activity.running = run.running;
    for (ObjectId local : run.awaited) {
      const size_t index = local.value() - 1;
      if (index >= part.graph_of.size()) continue;
      const ObjectId graph_id = part.graph_of[index];
      if (!graph_id.valid() || graph_id.value() > part.objects.size()) continue;
      activity.awaited.push_back(
          {part.objects[graph_id.value() - 1].name, part.producer_worker.at(graph_id.value() - 1)});
    }
    activities.push_back(std::move(activity));
  }
  return activities;
}

void GraphRunner::Cancel(uint64_t graph, uint64_t instance, const Status& reason) {
  const Key key{graph, instance};
  std::shared_ptr<GraphExecution> run;
  {
    MutexLock lock(&mutex_);
    if (Finished(key)) return;
    auto it = in_flight_.find(key);
    if (it != in_flight_.end() && it->second->run != nullptr) {
      run = it->second->run;
    } else {
      cancelled_[key] = reason;  // applied when it starts
    }
  }
  if (run != nullptr) run->Cancel(reason);
}

namespace {
constexpr int64_t kMaxEarlyPushBytes = int64_t{1} << 30;
}  // namespace

Result<void*> GraphRunner::AcceptPush(const PushKey& key, int64_t bytes) {
  MutexLock lock(&mutex_);
  auto it = parts_.find(key.graph);
  if (it == parts_.end()) {
    // The part may still be on its way (or being prepared): keep the bytes until it comes.
    if (bytes < 0 || early_push_bytes_ + bytes > kMaxEarlyPushBytes) {
      return ResourceExhausted(
          "push of object {} of graph {} ({} bytes) before its graph part arrived: over the {} "
          "bytes kept for early pushes",
          key.object, key.graph, bytes, kMaxEarlyPushBytes);
    }
    early_push_bytes_ += bytes;
    early_pushes_.push_back(EarlyPush{key, std::vector<uint8_t>(static_cast<size_t>(bytes))});
    return static_cast<void*>(early_pushes_.back().bytes.data());
  }
  if (key.object == 0 || key.object > it->second->objects.size()) {
    return InvalidArgument("push of object {} of unknown graph {}", key.object, key.graph);
  }
  const TensorMeta& meta = it->second->objects[key.object - 1].meta;
  if (meta.bytes() != bytes) {
    return InvalidArgument("push of {} bytes for {} ({})", bytes,
                           it->second->objects[key.object - 1].name, meta.ToString());
  }
  TESSERA_ASSIGN_OR_RETURN(Tensor tensor, Tensor::Empty(OnHost(meta), executor_.allocator()));
  void* dest = tensor.raw_data();
  incoming_[key] = std::move(tensor);
  return dest;
}

void GraphRunner::PushDelivered(const PushKey& key, const Status& status) {
  bool early_and_placed = false;
  {
    MutexLock lock(&mutex_);
    for (auto early = early_pushes_.begin(); early != early_pushes_.end(); ++early) {
      if (early->delivered || !(early->key == key)) continue;
      if (!status.ok()) {
        early_push_bytes_ -= static_cast<int64_t>(early->bytes.size());
        early_pushes_.erase(early);
        break;
      }
      early->delivered = true;  // the part's arrival hands it to the run
      if (parts_.count(key.graph) == 0) return;
      early_and_placed = true;  // the part came while the bytes did
      break;
    }
  }
  if (early_and_placed) return DeliverEarlyPushes(key.graph);
  Tensor tensor;
  ObjectId local;
  {
    MutexLock lock(&mutex_);
    auto it = incoming_.find(key);
    if (it != incoming_.end()) {
      tensor = std::move(it->second);
      incoming_.erase(it);
    }
    auto part = parts_.find(key.graph);
    if (part != parts_.end() && key.object > 0 && key.object <= part->second->local_of.size()) {
      local = part->second->local_of[key.object - 1];
    }
  }
  const Key instance{key.graph, key.instance};
  if (!status.ok() || !tensor.defined() || !local.valid()) {
    Cancel(key.graph, key.instance,
           status.ok() ? Internal("push of object {} could not be delivered", key.object) : status);
    return;
  }
  Arrive(instance, local, std::move(tensor));
}

void GraphRunner::Arrive(const Key& key, ObjectId local, Tensor tensor) {
  std::shared_ptr<GraphExecution> run;
  {
    MutexLock lock(&mutex_);
    if (Finished(key)) return;
    auto it = in_flight_.find(key);
    if (it == in_flight_.end() || it->second->run == nullptr) {
      arrivals_[key].emplace_back(local, std::move(tensor));  // Begin hands it over
      return;
    }
    run = it->second->run;
  }
  Status provided = run->Provide(local, std::move(tensor));
  if (!provided.ok()) run->Cancel(provided);
}

Status GraphRunner::Begin(const std::shared_ptr<Instance>& instance) {
  const Key key = instance->key;
  const Part& part = *instance->part;
  // Inputs at hand now: bound inline/local ones, and pushes that came before the start.
  ObjectMap inputs;
  for (auto& [local, tensor] : instance->ready) inputs[local] = std::move(tensor);
  instance->ready.clear();
  {
    MutexLock lock(&mutex_);
    for (auto& [local, tensor] : TakeArrivals(key)) inputs[local] = std::move(tensor);
  }
  RunHooks hooks = MakeHooks(*instance);
  for (ObjectId external : part.external) {
    if (!inputs.contains(external)) hooks.late_inputs.push_back(external);
  }
  if (Status pulls = StartPulls(*instance); !pulls.ok()) {
    for (auto& [local, tensor] : inputs) instance->ready.emplace_back(local, std::move(tensor));
    return pulls;  // Launch reports it, putting back what was taken over
  }
  std::shared_ptr<GraphExecution> run =
      executor_.Start(*part.prepared, std::move(inputs), std::move(hooks),
                      [this, instance](Result<RunResult> result, const ObjectMap& intact) {
                        Ended(instance, std::move(result), intact);
                      });
  // From now on pushes go to the run; those that came while it started are handed over here.
  std::vector<std::pair<ObjectId, Tensor>> buffered;
  std::optional<Status> cancel;
  {
    MutexLock lock(&mutex_);
    if (!in_flight_.contains(key)) return Status::Ok();  // ended already (Ended retired it)
    instance->run = run;
    buffered = TakeArrivals(key);
    cancel = TakeCancel(key);
    if (stopping_) cancel = Cancelled("worker stopping");
  }
  for (auto& [local, tensor] : buffered) {
    Status provided = run->Provide(local, std::move(tensor));
    if (!provided.ok()) run->Cancel(provided);
  }
  if (cancel.has_value()) run->Cancel(*cancel);
  return Status::Ok();
}

RunHooks GraphRunner::MakeHooks(const Instance& instance) {
  const Key key = instance.key;
  const std::shared_ptr<Part> part = instance.part;
  const std::shared_ptr<Outcome> outcome = instance.outcome;
  RunHooks hooks;
  for (const auto& [local, consumers] : part->exports) hooks.watched.push_back(local);
  hooks.on_produced = [this, key, part, outcome](ObjectId local, const Tensor& tensor) {
    PushExport(key, *part, outcome, local, tensor);
  };
  // Collective members go to the worker's communication stream, in the scheduler's order.
  if (engine_ != nullptr) {
    hooks.offloaded = [part](const TaskSpec& task) {
      return part->engine_member[task.id.value() - 1];
    };
    hooks.offload = [this, key, outcome, part, bases = instance.collective_bases,
                     names = instance.task_names, ids = instance.collective_ids](
                        const TaskSpec& task, std::vector<Tensor> in, std::vector<Tensor> out,
                        RunHooks::OffloadDone done) {
      CollectiveMember member{task.name, task.op, task.attrs, std::move(in), std::move(out), {}};
      // The instance's own identity for the member of a graph many instances share.
      const uint64_t graph_task = part->graph_task_of[task.id.value() - 1];
      if (graph_task <= names.size()) member.task = names[graph_task - 1];
      if (graph_task <= ids.size()) member.attrs.Set(kCollectiveAttr, ids[graph_task - 1]);
      member.on_ran = [outcome, id = task.id](int64_t start_us, int64_t end_us, int64_t bytes) {
        MutexLock lock(&outcome->mutex);
        outcome->collectives[id] = WorkerSpans::Task{0, kCollectiveStream, start_us, end_us, bytes};
      };
      engine_->Submit(key, PlaceOf(task, bases), std::move(member), std::move(done));
    };
    hooks.on_failed = [this, key, places = instance.places](const Status& error) {
      engine_->EndInstance(key, places, error);
    };
  }
  // Only an instance that names its tasks (a submitted task) needs a name per local task.
  if (!instance.task_names.empty()) {
    hooks.task_names.reserve(part->graph_task_of.size());
    for (uint64_t graph_task : part->graph_task_of) {
      hooks.task_names.push_back(graph_task <= instance.task_names.size()
                                     ? instance.task_names[graph_task - 1]
                                     : std::string());
    }
  }
  return hooks;
}

void GraphRunner::PushExport(const Key& key, const Part& part,
                             const std::shared_ptr<Outcome>& outcome, ObjectId local,
                             const Tensor& tensor) {
  const auto& consumers = part.exports.at(local);
  const PushKey push_key{key.first, key.second, part.graph_of[local.value() - 1].value()};
  // A GPU's object goes out from a host copy (once for every consumer).
  Result<Tensor> host = HostCopyOf(tensor, executor_.Copier());
  if (!host.ok()) {
    MutexLock lock(&outcome->mutex);
    if (outcome->error.ok()) outcome->error = host.status().WithContext("pushing");
    return;
  }
  for (const std::string& address : consumers) {
    {
      MutexLock lock(&outcome->mutex);
      ++outcome->pushes;
      outcome->figures.pushed_bytes += tensor.bytes();
    }
    auto destination = part.worker_of_address.find(address);
    const WorkerSpans::Push span{
        push_key.object, destination == part.worker_of_address.end() ? 0 : destination->second,
        SystemMicrosNow(), 0, tensor.bytes()};
    // Lent: until the peer has read it, an allocation over the cap waits for it (allocator.h).
    data_plane_->Push(address, push_key, host->raw_data(), host->bytes(),
                      Buffer::Lend(host->buffer()),
                      [this, key, outcome, address, span](const Status& status) {
                        {
                          MutexLock lock(&outcome->mutex);
                          --outcome->pushes;
                          outcome->figures.spans.pushes.push_back(span);
                          outcome->figures.spans.pushes.back().end_us = SystemMicrosNow();
                          if (!status.ok() && outcome->error.ok()) {
                            outcome->error = status.WithContext("pushing to " + address);
                          }
                        }
                        ReportWhenPushed(key, *outcome);
                      });
  }
}

void GraphRunner::ReportWhenPushed(const Key& key, Outcome& outcome) {
  Status error;
  std::vector<std::pair<ObjectId, Tensor>> sealed;
  std::vector<ObjectId> restored;
  InstanceFigures figures;
  {
    MutexLock lock(&outcome.mutex);
    // A failed run reports at once: a push still out may be to a worker that died, and fail
    // only at the transport's timeout (30 s), while the scheduler waits for this report to hand
    // the driver back what this worker put back. Pushes ending later find it reported.
    if (!outcome.run_done || (outcome.pushes > 0 && outcome.error.ok())) return;
    outcome.run_done = false;  // report once
    error = outcome.error;
    sealed = std::move(outcome.sealed);
    restored = std::move(outcome.restored);
    figures = outcome.figures;
  }
  Report(key, error, std::move(sealed), figures, restored);
}

Status GraphRunner::StartPulls(const Instance& instance) {
  // Remote bound inputs are pulled meanwhile and arrive like pushes.
  const Key key = instance.key;
  for (const Instance::Pull& pull : instance.pulls) {
    TESSERA_ASSIGN_OR_RETURN(Tensor tensor,
                             Tensor::Empty(OnHost(pull.meta), executor_.allocator()));
    auto destination = std::make_shared<Tensor>(std::move(tensor));
    data_plane_->Pull(pull.address, pull.cluster, destination->raw_data(), destination->bytes(),
                      [this, key, local = pull.local, destination](const Status& status) {
                        if (!status.ok()) {
                          Cancel(key.first, key.second, status);
                          return;
                        }
                        Arrive(key, local, std::move(*destination));
                      });
  }
  return Status::Ok();
}

void GraphRunner::Ended(const std::shared_ptr<Instance>& instance, Result<RunResult> result,
                        const ObjectMap& intact) {
  const Key key = instance->key;
  if (engine_ != nullptr) engine_->EndInstance(key, instance->places, result.status());
  Outcome& outcome = *instance->outcome;
  if (result.ok()) {
    MutexLock lock(&outcome.mutex);
    outcome.figures = outcome.FiguresOf(*instance->part, result->stats);
  }
  std::vector<std::pair<ObjectId, Tensor>> sealed;
  Status error = result.status();
  if (error.ok()) {
    for (const auto& [local, index] : instance->part->produced_outputs) {
      sealed.emplace_back(instance->output_ids.at(index), std::move(result->outputs.at(local)));
    }
  } else if (key.first < kFirstSchedulerGraphId) {  // a submitted task's error names the task
    error = error.WithContext(fmt::format("graph {} instance {}", key.first, key.second));
  }
  std::vector<ObjectId> restored;
  if (!error.ok()) restored = PutBack(*instance, intact);
  {
    MutexLock lock(&outcome.mutex);
    outcome.run_done = true;
    if (!error.ok() && outcome.error.ok()) outcome.error = error;
    outcome.sealed = std::move(sealed);
    outcome.restored = std::move(restored);
  }
  CountDone(result.ok() ? result->stats.tasks_run : 0);
  ReportWhenPushed(key, outcome);
  Retire(*instance);  // `this` may be gone once it returned: the destructor waits for it
}

InstanceFigures GraphRunner::Outcome::FiguresOf(const Part& part, const RunStats& stats) const {
  InstanceFigures result = figures;  // pushes so far
  result.role_bytes = stats.role_bytes;
  result.allocator_peak = stats.peak_bytes;
  result.wall_ms = stats.wall_ms;
  for (const auto& [task, ran] : collectives) result.collective_bytes += ran.bytes;
  const int64_t start_us = stats.start_unix_us;
  for (const TaskTiming& timing : stats.timings) {
    if (!timing.task.valid() || timing.task.value() > part.graph_task_of.size()) continue;
    WorkerSpans::Task span{part.graph_task_of[timing.task.value() - 1], timing.thread_slot,
                           start_us + static_cast<int64_t>(timing.start_us),
                           start_us + static_cast<int64_t>(timing.end_us), timing.bytes};
    auto engine_run = collectives.find(timing.task);
    if (engine_run != collectives.end()) {
      const uint64_t graph_task = span.task;
      span = engine_run->second;
      span.task = graph_task;
    }
    if (span.stream < 0 && span.stream != kCollectiveStream) span.stream = 0;
    span.end_us = std::max(span.end_us, span.start_us);
    result.spans.tasks.push_back(span);
  }
  return result;
}

void GraphRunner::CountDone(int64_t tasks) {
  MutexLock lock(&mutex_);
  ++done_;
  tasks_done_ += tasks;
}

void GraphRunner::Retire(const Instance& instance) {
  MutexLock lock(&mutex_);
  in_flight_.erase(instance.key);
  arrivals_.erase(instance.key);
  finished_.push_back(instance.key);
  if (finished_.size() > kRememberedInstances) finished_.pop_front();
  // The destructor waits for in_flight_ to empty. Notified under the lock: once it is
  // released the runner may be gone.
  retired_.NotifyAll();
}

std::vector<std::pair<ObjectId, Tensor>> GraphRunner::TakeArrivals(const Key& key) {
  std::vector<std::pair<ObjectId, Tensor>> arrived;
  auto it = arrivals_.find(key);
  if (it != arrivals_.end()) {
    arrived = std::move(it->second);
    arrivals_.erase(it);
  }
  return arrived;
}

std::optional<Status> GraphRunner::TakeCancel(const Key& key) {
  auto it = cancelled_.find(key);
  if (it == cancelled_.end()) return std::nullopt;
  Status reason = std::move(it->second);
  cancelled_.erase(it);
  return reason;
}

bool GraphRunner::Finished(const Key& key) const {
  return std::find(finished_.begin(), finished_.end(), key) != finished_.end();
}

void GraphRunner::RemovePart(uint64_t graph) {
  MutexLock lock(&mutex_);
  parts_.erase(graph);
}

GraphRunnerStats GraphRunner::stats() {
  MutexLock lock(&mutex_);
  return GraphRunnerStats{static_cast<int64_t>(in_flight_.size()), done_, tasks_done_};
}

void GraphRunner::Report(const Key& key, const Status& error,
                         std::vector<std::pair<ObjectId, Tensor>> sealed,
                         const InstanceFigures& figures, const std::vector<ObjectId>& restored) {
  rpc::ScopedMessageBuilder message;
  auto finished = message.initRoot<proto::Envelope>().initBody().initInstanceFinished();
  finished.setGraphId(key.first);
  finished.setInstance(key.second);
  // A step's figures (the dashboard's per-rank memory); a submitted task's instance has none
  // worth a report.
  if (key.first < kFirstSchedulerGraphId) {
    auto report = finished.initReport();
    report.setGraphId(key.first);
    report.setInstance(key.second);
    auto peaks = report.initRolePeaks(static_cast<unsigned>(kObjectRoles));
    for (unsigned r = 0; r < kObjectRoles; ++r) peaks.set(r, figures.role_bytes.peak[r]);
    report.setModelStatePeak(figures.role_bytes.model_state_peak);
    report.setTransientPeak(figures.role_bytes.transient_peak);
    report.setTotalPeak(figures.role_bytes.total_peak);
    report.setTotalWithScratchPeak(figures.role_bytes.total_with_scratch_peak);
    report.setAllocatorPeak(figures.allocator_peak);
    report.setCollectiveBytesSent(figures.collective_bytes);
    report.setPushedBytes(figures.pushed_bytes);
    report.setWallMicros(static_cast<int64_t>(figures.wall_ms * 1000));
  }
  if (error.ok()) rpc::ToWire(figures.spans, finished.initSpans());
  Status status = error;
  std::vector<std::pair<ObjectId, std::string>> reported;  // id, inline bytes
  std::vector<int64_t> sizes;
  for (std::pair<ObjectId, Tensor>& output : sealed) {
    if (!status.ok()) break;
    const ObjectId id = output.first;
    Tensor& tensor = output.second;
    std::string data;
    if (tensor.bytes() <= settings_.inline_object_bytes) {
      Result<Tensor> host = HostCopyOf(tensor, executor_.Copier());  // a GPU's loss, say
      if (!host.ok()) {
        status =
            host.status().WithContext("reporting an output of graph " + std::to_string(key.first));
        break;
      }
      data.assign(static_cast<const char*>(host->raw_data()), static_cast<size_t>(host->bytes()));
    }
    const int64_t bytes = tensor.bytes();
    Status put = store_.Put(id, std::move(tensor));
    if (!put.ok()) {
      status = put.WithContext("sealing an output of graph " + std::to_string(key.first));
      break;
    }
    reported.emplace_back(id, std::move(data));
    sizes.push_back(bytes);
  }
  if (!status.ok()) {
    rpc::ToWire(status, finished.initError());
    auto put_back = finished.initRestored(static_cast<unsigned>(restored.size()));
    for (unsigned i = 0; i < restored.size(); ++i) put_back.set(i, restored[i].value());
  } else {
    auto outputs = finished.initOutputs(static_cast<unsigned>(reported.size()));
    for (unsigned i = 0; i < reported.size(); ++i) {
      outputs[i].setId(reported[i].first.value());
      outputs[i].setBytes(sizes[i]);
      const std::string& data = reported[i].second;
      if (!data.empty()) {
        outputs[i].setInline(
            capnp::Data::Reader(reinterpret_cast<const kj::byte*>(data.data()), data.size()));
      }
    }
  }
  send_(message);
}

}  // namespace tessera

// ClusterClient's objects and graphs (cluster_client.h): Put and Submit (batched), Release,
// Get (inline, held here, or pulled over the data plane, following a rebuilt object), Wait, and
// registered graphs.
#include <algorithm>
#include <cstring>
#include <set>

#include "client/cluster_client.h"
#include "core/logging.h"
#include "core/rpc/frame.h"
#include "core/rpc/wire.h"
#include "worker/task_runner.h"

namespace tessera {

ObjectRef::State::~State() {
  if (handed_over.load()) return;  // the scheduler let go of it with the run it was handed to
  if (auto owner_client = owner.lock()) owner_client->Release(id);
}

bool ObjectRef::handed_over() const { return state_ != nullptr && state_->handed_over.load(); }

namespace detail {

void ClusterClient::OnHandedBack(proto::HandedBack::Reader back) {
  std::vector<std::shared_ptr<ObjectRef::State>> kept;  // dropped outside the lock
  std::vector<ObjectId> unheld;
  {
    MutexLock lock(&handed_mutex_);
    for (uint64_t id : back.getIds()) {
      auto it = handed_.find(id);
      std::shared_ptr<ObjectRef::State> state;
      if (it != handed_.end()) {
        state = it->second.lock();
        handed_.erase(it);
      }
      if (state == nullptr) {
        unheld.emplace_back(id);
        continue;
      }
      state->handed_over.store(false);  // its last holder releases it, as any other
      kept.push_back(std::move(state));
    }
  }
  // Nothing here holds these any more (or never did): the reference the scheduler gave back goes
  // at once.
  for (ObjectId id : unheld) Release(id);
  kept.clear();
  GetLogger("driver")->info("graph {} instance {} failed; {} object(s) handed to it came back",
                            back.getGraphId(), back.getInstance(), back.getIds().size());
}

ObjectRef ClusterClient::MakeRef(ObjectId id, const TensorMeta& meta) {
  auto state = std::make_shared<ObjectRef::State>();
  state->id = id;
  state->meta = meta;
  state->owner = weak_from_this();
  return ObjectRef(std::move(state));
}

Result<ObjectRef> ClusterClient::Put(const Tensor& value) {
  if (!value.defined()) return InvalidArgument("Put of an undefined tensor");
  if (closed_) return close_reason_;
  const ObjectId id(NextId());
  ObjectSpec spec{id, fmt::format("put#{}", id.value() & ((uint64_t{1} << kIdSequenceBits) - 1)),
                  value.meta(), ObjectRole::kInput, TaskId()};
  std::string inline_data;
  if (value.bytes() <= settings_.inline_object_bytes) {
    inline_data.assign(static_cast<const char*>(value.raw_data()),
                       static_cast<size_t>(value.bytes()));
  } else {
    // Objects are immutable: keep a private copy, so the caller may reuse its tensor.
    TESSERA_ASSIGN_OR_RETURN(Tensor copy, value.Clone(allocator_));
    MutexLock lock(&held_mutex_);
    held_[id.value()] = std::move(copy);
  }
  {
    MutexLock lock(&batch_mutex_);
    puts_.emplace_back(std::move(spec), std::move(inline_data));
  }
  ScheduleFlush(FlushWhen::kSoon);
  return MakeRef(id, value.meta());
}

Result<std::vector<ObjectRef>> ClusterClient::Submit(const std::string& op,
                                                     const std::vector<ObjectRef>& inputs,
                                                     const Attrs& attrs,
                                                     const SubmitOptions& options) {
  if (closed_) return close_reason_;
  std::vector<TensorMeta> input_metas;
  for (const ObjectRef& input : inputs) {
    if (!input.valid()) return InvalidArgument("Submit of '{}' with an empty ObjectRef", op);
    input_metas.push_back(input.meta());
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<TensorMeta> output_metas,
                           registry_.InferShapes(op, input_metas, attrs));
  TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry_.Find(op));
  TaskSpec task;
  task.id = TaskId(NextId());
  task.name =
      options.name.empty()
          ? fmt::format("{}#{}", op, task.id.value() & ((uint64_t{1} << kIdSequenceBits) - 1))
          : options.name;
  task.op = op;
  task.attrs = attrs;
  task.pinned_worker = options.pinned_worker;
  task.priority = options.priority;
  for (const ObjectRef& input : inputs) task.inputs.push_back(input.id());
  for (const auto& [in, out] : def->in_place) task.donations.push_back(Donation{in, out});
  std::vector<ObjectSpec> outputs;
  std::vector<ObjectRef> refs;
  for (size_t j = 0; j < output_metas.size(); ++j) {
    const ObjectId id(NextId());
    task.outputs.push_back(id);
    task.memory_estimate_bytes += output_metas[j].bytes();
    outputs.push_back(ObjectSpec{id, fmt::format("{}:{}", task.name, def->output_names[j]),
                                 output_metas[j], ObjectRole::kOutput, task.id});
    refs.push_back(MakeRef(id, output_metas[j]));
  }
  {
    MutexLock lock(&batch_mutex_);
    submits_.emplace_back(std::move(task), std::move(outputs));
  }
  ScheduleFlush(FlushWhen::kSoon);
  return refs;
}

void ClusterClient::Release(ObjectId id) {
  if (closed_) return;
  {
    MutexLock lock(&ready_mutex_);
    ready_.erase(id.value());
    watched_.erase(id.value());
  }
  {
    MutexLock lock(&batch_mutex_);
    releases_.push_back(id.value());
  }
  ScheduleFlush(FlushWhen::kLazy);
}

Result<Tensor> ClusterClient::Get(const ObjectRef& ref, int timeout_ms) {
  if (!ref.valid()) return InvalidArgument("Get of an empty ObjectRef");
  TESSERA_ASSIGN_OR_RETURN(ReadyState state, AwaitReady(ref.id(), timeout_ms));
  TESSERA_RETURN_IF_ERROR(state.error);
  // On the host whatever device the object lives on (a GPU worker serves a host copy).
  TESSERA_ASSIGN_OR_RETURN(Tensor tensor, Tensor::Empty(OnHost(ref.meta()), allocator_));
  if (!state.inline_data.empty() || tensor.bytes() == 0) {
    if (static_cast<int64_t>(state.inline_data.size()) != tensor.bytes()) {
      return DataLoss("{} came back with {} bytes, {} expected", ref.id().ToString(),
                      state.inline_data.size(), tensor.bytes());
    }
    std::memcpy(tensor.raw_data(), state.inline_data.data(), state.inline_data.size());
    return tensor;
  }
  {
    MutexLock lock(&held_mutex_);
    auto it = held_.find(ref.id().value());
    if (it != held_.end()) return it->second.Clone(allocator_);
  }
  // The holder may die under the pull. The scheduler learns of it within the heartbeat bound
  // (at once when its connection closes) and then says where the object is now (rebuilt from
  // lineage elsewhere) or why it is gone; until it knows, it still names the dead holder.
  const auto verdict_deadline = std::chrono::steady_clock::now() +
                                std::chrono::milliseconds(settings_.heartbeat_timeout_ms + 2000);
  while (true) {
    if (state.address.empty()) {
      return Unavailable("{} has no holder to pull from", ref.id().ToString());
    }
    Status pulled =
        data_plane_->PullAndWait(state.address, ref.id(), tensor.raw_data(), tensor.bytes());
    if (pulled.ok()) return tensor;
    Result<ReadyState> again = Status::Ok();
    do {
      {
        MutexLock lock(&ready_mutex_);
        ready_.erase(ref.id().value());
        watched_.erase(ref.id().value());
      }
      // Waiting as long as the caller allows: a rebuild takes as long as its tasks.
      again = AwaitReady(ref.id(), timeout_ms);
      if (!again.ok()) return pulled;
      if (!again->error.ok()) return again->error;
      if (again->address != state.address || !again->inline_data.empty()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    } while (std::chrono::steady_clock::now() < verdict_deadline);
    if (again->address == state.address && again->inline_data.empty()) return pulled;
    state = std::move(*again);
    if (!state.inline_data.empty()) {
      std::memcpy(tensor.raw_data(), state.inline_data.data(),
                  std::min<size_t>(state.inline_data.size(), static_cast<size_t>(tensor.bytes())));
      return tensor;
    }
  }
}

Status ClusterClient::Wait(const std::vector<ObjectRef>& refs, int timeout_ms) {
  std::vector<ObjectId> ids;
  ids.reserve(refs.size());
  for (const ObjectRef& ref : refs) {
    if (!ref.valid()) return InvalidArgument("Wait on an empty ObjectRef");
    ids.push_back(ref.id());
  }
  Watch(ids);  // one batch of watches; then wait for all of them
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  MutexLock lock(&ready_mutex_);
  for (ObjectId id : ids) {
    if (!WaitReady(id.value(), timeout_ms < 0 ? std::nullopt : std::optional(deadline))) {
      return TimedOut("{} was not ready within {} ms", id.ToString(), timeout_ms);
    }
    auto it = ready_.find(id.value());
    if (it == ready_.end()) return close_reason_;
    if (!it->second.error.ok()) return it->second.error;
  }
  return Status::Ok();
}

Result<std::vector<const LoadedPlugin*>> ClusterClient::SendPlugins() {
  std::vector<const LoadedPlugin*> plugins = LoadedPlugins();
  MutexLock lock(&plugins_mutex_);
  for (const LoadedPlugin* plugin : plugins) {
    // A plugin loaded after Connect: its ops, for checking graphs here.
    if (plugins_in_registry_.insert(plugin->sha256).second) {
      TESSERA_RETURN_IF_ERROR(AddPluginTo(*plugin, registry_, {}));
    }
    if (!plugins_sent_.insert(plugin->sha256).second) continue;
    rpc::ScopedMessageBuilder message;
    auto wire = message.initRoot<proto::Envelope>().initBody().initLoadPlugin();
    wire.setName(plugin->name);
    wire.setSha256(plugin->sha256);
    wire.setLibrary(capnp::Data::Reader(
        reinterpret_cast<const capnp::byte*>(plugin->library.data()), plugin->library.size()));
    connection_->Send(message);
  }
  return plugins;
}

Result<GraphHandle> ClusterClient::RegisterGraph(const Graph& graph) {
  if (closed_) return close_reason_;
  TESSERA_RETURN_IF_ERROR(graph.Validate());
  // Every plugin of this process travels with the graph (its library before, once): the workers
  // then run its ops, and only with these very builds of them.
  TESSERA_ASSIGN_OR_RETURN(std::vector<const LoadedPlugin*> plugins, SendPlugins());
  for (const TaskSpec& task : graph.tasks()) {
    TESSERA_RETURN_IF_ERROR(
        registry_.Find(task.op).status().WithContext("task '" + task.name + "'"));
  }
  GraphHandle handle;
  handle.id_ = NextId();
  handle.graph_ = std::make_shared<const Graph>(graph);
  auto promise = std::make_shared<std::promise<Status>>();
  uint64_t request;
  {
    MutexLock lock(&ready_mutex_);
    request = next_request_++;
    reply_waiters_[request] = promise;
  }
  rpc::ScopedMessageBuilder message;
  auto envelope = message.initRoot<proto::Envelope>();
  envelope.setRequestId(request);
  auto wire = envelope.initBody().initRegisterGraph();
  wire.setGraphId(handle.id_);
  auto objects = wire.initObjects(static_cast<unsigned>(graph.num_objects()));
  for (unsigned i = 0; i < objects.size(); ++i) rpc::ToWire(graph.objects()[i], objects[i]);
  auto tasks = wire.initTasks(static_cast<unsigned>(graph.num_tasks()));
  for (unsigned i = 0; i < tasks.size(); ++i) {
    const TaskSpec& task = graph.tasks()[i];
    std::vector<ObjectSpec> outputs;
    outputs.reserve(task.outputs.size());
    for (ObjectId output : task.outputs) outputs.push_back(graph.object(output));
    rpc::ToWire(task, outputs, tasks[i]);
  }
  auto outputs = wire.initOutputs(static_cast<unsigned>(graph.OutputObjects().size()));
  for (unsigned i = 0; i < outputs.size(); ++i) outputs.set(i, graph.OutputObjects()[i].value());
  auto wire_plugins = wire.initPlugins(static_cast<unsigned>(plugins.size()));
  for (unsigned i = 0; i < plugins.size(); ++i) {
    wire_plugins[i].setName(plugins[i]->name);
    wire_plugins[i].setSha256(plugins[i]->sha256);
  }
  connection_->Send(message);
  std::future<Status> future = promise->get_future();
  if (future.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    return TimedOut("the scheduler did not answer the registration of a {}-task graph in 60 s",
                    graph.num_tasks());
  }
  TESSERA_RETURN_IF_ERROR(future.get());
  return handle;
}

Result<std::map<ObjectId, ObjectRef>> ClusterClient::RunGraph(
    const GraphHandle& handle, const std::map<ObjectId, ObjectRef>& inputs,
    std::vector<ObjectId>* handed_over) {
  if (closed_) return close_reason_;
  if (!handle.valid()) return InvalidArgument("RunGraph of an unregistered graph");
  const Graph& graph = handle.graph();
  std::vector<ObjectRef> bound;
  // Inputs whose only reference in this driver is the one in `inputs` (no other copy of the
  // ObjectRef anywhere: a caller that keeps one keeps the object), when handing over.
  std::set<ObjectId> sole;
  for (ObjectId input : graph.InputObjects()) {
    auto it = inputs.find(input);
    const ObjectSpec& spec = graph.object(input);
    if (it == inputs.end() || !it->second.valid()) {
      return InvalidArgument("graph input '{}' ({}) is not bound", spec.name, spec.meta.ToString());
    }
    if (!it->second.meta().BindsTo(spec.meta)) {
      return InvalidArgument("graph input '{}' expects {} but is bound to {}", spec.name,
                             spec.meta.ToString(), it->second.meta().ToString());
    }
    if (handed_over != nullptr && it->second.state_.use_count() == 1) sole.insert(input);
    bound.push_back(it->second);
  }
  // The scheduler binds only finished objects: wait for them here (usually already done).
  TESSERA_RETURN_IF_ERROR(Wait(bound, -1));
  std::map<ObjectId, ObjectRef> outputs;
  rpc::ScopedMessageBuilder message;
  auto run = message.initRoot<proto::Envelope>().initBody().initRunGraph();
  run.setGraphId(handle.id());
  run.setInstance(NextId());
  const std::vector<ObjectId> input_ids = graph.InputObjects();
  auto bindings = run.initInputs(static_cast<unsigned>(input_ids.size()));
  for (unsigned i = 0; i < input_ids.size(); ++i) {
    bindings[i].setObject(input_ids[i].value());
    bindings[i].initSource().setObject(inputs.at(input_ids[i]).id().value());
    bindings[i].setTakeOver(sole.contains(input_ids[i]));
  }
  const std::vector<ObjectId>& graph_outputs = graph.OutputObjects();
  auto ids = run.initOutputIds(static_cast<unsigned>(graph_outputs.size()));
  for (unsigned i = 0; i < graph_outputs.size(); ++i) {
    const ObjectId id(NextId());
    ids.set(i, id.value());
    outputs.emplace(graph_outputs[i], MakeRef(id, graph.object(graph_outputs[i]).meta));
  }
  // Queued batches (a Put of an input, a Release) must reach the scheduler first.
  Flush();
  {
    MutexLock lock(&handed_mutex_);
    std::erase_if(handed_, [](const auto& entry) { return entry.second.expired(); });
    for (ObjectId input : sole) {
      const std::shared_ptr<ObjectRef::State>& state = inputs.at(input).state_;
      state->handed_over.store(true);
      handed_[state->id.value()] = state;
      handed_over->push_back(input);
    }
  }
  connection_->Send(message);
  return outputs;
}

}  // namespace detail
}  // namespace tessera

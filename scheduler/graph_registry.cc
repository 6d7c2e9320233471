#include "scheduler/graph_registry.h"

#include <algorithm>
#include <set>

#include "core/collective_task.h"
#include "core/logging.h"
#include "core/rpc/wire.h"
#include "scheduler/messages.h"

namespace tessera {

Result<Graph> GraphFromWire(uint64_t graph_id, proto::RegisterGraph::Reader wire,
                            const rpc::WireLimits& limits) {
  Graph graph;
  for (proto::ObjectDecl::Reader decl : wire.getObjects()) {
    TESSERA_ASSIGN_OR_RETURN(ObjectSpec object, rpc::FromWire(decl, limits));
    if (object.id != ObjectId(static_cast<uint64_t>(graph.num_objects()) + 1)) {
      return InvalidArgument("graph {} object ids must be dense from 1", graph_id);
    }
    graph.AddObject(std::move(object.name), object.meta, object.role);
  }
  const auto known = [&](ObjectId id) {
    return id.valid() && id.value() <= static_cast<uint64_t>(graph.num_objects());
  };
  for (proto::Task::Reader wire_task : wire.getTasks()) {
    // Producers are not on the wire: they follow from the tasks (Graph::AddTask).
    TESSERA_ASSIGN_OR_RETURN(rpc::WireTask task, rpc::FromWire(wire_task, limits));
    const TaskSpec& spec = task.spec;
    if (spec.id != TaskId(static_cast<uint64_t>(graph.num_tasks()) + 1)) {
      return InvalidArgument("graph {} task ids must be dense from 1", graph_id);
    }
    for (ObjectId input : spec.inputs) {
      if (!known(input)) return InvalidArgument("task '{}' reads an unknown object", spec.name);
    }
    for (ObjectId output : spec.outputs) {
      if (!known(output) || graph.object(output).producer.valid() ||
          std::count(spec.outputs.begin(), spec.outputs.end(), output) > 1) {
        return InvalidArgument("task '{}' produces an unknown object or one another task produces",
                               spec.name);
      }
    }
    graph.AddTask(std::move(task.spec));
  }
  for (uint64_t output : wire.getOutputs()) {
    if (!known(ObjectId(output))) {
      return InvalidArgument("graph {} returns an unknown object", graph_id);
    }
    graph.MarkOutput(ObjectId(output));
  }
  TESSERA_RETURN_IF_ERROR(graph.Validate().WithContext(fmt::format("graph {}", graph_id)));
  return graph;
}

namespace {

// What a template computes, as text: every object's meta and role, every task's op, attributes,
// wiring, device, priority, pin, memory estimate and donations. Names and ids are left out, so
// the same computation on other objects maps to the same template.
// One task's part of a key, its inputs and outputs given as graph-local ids.
void AppendTaskKey(std::string& key, const TaskSpec& task, const std::vector<ObjectId>& inputs,
                   const std::vector<ObjectId>& outputs) {
  key += fmt::format("t{}|{}|{}|{}|{}|{}|", task.op, task.attrs.ToString(),
                     static_cast<int>(task.device_kind), task.priority, task.pinned_worker.value(),
                     task.memory_estimate_bytes);
  for (ObjectId input : inputs) key += fmt::format("i{},", input.value());
  for (ObjectId output : outputs) key += fmt::format("o{},", output.value());
  for (const Donation& donation : task.donations) {
    key += fmt::format("d{}>{},", donation.input_index, donation.output_index);
  }
  key += ';';
}

void AppendObjectKey(std::string& key, const TensorMeta& meta, ObjectRole role) {
  key += fmt::format("o{}:{};", meta.ToString(), static_cast<int>(role));
}

std::string KeyOf(const Graph& graph) {
  std::string key;
  for (const ObjectSpec& object : graph.objects()) AppendObjectKey(key, object.meta, object.role);
  for (const TaskSpec& task : graph.tasks()) AppendTaskKey(key, task, task.inputs, task.outputs);
  return key;
}

// KeyOf the one-task graph AddToTemplate(task, ...) builds, without building it: what a
// submitted task costs the scheduler when its template is known (most tasks).
std::string KeyOfOneTask(const TaskSpec& task, const std::vector<TensorMeta>& input_metas,
                         const std::vector<ObjectSpec>& outputs) {
  std::string key;
  std::vector<ObjectId> distinct;  // cluster ids, in order of first use: local ids 1, 2, ...
  std::vector<ObjectId> local_inputs, local_outputs;
  for (size_t i = 0; i < task.inputs.size(); ++i) {
    auto seen = std::find(distinct.begin(), distinct.end(), task.inputs[i]);
    if (seen == distinct.end()) {
      distinct.push_back(task.inputs[i]);
      AppendObjectKey(key, input_metas[i], ObjectRole::kInput);
      seen = distinct.end() - 1;
    }
    local_inputs.emplace_back(static_cast<uint64_t>(seen - distinct.begin()) + 1);
  }
  for (size_t j = 0; j < outputs.size(); ++j) {
    AppendObjectKey(key, outputs[j].meta, outputs[j].role);
    local_outputs.emplace_back(distinct.size() + j + 1);
  }
  AppendTaskKey(key, task, local_inputs, local_outputs);
  return key;
}

// Adds one member or task to a template graph: its distinct inputs (in order of first use) and
// its outputs become graph objects; ids are graph-local. `prefix` keeps names unique.
void AddToTemplate(Graph& graph, TaskSpec task, const std::vector<TensorMeta>& input_metas,
                   const std::vector<ObjectSpec>& outputs, const std::string& prefix) {
  std::vector<std::pair<ObjectId, ObjectId>> local_of;  // cluster id -> graph id
  for (size_t i = 0; i < task.inputs.size(); ++i) {
    ObjectId& input = task.inputs[i];
    auto seen = std::find_if(local_of.begin(), local_of.end(),
                             [&](const auto& pair) { return pair.first == input; });
    if (seen != local_of.end()) {
      input = seen->second;
      continue;
    }
    const ObjectId local = graph.AddObject(fmt::format("{}in{}", prefix, local_of.size()),
                                           input_metas[i], ObjectRole::kInput);
    local_of.emplace_back(input, local);
    input = local;
  }
  task.outputs.clear();
  for (size_t j = 0; j < outputs.size(); ++j) {
    task.outputs.push_back(
        graph.AddObject(fmt::format("{}out{}", prefix, j), outputs[j].meta, outputs[j].role));
  }
  task.name = prefix + task.op;
  task.after.clear();
  const std::vector<ObjectId> produced = task.outputs;
  graph.AddTask(std::move(task));
  for (ObjectId output : produced) graph.MarkOutput(output);
}

}  // namespace

GraphRegistry::GraphRegistry(Outbox* outbox, ParticipantTable* participants,
                             CollectiveGroups* groups, bool allow_plugins)
    : outbox_(outbox),
      participants_(participants),
      groups_(groups),
      plugins_(outbox, allow_plugins) {}

Status GraphRegistry::Register(WorkerId driver, uint64_t request_id,
                               proto::RegisterGraph::Reader wire, const rpc::WireLimits& limits) {
  const uint64_t id = wire.getGraphId();
  // A graph that cannot be placed is the driver's to hear about, not a protocol violation.
  auto refuse = [&](const Status& reason) {
    SendReply(*outbox_, driver, request_id, reason);
    return Status::Ok();
  };
  if (id == 0 || graphs_.contains(id)) {
    return refuse(InvalidArgument("graph id {} is invalid or in use", id));
  }
  if (id >= kFirstSchedulerGraphId) {
    return refuse(InvalidArgument("graph id {} is reserved for the scheduler's own graphs", id));
  }
  TESSERA_ASSIGN_OR_RETURN(Graph graph, GraphFromWire(id, wire, limits));
  if (graph.tasks().empty()) return refuse(InvalidArgument("graph {} has no tasks", id));
  Result<std::vector<PluginRef>> plugins = plugins_.Check(id, wire.getPlugins());
  if (!plugins.ok()) return refuse(plugins.status());
  PlacementView view;
  view.workers = participants_->WorkerLoads();
  std::erase_if(view.workers, [](const WorkerLoad& worker) { return !worker.alive; });
  if (view.workers.empty()) return refuse(Unavailable("no worker is alive to run graph {}", id));
  // A graph with GPU tasks (a plan on Device::Cuda: each worker's own GPU) runs on GPU workers
  // only, its host-side tasks included.
  const auto gpu_task =
      std::find_if(graph.tasks().begin(), graph.tasks().end(),
                   [](const TaskSpec& t) { return t.device_kind != DeviceKind::kCpu; });
  if (gpu_task != graph.tasks().end()) {
    std::erase_if(view.workers, [&](const WorkerLoad& worker) {
      const Participant* participant = participants_->Find(worker.id);
      return participant == nullptr || participant->gpu.empty();
    });
    if (view.workers.empty()) {
      return refuse(Infeasible(
          "graph {} runs task '{}' on a GPU, and no GPU worker is alive (start some with "
          "`tessera start --gpus all`, or train_gpt2 --device cuda --workers N; or plan for the "
          "CPU)",
          id, gpu_task->name));
    }
  }
  Result<std::vector<WorkerId>> placed = PlaceGraph(graph, view);
  if (!placed.ok()) return refuse(placed.status());
  PlacedGraph entry;
  entry.id = id;
  entry.driver = driver;
  entry.objects = graph.objects();
  entry.tasks = graph.tasks();
  entry.task_worker = std::move(*placed);
  for (uint64_t output : wire.getOutputs()) entry.outputs.push_back(ObjectId(output));
  entry.plugins = *std::move(plugins);
  const Status completed = Complete(entry);
  if (!completed.ok()) return refuse(completed);
  // Each involved worker gets its part once, now.
  SendPartsTo(entry, entry.workers);
  GetLogger("scheduler")
      ->info("{} registered graph {}: {} tasks on {} worker(s)", driver.ToString(), id,
             entry.tasks.size(), entry.workers.size());
  graphs_.emplace(id, std::move(entry));
  SendReply(*outbox_, driver, request_id, Status::Ok());
  return Status::Ok();
}

Status GraphRegistry::Complete(PlacedGraph& graph) {
  TESSERA_RETURN_IF_ERROR(AssignCollectives(graph));
  for (const ObjectSpec& object : graph.objects) {
    if (!object.producer.valid()) graph.inputs.push_back(object.id);
  }
  graph.workers = graph.task_worker;
  std::sort(graph.workers.begin(), graph.workers.end());
  graph.workers.erase(std::unique(graph.workers.begin(), graph.workers.end()), graph.workers.end());
  return Status::Ok();
}

Status GraphRegistry::AssignCollectives(PlacedGraph& graph) {
  TESSERA_RETURN_IF_ERROR(ValidateCollectives(graph.tasks));
  TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> order,
                           OrderCollectives(graph.tasks, [&](ObjectId object) {
                             return graph.objects[object.value() - 1].producer;
                           }));
  std::map<int64_t, std::vector<size_t>> members;  // collective -> task indices by rank
  std::map<int64_t, int> channel_of;               // collective -> its channel
  for (size_t t = 0; t < graph.tasks.size(); ++t) {
    std::optional<CollectiveMembership> membership = *CollectiveOf(graph.tasks[t]);
    if (!membership) continue;
    channel_of[membership->collective] = membership->channel;
    auto& slots = members[membership->collective];
    slots.resize(static_cast<size_t>(membership->group_size));
    slots[static_cast<size_t>(membership->rank)] = t;
  }
  // Each worker runs each channel's members in the one global order: positions count per worker
  // and channel.
  for (int64_t collective : order) {
    const std::vector<size_t>& slots = members.at(collective);
    const int channel = channel_of.at(collective);
    std::vector<WorkerId> workers;
    workers.reserve(slots.size());
    for (size_t t : slots) workers.push_back(graph.task_worker[t]);
    const uint64_t group = groups_->GroupFor(workers, channel);
    graph.groups.insert(group);
    for (size_t t : slots) {
      graph.tasks[t].attrs.Set(kGroupAttr, static_cast<int64_t>(group));
      graph.tasks[t].attrs.Set(kPositionAttr, graph.members[{graph.task_worker[t], channel}]++);
    }
  }
  return Status::Ok();
}

Result<uint64_t> GraphRegistry::TaskTemplate(const TaskSpec& task,
                                             const std::vector<TensorMeta>& input_metas,
                                             const std::vector<ObjectSpec>& outputs) {
  std::string key = KeyOfOneTask(task, input_metas, outputs);
  if (auto found = template_of_key_.find(key); found != template_of_key_.end()) {
    return Touch(found->second);  // known: the same graph, valid before
  }
  Graph graph;
  AddToTemplate(graph, task, input_metas, outputs, "");
  TESSERA_RETURN_IF_ERROR(graph.Validate().WithContext(fmt::format("task '{}'", task.name)));
  TESSERA_CHECK(KeyOf(graph) == key, "a one-task template's key differs from its graph's: {}", key);
  return TemplateFor(std::move(key), std::move(graph));
}

Result<uint64_t> GraphRegistry::CollectiveTemplate(
    const std::vector<const TaskSpec*>& members,
    const std::vector<std::vector<TensorMeta>>& input_metas,
    const std::vector<const std::vector<ObjectSpec>*>& outputs) {
  Graph graph;
  for (size_t rank = 0; rank < members.size(); ++rank) {
    TaskSpec member = *members[rank];
    // The driver's collective id names one collective; the template stands for any.
    member.attrs.Set(kCollectiveAttr, int64_t{1});
    AddToTemplate(graph, std::move(member), input_metas[rank], *outputs[rank],
                  fmt::format("rank{}/", rank));
  }
  TESSERA_RETURN_IF_ERROR(graph.Validate().WithContext(
      fmt::format("collective of task '{}'", members.empty() ? "" : members[0]->name)));
  std::string key = KeyOf(graph);
  return TemplateFor(std::move(key), std::move(graph));
}

uint64_t GraphRegistry::Touch(uint64_t template_id) {
  lru_.splice(lru_.begin(), lru_, templates_.at(template_id).lru);
  return template_id;
}

Result<uint64_t> GraphRegistry::TemplateFor(std::string key, Graph graph) {
  if (auto found = template_of_key_.find(key); found != template_of_key_.end()) {
    return Touch(found->second);
  }
  const uint64_t id = next_id_++;
  lru_.push_front(id);
  template_of_key_.emplace(key, id);
  templates_.emplace(id, Template{std::move(graph), std::move(key), {}, 0, lru_.begin()});
  Evict();
  return id;
}

Result<PlacedGraph*> GraphRegistry::Place(uint64_t template_id, const PlacementView& view) {
  Template& source = templates_.at(template_id);
  TESSERA_ASSIGN_OR_RETURN(std::vector<WorkerId> placement, PlaceGraph(source.graph, view));
  if (auto found = source.placed.find(placement); found != source.placed.end()) {
    return &graphs_.at(found->second);
  }
  PlacedGraph entry;
  entry.id = next_id_++;
  entry.template_id = template_id;
  entry.objects = source.graph.objects();
  entry.tasks = source.graph.tasks();
  entry.task_worker = placement;
  entry.outputs = source.graph.OutputObjects();
  TESSERA_RETURN_IF_ERROR(Complete(entry));
  source.placed.emplace(std::move(placement), entry.id);
  return &graphs_.emplace(entry.id, std::move(entry)).first->second;
}

void GraphRegistry::SendPartsTo(PlacedGraph& graph, const std::vector<WorkerId>& workers) {
  std::vector<WorkerId> missing;
  for (WorkerId worker : workers) {
    if (graph.has_part.insert(worker).second) missing.push_back(worker);
  }
  if (missing.empty()) return;
  GraphPart part{graph.id, graph.objects, graph.tasks,  graph.task_worker,
                 {},       graph.outputs, graph.plugins};
  for (WorkerId worker : graph.workers) {
    part.worker_addresses.emplace_back(worker, participants_->DataAddress(worker));
  }
  // Each plugin's library before the first part that names it: the worker loads it first.
  for (WorkerId worker : missing) plugins_.SendTo(worker, graph.plugins);
  SendGraphPart(*outbox_, missing, part);
}

PlacedGraph* GraphRegistry::Find(uint64_t id) {
  auto it = graphs_.find(id);
  return it == graphs_.end() ? nullptr : &it->second;
}

const PlacedGraph* GraphRegistry::Find(uint64_t id) const {
  auto it = graphs_.find(id);
  return it == graphs_.end() ? nullptr : &it->second;
}

const std::vector<TaskSpec>* GraphRegistry::Tasks(uint64_t graph) const {
  const PlacedGraph* found = Find(graph);
  return found == nullptr ? nullptr : &found->tasks;
}

const std::vector<ObjectSpec>* GraphRegistry::Objects(uint64_t graph) const {
  const PlacedGraph* found = Find(graph);
  return found == nullptr ? nullptr : &found->objects;
}

void GraphRegistry::InstanceStarted(PlacedGraph& graph) {
  ++graph.running;
  if (graph.template_id != 0) ++templates_.at(graph.template_id).running;
}

void GraphRegistry::InstanceEnded(PlacedGraph& graph) {
  const uint64_t template_id = graph.template_id;
  if (--graph.running == 0 && !graph.retired.empty()) Forget(graph.id);  // `graph` is gone
  if (template_id == 0) return;
  --templates_.at(template_id).running;
  Evict();
}

void GraphRegistry::WorkerDied(WorkerId worker) {
  plugins_.WorkerDied(worker);
  std::vector<PlacedGraph*> placed_on_it;
  for (auto& [id, graph] : graphs_) {
    graph.has_part.erase(worker);
    if (graph.retired.empty() &&
        std::find(graph.workers.begin(), graph.workers.end(), worker) != graph.workers.end()) {
      placed_on_it.push_back(&graph);
    }
  }
  const std::string reason =
      fmt::format("it was placed on {}, which died", participants_->Describe(worker));
  for (PlacedGraph* graph : placed_on_it) Retire(*graph, reason);
}

void GraphRegistry::DriverGone(WorkerId driver) {
  std::vector<PlacedGraph*> its_graphs;
  for (auto& [id, graph] : graphs_) {
    if (graph.driver == driver && graph.retired.empty()) its_graphs.push_back(&graph);
  }
  const std::string reason = fmt::format("its driver {} left", driver.ToString());
  for (PlacedGraph* graph : its_graphs) Retire(*graph, reason);
}

const std::string* GraphRegistry::RetiredReason(WorkerId driver, uint64_t id) const {
  if (const PlacedGraph* graph = Find(id); graph != nullptr) {
    return graph->driver == driver && !graph->retired.empty() ? &graph->retired : nullptr;
  }
  for (const RetiredGraph& retired : retired_) {
    if (retired.id == id && retired.driver == driver) return &retired.reason;
  }
  return nullptr;
}

void GraphRegistry::Retire(PlacedGraph& graph, std::string reason) {
  graph.retired = std::move(reason);
  if (graph.template_id != 0) {
    std::erase_if(templates_.at(graph.template_id).placed,
                  [&](const auto& placed) { return placed.second == graph.id; });
  }
  if (graph.running == 0) Forget(graph.id);
}

void GraphRegistry::Forget(uint64_t id) {
  auto it = graphs_.find(id);
  if (it == graphs_.end()) return;
  const PlacedGraph& graph = it->second;
  const uint64_t ids[] = {id};
  for (WorkerId worker : graph.has_part) SendForgetGraphs(*outbox_, worker, ids);
  if (graph.template_id == 0) {
    retired_.push_back(RetiredGraph{id, graph.driver, graph.retired});
    if (retired_.size() > kMaxRetired) retired_.pop_front();
  }
  graphs_.erase(it);
}

void GraphRegistry::Evict() {
  for (auto it = lru_.rbegin(); templates_.size() > kMaxTemplates && it != lru_.rend();) {
    const uint64_t id = *it;
    Template& victim = templates_.at(id);
    if (victim.running > 0) {
      ++it;
      continue;
    }
    std::map<WorkerId, std::vector<uint64_t>> forget;  // worker -> its parts of the template
    for (const auto& [placement, placed] : victim.placed) {
      for (WorkerId worker : graphs_.at(placed).has_part) forget[worker].push_back(placed);
      graphs_.erase(placed);
    }
    for (const auto& [worker, ids] : forget) SendForgetGraphs(*outbox_, worker, ids);
    template_of_key_.erase(victim.key);
    it = std::make_reverse_iterator(lru_.erase(std::next(it).base()));
    templates_.erase(id);
  }
}

}  // namespace tessera

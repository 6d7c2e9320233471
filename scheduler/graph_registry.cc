#include "scheduler/graph_registry.h"

#include <algorithm>
#include <set>

#include "core/collective_task.h"
#include "core/logging.h"
#include "core/rpc/wire.h"
#include "scheduler/messages.h"
#include "scheduler/placement.h"

namespace tessera {

Result<Graph> GraphFromWire(uint64_t graph_id, proto::RegisterGraph::Reader wire) {
  Graph graph;
  for (proto::ObjectDecl::Reader decl : wire.getObjects()) {
    TESSERA_ASSIGN_OR_RETURN(ObjectSpec object, rpc::FromWire(decl));
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
    TESSERA_ASSIGN_OR_RETURN(rpc::WireTask task, rpc::FromWire(wire_task));
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

GraphRegistry::GraphRegistry(Outbox* outbox, ObjectDirectory* objects,
                             ParticipantTable* participants, CollectiveGroups* groups)
    : outbox_(outbox), objects_(objects), participants_(participants), groups_(groups) {}

Status GraphRegistry::Register(WorkerId driver, uint64_t request_id,
                               proto::RegisterGraph::Reader wire) {
  const uint64_t id = wire.getGraphId();
  // A graph that cannot be placed is the driver's to hear about, not a protocol violation.
  auto refuse = [&](const Status& reason) {
    SendReply(*outbox_, driver, request_id, reason);
    return Status::Ok();
  };
  if (id == 0 || graphs_.contains(id)) {
    return refuse(InvalidArgument("graph id {} is invalid or in use", id));
  }
  TESSERA_ASSIGN_OR_RETURN(Graph graph, GraphFromWire(id, wire));
  std::vector<WorkerId> alive = participants_->AliveWorkers();
  if (alive.empty()) return refuse(Unavailable("no worker is alive to run graph {}", id));
  // A graph with GPU tasks (a plan on Device::Cuda: each worker's own GPU) runs on GPU workers
  // only, its host-side tasks included.
  const auto gpu_task =
      std::find_if(graph.tasks().begin(), graph.tasks().end(),
                   [](const TaskSpec& t) { return t.device_kind != DeviceKind::kCpu; });
  if (gpu_task != graph.tasks().end()) {
    std::erase_if(alive, [&](WorkerId worker) {
      const Participant* participant = participants_->Find(worker);
      return participant == nullptr || participant->gpu.empty();
    });
    if (alive.empty()) {
      return refuse(Infeasible(
          "graph {} runs task '{}' on a GPU, and no GPU worker is alive (start some with "
          "`tessera start --gpus all`, or train_gpt2 --device cuda --workers N; or plan for the "
          "CPU)",
          id, gpu_task->name));
    }
  }
  Result<std::vector<WorkerId>> placed = PlaceGraph(graph, alive);
  if (!placed.ok()) return refuse(placed.status());
  GraphEntry entry;
  entry.id = id;
  entry.driver = driver;
  entry.objects = graph.objects();
  entry.tasks = graph.tasks();
  entry.task_worker = std::move(*placed);
  const Status collectives = AssignCollectives(entry);
  if (!collectives.ok()) return refuse(collectives);
  for (uint64_t output : wire.getOutputs()) entry.outputs.push_back(ObjectId(output));
  entry.inputs = graph.InputObjects();
  entry.workers = entry.task_worker;
  std::sort(entry.workers.begin(), entry.workers.end());
  entry.workers.erase(std::unique(entry.workers.begin(), entry.workers.end()), entry.workers.end());
  if (entry.workers.empty()) return refuse(InvalidArgument("graph {} has no tasks", id));
  // Each involved worker gets its part once.
  GraphPart part{id, entry.objects, entry.tasks, entry.task_worker, {}, entry.outputs};
  for (WorkerId worker : entry.workers) {
    part.worker_addresses.emplace_back(worker, participants_->DataAddress(worker));
  }
  SendGraphPart(*outbox_, entry.workers, part);
  GetLogger("scheduler")
      ->info("{} registered graph {}: {} tasks on {} worker(s)", driver.ToString(), id,
             entry.tasks.size(), entry.workers.size());
  graphs_.emplace(id, std::move(entry));
  SendReply(*outbox_, driver, request_id, Status::Ok());
  return Status::Ok();
}

Status GraphRegistry::AssignCollectives(GraphEntry& graph) {
  TESSERA_RETURN_IF_ERROR(ValidateCollectives(graph.tasks));
  TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> order,
                           OrderCollectives(graph.tasks, [&](ObjectId object) {
                             return graph.objects[object.value() - 1].producer;
                           }));
  std::map<int64_t, std::vector<size_t>> members;  // collective -> task indices by rank
  for (size_t t = 0; t < graph.tasks.size(); ++t) {
    std::optional<CollectiveMembership> membership = *CollectiveOf(graph.tasks[t]);
    if (!membership) continue;
    auto& slots = members[membership->collective];
    slots.resize(static_cast<size_t>(membership->group_size));
    slots[static_cast<size_t>(membership->rank)] = t;
  }
  // Each worker runs its members in the one global order: positions count per worker.
  std::map<WorkerId, int64_t> next_position;
  for (int64_t collective : order) {
    const std::vector<size_t>& slots = members.at(collective);
    std::vector<WorkerId> workers;
    for (size_t t : slots) workers.push_back(graph.task_worker[t]);
    const uint64_t group = groups_->GroupFor(workers);
    graph.groups.insert(group);
    for (size_t t : slots) {
      graph.tasks[t].attrs.Set(kGroupAttr, static_cast<int64_t>(group));
      graph.tasks[t].attrs.Set(kPositionAttr, next_position[graph.task_worker[t]]++);
    }
  }
  return Status::Ok();
}

Result<std::map<uint64_t, const ObjectEntry*>> GraphRegistry::Bind(
    const GraphEntry& graph, proto::RunGraph::Reader run) const {
  Status error;  // the last wrong binding's
  std::map<uint64_t, const ObjectEntry*> bindings;
  for (proto::Binding::Reader binding : run.getInputs()) {
    const uint64_t local = binding.getObject();
    const ObjectEntry* object = objects_->Find(ObjectId(binding.getSource().getObject()));
    if (local == 0 || local > graph.objects.size()) {
      error = InvalidArgument("binding of unknown graph object {}", local);
    } else if (object == nullptr || !object->finished()) {
      error = InvalidArgument(
          "input '{}' of graph {} is bound to an object that is not "
          "ready (wait for it first)",
          graph.objects[local - 1].name, graph.id);
    } else if (!object->error.ok()) {
      error = object->error;
    } else if (!object->spec.meta.BindsTo(graph.objects[local - 1].meta)) {
      error = InvalidArgument(
          "input '{}' of graph {} is {} but was bound to {}", graph.objects[local - 1].name,
          graph.id, graph.objects[local - 1].meta.ToString(), object->spec.meta.ToString());
    } else {
      bindings[local] = object;
    }
  }
  for (ObjectId input : graph.inputs) {
    if (error.ok() && !bindings.contains(input.value())) {
      error = InvalidArgument("input '{}' of graph {} is not bound",
                              graph.objects[input.value() - 1].name, graph.id);
    }
  }
  if (!error.ok()) return error;
  return bindings;
}

Status GraphRegistry::Run(WorkerId driver, uint64_t request_id, proto::RunGraph::Reader run) {
  auto it = graphs_.find(run.getGraphId());
  if (it == graphs_.end() || it->second.driver != driver) {
    SendReply(*outbox_, driver, request_id,
              NotFound("graph {} is not registered by this driver", run.getGraphId()));
    return Status::Ok();
  }
  const GraphEntry& graph = it->second;
  const InstanceKey key(graph.id, run.getInstance());
  if (instances_.contains(key)) {
    return InvalidArgument("instance {} of graph {} is already running", key.second, key.first);
  }
  if (run.getOutputIds().size() != graph.outputs.size()) {
    return InvalidArgument("run of graph {} names {} outputs, the graph has {}", graph.id,
                           run.getOutputIds().size(), graph.outputs.size());
  }
  InstanceEntry instance;
  instance.graph = graph.id;
  instance.instance = run.getInstance();
  instance.driver = driver;
  // Outputs: new cluster objects, referenced by the driver, sealed where they are produced.
  for (unsigned i = 0; i < graph.outputs.size(); ++i) {
    const ObjectId id(run.getOutputIds()[i]);
    if (!id.valid() || objects_->contains(id)) {
      return InvalidArgument("output id {} of graph {} is invalid or in use", id.ToString(),
                             graph.id);
    }
    ObjectSpec spec = graph.objects[graph.outputs[i].value() - 1];
    spec.id = id;
    spec.producer = TaskId();
    objects_->Declare(spec, driver);
    instance.outputs.push_back(id);
  }
  // Inputs: every graph input bound to a sealed cluster object of the same meta.
  Result<std::map<uint64_t, const ObjectEntry*>> bindings = Bind(graph, run);
  if (!bindings.ok()) {
    for (ObjectId id : instance.outputs) objects_->Fail(id, bindings.status());
    return Status::Ok();
  }
  GraphRun message{graph.id, instance.instance, instance.outputs, {}, {}};
  for (const auto& [local, object] : *bindings) {
    instance.bound.push_back(object->spec.id);
    objects_->AddUse(object->spec.id);
    if (object->inline_data.empty()) {
      message.inputs.emplace_back(local, SourceOf(*object, *participants_));
    } else {
      message.inline_inputs.push_back(InlineObject{local, object->inline_data});
    }
  }
  instance.pending = graph.workers;
  SendRunGraph(*outbox_, graph.workers, message);
  instances_.emplace(key, std::move(instance));
  return Status::Ok();
}

Status GraphRegistry::InstanceFinished(WorkerId worker, proto::InstanceFinished::Reader finished) {
  const InstanceKey key(finished.getGraphId(), finished.getInstance());
  auto it = instances_.find(key);
  if (it == instances_.end()) return Status::Ok();  // already failed and closed
  InstanceEntry& instance = it->second;
  auto& pending = instance.pending;
  if (std::find(pending.begin(), pending.end(), worker) == pending.end()) return Status::Ok();
  pending.erase(std::remove(pending.begin(), pending.end(), worker), pending.end());
  if (finished.hasError()) {
    FailInstance(instance, worker,
                 rpc::FromWire(finished.getError()).WithContext(participants_->Describe(worker)));
  } else {
    std::set<uint64_t> sealed;
    for (proto::SealedObject::Reader output : finished.getOutputs()) {
      const ObjectId id(output.getId());
      if (std::find(instance.outputs.begin(), instance.outputs.end(), id) ==
          instance.outputs.end()) {
        return InvalidArgument("{} sealed {}, which is not an output of the instance",
                               worker.ToString(), id.ToString());
      }
      // Twice in one report: the first seal may already have freed it (its driver let go).
      if (!sealed.insert(id.value()).second) {
        return InvalidArgument("{} sealed {} twice in one report", worker.ToString(),
                               id.ToString());
      }
      const ObjectEntry* object = objects_->Find(id);
      if (object == nullptr || object->finished()) continue;  // settled meanwhile: keep that
      const auto data = output.getInline();
      objects_->Seal(id, worker, output.getBytes(),
                     std::string(reinterpret_cast<const char*>(data.begin()), data.size()));
    }
  }
  MaybeFinishInstance(key);
  return Status::Ok();
}

void GraphRegistry::FailInstance(InstanceEntry& instance, WorkerId skip, const Status& error) {
  if (!instance.error.ok()) return;
  instance.error = error;
  GetLogger("scheduler")
      ->warn("graph {} instance {} failed: {}", instance.graph, instance.instance,
             error.ToString());
  for (WorkerId worker : instance.pending) {
    if (worker != skip) {
      SendCancelInstance(*outbox_, worker, instance.graph, instance.instance, error);
    }
  }
  // Every member of the instance's groups drops the formation, also where its part of the
  // collective had finished: the next collective of the group forms it again on all of them
  // (after the cancels above, on each worker's ordered connection).
  if (auto graph = graphs_.find(instance.graph); graph != graphs_.end()) {
    for (uint64_t group : graph->second.groups) groups_->Abort(group, error);
  }
}

void GraphRegistry::MaybeFinishInstance(const InstanceKey& key) {
  auto it = instances_.find(key);
  if (it == instances_.end()) return;
  if (!it->second.pending.empty() && it->second.error.ok()) return;
  const InstanceEntry done = std::move(it->second);
  instances_.erase(it);
  for (ObjectId id : done.outputs) {
    const ObjectEntry* object = objects_->Find(id);
    if (object == nullptr || object->finished()) continue;
    objects_->Fail(id, done.error.ok() ? Internal("graph {} finished without producing {}",
                                                  done.graph, object->spec.name)
                                       : done.error);
  }
  for (ObjectId id : done.bound) objects_->ReleaseUse(id);
}

void GraphRegistry::WorkerDied(WorkerId worker, const std::string& who, const Status& reason) {
  std::vector<InstanceKey> broken;
  for (const auto& [key, instance] : instances_) {
    if (std::find(instance.pending.begin(), instance.pending.end(), worker) !=
        instance.pending.end()) {
      broken.push_back(key);
    }
  }
  for (const InstanceKey& key : broken) {
    InstanceEntry& instance = instances_.at(key);
    auto& pending = instance.pending;
    pending.erase(std::remove(pending.begin(), pending.end(), worker), pending.end());
    FailInstance(instance, worker,
                 Unavailable("{} died while running its part of graph {} (instance {}): {}", who,
                             key.first, key.second, reason.message()));
    MaybeFinishInstance(key);
  }
}

const std::vector<TaskSpec>* GraphRegistry::Tasks(uint64_t graph) const {
  auto it = graphs_.find(graph);
  return it == graphs_.end() ? nullptr : &it->second.tasks;
}

const std::vector<ObjectSpec>* GraphRegistry::Objects(uint64_t graph) const {
  auto it = graphs_.find(graph);
  return it == graphs_.end() ? nullptr : &it->second.objects;
}

bool GraphRegistry::Running(uint64_t graph, uint64_t instance) const {
  if (instance != 0) return instances_.contains({graph, instance});
  auto it = instances_.lower_bound({graph, 0});
  return it != instances_.end() && it->first.first == graph;
}

}  // namespace tessera

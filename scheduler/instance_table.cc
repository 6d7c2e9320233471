#include "scheduler/instance_table.h"

#include <algorithm>
#include <set>

#include "core/logging.h"
#include "core/rpc/wire.h"
#include "scheduler/messages.h"

namespace tessera {

InstanceTable::InstanceTable(Outbox* outbox, ObjectDirectory* objects,
                             ParticipantTable* participants, CollectiveGroups* groups,
                             GraphRegistry* graphs)
    : outbox_(outbox),
      objects_(objects),
      participants_(participants),
      groups_(groups),
      graphs_(graphs) {}

Result<std::vector<std::pair<uint64_t, const ObjectEntry*>>> InstanceTable::Bind(
    const PlacedGraph& graph, proto::RunGraph::Reader run) const {
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
  return std::vector<std::pair<uint64_t, const ObjectEntry*>>(bindings.begin(), bindings.end());
}

Status InstanceTable::RunForDriver(WorkerId driver, uint64_t request_id,
                                   proto::RunGraph::Reader run) {
  Status started = StartForDriver(driver, request_id, run);
  // The driver handed these over with the run, whatever became of it (a started instance holds
  // uses of its own; a refused run's objects are freed unless something else holds them).
  for (proto::Binding::Reader binding : run.getInputs()) {
    if (binding.getTakeOver()) objects_->Release(driver, ObjectId(binding.getSource().getObject()));
  }
  return started;
}

bool InstanceTable::MayTakeOver(const PlacedGraph& graph, const ObjectEntry& object,
                                WorkerId driver, int bound_times,
                                const std::set<WorkerId>& readers) const {
  if (bound_times != 1 || !object.sealed || !object.error.ok() || object.driver_refs != 1 ||
      objects_->DriverRefs(driver, object.spec.id) != 1 || object.pending_uses != 0 ||
      !object.waiting_tasks.empty() || !object.watchers.empty() || object.holders.size() != 1) {
    return false;
  }
  const WorkerId holder = object.holders.front();
  if (std::find(graph.workers.begin(), graph.workers.end(), holder) == graph.workers.end()) {
    return false;
  }
  // A small object travels inline to the other readers; a large one is pulled from its holder,
  // so then the holder must be its only reader.
  if (!object.inline_data.empty()) return true;
  return readers.size() == 1 && *readers.begin() == holder;
}

Status InstanceTable::StartForDriver(WorkerId driver, uint64_t request_id,
                                     proto::RunGraph::Reader run) {
  PlacedGraph* graph = graphs_->Find(run.getGraphId());
  if (const std::string* retired = graphs_->RetiredReason(driver, run.getGraphId())) {
    SendReply(*outbox_, driver, request_id,
              Unavailable("graph {} can no longer run: {}; register it again to run it on the "
                          "workers there are",
                          run.getGraphId(), *retired));
    return Status::Ok();
  }
  if (graph == nullptr || graph->driver != driver) {
    SendReply(*outbox_, driver, request_id,
              NotFound("graph {} is not registered by this driver", run.getGraphId()));
    return Status::Ok();
  }
  const Key key(graph->id, run.getInstance());
  if (instances_.contains(key)) {
    return InvalidArgument("instance {} of graph {} is already running", key.second, key.first);
  }
  if (run.getOutputIds().size() != graph->outputs.size()) {
    return InvalidArgument("run of graph {} names {} outputs, the graph has {}", graph->id,
                           run.getOutputIds().size(), graph->outputs.size());
  }
  InstanceStart start{.graph = graph, .instance = key.second, .driver = driver};
  // Outputs: new cluster objects, referenced by the driver, sealed where they are produced.
  for (unsigned i = 0; i < graph->outputs.size(); ++i) {
    const ObjectId id(run.getOutputIds()[i]);
    if (!id.valid() || objects_->contains(id) ||
        std::find(start.outputs.begin(), start.outputs.end(), id) != start.outputs.end()) {
      return InvalidArgument("output id {} of graph {} is invalid or in use", id.ToString(),
                             graph->id);
    }
    start.outputs.push_back(id);
  }
  for (size_t i = 0; i < start.outputs.size(); ++i) {
    ObjectSpec spec = graph->objects[graph->outputs[i].value() - 1];
    spec.id = start.outputs[i];
    spec.producer = TaskId();
    objects_->Declare(spec, driver);
  }
  // Inputs: every graph input bound to a sealed cluster object of the same meta.
  Result<std::vector<std::pair<uint64_t, const ObjectEntry*>>> bindings = Bind(*graph, run);
  if (!bindings.ok()) {
    for (ObjectId id : start.outputs) objects_->Fail(id, bindings.status());
    return Status::Ok();
  }
  start.bindings = *std::move(bindings);
  for (proto::Binding::Reader binding : run.getInputs()) {
    if (binding.getTakeOver()) start.handed_over.emplace_back(binding.getSource().getObject());
  }
  Start(std::move(start));
  return Status::Ok();
}

std::vector<CollectiveBase> InstanceTable::TakeCollectiveBases(const PlacedGraph& graph) {
  std::vector<CollectiveBase> bases;
  for (const auto& [where, members] : graph.members) {
    int64_t& next = next_position_[where];
    bases.push_back(CollectiveBase{where.first, where.second, next});
    next += members;
  }
  return bases;
}

void InstanceTable::Start(InstanceStart start) {
  PlacedGraph& graph = *start.graph;
  InstanceEntry instance;
  instance.graph = &graph;
  instance.instance = start.instance;
  instance.driver = start.driver;
  instance.outputs = std::move(start.outputs);
  instance.observer = start.observer;
  instance.pending = graph.workers;
  GraphRun message{graph.id, instance.instance, instance.outputs, {}, {}};
  message.task_names = start.task_names;
  message.collective_ids = start.collective_ids;
  if (!start.handed_over.empty()) {
    // One pass over the tasks: which workers read each graph input.
    std::map<uint64_t, std::set<WorkerId>> readers;
    for (size_t t = 0; t < graph.tasks.size(); ++t) {
      for (ObjectId input : graph.tasks[t].inputs)
        readers[input.value()].insert(graph.task_worker[t]);
    }
    const std::set<ObjectId> handed_over(start.handed_over.begin(), start.handed_over.end());
    std::map<ObjectId, int> bound_times;
    for (const auto& [local, object] : start.bindings) ++bound_times[object->spec.id];
    for (const auto& [local, object] : start.bindings) {
      const ObjectId id = object->spec.id;
      if (handed_over.contains(id) &&
          MayTakeOver(graph, *object, instance.driver, bound_times[id], readers[local])) {
        message.take_over.push_back(local);
        instance.taken_over[object->holders.front()].insert(id);
      }
    }
  }
  for (const auto& [local, object] : start.bindings) {
    if (instance.observer == nullptr) {  // an observer holds its inputs' uses itself
      instance.bound.push_back(object->spec.id);
      objects_->AddUse(object->spec.id);
    }
    if (object->inline_data.empty()) {
      message.inputs.emplace_back(local, SourceOf(*object, *participants_));
    } else {
      message.inline_inputs.push_back(InlineObject{local, object->inline_data});
      // A small object one of the graph's workers holds (an output of the last step: this
      // step's state) is bound to it as well: that worker reads its own copy instead of making a
      // second one from the bytes (a second copy of every small piece of state each step,
      // beyond the plan); the others read the bytes.
      const auto held = std::find_first_of(object->holders.begin(), object->holders.end(),
                                           graph.workers.begin(), graph.workers.end());
      if (held != object->holders.end()) {
        message.inputs.emplace_back(local, SourceOf(*object, *participants_, *held));
      }
    }
  }
  message.collective_bases = TakeCollectiveBases(graph);
  graphs_->SendPartsTo(graph, graph.workers);
  SendRunGraph(*outbox_, graph.workers, message);
  graphs_->InstanceStarted(graph);
  instances_.emplace(Key(graph.id, instance.instance), std::move(instance));
  ++running_of_graph_[graph.id];
}

Status InstanceTable::Finished(WorkerId worker, proto::InstanceFinished::Reader finished) {
  const Key key(finished.getGraphId(), finished.getInstance());
  auto it = instances_.find(key);
  if (it == instances_.end()) {  // already failed and closed
    // Put back after the instance gave up on this worker (Tick): nobody holds them any more.
    std::vector<ObjectId> orphans;
    for (uint64_t raw : finished.getRestored()) {
      if (objects_->Find(ObjectId(raw)) == nullptr) orphans.emplace_back(raw);
    }
    if (!orphans.empty()) SendFreeObjects(*outbox_, worker, orphans);
    return Status::Ok();
  }
  InstanceEntry& instance = it->second;
  auto& pending = instance.pending;
  if (std::find(pending.begin(), pending.end(), worker) == pending.end()) return Status::Ok();
  // What this worker took over is settled by its report: put back (listed, after a failure) or
  // lost. Checked before anything changes.
  std::set<ObjectId> taken;
  if (auto it_taken = instance.taken_over.find(worker); it_taken != instance.taken_over.end()) {
    taken = it_taken->second;
  }
  if (!finished.hasError() && finished.getRestored().size() > 0) {
    return InvalidArgument("{} put objects back after graph {} instance {}, which it finished",
                           worker.ToString(), key.first, key.second);
  }
  std::vector<ObjectId> restored;
  for (uint64_t raw : finished.getRestored()) {
    const ObjectId id(raw);
    if (taken.erase(id) == 0) {
      return InvalidArgument(
          "{} put back {} after graph {} instance {} failed, but it was not told to take it "
          "over there (or put it back twice)",
          worker.ToString(), id.ToString(), key.first, key.second);
    }
    restored.push_back(id);
  }
  pending.erase(std::remove(pending.begin(), pending.end(), worker), pending.end());
  instance.taken_over.erase(worker);
  if (finished.hasError()) {
    instance.restored.insert(instance.restored.end(), restored.begin(), restored.end());
    if (instance.error.ok()) instance.failed_on = worker;
    FailInstance(instance, worker,
                 rpc::FromWire(finished.getError()).WithContext(participants_->Describe(worker)));
    MaybeFinish(key);
    return Status::Ok();
  }
  if (!instance.error.ok()) {  // failed elsewhere: its outputs fail with the instance
    MaybeFinish(key);
    return Status::Ok();
  }
  std::set<uint64_t> sealed;
  for (proto::SealedObject::Reader output : finished.getOutputs()) {
    const ObjectId id(output.getId());
    if (std::find(instance.outputs.begin(), instance.outputs.end(), id) == instance.outputs.end()) {
      return InvalidArgument("{} sealed {}, which is not an output of the instance",
                             worker.ToString(), id.ToString());
    }
    // Twice in one report: the first seal may already have freed it (its driver let go).
    if (!sealed.insert(id.value()).second) {
      return InvalidArgument("{} sealed {} twice in one report", worker.ToString(), id.ToString());
    }
    const ObjectEntry* object = objects_->Find(id);
    if (object == nullptr || object->finished()) continue;  // settled meanwhile: keep that
    const auto data = output.getInline();
    objects_->Seal(id, worker, output.getBytes(),
                   std::string(reinterpret_cast<const char*>(data.begin()), data.size()));
  }
  MaybeFinish(key);
  return Status::Ok();
}

void InstanceTable::FailInstance(InstanceEntry& instance, WorkerId skip, const Status& error) {
  if (!instance.error.ok()) return;
  instance.error = error;
  if (instance.observer == nullptr) {
    GetLogger("scheduler")
        ->warn("graph {} instance {} failed: {}", instance.graph->id, instance.instance,
               error.ToString());
  }
  for (WorkerId worker : instance.pending) {
    if (worker != skip) {
      SendCancelInstance(*outbox_, worker, instance.graph->id, instance.instance, error);
    }
  }
  // Every member of the instance's groups drops the formation, also where its part of the
  // collective had finished: the next collective of the group forms it again on all of them
  // (after the cancels above, on each worker's ordered connection).
  for (uint64_t group : instance.graph->groups) groups_->Abort(group, error);
}

void InstanceTable::MaybeFinish(const Key& key) {
  auto it = instances_.find(key);
  if (it == instances_.end()) return;
  const InstanceEntry& entry = it->second;
  if (!entry.pending.empty()) {
    if (entry.error.ok()) return;
    // Failed: still waiting for a worker to say which handed-over objects it put back?
    for (const auto& [worker, objects] : entry.taken_over) {
      if (!objects.empty() &&
          std::find(entry.pending.begin(), entry.pending.end(), worker) != entry.pending.end()) {
        return;
      }
    }
  }
  const InstanceEntry done = std::move(it->second);
  Erase(it);
  const uint64_t graph_id = done.graph->id;
  HandBack(done);
  graphs_->InstanceEnded(*done.graph);  // may forget a retired graph: done.graph is not used after
  for (ObjectId id : done.bound) objects_->ReleaseUse(id);
  if (done.observer != nullptr && !done.error.ok()) {
    done.observer->InstanceEnded(done.instance, done.failed_on, done.error);
    return;  // the observer decides what becomes of the outputs
  }
  for (ObjectId id : done.outputs) {
    const ObjectEntry* object = objects_->Find(id);
    if (object == nullptr || object->finished()) continue;
    objects_->Fail(id, done.error.ok()
                           ? Internal("{} of graph {} finished without producing {}",
                                      done.observer == nullptr ? "an instance" : "the task",
                                      graph_id, object->spec.name)
                           : done.error);
  }
  if (done.observer != nullptr) done.observer->InstanceEnded(done.instance, WorkerId(), done.error);
}

void InstanceTable::HandBack(const InstanceEntry& done) {
  if (done.restored.empty() || done.error.ok()) return;
  const Participant* driver = participants_->Find(done.driver);
  if (driver == nullptr || !driver->alive) return;  // its references went with it
  std::vector<ObjectId> kept;
  for (ObjectId id : done.restored) {
    if (objects_->Find(id) == nullptr) continue;
    objects_->AddDriverRef(done.driver, id);
    kept.push_back(id);
  }
  if (kept.empty()) return;
  GetLogger("scheduler")
      ->info("graph {} instance {} failed; {} object(s) handed to it came back unchanged",
             done.graph->id, done.instance, kept.size());
  SendHandedBack(*outbox_, done.driver, done.graph->id, done.instance, kept);
}

void InstanceTable::Abandon(uint64_t graph, uint64_t instance, const Status& error) {
  auto it = instances_.find(Key(graph, instance));
  if (it == instances_.end()) return;
  InstanceEntry& entry = it->second;
  FailInstance(entry, WorkerId(), error);
  graphs_->InstanceEnded(*entry.graph);
  for (ObjectId id : entry.bound) objects_->ReleaseUse(id);
  Erase(it);
}

void InstanceTable::Erase(Instances::iterator it) {
  if (auto count = running_of_graph_.find(it->first.first); --count->second == 0) {
    running_of_graph_.erase(count);
  }
  instances_.erase(it);
}

void InstanceTable::WorkerDied(WorkerId worker, const std::string& who, const Status& reason) {
  std::vector<Key> broken;
  for (const auto& [key, instance] : instances_) {
    if (instance.observer == nullptr && std::find(instance.pending.begin(), instance.pending.end(),
                                                  worker) != instance.pending.end()) {
      broken.push_back(key);
    }
  }
  std::sort(broken.begin(), broken.end());  // oldest first, whatever the table's order
  for (const Key& key : broken) {
    InstanceEntry& instance = instances_.at(key);
    auto& pending = instance.pending;
    pending.erase(std::remove(pending.begin(), pending.end(), worker), pending.end());
    instance.taken_over.erase(worker);  // what it took over died with it
    FailInstance(instance, worker,
                 Unavailable("{} died while running its part of graph {} (instance {}): {}", who,
                             key.first, key.second, reason.message()));
    MaybeFinish(key);
  }
  std::erase_if(next_position_, [&](const auto& entry) { return entry.first.first == worker; });
}

void InstanceTable::Tick(std::chrono::steady_clock::time_point now,
                         std::chrono::steady_clock::duration limit) {
  std::vector<Key> overdue;
  for (auto& [key, instance] : instances_) {
    if (instance.error.ok()) continue;
    const std::chrono::steady_clock::time_point since = instance.waiting_since.value_or(now);
    instance.waiting_since = since;
    if (now - since >= limit) overdue.push_back(key);
  }
  std::sort(overdue.begin(), overdue.end());
  for (const Key& key : overdue) {
    InstanceEntry& instance = instances_.at(key);
    std::string silent;
    for (WorkerId worker : instance.pending) {
      if (instance.taken_over.erase(worker) == 0) continue;
      silent += (silent.empty() ? "" : ", ") + participants_->Describe(worker);
    }
    if (!silent.empty()) {
      GetLogger("scheduler")
          ->warn(
              "graph {} instance {} failed and {} did not say what it put back within {} ms: "
              "what it took over is lost",
              key.first, key.second, silent,
              std::chrono::duration_cast<std::chrono::milliseconds>(limit).count());
    }
    MaybeFinish(key);
  }
}

bool InstanceTable::Running(uint64_t graph, uint64_t instance) const {
  if (instance != 0) return instances_.contains({graph, instance});
  return running_of_graph_.contains(graph);
}

}  // namespace tessera

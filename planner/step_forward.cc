// The forward part of a step graph (PlanStepForward): evaluation and prediction on the training
// step's own placement.
//
// The tasks kept are the targets' producers and everything they read from, closed over the
// members of every collective kept (a collective's members are tied by their id, not by an
// object: rank 0's loss all-reduce needs every rank's member to run). Nothing of the backward,
// the reductions, the clipping or the update is an ancestor of the loss or the predictions, so
// none of it is kept; each kept task keeps its worker, device, priority and attributes, but no
// donation of what is fed (the state is read, and stays its owner's).
//
// Control edges: one between two kept tasks stays; one from a task left out becomes edges from
// the kept tasks of the same worker that task waited for (through its inputs and control edges,
// transitively), so each worker's order among the kept tasks holds: one micro-batch's forwards
// after the previous micro-batch's (serialised by way of its backward) and a pipeline stage's
// order still keep what is live bounded as the memory plan counted it.
#include <algorithm>
#include <map>
#include <vector>

#include "core/collective_task.h"
#include "planner/step_graph.h"

namespace tessera {

namespace {

size_t Index(TaskId id) { return static_cast<size_t>(id.value() - 1); }
size_t Index(ObjectId id) { return static_cast<size_t>(id.value() - 1); }

// Which tasks the targets need: their producers, the producers of what those read, and every
// member of each collective among them (with what it reads).
std::vector<bool> TasksNeeded(const Graph& graph, const std::vector<ObjectId>& targets) {
  std::map<int64_t, std::vector<TaskId>> members;  // by collective id
  for (const TaskSpec& task : graph.tasks()) {
    if (task.attrs.Has(kCollectiveAttr)) {
      members[task.attrs.GetInt(kCollectiveAttr, 0)].push_back(task.id);
    }
  }
  std::vector<bool> needed(static_cast<size_t>(graph.num_tasks()), false);
  std::vector<TaskId> pending;
  const auto need = [&](TaskId id) {
    if (id.valid() && !needed[Index(id)]) {
      needed[Index(id)] = true;
      pending.push_back(id);
    }
  };
  for (ObjectId target : targets) need(graph.object(target).producer);
  while (!pending.empty()) {
    const TaskSpec& task = graph.task(pending.back());
    pending.pop_back();
    for (ObjectId input : task.inputs) need(graph.object(input).producer);
    if (task.attrs.Has(kCollectiveAttr)) {
      for (TaskId member : members[task.attrs.GetInt(kCollectiveAttr, 0)]) need(member);
    }
  }
  return needed;
}

// Per task, the kept tasks it waits for: itself when kept, else (transitively) what it waited
// for through its inputs and control edges.
Result<std::vector<std::vector<TaskId>>> KeptPredecessors(const Graph& graph,
                                                          const std::vector<bool>& kept) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<TaskId> order, graph.TopologicalOrder());
  std::vector<std::vector<TaskId>> waits(static_cast<size_t>(graph.num_tasks()));
  for (TaskId id : order) {
    if (kept[Index(id)]) {
      waits[Index(id)] = {id};
      continue;
    }
    const TaskSpec& task = graph.task(id);
    std::vector<TaskId>& mine = waits[Index(id)];
    const auto add = [&](TaskId before) {
      if (!before.valid()) return;
      const std::vector<TaskId>& theirs = waits[Index(before)];
      mine.insert(mine.end(), theirs.begin(), theirs.end());
    };
    for (ObjectId input : task.inputs) add(graph.object(input).producer);
    for (TaskId before : task.after) add(before);
    std::sort(mine.begin(), mine.end());
    mine.erase(std::unique(mine.begin(), mine.end()), mine.end());
  }
  return waits;
}

}  // namespace

Result<StepForward> PlanStepForward(const StepGraph& step, ForwardResult result) {
  const Graph& graph = step.graph;
  std::vector<ObjectId> targets;
  if (result == ForwardResult::kLoss) {
    if (!step.loss.valid()) return InvalidArgument("the step graph has no loss to evaluate");
    targets = {step.loss};
  } else {
    if (step.predictions.empty() || std::any_of(step.predictions.begin(), step.predictions.end(),
                                                [](ObjectId id) { return !id.valid(); })) {
      return InvalidArgument(
          "the model cannot predict on its training placement: its loss layer reads no layer "
          "(StepGraph::predictions is empty)");
    }
    targets = step.predictions;
  }
  const std::vector<bool> kept = TasksNeeded(graph, targets);
  TESSERA_ASSIGN_OR_RETURN(auto waits, KeptPredecessors(graph, kept));

  // The objects the kept tasks read or write, in the step's order.
  std::vector<bool> object_kept(static_cast<size_t>(graph.num_objects()), false);
  for (const TaskSpec& task : graph.tasks()) {
    if (!kept[Index(task.id)]) continue;
    for (ObjectId id : task.inputs) object_kept[Index(id)] = true;
    for (ObjectId id : task.outputs) object_kept[Index(id)] = true;
  }
  StepForward forward;
  std::vector<ObjectId> object_map(static_cast<size_t>(graph.num_objects()));
  for (const ObjectSpec& object : graph.objects()) {
    if (object_kept[Index(object.id)]) {
      object_map[Index(object.id)] = forward.graph.AddObject(object.name, object.meta, object.role);
    }
  }
  const auto mapped = [&object_map](ObjectId id) {
    return id.valid() ? object_map[Index(id)] : ObjectId();
  };
  std::vector<TaskId> task_map(static_cast<size_t>(graph.num_tasks()));
  for (const TaskSpec& task : graph.tasks()) {
    if (!kept[Index(task.id)]) continue;
    TaskSpec copy = task;
    copy.after.clear();
    // No task takes over the buffer of what is fed (the model state stays its owner's).
    std::erase_if(copy.donations, [&](const Donation& donation) {
      return !graph.object(task.inputs[static_cast<size_t>(donation.input_index)]).producer.valid();
    });
    for (ObjectId& id : copy.inputs) id = mapped(id);
    for (ObjectId& id : copy.outputs) id = mapped(id);
    task_map[Index(task.id)] = forward.graph.AddTask(std::move(copy));
  }
  for (const TaskSpec& task : graph.tasks()) {
    if (!kept[Index(task.id)]) continue;
    for (TaskId before : task.after) {
      for (TaskId waited : waits[Index(before)]) {
        // A control edge joins two tasks of one worker; across workers the data orders them.
        if (graph.task(waited).pinned_worker != task.pinned_worker) continue;
        forward.graph.AddControlEdge(task_map[Index(waited)], task_map[Index(task.id)]);
      }
    }
  }
  for (ObjectId target : targets) forward.graph.MarkOutput(mapped(target));
  if (result == ForwardResult::kLoss) {
    forward.loss = mapped(step.loss);
  } else {
    for (ObjectId id : step.predictions) forward.predictions.push_back(mapped(id));
  }

  // What is fed: the model's inputs and the state the kept tasks read; nothing else may be read.
  std::vector<bool> fed(static_cast<size_t>(graph.num_objects()), false);
  forward.inputs.resize(step.inputs.size());
  for (size_t i = 0; i < step.inputs.size(); ++i) {
    for (ObjectId id : step.inputs[i]) {
      forward.inputs[i].push_back(mapped(id));
      fed[Index(id)] = true;
    }
  }
  for (const StateObject& object : step.state) {
    forward.state.push_back(mapped(object.input));
    fed[Index(object.input)] = true;
  }
  for (ObjectId input : graph.InputObjects()) {
    if (object_kept[Index(input)] && !fed[Index(input)]) {
      return Internal(
          "the forward part of the step reads '{}', which is neither a model input "
          "nor model state",
          graph.object(input).name);
    }
  }
  TESSERA_RETURN_IF_ERROR(forward.graph.Validate());
  return forward;
}

}  // namespace tessera

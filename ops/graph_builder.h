// GraphBuilder: builds a Graph task by task, inferring every output's shape as it goes.
//
// Planners (planner/) describe a step as calls to AddTask; the builder looks the op up, runs its
// shape inference on the input objects' metas, creates the output objects, copies the op's
// in-place pairs into the task's donations, and estimates the task's memory. A mistake (unknown
// op, wrong arity, mismatched shapes) is reported when the task is added, with the task, its
// layer, the op and the shapes in the message, long before anything runs.
//
// Devices: a task runs on its worker's CPU or its GPU (TaskOptions::device_kind) and its outputs
// live there (TensorMeta::device: Device::Cpu(), or Device::Cuda(0) for the worker's own GPU).
// A task may read only objects on its own device; moving an object between the two is a task of
// a transfer op (OpDef::crosses_devices, e.g. "copy"), so every transfer is visible in the plan.
//
// Not thread-safe: one builder per thread.
#pragma once

#include <string>
#include <vector>

#include "core/graph.h"
#include "core/status.h"
#include "ops/op_registry.h"

namespace tessera {

struct TaskOptions {
  std::string layer;  // model layer, for messages and traces
  int32_t priority = 0;
  WorkerId pinned_worker;
  DeviceKind device_kind = DeviceKind::kCpu;
  // The outputs live on the disk tier (a CPU worker's swap file), not where the task runs: a
  // 'copy' that swaps an object out. InvalidArgument for any other op or device.
  bool outputs_on_disk = false;
  // Names of the output objects; default "<task name>:<op output name>".
  std::vector<std::string> output_names;
  // Roles of the output objects; default kActivation.
  std::vector<ObjectRole> output_roles;
};

class GraphBuilder {
 public:
  // REQUIRES: registry outlives the builder.
  explicit GraphBuilder(const OpRegistry& registry) : registry_(registry) {}

  // An object the caller binds each run (batch, parameters, optimizer state, lr, step).
  ObjectId AddInput(std::string name, TensorMeta meta, ObjectRole role);

  // Adds a task running `op` on `inputs`; returns its output objects. Errors (InvalidArgument,
  // NotFound for an unknown op) name the task, layer and op.
  Result<std::vector<ObjectId>> AddTask(std::string name, const std::string& op,
                                        std::vector<ObjectId> inputs, Attrs attrs,
                                        TaskOptions options = {});

  void MarkOutput(ObjectId id) { graph_.MarkOutput(id); }
  // `later` starts only after `earlier` ended (Graph::AddControlEdge).
  void AddControlEdge(TaskId earlier, TaskId later) { graph_.AddControlEdge(earlier, later); }
  const Graph& graph() const { return graph_; }
  const TensorMeta& meta(ObjectId id) const { return graph_.object(id).meta; }

  // Validates and returns the graph; the builder is left empty.
  Result<Graph> Build();

 private:
  const OpRegistry& registry_;
  Graph graph_;
};

}  // namespace tessera

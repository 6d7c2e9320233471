// Small graphs for the scheduler's tests (scheduler_core_test, placement_test,
// graph_registry_test), and the RegisterGraph a driver sends for one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/collective_task.h"
#include "core/graph.h"
#include "core/proto/tessera.capnp.h"
#include "core/rpc/wire.h"

namespace tessera::testing {

inline TensorMeta Floats(int64_t numel) { return {Shape{numel}, DType::kF32, Device::Cpu()}; }
// The same on a GPU worker's GPU (a plan on Device::Cuda(0)).
inline TensorMeta FloatsOnGpu(int64_t numel) {
  return {Shape{numel}, DType::kF32, Device::Cuda(0)};
}

// A gelu task reading `inputs` into a new object of `out_numel` floats named "<name>.out";
// returns that object.
inline ObjectId AddGelu(Graph& graph, const std::string& name, std::vector<ObjectId> inputs,
                        int64_t out_numel = 1, WorkerId pinned = WorkerId(), Attrs attrs = {}) {
  const ObjectId out = graph.AddObject(name + ".out", Floats(out_numel), ObjectRole::kActivation);
  TaskSpec spec;
  spec.name = name;
  spec.op = "gelu_forward";
  spec.inputs = std::move(inputs);
  spec.outputs = {out};
  spec.pinned_worker = pinned;
  spec.attrs = std::move(attrs);
  graph.AddTask(std::move(spec));
  return out;
}

// The attributes of rank `rank` of a collective of `size` members.
inline Attrs Member(int64_t collective, int64_t rank, int64_t size) {
  return Attrs{{kCollectiveAttr, collective}, {kRankAttr, rank}, {kGroupSizeAttr, size}};
}

// The RegisterGraph a driver sends for `graph` (client/cluster.cc).
inline void RegisterGraphToWire(const Graph& graph, uint64_t graph_id,
                                proto::RegisterGraph::Builder out) {
  out.setGraphId(graph_id);
  auto objects = out.initObjects(static_cast<unsigned>(graph.num_objects()));
  for (const ObjectSpec& object : graph.objects()) {
    rpc::ToWire(object, objects[static_cast<unsigned>(object.id.value() - 1)]);
  }
  auto tasks = out.initTasks(static_cast<unsigned>(graph.num_tasks()));
  for (const TaskSpec& task : graph.tasks()) {
    std::vector<ObjectSpec> declared;
    declared.reserve(task.outputs.size());
    for (ObjectId output : task.outputs) declared.push_back(graph.object(output));
    rpc::ToWire(task, declared, tasks[static_cast<unsigned>(task.id.value() - 1)]);
  }
  const std::vector<ObjectId>& returned = graph.OutputObjects();
  auto outputs = out.initOutputs(static_cast<unsigned>(returned.size()));
  for (unsigned i = 0; i < returned.size(); ++i) outputs.set(i, returned[i].value());
}

}  // namespace tessera::testing

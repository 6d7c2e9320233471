// The graph IR: objects, tasks, and the DAG they form.
//
// A training step is a graph of fine-grained tasks (the forward of one layer, the backward of
// one layer, the optimizer update of one parameter group, ...) over immutable objects
// (parameters, gradients, optimizer state, activations). This header defines that graph and
// nothing about how it runs: the in-process executor (worker/) and the scheduler take a
// Graph and execute it.
//
// Objects
//   Every object has a TensorMeta known when the graph is built (shape inference runs in the
//   builder), so memory can be planned before anything runs. An object is produced by exactly
//   one task, or by none: then it is a graph input, bound by the caller each time the graph
//   runs. Objects the caller wants back are graph outputs; every other object is freed after its
//   last consumer.
//
// Tasks
//   A TaskSpec names its op, attributes, input and output objects, and how it may be placed
//   (device kind, a pinned worker or "scheduler decides"), its priority among ready tasks, an
//   estimate of the memory it needs, and donations: an input whose buffer an output may reuse
//   when the task is that input's last user. Donation is how an optimizer updates a parameter
//   shard in place without doubling memory. Control edges (`after`) order tasks that share no
//   object: a task starts only once every task it is after has ended. They are how a plan
//   fixes the order of a worker's tasks (a pipeline schedule); both ends must run on one
//   worker (the scheduler refuses a placement that splits them).
//
// Ids are dense: the i-th object added gets ObjectId(i + 1), likewise for tasks, so lookups are
// vector indexing.
//
// Thread safety: a Graph is built on one thread, then read-only; concurrent reads are fine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/attrs.h"
#include "core/device.h"
#include "core/ids.h"
#include "core/status.h"
#include "core/tensor.h"

namespace tessera {

// What an object is, for memory accounting and planning (e.g. per-role peak bytes).
enum class ObjectRole : uint8_t {
  kInput,           // fed per step: token ids, targets, learning rate, step number
  kParameter,       // model weights (possibly a shard)
  kGradient,        // gradients of parameters
  kOptimizerState,  // Adam moments, master weights
  kActivation,      // everything a forward leaves for its backward, and other intermediates
  kOutput,          // small results: loss, norms
  // Transient model state (reported apart from the persistent kinds above, and bounded by the
  // plan): a sharded parameter gathered for one layer's use (ZeRO-3), and a layer's full
  // gradient on its way to a reduce-scatter (ZeRO-2/3 buckets).
  kGatheredParameter,
  kGradientBucket,
};
inline constexpr ObjectRole kLastObjectRole = ObjectRole::kGradientBucket;
inline constexpr size_t kObjectRoles = static_cast<size_t>(kLastObjectRole) + 1;

std::string_view ObjectRoleName(ObjectRole role);

struct ObjectSpec {
  ObjectId id;
  std::string name;  // unique within the graph, e.g. "h.3.params", "h.3.saved"
  TensorMeta meta;
  ObjectRole role = ObjectRole::kActivation;
  TaskId producer;  // invalid for graph inputs
};

// An output that may take over the buffer of an input (same byte size).
struct Donation {
  int input_index = 0;
  int output_index = 0;
  friend bool operator==(const Donation&, const Donation&) = default;
};

struct TaskSpec {
  TaskId id;
  std::string name;   // unique within the graph, e.g. "h.3/forward"
  std::string layer;  // model layer the task belongs to ("h.3"); for messages and traces
  std::string op;     // op registry name
  Attrs attrs;
  std::vector<ObjectId> inputs;
  std::vector<ObjectId> outputs;
  DeviceKind device_kind = DeviceKind::kCpu;
  WorkerId pinned_worker;  // invalid: the scheduler decides
  int32_t priority = 0;    // among ready tasks, higher runs first
  int64_t memory_estimate_bytes = 0;
  // Scratch its kernel holds while it runs, on top of its outputs (OpDef::workspace): what the
  // memory model adds at the task's run. Set when the graph is built; the planner's alone (not
  // sent to workers).
  int64_t workspace_bytes = 0;
  std::vector<Donation> donations;
  std::vector<TaskId> after;  // control edges: tasks that must end before this one starts
};

// Graph ids from this one up are the scheduler's own: the graphs it makes for submitted tasks and
// dynamic collectives (scheduler/graph_registry.h). Drivers register graphs below it.
inline constexpr uint64_t kFirstSchedulerGraphId = uint64_t{1} << 63;

class Graph {
 public:
  // Adds an object with no producer yet. Names must be unique (checked by Validate).
  ObjectId AddObject(std::string name, TensorMeta meta, ObjectRole role);
  // Adds a task; its id is assigned here and becomes the producer of its outputs.
  // REQUIRES: every output exists and has no producer yet.
  TaskId AddTask(TaskSpec spec);
  // Marks an object as returned to the caller after a run (never freed by the executor).
  void MarkOutput(ObjectId id);
  // Makes `later` start only after `earlier` ended (a control edge; no data moves).
  // REQUIRES: both tasks exist.
  void AddControlEdge(TaskId earlier, TaskId later);

  // Structural checks: ids in range, unique names, every output produced once, no cycles
  // (through objects and control edges), donations index real inputs/outputs of equal byte
  // size, control edges name other tasks of the graph, outputs exist. InvalidArgument
  // naming the task or object otherwise.
  Status Validate() const;
  // Tasks in an order where every task follows the producers of its inputs and the tasks it is
  // after (Kahn's algorithm, ties broken by higher priority, then by insertion order).
  // InvalidArgument on a cycle.
  Result<std::vector<TaskId>> TopologicalOrder() const;

  int num_objects() const { return static_cast<int>(objects_.size()); }
  int num_tasks() const { return static_cast<int>(tasks_.size()); }
  // REQUIRES: the id belongs to this graph.
  const ObjectSpec& object(ObjectId id) const;
  const TaskSpec& task(TaskId id) const;
  const std::vector<ObjectSpec>& objects() const { return objects_; }
  const std::vector<TaskSpec>& tasks() const { return tasks_; }

  // Objects without a producer, in insertion order.
  std::vector<ObjectId> InputObjects() const;
  const std::vector<ObjectId>& OutputObjects() const { return outputs_; }
  bool IsOutput(ObjectId id) const;

  // NotFound naming the object otherwise.
  Result<ObjectId> FindObject(std::string_view name) const;
  Result<TaskId> FindTask(std::string_view name) const;

  // Sum of byte sizes of objects with the given role.
  int64_t BytesOfRole(ObjectRole role) const;

 private:
  std::vector<ObjectSpec> objects_;
  std::vector<TaskSpec> tasks_;
  std::vector<ObjectId> outputs_;
};

}  // namespace tessera

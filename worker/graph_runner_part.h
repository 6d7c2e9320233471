// GraphRunner::Part: a worker's part of one registered graph, built once from the scheduler's
// GraphPart (worker/graph_runner.h says what a part holds and how instances use it). Private to
// the runner: graph_runner.cc runs instances of parts, graph_runner_part.cc builds them.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/collective_task.h"
#include "core/graph.h"
#include "core/proto/tessera.capnp.h"
#include "core/rpc/wire.h"
#include "core/status.h"
#include "worker/graph_runner.h"
#include "worker/in_process_executor.h"

namespace tessera {

// A collective member the collective engine runs (one of several members; a one-member
// collective is a copy, run as a kernel).
inline bool IsEngineMember(const TaskSpec& task) {
  return task.attrs.Has(kCollectiveAttr) && task.attrs.GetInt(kGroupSizeAttr, 1) > 1;
}

// An engine member's place on this worker: its channel, and its position plus `bases`' entry for
// the channel (all zero: the position the part gives it). The channel as the task says (the
// engine refuses one outside 0 .. kCollectiveChannels-1, here channel -1 with no base).
inline CollectivePlace PlaceOf(const TaskSpec& task,
                               const std::array<int64_t, kCollectiveChannels>& bases) {
  const int64_t channel = task.attrs.GetInt(kChannelAttr, 0);
  const int64_t position = task.attrs.GetInt(kPositionAttr, 0);
  if (channel < 0 || channel >= kCollectiveChannels) return {-1, position};
  return {static_cast<int>(channel), bases[static_cast<size_t>(channel)] + position};
}

struct GraphRunner::Part {
  uint64_t id = 0;
  std::vector<ObjectSpec> objects;  // the graph's, graph-local ids
  std::vector<ObjectId> outputs;    // graph outputs, graph-local, in order
  Graph local;                      // this worker's tasks, local ids
  std::vector<ObjectId> local_of;   // graph-local index -> local id (invalid: not used here)
  std::vector<ObjectId> graph_of;   // local index -> graph-local id
  std::unique_ptr<PreparedGraph> prepared;
  Status error;                    // why the part could not be prepared
  std::vector<ObjectId> external;  // local inputs: graph inputs and objects pushed here
  std::map<ObjectId, std::vector<std::string>> exports;       // local id -> consumer addresses
  std::vector<std::pair<ObjectId, size_t>> produced_outputs;  // local id, output index
  std::vector<uint64_t> graph_task_of;                        // local task index -> graph id
  std::map<std::string, uint64_t> worker_of_address;          // consumers' data planes
  std::vector<uint64_t> producer_worker;  // graph-local index -> the worker producing it (0: input)
  // Its engine members' places among the graph's members on this worker (their `channel` and
  // `position` attributes): an instance adds its base on the channel.
  std::vector<CollectivePlace> collective_places;
  std::vector<bool>
      engine_member;  // local task index -> IsEngineMember (decided once, not per run)

  // Reads the part from the wire, builds the local graph of worker `self`'s tasks and prepares
  // it on `executor` (the steps below, in order). InvalidArgument for a part that contradicts
  // itself or breaks `limits`; the executor's error for a local graph it cannot prepare.
  Status Build(uint64_t self, proto::GraphPart::Reader wire, const InProcessExecutor& executor,
               const rpc::WireLimits& limits);

  // The whole graph as the wire places it: every task and its worker.
  struct Placement {
    std::vector<rpc::WireTask> tasks;
    std::vector<uint64_t> task_workers;         // per task
    std::map<uint64_t, std::string> addresses;  // worker -> its data plane
  };
  // The objects, the outputs and the consumers' addresses; the tasks and their workers.
  Result<Placement> Read(proto::GraphPart::Reader wire, const rpc::WireLimits& limits);
  // Which worker produces each object (producer_worker).
  Status FindProducers(const Placement& placement);
  // Worker `self`'s tasks into the local graph, and what it exports to the others'.
  Status AddTasks(uint64_t self, const Placement& placement);
  // Graph task `t`, placed here, in local ids. `local_task`: graph task index -> local id.
  Status AddLocalTask(size_t t, const TaskSpec& spec, const std::vector<TaskId>& local_task);
  // Another worker's task (its data plane at `address`): the objects it reads that worker
  // `self` produces are pushed there.
  Status AddExports(uint64_t self, const TaskSpec& spec, const std::string& address);
  // The local inputs, the graph outputs produced here, the engine members' positions.
  Status AddOutputs(uint64_t self);
  // Graph-local object `graph_id` in the local graph, added at its first use.
  ObjectId Localize(ObjectId graph_id);
  bool Declares(ObjectId graph_id) const {
    return graph_id.value() != 0 && graph_id.value() <= objects.size();
  }
};

}  // namespace tessera

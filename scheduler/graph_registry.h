// GraphRegistry: the graphs drivers registered, and the running instances of them.
//
// Registering: a driver sends its graph once. The registry decodes it into a core::Graph and
// checks it (GraphFromWire), places every task then and there (PlaceGraph), keys the groups of
// its collectives and gives each member its position (AssignCollectives), and sends each
// involved worker the graph with its placement (GraphPart), once.
//
// Running: each run of a graph (an instance) binds the graph's inputs to sealed cluster objects
// of the same meta (pending uses until the instance ends) and declares its outputs as new
// cluster objects for the driver; it costs one RunGraph per involved worker and one
// InstanceFinished from each: O(workers), whatever the number of tasks. Objects that cross
// workers move peer to peer; only the outputs become cluster objects, sealed where they were
// produced. An instance ends when every involved worker reported, or at its first failure (a
// worker's error, or its death): the others are told to cancel, and the outputs not sealed fail
// with that error.
//
// Errors: a returned error is a protocol violation by the driver or worker (the core closes its
// connection); a graph that cannot be placed or run is answered with a Reply carrying the
// reason, and a run whose bindings are wrong fails its outputs.
//
// Thread safety: none; the scheduler's io thread drives it.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/graph.h"
#include "core/ids.h"
#include "core/proto/tessera.capnp.h"
#include "core/status.h"
#include "scheduler/collective_groups.h"
#include "scheduler/object_directory.h"
#include "scheduler/outbox.h"
#include "scheduler/participants.h"

namespace tessera {

// The graph a RegisterGraph carries, checked. InvalidArgument naming the graph or the task for:
// object or task ids that are not dense from 1, a task reading an unknown object, an object
// produced by two tasks (or by none that exists), a graph output that is not an object of the
// graph, and whatever Graph::Validate finds (duplicate names, a task without an op, bad
// donations, cycles: prefixed "graph <id>: "). Errors decoding the wire are returned as they
// are.
Result<Graph> GraphFromWire(uint64_t graph_id, proto::RegisterGraph::Reader wire);

class GraphRegistry {
 public:
  // The parts must outlive the registry.
  GraphRegistry(Outbox* outbox, ObjectDirectory* objects, ParticipantTable* participants,
                CollectiveGroups* groups);

  // `driver` registers a graph (request `request_id`, answered with a Reply: OK, or why not: an
  // id in use, no alive worker, a placement that cannot work, a graph without tasks).
  Status Register(WorkerId driver, uint64_t request_id, proto::RegisterGraph::Reader wire);
  // `driver` runs an instance of a graph it registered (a Reply only when it did not register
  // it). InvalidArgument for an instance already running, or output ids that do not fit.
  Status Run(WorkerId driver, uint64_t request_id, proto::RunGraph::Reader run);
  // `worker` finished (or failed) its part of an instance. InvalidArgument when it seals an
  // object that is not an output of the instance. Reports for closed instances are ignored.
  Status InstanceFinished(WorkerId worker, proto::InstanceFinished::Reader finished);
  // `worker` (described as `who`) died of `reason`: the instances it was part of fail.
  void WorkerDied(WorkerId worker, const std::string& who, const Status& reason);

  // A registered graph's tasks and objects (graph-local ids, dense from 1); null when unknown.
  const std::vector<TaskSpec>* Tasks(uint64_t graph) const;
  const std::vector<ObjectSpec>* Objects(uint64_t graph) const;
  // Whether an instance is still running (some involved worker has not reported); with
  // instance 0, whether any instance of `graph` is.
  bool Running(uint64_t graph, uint64_t instance) const;

 private:
  struct GraphEntry {
    uint64_t id = 0;
    WorkerId driver;
    std::vector<ObjectSpec> objects;  // graph-local ids, dense from 1
    std::vector<TaskSpec> tasks;      // graph-local ids, dense from 1; with group and position
    std::vector<WorkerId> task_worker;
    std::vector<WorkerId> workers;  // involved, ascending
    std::vector<ObjectId> inputs;   // graph-local ids of objects no task produces
    std::vector<ObjectId> outputs;  // graph-local ids returned to the driver
    std::set<uint64_t> groups;      // the collective groups its collectives use
  };
  struct InstanceEntry {
    uint64_t graph = 0;
    uint64_t instance = 0;
    WorkerId driver;
    std::vector<WorkerId> pending;  // workers still running their part
    std::vector<ObjectId> bound;    // cluster objects bound to the inputs (pending uses)
    std::vector<ObjectId> outputs;  // cluster objects for the outputs
    Status error;
  };
  using InstanceKey = std::pair<uint64_t, uint64_t>;  // graph, instance

  // Keys the groups of a placed graph's collectives and gives each member its group and its
  // position on its worker (core/collective_task.h). InvalidArgument for inconsistent members.
  Status AssignCollectives(GraphEntry& graph);
  // Binds the run's inputs: graph-local id -> sealed cluster object. InvalidArgument (or the
  // bound object's error) when a binding is unknown, not ready, of another meta, or missing.
  Result<std::map<uint64_t, const ObjectEntry*>> Bind(const GraphEntry& graph,
                                                      proto::RunGraph::Reader run) const;
  // Records the instance's first failure and tells the other workers still running to cancel.
  void FailInstance(InstanceEntry& instance, WorkerId skip, const Status& error);
  // Ends the instance once every involved worker reported (or it failed): fails the outputs not
  // sealed, releases the bound inputs.
  void MaybeFinishInstance(const InstanceKey& key);

  Outbox* outbox_;
  ObjectDirectory* objects_;
  ParticipantTable* participants_;
  CollectiveGroups* groups_;
  std::unordered_map<uint64_t, GraphEntry> graphs_;
  std::map<InstanceKey, InstanceEntry> instances_;
};

}  // namespace tessera

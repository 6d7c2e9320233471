// InstanceTable: every running instance of a placed graph (graph_registry.h) — the one way work
// runs on workers.
//
// An instance binds the graph's inputs to sealed cluster objects and gives its outputs cluster
// ids. Starting one sends each involved worker the graph's part if it lacks it, then one RunGraph
// (the same message to each): the bindings (where to pull each input, or its bytes inline), the
// output ids, the instance's names for its tasks (a submitted task's own name), and each worker's
// collective base. Cost: O(workers) messages, whatever the number of tasks. Objects that cross
// workers move peer to peer; only the outputs become cluster objects, sealed where they were
// produced, as each worker reports (InstanceFinished).
//
// Collective order: every collective member a worker runs has one position in that worker's
// order of its channel's collectives (core/collective_task.h). The table counts, per worker and
// channel, the members of every instance it started there; an instance's base on a worker and
// channel is that count when it starts. Every worker of a group meets the group's collectives in
// the order their instances started, so no two workers wait on each other in opposite orders.
//
// Two owners:
//   - a driver's RunGraph (RunForDriver): the instance ends when every involved worker reported,
//     or at its first failure (a worker's error, or its death): the others are told to cancel,
//     its groups are aborted, and the outputs not sealed fail with that error. A failed instance
//     whose workers took over handed-over objects (below) ends once each of those workers has
//     reported (or died): the objects they put back unchanged are the driver's again (a
//     HandedBack message, sent before the outputs fail), the rest are lost. Such a worker that
//     has not reported a heartbeat timeout after the failure (Tick) is given up on: what it took
//     is lost, and a late report's put-back objects are freed on it;
//   - the task table, for submitted tasks and dynamic collectives (Start with an observer): on
//     success the outputs are sealed and the observer told; on a failure the observer is told and
//     decides (run the work again, wait for rebuilt inputs, or fail the outputs). A worker's
//     death is the owner's to handle (it knows which of its instances ran there: Abandon).
//
// Handing over: a driver may hand bound objects to its run (RunGraph's takeOver: a trainer's
// state, which the optimizer updates). The driver's reference is released once the run is
// started or refused, whatever becomes of it. A handed-over object that only this driver's
// reference kept, that nothing else uses, watches or waits for, and that one worker of the graph
// holds and alone reads, is taken over by that worker (its binding's takeOver): the worker moves
// it out of its store, so the run holds its only copy and may update it in place; otherwise the
// run reads it as any other (and the object is freed when the run ends).
//
// Errors: a returned error is a protocol violation by the driver or worker (the core closes its
// connection); a run whose bindings are wrong fails its outputs.
//
// Thread safety: none; the scheduler's io thread drives it.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/ids.h"
#include "core/proto/tessera.capnp.h"
#include "core/status.h"
#include "scheduler/collective_groups.h"
#include "scheduler/graph_registry.h"
#include "scheduler/messages.h"
#include "scheduler/object_directory.h"
#include "scheduler/outbox.h"
#include "scheduler/participants.h"

namespace tessera {

// The owner of instances started with Start (the task table).
class InstanceObserver {
 public:
  virtual ~InstanceObserver() = default;
  // Instance `instance` ended: every output sealed (`error` OK), or failed with `error` on
  // `worker` (its report). The instance is closed when this is called.
  virtual void InstanceEnded(uint64_t instance, WorkerId worker, const Status& error) = 0;
};

struct InstanceStart {
  PlacedGraph* graph = nullptr;
  uint64_t instance = 0;  // unique among the graph's running instances
  WorkerId driver;        // whose objects the outputs are
  // Every graph input (graph-local id) and the sealed cluster object bound to it.
  std::vector<std::pair<uint64_t, const ObjectEntry*>> bindings;
  std::vector<ObjectId> outputs;         // cluster ids of the graph's outputs, in order (declared)
  std::vector<std::string> task_names;   // per graph task; empty: the graph's own names
  std::vector<int64_t> collective_ids;   // per graph task; empty: the graph's own
  InstanceObserver* observer = nullptr;  // null: the driver's (see above)
  // Cluster objects the driver hands to the instance with its run (RunGraph's takeOver): its
  // reference goes once the instance is started. Where the instance is then the object's only
  // user and the one worker holding it its only reader, that worker is told to move it out of
  // its store (so the run may update it in place).
  std::vector<ObjectId> handed_over;
};

class InstanceTable {
 public:
  // The parts must outlive the table.
  InstanceTable(Outbox* outbox, ObjectDirectory* objects, ParticipantTable* participants,
                CollectiveGroups* groups, GraphRegistry* graphs);

  // `driver` runs an instance of a graph it registered (a Reply only when it did not register
  // it). InvalidArgument for an instance already running, or output ids that do not fit.
  Status RunForDriver(WorkerId driver, uint64_t request_id, proto::RunGraph::Reader run);
  // Starts an instance for an observer (the task table). REQUIRES: the bindings cover every
  // graph input with a sealed object; the outputs are declared; the key is not running.
  void Start(InstanceStart start);
  // `worker` finished (or failed) its part of an instance. InvalidArgument when it seals an
  // object that is not an output of the instance, or puts back one it was not told to take over
  // (or after a success). Reports for closed instances are ignored, but for the objects they put
  // back that nothing holds any more: those are freed on the worker.
  Status Finished(WorkerId worker, proto::InstanceFinished::Reader finished);
  // The owner ends its instance (a member failed, a worker died): the workers still running it
  // are told to cancel and its collective groups are aborted. The observer is not told.
  void Abandon(uint64_t graph, uint64_t instance, const Status& error);
  // `worker` (described as `who`) died of `reason`: the drivers' instances it was part of fail
  // (observed ones are their owner's to handle).
  void WorkerDied(WorkerId worker, const std::string& who, const Status& reason);

  // Failed instances still waiting for a worker to say what it put back (see the file comment)
  // end once they have waited `limit` since the first Tick that saw them failed.
  void Tick(std::chrono::steady_clock::time_point now, std::chrono::steady_clock::duration limit);

  // Whether an instance is still running (some involved worker has not reported); with
  // instance 0, whether any instance of `graph` is.
  bool Running(uint64_t graph, uint64_t instance) const;
  size_t size() const { return instances_.size(); }

 private:
  struct InstanceEntry {
    PlacedGraph* graph = nullptr;
    uint64_t instance = 0;
    WorkerId driver;
    std::vector<WorkerId> pending;  // workers still running their part
    std::vector<ObjectId> bound;    // cluster objects bound to the inputs (pending uses: driver's)
    std::vector<ObjectId> outputs;  // cluster objects for the outputs
    InstanceObserver* observer = nullptr;
    Status error;
    WorkerId failed_on;
    // Handed-over objects each worker was told to take over, until it reports: after a failure
    // the instance waits for those workers, to hand back what they put back (`restored`).
    std::map<WorkerId, std::set<ObjectId>> taken_over;
    std::vector<ObjectId> restored;
    // Failed and still open: since when (the first Tick that saw it so).
    std::optional<std::chrono::steady_clock::time_point> waiting_since;
  };
  using Key = std::pair<uint64_t, uint64_t>;  // graph, instance
  // Hashed: a stream of submitted tasks keeps tens of thousands in flight, and every report
  // looks its instance up (with a tree, Finished took 7% of the scheduler's time in perf).
  using Instances = std::unordered_map<Key, InstanceEntry, IdPairHash>;

  // Binds a driver's run's inputs: graph-local id -> sealed cluster object. InvalidArgument (or
  // the bound object's error) when a binding is unknown, not ready, of another meta, or missing.
  Result<std::vector<std::pair<uint64_t, const ObjectEntry*>>> Bind(
      const PlacedGraph& graph, proto::RunGraph::Reader run) const;
  // RunForDriver up to the start (the driver's handed-over references are released after it).
  Status StartForDriver(WorkerId driver, uint64_t request_id, proto::RunGraph::Reader run);
  // Whether `object`, handed over by `driver`, may be taken over by the worker holding it (see
  // the file comment); `bound_times`: how often the run binds it; `readers`: the workers whose
  // tasks read the input it is bound to.
  bool MayTakeOver(const PlacedGraph& graph, const ObjectEntry& object, WorkerId driver,
                   int bound_times, const std::set<WorkerId>& readers) const;
  // Records the instance's first failure, tells the other workers still running to cancel and
  // aborts its groups.
  void FailInstance(InstanceEntry& instance, WorkerId skip, const Status& error);
  // Ends the instance once every involved worker reported (or it failed).
  void MaybeFinish(const Key& key);
  // A failed driver's instance that closes: the objects its workers put back are the driver's
  // again (a reference each, and a HandedBack message), unless the driver is gone.
  void HandBack(const InstanceEntry& done);
  // Takes an entry out of instances_ (and its graph's count).
  void Erase(Instances::iterator it);
  // Each involved worker's collective base for a new instance of `graph` (advances the counts).
  std::vector<CollectiveBase> TakeCollectiveBases(const PlacedGraph& graph);

  Outbox* outbox_;
  ObjectDirectory* objects_;
  ParticipantTable* participants_;
  CollectiveGroups* groups_;
  GraphRegistry* graphs_;
  Instances instances_;
  std::unordered_map<uint64_t, int> running_of_graph_;  // instances_ per graph id
  // Per worker and channel: collective members started there.
  std::map<std::pair<WorkerId, int>, int64_t> next_position_;
};

}  // namespace tessera

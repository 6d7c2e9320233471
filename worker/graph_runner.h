// GraphRunner: a worker's parts of registered graphs, and the instances it runs.
//
// When a driver registers a graph, the scheduler places every task and sends each involved
// worker the graph with the placement (a GraphPart). The runner builds and prepares, once, the
// local graph of this worker's tasks: its inputs are the graph inputs it reads and the objects
// other workers produce for it; its exports are the objects it produces that other workers read.
//
// Each instance (RunGraph from the scheduler) then runs the prepared local graph on the worker's
// executor:
//   - bound inputs come inline, from the local object store, or are pulled from their holder;
//     one the scheduler says the instance takes over (a driver's state handed to its step, the
//     run its last user) leaves the store as it is bound, so the run holds its only copy and
//     its in-place updates (the optimizer's) need no second one;
//   - objects from other workers are pushed here by their producers and delivered to the run
//     as they arrive (late inputs); pushes that come before the instance starts wait for it;
//   - each export is pushed to its consumers as soon as it is produced;
//   - collective members go to the collective engine (the worker's communication stream), which
//     runs them in the order the scheduler assigned;
//   - the graph outputs produced here are sealed into the object store under the cluster ids the
//     scheduler assigned, and InstanceFinished reports them (once every push has completed).
// A failure anywhere (a kernel, a pull, a push, or a cancel from the scheduler) ends the
// instance with an error; the inputs it took over that no task had updated in place go back into
// the store under their cluster ids, and the report says which (InstanceFinished's restored), so
// the driver keeps them (a failed step's state is not lost).
//
// Every instance runs here: a driver's step, a submitted task's one-task graph, a submitted
// collective's graph of members. Instances start as they arrive (Start returns at once: the
// executor runs them, InProcessExecutor::Start) and run concurrently, their ready tasks ordered
// by priority across all of them in the executor's queue. Collective members go to the
// collective engine at their place: their channel, and their position in the worker's order of
// that channel's collectives (the part's position plus the instance's base on the channel,
// RunGraph's collectiveBases), which the scheduler counts alike for every worker, so concurrent
// instances never meet a group's collectives in different orders; an instance that ends passes
// the places of members it never submitted (EndInstance). An
// instance may carry its own names for its tasks and its own collective ids (a submitted task's
// and collective's, RunGraph's taskNames and collectiveIds): errors, waits and the engine use
// them.
//
// Thread safety: every method may be called from any thread (AddPart/Start/Cancel come from the
// io thread, push handlers from the data plane's thread, Activity from the heartbeat). Instance
// ends (reports) come from the executor's threads, the collective engine's or the data plane's.
// The runner's state is under one mutex, never held while calling the executor, a run, the
// collective engine or the data plane; an instance's report in the making has a lock of its own.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <capnp/message.h>

#include "core/proto/tessera.capnp.h"
#include "core/settings.h"
#include "core/status.h"
#include "core/thread_annotations.h"
#include "core/timeline.h"
#include "core/transport/data_plane.h"
#include "worker/collective_engine.h"
#include "worker/in_process_executor.h"
#include "worker/object_store.h"

namespace tessera {

// What an instance cost this worker, reported with InstanceFinished.
struct InstanceFigures {
  RoleBytes role_bytes;
  int64_t allocator_peak = 0;
  int64_t collective_bytes = 0;  // sent by collective members
  int64_t pushed_bytes = 0;      // exports pushed to other workers
  double wall_ms = 0;
  // Where the time went (core/timeline.h): every local task (collective members with the time
  // they ran on the collective engine and the bytes they sent) and every push of an export.
  WorkerSpans spans;
};

// What an instance in progress is doing (tessera status --waits).
struct GraphRunActivity {
  uint64_t graph = 0;
  uint64_t instance = 0;
  std::vector<std::string> running;  // tasks whose kernels run now
  struct Awaited {
    std::string name;       // the object's name in the graph
    uint64_t producer = 0;  // the worker producing it (0: a bound input, pulled)
  };
  std::vector<Awaited> awaited;  // inputs from other workers not here yet
};

// Instances in flight here, those ended since the start, and the tasks they ran to completion
// (registered graphs' and submitted tasks' alike).
struct GraphRunnerStats {
  int64_t running = 0;
  int64_t done = 0;
  int64_t tasks_done = 0;
};

class GraphRunner {
 public:
  using SendToScheduler = std::function<void(capnp::MessageBuilder&)>;

  GraphRunner(const OpRegistry& registry, const ExecutorOptions& executor_options,
              ObjectStore& store, const Settings& settings, SendToScheduler send);
  // Cancels the instances in flight and waits for their runs to end (their reports are sent);
  // instances waiting for their turn are dropped.
  ~GraphRunner();
  // REQUIRES: called once, before any part arrives.
  void set_data_plane(DataPlane* data_plane) { data_plane_ = data_plane; }
  // Where collective members run (their communicators). Without one, only one-member
  // collectives run. REQUIRES: called once, before any part arrives; outlives the runner.
  void set_collective_engine(CollectiveEngine* engine) { engine_ = engine; }

  // A graph part for this worker (`self` is this worker's id). InvalidArgument for a part that
  // cannot be prepared (e.g. an op without a kernel): reported to the driver at its first run.
  // A `prepared` error (a plugin the part needs did not load) is the part's error as it is.
  void AddPart(uint64_t self, proto::GraphPart::Reader part, Status prepared = Status::Ok())
      EXCLUDES(mutex_);
  void Start(proto::RunGraph::Reader run) EXCLUDES(mutex_);
  void Cancel(uint64_t graph, uint64_t instance, const Status& reason) EXCLUDES(mutex_);

  // Every instance in progress (its run started on the executor and not ended) and what it
  // does, oldest first; empty when none runs.
  std::vector<GraphRunActivity> Activity() EXCLUDES(mutex_);
  // The scheduler forgot graph `graph` (a template it evicted): its part goes.
  void RemovePart(uint64_t graph) EXCLUDES(mutex_);
  GraphRunnerStats stats() EXCLUDES(mutex_);

  // Data-plane push handlers.
  Result<void*> AcceptPush(const PushKey& key, int64_t bytes) EXCLUDES(mutex_);
  void PushDelivered(const PushKey& key, const Status& status) EXCLUDES(mutex_);

 private:
  struct Part;
  struct Instance;
  struct Outcome;
  using Key = std::pair<uint64_t, uint64_t>;  // graph, instance

  // An instance is ready to start (or failed before it could): it is in flight from now on.
  void Admit(const std::shared_ptr<Instance>& instance) EXCLUDES(mutex_);
  // Starts the instance on the executor, or reports and retires it when it cannot start.
  void Launch(const std::shared_ptr<Instance>& instance) EXCLUDES(mutex_);
  // Starts one instance's run on the executor; an error when it could not.
  Status Begin(const std::shared_ptr<Instance>& instance) EXCLUDES(mutex_);
  RunHooks MakeHooks(const Instance& instance);
  Status StartPulls(const Instance& instance);
  // An export was produced: push it to its consumers.
  void PushExport(const Key& key, const Part& part, const std::shared_ptr<Outcome>& outcome,
                  ObjectId local, const Tensor& tensor);
  // The run of an instance ended: figures, sealed outputs, the report (after the pushes).
  // `intact`: on a failure, the inputs no task updated in place.
  void Ended(const std::shared_ptr<Instance>& instance, Result<RunResult> result,
             const ObjectMap& intact) EXCLUDES(mutex_);
  // After a failed run: puts the inputs the instance took over that are in `intact` back into
  // the store under their cluster ids; returns those ids (the report's `restored`).
  std::vector<ObjectId> PutBack(const Instance& instance, const ObjectMap& intact);
  // Reports the instance when its run has ended and no push is out, or at once when the run
  // failed (once).
  void ReportWhenPushed(const Key& key, Outcome& outcome) EXCLUDES(mutex_);
  // Counts an ended instance in stats().done, and the tasks it ran here in stats().tasks_done:
  // before its report, so that whoever the report wakes sees it counted.
  void CountDone(int64_t tasks) EXCLUDES(mutex_);
  // The instance is over here.
  void Retire(const Instance& instance) EXCLUDES(mutex_);
  // An input of an instance is here (pushed or pulled): give it to the run, or keep it for when
  // the run starts.
  void Arrive(const Key& key, ObjectId local, Tensor tensor) EXCLUDES(mutex_);
  void Report(const Key& key, const Status& error, std::vector<std::pair<ObjectId, Tensor>> sealed,
              const InstanceFigures& figures = {}, const std::vector<ObjectId>& restored = {})
      EXCLUDES(mutex_);

  // Hands the pushes that came before graph `graph`'s part to their runs.
  void DeliverEarlyPushes(uint64_t graph) EXCLUDES(mutex_);
  // The inputs that arrived for instance `key` before its run took them (taken out).
  std::vector<std::pair<ObjectId, Tensor>> TakeArrivals(const Key& key) REQUIRES(mutex_);
  // The cancel that came for instance `key` before its run started, if one did (taken out).
  std::optional<Status> TakeCancel(const Key& key) REQUIRES(mutex_);
  // Whether instance `key` ended here recently (its late pushes and cancels are dropped).
  bool Finished(const Key& key) const REQUIRES(mutex_);

  [[maybe_unused]] const OpRegistry& registry_;  // unused (Clang's -Wunused-private-field)
  const Settings settings_;
  ObjectStore& store_;
  SendToScheduler send_;
  DataPlane* data_plane_ = nullptr;
  CollectiveEngine* engine_ = nullptr;
  InProcessExecutor executor_;

  Mutex mutex_;      // never held while calling the executor or a run
  CondVar retired_;  // in_flight_ lost an instance
  std::map<uint64_t, std::shared_ptr<Part>> parts_ GUARDED_BY(mutex_);
  // Instances started here and not retired: their runs (once started) take pushes, cancels and
  // activity queries.
  std::map<Key, std::shared_ptr<Instance>> in_flight_ GUARDED_BY(mutex_);
  uint64_t self_ GUARDED_BY(mutex_) = 0;  // this worker's id (every part names it)
  int64_t done_ GUARDED_BY(mutex_) = 0;   // instances ended here
  int64_t tasks_done_ GUARDED_BY(mutex_) = 0;
  uint64_t next_sequence_ GUARDED_BY(mutex_) = 0;
  // Inputs that came before their instance's run started.
  std::map<Key, std::vector<std::pair<ObjectId, Tensor>>> arrivals_ GUARDED_BY(mutex_);
  std::map<PushKey, Tensor, bool (*)(const PushKey&, const PushKey&)> incoming_ GUARDED_BY(mutex_);
  // Pushes of a graph whose part has not arrived here yet (a peer that got its part and its
  // RunGraph first may push before this worker's part is prepared): raw bytes, bounded by
  // kMaxEarlyPushBytes, delivered when the part arrives.
  struct EarlyPush {
    PushKey key;
    std::vector<uint8_t> bytes;
    bool delivered = false;
  };
  std::vector<EarlyPush> early_pushes_ GUARDED_BY(mutex_);
  int64_t early_push_bytes_ GUARDED_BY(mutex_) = 0;
  // Cancels of instances not started on the executor yet (queued, still launching, or not
  // arrived): applied when they start.
  std::map<Key, Status> cancelled_ GUARDED_BY(mutex_);
  std::deque<Key> finished_ GUARDED_BY(mutex_);  // recent instances, whose late pushes are dropped
  bool stopping_ GUARDED_BY(mutex_) = false;
};

}  // namespace tessera

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
//   - objects from other workers are pushed here by their producers and delivered to the run
//     as they arrive (late inputs); pushes that come before the instance starts wait for it;
//   - each export is pushed to its consumers as soon as it is produced;
//   - collective members go to the collective engine (the worker's communication stream), which
//     runs them in the order the scheduler assigned;
//   - the graph outputs produced here are sealed into the object store under the cluster ids the
//     scheduler assigned, and InstanceFinished reports them (once every push has completed).
// A failure anywhere (a kernel, a pull, a push, or a cancel from the scheduler) ends the
// instance with an error.
//
// Every instance runs here: a driver's step, a submitted task's one-task graph, a submitted
// collective's graph of members. Instances start as they arrive (Start returns at once: the
// executor runs them, InProcessExecutor::Start) and run concurrently, their ready tasks ordered
// by priority across all of them in the executor's queue. Collective members go to the
// collective engine at their position in the worker's one order of collectives (the part's place
// plus the instance's base, RunGraph's collectiveBases), which the scheduler counts alike for
// every worker, so concurrent instances never meet a group's collectives in different orders; an
// instance that ends passes the positions of members it never submitted (EndInstance). An
// instance may carry its own names for its tasks and its own collective ids (a submitted task's
// and collective's, RunGraph's taskNames and collectiveIds): errors, waits and the engine use
// them.
//
// Thread safety: every method may be called from any thread (AddPart/Start/Cancel come from the
// io thread, push handlers from the data plane's thread, Activity from the heartbeat). Instance
// ends (reports) come from the executor's threads, the collective engine's or the data plane's.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <capnp/message.h>

#include "core/proto/tessera.capnp.h"
#include "core/settings.h"
#include "core/status.h"
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

// Instances in flight here, and those ended since the start.
struct GraphRunnerStats {
  int64_t running = 0;
  int64_t done = 0;
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
  void AddPart(uint64_t self, proto::GraphPart::Reader part);
  void Start(proto::RunGraph::Reader run);
  void Cancel(uint64_t graph, uint64_t instance, const Status& reason);

  // Every instance in progress (its run started on the executor and not ended) and what it
  // does, oldest first; empty when none runs.
  std::vector<GraphRunActivity> Activity();
  // The scheduler forgot graph `graph` (a template it evicted): its part goes.
  void RemovePart(uint64_t graph);
  GraphRunnerStats stats();

  // Data-plane push handlers.
  Result<void*> AcceptPush(const PushKey& key, int64_t bytes);
  void PushDelivered(const PushKey& key, const Status& status);

 private:
  struct Part;
  struct Instance;
  struct Outcome;
  using Key = std::pair<uint64_t, uint64_t>;  // graph, instance

  // An instance is ready to start (or failed before it could): it is in flight from now on.
  void Admit(std::shared_ptr<Instance> instance);
  // Starts the instance on the executor, or reports and retires it when it cannot start.
  void Launch(std::shared_ptr<Instance> instance);
  // Starts one instance's run on the executor; an error when it could not.
  Status Begin(const std::shared_ptr<Instance>& instance);
  RunHooks MakeHooks(const Instance& instance);
  Status StartPulls(const Instance& instance);
  // An export was produced: push it to its consumers.
  void PushExport(const Key& key, const Part& part, const std::shared_ptr<Outcome>& outcome,
                  ObjectId local, const Tensor& tensor);
  // The run of an instance ended: figures, sealed outputs, the report (after the pushes).
  void Ended(const std::shared_ptr<Instance>& instance, Result<RunResult> result);
  static InstanceFigures FiguresOf(const Part& part, const RunStats& stats, const Outcome& outcome);
  // Reports the instance when its run has ended and no push is out (once).
  void ReportWhenPushed(const Key& key, Outcome& outcome);
  // Counts an ended instance in stats().done: before its report, so that whoever the report
  // wakes sees it counted.
  void CountDone();
  // The instance is over here.
  void Retire(const Instance& instance);
  // An input of an instance is here (pushed or pulled): give it to the run, or keep it for when
  // the run starts.
  void Arrive(const Key& key, ObjectId local, Tensor tensor);
  void Report(const Key& key, const Status& error, std::vector<std::pair<ObjectId, Tensor>> sealed,
              const InstanceFigures& figures = {});

  // Hands the pushes that came before graph `graph`'s part to their runs.
  void DeliverEarlyPushes(uint64_t graph);

  [[maybe_unused]] const OpRegistry& registry_;  // unused (Clang's -Wunused-private-field)
  const Settings settings_;
  ObjectStore& store_;
  SendToScheduler send_;
  DataPlane* data_plane_ = nullptr;
  CollectiveEngine* engine_ = nullptr;
  InProcessExecutor executor_;

  std::mutex mutex_;  // never held while calling the executor or a run
  std::condition_variable retired_;
  std::map<uint64_t, std::shared_ptr<Part>> parts_;
  // Instances started here and not retired: their runs (once started) take pushes, cancels and
  // activity queries.
  std::map<Key, std::shared_ptr<Instance>> in_flight_;
  uint64_t self_ = 0;  // this worker's id (every part names it)
  int64_t done_ = 0;   // instances ended here
  uint64_t next_sequence_ = 0;
  std::map<Key, std::vector<std::pair<ObjectId, Tensor>>> arrivals_;  // before their run starts
  std::map<PushKey, Tensor, bool (*)(const PushKey&, const PushKey&)> incoming_;
  // Pushes of a graph whose part has not arrived here yet (a peer that got its part and its
  // RunGraph first may push before this worker's part is prepared): raw bytes, bounded by
  // kMaxEarlyPushBytes, delivered when the part arrives.
  struct EarlyPush {
    PushKey key;
    std::vector<uint8_t> bytes;
    bool delivered = false;
  };
  std::vector<EarlyPush> early_pushes_;
  int64_t early_push_bytes_ = 0;
  // Cancels of instances not started on the executor yet (queued, still launching, or not
  // arrived): applied when they start.
  std::map<Key, Status> cancelled_;
  std::deque<Key> finished_;  // recent instances, whose late pushes are dropped
  bool stopping_ = false;
};

}  // namespace tessera

// CollectiveEngine: a worker's communication streams. It runs the worker's collective member
// tasks on communicators while the executor goes on with compute (as NCCL runs on CUDA streams of
// its own): one thread per channel (core/collective_task.h), each running its channel's members
// one at a time, so collectives on different channels progress at once.
//
// Order. Members arrive as they become ready (their inputs are local), in any order. Each
// belongs to an instance (of a registered graph, a submitted collective: all work is instances)
// and has a place: its channel, and a position in the worker's order of that channel's
// collectives. The scheduler counts every member of every instance it starts on this worker, per
// channel (the instance's base on this worker and channel plus the member's place among the
// instance's members there). Each channel runs its members strictly by position: every worker of
// a group reaches the group's collectives in the same order, so none waits on another that waits
// on it. An instance that ends says which of its places it will never submit (EndInstance), so
// the orders move past them.
//
// Communicators. One per collective group (the workers of a collective, in rank order, on one
// channel: a channel's groups are its own, so only its thread uses their communicators), formed
// the first time the group meets, with the scheduler as rendezvous (CollectiveJoin /
// CollectivePeers), and reused by every later collective of that group. Host buffers go over
// the UCX communicator (collectives/ucx_communicator.h); a GPU worker's device buffers cross it
// through host copies (in, then the result back), on the engine's thread.
//
// Failures. The scheduler is every group's watcher: when a member dies, or members report a
// peer silent past collective_timeout_ms, it sends the group's verdict (CollectiveAbort) and
// the collective in progress fails at once on every member with that one message, naming the
// worker. A failed group's communicator is dropped; the next collective of the group forms it
// again (a new epoch). A verdict names the epoch it is about: one about a formation this worker
// has since replaced is ignored; one about a later formation than this worker's (which it never
// joined) moves its next formation past it, so all members form again at one epoch. A verdict for a
// group with no collective in progress drops its communicator (the next one forms it again); one
// that lands as a collective finishes drops it after that collective — an aborted communicator is
// never used again.
//
// Thread safety: Submit, EndInstance and the scheduler's messages from any thread; `done`
// callbacks run on the engine's thread (or the caller's, for members of an instance that
// already failed).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <capnp/message.h>

#include "collectives/communicator.h"
#include "core/attrs.h"
#include "core/collective_task.h"
#include "core/proto/tessera.capnp.h"
#include "core/settings.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/thread_annotations.h"
#include "ops/op_registry.h"

namespace tessera {

struct CollectiveMember {
  std::string task;  // the task's name, for errors
  std::string op;    // a collective op (IsCollectiveOp: all_reduce, all_to_all, ...)
  Attrs attrs;       // collective, rank, group_size, group, position, reduce, root
  std::vector<Tensor> inputs;
  std::vector<Tensor> outputs;  // allocated; in-place outputs hold the input already
  // When set, told (on the engine's thread, before `done`) when the member ran, on the system
  // clock in microseconds since the Unix epoch (core/timeline.h), and the bytes it sent; not
  // called for members that never ran.
  std::function<void(int64_t start_us, int64_t end_us, int64_t bytes_sent)> on_ran;
};

struct CollectiveEngineStats {
  int64_t collectives_run = 0;
  int64_t bytes_sent = 0;  // over every communicator
  int groups_formed = 0;
};

// A member in progress on a collective channel, as `tessera status --waits` shows it.
struct CollectiveInProgress {
  std::string task;  // empty: none in progress
  std::string op;
  int64_t collective = 0;
  uint64_t group = 0;
  int rank = 0;
  int size = 0;
  bool forming = false;  // waiting for the group's rendezvous (the other members' joins)
  std::chrono::steady_clock::time_point since;
};

class CollectiveEngine {
 public:
  using InstanceId = std::pair<uint64_t, uint64_t>;  // (graph, instance)
  using Done = std::function<void(const Status&)>;
  using SendToScheduler = std::function<void(capnp::MessageBuilder&)>;

  // `copier` moves device buffers to and from the host (a GPU worker's; task_runner.h).
  CollectiveEngine(const Settings& settings, SendToScheduler send, KernelContext copier = {});
  ~CollectiveEngine();

  // Queues a member of `instance` at `place` (its channel's order on this worker); it runs once
  // every earlier position of the channel has run or passed. `done` gets its result. A member of
  // an instance that already failed fails at once with that error (its position passes), one on
  // a channel outside 0 .. kCollectiveChannels-1 with InvalidArgument.
  void Submit(const InstanceId& instance, CollectivePlace place, CollectiveMember member,
              Done done);
  // The instance is over here, and `places` are all its members' places on this worker: those
  // never submitted pass, queued ones fail with `reason` (Cancelled when OK); with an error
  // reason, its members in progress are aborted too.
  void EndInstance(const InstanceId& instance, const std::vector<CollectivePlace>& places,
                   const Status& reason);

  // The worker is stopping: the collective in progress (or a group forming) fails at once, and
  // nothing queued or submitted later runs (each fails with Cancelled by the destructor or on
  // Submit). Without it a collective whose peers stopped too would wait out its timeout.
  void Stop();

  // From the scheduler (any thread).
  void OnPeers(proto::CollectivePeers::Reader peers);
  void OnAbort(uint64_t group, uint32_t epoch, const Status& reason);

  CollectiveEngineStats stats() const;
  // What the engine is doing now: of the members in progress (one per busy channel), the one
  // running longest; none (task empty) when idle. Any thread; cheap: a copy under the mutex.
  CollectiveInProgress InProgress() const;

 private:
  class SchedulerRendezvous;
  struct Queued {
    InstanceId instance;
    CollectiveMember member;
    Done done;
    // Drops the member's references to its buffers, then calls `done`: the run's dependents may
    // start (and allocate) as soon as `done` returns, and an input whose last reader this member
    // was must be freed by then, as the plan counts it (not whenever this thread gets to it).
    void Finish(const Status& status);
  };
  struct Group {
    uint32_t epoch = 0;
    std::shared_ptr<SchedulerRendezvous> rendezvous;
    std::unique_ptr<Communicator> communicator;
    // Aborted while its collective ran: dropped when that collective returns, whatever it
    // returned (an aborted communicator fails every later call).
    bool aborted = false;
  };

  // One channel: its order, and the thread that runs it. Its fields are guarded by mutex_ (all
  // but `thread`, which only the constructor of the lane and the destructor touch).
  struct Lane {
    int channel = 0;
    int64_t next = 0;                  // the next position to run
    std::map<int64_t, Queued> queued;  // by position
    std::set<int64_t> passing;         // positions of ended instances never submitted
    uint64_t running_group = 0;        // the group of the member in progress (0: none)
    InstanceId running_instance = InstanceId{0, 0};
    CollectiveInProgress in_progress;
    std::thread thread;
    // Whether the member at `next` is queued or passes.
    bool NextIsDue() const { return queued.contains(next) || passing.contains(next); }
  };

  // The channel's lane, started at its first use (nullptr while stopping).
  Lane* LaneFor(int channel) REQUIRES(mutex_);
  void Loop(Lane& lane);
  // Runs one member; `sent` gets the bytes it sent.
  Status Run(Lane& lane, CollectiveMember& member, int64_t& sent);
  // A compressed all-reduce member's error buffers on the host (outputs 1 and 2, copied when
  // on a device) for `count` of x's elements compressed; InvalidArgument naming what `out` (x)
  // and they should be.
  Result<std::array<Tensor, 2>> CompressedErrorsOnHost(const CollectiveMember& member,
                                                       const Tensor& out, int64_t count, int size);
  Result<Communicator*> CommunicatorFor(Lane& lane, uint64_t group_key, int rank, int size);
  // Aborts what `lane` runs now (its communicator, or its group still forming): returns the
  // rendezvous to fail outside the lock, if any.
  std::shared_ptr<SchedulerRendezvous> AbortRunning(Lane& lane, const Status& reason)
      REQUIRES(mutex_);

  const Settings settings_;
  SendToScheduler send_;
  const KernelContext copier_;

  mutable Mutex mutex_;
  CondVar changed_;
  std::array<std::unique_ptr<Lane>, kCollectiveChannels> lanes_ GUARDED_BY(mutex_);
  // An instance's first failed member: its instance fails, so its later members fail with this
  // at once instead of forming a group the other members will never join (which would also move
  // this worker's epoch of that group past theirs). Until the instance ends here.
  std::map<InstanceId, Status> failed_ GUARDED_BY(mutex_);
  std::map<uint64_t, Group> groups_ GUARDED_BY(mutex_);
  CollectiveEngineStats stats_ GUARDED_BY(mutex_);
  bool stopping_ GUARDED_BY(mutex_) = false;
};

}  // namespace tessera

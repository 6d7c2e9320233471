// Step simulation: a planned step run against a clock before it runs, to predict its time with
// the waits that one worker's busy time (planner/step_time.h) leaves out: pipeline bubbles,
// collectives' transfers, objects pushed between workers, swaps.
//
// The step graph is replayed on its workers, every task taking its time (EstimateTaskTimes: the
// measured layer times and the op cost model's estimate for the rest, plus the per-task
// overhead), on the lanes a worker runs them on:
//   compute     one task at a time, ready tasks by priority, first ready first among equals,
//               then graph order (the in-process executor's choice, as SimulateWorkerOrders
//               makes it with unit times);
//   collective  one lane per communication channel (core/collective_task.h): a collective
//               starts once every member is ready, the collectives before it in its channel's
//               order (the runtime's: planner/channel_order.h) have started on its members'
//               workers, and every member's channel is free, and its
//               members end together after its reduction's compute (the op cost model's) plus
//               the link's latency (on tensor parallelism's channel, the wait calibrated for
//               its kind of group and size, inside a pipeline where the group is a stage of
//               one: StepLinks::GroupWaitUs) and its bytes over the link's bandwidth, scaled by the
//               ring's traffic (all-reduce 2(N-1)/N of the tensor, reduce-scatter,
//               all-gather and an all-to-all of blocks (N-1)/N, broadcast and an all-to-all
//               passing whole buffers to a neighbour, a halo or a ring's rotation, the whole)
//               relative to the all-reduce the link was measured with;
//   I/O         a CPU worker's swap-file copies (core/disk_tasks.h), one at a time, their bytes
//               over the disk link, each taking its share of compute (TaskTime::ms) from the
//               next compute task.
// Workers may share one machine's compute (ComputeSharing): then a compute task's time stretches
// while more workers compute at once than the machine holds at full speed.
// An object made on one worker and read on another arrives the point-to-point link's latency
// plus its bytes over that link's bandwidth after its producer ends.
//
// The step ends when the last lane of any worker does. Each worker's compute lane is busy or
// idle; an idle gap before a task is put down to what the task waited for last: a task of
// another worker (a bubble: the pipeline's, or a rank waiting on a slower one), a transfer or a
// collective (communication), a swap-file copy (swap). The bottleneck of a plan is the largest of
// the critical (last to end) worker's compute, bubble, communication and swap time.
//
// It is a model: CPU workers' collectives and copies take cores from the compute beyond what
// the calibration saw, a real executor may overlap tasks, links are shared. bench_plan_search
// measures it against runs.
//
// Thread safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <vector>

#include "core/graph.h"
#include "core/ids.h"
#include "core/status.h"
#include "planner/memory_model.h"
#include "planner/step_time.h"
#include "planner/training_plan.h"

namespace tessera {

// The links a step's communication takes.
struct StepLinks {
  // An all-reduce among `collective_group` workers (0: each collective's own group): latency +
  // bytes / bandwidth (training/collective_link.h measures it).
  CollectiveLink collective;
  int collective_group = 0;
  // What a collective of more members than a pair waits in place of the link's latency while
  // the workers share a machine (calibrated on a probe of that many tensor ranks: a member waits
  // for more peers to be scheduled), by member count, ascending; a count not listed waits the
  // figure of the largest count below it, else the link's latency.
  struct GroupLatency {
    int members = 0;
    double latency_us = 0;
  };
  std::vector<GroupLatency> group_latency;
  // What a reduce-scatter or all-gather on tensor parallelism's channel (Megatron-LM's sequence
  // sharding: the pair that takes each all-reduce's place, with little compute between them, so
  // that peers arrive closer together) waits in place of LatencyUs(members) while the workers
  // share a machine (calibrated on a sequence-sharded probe of that many tensor ranks); by
  // member count, ascending, looked up alike; none listed at or below the count:
  // LatencyUs(members).
  std::vector<GroupLatency> sequence_shard_latency;
  // What an all-to-all on tensor parallelism's channel (spatial parallelism's halo passes and
  // exchanged norm statistics: a chain of small exchanges, each member sending to one or every
  // neighbour, with a convolution's or a norm's compute between) waits in place of
  // LatencyUs(members) while the workers share a machine (calibrated on a probe of slabs of that
  // many members); looked up alike; none listed at or below the count: LatencyUs(members).
  std::vector<GroupLatency> exchange_latency;
  // What a ZeRO-3 parameter gather (core/collective_task.h: kGatherChannel) waits in place of
  // LatencyUs(members) while the workers share a machine: its members gather beside their
  // compute, and where two workers share a core they compute in turns at full speed rather
  // than side by side at half, so a gather's members arrive a turn apart and its copies wait
  // for theirs (calibrated on every worker a ZeRO-3 rank at once: GPT-2's D4 x P1 M4 ZeRO-3
  // had run 16-22% slower than simulated at the link's latency). Not where every member's
  // worker also runs tensor parallelism's collectives (tensor ranks, slabs: they meet at every
  // layer, so a gather's members arrive together; priced so, the U-Net's D1 x S4 x P1 M8 ZeRO-3
  // came out 22% slow). Looked up alike; none at or below the count: LatencyUs(members).
  std::vector<GroupLatency> gather_latency;
  double LatencyUs(int members) const;
  double GatherLatencyUs(int members) const;
  double SequenceShardLatencyUs(int members) const;
  double ExchangeLatencyUs(int members) const;
  // Which of those three figures a collective on tensor parallelism's channel waits (by its op:
  // an all-to-all an exchange's, a reduce-scatter or all-gather a sequence shard's, else an
  // all-reduce's).
  enum class GroupWait : uint8_t { kAllReduce, kSequenceShard, kExchange };
  // What such a collective waits in place of its kind's figure when its group is a stage of a
  // pipeline (its members read what another stage's workers push them, and push theirs on, each
  // micro-batch) while the workers share a machine: calibrated on a pipeline whose every stage is
  // such a group. The wait fitted there is longer than the one fitted on the same groups side by
  // side, where its kind's figure comes from: priced at that figure, GPT-2 D1 x T2 x P2 plans of
  // 4-16 micro-batches ran 10-20% slower than predicted, the U-Net's D1 x S2 x P2 alike.
  // By kind and member count, looked up as above, never below the kind's own figure at that count
  // (a smaller group's staged wait can be); none at or below the count: the kind's.
  struct StagedLatency {
    GroupWait wait = GroupWait::kAllReduce;
    int members = 0;
    double latency_us = 0;
  };
  std::vector<StagedLatency> staged_latency;  // ascending by members within a kind
  // The figure a collective of `wait`'s kind and `members` waits, its group a pipeline's stage
  // or not.
  double GroupWaitUs(GroupWait wait, int members, bool staged) const;
  // An object pushed from one worker to another; unmeasured: the collective link's latency and
  // bandwidth (an all-reduce moves about twice a push's bytes per link), else free.
  CollectiveLink point_to_point;
  // What such an object waits in place of point_to_point's latency while the workers share a
  // machine (calibrated on a pipeline over every worker: its reader must be scheduled before it
  // starts, and a pipeline's stages hand over objects at every micro-batch); 0: point_to_point's.
  double shared_push_latency_us = 0;
  double disk_bytes_per_us = 0;  // the swap file's, each way; 0: copies take no time
};

// Workers that share one machine's cores (a local cluster of CPU workers) compute slower when
// several compute at once: `capacity` is how many can compute at full speed together (the cores
// over each worker's threads, as calibrated: training/plan_calibration.h); with more running,
// each runs at capacity / running of its speed (processor sharing). A running collective on
// tensor parallelism's channel counts each member as one more user (it sits on its ranks' path
// between their compute tasks, and its calibrated wait was fitted so); any other collective (a
// data-parallel all-reduce, ZeRO's gathers and reduce-scatters, beside the compute) counts none,
// its members waiting for their peers with their cores yielded, and progresses at its slowest
// member's group's rate (its copies need the cores). Counting those as users too had the GPT-2
// D4 x P1 M4 ZeRO-3 plan's forward pass 3x the measured and the U-Net's D1 x S4 x P1 M8 ZeRO-3
// step +47-51% (docs/benchmarks.md, 2026-12-07, seventh). 0: every worker has its own hardware
// (GPU workers, one worker per machine).
//
// Workers bound to cores of their own (core/cpu_set.h) share only those: `groups` lists the
// workers that share cores with each other, each group's workers sharing capacity * share (its
// cores over all the groups' cores) among themselves, whatever the other groups run; one running
// alone on its group's cores runs at full speed (a one-core group's share is below one worker's:
// what two lose taking turns on the core). A worker in no group shares the whole capacity with
// the other such workers. Empty: one group of every worker (workers the system moves between all
// the machine's cores).
struct CoreGroup {
  std::vector<WorkerId> workers;
  double share = 1;
};
struct ComputeSharing {
  double capacity = 0;
  std::vector<CoreGroup> groups;
};

enum class Bottleneck : uint8_t { kCompute, kBubble, kCommunication, kSwap };
const char* BottleneckName(Bottleneck bottleneck);  // "compute", "bubble", ...

struct SimulatedWorker {
  WorkerId worker;
  double end_ms = 0;  // when its last lane is done
  // Its compute lane's time, busy (tasks and their overhead) and idle by what it waited for;
  // they add up to end_ms (what follows the last compute task is put down to what runs then).
  double compute_ms = 0, bubble_ms = 0, communication_ms = 0, swap_ms = 0;
};

struct SimulatedStep {
  double step_ms = 0;
  std::vector<SimulatedWorker> workers;  // in order of their first task in the graph
  size_t critical = 0;                   // the worker that ends last
  Bottleneck bottleneck = Bottleneck::kCompute;
  std::vector<double> start_ms, end_ms;  // per task
};

// InvalidArgument when `times` does not hold one entry per task, or when the graph cannot
// finish (a cycle; a collective with inconsistent attributes, named).
Result<SimulatedStep> SimulateStep(const Graph& graph, const std::vector<TaskTime>& times,
                                   const StepLinks& links, double task_overhead_ms = 0,
                                   const ComputeSharing& sharing = {});

// Each worker's tasks in the order the simulated step ended them (then by start, then graph
// order): the order the memory model (PredictMemory) takes to count what lives while the
// collectives and copies of the lanes beside the compute take their time. The workers in the
// order their first task appears (SimulateWorkerOrders' order).
std::vector<WorkerOrder> TimedWorkerOrders(const Graph& graph, const SimulatedStep& simulated);
// The memory of the simulated step: TimedWorkerOrders, each object another worker produces
// arriving when its producer ends there (PredictMemory with the finishing times).
Result<MemoryProfile> PredictTimedMemory(const Graph& graph, const SimulatedStep& simulated);

}  // namespace tessera

// Who waits on what: the scheduler's explanation of every worker's wait (tessera status --waits,
// Cluster::Waits, the dashboard's /api/waits).
//
// Each worker says in its heartbeats what it does (ReportedWait: the tasks its graph run has on
// the CPU now, the objects the run still waits for and who produces them, the collective member
// in progress on its communication stream). Alone, a report says "rank 0 waits in all_reduce";
// the scheduler adds what only it knows, so the line names the culprit:
//   - liveness: a worker silent for more than `silent_after` (two heartbeat intervals) is
//     "not responding (last heartbeat N ms ago)", long before it is declared dead;
//   - rendezvous: while a group forms, which members have not joined (CollectiveGroups);
//   - the other members' reports: a peer that is not in the same collective has not reached it.
// The workers a wait is blocked on (silent, or not at the rendezvous) are listed, so callers
// need not parse the text.
//
// ExplainWaits is a pure function of plain data (SchedulerCore gathers it), tested directly.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/ids.h"
#include "core/proto/tessera.capnp.h"

namespace tessera {

// A worker's latest WaitState (core/proto/tessera.capnp), copied out of its heartbeat.
struct ReportedWait {
  std::vector<std::string> running;  // "graph.instance/task"
  struct Awaited {
    std::string name;   // "graph.instance/object"
    WorkerId producer;  // invalid: a bound input
  };
  std::vector<Awaited> awaited;
  struct Collective {
    std::string task;
    std::string op;
    int64_t collective = 0;
    uint64_t group = 0;
    int rank = 0;
    int size = 0;
    bool forming = false;
    int64_t since_us = 0;
  };
  std::optional<Collective> collective;
  std::string instance;  // the graph instance in progress ("graph.instance"); empty: none
};

ReportedWait ReadWaitState(proto::WaitState::Reader wire);

// What the scheduler knows of one worker.
struct WorkerWaitInput {
  WorkerId id;
  bool alive = true;
  std::chrono::milliseconds silent{0};  // since its last heartbeat
  int tasks_in_flight = 0;              // dynamic tasks the scheduler dispatched to it
  ReportedWait reported;
};

// What the scheduler knows of a collective group.
struct GroupView {
  std::vector<WorkerId> members;        // in rank order
  std::vector<WorkerId> missing_joins;  // not at the open rendezvous round (CollectiveGroups)
};

struct WorkerWaitLine {
  WorkerId worker;
  // "runs 1.3/forward", "waits in collective 7/all_reduce (rank 0 of 2) for worker3, which has
  // not answered for 2.1 s", "not responding (last heartbeat 1500 ms ago); it said: ...", "idle".
  std::string text;
  std::vector<WorkerId> blocked_on;  // the workers it waits for that are silent or absent
};

// One line per worker of `workers`, in their order. `group` looks up a group key (nullopt:
// unknown).
std::vector<WorkerWaitLine> ExplainWaits(
    const std::vector<WorkerWaitInput>& workers,
    const std::function<std::optional<GroupView>(uint64_t)>& group,
    std::chrono::milliseconds silent_after = std::chrono::milliseconds(1000));

}  // namespace tessera

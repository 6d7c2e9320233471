// ParticipantTable: who is connected to the scheduler, in which role, and how each worker is.
//
// Participants (workers, drivers, admin clients) share one id space (WorkerId): a connection gets
// an id when accepted and must say Hello with the cluster's token before anything else (the core
// refuses it otherwise). For every participant the table keeps what its Hello said and when it
// was last heard from; for a worker also its heartbeat figures, whether it is alive, the load the
// scheduler put on it (tasks in flight and the host memory promised to them: placement reads
// both through WorkerLoads) and its latest graph-instance report (for status).
//
// Invariants: ids are never reused. A worker declared dead stays listed, not alive and carrying
// no load, until its connection is gone (Remove). Which workers are dead is the core's verdict:
// the table only says who has been silent too long (Expired).
//
// Thread safety: none; the scheduler's io thread drives it.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <capnp/message.h>

#include "core/gpu_use.h"
#include "core/ids.h"
#include "core/proto/tessera.capnp.h"
#include "core/status.h"
#include "scheduler/placement.h"
#include "scheduler/waits.h"

namespace tessera {

enum class ParticipantRole { kPending, kWorker, kDriver, kAdmin };

struct Participant {
  WorkerId id;
  ParticipantRole role = ParticipantRole::kPending;
  bool alive = true;
  std::string hostname;
  int pid = 0;
  std::string data_address;
  int cpu_threads = 0;
  std::string gpu;   // the GPU a worker owns; empty for a CPU worker
  std::string cpus;  // the CPUs it may run on, as it said ("0-3"; core/cpu_set.h); empty: unknown
  // Heartbeat figures (a worker's own view of itself).
  int64_t host_capacity = 0;
  int64_t host_used = 0;
  int64_t spilled_bytes = 0;
  int64_t spilled_total = 0;  // cumulative
  int64_t tasks_done = 0;
  int64_t bytes_pulled = 0;
  int64_t pull_micros = 0;
  int64_t bytes_served = 0;
  double cpu_seconds = 0;         // cumulative CPU time of the worker process
  double cpu_utilization = 0;     // cores it kept busy over its last heartbeat interval
  std::optional<GpuUse> gpu_use;  // its GPU's figures in its latest heartbeat; none: not reported
  int64_t objects = 0;            // in its store now
  int64_t device_bytes = 0;       // of its store's, in the device tier
  int64_t restores = 0;           // objects its store read back from disk so far
  ReportedWait waits;             // what it runs or waits for, as of its latest heartbeat
  // The scheduler's load on it: dispatched tasks and the memory estimates they were placed with.
  int tasks_in_flight = 0;
  int64_t committed_bytes = 0;
  // The latest InstanceFinished report, copied out of its message (reported in status), and
  // sums over every report (the dashboard's cumulative bytes).
  std::unique_ptr<capnp::MallocMessageBuilder> last_run;
  int64_t instances_finished = 0;
  int64_t bytes_pushed = 0;
  int64_t collective_bytes_sent = 0;
  std::chrono::steady_clock::time_point last_heard;
};

class ParticipantTable {
 public:
  using Clock = std::chrono::steady_clock;

  // `token` is what joining processes must present; `session_dir` is named in the refusal.
  ParticipantTable(std::string token, std::string session_dir);

  // A new connection, heard from `now`, pending its Hello. Returns its id.
  WorkerId Accept(Clock::time_point now);
  // nullptr for an id that is not (or no longer) listed.
  Participant* Find(WorkerId id);
  const Participant* Find(WorkerId id) const;
  // The connection is gone: forgets the participant. A worker is kept among departed() (dead),
  // so that status and the dashboard show it as dead rather than drop it.
  void Remove(WorkerId id);

  // Admits `from` with the role and figures its Hello gives. InvalidArgument for another protocol
  // version; Unavailable for a wrong token (logged with the pid and host it claimed). On an error
  // nothing is recorded and the caller refuses the connection.
  Status Hello(Participant& from, proto::Hello::Reader hello);
  // Records a worker's heartbeat figures.
  void Heartbeat(Participant& worker, proto::Heartbeat::Reader heartbeat);
  // Keeps a copy of the latest graph-instance report of `worker` and adds its bytes to the sums.
  void RecordRun(Participant& worker, proto::RunReport::Reader report);

  // Alive workers not heard from for more than `timeout` at `now`, ascending.
  std::vector<WorkerId> Expired(Clock::time_point now, std::chrono::milliseconds timeout) const;
  // The worker is dead: no longer alive, and no load (its tasks are the task table's to retry).
  void MarkDead(Participant& worker);

  // A task with `memory_bytes` estimated was dispatched to `worker`. REQUIRES: listed.
  void AddLoad(WorkerId worker, int64_t memory_bytes);
  // Such a task finished or failed. Nothing when the worker is dead or no longer listed.
  void RemoveLoad(WorkerId worker, int64_t memory_bytes);

  // Every worker (dead ones too, not alive), ascending: free bytes are capacity - used -
  // committed.
  std::vector<WorkerLoad> WorkerLoads() const;
  // Alive workers, ascending.
  std::vector<WorkerId> AliveWorkers() const;
  int alive_workers() const;

  // "worker3 (pid 1234 on host)"; the bare id for a participant that is not listed.
  std::string Describe(WorkerId id) const;
  // Where peers pull the participant's objects. REQUIRES: listed.
  const std::string& DataAddress(WorkerId id) const;

  // Every participant, by id (for status and broadcasts).
  const std::map<WorkerId, Participant>& all() const { return participants_; }
  // Workers whose connection is gone, oldest first: the last kDepartedKept, not alive, with
  // their figures as they last were.
  static constexpr size_t kDepartedKept = 64;
  const std::deque<Participant>& departed() const { return departed_; }

 private:
  const std::string token_;
  const std::string session_dir_;
  uint64_t next_id_ = 1;
  std::map<WorkerId, Participant> participants_;
  std::deque<Participant> departed_;
};

}  // namespace tessera

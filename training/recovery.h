// StepRecovery: a training run on a cluster that survives losing workers.
//
// A step fails when a worker of its plan dies or stops answering: the scheduler declares it dead
// (at once when its connection closes, within the heartbeat bound when it is silent), its
// collective groups abort on every other member, and the step fails on every rank, so nothing
// waits. What the failed step had already changed is not trusted (some ranks may have updated
// their shards in place), so the run goes back to its last consistent state: the last disk
// checkpoint, which reshards to any number of workers and any ZeRO stage (training/checkpoint.h).
//
// Recoverable tells a lost worker from any other error (a bad batch, a bug: the caller's to
// report): some worker of the plan is no longer alive in the cluster's status. Recover then
//   1. optionally starts a replacement per lost worker (a local cluster), and waits up to the
//      grace period for the plan's size to come back (a replacement an operator starts counts);
//   2. plans the same model and plan again on the workers there are, as many data-parallel
//      ranks as were asked for if there are enough, else the most the batch divides
//      (ranks x gradient accumulation), never fewer than min_workers;
//   3. loads the last checkpoint into the new trainer;
//   4. says what was lost, what was restored, and from which step the caller replays.
// The caller rewinds its data to the checkpoint's sampler state and replays from there, so the
// run computes what an uninterrupted run resumed from that checkpoint on those workers would.
//
// A lost scheduler (its connection closed, or silent past rpc::SchedulerSilenceLimit) is
// recoverable too when the caller can connect again (RecoveryOptions::reconnect: a cluster
// started with `tessera start --head`, whose supervisor restarts the scheduler on the same port).
// The restarted scheduler knows nothing of the old one: its workers rejoin as new workers, so
// Recover connects again, waits for them as for replacements, and goes on as above.
//
// Step 3 restores the peer snapshot (training/peer_snapshot.h: the state in memory on the workers,
// each piece also on the next rank's worker) when the caller keeps one (Snapshot, at least at
// every checkpoint) and one copy of every piece survived; else the last disk checkpoint. After a
// recovery a snapshot of the new plan is taken at once.
//
// Thread safety: none; one driver thread runs the training loop.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "core/status.h"
#include "training/checkpoint.h"
#include "training/peer_snapshot.h"
#include "training/trainer.h"

namespace tessera {

struct RecoveryOptions {
  int max_restarts = 0;  // recoveries allowed in the run; 0: a lost worker ends it
  int min_workers = 1;   // fewer alive than this after the grace period: give up
  // How long to wait for the plan's size to come back (replacements) before going on with fewer.
  int replacement_grace_ms = 10'000;
  // A local cluster: start one worker for each one lost.
  bool start_replacements = false;
  // How long the scheduler may take to declare a failed step's worker dead (its heartbeat
  // timeout, plus a margin) before the error is taken for something else.
  int detect_ms = 6'000;
  // Keep a peer snapshot every this many steps (0: none; recovery then reads the checkpoint).
  int snapshot_every = 0;
  // A cluster the caller connected to: drops the old Cluster and connects again (retrying while
  // the scheduler restarts); the result replaces the cluster given to StepRecovery. Called only
  // after the trainer on the old one is gone. Empty: a lost scheduler ends the run.
  std::function<Result<Cluster*>()> reconnect;
};

struct RecoveryReport {
  int restart = 0;            // 1 for the first recovery of the run
  int64_t failed_step = 0;    // the step that failed
  std::string error;          // how it failed
  std::string lost;           // the workers lost, with pid and host
  std::string restored_from;  // the checkpoint's step directory
  int64_t restored_step = 0;  // steps taken in the restored state
  int workers = 0;            // data-parallel ranks of the new plan
  std::string plan;           // the new plan, described
  double seconds = 0;         // from the call to Recover until the new trainer was ready
  int64_t replayed() const { return failed_step - 1 - restored_step; }
  std::string ToString() const;
};

class StepRecovery {
 public:
  // `model` and `plan` are what was asked for (the plan's data-parallel size is the size to come
  // back to); the trainers made here run on `cluster` (which must outlive this, or be replaced
  // through options.reconnect) with `placement`, restoring from `checkpoint_dir`.
  StepRecovery(Cluster& cluster, ModelSpec model, TrainingPlan plan, ClusterPlacement placement,
               std::string checkpoint_dir, RecoveryOptions options);

  // Whether `error`, from a step of `trainer`, is a loss that Recover can handle: restarts remain
  // and a worker of the trainer's plan is (or, within detect_ms, becomes) dead, or the scheduler
  // is lost and options.reconnect is set.
  bool Recoverable(const Status& error, Trainer& trainer);

  struct Recovered {
    std::unique_ptr<Trainer> trainer;
    CheckpointInfo checkpoint;  // its step and the data position to rewind to
    RecoveryReport report;
  };
  // `trainer` failed at step `failed_step` with `error`: it is dropped, and a new trainer on the
  // workers there are now is returned with the last checkpoint loaded. Infeasible when too few
  // workers remain (naming how many and what to start); the checkpoint's errors otherwise.
  Result<Recovered> Recover(int64_t failed_step, const Status& error,
                            std::unique_ptr<Trainer> trainer);

  // After each completed step (and after the checkpoint at step 0): with snapshot_every > 0,
  // keeps the trainer's state as the peer snapshot that Recover restores, every snapshot_every
  // steps and whenever `checkpointed` (a disk checkpoint was just saved), so the snapshot is
  // never older than the checkpoint. `sampler_state` is the data position. A failed snapshot (a
  // worker lost meanwhile) keeps the previous one and is only logged: the next step fails too,
  // and is recovered.
  void AfterStep(Trainer& trainer, const std::string& sampler_state, bool checkpointed);
  struct SnapshotStats {
    int taken = 0;
    double seconds = 0;  // in all
    int64_t bytes = 0;   // held by the last one, every copy counted
  };
  const SnapshotStats& snapshot_stats() const { return snapshot_stats_; }

  int restarts() const { return restarts_; }
  const std::vector<RecoveryReport>& reports() const { return reports_; }

 private:
  // Workers of `trainer`'s plan that the cluster's status no longer shows alive, described.
  Result<std::map<WorkerId, std::string>> LostWorkers(const std::vector<WorkerId>& plan_workers);
  // Remembers how the cluster's workers are described (a dead worker leaves the status).
  void Remember(const ClusterInfo& info);
  // The alive workers' count once the alive set has stood still for a moment (workers lost
  // together are declared dead moments apart), waiting up to the grace period for `want`.
  Result<int> AwaitWorkers(int want);
  // Plans on the workers alive now and restores the newest surviving state into a new trainer
  // (the peer snapshot, asking no copy on `dead` first; else the disk checkpoint). `so_far` is
  // the report to complete.
  Result<Recovered> Replan(const RecoveryReport& so_far, const std::set<WorkerId>& dead);

  Cluster* cluster_;
  bool scheduler_lost_ = false;  // Recoverable saw the connection to the scheduler gone
  const ModelSpec model_;
  const TrainingPlan plan_;
  const ClusterPlacement placement_;
  const std::string checkpoint_dir_;
  const RecoveryOptions options_;
  int restarts_ = 0;
  std::vector<WorkerId> last_plan_workers_;
  std::map<WorkerId, std::string> described_;  // "workerN (pid P on HOST)"
  std::vector<RecoveryReport> reports_;
  // Replaces the peer snapshot with one of `trainer` (the old one stays on error).
  Status Snapshot(Trainer& trainer, std::string sampler_state);

  std::optional<PeerSnapshot> snapshot_;
  bool snapshot_due_ = false;  // a snapshot waits for 0/1 Adam's next sync
  SnapshotStats snapshot_stats_;
};

}  // namespace tessera

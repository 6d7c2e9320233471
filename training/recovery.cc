#include "training/recovery.h"

#include <algorithm>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/logging.h"
#include "model/model_spec.h"

namespace tessera {

namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kPoll = std::chrono::milliseconds(50);
// Workers lost together (a host) are declared dead within moments of each other: the alive set
// must stand this long before a plan is made on it.
constexpr auto kSettle = std::chrono::milliseconds(250);
constexpr int kReplanAttempts = 3;

std::string Describe(const std::map<WorkerId, std::string>& lost) {
  if (lost.empty()) return "no worker (the step failed on its own)";
  std::vector<std::string> described;
  described.reserve(lost.size());
  for (const auto& [id, description] : lost) described.push_back(description);
  return fmt::format("{}", fmt::join(described, ", "));
}

}  // namespace

std::string RecoveryReport::ToString() const {
  return fmt::format(
      "recovery {}: step {} failed ({}); lost {}; restored step {} from {}; {} ranks now ({}); "
      "replaying {} step(s); ready in {:.2f} s",
      restart, failed_step, error, lost, restored_step, restored_from, workers, plan, replayed(),
      seconds);
}

StepRecovery::StepRecovery(Cluster& cluster, ModelSpec model, TrainingPlan plan,
                           ClusterPlacement placement, std::string checkpoint_dir,
                           RecoveryOptions options)
    : cluster_(&cluster),
      model_(std::move(model)),
      plan_(std::move(plan)),
      placement_(placement),
      checkpoint_dir_(std::move(checkpoint_dir)),
      options_(std::move(options)) {
  if (Result<ClusterInfo> info = cluster_->Info(); info.ok()) Remember(*info);
}

void StepRecovery::Remember(const ClusterInfo& info) {
  for (const WorkerInfo& worker : info.workers) {
    described_[worker.id] =
        fmt::format("{} (pid {} on {})", worker.id.ToString(), worker.pid, worker.hostname);
  }
}

Result<std::map<WorkerId, std::string>> StepRecovery::LostWorkers(
    const std::vector<WorkerId>& plan_workers) {
  TESSERA_ASSIGN_OR_RETURN(ClusterInfo info, cluster_->Info());
  Remember(info);
  std::map<WorkerId, std::string> lost;
  for (WorkerId id : plan_workers) {
    auto it = std::find_if(info.workers.begin(), info.workers.end(),
                           [&](const WorkerInfo& worker) { return worker.id == id; });
    if (it == info.workers.end() || !it->alive) {
      auto described = described_.find(id);
      lost[id] = described != described_.end() ? described->second : id.ToString();
    }
  }
  return lost;
}

bool StepRecovery::Recoverable(const Status& error, Trainer& trainer) {
  if (error.ok() || cluster_ == nullptr || restarts_ >= options_.max_restarts) return false;
  last_plan_workers_ = trainer.plan().parallel.workers;
  if (last_plan_workers_.empty()) last_plan_workers_ = trainer.backend().workers();
  // The step may fail (a peer's pull, a collective abort) a moment before the scheduler has
  // marked the worker dead: ask until it has, or until it would have.
  const auto deadline = Clock::now() + std::chrono::milliseconds(options_.detect_ms);
  while (true) {
    if (!cluster_->connected()) {
      scheduler_lost_ = true;
      return static_cast<bool>(options_.reconnect);
    }
    Result<std::map<WorkerId, std::string>> lost = LostWorkers(last_plan_workers_);
    if (lost.ok() && !lost->empty()) return true;
    // An error other than a connection that just closed (checked above) is not a loss.
    if ((!lost.ok() && cluster_->connected()) || Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(kPoll);
  }
}

Result<int> StepRecovery::AwaitWorkers(int want) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(options_.replacement_grace_ms);
  std::set<WorkerId> seen;
  auto unchanged_since = Clock::now();
  for (bool first = true;; first = false) {
    TESSERA_ASSIGN_OR_RETURN(ClusterInfo info, cluster_->Info());
    Remember(info);
    std::set<WorkerId> alive;
    for (const WorkerInfo& worker : info.workers) {
      if (worker.alive) alive.insert(worker.id);
    }
    const auto now = Clock::now();
    if (first || alive != seen) {
      seen = std::move(alive);
      unchanged_since = now;
    }
    const int count = static_cast<int>(seen.size());
    if (now - unchanged_since >= kSettle && (count >= want || now >= deadline)) return count;
    std::this_thread::sleep_for(kPoll);
  }
}

Status StepRecovery::Snapshot(Trainer& trainer, std::string sampler_state) {
  const auto start = Clock::now();
  Result<PeerSnapshot> taken = PeerSnapshot::Take(trainer, std::move(sampler_state));
  if (!taken.ok()) {
    // The next step will most likely fail too, and be recovered; the old snapshot stays.
    GetLogger("recovery")
        ->warn("no peer snapshot of step {}: {}", trainer.steps_taken(), taken.status().ToString());
    return taken.status();
  }
  snapshot_.reset();  // the old copies go once the new ones are complete
  snapshot_.emplace(std::move(*taken));
  snapshot_stats_.taken += 1;
  snapshot_stats_.seconds += std::chrono::duration<double>(Clock::now() - start).count();
  snapshot_stats_.bytes = snapshot_->bytes() * snapshot_->copies();
  return Status::Ok();
}

Result<StepRecovery::Recovered> StepRecovery::Replan(const RecoveryReport& so_far,
                                                     const std::set<WorkerId>& dead) {
  Recovered recovered;
  recovered.report = so_far;
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<GraphBackend> backend,
                           MakeClusterBackend(*cluster_, placement_));
  // As many ranks as asked if there are enough workers, else the most the batch divides (a
  // pipeline keeps its stages: P workers per rank).
  const int want = std::max(1, plan_.parallel.data_parallel);
  const int stages = std::max(1, plan_.parallel.pipeline_stages);
  const int alive = static_cast<int>(backend->workers().size());
  TrainingPlan plan = plan_;
  plan.parallel.workers.clear();
  int ranks = std::min(want, alive / stages);
  for (; ranks >= options_.min_workers && ranks >= 1; --ranks) {
    plan.parallel.data_parallel = ranks;
    if (plan.Validate(model_).ok()) break;
  }
  if (ranks < std::max(1, options_.min_workers)) {
    return Infeasible(
        "after losing {}, {} worker(s) are alive and no plan of at least {} rank(s) fits the "
        "batch of {} (it must divide by ranks x {} micro-batches): start {} more worker(s) or "
        "lower --min-workers",
        so_far.lost, alive, options_.min_workers, plan.batch, plan.parallel.micro_batches,
        std::max(0, want - alive));
  }
  TESSERA_ASSIGN_OR_RETURN(recovered.trainer, Trainer::Create(model_, plan, std::move(backend)));
  // The newest state that survived: the peer snapshot (taken at least at every checkpoint),
  // else the disk checkpoint.
  Result<CheckpointInfo> restored = Unavailable("no peer snapshot");
  if (snapshot_) {
    restored = snapshot_->Restore(*recovered.trainer, dead);
    if (!restored.ok()) {
      GetLogger("recovery")->warn("{}; back to the disk checkpoint", restored.status().ToString());
    }
  }
  if (!restored.ok()) restored = LoadCheckpoint(*recovered.trainer, checkpoint_dir_);
  TESSERA_ASSIGN_OR_RETURN(recovered.checkpoint, std::move(restored));
  recovered.report.restored_from = recovered.checkpoint.path;
  recovered.report.restored_step = recovered.checkpoint.step;
  recovered.report.workers = ranks;
  recovered.report.plan = recovered.trainer->plan().parallel.ToString();
  return recovered;
}

void StepRecovery::AfterStep(Trainer& trainer, const std::string& sampler_state,
                             bool checkpointed) {
  if (options_.snapshot_every <= 0 || cluster_ == nullptr) return;
  snapshot_due_ =
      snapshot_due_ || checkpointed || trainer.steps_taken() % options_.snapshot_every == 0;
  // 0/1 Adam's local steps leave every rank its own parameters: the snapshot waits for the sync.
  if (snapshot_due_ && trainer.parameters_synchronized()) {
    snapshot_due_ = false;
    (void)Snapshot(trainer, sampler_state);
  }
}

Result<StepRecovery::Recovered> StepRecovery::Recover(int64_t failed_step, const Status& error,
                                                      std::unique_ptr<Trainer> trainer) {
  if (cluster_ == nullptr) {
    return Unavailable("no cluster to recover on: connecting to the scheduler again failed before");
  }
  const auto start = Clock::now();
  ++restarts_;
  RecoveryReport report;
  report.restart = restarts_;
  report.failed_step = failed_step;
  report.error = error.ToString();
  std::map<WorkerId, std::string> lost;
  if (scheduler_lost_ || !cluster_->connected()) {
    snapshot_.reset();  // its copies went with the workers' state
    report.lost =
        fmt::format("the scheduler at {}, and with it every worker's state", cluster_->address());
    trainer.reset();  // before its cluster goes
    GetLogger("recovery")
        ->warn("step {} failed: {}; lost {}; connecting again", failed_step, report.error,
               report.lost);
    if (!options_.reconnect) {
      return Unavailable("lost the scheduler at {} and there is no way to connect again",
                         cluster_->address());
    }
    Result<Cluster*> reconnected = options_.reconnect();
    if (!reconnected.ok()) {
      cluster_ = nullptr;  // the caller dropped the old one: no recovery after this
      return reconnected.status().WithContext("connecting to the scheduler again");
    }
    cluster_ = *reconnected;
    scheduler_lost_ = false;
  } else {
    TESSERA_ASSIGN_OR_RETURN(lost, LostWorkers(last_plan_workers_));
    report.lost = Describe(lost);
    trainer.reset();  // its state is not trusted; the checkpoint is
    GetLogger("recovery")
        ->warn("step {} failed: {}; lost {}", failed_step, report.error, report.lost);
  }

  const int want = std::max(1, plan_.parallel.num_workers());
  if (options_.start_replacements && !lost.empty()) {
    if (Status added = cluster_->AddLocalWorkers(static_cast<int>(lost.size())); !added.ok()) {
      GetLogger("recovery")->warn("could not start replacements: {}", added.ToString());
    }
  }
  TESSERA_RETURN_IF_ERROR(AwaitWorkers(want).status());
  const bool workers_lost = !lost.empty();
  // Workers may still be dying (several lost at once: a host, a rack): a plan or a restore that
  // loses one is made again on the workers there are then.
  Recovered recovered;
  for (int attempt = 1;; ++attempt) {
    if (workers_lost) {  // others may have been declared dead since
      TESSERA_ASSIGN_OR_RETURN(lost, LostWorkers(last_plan_workers_));
      report.lost = Describe(lost);
    }
    std::set<WorkerId> dead;
    for (const auto& [id, description] : lost) dead.insert(id);
    Result<Recovered> made = Replan(report, dead);
    if (made.ok()) {
      recovered = *std::move(made);
      break;
    }
    if (made.status().code() != StatusCode::kUnavailable || attempt >= kReplanAttempts ||
        !cluster_->connected()) {
      return made.status();
    }
    GetLogger("recovery")
        ->warn("recovery attempt {} failed: {}; planning again", attempt, made.status().ToString());
  }
  // A snapshot of the new plan, so that a later loss finds its pieces on the new buddies.
  if (options_.snapshot_every > 0) {
    (void)Snapshot(*recovered.trainer, recovered.checkpoint.sampler_state);
  }
  recovered.report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  reports_.push_back(recovered.report);
  GetLogger("recovery")->warn("{}", recovered.report.ToString());
  return recovered;
}

}  // namespace tessera

#include "examples/common/training_loop.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <set>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "client/trace.h"
#include "core/statistics.h"
#include "ops/standard_ops.h"
#include "planner/memory_model.h"
#include "planner/step_time.h"

namespace tessera::examples {

namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double Megabytes(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

// ---- Checkpoints ----

Checkpoints::Checkpoints(const CheckpointFlags& flags, std::string program)
    : flags_(flags), program_(std::move(program)) {}

Result<std::optional<CheckpointInfo>> Checkpoints::Resume(Trainer& trainer) {
  if (!flags_.resume) return std::optional<CheckpointInfo>();
  TESSERA_ASSIGN_OR_RETURN(CheckpointInfo loaded, LoadCheckpoint(trainer, flags_.dir));
  std::fprintf(stderr, "%s: resumed from %s (step %lld)\n", program_.c_str(), loaded.path.c_str(),
               static_cast<long long>(loaded.step));
  return std::optional<CheckpointInfo>(std::move(loaded));
}

Status Checkpoints::Save(Trainer& trainer, const std::string& data_state) {
  const auto started = std::chrono::steady_clock::now();
  TESSERA_ASSIGN_OR_RETURN(std::string saved, SaveCheckpoint(trainer, flags_.dir, data_state));
  ++saved_;
  seconds_ += SecondsSince(started);
  std::fprintf(stderr, "%s: checkpoint %s\n", program_.c_str(), saved.c_str());
  return Status::Ok();
}

bool Checkpoints::Due(const Trainer& trainer, int64_t step) {
  if (flags_.dir.empty() || flags_.every <= 0) return false;
  const bool asked = step % flags_.every == 0;
  if (asked && !trainer.parameters_synchronized()) {
    std::fprintf(stderr,
                 "%s: checkpoint of step %lld waits for 0/1 Adam's synchronisation at step %lld "
                 "(each rank holds its own parameters until then)\n",
                 program_.c_str(), static_cast<long long>(step),
                 static_cast<long long>(trainer.NextSynchronizedStep()));
  }
  waiting_ = waiting_ || asked;
  if (!waiting_ || !trainer.parameters_synchronized()) return false;
  waiting_ = false;
  return true;
}

Status Checkpoints::SaveAtEnd(Trainer& trainer, int64_t steps, const std::string& data_state) {
  const bool saved_last = flags_.every > 0 && steps % flags_.every == 0 && !waiting_;
  if (flags_.dir.empty() || trainer.steps_taken() == 0 || saved_last) return Status::Ok();
  if (!trainer.parameters_synchronized()) {
    std::fprintf(stderr,
                 "%s: no checkpoint of the last step %lld: it is one of 0/1 Adam's local steps "
                 "(the ranks synchronise at step %lld); run to a synchronised step to save it\n",
                 program_.c_str(), static_cast<long long>(trainer.steps_taken()),
                 static_cast<long long>(trainer.NextSynchronizedStep()));
    return Status::Ok();
  }
  return Save(trainer, data_state);
}

void Checkpoints::PrintSummary() const {
  if (saved_ == 0) return;
  std::printf("checkpoints: %d saved, %.1f ms each on average\n", saved_,
              1000.0 * seconds_ / saved_);
}

// ---- StepStats ----

void StepStats::Record(const StepReport& report) {
  step_ms_.push_back(report.step_ms);
  // The largest executor peak of any process that ran the step (this one, or each worker).
  peak_bytes_ = std::max(peak_bytes_, report.peak_bytes);
  gpu_peak_bytes_ = std::max(gpu_peak_bytes_, report.device_peak_bytes);
  if (rank_peaks_.size() < report.ranks.size()) rank_peaks_.resize(report.ranks.size());
  for (size_t r = 0; r < report.ranks.size(); ++r) {
    const RunFigures& now = report.ranks[r].figures;
    peak_bytes_ = std::max(peak_bytes_, now.allocator_peak);
    RankFigures& kept = rank_peaks_[r];
    kept.rank = report.ranks[r].rank;
    kept.worker = report.ranks[r].worker;
    kept.figures.role_peaks.resize(now.role_peaks.size());
    for (size_t role = 0; role < now.role_peaks.size(); ++role) {
      kept.figures.role_peaks[role] = std::max(kept.figures.role_peaks[role], now.role_peaks[role]);
    }
    kept.figures.model_state_peak = std::max(kept.figures.model_state_peak, now.model_state_peak);
    kept.figures.transient_peak = std::max(kept.figures.transient_peak, now.transient_peak);
    kept.figures.total_peak = std::max(kept.figures.total_peak, now.total_peak);
    kept.figures.total_with_scratch_peak =
        std::max(kept.figures.total_with_scratch_peak, now.total_with_scratch_peak);
    kept.figures.collective_bytes_sent = now.collective_bytes_sent;
    kept.figures.pushed_bytes = now.pushed_bytes;
  }
  last_loss_ = report.loss;
}

double StepStats::MedianStepMs() const {
  std::vector<double> timed = step_ms_;
  if (timed.size() > 1) timed.erase(timed.begin());  // the first step warms up
  return Median(std::move(timed));
}

void StepStats::PrintRanks() const {
  for (const RankFigures& rank : rank_peaks_) {
    const RunFigures& f = rank.figures;
    std::printf(
        "worker rank %d%s: peak params %.2f MB, grads %.2f MB, optimizer %.2f MB (model state "
        "%.2f MB), transient %.2f MB, all objects %.2f MB, with kernel scratch %.2f MB; sent %.2f "
        "MB/step\n",
        rank.rank, rank.worker.valid() ? (" (" + rank.worker.ToString() + ")").c_str() : "",
        Megabytes(f.peak(ObjectRole::kParameter)), Megabytes(f.peak(ObjectRole::kGradient)),
        Megabytes(f.peak(ObjectRole::kOptimizerState)), Megabytes(f.model_state_peak),
        Megabytes(f.transient_peak), Megabytes(f.total_peak), Megabytes(f.total_with_scratch_peak),
        Megabytes(f.collective_bytes_sent + f.pushed_bytes));
  }
}

void StepStats::PrintSummary(int64_t steps, const char* rate, double items_per_step) const {
  const double median = MedianStepMs();
  const std::string gpu_peak =
      gpu_peak_bytes_ > 0 ? fmt::format(" gpu_peak_mb={:.1f}", Megabytes(gpu_peak_bytes_)) : "";
  double steps_ms = 0;
  for (double ms : step_ms_) steps_ms += ms;
  const std::string spilled =
      spilled_bytes_ ? fmt::format(" spilled_mb={:.1f}", Megabytes(*spilled_bytes_)) : "";
  std::printf(
      "summary: steps=%lld step_ms_median=%.2f %s=%.0f final_loss=%.6f peak_mb=%.1f%s%s "
      "steps_s=%.3f\n",
      static_cast<long long>(steps), median, rate,
      median > 0 ? items_per_step / (median / 1000.0) : 0.0, last_loss_, Megabytes(peak_bytes_),
      gpu_peak.c_str(), spilled.c_str(), steps_ms / 1000.0);
}

// ---- Progress ----

void Progress::AfterStep(int64_t step, int64_t steps) {
  const double elapsed = SecondsSince(start_);
  if (elapsed - last_s_ < 10.0 || step >= steps) return;
  last_s_ = elapsed;
  const double eta = elapsed / static_cast<double>(step) * static_cast<double>(steps - step);
  std::fprintf(stderr, "progress: %lld/%lld steps (%.0f%%), elapsed %.0f s, eta %.0f s\n",
               static_cast<long long>(step), static_cast<long long>(steps),
               100.0 * static_cast<double>(step) / static_cast<double>(steps), elapsed, eta);
}

// ---- TrainingLoop ----

TrainingLoop::TrainingLoop(Options options, Hooks hooks, Checkpoints& checkpoints,
                           StepRecovery* recovery, Session& session)
    : options_(std::move(options)),
      hooks_(std::move(hooks)),
      checkpoints_(checkpoints),
      recovery_(recovery),
      session_(session) {}

std::string TrainingLoop::DataState() const {
  return hooks_.data_state ? hooks_.data_state() : std::string();
}

Result<int64_t> TrainingLoop::Recover(std::unique_ptr<Trainer>& trainer, int64_t step,
                                      const Status& error) {
  if (!failed_at_) failed_at_ = std::chrono::steady_clock::now();
  Result<StepRecovery::Recovered> recovered = recovery_->Recover(step, error, std::move(trainer));
  if (!recovered.ok()) {
    return recovered.status().WithContext(fmt::format("recovering from step {}", step));
  }
  trainer = std::move(recovered->trainer);
  if (hooks_.restore_data_state) {
    TESSERA_RETURN_IF_ERROR(hooks_.restore_data_state(recovered->checkpoint.sampler_state)
                                .WithContext(recovered->checkpoint.path));
  }
  std::fprintf(stderr, "%s: %s\n", options_.program.c_str(), recovered->report.ToString().c_str());
  stats_.ResetRanks();  // the new plan's ranks
  return recovered->checkpoint.step;
}

void TrainingLoop::ReportProgress(int64_t step, const StepReport& report, const Trainer& trainer,
                                  double validation_loss) {
  Cluster* cluster = session_.cluster();
  if (cluster == nullptr || !cluster->connected()) return;
  // For the scheduler's dashboard and /metrics. One-way: a lost connection shows up on the next
  // step, where recovery handles it.
  const double per_second = options_.items_per_step / (report.step_ms / 1000.0);
  JobProgress progress{.job = options_.job,
                       .step = step,
                       .loss = report.loss,
                       .step_ms = report.step_ms,
                       .validation_loss = validation_loss};
  (options_.items_are_tokens ? progress.tokens_per_second : progress.samples_per_second) =
      per_second;
  if (std::string plan = trainer.plan().parallel.ToString(); plan != reported_plan_) {
    progress.plan = plan;
    reported_plan_ = std::move(plan);
  }
  (void)cluster->ReportProgress(progress);
}

namespace {

// What the cluster's workers have written to disk so far (their object stores' spills, as of
// their latest heartbeats); nullopt in process or when the cluster does not answer.
std::optional<int64_t> SpilledSoFar(Session& session) {
  Cluster* cluster = session.cluster();
  if (cluster == nullptr || !cluster->connected()) return std::nullopt;
  Result<ClusterInfo> info = cluster->Info();
  if (!info.ok()) return std::nullopt;
  int64_t total = 0;
  for (const WorkerInfo& worker : info->workers) total += worker.spilled_total_bytes;
  return total;
}

}  // namespace

Status TrainingLoop::Run(std::unique_ptr<Trainer>& trainer, int64_t first_step) {
  const std::optional<int64_t> spilled_before = SpilledSoFar(session_);
  Status ran = RunSteps(trainer, first_step);
  if (!ran.ok() || !spilled_before) return ran;  // the summary is not printed after a failure
  // The workers report their spills with their heartbeats: wait for one after the last step.
  std::this_thread::sleep_for(
      std::chrono::milliseconds(session_.settings().heartbeat_interval_ms + 50));
  if (const std::optional<int64_t> spilled_after = SpilledSoFar(session_); spilled_after) {
    stats_.SetSpilledBytes(std::max<int64_t>(0, *spilled_after - *spilled_before));
    if (*spilled_after > *spilled_before) {
      std::fprintf(stderr,
                   "%s: the workers spilled %.1f MB of objects to disk (their host tiers were "
                   "full): give them more host memory (--host-memory-mb of tessera start) or plan "
                   "under a cap (--host-memory-gib) to keep steps off the disk\n",
                   options_.program.c_str(), Megabytes(*spilled_after - *spilled_before));
    }
  }
  return Status::Ok();
}

Status TrainingLoop::RunSteps(std::unique_ptr<Trainer>& trainer, int64_t first_step) {
  for (int64_t i = first_step; i <= options_.steps; ++i) {
    Result<std::vector<Tensor>> batch = hooks_.batch(i);
    if (!batch.ok()) return batch.status().WithContext(fmt::format("step {}", i));
    Result<StepReport> report = trainer->Step(*batch, options_.lr);
    if (!report.ok() && recovery_ && recovery_->Recoverable(report.status(), *trainer)) {
      TESSERA_ASSIGN_OR_RETURN(const int64_t restored, Recover(trainer, i, report.status()));
      i = restored;  // the loop goes on with the step after it: the replay
      continue;
    }
    if (!report.ok()) return report.status().WithContext(fmt::format("step {}", i));
    if (failed_at_) {
      std::fprintf(stderr,
                   "%s: recovery %d: step %lld completed %.2f s after the failed step returned\n",
                   options_.program.c_str(), recovery_->restarts(), static_cast<long long>(i),
                   SecondsSince(*failed_at_));
      failed_at_.reset();
    }
    stats_.Record(*report);
    if (!std::isfinite(report->loss)) {
      return Internal("loss became {} at step {}; try a lower --lr", report->loss, i);
    }
    if (hooks_.log_step) TESSERA_RETURN_IF_ERROR(hooks_.log_step(*trainer, i, *report, *batch));
    progress_.AfterStep(i, options_.steps);
    const bool checkpointed = checkpoints_.Due(*trainer, i);
    if (checkpointed) {
      Status saved = checkpoints_.Save(*trainer, DataState());
      if (!saved.ok() && recovery_ && recovery_->Recoverable(saved, *trainer)) {
        // A worker lost while writing the checkpoint: the previous checkpoint is intact (this one
        // never left its staging directory), so the run goes back to it, replays, and writes this
        // one again when it gets here.
        std::fprintf(stderr, "%s: checkpoint of step %lld not written: %s\n",
                     options_.program.c_str(), static_cast<long long>(i), saved.ToString().c_str());
        TESSERA_ASSIGN_OR_RETURN(const int64_t restored, Recover(trainer, i, saved));
        i = restored;
        continue;
      }
      TESSERA_RETURN_IF_ERROR(saved.WithContext(fmt::format("checkpoint of step {}", i)));
    }
    if (recovery_) recovery_->AfterStep(*trainer, DataState(), checkpointed);
    double validation_loss = std::numeric_limits<double>::quiet_NaN();
    if (hooks_.after_step) {
      TESSERA_ASSIGN_OR_RETURN(validation_loss, hooks_.after_step(*trainer, i));
    }
    ReportProgress(i, *report, *trainer, validation_loss);
  }
  return Status::Ok();
}

Status PrintMemoryPlan(const Trainer& trainer, const TraceFlags& flags) {
  if (!flags.explain_memory) return Status::Ok();
  const Graph& graph = trainer.step_graph().graph;
  Result<MemoryProfile> profile = PredictMemory(graph);
  if (!profile.ok()) return profile.status().WithContext("--explain-memory");
  std::fputs(ExplainMemory(graph, *profile).c_str(), stdout);
  const MemoryDecision& memory = trainer.step_graph().memory;
  if (memory.cap_bytes > 0 || memory.activation_cap_bytes > 0) {
    std::printf("memory plan (%s tier): %s\n", MemoryTierName(memory.tier), memory.reason.c_str());
  }
  // With profiled layer times (--balance profile), how long the planned step should take.
  const ParallelConfig& parallel = trainer.step_graph().parallel;
  if (!parallel.layer_op_costs.empty()) {
    OpRegistry registry;
    TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry));
    Result<StepTimePrediction> predicted = PredictStepTime(
        graph, trainer.model(), parallel.layer_op_costs, registry, parallel.task_overhead_ms,
        trainer.plan().memory.disk_copy_compute_us_per_byte);
    if (!predicted.ok()) return predicted.status().WithContext("--explain-memory: the step time");
    std::printf(
        "predicted step time: %.1f ms (the slowest worker: layers %.1f, other tasks %.1f, "
        "%.3f ms a task beyond its own time %.1f; from the profiled layer times)\n",
        predicted->step_ms, predicted->layer_ms, predicted->other_ms, parallel.task_overhead_ms,
        predicted->overhead_ms);
  }
  std::fflush(stdout);
  return Status::Ok();
}

Status WriteStepTrace(Trainer& trainer, const TraceFlags& flags, const std::string& program) {
  if (flags.path.empty()) return Status::Ok();
  TESSERA_ASSIGN_OR_RETURN(Timeline timeline, trainer.StepTimeline(flags.steps));
  if (timeline.spans.empty()) {
    return NotFound("--trace: no step ran, so there is nothing to trace (use --steps >= 1)");
  }
  TESSERA_RETURN_IF_ERROR(WriteChromeTrace(flags.path, timeline).WithContext("--trace"));
  std::set<uint64_t> steps;
  for (const TimelineSpan& span : timeline.spans) steps.insert(span.instance);
  std::fprintf(stderr,
               "%s: trace of the last %zu step(s) (%zu spans, %zu process(es)) written to %s\n",
               program.c_str(), steps.size(), timeline.spans.size(), timeline.processes.size(),
               flags.path.c_str());
  return Status::Ok();
}

}  // namespace tessera::examples

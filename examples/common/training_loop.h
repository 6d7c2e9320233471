// The pieces of a training run every example driver repeats:
//
//   Checkpoints   --checkpoint-dir / --checkpoint-every / --resume: resuming (the trainer's state
//                 and the data position), saving with timing, the end-of-run checkpoint;
//   StepStats     per-step figures: the median step time, the largest host and GPU peaks, each
//                 rank's largest model state and its bytes sent; the "worker rank" lines and the
//                 one "summary:" line scripts and tests parse;
//   Progress      a line with the time left, at most every ~10 s, on stderr;
//   TrainingLoop  the steps themselves: the batch, the step, recovery from lost workers (re-plan,
//                 restore, replay), the dashboard's progress report, checkpoints, snapshots; the
//                 driver prints its own step lines and evaluates through hooks.
//
// Output: lines a driver's users and scripts read go to stdout ("worker rank ...", "checkpoints:
// ...", "peer snapshots: ...", "summary: ..."); diagnostics to stderr, prefixed "<program>: ".
// Not thread-safe: one driver thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client/cluster.h"
#include "core/status.h"
#include "core/tensor.h"
#include "examples/common/flags.h"
#include "examples/common/session.h"
#include "training/checkpoint.h"
#include "training/recovery.h"
#include "training/trainer.h"

namespace tessera::examples {

class Checkpoints {
 public:
  Checkpoints(const CheckpointFlags& flags, std::string program);

  // With --resume: loads the latest checkpoint into `trainer` and prints where from; returns it
  // (its step and data position). Without: nullopt. LoadCheckpoint's errors.
  Result<std::optional<CheckpointInfo>> Resume(Trainer& trainer);
  // Saves the trainer's state with the data position `data_state`; prints the step directory.
  Status Save(Trainer& trainer, const std::string& data_state);
  // Whether --checkpoint-every asks for one after step `step` of `trainer`: one that fell on
  // one of 0/1 Adam's local steps waits (with a message) for its next sync.
  bool Due(const Trainer& trainer, int64_t step);
  // At the end of a run of `steps` steps: saves unless the last step was saved (or none ran).
  Status SaveAtEnd(Trainer& trainer, int64_t steps, const std::string& data_state);
  // "checkpoints: N saved, X ms each on average" on stdout, when any was saved.
  void PrintSummary() const;

 private:
  CheckpointFlags flags_;
  std::string program_;
  int saved_ = 0;
  double seconds_ = 0;
  bool waiting_ = false;  // a checkpoint due at a local step
};

class StepStats {
 public:
  // A completed step's figures.
  void Record(const StepReport& report);
  // After a recovery: the new plan's ranks replace the old ones' figures.
  void ResetRanks() { rank_peaks_.clear(); }
  float last_loss() const { return last_loss_; }
  // The median step time, the first step left out when there are others (allocation warm-up).
  double MedianStepMs() const;
  // Per rank on stdout: "worker rank R (workerN): peak params X MB, grads, optimizer (model
  // state), transient; sent Y MB/step".
  void PrintRanks() const;
  // "summary: steps=N step_ms_median=X <rate>=Y final_loss=Z peak_mb=M [gpu_peak_mb=G]
  // [spilled_mb=D] steps_s=S" on stdout: `rate` is "tokens_per_s" or "samples_per_s" (at the
  // median step), D what the workers' object stores wrote to disk during the steps (on a
  // cluster only: in process nothing spills),
  // `items_per_step` what one step processes; S the steps' times together, every one (a run's
  // end-to-end training time: warm-up, plan switches and slow steps included; not the start,
  // evaluations or checkpoints).
  void PrintSummary(int64_t steps, const char* rate, double items_per_step) const;
  void SetSpilledBytes(int64_t bytes) { spilled_bytes_ = bytes; }

 private:
  std::vector<double> step_ms_;
  std::optional<int64_t> spilled_bytes_;  // on a cluster: the workers' spills during the steps
  int64_t peak_bytes_ = 0, gpu_peak_bytes_ = 0;
  float last_loss_ = 0;
  // Per rank: the largest figures of any step, and the last step's bytes sent.
  std::vector<RankFigures> rank_peaks_;
};

class Progress {
 public:
  Progress() : start_(std::chrono::steady_clock::now()) {}
  // After step `step` of `steps`: "progress: i/N steps (P%), elapsed E s, eta T s" on stderr
  // once ~10 s have passed since the last one (never after the last step).
  void AfterStep(int64_t step, int64_t steps);

 private:
  std::chrono::steady_clock::time_point start_;
  double last_s_ = 0;
};

class TrainingLoop {
 public:
  struct Options {
    std::string program;  // prefix of stderr lines
    std::string job;      // the dashboard's name for the run (Cluster::ReportProgress)
    int64_t steps = 0;    // the last step
    float lr = 0;
    // What a step processes, for the dashboard and the summary: tokens or samples.
    double items_per_step = 0;
    bool items_are_tokens = true;
  };
  struct Hooks {
    // The batch of the next step: one host tensor per model input. Called once per step taken,
    // replays after a recovery included (the data position was rewound first).
    std::function<Result<std::vector<Tensor>>(int64_t step)> batch;
    // The data position, saved with checkpoints and snapshots; and restoring one (a recovery
    // rewinds to its checkpoint's). Empty: the batches depend on the step number only.
    std::function<std::string()> data_state;
    std::function<Status(const std::string&)> restore_data_state;
    // After each completed step: the driver's step line (as often as it wants).
    std::function<Status(Trainer&, int64_t step, const StepReport&,
                         const std::vector<Tensor>& batch)>
        log_step;
    // Last thing after each completed step (after checkpoints and snapshots): evaluation. Returns
    // the validation loss when it evaluated (reported to the dashboard with the step), else NaN.
    std::function<Result<double>(Trainer&, int64_t step)> after_step;
  };

  // `checkpoints`, `recovery` (null: none) and `session` outlive the loop.
  TrainingLoop(Options options, Hooks hooks, Checkpoints& checkpoints, StepRecovery* recovery,
               Session& session);

  // Steps first_step .. options.steps on *trainer. A step that fails because a worker or the
  // scheduler was lost is recovered when `recovery` allows (*trainer is then the new one, and
  // the steps since its checkpoint are replayed); any other failure ends the run, naming the
  // step. A loss that is not finite is Internal.
  // On a cluster, what its workers spilled to disk meanwhile goes to the summary (and, when
  // anything, a line on stderr saying what to change).
  Status Run(std::unique_ptr<Trainer>& trainer, int64_t first_step);
  const StepStats& stats() const { return stats_; }

 private:
  Status RunSteps(std::unique_ptr<Trainer>& trainer, int64_t first_step);
  std::string DataState() const;
  // A recovered step: the new trainer, the data rewound, the report printed. Returns the
  // checkpoint's step (the loop goes on after it).
  Result<int64_t> Recover(std::unique_ptr<Trainer>& trainer, int64_t step, const Status& error);
  // The dashboard's figures of a completed step (the plan with the first, and when it changed).
  void ReportProgress(int64_t step, const StepReport& report, const Trainer& trainer,
                      double validation_loss);

  Options options_;
  Hooks hooks_;
  Checkpoints& checkpoints_;
  StepRecovery* recovery_;
  Session& session_;
  StepStats stats_;
  Progress progress_;
  std::string reported_plan_;  // the plan last sent with a step
  // When the step of a recovery failed (reported once the next step completes).
  std::optional<std::chrono::steady_clock::time_point> failed_at_;
};

// --trace: writes the last --trace-steps steps' trace (client/trace.h) and says so on stderr;
// nothing without --trace. NotFound when no step ran.
Status WriteStepTrace(Trainer& trainer, const TraceFlags& flags, const std::string& program);
// --explain-memory: the step graph's memory as planner/memory_model.h predicts it, on stdout
// (nothing without the flag).
Status PrintMemoryPlan(const Trainer& trainer, const TraceFlags& flags);

}  // namespace tessera::examples

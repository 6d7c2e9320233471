// Training runs recorded and compared across plans: the equivalence every parallel plan promises
// (docs/architecture.md: within 1e-5 of one worker's losses).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "client/cluster.h"
#include "core/status.h"
#include "training/trainer.h"

namespace tessera::testing {

struct TrainingRun {
  std::vector<float> losses, grad_norms;
  std::vector<float> parameter;  // one parameter's values after the last step
  std::vector<StepReport> reports;
};

// Initialises `trainer` from `seed`, runs `steps` steps (`step(trainer, i)` takes step i), and
// reads `parameter` at the end.
Result<TrainingRun> RecordRun(Trainer& trainer, uint64_t seed, int steps,
                              const std::function<Result<StepReport>(Trainer&, int)>& step,
                              const std::string& parameter);

// A local cluster of `workers` CPU worker processes of this build's `tessera`, one thread each
// (each with its allocator capped at `host_cap_gib` when it is not 0): what the plan tests run
// their plans on.
Result<std::unique_ptr<Cluster>> StartTestCluster(int workers, double host_cap_gib = 0);

// `run` against `reference`: every loss within 1e-5 relative, every gradient norm within 1e-4
// relative, the parameter within 1e-4 of its scale. Prints the worst loss difference, labelled.
void ExpectSameRun(const TrainingRun& run, const TrainingRun& reference, const std::string& label);

// The memory plan worked under an activation budget: a cap is set and some layer is not kept
// whole (kept in part, recomputed or swapped).
void ExpectActivationsPlanned(const MemoryDecision& memory);

// The predicted memory of `worker` in `profile` (nullptr when it has none).
const WorkerMemory* PredictedWorker(const MemoryProfile& profile, WorkerId worker);

// Every parameter's gradient (in ParameterNames' order) after `trainer`'s first step on `batch`
// at `lr`, from parameters initialised from `seed`.
Result<std::vector<std::vector<float>>> FirstStepGradients(Trainer& trainer, uint64_t seed,
                                                           const std::vector<Tensor>& batch,
                                                           float lr);

// Over a split model's layers (ModelSpec::tensor_parallel ranks): the elements of the whole
// model's parameters its ranks hold together (a split slot a 1/T slice of its parameter, a
// replicated one the whole of it), its partial outputs and its partial input gradients. A
// failure names a layer without its TensorParallelLayer.
struct SplitCounts {
  int64_t held = 0, partial_outputs = 0, partial_gradients = 0;
};
SplitCounts CountSplit(const ModelSpec& split);

// `rank`'s measured activation peak and its worker's predicted one in `profile`; a failure when
// they differ by more than 5% of the prediction (or the worker has none), labelled `where`.
struct ActivationPeaks {
  double measured = 0, predicted = 0;
};
ActivationPeaks ExpectActivationPeakAsPredicted(const MemoryProfile& profile,
                                                const RankFigures& rank, const std::string& where);

// After `run` of `trainer`'s plan under an activation budget: every rank's measured activation
// peak (its last step's) is under the budget and within max(`relative` x the prediction,
// `absolute` bytes) of its worker's predicted peak.
void ExpectActivationPeaksAsPredicted(const Trainer& trainer, const TrainingRun& run,
                                      double relative, int64_t absolute);

}  // namespace tessera::testing

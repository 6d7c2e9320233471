#include "plan_equivalence.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "planner/activation_solver.h"
#include "planner/memory_model.h"
#include "test_util.h"

namespace tessera::testing {

Result<std::unique_ptr<Cluster>> StartTestCluster(int workers, double host_cap_gib) {
  LocalClusterOptions options;
  options.cpu_workers = workers;
  options.threads_per_worker = 1;
  options.host_cap_gib = host_cap_gib;
  options.tessera_binary = BinaryPath("tessera");
  return Cluster::StartLocal(options);
}

Result<TrainingRun> RecordRun(Trainer& trainer, uint64_t seed, int steps,
                              const std::function<Result<StepReport>(Trainer&, int)>& step,
                              const std::string& parameter) {
  TESSERA_RETURN_IF_ERROR(trainer.InitializeParameters(seed));
  TrainingRun run;
  for (int i = 0; i < steps; ++i) {
    TESSERA_ASSIGN_OR_RETURN(StepReport report, step(trainer, i));
    run.losses.push_back(report.loss);
    run.grad_norms.push_back(report.grad_norm);
    run.reports.push_back(std::move(report));
  }
  TESSERA_ASSIGN_OR_RETURN(run.parameter, trainer.GetParameter(parameter));
  return run;
}

void ExpectSameRun(const TrainingRun& run, const TrainingRun& reference, const std::string& label) {
  ASSERT_EQ(run.losses.size(), reference.losses.size()) << label;
  double worst = 0;
  for (size_t i = 0; i < run.losses.size(); ++i) {
    const double expected = reference.losses[i];
    const double relative = std::abs(run.losses[i] - expected) / std::abs(expected);
    worst = std::max(worst, relative);
    EXPECT_LE(relative, 1e-5) << label << " step " << i << ": " << run.losses[i] << " vs "
                              << expected;
    EXPECT_NEAR(run.grad_norms[i], reference.grad_norms[i], 1e-4 * reference.grad_norms[i])
        << label << " step " << i;
  }
  EXPECT_LE(ScaledMaxError(run.parameter, reference.parameter), 1e-4) << label;
  std::printf("[ %s ] worst relative loss difference over %zu steps: %.2e\n", label.c_str(),
              run.losses.size(), worst);
}

void ExpectActivationsPlanned(const MemoryDecision& memory) {
  ASSERT_GT(memory.activation_cap_bytes, 0);
  EXPECT_LT(CountChoice(memory.activations, ActivationChoice::kKeep),
            static_cast<int>(memory.activations.size()))
      << memory.reason;
}

const WorkerMemory* PredictedWorker(const MemoryProfile& profile, WorkerId worker) {
  const auto it = std::find_if(profile.workers.begin(), profile.workers.end(),
                               [&](const WorkerMemory& w) { return w.order.worker == worker; });
  return it == profile.workers.end() ? nullptr : &*it;
}

Result<std::vector<std::vector<float>>> FirstStepGradients(Trainer& trainer, uint64_t seed,
                                                           const std::vector<Tensor>& batch,
                                                           float lr) {
  TESSERA_RETURN_IF_ERROR(trainer.SetKeepGradients(true));
  TESSERA_RETURN_IF_ERROR(trainer.InitializeParameters(seed));
  TESSERA_RETURN_IF_ERROR(trainer.Step(batch, lr).status());
  std::vector<std::vector<float>> grads;
  for (const std::string& name : trainer.ParameterNames()) {
    TESSERA_ASSIGN_OR_RETURN(std::vector<float> grad, trainer.GetGradient(name));
    grads.push_back(std::move(grad));
  }
  return grads;
}

SplitCounts CountSplit(const ModelSpec& split) {
  SplitCounts counts;
  for (const LayerSpec& layer : split.layers) {
    EXPECT_TRUE(layer.tensor_parallel.has_value()) << layer.name;
    if (!layer.tensor_parallel.has_value()) continue;
    const TensorParallelLayer& tp = *layer.tensor_parallel;
    const auto& slots = layer.params.slots();
    for (size_t s = 0; s < slots.size() && s < tp.slots.size(); ++s) {
      counts.held += tp.slots[s].replicated() ? slots[s].shape.numel()
                                              : slots[s].shape.numel() * split.tensor_parallel;
    }
    for (bool partial : tp.partial_outputs) counts.partial_outputs += partial;
    for (bool partial : tp.partial_input_gradients) counts.partial_gradients += partial;
  }
  return counts;
}

ActivationPeaks ExpectActivationPeakAsPredicted(const MemoryProfile& profile,
                                                const RankFigures& rank, const std::string& where) {
  ActivationPeaks peaks{.measured =
                            static_cast<double>(rank.figures.peak(ObjectRole::kActivation))};
  const WorkerMemory* worker = PredictedWorker(profile, rank.worker);
  EXPECT_NE(worker, nullptr) << where;
  if (worker == nullptr) return peaks;
  peaks.predicted =
      static_cast<double>(worker->role_peaks[static_cast<size_t>(ObjectRole::kActivation)]);
  EXPECT_NEAR(peaks.measured, peaks.predicted, 0.05 * peaks.predicted) << where;
  return peaks;
}

void ExpectActivationPeaksAsPredicted(const Trainer& trainer, const TrainingRun& run,
                                      double relative, int64_t absolute) {
  const MemoryDecision& memory = trainer.step_graph().memory;
  ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(trainer.step_graph().graph));
  ASSERT_FALSE(run.reports.empty());
  ASSERT_EQ(run.reports.back().ranks.size(), profile.workers.size());
  for (const RankFigures& rank : run.reports.back().ranks) {
    const int64_t measured = rank.figures.peak(ObjectRole::kActivation);
    EXPECT_LE(measured, memory.activation_cap_bytes) << memory.reason;
    const WorkerMemory* worker = PredictedWorker(profile, rank.worker);
    ASSERT_NE(worker, nullptr);
    const auto predicted =
        static_cast<double>(worker->role_peaks[static_cast<size_t>(ObjectRole::kActivation)]);
    EXPECT_NEAR(static_cast<double>(measured), predicted,
                std::max(relative * predicted, static_cast<double>(absolute)))
        << rank.worker.ToString() << ": " << memory.reason;
  }
}

}  // namespace tessera::testing

#include "plan_equivalence.h"

#include <cmath>
#include <cstdio>

#include "planner/activation_solver.h"
#include "test_util.h"

namespace tessera::testing {

Result<std::unique_ptr<Cluster>> StartTestCluster(int workers) {
  LocalClusterOptions options;
  options.cpu_workers = workers;
  options.threads_per_worker = 1;
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

}  // namespace tessera::testing

// The 3D U-Net (model/unet3d.h, built with the model API) under every plan: on a local cluster
// of real worker processes, 2 and 4 workers at every ZeRO stage train the same run as one worker
// (losses within 1e-5 relative over 20 steps), so does ZeRO-3 on two workers with half of its
// activations (each worker's peak as predicted), each rank's model state follows the ZeRO
// formulas, and train_unet3d learns (the loss falls, Dice rises) and resumes from checkpoints.
#include <cmath>
#include <filesystem>
#include <memory>
#include <regex>

#include <fmt/format.h>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "data/volumes.h"
#include "model/unet3d.h"
#include "plan_equivalence.h"
#include "planner/activation_solver.h"
#include "test_util.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

constexpr int kClusterWorkers = 4;
constexpr int kSteps = 20;
constexpr int64_t kBatch = 4;

UNet3dConfig Tiny() { return *UNet3dConfig::Preset("tiny"); }

std::vector<Tensor> Batch(int step) {
  const UNet3dConfig c = Tiny();
  Result<VolumeBatch> made = GenerateVolumes(kBatch, c.volume, c.in_channels, 100 + step);
  TESSERA_CHECK(made.ok(), "{}", made.status().ToString());
  const int64_t v = c.volume;
  return {FloatTensor(Shape{kBatch, c.in_channels, v, v, v}, made->volumes),
          IntTensor(Shape{kBatch, v, v, v}, made->labels)};
}

TrainingPlan Plan(int workers, int stage, OffloadMode offload = OffloadMode::kNone, int accum = 1) {
  TrainingPlan plan;
  plan.batch = kBatch;
  plan.parallel.data_parallel = workers;
  plan.parallel.zero_stage = stage;
  plan.parallel.offload = offload;
  plan.parallel.micro_batches = accum;
  return plan;
}

Result<TrainingRun> Train(Trainer& trainer, int steps = kSteps) {
  return RecordRun(
      trainer, 2, steps, [](Trainer& t, int step) { return t.Step(Batch(step), 3e-3f); }, "head.w");
}

class UNet3dPlansTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Result<std::unique_ptr<Cluster>> cluster = StartTestCluster(kClusterWorkers);
    ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
    cluster_ = std::move(*cluster).release();
    Result<ModelSpec> model = BuildUNet3d(Tiny(), CpuRegistry());
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    auto reference = Trainer::Create(*model, Plan(1, 0), ExecutorOptions{});
    ASSERT_TRUE(reference.ok()) << reference.status().ToString();
    Result<TrainingRun> run = Train(**reference);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    reference_ = new TrainingRun(*std::move(run));
  }
  static void TearDownTestSuite() {
    delete cluster_;
    delete reference_;
    cluster_ = nullptr;
    reference_ = nullptr;
  }

  static Result<std::unique_ptr<Trainer>> Distributed(const TrainingPlan& plan) {
    TESSERA_ASSIGN_OR_RETURN(ModelSpec model, BuildUNet3d(Tiny(), CpuRegistry()));
    TESSERA_ASSIGN_OR_RETURN(auto backend, MakeClusterBackend(*cluster_));
    return Trainer::Create(std::move(model), plan, std::move(backend));
  }

  static void ExpectSameRun(const TrainingPlan& plan) {
    ASSERT_NE(reference_, nullptr);
    ASSERT_OK_AND_ASSIGN(auto trainer, Distributed(plan));
    ASSERT_OK_AND_ASSIGN(TrainingRun run, Train(*trainer));
    testing::ExpectSameRun(run, *reference_, plan.parallel.ToString());
  }

  static Cluster* cluster_;
  static TrainingRun* reference_;
};

Cluster* UNet3dPlansTest::cluster_ = nullptr;
TrainingRun* UNet3dPlansTest::reference_ = nullptr;

TEST_F(UNet3dPlansTest, EveryZeroStageOnTwoAndFourWorkersMatchesOneWorker) {
  for (int stage = 0; stage <= 3; ++stage) {
    for (int workers : {2, 4}) ExpectSameRun(Plan(workers, stage));
  }
}

TEST_F(UNet3dPlansTest, OffloadAndGradientAccumulationMatchOneWorker) {
  ExpectSameRun(Plan(2, 3, OffloadMode::kOptimizer));
  ExpectSameRun(Plan(2, 2, OffloadMode::kNone, 2));
}

// The memory plan on a cluster: ZeRO-3 over two workers with half of the U-Net's activations
// (its layers keeping only their convolutions' outputs, or recomputed) trains the one worker's
// run, each worker under the budget as predicted.
// At half its activations the layers keep part and recompute; at a quarter, below what its top
// decoder's backward needs, each rank's two rows also run as two micro-batches of one.
TEST_F(UNet3dPlansTest, HalfAndAQuarterOfItsActivationsUnderZero3MatchOneWorker) {
  for (double budget : {0.5, 0.25}) {
    const std::string what = fmt::format("ZeRO-3 with {:.0f}% of its activations", 100 * budget);
    TrainingPlan plan = Plan(2, 3);
    plan.memory.activation_budget = budget;
    ASSERT_OK_AND_ASSIGN(auto trainer, Distributed(plan));
    ExpectActivationsPlanned(trainer->step_graph().memory);
    EXPECT_EQ(trainer->step_graph().parallel.micro_batches, budget < 0.5 ? 2 : 1)
        << trainer->step_graph().memory.reason;
    ASSERT_OK_AND_ASSIGN(TrainingRun run, Train(*trainer));
    testing::ExpectSameRun(run, *reference_, what);
    ExpectActivationPeaksAsPredicted(*trainer, run, 0.03, 0);
  }
}

// fp32 model state per rank for P parameters: parameters 4P, gradients 4P, Adam 8P, sharded
// over N ranks as each stage promises.
TEST_F(UNet3dPlansTest, ModelStatePerRankFollowsTheZeroFormulas) {
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(Tiny(), CpuRegistry()));
  const double p = static_cast<double>(model.NumParameters());
  for (int workers : {2, 4}) {
    const double n = workers;
    for (int stage = 0; stage <= 3; ++stage) {
      const double expected[] = {16 * p, 8 * p + 8 * p / n, 4 * p + 12 * p / n, 16 * p / n};
      ASSERT_OK_AND_ASSIGN(auto trainer, Distributed(Plan(workers, stage)));
      ASSERT_OK_AND_ASSIGN(TrainingRun run, Train(*trainer, 2));
      const StepReport& report = run.reports.back();
      ASSERT_EQ(report.ranks.size(), static_cast<size_t>(workers));
      for (const RankFigures& rank : report.ranks) {
        const double memory = static_cast<double>(rank.figures.model_state_peak);
        const std::string where = fmt::format("N={} stage {} rank {}", workers, stage, rank.rank);
        std::printf("[ %s ] model state %.0f B (formula %.0f, %+.2f%%)\n", where.c_str(), memory,
                    expected[stage], 100 * (memory / expected[stage] - 1));
        EXPECT_NEAR(memory, expected[stage], 0.05 * expected[stage]) << where;
      }
    }
  }
}

struct Logged {
  std::vector<float> losses, dice;
  float held_out_dice = -1;
};

Logged ParseLog(const std::string& output) {
  Logged logged;
  const std::regex step(R"(step \d+/\d+ loss ([0-9.]+) dice ([0-9.]+))");
  for (std::sregex_iterator it(output.begin(), output.end(), step), end; it != end; ++it) {
    logged.losses.push_back(std::stof((*it)[1]));
    logged.dice.push_back(std::stof((*it)[2]));
  }
  std::smatch held;
  if (std::regex_search(output, held, std::regex(R"(held-out: loss [0-9.]+ dice ([0-9.]+))"))) {
    logged.held_out_dice = std::stof(held[1]);
  }
  return logged;
}

TEST(TrainUNet3dTest, TheLossFallsAndDiceRisesOver200Steps) {
  ProcessResult run = RunBinary("train_unet3d", "--steps 200 --log-every 50 --threads 1");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const Logged logged = ParseLog(run.output);
  ASSERT_EQ(logged.losses.size(), 5u) << run.output;  // steps 1, 50, 100, 150, 200
  EXPECT_LT(logged.losses.back(), 0.5f * logged.losses.front()) << run.output;
  EXPECT_GT(logged.held_out_dice, logged.dice.front() + 0.15f) << run.output;
}

TEST(TrainUNet3dTest, AResumedRunContinuesTheUninterruptedOne) {
  const std::string dir = TempPath("unet3d_checkpoints");
  std::filesystem::remove_all(dir);
  ProcessResult whole = RunBinary("train_unet3d", "--steps 12 --threads 1");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  ProcessResult first = RunBinary("train_unet3d", "--steps 6 --threads 1 --checkpoint-dir " + dir);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ProcessResult rest =
      RunBinary("train_unet3d", "--steps 12 --threads 1 --resume --checkpoint-dir " + dir);
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  EXPECT_NE(rest.output.find("resumed from"), std::string::npos) << rest.output;
  const Logged expected = ParseLog(whole.output), resumed = ParseLog(rest.output);
  ASSERT_EQ(expected.losses.size(), 12u);
  ASSERT_EQ(resumed.losses.size(), 6u) << rest.output;  // steps 7..12
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(resumed.losses[i], expected.losses[6 + i]) << i;
  ProcessResult wrong =
      RunBinary("train_unet3d", "--preset small --steps 8 --resume --checkpoint-dir " + dir);
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_NE(wrong.output.find("same model"), std::string::npos) << wrong.output;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessera::testing

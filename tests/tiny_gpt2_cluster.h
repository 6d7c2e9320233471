// A test suite sharing one local cluster of worker processes and training the tiny GPT-2 on it:
// the fixture of the integration tests that compare plans run on real workers.
//
//   class MyTest : public TinyGpt2ClusterTest<MyTest> {
//    public:
//     static constexpr int kClusterWorkers = 4;
//     // Optional: environment the workers start with (TESSERA_* settings).
//     static std::vector<std::pair<std::string, std::string>> ClusterEnvironment();
//   };
//   TEST_F(MyTest, ...) { ASSERT_OK_AND_ASSIGN(auto trainer, Distributed(plan)); ... }
//
// The cluster starts before the suite's first test and stops after its last (plans take the
// first workers they need). Not thread-safe: gtest runs a suite's tests one at a time.
#pragma once

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "gpt2_test_util.h"
#include "plan_equivalence.h"
#include "test_util.h"
#include "training/token_dataset.h"
#include "training/trainer.h"

namespace tessera::testing {

// Steps [first, last) of the tiny GPT-2's run on the same synthetic batches of `batch` rows of
// `seq_len` tokens at learning rate 3e-3 (a fresh run, first 0, initialises the parameters from
// seed 5; a resumed one starts from its state); each step's report.
inline Result<std::vector<StepReport>> TrainOnSyntheticTokens(Trainer& trainer, int64_t batch,
                                                              int64_t seq_len, int first,
                                                              int last) {
  if (first == 0) TESSERA_RETURN_IF_ERROR(trainer.InitializeParameters(5));
  TokenDataset data = TokenDataset::Synthetic(20'000, 256, 9);
  TESSERA_ASSIGN_OR_RETURN(BatchSampler sampler, BatchSampler::Create(data, batch, seq_len, 3));
  std::vector<int32_t> tokens(static_cast<size_t>(batch * seq_len)),
      targets(static_cast<size_t>(batch * seq_len));
  std::vector<StepReport> reports;
  for (int step = 0; step < last; ++step) {
    sampler.Next(tokens.data(), targets.data());
    if (step < first) continue;
    TESSERA_ASSIGN_OR_RETURN(StepReport report, Gpt2Step(trainer, tokens, targets, 3e-3f));
    reports.push_back(std::move(report));
  }
  return reports;
}

template <typename Suite>
class TinyGpt2ClusterTest : public ::testing::Test {
 public:
  static std::vector<std::pair<std::string, std::string>> ClusterEnvironment() { return {}; }

 protected:
  static void SetUpTestSuite() {
    const auto environment = Suite::ClusterEnvironment();
    for (const auto& [name, value] : environment) setenv(name.c_str(), value.c_str(), 1);
    Result<std::unique_ptr<Cluster>> cluster = StartTestCluster(Suite::kClusterWorkers);
    for (const auto& [name, value] : environment) unsetenv(name.c_str());
    ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
    cluster_ = std::move(*cluster).release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  // The tiny GPT-2's trainer of `plan` on the suite's cluster (the scheduler places its tasks).
  static Result<std::unique_ptr<Trainer>> Distributed(const TrainingPlan& plan) {
    TESSERA_ASSIGN_OR_RETURN(auto backend,
                             MakeClusterBackend(*cluster_, ClusterPlacement::kScheduler));
    return Trainer::Create(*BuildGpt2(*Gpt2Config::Preset("tiny")), plan, std::move(backend));
  }

  // A two-stage GPipe pipeline of `plan` (two data ranks a stage) gives the losses of `plan`
  // itself to 1e-5 over steps [0, steps) of TrainOnSyntheticTokens with `batch` rows of
  // `seq_len`. One micro-batch: the same gradients to the last bit (micro-batches would sum them
  // in another order, and a compressed sign of an element near zero may then flip).
  static void ExpectTwoStagePipelineLikeItsFlatPlan(const TrainingPlan& plan, int64_t batch,
                                                    int64_t seq_len, int steps) {
    ASSERT_OK_AND_ASSIGN(auto flat, Distributed(plan));
    ASSERT_OK_AND_ASSIGN(std::vector<StepReport> expected,
                         TrainOnSyntheticTokens(*flat, batch, seq_len, 0, steps));
    flat.reset();
    TrainingPlan staged = plan;
    staged.parallel.pipeline_stages = 2;
    staged.parallel.schedule = PipelineSchedule::kGPipe;
    ASSERT_OK_AND_ASSIGN(auto pipeline, Distributed(staged));
    ASSERT_OK_AND_ASSIGN(std::vector<StepReport> run,
                         TrainOnSyntheticTokens(*pipeline, batch, seq_len, 0, steps));
    ASSERT_EQ(run.size(), expected.size());
    for (size_t i = 0; i < run.size(); ++i) {
      EXPECT_NEAR(run[i].loss, expected[i].loss, 1e-5 * expected[i].loss) << "step " << i + 1;
    }
  }

  static inline Cluster* cluster_ = nullptr;
};

}  // namespace tessera::testing

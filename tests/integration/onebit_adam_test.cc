// 1-bit Adam (OptimizerConfig::Kind::kOneBitAdam) on a local cluster of two real worker
// processes: its warm-up is exact data parallelism (the same losses as one worker's), its
// compressed phase sends what the compressed all-reduce's byte count says for every group and
// about 1/32 of the warm-up's all-reduce bytes, and its losses stay within 1% of one worker's
// (uncompressed: one worker's momentum is its own); plans it cannot run yet are refused by name.
#include <cmath>
#include <memory>

#include <fmt/format.h>
#include <gmock/gmock.h>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "collectives/compressed.h"
#include "core/collective_task.h"
#include "gpt2_test_util.h"
#include "plan_equivalence.h"
#include "test_util.h"
#include "training/token_dataset.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kFreezeStep = 4;
constexpr int kSteps = 10;
constexpr int64_t kBatch = 8;
constexpr int64_t kSeqLen = 64;

TrainingPlan OneBitPlan(int workers) {
  TrainingPlan plan;
  plan.batch = kBatch;
  plan.seq_len = kSeqLen;
  plan.parallel.data_parallel = workers;
  plan.optimizer.kind = OptimizerConfig::Kind::kOneBitAdam;
  plan.optimizer.freeze_step = kFreezeStep;
  return plan;
}

// kSteps steps on the same synthetic batches; each step's report.
Result<std::vector<StepReport>> Train(Trainer& trainer) {
  TESSERA_RETURN_IF_ERROR(trainer.InitializeParameters(5));
  TokenDataset data = TokenDataset::Synthetic(20'000, 256, 9);
  TESSERA_ASSIGN_OR_RETURN(BatchSampler sampler, BatchSampler::Create(data, kBatch, kSeqLen, 3));
  std::vector<int32_t> tokens(kBatch * kSeqLen), targets(kBatch * kSeqLen);
  std::vector<StepReport> reports;
  for (int step = 0; step < kSteps; ++step) {
    sampler.Next(tokens.data(), targets.data());
    TESSERA_ASSIGN_OR_RETURN(StepReport report, Gpt2Step(trainer, tokens, targets, 3e-3f));
    reports.push_back(std::move(report));
  }
  return reports;
}

class OneBitAdamTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Result<std::unique_ptr<Cluster>> cluster = StartTestCluster(2);
    ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
    cluster_ = std::move(*cluster).release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  static Result<std::unique_ptr<Trainer>> Distributed(const TrainingPlan& plan) {
    TESSERA_ASSIGN_OR_RETURN(auto backend,
                             MakeClusterBackend(*cluster_, ClusterPlacement::kScheduler));
    return Trainer::Create(*BuildGpt2(*Gpt2Config::Preset("tiny")), plan, std::move(backend));
  }

  static Cluster* cluster_;
};

Cluster* OneBitAdamTest::cluster_ = nullptr;

TEST_F(OneBitAdamTest, TheWarmUpIsOneWorkersAndTheCompressedPhaseSendsAThirtySecond) {
  ASSERT_OK_AND_ASSIGN(auto one, Trainer::Create(*BuildGpt2(*Gpt2Config::Preset("tiny")),
                                                 OneBitPlan(1), ExecutorOptions{}));
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> alone, Train(*one));
  ASSERT_OK_AND_ASSIGN(auto two, Distributed(OneBitPlan(2)));
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> pair, Train(*two));

  // The warm-up's updates are exact: every loss up to the first step after them is one worker's.
  for (int step = 0; step <= kFreezeStep; ++step) {
    EXPECT_NEAR(pair[step].loss, alone[step].loss, 1e-5 * std::abs(alone[step].loss))
        << "step " << step + 1;
  }
  // The compressed phase follows one worker's (which has nothing to compress: its momentum is
  // its own) within 1%: the signs and scales with their errors fed back carry the average.
  for (int step = kFreezeStep + 1; step < kSteps; ++step) {
    EXPECT_TRUE(std::isfinite(pair[step].loss)) << "step " << step + 1;
    EXPECT_NEAR(pair[step].loss, alone[step].loss, 0.01 * std::abs(alone[step].loss))
        << "step " << step + 1;
    EXPECT_NE(pair[step].loss, alone[step].loss) << "step " << step + 1 << " was not compressed";
  }

  // Bytes each worker sent per step (the collective counters): the warm-up's f32 all-reduces,
  // then each group's compressed all-reduce of its momentum, exactly its byte count, beside the
  // step's other collectives (a pair's all-reduce sends its buffer once).
  int64_t compressed_expected = 0;
  for (int64_t numel : two->step_graph().group_numel) {
    if (numel > 0) compressed_expected += CompressedAllReduceBytes(numel, 2);
  }
  int64_t others = 0;
  const Graph& graph = two->step_graph().graph;
  for (const TaskSpec& task : graph.tasks()) {
    ASSERT_OK_AND_ASSIGN(std::optional<CollectiveMembership> member, CollectiveOf(task));
    if (!member.has_value() || member->rank != 0 || task.op == "compressed_all_reduce") continue;
    ASSERT_EQ(task.op, "all_reduce") << task.name;
    others += graph.object(task.inputs[0]).meta.bytes();
  }
  compressed_expected += others;
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(pair[1].ranks.size(), 2u);
    const int64_t warmup = pair[1].ranks[r].figures.collective_bytes_sent;
    const int64_t compressed = pair[kSteps - 1].ranks[r].figures.collective_bytes_sent;
    EXPECT_EQ(compressed, compressed_expected) << "rank " << r;
    const double ratio = static_cast<double>(compressed) / static_cast<double>(warmup);
    RecordProperty(fmt::format("rank{}_bytes_warmup_compressed", r),
                   fmt::format("{} {} (1/{:.3f})", warmup, compressed, 1 / ratio));
    EXPECT_NEAR(ratio * 32, 1.0, 0.02)
        << "rank " << r << ": " << compressed << " bytes against " << warmup;
  }
}

TEST_F(OneBitAdamTest, PlansItCannotRunYetAreRefusedByName) {
  TrainingPlan zero = OneBitPlan(2);
  zero.parallel.zero_stage = 1;
  Result<std::unique_ptr<Trainer>> refused = Distributed(zero);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("1-bit Adam runs with ZeRO stage 0"));
  TrainingPlan unfrozen = OneBitPlan(2);
  unfrozen.optimizer.freeze_step = 0;
  refused = Distributed(unfrozen);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("freeze step must be >= 1"));
}

}  // namespace
}  // namespace tessera::testing

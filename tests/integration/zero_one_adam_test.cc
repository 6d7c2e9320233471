// 0/1 Adam (OptimizerConfig::Kind::kZeroOneAdam, planner/zero_one_adam.h) on a local cluster of
// real worker processes: its variance steps are exact data parallelism (one worker's losses),
// each kind of step sends what its collectives say (compressed steps 1/32 of a variance step's
// bytes, local steps nothing but the loss), its losses stay within 1% of one worker's; local
// steps leave each rank its own parameters and a sync makes them the same bits again; a
// checkpoint at a sync resumes exactly with its error buffers, on as many workers, and runs on
// one; one worker synchronising every step follows 1-bit Adam; a pipeline runs like its flat
// plan; plans it cannot run are refused.
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "collectives/compressed.h"
#include "core/collective_task.h"
#include "gpt2_test_util.h"
#include "test_util.h"
#include "tiny_gpt2_cluster.h"
#include "training/checkpoint.h"
#include "training/peer_snapshot.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;
using Step = OptimizerConfig::ZeroOneStep;

constexpr int64_t kBatch = 8;
constexpr int64_t kSeqLen = 64;
constexpr int kSteps = 14;

// Variance at steps 1, 2, 4 and 6 (the interval doubles after every 2 of them), the gradients of
// 3 and 5 averaged compressed; from step 7 local steps, synchronising every step at 7 and 8, every
// 2 steps at 10 and 12, then every 4 (the interval doubles every 2 frozen steps, up to 4).
constexpr int kVarFreezeStep = 6;
constexpr Step kSchedule[kSteps] = {Step::kVariance,
                                    Step::kVariance,
                                    Step::kCompressedGradient,
                                    Step::kVariance,
                                    Step::kCompressedGradient,
                                    Step::kVariance,
                                    Step::kSync,
                                    Step::kSync,
                                    Step::kLocal,
                                    Step::kSync,
                                    Step::kLocal,
                                    Step::kSync,
                                    Step::kLocal,
                                    Step::kLocal};

TrainingPlan ZeroOnePlan(int workers) {
  TrainingPlan plan;
  plan.batch = kBatch;
  plan.seq_len = kSeqLen;
  plan.parallel.data_parallel = workers;
  plan.optimizer.kind = OptimizerConfig::Kind::kZeroOneAdam;
  plan.optimizer.var_freeze_step = kVarFreezeStep;
  plan.optimizer.var_update_scaler = 2;
  plan.optimizer.local_step_scaler = 2;
  plan.optimizer.local_step_clipper = 4;
  return plan;
}

Result<std::vector<StepReport>> Train(Trainer& trainer, int first = 0, int last = kSteps) {
  return TrainOnSyntheticTokens(trainer, kBatch, kSeqLen, first, last);
}

// Each data rank's parameters of every group, in state order.
Result<std::vector<std::vector<float>>> ParametersOfRank(Trainer& trainer, int rank) {
  std::vector<std::vector<float>> groups;
  const std::vector<StateObject>& state = trainer.step_graph().state;
  for (size_t i = 0; i < state.size(); ++i) {
    if (state[i].kind != StateKind::kParameter || state[i].piece.rank != rank) continue;
    TESSERA_ASSIGN_OR_RETURN(Tensor value, trainer.DownloadState(i));
    groups.push_back(ToVector(value));
  }
  return groups;
}

class ZeroOneAdamTest : public TinyGpt2ClusterTest<ZeroOneAdamTest> {
 public:
  static constexpr int kClusterWorkers = 4;  // plans take the first N
};

TEST(ZeroOneAdamScheduleOfTheSuiteTest, IsTheOneTheTestsAssume) {
  ZeroOneAdamSchedule schedule(ZeroOnePlan(2).optimizer);
  for (int step = 0; step < kSteps; ++step) {
    EXPECT_EQ(schedule.Next(), kSchedule[step]) << "step " << step + 1;
    schedule.Advance();
  }
}

TEST_F(ZeroOneAdamTest, VarianceStepsAreExactAndEachKindSendsWhatItsCollectivesSay) {
  ASSERT_OK_AND_ASSIGN(auto one, Trainer::Create(*BuildGpt2(*Gpt2Config::Preset("tiny")),
                                                 ZeroOnePlan(1), ExecutorOptions{}));
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> alone, Train(*one));
  ASSERT_OK_AND_ASSIGN(auto two, Distributed(ZeroOnePlan(2)));
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> pair, Train(*two));
  // Steps 1 and 2 update from all-reduced gradients: every loss up to step 3's is one worker's.
  for (int step = 0; step < 3; ++step) {
    EXPECT_NEAR(pair[step].loss, alone[step].loss, 1e-5 * std::abs(alone[step].loss))
        << "step " << step + 1;
  }
  // Then the compressed averages (gradients, then moves) with their errors fed back follow one
  // worker's (whose averages are its own) within 1%, without being it.
  for (int step = 3; step < kSteps; ++step) {
    EXPECT_TRUE(std::isfinite(pair[step].loss)) << "step " << step + 1;
    EXPECT_NEAR(pair[step].loss, alone[step].loss, 0.01 * std::abs(alone[step].loss))
        << "step " << step + 1;
    EXPECT_NE(pair[step].loss, alone[step].loss) << "step " << step + 1 << " was not compressed";
  }

  // Bytes each worker sent (the collective counters). The sync step's graph: each group's
  // compressed all-reduce (its byte count) and the loss's all-reduce (a scalar; a pair's
  // all-reduce sends its buffer once). A compressed-gradient step sends the same; a variance
  // step each group's f32 gradient; a local step the loss only.
  int64_t compressed = 0, full = 0, loss = 0;
  const StepGraph& sync = two->step_graph();
  for (size_t l = 0; l < sync.group_numel.size(); ++l) {
    const int64_t numel = two->model().layers[l].params.numel();
    if (numel == 0) continue;
    compressed += CompressedAllReduceBytes(numel, 2);
    full += 4 * numel;
  }
  for (const TaskSpec& task : sync.graph.tasks()) {
    ASSERT_OK_AND_ASSIGN(std::optional<CollectiveMembership> member, CollectiveOf(task));
    if (!member.has_value() || member->rank != 0 || task.op == "compressed_all_reduce") continue;
    ASSERT_EQ(task.op, "all_reduce") << task.name;
    loss += sync.graph.object(task.inputs[0]).meta.bytes();
  }
  ASSERT_EQ(loss, 4);
  for (int r = 0; r < 2; ++r) {
    for (int step = 0; step < kSteps; ++step) {
      const int64_t sent = pair[step].ranks[r].figures.collective_bytes_sent;
      switch (kSchedule[step]) {
        case Step::kVariance:
          EXPECT_EQ(sent, full + loss) << "rank " << r << " step " << step + 1;
          break;
        case Step::kCompressedGradient:
        case Step::kSync:
          EXPECT_EQ(sent, compressed + loss) << "rank " << r << " step " << step + 1;
          break;
        case Step::kLocal:
          EXPECT_EQ(sent, loss) << "rank " << r << " step " << step + 1;
          break;
      }
    }
    const double ratio = static_cast<double>(compressed + loss) / static_cast<double>(full + loss);
    RecordProperty(
        fmt::format("rank{}_bytes_variance_compressed_local", r),
        fmt::format("{} {} {} (1/{:.3f})", full + loss, compressed + loss, loss, 1 / ratio));
    EXPECT_NEAR(ratio * 32, 1.0, 0.02);
  }
}

TEST_F(ZeroOneAdamTest, LocalStepsLeaveEachRankItsOwnParametersUntilTheSync) {
  ASSERT_OK_AND_ASSIGN(auto two, Distributed(ZeroOnePlan(2)));
  for (int step = 1; step <= kSteps; ++step) {
    ASSERT_OK(Train(*two, step - 1, step).status());
    ASSERT_OK_AND_ASSIGN(auto rank0, ParametersOfRank(*two, 0));
    ASSERT_OK_AND_ASSIGN(auto rank1, ParametersOfRank(*two, 1));
    const bool local = kSchedule[step - 1] == Step::kLocal;
    EXPECT_EQ(two->parameters_synchronized(), !local) << "after step " << step;
    // Synchronised: the same bits on both ranks (the sync starts both from the interval's start
    // and adds the same average); after a local step each rank's own gradient moved its own.
    EXPECT_EQ(rank0 == rank1, !local) << "after step " << step;
  }
  // Step 14 is local: a checkpoint now is refused, naming the sync it waits for.
  EXPECT_EQ(two->NextSynchronizedStep(), 16);
  const Result<std::string> refused = SaveCheckpoint(*two, TempPath("zero-one-local"), "");
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("0/1 Adam's local steps"));
  EXPECT_THAT(refused.status().message(), HasSubstr("at step 16"));
}

// A checkpoint (and a peer snapshot) at a sync keeps every rank's error buffers: resumed on as
// many workers the run goes on exactly as it would have (the schedule replayed, the interval starts
// set to the parameters); on one worker it runs on (the errors resharded: their mean).
TEST_F(ZeroOneAdamTest, ACheckpointAtASyncResumesExactly) {
  constexpr int kSaveAt = 8;  // a sync, with the errors of the moves' compression
  ASSERT_OK_AND_ASSIGN(auto whole, Distributed(ZeroOnePlan(2)));
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> uninterrupted, Train(*whole));
  whole.reset();
  const std::string dir = TempPath("zero-one-checkpoint");
  std::filesystem::remove_all(dir);
  {
    ASSERT_OK_AND_ASSIGN(auto first, Distributed(ZeroOnePlan(2)));
    ASSERT_OK(Train(*first, 0, kSaveAt).status());
    ASSERT_OK(SaveCheckpoint(*first, dir, "").status());
    // A peer snapshot there keeps the error buffers too: restored two steps later, the run goes
    // on exactly as it did. At a local step (9) a snapshot is refused.
    ASSERT_OK_AND_ASSIGN(PeerSnapshot snapshot, PeerSnapshot::Take(*first, ""));
    ASSERT_OK(Train(*first, kSaveAt, kSaveAt + 1).status());
    const Result<PeerSnapshot> local = PeerSnapshot::Take(*first, "");
    ASSERT_FALSE(local.ok());
    EXPECT_THAT(local.status().message(), HasSubstr("synchronisation at step 10"));
    ASSERT_OK(Train(*first, kSaveAt + 1, kSaveAt + 2).status());
    ASSERT_OK(snapshot.Restore(*first, {}).status());
    ASSERT_OK_AND_ASSIGN(std::vector<StepReport> again, Train(*first, kSaveAt, kSteps));
    for (size_t i = 0; i < again.size(); ++i) {
      EXPECT_EQ(again[i].loss, uninterrupted[kSaveAt + i].loss) << "step " << kSaveAt + i + 1;
    }
  }
  ASSERT_OK_AND_ASSIGN(auto resumed, Distributed(ZeroOnePlan(2)));
  ASSERT_OK_AND_ASSIGN(CheckpointInfo info, LoadCheckpoint(*resumed, dir));
  EXPECT_EQ(info.step, kSaveAt);
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> rest, Train(*resumed, kSaveAt, kSteps));
  ASSERT_EQ(rest.size(), static_cast<size_t>(kSteps - kSaveAt));
  for (size_t i = 0; i < rest.size(); ++i) {
    EXPECT_EQ(rest[i].loss, uninterrupted[kSaveAt + i].loss) << "step " << kSaveAt + i + 1;
  }
  ASSERT_OK_AND_ASSIGN(auto alone, Trainer::Create(*BuildGpt2(*Gpt2Config::Preset("tiny")),
                                                   ZeroOnePlan(1), ExecutorOptions{}));
  ASSERT_OK(LoadCheckpoint(*alone, dir).status());
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> single, Train(*alone, kSaveAt, kSteps));
  for (const StepReport& report : single) {
    EXPECT_NEAR(report.loss, uninterrupted[report.step - 1].loss,
                0.01 * uninterrupted[report.step - 1].loss)
        << "step " << report.step;
  }
}

// On one worker nothing is compressed: with every step up to the freeze a variance step and a
// sync every step after it, 0/1 Adam is 1-bit Adam (the sync's arithmetic rounds differently).
TEST(ZeroOneAdamAloneTest, SynchronisingEveryStepItFollowsOneBitAdam) {
  TrainingPlan zero_one = ZeroOnePlan(1);
  zero_one.optimizer.var_update_scaler = 1000;
  zero_one.optimizer.local_step_clipper = 1;
  TrainingPlan onebit = ZeroOnePlan(1);
  onebit.optimizer.kind = OptimizerConfig::Kind::kOneBitAdam;
  onebit.optimizer.freeze_step = kVarFreezeStep;
  ASSERT_OK_AND_ASSIGN(auto a, Trainer::Create(*BuildGpt2(*Gpt2Config::Preset("tiny")), zero_one,
                                               ExecutorOptions{}));
  ASSERT_OK_AND_ASSIGN(
      auto b, Trainer::Create(*BuildGpt2(*Gpt2Config::Preset("tiny")), onebit, ExecutorOptions{}));
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> ours, Train(*a));
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> theirs, Train(*b));
  for (int step = 0; step < kSteps; ++step) {
    EXPECT_NEAR(ours[step].loss, theirs[step].loss, 1e-5 * std::abs(theirs[step].loss))
        << "step " << step + 1;
  }
}

// A two-stage pipeline of two data ranks a stage runs each kind of step on each stage's groups
// over the same two ranks: the flat data-parallel plan's run.
TEST_F(ZeroOneAdamTest, APipelineRunsLikeItsDataParallelPlan) {
  ExpectTwoStagePipelineLikeItsFlatPlan(ZeroOnePlan(2), kBatch, kSeqLen, kSteps);
}

TEST_F(ZeroOneAdamTest, PlansItCannotRunAreRefusedByName) {
  TrainingPlan zero = ZeroOnePlan(2);
  zero.parallel.zero_stage = 1;
  Result<std::unique_ptr<Trainer>> refused = Distributed(zero);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("0/1 Adam runs on data-parallel"));
  TrainingPlan never = ZeroOnePlan(2);
  never.optimizer.local_step_clipper = 0;
  refused = Distributed(never);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("local_step_clipper"));
}

}  // namespace
}  // namespace tessera::testing

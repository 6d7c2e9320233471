// 1-bit Adam (OptimizerConfig::Kind::kOneBitAdam) on a local cluster of two real worker
// processes: its warm-up is exact data parallelism (the same losses as one worker's), its
// compressed phase sends what the compressed all-reduce's byte count says for every group and
// about 1/32 of the warm-up's all-reduce bytes, and its losses stay within 1% of one worker's
// (uncompressed: one worker's momentum is its own); a checkpoint in the compressed phase resumes
// exactly with its error buffers, resharded on four workers, and on one; ZeRO-1 and ZeRO-2 shard
// its state with the same losses; plans it cannot run yet are refused by name; a pipeline
// compresses like its data-parallel plan.
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>

#include <fmt/format.h>
#include <gmock/gmock.h>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "collectives/compressed.h"
#include "core/collective_task.h"
#include "core/sign_compression.h"
#include "gpt2_test_util.h"
#include "plan_equivalence.h"
#include "test_util.h"
#include "tiny_gpt2_cluster.h"
#include "training/checkpoint.h"
#include "training/peer_snapshot.h"
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

// Steps [first, last) of the run on the suites' synthetic batches.
Result<std::vector<StepReport>> Train(Trainer& trainer, int first = 0, int last = kSteps) {
  return TrainOnSyntheticTokens(trainer, kBatch, kSeqLen, first, last);
}

// A layer's error buffers on every data rank, in rank order.
struct LayerErrors {
  std::vector<std::vector<float>> worker, server;
  // Element k of the server errors joined in chunk order.
  float Server(int64_t k) const {
    const auto chunk = static_cast<int64_t>(server.front().size());
    return server[static_cast<size_t>(k / chunk)][static_cast<size_t>(k % chunk)];
  }
};
using ErrorsByLayer = std::map<size_t, LayerErrors>;

Result<ErrorsByLayer> Errors(Trainer& trainer) {
  ErrorsByLayer errors;
  const std::vector<StateObject>& state = trainer.step_graph().state;
  for (size_t i = 0; i < state.size(); ++i) {
    const bool worker = state[i].kind == StateKind::kWorkerError;
    if (!worker && state[i].kind != StateKind::kServerError) continue;
    TESSERA_ASSIGN_OR_RETURN(Tensor value, trainer.DownloadState(i));
    LayerErrors& layer = errors[state[i].piece.layer];
    auto& list = worker ? layer.worker : layer.server;
    list.resize(std::max(list.size(), static_cast<size_t>(state[i].piece.rank) + 1));
    list[static_cast<size_t>(state[i].piece.rank)] = ToVector(value);
  }
  return errors;
}

class OneBitAdamTest : public TinyGpt2ClusterTest<OneBitAdamTest> {
 public:
  static constexpr int kClusterWorkers = 4;  // plans take the first N
};

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

// A checkpoint in the compressed phase keeps every rank's error buffers: resumed on as many
// workers, the run goes on exactly as it would have; on one worker it resumes too (the errors
// resharded: RestoreErrors in training/checkpoint.cc).
TEST_F(OneBitAdamTest, AResumeInTheCompressedPhaseKeepsTheErrorBuffers) {
  constexpr int kSaveAt = kFreezeStep + 3;
  ASSERT_OK_AND_ASSIGN(auto whole, Distributed(OneBitPlan(2)));
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> uninterrupted, Train(*whole));
  whole.reset();
  const std::string dir = TempPath("onebit-checkpoint");
  std::filesystem::remove_all(dir);
  ErrorsByLayer saved;
  {
    ASSERT_OK_AND_ASSIGN(auto first, Distributed(OneBitPlan(2)));
    ASSERT_OK(Train(*first, 0, kSaveAt).status());
    ASSERT_OK(SaveCheckpoint(*first, dir, "").status());
    ASSERT_OK_AND_ASSIGN(saved, Errors(*first));
    // A peer snapshot in the compressed phase keeps the error buffers too: two steps later
    // (other errors) it restores the step's state, and the run goes on exactly as it did.
    ASSERT_OK_AND_ASSIGN(PeerSnapshot snapshot, PeerSnapshot::Take(*first, ""));
    ASSERT_OK(Train(*first, kSaveAt, kSaveAt + 2).status());
    ASSERT_OK_AND_ASSIGN(CheckpointInfo restored, snapshot.Restore(*first, {}));
    EXPECT_EQ(restored.step, kSaveAt);
    ASSERT_OK_AND_ASSIGN(ErrorsByLayer back, Errors(*first));
    ASSERT_EQ(back.size(), saved.size());
    for (const auto& [layer, errors] : saved) {
      EXPECT_EQ(back.at(layer).worker, errors.worker) << "layer " << layer;
      EXPECT_EQ(back.at(layer).server, errors.server) << "layer " << layer;
    }
    ASSERT_OK_AND_ASSIGN(std::vector<StepReport> again, Train(*first, kSaveAt, kSteps));
    for (size_t i = 0; i < again.size(); ++i) {
      EXPECT_EQ(again[i].loss, uninterrupted[kSaveAt + i].loss) << "step " << kSaveAt + i + 1;
    }
  }
  ASSERT_OK_AND_ASSIGN(auto resumed, Distributed(OneBitPlan(2)));
  ASSERT_OK_AND_ASSIGN(CheckpointInfo info, LoadCheckpoint(*resumed, dir));
  EXPECT_EQ(info.step, kSaveAt);
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> rest, Train(*resumed, kSaveAt, kSteps));
  ASSERT_EQ(rest.size(), static_cast<size_t>(kSteps - kSaveAt));
  for (size_t i = 0; i < rest.size(); ++i) {
    EXPECT_EQ(rest[i].loss, uninterrupted[kSaveAt + i].loss) << "step " << kSaveAt + i + 1;
  }
  // Without the errors the same resume goes elsewhere: they are what made it exact.
  ASSERT_OK_AND_ASSIGN(auto forgetful, Distributed(OneBitPlan(2)));
  ASSERT_OK(LoadCheckpoint(*forgetful, dir).status());
  ASSERT_OK(forgetful->EnterCompressedPhase());
  for (size_t i = 0; i < forgetful->step_graph().state.size(); ++i) {
    const StateObject& object = forgetful->step_graph().state[i];
    if (object.kind != StateKind::kWorkerError && object.kind != StateKind::kServerError) continue;
    ASSERT_OK(forgetful->WriteStateObject(
        i, std::vector<float>(static_cast<size_t>(object.piece.numel), 0.0f)));
  }
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> zeroed, Train(*forgetful, kSaveAt, kSteps));
  EXPECT_NE(zeroed.back().loss, uninterrupted.back().loss);
  // On four workers the errors are resharded keeping what the compressed all-reduce still owes
  // the true averages: the ranks' mean worker error and the server errors in chunk order.
  ASSERT_OK_AND_ASSIGN(auto wider, Distributed(OneBitPlan(4)));
  ASSERT_OK(LoadCheckpoint(*wider, dir).status());
  ASSERT_OK_AND_ASSIGN(ErrorsByLayer resharded, Errors(*wider));
  ASSERT_EQ(resharded.size(), saved.size());
  for (const auto& [layer, before] : saved) {
    const LayerErrors& after = resharded.at(layer);
    ASSERT_EQ(before.worker.size(), 2u);
    ASSERT_EQ(after.worker.size(), 4u);
    const int64_t numel = wider->model().layers[layer].params.numel();
    for (int64_t k = 0; k < numel; ++k) {
      const auto at = static_cast<size_t>(k);
      const double old_mean = (before.worker[0][at] + before.worker[1][at]) / 2.0;
      double new_mean = 0;
      for (const std::vector<float>& error : after.worker) new_mean += error[at] / 4.0;
      ASSERT_NEAR(new_mean, old_mean, 1e-6) << "layer " << layer << " element " << k;
      ASSERT_EQ(after.Server(k), before.Server(k)) << "layer " << layer << " element " << k;
    }
  }
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> four, Train(*wider, kSaveAt, kSteps));
  for (const StepReport& report : four) {
    EXPECT_NEAR(report.loss, uninterrupted[report.step - 1].loss,
                0.01 * uninterrupted[report.step - 1].loss)
        << "four workers, step " << report.step;
  }
  // On one worker: it resumes and trains on.
  ASSERT_OK_AND_ASSIGN(auto alone, Trainer::Create(*BuildGpt2(*Gpt2Config::Preset("tiny")),
                                                   OneBitPlan(1), ExecutorOptions{}));
  ASSERT_OK(LoadCheckpoint(*alone, dir).status());
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> single, Train(*alone, kSaveAt, kSteps));
  for (const StepReport& report : single) {
    EXPECT_NEAR(report.loss, uninterrupted[report.step - 1].loss,
                0.01 * uninterrupted[report.step - 1].loss)
        << "step " << report.step;
  }
}

// A two-stage pipeline of two data ranks a stage compresses each stage's groups over the same
// two ranks: the same run as the flat data-parallel plan's, warm-up and compressed phase.
TEST_F(OneBitAdamTest, APipelineCompressesLikeItsDataParallelPlan) {
  ExpectTwoStagePipelineLikeItsFlatPlan(OneBitPlan(2), kBatch, kSeqLen, kSteps);
}

// ZeRO-1 and ZeRO-2 shard the state of 1-bit Adam (warm-up: both moments; compressed phase: the
// frozen variance and the server errors, each rank's shard its chunk of the compressed
// all-reduce) and give the losses of the plan without ZeRO, on `workers` of the cluster behind
// `distributed`. The compressed phase sends the same compressed all-reduces plus the all-gathers
// of the updated shards.
void ExpectZeroShardsWithTheLossesOfDataParallelism(
    int workers,
    const std::function<Result<std::unique_ptr<Trainer>>(const TrainingPlan&)>& distributed) {
  ASSERT_OK_AND_ASSIGN(auto flat, distributed(OneBitPlan(workers)));
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> expected, Train(*flat));
  flat.reset();
  for (int zero : {1, 2}) {
    SCOPED_TRACE(fmt::format("{} workers, ZeRO-{}", workers, zero));
    TrainingPlan plan = OneBitPlan(workers);
    plan.parallel.zero_stage = zero;
    ASSERT_OK_AND_ASSIGN(auto sharded, distributed(plan));
    ASSERT_OK_AND_ASSIGN(std::vector<StepReport> run, Train(*sharded));
    for (size_t i = 0; i < run.size(); ++i) {
      EXPECT_NEAR(run[i].loss, expected[i].loss, 1e-6 * expected[i].loss) << "step " << i + 1;
    }
    // The compressed phase's state: each rank's momentum and worker error whole, its variance
    // and server error the shard it updates.
    const StepGraph& step = sharded->step_graph();
    for (const StateObject& object : step.state) {
      const int64_t group = step.group_numel[object.piece.layer];
      const int64_t own = sharded->model().layers[object.piece.layer].params.numel();
      switch (object.kind) {
        case StateKind::kExpAvg:
        case StateKind::kWorkerError:
        case StateKind::kParameter:
          EXPECT_EQ(object.piece.numel, group) << StateKindName(object.kind);
          break;
        case StateKind::kExpAvgSq:
        case StateKind::kServerError:
          EXPECT_EQ(object.piece.numel, group / workers) << StateKindName(object.kind);
          EXPECT_EQ(object.piece.numel, SignChunkElements(own, workers));
          break;
        default:
          ADD_FAILURE() << "unexpected state " << StateKindName(object.kind);
      }
    }
    // Bytes (the collective counters): data parallelism's compressed phase (the compressed
    // all-reduces of the groups' own elements, the loss's all-reduce) and the all-gathers of the
    // updated shards (n-1 shards sent).
    int64_t gathers = 0;
    for (int64_t numel : step.group_numel) gathers += 4 * numel / workers * (workers - 1);
    for (int r = 0; r < workers; ++r) {
      EXPECT_EQ(run.back().ranks[r].figures.collective_bytes_sent,
                expected.back().ranks[r].figures.collective_bytes_sent + gathers)
          << "rank " << r;
    }
  }
}

// Two workers: ring reductions, whose sums of two are the same whatever the segmentation.
TEST_F(OneBitAdamTest, ZeroOneAndTwoShardItsStateWithTheLossesOfDataParallelism) {
  ExpectZeroShardsWithTheLossesOfDataParallelism(2, Distributed);
}

// Four workers reducing in rank order (every reduction direct: TESSERA_COLLECTIVE_SMALL_BYTES):
// a ring's sum of an element over more than two ranks starts at the rank its segment says, and
// ZeRO's segments (shards) are not data parallelism's (groups, buckets), so ring reductions
// differ in the last bits, which the compressed phase's signs of elements near zero amplify.
class OneBitAdamRankOrderTest : public TinyGpt2ClusterTest<OneBitAdamRankOrderTest> {
 public:
  static constexpr int kClusterWorkers = 4;
  static std::vector<std::pair<std::string, std::string>> ClusterEnvironment() {
    return {{"TESSERA_COLLECTIVE_SMALL_BYTES", "1073741824"}};
  }
};

TEST_F(OneBitAdamRankOrderTest, ZeroOneAndTwoOnFourWorkersGiveTheLossesOfDataParallelism) {
  ExpectZeroShardsWithTheLossesOfDataParallelism(4, Distributed);
}

TEST_F(OneBitAdamTest, AZeroTwoCheckpointResumesExactlyUnderZeroTwoAndDataParallelism) {
  constexpr int kSaveAt = kFreezeStep + 3;
  TrainingPlan zero2 = OneBitPlan(2);
  zero2.parallel.zero_stage = 2;
  ASSERT_OK_AND_ASSIGN(auto whole, Distributed(zero2));
  ASSERT_OK_AND_ASSIGN(std::vector<StepReport> uninterrupted, Train(*whole));
  whole.reset();
  const std::string dir = TempPath("onebit-zero2-checkpoint");
  std::filesystem::remove_all(dir);
  {
    ASSERT_OK_AND_ASSIGN(auto first, Distributed(zero2));
    ASSERT_OK(Train(*first, 0, kSaveAt).status());
    ASSERT_OK(SaveCheckpoint(*first, dir, "").status());
  }
  for (int zero : {2, 0}) {
    SCOPED_TRACE(fmt::format("resumed under ZeRO-{}", zero));
    TrainingPlan plan = OneBitPlan(2);
    plan.parallel.zero_stage = zero;
    ASSERT_OK_AND_ASSIGN(auto resumed, Distributed(plan));
    ASSERT_OK(LoadCheckpoint(*resumed, dir).status());
    ASSERT_OK_AND_ASSIGN(std::vector<StepReport> rest, Train(*resumed, kSaveAt, kSteps));
    ASSERT_EQ(rest.size(), static_cast<size_t>(kSteps - kSaveAt));
    for (size_t i = 0; i < rest.size(); ++i) {
      const float want = uninterrupted[kSaveAt + i].loss;
      if (zero == 2) {
        EXPECT_EQ(rest[i].loss, want) << "step " << kSaveAt + i + 1;
      } else {
        EXPECT_NEAR(rest[i].loss, want, 1e-6 * want) << "step " << kSaveAt + i + 1;
      }
    }
  }
}

TEST_F(OneBitAdamTest, PlansItCannotRunYetAreRefusedByName) {
  TrainingPlan zero = OneBitPlan(2);
  zero.parallel.zero_stage = 3;
  Result<std::unique_ptr<Trainer>> refused = Distributed(zero);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("1-bit Adam runs with ZeRO stages 0-2"));
  TrainingPlan unfrozen = OneBitPlan(2);
  unfrozen.optimizer.freeze_step = 0;
  refused = Distributed(unfrozen);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("freeze step must be >= 1"));
}

}  // namespace
}  // namespace tessera::testing

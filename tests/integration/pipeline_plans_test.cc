// Pipeline parallelism as placement (planner/pipeline_schedule.h, planner/step_graph.h): on a local
// cluster of real worker processes, GPT-2 and the 3D U-Net (whose skip connections cross
// stages) cut into P = 2 and 4 stages, run under every schedule (zb-h1 with split backwards) and
// composed with data parallelism and ZeRO 1-3 (and optimizer offload) inside the stages, train the
// same 20 steps as one worker: losses within 1e-5 relative.
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "data/volumes.h"
#include "gpt2_test_util.h"
#include "model/gpt2.h"
#include "model/unet3d.h"
#include "plan_equivalence.h"
#include "test_util.h"
#include "training/token_dataset.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

constexpr int kClusterWorkers = 4;
constexpr int kSteps = 20;

// Six blocks: eight layers, enough for four stages of two chunks.
Gpt2Config Gpt2() { return Gpt2Config{6, 64, 4, 256, 64}; }
// Depth two: eleven layers (pooling and loss layers without parameters among them).
UNet3dConfig UNet() { return UNet3dConfig{.base_channels = 4, .depth = 2, .volume = 8}; }

struct Pipeline {
  int stages = 1, ranks = 1, micro = 1, virtual_stages = 1, zero = 0;
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  OffloadMode offload = OffloadMode::kNone;
  bool per_micro_gather = false;
  std::vector<int> cut;  // layers per chunk (empty: balanced)
};

std::string Label(const Pipeline& p) {
  return fmt::format("P={} D={} M={} V={} {} zero={}{}{}{}", p.stages, p.ranks, p.micro,
                     p.virtual_stages, ScheduleName(p.schedule), p.zero,
                     p.offload == OffloadMode::kOptimizer ? " offload" : "",
                     p.per_micro_gather ? " gather-per-micro-batch" : "",
                     p.cut.empty() ? "" : fmt::format(" cut {}", fmt::join(p.cut, "+")));
}

TrainingPlan PlanOf(const Pipeline& p, int64_t batch, int64_t seq_len) {
  TrainingPlan plan;
  plan.batch = batch;
  plan.seq_len = seq_len;
  plan.parallel.data_parallel = p.ranks;
  plan.parallel.zero_stage = p.zero;
  plan.parallel.offload = p.offload;
  plan.parallel.micro_batches = p.micro;
  plan.parallel.pipeline_stages = p.stages;
  plan.parallel.virtual_stages = p.virtual_stages;
  plan.parallel.schedule = p.schedule;
  if (p.per_micro_gather) plan.parallel.gather = GatherPolicy::kPerMicroBatch;
  plan.parallel.chunk_layers = p.cut;
  return plan;
}

// GPT-2's eight layers cut by hand (the plan search's cuts, --stage-layers): lopsided, with
// ZeRO inside the stages, and four stages.
std::vector<Pipeline> GivenCuts() {
  return {{.stages = 2, .micro = 4, .cut = {2, 6}},
          {.stages = 2, .ranks = 2, .micro = 4, .zero = 1, .cut = {5, 3}},
          {.stages = 4, .micro = 4, .schedule = PipelineSchedule::kZbH1, .cut = {1, 3, 2, 2}}};
}

// Every schedule at P = 2 and 4 (interleaved with two chunks per stage).
std::vector<Pipeline> EverySchedule() {
  std::vector<Pipeline> plans;
  for (int stages : {2, 4}) {
    plans.push_back({.stages = stages, .micro = 4, .schedule = PipelineSchedule::kGPipe});
    plans.push_back({.stages = stages, .micro = 4, .schedule = PipelineSchedule::k1F1B});
    plans.push_back({.stages = stages,
                     .micro = 4,
                     .virtual_stages = 2,
                     .schedule = PipelineSchedule::kInterleaved});
    plans.push_back({.stages = stages, .micro = 4, .schedule = PipelineSchedule::kZbH1});
  }
  return plans;
}

// P = 2 x D = 2 with ZeRO 1-3 inside the stages, and offload.
std::vector<Pipeline> ZeroInsideStages() {
  std::vector<Pipeline> plans;
  for (int zero : {1, 2, 3}) plans.push_back({.stages = 2, .ranks = 2, .micro = 4, .zero = zero});
  plans.push_back(
      {.stages = 2, .ranks = 2, .micro = 4, .zero = 2, .offload = OffloadMode::kOptimizer});
  // ZeRO-3 gathering before every use inside the stages: the collective order follows the
  // schedule's control edges.
  plans.push_back({.stages = 2, .ranks = 2, .micro = 4, .zero = 3, .per_micro_gather = true});
  plans.push_back({.stages = 2,
                   .ranks = 2,
                   .micro = 4,
                   .zero = 3,
                   .schedule = PipelineSchedule::kZbH1,
                   .per_micro_gather = true});
  // Split backwards with sharded parameters: the weight halves read the gathered groups too.
  plans.push_back(
      {.stages = 2, .ranks = 2, .micro = 4, .zero = 3, .schedule = PipelineSchedule::kZbH1});
  return plans;
}

class PipelinePlansTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Result<std::unique_ptr<Cluster>> cluster = StartTestCluster(kClusterWorkers);
    ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
    cluster_ = std::move(*cluster).release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  static Result<std::unique_ptr<GraphBackend>> Backend() {
    return MakeClusterBackend(*cluster_, ClusterPlacement::kScheduler);
  }
  static Cluster* cluster_;
};
Cluster* PipelinePlansTest::cluster_ = nullptr;

// GPT-2: synthetic tokens, batch 8 x 32.
constexpr int64_t kGptBatch = 8, kGptSeq = 32;
Result<TrainingRun> TrainGpt2(Trainer& trainer) {
  TokenDataset data = TokenDataset::Synthetic(20'000, 256, 9);
  TESSERA_ASSIGN_OR_RETURN(BatchSampler sampler, BatchSampler::Create(data, kGptBatch, kGptSeq, 3));
  std::vector<int32_t> tokens(kGptBatch * kGptSeq), targets(kGptBatch * kGptSeq);
  return RecordRun(
      trainer, 5, kSteps,
      [&](Trainer& t, int) {
        sampler.Next(tokens.data(), targets.data());
        return Gpt2Step(t, tokens, targets, 3e-3f);
      },
      "h.1.fc_w");
}

// The U-Net: generated volumes, batch 8.
constexpr int64_t kUNetBatch = 8;
std::vector<Tensor> VolumeBatch(int step) {
  const UNet3dConfig c = UNet();
  Result<tessera::VolumeBatch> made =
      GenerateVolumes(kUNetBatch, c.volume, c.in_channels, 100 + step);
  TESSERA_CHECK(made.ok(), "{}", made.status().ToString());
  const int64_t v = c.volume;
  return {FloatTensor(Shape{kUNetBatch, c.in_channels, v, v, v}, made->volumes),
          IntTensor(Shape{kUNetBatch, v, v, v}, made->labels)};
}
Result<TrainingRun> TrainUNet(Trainer& trainer) {
  return RecordRun(
      trainer, 2, kSteps, [](Trainer& t, int step) { return t.Step(VolumeBatch(step), 3e-3f); },
      "head.w");
}

TEST_F(PipelinePlansTest, Gpt2UnderEveryScheduleAndZeroInsideStagesMatchesOneWorker) {
  ASSERT_NE(cluster_, nullptr);
  ASSERT_OK_AND_ASSIGN(auto reference,
                       Trainer::Create(*BuildGpt2(Gpt2()), PlanOf(Pipeline{}, kGptBatch, kGptSeq),
                                       ExecutorOptions{}));
  ASSERT_OK_AND_ASSIGN(TrainingRun expected, TrainGpt2(*reference));
  std::vector<Pipeline> plans = EverySchedule();
  for (const Pipeline& p : ZeroInsideStages()) plans.push_back(p);
  for (const Pipeline& p : GivenCuts()) plans.push_back(p);
  for (const Pipeline& p : plans) {
    SCOPED_TRACE(Label(p));
    ASSERT_OK_AND_ASSIGN(auto backend, Backend());
    ASSERT_OK_AND_ASSIGN(
        auto trainer,
        Trainer::Create(*BuildGpt2(Gpt2()), PlanOf(p, kGptBatch, kGptSeq), std::move(backend)));
    ASSERT_OK_AND_ASSIGN(TrainingRun run, TrainGpt2(*trainer));
    ExpectSameRun(run, expected, Label(p));
  }
}

TEST_F(PipelinePlansTest, UNetWithSkipsAcrossStagesMatchesOneWorker) {
  ASSERT_NE(cluster_, nullptr);
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(UNet(), CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(
      auto reference, Trainer::Create(model, PlanOf(Pipeline{}, kUNetBatch, 1), ExecutorOptions{}));
  ASSERT_OK_AND_ASSIGN(TrainingRun expected, TrainUNet(*reference));
  std::vector<Pipeline> plans = EverySchedule();
  for (const Pipeline& p : ZeroInsideStages()) plans.push_back(p);
  for (const Pipeline& p : plans) {
    SCOPED_TRACE(Label(p));
    ASSERT_OK_AND_ASSIGN(auto backend, Backend());
    ASSERT_OK_AND_ASSIGN(auto trainer,
                         Trainer::Create(model, PlanOf(p, kUNetBatch, 1), std::move(backend)));
    ASSERT_OK_AND_ASSIGN(TrainingRun run, TrainUNet(*trainer));
    ExpectSameRun(run, expected, Label(p));
  }
}

}  // namespace
}  // namespace tessera::testing

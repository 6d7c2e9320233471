// Tensor parallelism (Megatron-LM's tensor slicing) on local clusters of CPU worker processes:
// GPT-2 split over 2 and 4 tensor ranks, TP 2 x DP 2 under ZeRO-1 and ZeRO-3, and 3D (TP 2 x PP 2 x
// DP 2, ZeRO-1, eight workers) train the single-worker run: every loss within 1e-5 relative, every
// gradient norm within 1e-4, and after the first step every parameter's gradient within 1e-6
// (the norm of the difference against the gradient's norm). The split model's slices cover each
// parameter of the whole model once; the activations' all-reduces are collectives of the step graph
// (two forward, two backward per block; the vocabulary-parallel embedding and cross-entropy's,
// with no rank holding the whole vocabulary's logits); a checkpoint written at TP 2 x DP 2 resumes
// at TP 4 and at TP 1 with the same next loss; bad degrees are refused naming the fix.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "model/gpt2.h"
#include "ops/layer_program.h"
#include "ops/standard_ops.h"
#include "plan_equivalence.h"
#include "planner/memory_model.h"
#include "test_util.h"
#include "training/checkpoint.h"
#include "training/trainer.h"

namespace tessera {
namespace {

constexpr int kClusterWorkers = 8;
constexpr int kSteps = 20;
constexpr int64_t kBatch = 8, kSeqLen = 32;
const Gpt2Config kTiny{.layers = 2, .channels = 64, .heads = 4, .vocab = 256, .max_seq_len = 64};

std::vector<Tensor> Batch(int step) {
  std::mt19937_64 rng(900 + static_cast<uint64_t>(step));
  std::vector<int32_t> stream(static_cast<size_t>(kBatch * kSeqLen + 1));
  for (int32_t& token : stream) token = static_cast<int32_t>(rng() % kTiny.vocab);
  Result<std::vector<Tensor>> batch = Gpt2Batch(kTiny, std::span(stream).first(stream.size() - 1),
                                                std::span(stream).subspan(1), kBatch, kSeqLen);
  TESSERA_CHECK(batch.ok(), "batch tensors");
  return *std::move(batch);
}

TrainingPlan Plan(int data, int tensor, int stages, int zero_stage) {
  TrainingPlan plan;
  plan.batch = kBatch;
  plan.seq_len = kSeqLen;
  plan.parallel.data_parallel = data;
  plan.parallel.tensor_parallel = tensor;
  plan.parallel.pipeline_stages = stages;
  plan.parallel.zero_stage = zero_stage;
  if (stages > 1) plan.parallel.micro_batches = 2;
  return plan;
}

// Megatron-LM's sequence parallelism: the tensor ranks' norms and residuals on 1/T of each
// sequence.
TrainingPlan ShardedPlan(int data, int tensor, int stages, int zero_stage) {
  TrainingPlan plan = Plan(data, tensor, stages, zero_stage);
  plan.parallel.shard_sequence = true;
  return plan;
}

// Sequence parallelism (DeepSpeed-Ulysses): `data` data-parallel ranks in groups of `sequence`.
TrainingPlan SequencePlan(int data, int sequence, int stages, int zero_stage) {
  TrainingPlan plan = Plan(data, 1, stages, zero_stage);
  plan.parallel.sequence_parallel = sequence;
  return plan;
}

// Ring attention: `data` data-parallel ranks in groups of `sequence`, keys and values rotated
// round each group.
TrainingPlan RingPlan(int data, int sequence, int stages, int zero_stage) {
  TrainingPlan plan = SequencePlan(data, sequence, stages, zero_stage);
  plan.parallel.sequence_attention = SequenceAttention::kRing;
  return plan;
}

ModelSpec Model() {
  Result<ModelSpec> model = BuildGpt2(kTiny, Gpt2LayerImpl::kPrimitive);
  TESSERA_CHECK(model.ok(), "GPT-2 tiny");
  return *std::move(model);
}

Result<testing::TrainingRun> Train(Trainer& trainer) {
  return testing::RecordRun(
      trainer, 7, kSteps, [](Trainer& t, int step) { return t.Step(Batch(step), 3e-3f); },
      "h.1.qkv_w");
}

// Every parameter's gradient after one step from the same start.
Result<std::vector<std::vector<float>>> FirstGradients(Trainer& trainer) {
  return testing::FirstStepGradients(trainer, 7, Batch(0), 3e-3f);
}

class TensorParallelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Result<std::unique_ptr<Cluster>> cluster = testing::StartTestCluster(kClusterWorkers);
    ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
    cluster_ = std::move(*cluster).release();
    auto reference = Trainer::Create(Model(), Plan(1, 1, 1, 0), ExecutorOptions{});
    ASSERT_TRUE(reference.ok()) << reference.status().ToString();
    Result<testing::TrainingRun> run = Train(**reference);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    reference_ = new testing::TrainingRun(*std::move(run));
    Result<float> eval_loss = (*reference)->EvalLoss(Batch(kSteps));
    ASSERT_TRUE(eval_loss.ok()) << eval_loss.status().ToString();
    reference_eval_loss_ = new float(*eval_loss);
    auto fresh = Trainer::Create(Model(), Plan(1, 1, 1, 0), ExecutorOptions{});
    ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
    Result<std::vector<std::vector<float>>> grads = FirstGradients(**fresh);
    ASSERT_TRUE(grads.ok()) << grads.status().ToString();
    reference_grads_ = new std::vector<std::vector<float>>(*std::move(grads));
  }
  static void TearDownTestSuite() {
    delete cluster_;
    delete reference_;
    delete reference_grads_;
    delete reference_eval_loss_;
    reference_eval_loss_ = nullptr;
    cluster_ = nullptr;
    reference_ = nullptr;
    reference_grads_ = nullptr;
  }

  static Result<std::unique_ptr<Trainer>> OnCluster(const TrainingPlan& plan,
                                                    ModelSpec model = Model()) {
    TESSERA_ASSIGN_OR_RETURN(auto backend,
                             MakeClusterBackend(*cluster_, ClusterPlacement::kScheduler));
    return Trainer::Create(std::move(model), plan, std::move(backend));
  }

  static void ExpectSameRun(const TrainingPlan& plan) {
    ASSERT_NE(reference_, nullptr);
    ASSERT_OK_AND_ASSIGN(auto trainer, OnCluster(plan));
    ASSERT_OK_AND_ASSIGN(testing::TrainingRun run, Train(*trainer));
    testing::ExpectSameRun(run, *reference_, plan.parallel.ToString());
    // The trained model evaluated (the whole groups gathered from the tensor ranks' slices).
    ASSERT_OK_AND_ASSIGN(float eval_loss, trainer->EvalLoss(Batch(kSteps)));
    EXPECT_NEAR(eval_loss, *reference_eval_loss_, 1e-5 * *reference_eval_loss_);
    // The gradients of the first step, parameter by parameter.
    ASSERT_OK_AND_ASSIGN(auto again, OnCluster(plan));
    ASSERT_OK_AND_ASSIGN(auto grads, FirstGradients(*again));
    ASSERT_EQ(grads.size(), reference_grads_->size());
    // Per parameter: the norm of the difference against the reference's norm (what is
    // asserted), and the largest element's difference against the largest element (printed:
    // two data-parallel ranks alone come to about 7e-7 of it, float rounding of sums in another
    // order).
    double worst = 0, worst_element = 0;
    std::string worst_name;
    for (size_t p = 0; p < grads.size(); ++p) {
      const std::vector<float>& expected = (*reference_grads_)[p];
      ASSERT_EQ(grads[p].size(), expected.size());
      double norm = 0, difference = 0, scale = 0, largest = 0;
      for (size_t i = 0; i < expected.size(); ++i) {
        const double d = static_cast<double>(grads[p][i]) - expected[i];
        norm += static_cast<double>(expected[i]) * expected[i];
        difference += d * d;
        scale = std::max(scale, std::abs(static_cast<double>(expected[i])));
        largest = std::max(largest, std::abs(d));
      }
      const double relative = std::sqrt(difference / std::max(norm, 1e-60));
      EXPECT_LE(relative, 1e-6) << plan.parallel.ToString() << " gradient of "
                                << again->ParameterNames()[p];
      if (relative > worst) {
        worst = relative;
        worst_name = again->ParameterNames()[p];
      }
      worst_element = std::max(worst_element, largest / std::max(scale, 1e-30));
    }
    std::printf(
        "[ %s ] first-step gradients: worst relative difference %.2e (%s); largest element's "
        "%.2e of its parameter's largest\n",
        plan.parallel.ToString().c_str(), worst, worst_name.c_str(), worst_element);
  }

  // A checkpoint written after three steps of `writer` (in `name` under the temp directory)
  // resumes under each of `readers` at step 3 with the same next loss.
  static void ExpectCheckpointResumes(const TrainingPlan& writer_plan,
                                      const std::vector<TrainingPlan>& readers,
                                      const std::string& name) {
    const std::string dir = testing::TempPath(name);
    std::filesystem::remove_all(dir);
    ASSERT_OK_AND_ASSIGN(auto writer, OnCluster(writer_plan));
    ASSERT_OK(writer->InitializeParameters(7));
    for (int step = 0; step < 3; ++step) ASSERT_OK(writer->Step(Batch(step), 3e-3f).status());
    ASSERT_OK_AND_ASSIGN(std::string saved, SaveCheckpoint(*writer, dir, ""));
    ASSERT_OK_AND_ASSIGN(StepReport next, writer->Step(Batch(3), 3e-3f));
    writer.reset();
    for (const TrainingPlan& plan : readers) {
      ASSERT_OK_AND_ASSIGN(auto reader, OnCluster(plan));
      ASSERT_OK(LoadCheckpoint(*reader, saved).status());
      EXPECT_EQ(reader->steps_taken(), 3);
      ASSERT_OK_AND_ASSIGN(StepReport resumed, reader->Step(Batch(3), 3e-3f));
      EXPECT_NEAR(resumed.loss, next.loss, 1e-5 * next.loss) << plan.parallel.ToString();
    }
    std::filesystem::remove_all(dir);
  }

  static Cluster* cluster_;
  static testing::TrainingRun* reference_;
  static std::vector<std::vector<float>>* reference_grads_;
  static float* reference_eval_loss_;
};

Cluster* TensorParallelTest::cluster_ = nullptr;
testing::TrainingRun* TensorParallelTest::reference_ = nullptr;
std::vector<std::vector<float>>* TensorParallelTest::reference_grads_ = nullptr;
float* TensorParallelTest::reference_eval_loss_ = nullptr;

TEST(TensorParallelSplitTest, EveryParameterIsSlicedOnce) {
  const ModelSpec whole = Model();
  for (int ranks : {2, 4}) {
    ASSERT_OK_AND_ASSIGN(ModelSpec split, whole.SplitForTensorParallel(ranks));
    EXPECT_EQ(split.tensor_parallel, ranks);
    // Four layers a block; the embedding and positions; the head and the loss.
    ASSERT_EQ(split.layers.size(), static_cast<size_t>(4 * kTiny.layers + 4));
    const testing::SplitCounts counts = testing::CountSplit(split);
    EXPECT_EQ(counts.held, whole.NumParameters()) << ranks << " ranks";
    // Megatron's two all-reduces forward and two backward per block; the vocabulary-parallel
    // embedding's sum, the head's statistics and its input's gradient.
    EXPECT_EQ(counts.partial_outputs, 2 * kTiny.layers + 2);
    EXPECT_EQ(counts.partial_gradients, 2 * kTiny.layers + 1);
  }
}

// The logits of the whole vocabulary are on no rank: the split head's values are at most
// [B S, V / T] (the whole model's head holds [B S, V]).
TEST(TensorParallelSplitTest, NoRankHoldsTheWholeVocabularysLogits) {
  OpRegistry registry;
  ASSERT_OK(RegisterStandardOps(registry));
  const std::vector<TensorMeta> inputs = {
      TensorMeta{Shape{kBatch, kSeqLen, kTiny.channels}, DType::kF32, Device::Cpu()},
      TensorMeta{Shape{kBatch, kSeqLen}, DType::kI32, Device::Cpu()}};
  // The largest value of the layer `name`'s program.
  const auto largest = [&](const ModelSpec& model, const std::string& name) -> Result<int64_t> {
    for (const LayerSpec& layer : model.layers) {
      if (layer.name != name) continue;
      TESSERA_ASSIGN_OR_RETURN(std::string text, layer.attrs.GetString(kProgramAttr));
      TESSERA_ASSIGN_OR_RETURN(LayerProgram program, LayerProgram::Decode(text));
      TESSERA_ASSIGN_OR_RETURN(ProgramShapes shapes, InferProgram(registry, program, inputs));
      int64_t most = 0;
      for (const TensorMeta& value : shapes.values) most = std::max(most, value.numel());
      return most;
    }
    return NotFound("no layer '{}'", name);
  };
  const int64_t rows = kBatch * kSeqLen;
  ASSERT_OK_AND_ASSIGN(int64_t whole, largest(Model(), "head"));
  EXPECT_EQ(whole, rows * kTiny.vocab);
  for (int ranks : {2, 4}) {
    ASSERT_OK_AND_ASSIGN(ModelSpec split, Model().SplitForTensorParallel(ranks));
    ASSERT_OK_AND_ASSIGN(int64_t part, largest(split, "head"));
    EXPECT_EQ(part, rows * kTiny.vocab / ranks) << "TP " << ranks;
  }
  // A degree that does not divide the vocabulary keeps the embedding and the head replicated.
  Gpt2Config odd = kTiny;
  odd.vocab = 257;
  ASSERT_OK_AND_ASSIGN(ModelSpec odd_whole, BuildGpt2(odd, Gpt2LayerImpl::kPrimitive));
  ASSERT_OK_AND_ASSIGN(ModelSpec odd_split, odd_whole.SplitForTensorParallel(2));
  EXPECT_EQ(odd_split.layers.size(), static_cast<size_t>(4 * kTiny.layers + 2));
  ASSERT_OK_AND_ASSIGN(int64_t replicated, largest(odd_split, "head"));
  EXPECT_EQ(replicated, rows * odd.vocab);
}

TEST(TensorParallelSplitTest, BadDegreesAreRefusedWithTheFix) {
  const ModelSpec whole = Model();
  Result<ModelSpec> three = whole.SplitForTensorParallel(3);
  ASSERT_FALSE(three.ok());
  EXPECT_NE(three.status().message().find("4 attention heads"), std::string::npos)
      << three.status().ToString();
  // The fused layers' model splits as the primitive one does (the same split).
  ASSERT_OK_AND_ASSIGN(ModelSpec fused, BuildGpt2(kTiny)->SplitForTensorParallel(2));
  ASSERT_OK_AND_ASSIGN(ModelSpec primitive, whole.SplitForTensorParallel(2));
  ASSERT_EQ(fused.layers.size(), primitive.layers.size());
  for (size_t l = 0; l < fused.layers.size(); ++l) {
    EXPECT_EQ(fused.layers[l].name, primitive.layers[l].name);
    EXPECT_EQ(fused.layers[l].params.numel(), primitive.layers[l].params.numel());
  }
  // A split runs on CPUs with f32 activations: bf16 (a GPU's) is refused with the fix.
  Gpt2Config bf16 = kTiny;
  bf16.activations = DType::kBF16;
  Result<ModelSpec> gpu_split = BuildGpt2(bf16)->SplitForTensorParallel(2);
  ASSERT_FALSE(gpu_split.ok());
  EXPECT_NE(gpu_split.status().message().find("plan without tensor or sequence parallelism"),
            std::string::npos)
      << gpu_split.status().ToString();
  // The plan's workers must be D x T x P.
  TrainingPlan plan = Plan(1, 2, 1, 0);
  plan.parallel.workers = {WorkerId(1), WorkerId(2), WorkerId(3)};
  ASSERT_OK_AND_ASSIGN(ModelSpec split, whole.SplitForTensorParallel(2));
  Status status = plan.Validate(split);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("D x T x P = 2 workers"), std::string::npos) << status.ToString();
  // A split model planned without tensor parallelism is refused; a whole one is checked as it
  // splits, and the step is planned on the split one only.
  EXPECT_FALSE(Plan(1, 1, 1, 0).Validate(split).ok());
  EXPECT_OK(Plan(1, 2, 1, 0).Validate(whole));
  EXPECT_OK(Plan(1, 2, 1, 0).Validate(*BuildGpt2(kTiny)));
  OpRegistry registry;
  ASSERT_OK(RegisterStandardOps(registry));
  TrainingPlan bound = Plan(1, 2, 1, 0);
  bound.parallel.workers = {WorkerId(1), WorkerId(2)};
  EXPECT_FALSE(PlanTrainingStep(whole, bound, registry).ok());
  EXPECT_OK(PlanTrainingStep(split, bound, registry).status());
}

TEST_F(TensorParallelTest, TwoRanksTrainTheOneWorkerRun) { ExpectSameRun(Plan(1, 2, 1, 0)); }

// Without tensor parallelism, for scale: the rounding two data-parallel ranks alone bring.
TEST_F(TensorParallelTest, TwoDataRanksForComparison) { ExpectSameRun(Plan(2, 1, 1, 0)); }

TEST_F(TensorParallelTest, FourRanksTrainTheOneWorkerRun) { ExpectSameRun(Plan(1, 4, 1, 0)); }

TEST_F(TensorParallelTest, TwoTensorByTwoDataRanksUnderZero1) { ExpectSameRun(Plan(2, 2, 1, 1)); }

// ZeRO-3 over the data-parallel ranks of each tensor rank: the split groups' shards gathered
// per micro-batch.
TEST_F(TensorParallelTest, TwoTensorByTwoDataRanksUnderZero3WithMicroBatches) {
  TrainingPlan plan = Plan(2, 2, 1, 3);
  plan.parallel.micro_batches = 2;
  ExpectSameRun(plan);
}

TEST_F(TensorParallelTest, ThreeDimensionsOnEightWorkers) { ExpectSameRun(Plan(2, 2, 2, 1)); }

// A trainer of the fused layers' model (train_gpt2's default) runs every split as the
// primitive model's: its parameters mapped onto the split's slices by name, the one-worker run's
// losses (float rounding of other kernels apart, within 1e-5).
TEST_F(TensorParallelTest, TheFusedModelTrainsEverySplit) {
  for (const TrainingPlan& plan : {Plan(1, 2, 1, 0), ShardedPlan(1, 2, 1, 0),
                                   SequencePlan(2, 2, 1, 0), RingPlan(2, 2, 1, 0)}) {
    ASSERT_OK_AND_ASSIGN(ModelSpec fused, BuildGpt2(kTiny));
    ASSERT_OK_AND_ASSIGN(auto trainer, OnCluster(plan, std::move(fused)));
    ASSERT_OK_AND_ASSIGN(testing::TrainingRun run, Train(*trainer));
    testing::ExpectSameRun(run, *reference_, "fused, " + plan.parallel.ToString());
    ASSERT_OK_AND_ASSIGN(float eval_loss, trainer->EvalLoss(Batch(kSteps)));
    EXPECT_NEAR(eval_loss, *reference_eval_loss_, 1e-5 * *reference_eval_loss_);
  }
}

// The gradients of two runs' first steps, parameter by parameter: the norm of each difference
// against the reference's norm, at most 1e-6; returns the worst.
double ExpectSameGradients(const std::vector<std::vector<float>>& grads,
                           const std::vector<std::vector<float>>& reference,
                           const std::vector<std::string>& names, const std::string& label) {
  EXPECT_EQ(grads.size(), reference.size()) << label;
  double worst = 0;
  for (size_t p = 0; p < grads.size() && p < reference.size(); ++p) {
    EXPECT_EQ(grads[p].size(), reference[p].size()) << label << " " << names[p];
    double norm = 0, difference = 0;
    for (size_t i = 0; i < grads[p].size() && i < reference[p].size(); ++i) {
      const double d = static_cast<double>(grads[p][i]) - reference[p][i];
      norm += static_cast<double>(reference[p][i]) * reference[p][i];
      difference += d * d;
    }
    const double relative = std::sqrt(difference / std::max(norm, 1e-60));
    EXPECT_LE(relative, 1e-6) << label << " gradient of " << names[p];
    worst = std::max(worst, relative);
  }
  return worst;
}

// Sequence parallelism (Ulysses) trains the one-worker run: every sequence rank of a group
// reads the same rows, each its 1/P of their positions, with all-to-alls around attention.
TEST_F(TensorParallelTest, TwoSequenceRanksTrainTheOneWorkerRun) {
  ExpectSameRun(SequencePlan(2, 2, 1, 0));
}

TEST_F(TensorParallelTest, FourSequenceRanksTrainTheOneWorkerRun) {
  ExpectSameRun(SequencePlan(4, 4, 1, 0));
}

// Two row groups of two sequence ranks, ZeRO-1 over all four; and ZeRO-3 over four sequence
// ranks with two micro-batches.
TEST_F(TensorParallelTest, SequenceRanksComposeWithDataRanksAndZero) {
  ExpectSameRun(SequencePlan(4, 2, 1, 1));
  TrainingPlan zero3 = SequencePlan(4, 4, 1, 3);
  zero3.parallel.micro_batches = 2;
  ExpectSameRun(zero3);
}

// Two pipeline stages of two sequence ranks each (1F1B, two micro-batches).
TEST_F(TensorParallelTest, SequenceRanksInAPipeline) { ExpectSameRun(SequencePlan(2, 2, 2, 1)); }

// Ring attention trains the one-worker run: every rank of a group reads the same rows, each its
// 1/P of their positions with every head, the keys and values rotated round the group.
TEST_F(TensorParallelTest, TwoRingRanksTrainTheOneWorkerRun) {
  ExpectSameRun(RingPlan(2, 2, 1, 0));
}

TEST_F(TensorParallelTest, FourRingRanksTrainTheOneWorkerRun) {
  ExpectSameRun(RingPlan(4, 4, 1, 0));
}

// Two row groups of two ring ranks under ZeRO-1; four under ZeRO-3 with two micro-batches; two
// pipeline stages of two ring ranks each.
TEST_F(TensorParallelTest, RingRanksComposeWithDataRanksZeroAndPipelines) {
  ExpectSameRun(RingPlan(4, 2, 1, 1));
  TrainingPlan zero3 = RingPlan(4, 4, 1, 3);
  zero3.parallel.micro_batches = 2;
  ExpectSameRun(zero3);
  ExpectSameRun(RingPlan(2, 2, 2, 1));
}

// Sequence parallelism under the memory plan: four Ulysses or ring ranks under an activation
// budget that makes the plan split each rank's batch into micro-batches (run one after another)
// and keep layers in part or recompute them (a ring layer's recompute reads the re-derived
// blocks too) train the one-worker run, their activation peaks as predicted. (The trainer used to
// hand the sequence ranks the rows of the plan's micro-batch count rather than the step's: the
// losses were another batch's.)
TEST_F(TensorParallelTest, SequenceRanksUnderAnActivationBudget) {
  for (const auto& [plan, budget] :
       std::vector<std::pair<TrainingPlan, double>>{{SequencePlan(4, 4, 1, 0), 0.3},
                                                    {RingPlan(4, 4, 1, 0), 0.5},
                                                    {RingPlan(4, 4, 1, 0), 0.6}}) {
    TrainingPlan capped = plan;
    capped.memory.activation_budget = budget;
    const std::string what =
        fmt::format("{} with {} of its activations", plan.parallel.ToString(), budget);
    ASSERT_OK_AND_ASSIGN(auto trainer, OnCluster(capped));
    testing::ExpectActivationsPlanned(trainer->step_graph().memory);
    ASSERT_OK_AND_ASSIGN(testing::TrainingRun run, Train(*trainer));
    testing::ExpectSameRun(run, *reference_, what);
    testing::ExpectActivationPeaksAsPredicted(*trainer, run, 0.05, 0);
    std::printf("[ %s ] %d micro-batch(es) a step; %s\n", what.c_str(),
                trainer->step_graph().parallel.micro_batches,
                trainer->step_graph().memory.reason.c_str());
  }
}

// Six heads over four sequence ranks: under Ulysses each rank attends over two heads, the last
// rank's both padding (zeros); under ring attention every rank attends over all six. Either way
// the run is the one worker's, losses and first-step gradients.
TEST_F(TensorParallelTest, AHeadCountTheSequenceDegreeDoesNotDivide) {
  Gpt2Config six = kTiny;
  six.heads = 6;
  six.channels = 96;
  const auto trainer = [&](const TrainingPlan& plan,
                           bool cluster) -> Result<std::unique_ptr<Trainer>> {
    TESSERA_ASSIGN_OR_RETURN(ModelSpec model, BuildGpt2(six, Gpt2LayerImpl::kPrimitive));
    if (!cluster) return Trainer::Create(model, plan, ExecutorOptions{});
    TESSERA_ASSIGN_OR_RETURN(auto backend,
                             MakeClusterBackend(*cluster_, ClusterPlacement::kScheduler));
    return Trainer::Create(model, plan, std::move(backend));
  };
  ASSERT_OK_AND_ASSIGN(auto reference, trainer(Plan(1, 1, 1, 0), false));
  ASSERT_OK_AND_ASSIGN(testing::TrainingRun expected, Train(*reference));
  ASSERT_OK_AND_ASSIGN(auto fresh, trainer(Plan(1, 1, 1, 0), false));
  ASSERT_OK_AND_ASSIGN(auto expected_grads, FirstGradients(*fresh));
  for (const TrainingPlan& split : {SequencePlan(4, 4, 1, 0), RingPlan(4, 4, 1, 0)}) {
    const std::string what = fmt::format("6 heads over 4 sequence ranks ({})",
                                         SequenceAttentionName(split.parallel.sequence_attention));
    ASSERT_OK_AND_ASSIGN(auto ranks, trainer(split, true));
    ASSERT_OK_AND_ASSIGN(testing::TrainingRun run, Train(*ranks));
    testing::ExpectSameRun(run, expected, what);
    ASSERT_OK_AND_ASSIGN(auto again, trainer(split, true));
    ASSERT_OK_AND_ASSIGN(auto grads, FirstGradients(*again));
    const double worst = ExpectSameGradients(grads, expected_grads, again->ParameterNames(), what);
    std::printf("[ %s ] first-step gradients: worst %.2e\n", what.c_str(), worst);
  }
}

// The sequence exchanges' bytes: a run of P sequence ranks sends, beyond what P data-parallel
// ranks send (the same gradient reductions), per block:
//   Ulysses  two all-to-alls forward and two backward, each rank sending (P - 1) / P of its
//            buffer: QKV's [P, B, S/P, 3 Hp d] and attention's [P, B, S/P, Hp d] (Hp d = h / P
//            when P divides the heads: 4 x 4 B S h (P - 1) / P^2 bytes per block per direction)
//   ring     P - 1 rotations forward of the rank's keys and values [B, S/P, 2h], P - 1 of them
//            again backward (the other way, re-deriving the blocks rather than keeping them)
//            and P - 1 of their gradients, each sent whole: 3 (P - 1) x 4 x 2 B S h / P bytes
TEST_F(TensorParallelTest, SequenceRanksSendTheExchangesBytes) {
  for (SequenceAttention attention : {SequenceAttention::kUlysses, SequenceAttention::kRing}) {
    for (int ranks : {2, 4}) {
      double sent[2] = {0, 0};
      for (int sequence : {1, ranks}) {
        // Every gradient in one bucket in both runs, the same collective whatever the models'
        // layer groups (buckets sized from the link measured as each trainer is made could
        // differ).
        TrainingPlan plan = SequencePlan(ranks, sequence, 1, 0);
        plan.parallel.sequence_attention = attention;
        plan.parallel.bucket_bytes = int64_t{1} << 30;
        ASSERT_OK_AND_ASSIGN(auto trainer, OnCluster(plan));
        ASSERT_OK(trainer->InitializeParameters(7));
        ASSERT_OK_AND_ASSIGN(StepReport report, trainer->Step(Batch(0), 3e-3f));
        ASSERT_EQ(report.ranks.size(), static_cast<size_t>(ranks));
        const double first = static_cast<double>(report.ranks[0].figures.collective_bytes_sent);
        for (const RankFigures& rank : report.ranks) {
          EXPECT_EQ(static_cast<double>(rank.figures.collective_bytes_sent), first);
        }
        sent[sequence == 1 ? 0 : 1] = first;
      }
      const double local = static_cast<double>(kBatch) * kSeqLen / ranks;  // B S / P positions
      const double expected =
          attention == SequenceAttention::kRing
              ? kTiny.layers * 3.0 * (ranks - 1) * 4.0 * local * 2 * kTiny.channels
              : kTiny.layers * 2.0 * 4.0 * local * (3 + 1) * kTiny.channels * (ranks - 1) / ranks;
      EXPECT_NEAR(sent[1] - sent[0], expected, 0.01 * expected)
          << SequenceAttentionName(attention) << " P " << ranks;
      std::printf("[ %s P %d ] exchanges sent %.0f bytes per rank (formula %.0f)\n",
                  SequenceAttentionName(attention), ranks, sent[1] - sent[0], expected);
    }
  }
}

// Under a per-worker memory cap, the longest sequence that trains: on one worker, on four
// Ulysses ranks (each holding a quarter of every activation) and on four ring-attention ranks
// (a quarter of every activation but the keys and values: each rank keeps every block it
// attended, the whole sequence's). Found with the memory model (whose predictions the runs'
// measured peaks match) keeping every activation, then trained at that length under the cap,
// measured peaks within it and the activations' the model's within 5%. With the planner free to
// recompute, the lengths grow (printed).
TEST_F(TensorParallelTest, FourSequenceRanksTrainSequencesNearlyFourTimesLonger) {
  Gpt2Config config = kTiny;
  config.max_seq_len = 4096;
  constexpr int64_t kRows = 4, kCap = int64_t{24} << 20;
  ASSERT_OK_AND_ASSIGN(ModelSpec whole, BuildGpt2(config, Gpt2LayerImpl::kPrimitive));
  OpRegistry registry;
  ASSERT_OK(RegisterStandardOps(registry));
  const auto capped = [&](TrainingPlan plan) {
    plan.batch = kRows;
    plan.memory.host_bytes = kCap;
    plan.parallel.bucket_bytes = 0;  // as searched, whatever link the trainer measures
    return plan;
  };
  // The longest multiple of 16 positions whose step fits under the cap: keeping every
  // activation (the predicted peak of the plan without a cap), or as the planner plans it.
  const auto longest = [&](TrainingPlan plan, bool keep_all) -> int64_t {
    for (int w = 1; w <= plan.parallel.num_workers() && plan.parallel.num_workers() > 1; ++w) {
      plan.parallel.workers.push_back(WorkerId(static_cast<uint64_t>(w)));
    }
    if (keep_all) plan.memory.host_bytes = 0;
    Result<ModelSpec> split =
        whole.PlannedFor(plan.parallel.tensor_parallel, plan.parallel.sequence_parallel, false,
                         plan.parallel.sequence_attention);
    if (!split.ok()) return 0;
    int64_t fits = 0;
    for (int64_t lo = 1, hi = config.max_seq_len / 16; lo <= hi;) {
      const int64_t mid = (lo + hi) / 2;
      plan.seq_len = mid * 16;
      Result<StepGraph> step = PlanTrainingStep(*split, plan, registry);
      bool ok = step.ok();
      if (ok && keep_all) {
        Result<MemoryProfile> profile = PredictMemory(step->graph);
        ok = profile.ok();
        for (const WorkerMemory& worker : ok ? profile->workers : std::vector<WorkerMemory>{}) {
          ok = ok && worker.total_peak <= kCap;
        }
      }
      if (ok) {
        fits = plan.seq_len;
        lo = mid + 1;
      } else {
        hi = mid - 1;
      }
    }
    return fits;
  };
  // Trains `plan` one step at its length, within the cap, as the memory model predicts.
  const auto trains_within_cap = [&](const TrainingPlan& plan) {
    std::mt19937_64 rng(77);
    std::vector<int32_t> stream(static_cast<size_t>(kRows * plan.seq_len + 1));
    for (int32_t& token : stream) token = static_cast<int32_t>(rng() % config.vocab);
    const std::vector<Tensor> batch = *Gpt2Batch(config, std::span(stream).first(stream.size() - 1),
                                                 std::span(stream).subspan(1), kRows, plan.seq_len);
    std::unique_ptr<Trainer> trainer;
    if (plan.parallel.num_workers() > 1) {
      ASSERT_OK_AND_ASSIGN(auto backend,
                           MakeClusterBackend(*cluster_, ClusterPlacement::kScheduler));
      ASSERT_OK_AND_ASSIGN(trainer, Trainer::Create(whole, plan, std::move(backend)));
    } else {
      ASSERT_OK_AND_ASSIGN(trainer, Trainer::Create(whole, plan, ExecutorOptions{}));
    }
    ASSERT_OK(trainer->InitializeParameters(7));
    ASSERT_OK_AND_ASSIGN(StepReport report, trainer->Step(batch, 3e-3f));
    EXPECT_TRUE(std::isfinite(report.loss));
    ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(trainer->step_graph().graph));
    for (const RankFigures& rank : report.ranks) {
      const auto measured = static_cast<double>(rank.figures.peak(ObjectRole::kActivation));
      const WorkerMemory* worker = testing::PredictedWorker(profile, rank.worker);
      ASSERT_NE(worker, nullptr);
      const auto predicted =
          static_cast<double>(worker->role_peaks[static_cast<size_t>(ObjectRole::kActivation)]);
      EXPECT_NEAR(measured, predicted, 0.05 * predicted) << plan.parallel.ToString();
      EXPECT_LE(rank.figures.total_peak, kCap) << plan.parallel.ToString();
      std::printf(
          "[ %s, %lld positions ] rank %d: activations %.2f MiB (predicted %.2f), all "
          "objects %.2f MiB (cap %lld)\n",
          plan.parallel.ToString().c_str(), static_cast<long long>(plan.seq_len), rank.rank,
          measured / (1 << 20), predicted / (1 << 20),
          static_cast<double>(rank.figures.total_peak) / (1 << 20),
          static_cast<long long>(kCap >> 20));
    }
  };
  TrainingPlan one = capped(Plan(1, 1, 1, 0));
  const int64_t alone = longest(one, true), planned_alone = longest(one, false);
  ASSERT_GT(alone, 0);
  one.seq_len = alone;
  trains_within_cap(one);
  for (TrainingPlan four : {capped(SequencePlan(4, 4, 1, 0)), capped(RingPlan(4, 4, 1, 0))}) {
    const bool ring = four.parallel.sequence_attention == SequenceAttention::kRing;
    const int64_t split = longest(four, true), planned_split = longest(four, false);
    const bool at_most = planned_split == config.max_seq_len;  // the model's positions end there
    std::printf(
        "[ cap %lld MiB ] longest sequence keeping every activation: %lld positions on one "
        "worker, %lld on four %s ranks (%.2fx); as planned (recomputing): %lld and %s%lld "
        "(%s%.2fx)\n",
        static_cast<long long>(kCap >> 20), static_cast<long long>(alone),
        static_cast<long long>(split), ring ? "ring-attention" : "Ulysses",
        static_cast<double>(split) / static_cast<double>(alone),
        static_cast<long long>(planned_alone), at_most ? "the model's max_seq_len, " : "",
        static_cast<long long>(planned_split), at_most ? "at least " : "",
        static_cast<double>(planned_split) / static_cast<double>(planned_alone));
    // Ulysses holds a quarter of everything. The ring keeps a quarter of everything but its
    // chain of partial outputs: each step's merged output is kept for the next step's backward,
    // P of them of S/P positions (S h per row per block, against Ulysses' attention output of
    // S h / P), so it gains more than three times, less than four.
    EXPECT_GE(static_cast<double>(split), (ring ? 3.0 : 3.6) * static_cast<double>(alone));
    if (ring) {
      EXPECT_LT(static_cast<double>(split), 4.0 * static_cast<double>(alone));
    }
    EXPECT_GE(planned_alone, alone);
    EXPECT_GE(planned_split, split);
    four.seq_len = split;
    trains_within_cap(four);
  }
}

// A checkpoint written by two groups of two sequence ranks under ZeRO-1 resumes on four
// sequence ranks, on one worker and at TP 2, with the same next loss.
TEST_F(TensorParallelTest, ASequenceParallelCheckpointResumesAnywhere) {
  ExpectCheckpointResumes(SequencePlan(4, 2, 1, 1),
                          {SequencePlan(4, 4, 1, 0), Plan(1, 1, 1, 0), Plan(1, 2, 1, 0)},
                          "sp_checkpoint");
}

// The ring split's layers per block (qkv, ring0, then per step a hand-on layer and a ring step,
// then post), and where each step's block of keys and values comes from: the qkv layer's own
// block, rotated once per step.
TEST(TensorParallelSplitTest, RingStepsReadTheirBlockFromTheRanksOwn) {
  ASSERT_OK_AND_ASSIGN(ModelSpec ring,
                       Model().SplitForSequenceParallel(4, SequenceAttention::kRing));
  EXPECT_EQ(ring.sequence_attention, SequenceAttention::kRing);
  ASSERT_OK_AND_ASSIGN(const LayerSpec* qkv, ring.FindLayer("h.1.qkv"));
  const auto index = [&](std::string_view name) {
    const Result<const LayerSpec*> layer = ring.FindLayer(name);
    return layer.ok() ? static_cast<size_t>(*layer - ring.layers.data()) : ring.layers.size();
  };
  for (int step = 1; step < 4; ++step) {
    const size_t l = index(fmt::format("h.1.ring{}", step));
    ASSERT_LT(l, ring.layers.size());
    const std::optional<ModelSpec::Rotated> block = ring.RotationOrigin(l, 1);
    ASSERT_TRUE(block.has_value()) << step;
    EXPECT_EQ(block->origin_layer, static_cast<size_t>(qkv - ring.layers.data()));
    EXPECT_EQ(block->origin_output, 1);
    EXPECT_EQ(block->rotations, step);
    EXPECT_FALSE(ring.RotationOrigin(l, 0).has_value()) << "the queries are not rotated";
    EXPECT_TRUE(ring.layers[index(fmt::format("h.1.kv{}", step))].hands_on_rotation);
  }
  EXPECT_FALSE(ring.RotationOrigin(index("h.1.ring0"), 1).has_value());
}

// A ring-attention checkpoint (two groups of two ranks, ZeRO-1) resumes under Ulysses and on one
// worker with the same next loss: the ring keeps the whole model's parameters and names.
TEST_F(TensorParallelTest, ARingAttentionCheckpointResumesAnywhere) {
  ExpectCheckpointResumes(RingPlan(4, 2, 1, 1),
                          {SequencePlan(4, 4, 1, 0), Plan(1, 1, 1, 0), RingPlan(4, 4, 1, 0)},
                          "ring_checkpoint");
}

TEST(TensorParallelSplitTest, SequenceParallelismIsRefusedWithTheFix) {
  TrainingPlan odd_length = SequencePlan(2, 2, 1, 0);
  odd_length.seq_len = 31;
  Status status = odd_length.Validate(Model());
  EXPECT_NE(status.message().find("multiple of 2"), std::string::npos) << status.ToString();
  Status groups = SequencePlan(3, 2, 1, 0).Validate(Model());
  EXPECT_NE(groups.message().find("divide the 3 data-parallel ranks"), std::string::npos)
      << groups.ToString();
  TrainingPlan both = SequencePlan(2, 2, 1, 0);
  both.parallel.tensor_parallel = 2;
  Status together = both.Validate(Model());
  EXPECT_NE(together.message().find("not built"), std::string::npos) << together.ToString();
  // The fused layers' model splits sequences as the primitive one does.
  EXPECT_OK(SequencePlan(2, 2, 1, 0).Validate(*BuildGpt2(kTiny)));
  EXPECT_OK(RingPlan(2, 2, 1, 0).Validate(*BuildGpt2(kTiny)));
  TrainingPlan ring_with_tensor = RingPlan(2, 2, 1, 0);
  ring_with_tensor.parallel.tensor_parallel = 2;
  Status ring_together = ring_with_tensor.Validate(Model());
  EXPECT_NE(ring_together.message().find("not built"), std::string::npos)
      << ring_together.ToString();
  // A split made for one way of attending is not planned for the other.
  ASSERT_OK_AND_ASSIGN(ModelSpec ulysses, Model().SplitForSequenceParallel(2));
  Status other = RingPlan(2, 2, 1, 0).Validate(ulysses);
  EXPECT_NE(other.message().find("give the whole model"), std::string::npos) << other.ToString();
  Result<ModelSpec> resplit = ulysses.SplitForSequenceParallel(2, SequenceAttention::kRing);
  ASSERT_FALSE(resplit.ok());
  EXPECT_NE(resplit.status().message().find("attending by ulysses, not ring"), std::string::npos)
      << resplit.status().ToString();
}

// A vocabulary the degree does not divide (257 over 2 ranks): the embedding and the head stay
// replicated, and the run is the one worker's.
TEST_F(TensorParallelTest, AVocabularyTheDegreeDoesNotDivideTrainsReplicated) {
  Gpt2Config odd = kTiny;
  odd.vocab = 257;
  const auto run = [&](const TrainingPlan& plan,
                       std::unique_ptr<GraphBackend> backend) -> Result<testing::TrainingRun> {
    TESSERA_ASSIGN_OR_RETURN(ModelSpec model, BuildGpt2(odd, Gpt2LayerImpl::kPrimitive));
    TESSERA_ASSIGN_OR_RETURN(auto trainer, Trainer::Create(model, plan, std::move(backend)));
    return testing::RecordRun(
        *trainer, 7, 5, [](Trainer& t, int step) { return t.Step(Batch(step), 3e-3f); },
        "h.1.qkv_w");
  };
  ASSERT_OK_AND_ASSIGN(auto local, MakeInProcessBackend(ExecutorOptions{}));
  ASSERT_OK_AND_ASSIGN(testing::TrainingRun reference, run(Plan(1, 1, 1, 0), std::move(local)));
  ASSERT_OK_AND_ASSIGN(auto backend, MakeClusterBackend(*cluster_, ClusterPlacement::kScheduler));
  ASSERT_OK_AND_ASSIGN(testing::TrainingRun split, run(Plan(1, 2, 1, 0), std::move(backend)));
  testing::ExpectSameRun(split, reference, "TP 2, vocabulary 257");
}

TEST_F(TensorParallelTest, TheStepGraphHoldsTheActivationsAllReduces) {
  ASSERT_OK_AND_ASSIGN(auto trainer, OnCluster(Plan(1, 2, 1, 0)));
  int64_t forward = 0, backward = 0;
  for (const TaskSpec& task : trainer->step_graph().graph.tasks()) {
    if (task.op != "all_reduce" || task.name.find("/tp_sum") == std::string::npos) continue;
    ++(task.name.find("tp_sum_dx") != std::string::npos ? backward : forward);
  }
  // Per tensor rank: two forward and two backward per block; the embedding's and the head's
  // statistics forward, the head's input gradient backward.
  EXPECT_EQ(forward, int64_t{2} * (2 * kTiny.layers + 2));
  EXPECT_EQ(backward, int64_t{2} * (2 * kTiny.layers + 1));
}

// Ring attention's backward re-derives the blocks of keys and values it reads: per rank, block and
// rotation one rotation the other way ("rotate_back"), and no backward reads a block the forward
// rotated, so those are freed after their forward readers (the memory test above measures it).
TEST_F(TensorParallelTest, RingBackwardsRederiveTheirBlocks) {
  constexpr int kRanks = 4;
  ASSERT_OK_AND_ASSIGN(auto trainer, OnCluster(RingPlan(kRanks, kRanks, 1, 0)));
  const Graph& graph = trainer->step_graph().graph;
  std::map<ObjectId, std::string> rotated;  // object -> the rotation that made it
  std::set<ObjectId> rederived;
  int64_t forward = 0, backward = 0;
  for (const TaskSpec& task : graph.tasks()) {
    if (task.op != "all_to_all") continue;
    ASSERT_OK_AND_ASSIGN(ExchangeLayout layout, ExchangeLayoutOf(task.attrs));
    if (layout == ExchangeLayout::kRingNext) {
      ++forward;
      for (ObjectId out : task.outputs) rotated[out] = task.name;
    } else if (layout == ExchangeLayout::kRingPrevious &&
               task.name.find("/rotate_back") != std::string::npos) {
      ++backward;
      rederived.insert(task.outputs.begin(), task.outputs.end());
    }
  }
  EXPECT_EQ(forward, int64_t{kRanks} * kTiny.layers * (kRanks - 1));
  EXPECT_EQ(backward, int64_t{kRanks} * kTiny.layers * (kRanks - 1));
  int64_t reads_rederived = 0;
  for (const TaskSpec& task : graph.tasks()) {
    if (task.name.find("/backward") == std::string::npos) continue;
    for (ObjectId in : task.inputs) {
      EXPECT_FALSE(rotated.contains(in))
          << task.name << " reads " << rotated[in] << "'s block, kept since the forward";
      reads_rederived += rederived.contains(in) ? 1 : 0;
    }
  }
  // Each ring step's backward reads its block re-derived (P - 1 a block), and so does each
  // hand-on layer's after the first (P - 2: a layer program's backward reads all its inputs).
  EXPECT_EQ(reads_rederived, int64_t{kRanks} * kTiny.layers * ((kRanks - 1) + (kRanks - 2)));
}

// What one member of an all-reduce of `bytes` over `members` sends: the host communicator's
// direct algorithm up to 64 KiB (to every other member), the ring's 2 (n - 1) / n above.
double AllReduceBytesSent(double bytes, int members) {
  if (members == 1) return 0;
  return bytes <= 64 * 1024 ? bytes * (members - 1) : 2.0 * (members - 1) / members * bytes;
}

// The bytes each worker's collectives send in a step, against Megatron's count: per block two
// all-reduces of the activations [B, S, h] forward and two of their gradients backward; the
// vocabulary-parallel embedding's [B, S, h] forward and the head's input gradient backward; the
// cross-entropy's statistics [B S, T + 1] (Megatron's three all-reduces of [B S]: max, sum, target
// logit); and the gradient norm's scalar. Each rank's parameters and activations against the
// formulas.
TEST_F(TensorParallelTest, BytesAndMemoryPerRankAreTheFormulas) {
  for (int ranks : {2, 4}) {
    ASSERT_OK_AND_ASSIGN(auto trainer, OnCluster(Plan(1, ranks, 1, 0)));
    ASSERT_OK(trainer->InitializeParameters(7));
    ASSERT_OK_AND_ASSIGN(StepReport report, trainer->Step(Batch(0), 3e-3f));
    ASSERT_EQ(report.ranks.size(), static_cast<size_t>(ranks));
    const double activation = 4.0 * kBatch * kSeqLen * kTiny.channels;
    const double stats = 4.0 * kBatch * kSeqLen * (ranks + 1);
    const double expected_sent = (4.0 * kTiny.layers + 2) * AllReduceBytesSent(activation, ranks) +
                                 AllReduceBytesSent(stats, ranks) + AllReduceBytesSent(4, ranks);
    // Parameters: the replicated ones whole, the split ones (and wte's rows) a 1/T slice.
    const int64_t c = kTiny.channels;
    const int64_t replicated =
        kTiny.max_seq_len * c + 2 * c + kTiny.layers * (2 * c + 2 * c + c + c);
    const int64_t split = kTiny.vocab * c + kTiny.layers * (3 * c * c + 3 * c + c * c + 4 * c * c +
                                                            4 * c + 4 * c * c);
    ASSERT_EQ(replicated + split, kTiny.NumParameters());
    const double expected_params =
        4.0 * (static_cast<double>(replicated) + static_cast<double>(split) / ranks);
    ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(trainer->step_graph().graph));
    for (const RankFigures& rank : report.ranks) {
      const double sent = static_cast<double>(rank.figures.collective_bytes_sent);
      EXPECT_NEAR(sent, expected_sent, 0.01 * expected_sent) << "TP " << ranks;
      const auto params = static_cast<double>(rank.figures.peak(ObjectRole::kParameter));
      EXPECT_NEAR(params, expected_params, 0.05 * expected_params) << "TP " << ranks;
      // Activations: what the memory model predicts for the rank's worker.
      const testing::ActivationPeaks peaks =
          testing::ExpectActivationPeakAsPredicted(profile, rank, fmt::format("TP {}", ranks));
      std::printf(
          "[ TP %d rank %d ] collectives sent %.0f bytes (Megatron's count %.0f); parameters "
          "%.0f bytes (formula %.0f); activations peak %.0f bytes (predicted %.0f)\n",
          ranks, rank.rank, sent, expected_sent, params, expected_params, peaks.measured,
          peaks.predicted);
    }
  }
}

// Megatron-LM's sequence parallelism trains the one-worker run: TP 2 and 4, TP 2 x DP 2 under
// ZeRO-1, and 3D with two pipeline stages.
TEST_F(TensorParallelTest, MegatronSequenceParallelismTrainsTheOneWorkerRun) {
  ExpectSameRun(ShardedPlan(1, 2, 1, 0));
  ExpectSameRun(ShardedPlan(1, 4, 1, 0));
  ExpectSameRun(ShardedPlan(2, 2, 1, 1));
  ExpectSameRun(ShardedPlan(2, 2, 2, 1));
}

// With ZeRO-3 over two data ranks and two micro-batches; a zero-bubble pipeline (its backwards
// split into input and weight halves, the sharded layers' parameter gradients all-reduced from
// the weight halves); and under half of its activations, the memory plan recomputing or keeping
// part of the sharded and split layers alike.
TEST_F(TensorParallelTest, MegatronSequenceParallelismComposesWithZero3PipelinesAndTheMemoryPlan) {
  TrainingPlan zero3 = ShardedPlan(2, 2, 1, 3);
  zero3.parallel.micro_batches = 2;
  ExpectSameRun(zero3);
  TrainingPlan zero_bubble = ShardedPlan(1, 2, 2, 0);
  zero_bubble.parallel.schedule = PipelineSchedule::kZbH1;
  zero_bubble.parallel.micro_batches = 4;
  ExpectSameRun(zero_bubble);
  TrainingPlan half = ShardedPlan(1, 2, 1, 0);
  half.memory.activation_budget = 0.5;
  ASSERT_OK_AND_ASSIGN(auto trainer, OnCluster(half));
  testing::ExpectActivationsPlanned(trainer->step_graph().memory);
  ASSERT_OK_AND_ASSIGN(testing::TrainingRun run, Train(*trainer));
  testing::ExpectSameRun(run, *reference_, "Megatron-SP TP 2 with half of its activations");
  testing::ExpectActivationPeaksAsPredicted(*trainer, run, 0.05, 0);
}

// The split: the same layers as plain tensor parallelism; positions, mid and out on 1/T of the
// positions, the embedding's, attention's and MLP's sums reduce-scattered, the norms' outputs
// all-gathered; the step graph's collectives, per tensor rank, are a reduce-scatter and an
// all-gather where plain tensor parallelism has an all-reduce (the head's statistics and the
// sharded layers' parameter gradients all-reduced); bad degrees refused naming the fix.
TEST_F(TensorParallelTest, MegatronSequenceParallelismShardsTheNormsAndResiduals) {
  ASSERT_OK_AND_ASSIGN(ModelSpec split, Model().SplitForTensorParallel(2, /*shard_sequence=*/true));
  EXPECT_TRUE(split.shards_sequence);
  int sharded = 0, scattered = 0, gathered = 0;
  for (const LayerSpec& layer : split.layers) {
    const TensorParallelLayer& tp = *layer.tensor_parallel;
    sharded += tp.sequence_sharded;
    for (size_t o = 0; o < static_cast<size_t>(layer.activations); ++o) {
      scattered += tp.scatters(o);
      gathered += tp.gathers(o);
    }
  }
  EXPECT_EQ(sharded, 2 * kTiny.layers + 1);    // positions, h.<b>.mid, h.<b>.out
  EXPECT_EQ(scattered, 2 * kTiny.layers + 1);  // embedding, h.<b>.attn, h.<b>.mlp
  EXPECT_EQ(gathered, 2 * kTiny.layers + 1);   // ln1 of positions, ln2 of mid, out's norm
  // Planned as one rank (the planner's layer estimates), each scattered output is read as 1/T of
  // the positions and each gathered one as all of them: the loss's graph builds.
  OpRegistry registry;
  ASSERT_OK(RegisterStandardOps(registry));
  ASSERT_OK_AND_ASSIGN(ForwardGraph one_rank, PlanEvalLoss(split, kBatch, kSeqLen, registry));
  EXPECT_EQ(one_rank.graph.object(one_rank.result).meta.numel(), 1);
  ASSERT_OK_AND_ASSIGN(auto trainer, OnCluster(ShardedPlan(1, 2, 1, 0)));
  std::map<std::string, int64_t> ops;
  for (const TaskSpec& task : trainer->step_graph().graph.tasks()) {
    if (task.name.find("/tp_") != std::string::npos) ++ops[task.op];
  }
  const int64_t per_direction = 2 + 4 * kTiny.layers;  // on each of the 2 tensor ranks
  EXPECT_EQ(ops["reduce_scatter"], 2 * per_direction);
  EXPECT_EQ(ops["all_gather"], 2 * per_direction);
  // The head's statistics; the sharded layers' parameter gradients.
  EXPECT_EQ(ops["all_reduce"], 2 * (1 + 2 * kTiny.layers + 1));
  // A degree the vocabulary does not divide, and tensor parallelism of 1, are refused.
  Gpt2Config odd = kTiny;
  odd.vocab = 257;
  ASSERT_OK_AND_ASSIGN(ModelSpec odd_whole, BuildGpt2(odd, Gpt2LayerImpl::kPrimitive));
  Result<ModelSpec> refused = odd_whole.SplitForTensorParallel(2, true);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("use a --vocab that 2 divides"), std::string::npos)
      << refused.status().ToString();
  TrainingPlan alone = ShardedPlan(1, 1, 1, 0);
  Status status = alone.Validate(Model());
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("--tensor-parallel 2 or more"), std::string::npos)
      << status.ToString();
  TrainingPlan uneven = ShardedPlan(1, 4, 1, 0);
  uneven.seq_len = 30;
  status = uneven.Validate(Model());
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("a multiple of 4"), std::string::npos) << status.ToString();
}

// Bytes and memory under Megatron-LM's sequence parallelism: per block a reduce-scatter and an
// all-gather of [B, S, h] forward where plain tensor parallelism all-reduces (ring: each sends
// (T - 1) / T of the buffer), and their adjoints backward; the embedding's and ln1's the same;
// the head's statistics, the sharded layers' parameter gradients and the norm's scalar
// all-reduced. Each rank's activations are the memory model's prediction, and fewer than plain
// tensor parallelism's (the norms and residuals a 1/T slice).
TEST_F(TensorParallelTest, MegatronSequenceParallelBytesAndMemoryAreTheFormulas) {
  for (int ranks : {2, 4}) {
    double plain_peak = 0;
    {
      ASSERT_OK_AND_ASSIGN(auto plain, OnCluster(Plan(1, ranks, 1, 0)));
      ASSERT_OK(plain->InitializeParameters(7));
      ASSERT_OK_AND_ASSIGN(StepReport report, plain->Step(Batch(0), 3e-3f));
      plain_peak = static_cast<double>(report.ranks[0].figures.peak(ObjectRole::kActivation));
    }
    ASSERT_OK_AND_ASSIGN(auto trainer, OnCluster(ShardedPlan(1, ranks, 1, 0)));
    ASSERT_OK(trainer->InitializeParameters(7));
    ASSERT_OK_AND_ASSIGN(StepReport report, trainer->Step(Batch(0), 3e-3f));
    ASSERT_EQ(report.ranks.size(), static_cast<size_t>(ranks));
    const int64_t c = kTiny.channels;
    const double activation = 4.0 * kBatch * kSeqLen * c;
    const double ring = activation * (ranks - 1) / ranks;  // a reduce-scatter's or all-gather's
    const double stats = 4.0 * kBatch * kSeqLen * (ranks + 1);
    const double positions = 4.0 * (kTiny.max_seq_len * c + 2 * c), norms = 4.0 * 3 * c;
    const double expected_sent =
        2 * (2 + 4 * kTiny.layers) * ring + AllReduceBytesSent(stats, ranks) +
        AllReduceBytesSent(positions, ranks) + 2 * kTiny.layers * AllReduceBytesSent(norms, ranks) +
        AllReduceBytesSent(4, ranks);
    ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(trainer->step_graph().graph));
    for (const RankFigures& rank : report.ranks) {
      const auto sent = static_cast<double>(rank.figures.collective_bytes_sent);
      EXPECT_NEAR(sent, expected_sent, 0.01 * expected_sent) << "TP " << ranks;
      const testing::ActivationPeaks peaks =
          testing::ExpectActivationPeakAsPredicted(profile, rank, fmt::format("TP {}", ranks));
      EXPECT_LT(peaks.measured, plain_peak) << "TP " << ranks;
      std::printf(
          "[ TP %d Megatron-SP rank %d ] collectives sent %.0f bytes (formula %.0f); activations "
          "peak %.0f bytes (predicted %.0f; plain tensor parallelism %.0f)\n",
          ranks, rank.rank, sent, expected_sent, peaks.measured, peaks.predicted, plain_peak);
    }
  }
}

// A checkpoint written under Megatron sequence parallelism resumes under plain tensor
// parallelism and on one worker with the same next loss (its groups are the whole model's).
TEST_F(TensorParallelTest, AMegatronSequenceParallelCheckpointResumesAnywhere) {
  ExpectCheckpointResumes(ShardedPlan(2, 2, 1, 1), {Plan(1, 4, 1, 0), Plan(1, 1, 1, 0)},
                          "megatron_sp_checkpoint");
}

TEST_F(TensorParallelTest, ACheckpointResumesAtAnyDegree) {
  ExpectCheckpointResumes(Plan(2, 2, 1, 1), {Plan(1, 4, 1, 0), Plan(1, 1, 1, 0)}, "tp_checkpoint");
}

}  // namespace
}  // namespace tessera

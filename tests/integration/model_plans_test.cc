// Plans on a model built with the model API (not GPT-2): a classifier whose head reads both the
// residual blocks' output and the first layer's (a skip connection), whose second block shares
// the first's weights, with derived backwards.
// On a local cluster of real worker processes, data parallel, ZeRO 1-3, optimizer offload and
// gradient accumulation compute the same training run as one worker in this process.
#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <sstream>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "model/model.h"
#include "ops/standard_ops.h"
#include "plan_equivalence.h"
#include "planner/step_graph.h"
#include "test_util.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

constexpr int kClusterWorkers = 4;
constexpr int kSteps = 12;
constexpr int64_t kBatch = 16;
constexpr int64_t kFeatures = 12;
constexpr int64_t kHidden = 24;
constexpr int64_t kClasses = 4;

Result<ModelSpec> SkipClassifier() {
  ModelBuilder model("skip_classifier", CpuRegistry());
  ModelValue x = model.Input("x", DType::kF32, Shape{1, kFeatures});
  ModelValue y = model.Input("y", DType::kI32, Shape{1}, /*label=*/true);
  ModelValue h = model.Layer("fc1", {x}, [](LayerBuilder& l) {
    LayerValue w = l.Param("w", Shape{kHidden, kFeatures}, ParamInit::Normal(0.3), true);
    LayerValue b = l.Param("b", Shape{kHidden}, ParamInit::Zeros());
    return l.Call("gelu_forward", {l.Call("linear_forward", {l.input(0), w, b})});
  });
  ModelValue r = model.Layer("block", {h}, [](LayerBuilder& l) {
    LayerValue g = l.Param("ln_w", Shape{kHidden}, ParamInit::Ones());
    LayerValue beta = l.Param("ln_b", Shape{kHidden}, ParamInit::Zeros());
    LayerValue w = l.Param("w", Shape{kHidden, kHidden}, ParamInit::Normal(0.2), true);
    LayerValue b = l.Param("b", Shape{kHidden}, ParamInit::Zeros());
    LayerValue normed = l.Call("layernorm_forward", {l.input(0), g, beta});
    return l.Call("add_forward",
                  {l.input(0), l.Call("gelu_forward", {l.Call("linear_forward", {normed, w, b})})});
  });
  // A second block with the first's weights (shared, as ALBERT's): a layer that is not the loss
  // reads another layer's group, which ZeRO-3 gathers again for its backward.
  ModelValue r2 = model.Layer("block2", {r}, [](LayerBuilder& l) {
    LayerValue g = l.Param("ln_w", Shape{kHidden}, ParamInit::Ones());
    LayerValue beta = l.Param("ln_b", Shape{kHidden}, ParamInit::Zeros());
    LayerValue w = l.SharedParam("block", "w");
    LayerValue b = l.SharedParam("block", "b");
    LayerValue normed = l.Call("layernorm_forward", {l.input(0), g, beta});
    return l.Call("add_forward",
                  {l.input(0), l.Call("gelu_forward", {l.Call("linear_forward", {normed, w, b})})});
  });
  ModelValue logits = model.Layer("head", {r2, h}, [](LayerBuilder& l) {
    LayerValue w = l.Param("w", Shape{kClasses, kHidden}, ParamInit::Normal(0.2), true);
    LayerValue b = l.Param("b", Shape{kClasses}, ParamInit::Zeros());
    LayerValue both = l.Call("add_forward", {l.input(0), l.input(1)});  // the skip from fc1
    return l.Call("linear_forward", {both, w, b});
  });
  model.Loss("loss", {logits, y}, [](LayerBuilder& l) {
    return l.Call("softmax_cross_entropy", {l.input(0), l.input(1)});
  });
  return model.Build();
}

// Points around one centre per class: learnable, deterministic in the step.
std::vector<Tensor> Batch(int step) {
  std::mt19937_64 rng(1000 + static_cast<uint64_t>(step));
  std::normal_distribution<float> noise(0.0f, 0.5f);
  std::vector<float> x(kBatch * kFeatures);
  std::vector<int32_t> y(kBatch);
  for (int64_t i = 0; i < kBatch; ++i) {
    y[static_cast<size_t>(i)] = static_cast<int32_t>(rng() % kClasses);
    for (int64_t f = 0; f < kFeatures; ++f) {
      const float centre = (f % kClasses == y[static_cast<size_t>(i)]) ? 1.5f : 0.0f;
      x[static_cast<size_t>(i * kFeatures + f)] = centre + noise(rng);
    }
  }
  return {FloatTensor(Shape{kBatch, kFeatures}, x), IntTensor(Shape{kBatch}, y)};
}

TrainingPlan Plan(int workers, int stage, OffloadMode offload, int accum) {
  TrainingPlan plan;
  plan.batch = kBatch;
  plan.parallel.data_parallel = workers;
  plan.parallel.zero_stage = stage;
  plan.parallel.offload = offload;
  plan.parallel.micro_batches = accum;
  return plan;
}

Result<TrainingRun> Train(Trainer& trainer) {
  return RecordRun(
      trainer, 3, kSteps, [](Trainer& t, int step) { return t.Step(Batch(step), 1e-2f); },
      "block.w");
}

class ModelPlansTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Result<std::unique_ptr<Cluster>> cluster = StartTestCluster(kClusterWorkers);
    ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
    cluster_ = std::move(*cluster).release();
    Result<ModelSpec> model = SkipClassifier();
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    auto reference = Trainer::Create(*model, Plan(1, 0, OffloadMode::kNone, 1), ExecutorOptions{});
    ASSERT_TRUE(reference.ok()) << reference.status().ToString();
    Result<TrainingRun> run = Train(**reference);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    reference_ = new TrainingRun(*std::move(run));
    Result<float> eval_loss = (*reference)->EvalLoss(Batch(kSteps));
    ASSERT_TRUE(eval_loss.ok()) << eval_loss.status().ToString();
    reference_eval_loss_ = new float(*eval_loss);
  }
  static void TearDownTestSuite() {
    delete cluster_;
    delete reference_;
    delete reference_eval_loss_;
    cluster_ = nullptr;
    reference_ = nullptr;
    reference_eval_loss_ = nullptr;
  }

  static void ExpectSameRun(const TrainingPlan& plan) {
    ASSERT_NE(reference_, nullptr);
    ASSERT_OK_AND_ASSIGN(ModelSpec model, SkipClassifier());
    ASSERT_OK_AND_ASSIGN(auto backend, MakeClusterBackend(*cluster_, ClusterPlacement::kScheduler));
    ASSERT_OK_AND_ASSIGN(auto trainer, Trainer::Create(model, plan, std::move(backend)));
    ASSERT_OK_AND_ASSIGN(TrainingRun run, Train(*trainer));
    testing::ExpectSameRun(run, *reference_, plan.parallel.ToString());
    // The held-out loss of the trained model too.
    ASSERT_OK_AND_ASSIGN(float eval_loss, trainer->EvalLoss(Batch(kSteps)));
    EXPECT_NEAR(eval_loss, *reference_eval_loss_, 1e-5 * *reference_eval_loss_);
  }

  static Cluster* cluster_;
  static TrainingRun* reference_;
  static float* reference_eval_loss_;
};

Cluster* ModelPlansTest::cluster_ = nullptr;
TrainingRun* ModelPlansTest::reference_ = nullptr;
float* ModelPlansTest::reference_eval_loss_ = nullptr;

TEST_F(ModelPlansTest, TheLossFallsOnOneWorker) {
  ASSERT_NE(reference_, nullptr);
  EXPECT_LT(reference_->losses.back(), 0.7 * reference_->losses.front())
      << reference_->losses.front() << " -> " << reference_->losses.back();
}

TEST_F(ModelPlansTest, EveryZeroStageMatchesOneWorker) {
  for (int stage = 0; stage <= 3; ++stage) {
    for (int workers : {2, 4}) ExpectSameRun(Plan(workers, stage, OffloadMode::kNone, 1));
  }
}

TEST_F(ModelPlansTest, OffloadAndGradientAccumulationMatchOneWorker) {
  ExpectSameRun(Plan(2, 2, OffloadMode::kOptimizer, 1));
  ExpectSameRun(Plan(1, 0, OffloadMode::kNone, 2));
  ExpectSameRun(Plan(2, 3, OffloadMode::kNone, 2));
}

TEST_F(ModelPlansTest, ABatchOfTheWrongShapeIsRefusedNamingTheInput) {
  ASSERT_OK_AND_ASSIGN(ModelSpec model, SkipClassifier());
  ASSERT_OK_AND_ASSIGN(
      auto trainer, Trainer::Create(model, Plan(1, 0, OffloadMode::kNone, 1), ExecutorOptions{}));
  std::vector<Tensor> batch = Batch(0);
  batch[0] = RandomTensor(Shape{kBatch, kFeatures + 1}, 1);
  Result<StepReport> step = trainer->Step(batch, 1e-2f);
  ASSERT_FALSE(step.ok());
  EXPECT_NE(step.status().ToString().find("input 'x'"), std::string::npos)
      << step.status().ToString();
  EXPECT_FALSE(trainer->Step({batch[1]}, 1e-2f).ok());
}

// The shared group's plan under ZeRO-3: "block2" reads "block"'s parameters, gathered for its
// forward and gathered again for its backward, and the group's gradient sums both readers' parts.
TEST(ModelPlansGraphTest, ZeroThreeGathersASharedGroupForEachReader) {
  ASSERT_OK_AND_ASSIGN(ModelSpec model, SkipClassifier());
  TrainingPlan plan = Plan(2, 3, OffloadMode::kNone, 1);
  plan.parallel.workers = {WorkerId(10), WorkerId(11)};
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  for (const char* task : {"rank0/block/gather_forward", "rank0/block/gather_block2",
                           "rank0/block/gather_backward", "rank0/block/gather_block2_backward"}) {
    EXPECT_TRUE(step.graph.FindTask(task).ok()) << task;
  }
  EXPECT_TRUE(step.graph.FindTask("rank1/block.grad_parts/sum1").ok());
}

// The losses train_mlp printed ("step N loss L" every 10 steps).
std::vector<float> MlpLosses(const std::string& output) {
  std::vector<float> losses;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    float loss = 0;
    if (std::sscanf(line.c_str(), "step %*d loss %f", &loss) == 1) losses.push_back(loss);
  }
  return losses;
}

// examples/mlp, the README's smallest driver: two workers, ZeRO-2, the loss falls.
TEST(MlpExampleTest, TheHelloWorldDriverLearns) {
  ProcessResult run = RunBinary("train_mlp", "");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const std::vector<float> losses = MlpLosses(run.output);
  ASSERT_EQ(losses.size(), 10u) << run.output;
  EXPECT_LT(losses.back(), 0.5f * losses.front()) << run.output;
}

// train_mlp with the plugin's softsign (examples/plugin) on a local cluster of two workers whose
// sessions go under `temp` (emptied first), with `environment` added.
BoundedRun TrainWithThePlugin(const std::string& temp, const std::string& environment = "") {
  std::filesystem::remove_all(temp);
  return RunBinaryWithin("train_mlp",
                         fmt::format("--plugin {} --activation softsign_forward --temp-dir {}",
                                     TESSERA_MY_OPS_PLUGIN, temp),
                         std::chrono::minutes(3), environment);
}

// The plugin's op as the hidden activation on the cluster: the driver loads the plugin and
// sends it; each worker writes it under its session root, loads it and runs its kernels. The
// loss falls as with the built-in GELU.
TEST(MlpExampleTest, APluginsOpRunsOnTheWorkers) {
  const std::string temp = TempPath("plugin_cluster");
  BoundedRun run = TrainWithThePlugin(temp);
  ASSERT_TRUE(run.exited && run.exit_code == 0) << run.output;
  EXPECT_NE(run.output.find("loaded plugin 'my_ops'"), std::string::npos) << run.output;
  const std::vector<float> losses = MlpLosses(run.output);
  ASSERT_EQ(losses.size(), 10u) << run.output;
  EXPECT_LT(losses.back(), 0.5f * losses.front()) << run.output;
  // The workers wrote the plugin they were sent under the session root, named by its digest.
  int written = 0;
  for (const auto& entry : std::filesystem::directory_iterator(temp + "/plugins")) {
    written += entry.path().string().ends_with("-my_ops.so");
  }
  EXPECT_EQ(written, 1);
  std::filesystem::remove_all(temp);
}

TEST(MlpExampleTest, AClusterThatRefusesPluginsSaysSo) {
  const std::string temp = TempPath("plugin_refused");
  BoundedRun run = TrainWithThePlugin(temp, "TESSERA_ALLOW_PLUGINS=0");
  ASSERT_TRUE(run.exited) << run.output;
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_NE(run.output.find("TESSERA_ALLOW_PLUGINS=0"), std::string::npos) << run.output;
  std::filesystem::remove_all(temp);
}

TEST(MlpExampleTest, AnUnknownActivationOrPluginIsNamed) {
  BoundedRun missing =
      RunBinaryWithin("train_mlp", "--plugin /nonexistent/libx.so", std::chrono::seconds(30));
  ASSERT_TRUE(missing.exited) << missing.output;
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_NE(missing.output.find("--plugin /nonexistent/libx.so"), std::string::npos)
      << missing.output;
  EXPECT_NE(missing.output.find("does not exist"), std::string::npos) << missing.output;
  BoundedRun unknown = RunBinaryWithin("train_mlp", "--in-process --activation softsign_forward",
                                       std::chrono::seconds(30));
  ASSERT_TRUE(unknown.exited) << unknown.output;
  EXPECT_EQ(unknown.exit_code, 1) << unknown.output;
  EXPECT_NE(unknown.output.find("softsign_forward"), std::string::npos) << unknown.output;
}

}  // namespace
}  // namespace tessera::testing

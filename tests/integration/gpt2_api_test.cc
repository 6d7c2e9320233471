// GPT-2's two layer implementations (model/gpt2.h's BuildGpt2): layer programs of primitive
// ops (Gpt2LayerImpl::kPrimitive) against the hand-fused layer ops (kFused). They have the same
// groups, names and initial values; with the fused model's parameter groups copied in, ten
// training steps on the same batches give the same losses (within 1e-5 relative) and gradient
// norms (1e-4), in this process and under a 2-rank ZeRO-3 plan on a local cluster of worker
// processes; a checkpoint of one loads into the other. Also prints the step times of both at a
// larger size (no threshold: a measurement, not a test).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <vector>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "model/gpt2.h"
#include "test_util.h"
#include "training/checkpoint.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

constexpr int kSteps = 10;
constexpr float kLr = 1e-3f;

// Tokens and next-token targets, deterministic in the step.
std::vector<Tensor> Batch(const Gpt2Config& config, int64_t batch, int64_t seq_len, int step) {
  std::mt19937_64 rng(500 + static_cast<uint64_t>(step));
  std::vector<int32_t> stream(static_cast<size_t>(batch * seq_len + 1));
  for (int32_t& token : stream) token = static_cast<int32_t>(rng() % config.vocab);
  std::vector<int32_t> tokens(stream.begin(), stream.end() - 1);
  std::vector<int32_t> targets(stream.begin() + 1, stream.end());
  Result<Tensor> t = Tensor::FromVector(Shape{batch, seq_len}, tokens);
  Result<Tensor> y = Tensor::FromVector(Shape{batch, seq_len}, targets);
  TESSERA_CHECK(t.ok() && y.ok(), "batch tensors");
  return {*t, *y};
}

TrainingPlan Plan(int64_t batch, int64_t seq_len, int ranks, int stage) {
  TrainingPlan plan;
  plan.batch = batch;
  plan.seq_len = seq_len;
  plan.parallel.data_parallel = ranks;
  plan.parallel.zero_stage = stage;
  return plan;
}

// Gives `to` (zero optimizer state) a copy of every parameter group of `from`.
Status CopyGroups(Trainer& from, Trainer& to, size_t layers) {
  TESSERA_RETURN_IF_ERROR(to.InitializeParameters(1));  // the optimizer state, zero
  for (size_t l = 0; l < layers; ++l) {
    TESSERA_ASSIGN_OR_RETURN(std::vector<float> group, from.ReadGroup(l, StateKind::kParameter));
    TESSERA_RETURN_IF_ERROR(to.WriteGroup(l, StateKind::kParameter, group));
  }
  return Status::Ok();
}

struct TrainingRun {
  std::vector<float> losses, grad_norms;
  std::vector<double> step_ms;
};

Result<TrainingRun> Train(Trainer& trainer, const Gpt2Config& config, const TrainingPlan& plan,
                          int steps) {
  TrainingRun run;
  for (int step = 0; step < steps; ++step) {
    TESSERA_ASSIGN_OR_RETURN(StepReport report,
                             trainer.Step(Batch(config, plan.batch, plan.seq_len, step), kLr));
    run.losses.push_back(report.loss);
    run.grad_norms.push_back(report.grad_norm);
    run.step_ms.push_back(report.step_ms);
  }
  return run;
}

void ExpectSameRun(const TrainingRun& run, const TrainingRun& reference, const char* what) {
  double worst_loss = 0, worst_norm = 0;
  for (size_t step = 0; step < reference.losses.size(); ++step) {
    const double loss =
        std::abs(run.losses[step] - reference.losses[step]) / std::abs(reference.losses[step]);
    const double norm = std::abs(run.grad_norms[step] - reference.grad_norms[step]) /
                        std::abs(reference.grad_norms[step]);
    EXPECT_LE(loss, 1e-5) << what << " step " << step << ": " << run.losses[step] << " vs "
                          << reference.losses[step];
    EXPECT_LE(norm, 1e-4) << what << " step " << step << ": " << run.grad_norms[step] << " vs "
                          << reference.grad_norms[step];
    worst_loss = std::max(worst_loss, loss);
    worst_norm = std::max(worst_norm, norm);
  }
  std::printf(
      "[ %s ] loss %.6f -> %.6f (fused %.6f -> %.6f); worst relative difference over %zu steps: "
      "loss %.2e, grad norm %.2e\n",
      what, run.losses.front(), run.losses.back(), reference.losses.front(),
      reference.losses.back(), reference.losses.size(), worst_loss, worst_norm);
}

const Gpt2Config kTiny{.layers = 2, .channels = 64, .heads = 4, .vocab = 256, .max_seq_len = 64};
constexpr int64_t kBatch = 4, kSeqLen = 32;

TEST(Gpt2ApiTest, TheGroupsHaveTheFusedLayouts) {
  ASSERT_OK_AND_ASSIGN(ModelSpec api, BuildGpt2(kTiny, Gpt2LayerImpl::kPrimitive));
  ASSERT_OK_AND_ASSIGN(ModelSpec fused, BuildGpt2(kTiny));
  ASSERT_EQ(api.layers.size(), fused.layers.size());
  for (size_t l = 0; l < fused.layers.size(); ++l) {
    EXPECT_EQ(api.layers[l].name, fused.layers[l].name);
    const auto& a = api.layers[l].params.slots();
    const auto& f = fused.layers[l].params.slots();
    ASSERT_EQ(a.size(), f.size()) << fused.layers[l].name;
    for (size_t s = 0; s < f.size(); ++s) {
      EXPECT_EQ(a[s].name, f[s].name);
      EXPECT_EQ(a[s].shape, f[s].shape) << f[s].name;
      EXPECT_EQ(a[s].offset, f[s].offset) << f[s].name;
      EXPECT_EQ(a[s].weight_decay, f[s].weight_decay) << f[s].name;
    }
  }
  EXPECT_EQ(api.NumParameters(), fused.NumParameters());
  EXPECT_TRUE(api.inputs[0].sequence && api.inputs[1].sequence && api.inputs[1].label);
  // The same description otherwise: checkpoint identity, parameter names and initialisation.
  EXPECT_EQ(api.config, fused.config);
  for (size_t l = 0; l < fused.layers.size(); ++l) {
    EXPECT_EQ(api.layers[l].ParamPrefix(), fused.layers[l].ParamPrefix());
    ASSERT_EQ(api.layers[l].init.size(), fused.layers[l].init.size());
    for (size_t s = 0; s < fused.layers[l].init.size(); ++s) {
      EXPECT_EQ(api.layers[l].init[s].kind, fused.layers[l].init[s].kind);
      EXPECT_EQ(api.layers[l].init[s].scale, fused.layers[l].init[s].scale);
    }
  }
  ASSERT_OK_AND_ASSIGN(Gpt2Config read, Gpt2ConfigOf(api));
  EXPECT_EQ(read, kTiny);
  EXPECT_FALSE(BuildGpt2(Gpt2Config{.activations = DType::kBF16}, Gpt2LayerImpl::kPrimitive).ok());
}

// A seed gives both implementations the same parameters, and a checkpoint of one loads into the
// other.
TEST(Gpt2ApiTest, TheSameSeedAndCheckpointsServeBoth) {
  const TrainingPlan plan = Plan(kBatch, kSeqLen, 1, 0);
  ASSERT_OK_AND_ASSIGN(auto fused, Trainer::Create(*BuildGpt2(kTiny), plan, ExecutorOptions{}));
  ASSERT_OK_AND_ASSIGN(auto api, Trainer::Create(*BuildGpt2(kTiny, Gpt2LayerImpl::kPrimitive), plan,
                                                 ExecutorOptions{}));
  ASSERT_OK(fused->InitializeParameters(42));
  ASSERT_OK(api->InitializeParameters(42));
  EXPECT_EQ(api->ParameterNames(), fused->ParameterNames());
  for (const std::string& name : fused->ParameterNames()) {
    EXPECT_EQ(*api->GetParameter(name), *fused->GetParameter(name)) << name;
  }
  ASSERT_OK(fused->Step(Batch(kTiny, kBatch, kSeqLen, 0), kLr).status());
  const std::string dir = TempPath("gpt2_api_checkpoints");
  std::filesystem::remove_all(dir);
  ASSERT_OK(SaveCheckpoint(*fused, dir, "").status());
  ASSERT_OK_AND_ASSIGN(CheckpointInfo loaded, LoadCheckpoint(*api, dir));
  EXPECT_EQ(loaded.step, 1);
  EXPECT_EQ(*api->GetParameter("h.1.fc_w"), *fused->GetParameter("h.1.fc_w"));
  std::filesystem::remove_all(dir);
}

TEST(Gpt2ApiTest, TrainsAsTheFusedModelInProcess) {
  const TrainingPlan plan = Plan(kBatch, kSeqLen, 1, 0);
  ASSERT_OK_AND_ASSIGN(auto fused, Trainer::Create(*BuildGpt2(kTiny), plan, ExecutorOptions{}));
  ASSERT_OK(fused->InitializeParameters(42));
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildGpt2(kTiny, Gpt2LayerImpl::kPrimitive));
  ASSERT_OK_AND_ASSIGN(auto api, Trainer::Create(model, plan, ExecutorOptions{}));
  ASSERT_OK(CopyGroups(*fused, *api, model.layers.size()));
  ASSERT_OK_AND_ASSIGN(TrainingRun reference, Train(*fused, kTiny, plan, kSteps));
  ASSERT_OK_AND_ASSIGN(TrainingRun run, Train(*api, kTiny, plan, kSteps));
  ExpectSameRun(run, reference, "in process");
  // Trained alike: the parameters after ten steps (wte: both layers' gradients summed).
  double worst = 0;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    ASSERT_OK_AND_ASSIGN(std::vector<float> a, api->ReadGroup(l, StateKind::kParameter));
    ASSERT_OK_AND_ASSIGN(std::vector<float> f, fused->ReadGroup(l, StateKind::kParameter));
    const double error = ScaledMaxError(a, f);
    EXPECT_LE(error, 1e-4) << model.layers[l].name;
    worst = std::max(worst, error);
  }
  std::printf("[ in process ] parameters after %d steps: worst scaled difference %.2e\n", kSteps,
              worst);
}

TEST(Gpt2ApiTest, TrainsAsTheFusedModelUnderZero3OnTwoWorkers) {
  LocalClusterOptions options;
  options.cpu_workers = 2;
  options.threads_per_worker = 1;
  options.tessera_binary = BinaryPath("tessera");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Cluster> cluster, Cluster::StartLocal(options));
  const TrainingPlan single = Plan(kBatch, kSeqLen, 1, 0);
  ASSERT_OK_AND_ASSIGN(auto fused, Trainer::Create(*BuildGpt2(kTiny), single, ExecutorOptions{}));
  ASSERT_OK(fused->InitializeParameters(42));
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildGpt2(kTiny, Gpt2LayerImpl::kPrimitive));
  ASSERT_OK_AND_ASSIGN(auto backend, MakeClusterBackend(*cluster, ClusterPlacement::kScheduler));
  ASSERT_OK_AND_ASSIGN(auto api,
                       Trainer::Create(model, Plan(kBatch, kSeqLen, 2, 3), std::move(backend)));
  ASSERT_OK(CopyGroups(*fused, *api, model.layers.size()));
  ASSERT_OK_AND_ASSIGN(TrainingRun reference, Train(*fused, kTiny, single, kSteps));
  ASSERT_OK_AND_ASSIGN(TrainingRun run, Train(*api, kTiny, single, kSteps));
  ExpectSameRun(run, reference, "ZeRO-3, 2 workers");
}

// Step times at a larger size, both models in this process on two threads; printed only.
TEST(Gpt2ApiTest, PrintsTheStepTimesOfBoth) {
  const Gpt2Config config{
      .layers = 4, .channels = 256, .heads = 4, .vocab = 50257, .max_seq_len = 64};
  const TrainingPlan plan = Plan(4, 64, 1, 0);
  const ExecutorOptions two_threads{.threads = 2};
  ASSERT_OK_AND_ASSIGN(auto fused, Trainer::Create(*BuildGpt2(config), plan, two_threads));
  ASSERT_OK(fused->InitializeParameters(42));
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildGpt2(config, Gpt2LayerImpl::kPrimitive));
  ASSERT_OK_AND_ASSIGN(auto api, Trainer::Create(model, plan, two_threads));
  ASSERT_OK(CopyGroups(*fused, *api, model.layers.size()));
  ASSERT_OK_AND_ASSIGN(TrainingRun reference, Train(*fused, config, plan, kSteps));
  ASSERT_OK_AND_ASSIGN(TrainingRun run, Train(*api, config, plan, kSteps));
  auto mean_after_first = [](const std::vector<double>& ms) {
    double total = 0;
    for (size_t i = 1; i < ms.size(); ++i) total += ms[i];
    return total / static_cast<double>(ms.size() - 1);
  };
  std::printf(
      "[ %s, batch 4 x 64, 2 threads ] mean step time over steps 2-%d: fused %.1f ms, model API "
      "%.1f ms (x%.2f)\n",
      config.ToString().c_str(), kSteps, mean_after_first(reference.step_ms),
      mean_after_first(run.step_ms),
      mean_after_first(run.step_ms) / mean_after_first(reference.step_ms));
  ExpectSameRun(run, reference, "larger model");
}

}  // namespace
}  // namespace tessera::testing

// The 3D U-Net (model/unet3d.h, built with the model API) under every plan: on a local cluster
// of real worker processes, 2 and 4 workers at every ZeRO stage train the same run as one worker
// (losses within 1e-5 relative over 20 steps), so does ZeRO-3 on two workers with half of its
// activations (each worker's peak as predicted), each rank's model state follows the ZeRO
// formulas, and train_unet3d learns (the loss falls, Dice rises) and resumes from checkpoints.
// Split over 2 and 4 tensor ranks (each pair of convolutions column- then row-parallel), alone and
// with two data ranks under ZeRO-1, it trains the same run too (first-step gradients within 1e-6),
// its all-reduces send the bytes the split says, each rank holds its slice of the parameters, and
// a checkpoint written at TP 2 x DP 2 resumes at TP 4 and at TP 1. On NIfTI volumes (--data, as
// written by --write-volumes) it learns from crops of a held-in set, evaluates on the held-out
// case, makes batches ahead of the steps, resumes exactly, and names a bad dataset.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <regex>
#include <utility>

#include <fmt/format.h>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "data/nifti.h"
#include "data/volumes.h"
#include "model/unet3d.h"
#include "plan_equivalence.h"
#include "planner/activation_solver.h"
#include "planner/memory_model.h"
#include "test_util.h"
#include "training/checkpoint.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

constexpr int kClusterWorkers = 4;
constexpr int kSteps = 20;
constexpr int64_t kBatch = 4;

UNet3dConfig Tiny() { return *UNet3dConfig::Preset("tiny"); }
UNet3dConfig TinyBf16() {
  UNet3dConfig config = Tiny();
  config.activations = DType::kBF16;
  return config;
}

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

// `data` data-parallel ranks of `tensor` tensor ranks each.
TrainingPlan TensorPlan(int data, int tensor, int stage) {
  TrainingPlan plan = Plan(data, stage);
  plan.parallel.tensor_parallel = tensor;
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

  static Result<std::unique_ptr<Trainer>> Distributed(const TrainingPlan& plan,
                                                      const UNet3dConfig& config = Tiny()) {
    TESSERA_ASSIGN_OR_RETURN(ModelSpec model, BuildUNet3d(config, CpuRegistry()));
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

// bf16 activations (mixed precision, as on a GPU; on the CPU each op computes in f32 and rounds
// its activation outputs as the GPU's kernels do): every activation between layers is bf16 and
// every parameter f32; the 20 steps stay within bf16's tolerance of the f32 run (each loss
// within 1%; bf16 keeps 8 bits of mantissa, 0.4% a rounding); the memory model predicts each
// worker's activation peak (about half of f32's); and data parallelism under ZeRO-2 and two
// tensor ranks train the bf16 one-worker run (their sums in another order move a bf16
// rounding now and then: within 0.1%).
TEST_F(UNet3dPlansTest, Bf16ActivationsTrainWithinBf16ToleranceOfF32OnEveryPlan) {
  ASSERT_NE(reference_, nullptr);
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(TinyBf16(), CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(auto alone, Trainer::Create(model, Plan(1, 0), ExecutorOptions{}));
  int64_t bf16_objects = 0;
  for (const ObjectSpec& object : alone->step_graph().graph.objects()) {
    if (object.role == ObjectRole::kParameter || object.role == ObjectRole::kGradient ||
        object.role == ObjectRole::kOptimizerState) {
      EXPECT_EQ(object.meta.dtype, DType::kF32) << object.name;
    }
    bf16_objects += object.meta.dtype == DType::kBF16;
  }
  EXPECT_GT(bf16_objects, 10);
  ASSERT_OK_AND_ASSIGN(TrainingRun bf16, Train(*alone));
  ASSERT_EQ(bf16.losses.size(), reference_->losses.size());
  double worst = 0;
  for (size_t i = 0; i < bf16.losses.size(); ++i) {
    const double f32 = reference_->losses[i];
    worst = std::max(worst, std::abs(bf16.losses[i] - f32) / f32);
    EXPECT_NEAR(bf16.losses[i], f32, 1e-2 * f32) << "step " << i + 1;
  }
  EXPECT_GT(worst, 0) << "bf16 activations gave the f32 losses bit for bit: were they used?";
  EXPECT_LT(bf16.losses.back(), 0.9 * bf16.losses.front());
  std::printf(
      "[ bf16 ] 20 steps, worst loss difference from f32 %.3g relative; final %.6f "
      "(f32 %.6f)\n",
      worst, bf16.losses.back(), reference_->losses.back());

  ASSERT_OK_AND_ASSIGN(ModelSpec f32_model, BuildUNet3d(Tiny(), CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(auto f32_alone, Trainer::Create(f32_model, Plan(1, 0), ExecutorOptions{}));
  ASSERT_OK_AND_ASSIGN(MemoryProfile f32_profile, PredictMemory(f32_alone->step_graph().graph));
  ASSERT_OK_AND_ASSIGN(MemoryProfile bf16_profile, PredictMemory(alone->step_graph().graph));
  const auto activations = [](const MemoryProfile& profile) {
    return static_cast<double>(
        profile.workers.at(0).role_peaks[static_cast<size_t>(ObjectRole::kActivation)]);
  };
  const double ratio = activations(bf16_profile) / activations(f32_profile);
  EXPECT_GT(ratio, 0.45);
  EXPECT_LT(ratio, 0.6);
  std::printf("[ bf16 ] predicted activation peak %.0f bytes, f32 %.0f (%.3fx)\n",
              activations(bf16_profile), activations(f32_profile), ratio);

  for (const TrainingPlan& plan : {Plan(2, 2), TensorPlan(1, 2, 0)}) {
    const std::string what = "bf16 " + plan.parallel.ToString();
    ASSERT_OK_AND_ASSIGN(auto trainer, Distributed(plan, TinyBf16()));
    ASSERT_OK_AND_ASSIGN(TrainingRun run, Train(*trainer));
    ASSERT_EQ(run.losses.size(), bf16.losses.size());
    double plan_worst = 0;
    for (size_t i = 0; i < run.losses.size(); ++i) {
      EXPECT_NEAR(run.losses[i], bf16.losses[i], 1e-3 * bf16.losses[i])
          << what << " step " << i + 1;
      plan_worst =
          std::max<double>(plan_worst, std::abs(run.losses[i] - bf16.losses[i]) / bf16.losses[i]);
    }
    std::printf("[ %s ] worst loss difference from one bf16 worker %.3g relative\n", what.c_str(),
                plan_worst);
    ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(trainer->step_graph().graph));
    for (const RankFigures& rank : run.reports.back().ranks) {
      ExpectActivationPeakAsPredicted(profile, rank, what);
    }
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

// Every parameter's gradient after one step from the same start.
Result<std::vector<std::vector<float>>> FirstGradients(Trainer& trainer) {
  return FirstStepGradients(trainer, 2, Batch(0), 3e-3f);
}

// The split model: every parameter of the whole one held once over the ranks (a split slot a
// 1/T slice), one partial sum per pair of conv blocks, a partial input gradient per input of
// each that is not the volume; a degree that does not divide the group norm's groups refused
// naming the fix.
TEST(UNet3dSplitTest, EveryParameterIsSlicedOnceAndBadDegreesAreRefused) {
  for (const char* preset : {"tiny", "small"}) {
    ASSERT_OK_AND_ASSIGN(UNet3dConfig config, UNet3dConfig::Preset(preset));
    ASSERT_OK_AND_ASSIGN(ModelSpec whole, BuildUNet3d(config, CpuRegistry()));
    const auto pairs = static_cast<size_t>(2 * config.depth + 1);  // enc*, bottleneck, dec*
    for (int ranks : {2, 4}) {
      ASSERT_OK_AND_ASSIGN(ModelSpec split, whole.SplitForTensorParallel(ranks));
      EXPECT_EQ(split.tensor_parallel, ranks);
      ASSERT_EQ(split.layers.size(), whole.layers.size() + pairs) << preset;
      const SplitCounts counts = CountSplit(split);
      EXPECT_EQ(counts.held, whole.NumParameters()) << preset << " TP " << ranks;
      EXPECT_EQ(counts.partial_outputs, static_cast<int64_t>(pairs)) << preset;
      // enc1.. and the bottleneck one input each, dec* two; enc0 reads the volume.
      EXPECT_EQ(counts.partial_gradients, 3 * config.depth) << preset;
    }
  }
  ASSERT_OK_AND_ASSIGN(ModelSpec whole, BuildUNet3d(Tiny(), CpuRegistry()));
  for (int ranks : {3, 8}) {
    Result<ModelSpec> refused = whole.SplitForTensorParallel(ranks);
    ASSERT_FALSE(refused.ok()) << ranks;
    EXPECT_NE(refused.status().message().find("4 group-norm groups do not split over"),
              std::string::npos)
        << refused.status().ToString();
    EXPECT_NE(refused.status().message().find("use a degree that divides 4"), std::string::npos)
        << refused.status().ToString();
  }
}

// The norm of a gradient.
double Norm(const std::vector<float>& values) {
  double sum = 0;
  for (float v : values) sum += static_cast<double>(v) * v;
  return std::sqrt(sum);
}

// Two and four tensor ranks, and two tensor by two data ranks under ZeRO-1 and ZeRO-3: the one
// worker's losses, and its gradients after the first step, parameter by parameter: the norm of
// the difference within 5e-6 of the gradient's norm. Data-parallel ranks alone (run first, for
// comparison) come to about 1e-7; the row-parallel convolution adds T partial sums of its input
// channels where one rank sums them all, and the group norms that follow (their mean taken out
// of values of about the same size) turn that order's rounding into 0.3-2e-6 of the gradients
// before them. A conv bias followed by a group norm of one channel per group has no gradient in
// exact arithmetic (the norm takes each channel's mean out): the tiny U-Net's at level 0 are
// rounding noise of about 1e-9, measured against the same block's weight gradient instead.
TEST_F(UNet3dPlansTest, TensorParallelRanksTrainTheOneWorkerRun) {
  constexpr double kTolerance = 5e-6;
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(Tiny(), CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(auto one, Trainer::Create(model, Plan(1, 0), ExecutorOptions{}));
  ASSERT_OK_AND_ASSIGN(auto expected, FirstGradients(*one));
  const std::vector<std::string> names = one->ParameterNames();
  // Per parameter, what its difference is measured against.
  std::vector<double> scales;
  for (size_t p = 0; p < names.size(); ++p) {
    const std::string& name = names[p];
    const bool bias = name.ends_with(".b") && name.find(".conv") != std::string::npos;
    const bool per_channel_norm = static_cast<int64_t>(expected[p].size()) == Tiny().groups;
    if (!bias || !per_channel_norm) {
      scales.push_back(Norm(expected[p]));
      continue;
    }
    const std::string weight = name.substr(0, name.size() - 1) + "w";
    const auto at = std::find(names.begin(), names.end(), weight);
    ASSERT_NE(at, names.end()) << weight;
    const double weight_norm = Norm(expected[static_cast<size_t>(at - names.begin())]);
    EXPECT_LE(Norm(expected[p]), 1e-6 * weight_norm) << name << " is not zero";
    scales.push_back(weight_norm);
  }
  for (const TrainingPlan& plan : {Plan(2, 0), TensorPlan(1, 2, 0), TensorPlan(1, 4, 0),
                                   TensorPlan(2, 2, 1), TensorPlan(2, 2, 3)}) {
    const std::string what = plan.parallel.ToString();
    ExpectSameRun(plan);
    ASSERT_OK_AND_ASSIGN(auto trainer, Distributed(plan));
    ASSERT_OK_AND_ASSIGN(auto grads, FirstGradients(*trainer));
    ASSERT_EQ(grads.size(), expected.size());
    double worst = 0;
    std::string worst_name;
    for (size_t p = 0; p < grads.size(); ++p) {
      ASSERT_EQ(grads[p].size(), expected[p].size()) << names[p];
      double difference = 0;
      for (size_t i = 0; i < grads[p].size(); ++i) {
        const double d = static_cast<double>(grads[p][i]) - expected[p][i];
        difference += d * d;
      }
      const double relative = std::sqrt(difference) / std::max(scales[p], 1e-30);
      EXPECT_LE(relative, kTolerance) << what << " gradient of " << names[p];
      if (relative > worst) {
        worst = relative;
        worst_name = names[p];
      }
    }
    std::printf("[ %s ] first-step gradients: worst relative difference %.2e (%s)\n", what.c_str(),
                worst, worst_name.c_str());
  }
}

// What one member of an all-reduce of `bytes` over `members` sends: the host communicator's
// direct algorithm up to 64 KiB (to every other member), the ring's 2 (n - 1) / n above.
double AllReduceBytesSent(double bytes, int members) {
  if (members == 1) return 0;
  return bytes <= 64 * 1024 ? bytes * (members - 1) : 2.0 * (members - 1) / members * bytes;
}

// Each tensor rank's collectives and parameters in a step, against the split's count: per pair
// of conv blocks one all-reduce of its output [B, C, V^3] forward and one of each input's
// gradient backward (the volume has none), and the gradient norm's scalar; the split slots a
// 1/T slice, the rest whole.
TEST_F(UNet3dPlansTest, TensorRanksSendTheirAllReducesAndHoldTheirSlices) {
  const UNet3dConfig c = Tiny();  // depth 1: enc0 (V), bottleneck (V/2), dec0 (V, two inputs)
  const double v3 = static_cast<double>(c.volume * c.volume * c.volume), c0 = c.base_channels;
  const double c1 = 2.0 * c0;
  const double enc0 = 4.0 * kBatch * c0 * v3;               // enc0's output, and up0's
  const double bottleneck = 4.0 * kBatch * c1 * v3 / 8;     // its output at V/2
  const double bottleneck_in = 4.0 * kBatch * c0 * v3 / 8;  // down0's output
  // Parameters: conv1 (weights, bias, norm) and conv2's weights split; conv2's bias and norm,
  // up0 and the head whole.
  const auto pair = [](double in, double out) {
    return std::pair<double, double>{out * in * 27 + 3 * out + out * out * 27, 3 * out};
  };
  const std::pair<double, double> pairs[] = {pair(c.in_channels, c0), pair(c0, c1),
                                             pair(2 * c0, c0)};
  double split = 0, whole = c1 * c0 * 8 + c0 + c.classes * c0 + c.classes;  // up0, head
  for (const auto& [sliced, replicated] : pairs) {
    split += sliced;
    whole += replicated;
  }
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(c, CpuRegistry()));
  ASSERT_EQ(static_cast<int64_t>(split + whole), model.NumParameters());
  for (int ranks : {2, 4}) {
    ASSERT_OK_AND_ASSIGN(auto trainer, Distributed(TensorPlan(1, ranks, 0)));
    ASSERT_OK(trainer->InitializeParameters(2));
    ASSERT_OK_AND_ASSIGN(StepReport report, trainer->Step(Batch(0), 3e-3f));
    ASSERT_EQ(report.ranks.size(), static_cast<size_t>(ranks));
    const double expected_sent =
        AllReduceBytesSent(enc0, ranks) + AllReduceBytesSent(bottleneck, ranks) +
        AllReduceBytesSent(enc0, ranks) +                                                 // forward
        AllReduceBytesSent(bottleneck_in, ranks) + 2 * AllReduceBytesSent(enc0, ranks) +  // dx
        AllReduceBytesSent(4, ranks);  // gradient norm
    const double expected_params = 4.0 * (whole + split / ranks);
    ASSERT_OK_AND_ASSIGN(MemoryProfile profile, PredictMemory(trainer->step_graph().graph));
    for (const RankFigures& rank : report.ranks) {
      const auto sent = static_cast<double>(rank.figures.collective_bytes_sent);
      const auto params = static_cast<double>(rank.figures.peak(ObjectRole::kParameter));
      EXPECT_NEAR(sent, expected_sent, 0.01 * expected_sent) << "TP " << ranks;
      EXPECT_NEAR(params, expected_params, 0.05 * expected_params) << "TP " << ranks;
      // Activations: what the memory model predicts for the rank's worker.
      const ActivationPeaks peaks =
          ExpectActivationPeakAsPredicted(profile, rank, fmt::format("TP {}", ranks));
      std::printf(
          "[ U-Net TP %d rank %d ] collectives sent %.0f bytes (the split's count %.0f); "
          "parameters %.0f bytes (formula %.0f); activations peak %.0f bytes (predicted %.0f)\n",
          ranks, rank.rank, sent, expected_sent, params, expected_params, peaks.measured,
          peaks.predicted);
    }
  }
}

// Spatial parallelism (--spatial-parallel P): each volume's depth split into P slabs over P
// workers trains the one worker's run (losses within 1e-6 relative at every step), and what
// crosses between slabs is what the split says: per rank and step, the boundary planes of every
// convolution's input to each neighbour (forward) and their gradients back (backward), and each
// norm's statistics; measured as the bytes the rank sends beyond a data-parallel run's on as
// many workers (the same gradient reduction, one bucket each).
TrainingPlan SlabPlan(int slabs) {
  TrainingPlan plan = Plan(slabs, 0);
  plan.parallel.bucket_bytes = int64_t{64} << 20;  // one bucket: the same reduction in both runs
  if (slabs > 1) {
    plan.parallel.sequence_parallel = slabs;
    plan.parallel.sequence_attention = SequenceAttention::kHalo;
  }
  return plan;
}

// The halo bytes one rank sends a step by the split's theory: a 3x3x3 convolution reads one
// D-plane of its input from each neighbour, and sends each the gradient of the plane it read
// from it; `neighbours` is 1 at the ends, 2 between.
double HaloBytesInTheory(const UNet3dConfig& c, int neighbours) {
  double planes = 0;  // floats of one D-plane of every convolution's input, summed
  const auto plane = [&](int64_t channels, int64_t level) {
    const double extent = static_cast<double>(c.volume >> level);
    planes += static_cast<double>(kBatch * channels) * extent * extent;
  };
  for (int64_t i = 0; i < c.depth; ++i) {
    plane(i == 0 ? c.in_channels : c.Channels(i - 1), i);  // enc{i}.conv1 (after pooling)
    plane(c.Channels(i), i);                               // enc{i}.conv2
    plane(2 * c.Channels(i), i);                           // dec{i}.conv1: up{i} and the skip
    plane(c.Channels(i), i);                               // dec{i}.conv2
  }
  plane(c.Channels(c.depth - 1), c.depth);  // bottleneck.conv1
  plane(c.Channels(c.depth), c.depth);      // bottleneck.conv2
  return 2.0 * 4.0 * neighbours * planes;   // forward and backward, f32
}

// The largest relative difference of `run`'s losses from the one worker's; a failure past 1e-6.
double ExpectLossesWithin1e6(const TrainingRun& run, const TrainingRun& reference,
                             const std::string& label) {
  EXPECT_EQ(run.losses.size(), reference.losses.size()) << label;
  double worst = 0;
  for (size_t i = 0; i < run.losses.size() && i < reference.losses.size(); ++i) {
    const double relative =
        std::abs(run.losses[i] - reference.losses[i]) / std::abs(reference.losses[i]);
    worst = std::max(worst, relative);
    EXPECT_LE(relative, 1e-6) << label << " step " << i + 1 << ": " << run.losses[i] << " against "
                              << reference.losses[i];
  }
  return worst;
}

TEST_F(UNet3dPlansTest, SlabsOnTwoAndFourWorkersTrainTheOneWorkerRunPassingTheirHalos) {
  const UNet3dConfig c = Tiny();
  const int norms = 2 * (2 * static_cast<int>(c.depth) + 1);  // two per pair of conv blocks
  for (int slabs : {2, 4}) {
    const std::string label = fmt::format("{} slabs", slabs);
    ASSERT_OK_AND_ASSIGN(auto trainer, Distributed(SlabPlan(slabs)));
    EXPECT_EQ(trainer->planned_model().sequence_attention, SequenceAttention::kHalo);
    ASSERT_OK_AND_ASSIGN(TrainingRun run, Train(*trainer));
    RecordProperty(fmt::format("slabs{}_worst_relative_loss_difference", slabs),
                   fmt::format("{:.3g}", ExpectLossesWithin1e6(run, *reference_, label)));
    // Bytes: the same steps as data parallelism over as many workers, the difference per rank.
    TrainingPlan rows_plan = SlabPlan(1);
    rows_plan.parallel.data_parallel = slabs;
    ASSERT_OK_AND_ASSIGN(auto data_parallel, Distributed(rows_plan));
    ASSERT_OK_AND_ASSIGN(TrainingRun rows, Train(*data_parallel, 2));
    const StepReport& spatial = run.reports[1];
    const StepReport& reference = rows.reports[1];
    ASSERT_EQ(spatial.ranks.size(), static_cast<size_t>(slabs));
    ASSERT_EQ(reference.ranks.size(), static_cast<size_t>(slabs));
    // Each norm's statistics: the P - 1 blocks of [N, G, 4] f32 an all-to-all sends, forward
    // and back.
    const double statistics = 2.0 * norms * (slabs - 1) * kBatch * c.groups * 4 * 4;
    for (int r = 0; r < slabs; ++r) {
      const int neighbours = (r > 0 ? 1 : 0) + (r + 1 < slabs ? 1 : 0);
      const double halos = static_cast<double>(spatial.ranks[r].figures.collective_bytes_sent -
                                               reference.ranks[r].figures.collective_bytes_sent) -
                           statistics;
      const double theory = HaloBytesInTheory(c, neighbours);
      std::printf(
          "[ U-Net %d slabs rank %d ] halos sent %.0f bytes a step (theory %.0f, %+.3f%%)\n", slabs,
          r, halos, theory, 100 * (halos / theory - 1));
      EXPECT_NEAR(halos, theory, 0.01 * theory) << label << " rank " << r;
    }
  }
}

// Two row groups of two slabs under ZeRO-3.
TrainingPlan SlabRowsUnderZero3() {
  TrainingPlan plan = SlabPlan(2);
  plan.parallel.data_parallel = 4;
  plan.parallel.zero_stage = 3;
  return plan;
}

// Two slabs in each of two pipeline stages, two micro-batches.
TrainingPlan SlabsInPipelineStages() {
  TrainingPlan plan = SlabPlan(2);
  plan.parallel.pipeline_stages = 2;
  plan.parallel.micro_batches = 2;
  return plan;
}

// Slabs compose with the other placements: row groups under ZeRO-3 and pipeline stages train
// the one worker's run.
TEST_F(UNet3dPlansTest, SlabsWithZero3AndWithPipelineStagesTrainTheOneWorkerRun) {
  for (const TrainingPlan& plan : {SlabRowsUnderZero3(), SlabsInPipelineStages()}) {
    const std::string label = plan.parallel.ToString();
    ASSERT_OK_AND_ASSIGN(auto trainer, Distributed(plan));
    ASSERT_OK_AND_ASSIGN(TrainingRun run, Train(*trainer));
    ExpectLossesWithin1e6(run, *reference_, label);
  }
}

// The whole model's logits for `image` on one in-process executor (PlanLogits), with `trainer`'s
// parameters: the reference a placed prediction is checked against.
Result<std::vector<float>> WholeModelLogits(Trainer& trainer, const Tensor& image) {
  const ModelSpec& model = trainer.model();
  const int64_t rows = image.shape()[0];
  TESSERA_ASSIGN_OR_RETURN(ForwardGraph forward, PlanLogits(model, rows, 1, CpuRegistry()));
  ObjectMap inputs;
  inputs[forward.inputs[0]] = image;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    if (!forward.params[l].valid()) continue;
    TESSERA_ASSIGN_OR_RETURN(std::vector<float> group, trainer.ReadGroup(l, StateKind::kParameter));
    const int64_t numel = forward.graph.object(forward.params[l]).meta.numel();
    group.resize(static_cast<size_t>(numel));  // a ZeRO group's padding off
    inputs[forward.params[l]] = FloatTensor(Shape{numel}, group);
  }
  InProcessExecutor local(CpuRegistry(), ExecutorOptions{});
  TESSERA_ASSIGN_OR_RETURN(PreparedGraph prepared, local.Prepare(forward.graph));
  TESSERA_ASSIGN_OR_RETURN(RunResult run, local.Run(prepared, std::move(inputs)));
  return ToVector(run.outputs.at(forward.result));
}

// Evaluation and prediction run on the training step's own placement (PlanStepForward): in 2 and
// 4 slabs, in slabs under ZeRO-3 and in a pipeline of slabs, over tensor ranks. After three steps
// each plan's EvalLoss is the one worker's within 1e-6 relative, and is exactly the loss the
// next step reports for that batch; Predict of 5 rows (two chunks of the plan's batch of 4, the
// second padded) joins every rank's rows and slab into the whole model's logits (1e-5 of their
// largest). One worker's plan, last, too.
TEST_F(UNet3dPlansTest, EveryPlanEvaluatesAndPredictsOnItsOwnPlacement) {
  const UNet3dConfig c = Tiny();
  const int64_t v = c.volume;
  ASSERT_OK_AND_ASSIGN(VolumeBatch five, GenerateVolumes(5, v, c.in_channels, 77));
  const Tensor image = FloatTensor(Shape{5, c.in_channels, v, v, v}, five.volumes);
  ASSERT_OK_AND_ASSIGN(ModelSpec model, BuildUNet3d(Tiny(), CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(auto one, Trainer::Create(model, Plan(1, 0), ExecutorOptions{}));
  ASSERT_OK(Train(*one, 3).status());
  ASSERT_OK_AND_ASSIGN(const float expected_eval, one->EvalLoss(Batch(40)));
  for (const TrainingPlan& plan : {SlabPlan(2), SlabPlan(4), SlabRowsUnderZero3(),
                                   SlabsInPipelineStages(), TensorPlan(2, 2, 1), Plan(1, 0)}) {
    const std::string label = plan.parallel.ToString();
    ASSERT_OK_AND_ASSIGN(auto trainer, Distributed(plan));
    ASSERT_OK(Train(*trainer, 3).status());
    ASSERT_OK_AND_ASSIGN(const float eval, trainer->EvalLoss(Batch(40)));
    EXPECT_NEAR(eval, expected_eval, 1e-6 * expected_eval) << label;
    ASSERT_OK_AND_ASSIGN(std::vector<float> whole, WholeModelLogits(*trainer, image));
    ASSERT_OK_AND_ASSIGN(Tensor predicted, trainer->Predict({image, Tensor()}));
    EXPECT_EQ(predicted.shape(), (Shape{5, c.classes, v, v, v})) << label;
    const std::vector<float> placed = ToVector(predicted);
    ASSERT_EQ(placed.size(), whole.size()) << label;
    double largest = 0, worst = 0;
    for (size_t i = 0; i < whole.size(); ++i) {
      largest = std::max(largest, std::abs(static_cast<double>(whole[i])));
      worst = std::max(worst, std::abs(static_cast<double>(placed[i]) - whole[i]));
    }
    EXPECT_LE(worst, 1e-5 * largest) << label;
    // The evaluation is the step's forward: the next step's loss, to the bit.
    ASSERT_OK_AND_ASSIGN(const float before, trainer->EvalLoss(Batch(4)));
    ASSERT_OK_AND_ASSIGN(StepReport step, trainer->Step(Batch(4), 3e-3f));
    EXPECT_EQ(before, step.loss) << label;
  }
}

// Small state (every piece of this U-Net's is under the 16 KiB inline bound) is a step's output
// the worker keeps and the next step's input: the worker reads its own copy, so from the second
// step on its allocator peaks where the first step's did (a second copy of the state made from
// the bytes each step was 57,588 bytes beyond the plan a worker, which failed a plan predicted 40
// KB under its cap).
TEST_F(UNet3dPlansTest, AWorkerReadsItsSmallStateFromItsStoreEachStep) {
  ASSERT_OK_AND_ASSIGN(auto trainer, Distributed(SlabPlan(2)));
  ASSERT_OK_AND_ASSIGN(TrainingRun run, Train(*trainer, 4));
  ASSERT_EQ(run.reports.size(), 4u);
  for (size_t r = 0; r < 2; ++r) {
    const int64_t first = run.reports[0].ranks.at(r).figures.allocator_peak;
    std::printf("[ rank %zu ] allocator peak %lld bytes at step 1, %lld at step 4\n", r,
                static_cast<long long>(first),
                static_cast<long long>(run.reports.back().ranks.at(r).figures.allocator_peak));
    for (size_t s = 1; s < run.reports.size(); ++s) {
      EXPECT_LE(run.reports[s].ranks.at(r).figures.allocator_peak, first)
          << "rank " << r << " step " << s + 1;
    }
  }
}

// The split into slabs: every parameter whole once, the inputs split along the depth, halos and
// statistics exchanged as the layouts say; slab counts the levels cannot halve evenly, and a
// model that cannot split, refused naming the fix.
TEST(UNet3dSlabsTest, EveryParameterOnceInputsSplitAlongTheDepthBadCountsRefused) {
  for (const char* preset : {"tiny", "small", "nnunet"}) {
    ASSERT_OK_AND_ASSIGN(UNet3dConfig config, UNet3dConfig::Preset(preset));
    ASSERT_OK_AND_ASSIGN(ModelSpec whole, BuildUNet3d(config, CpuRegistry()));
    ASSERT_OK_AND_ASSIGN(ModelSpec slabs,
                         whole.SplitForSequenceParallel(2, SequenceAttention::kHalo));
    EXPECT_EQ(slabs.sequence_parallel, 2);
    EXPECT_EQ(slabs.NumParameters(), whole.NumParameters()) << preset;
    EXPECT_EQ(slabs.inputs[0].split_axis, 2);
    EXPECT_EQ(slabs.inputs[1].split_axis, 1);
    EXPECT_EQ(slabs.inputs[0].shape[2], config.volume / 2);
    int halos = 0, statistics = 0;
    for (const LayerSpec& layer : slabs.layers) {
      for (ExchangeLayout layout : layer.exchanged_outputs) {
        halos += PassesHalo(layout) ? 1 : 0;
        statistics += layout == ExchangeLayout::kBlocks ? 1 : 0;
      }
    }
    // The statistics of every norm (one a convolution); two planes of every convolution's
    // input, a decoder's first reading two (its up-convolution's and the skip), and under
    // pooling each encoder level's output passed twice (the skip, and pooled for the next level).
    const int depth = static_cast<int>(config.depth);
    const int convolutions = 2 * (2 * depth + 1);
    const bool pooled = config.downsample == UNetDownsample::kMaxPool;
    EXPECT_EQ(statistics, convolutions) << preset;
    EXPECT_EQ(halos, 2 * (convolutions + (pooled ? depth : 0))) << preset;
  }
  ASSERT_OK_AND_ASSIGN(ModelSpec tiny, BuildUNet3d(Tiny(), CpuRegistry()));
  Result<ModelSpec> refused = tiny.SplitForSequenceParallel(8, SequenceAttention::kHalo);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("--spatial-parallel must divide"), std::string::npos)
      << refused.status().ToString();
  refused = tiny.SplitForSequenceParallel(2, SequenceAttention::kUlysses);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("cannot run sequence parallel"), std::string::npos)
      << refused.status().ToString();
}

TEST_F(UNet3dPlansTest, ATensorParallelCheckpointResumesAtAnyDegree) {
  const std::string dir = TempPath("unet3d_tp_checkpoint");
  std::filesystem::remove_all(dir);
  ASSERT_OK_AND_ASSIGN(auto writer, Distributed(TensorPlan(2, 2, 1)));
  ASSERT_OK(writer->InitializeParameters(2));
  for (int step = 0; step < 3; ++step) ASSERT_OK(writer->Step(Batch(step), 3e-3f).status());
  ASSERT_OK_AND_ASSIGN(std::string saved, SaveCheckpoint(*writer, dir, ""));
  ASSERT_OK_AND_ASSIGN(StepReport next, writer->Step(Batch(3), 3e-3f));
  writer.reset();
  for (int tensor : {4, 1}) {
    ASSERT_OK_AND_ASSIGN(auto reader, Distributed(TensorPlan(1, tensor, 0)));
    ASSERT_OK(LoadCheckpoint(*reader, saved).status());
    EXPECT_EQ(reader->steps_taken(), 3);
    ASSERT_OK_AND_ASSIGN(StepReport resumed, reader->Step(Batch(3), 3e-3f));
    EXPECT_NEAR(resumed.loss, next.loss, 1e-5 * next.loss) << "TP " << tensor;
  }
  std::filesystem::remove_all(dir);
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

// The summary's final_loss (6 decimals), or -1 when the output has none.
double FinalLoss(const std::string& output) {
  std::smatch match;
  if (!std::regex_search(output, match, std::regex(R"(final_loss=([0-9.]+))"))) return -1.0;
  return std::stod(match[1]);
}

TEST(TrainUNet3dTest, TheLossFallsAndDiceRisesOver200Steps) {
  ProcessResult run = RunBinary("train_unet3d", "--steps 200 --log-every 50 --threads 1");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const Logged logged = ParseLog(run.output);
  ASSERT_EQ(logged.losses.size(), 5u) << run.output;  // steps 1, 50, 100, 150, 200
  EXPECT_LT(logged.losses.back(), 0.5f * logged.losses.front()) << run.output;
  EXPECT_GT(logged.held_out_dice, logged.dice.front() + 0.15f) << run.output;
}

// The final loss of `train_unet3d --steps 8 --threads 1` in one process (run once a test binary).
double OneProcessFinalLoss() {
  static const double loss = [] {
    ProcessResult alone = RunBinary("train_unet3d", "--steps 8 --threads 1");
    EXPECT_EQ(alone.exit_code, 0) << alone.output;
    return FinalLoss(alone.output);
  }();
  return loss;
}

// `run` (train_unet3d's 8 steps, split some way) succeeded and ended with the one process's final
// loss, within `tolerance` relative.
void ExpectOneProcessFinalLoss(const ProcessResult& run, double tolerance) {
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const double expected = OneProcessFinalLoss();
  ASSERT_GT(expected, 0);
  EXPECT_NEAR(FinalLoss(run.output), expected, tolerance * expected) << run.output;
}

// `train_unet3d` with `flags` refused, its output holding `message`.
void ExpectRefused(const std::string& flags, const std::string& message) {
  ProcessResult refused = RunBinary("train_unet3d", flags);
  EXPECT_NE(refused.exit_code, 0) << flags;
  EXPECT_NE(refused.output.find(message), std::string::npos) << refused.output;
}

// train_unet3d --tensor-parallel 2 on two workers trains the run of one process, prints each
// layer's split, and refuses a degree the group norm's groups do not divide, naming the fix.
TEST(TrainUNet3dTest, TensorParallelWorkersTrainLikeOneProcess) {
  ProcessResult split =
      RunBinary("train_unet3d", "--steps 8 --threads 1 --workers 2 --tensor-parallel 2");
  ExpectOneProcessFinalLoss(split, 1e-5);
  EXPECT_NE(split.output.find("each layer over 2 tensor ranks"), std::string::npos) << split.output;
  EXPECT_NE(split.output.find("enc0.convs: enc0.conv1.w rows split"), std::string::npos)
      << split.output;
  EXPECT_NE(split.output.find("dec0.convs"), std::string::npos) << split.output;
  // --plan auto with the degree given: one rank of the split calibrated, a D1 x T2 plan chosen,
  // the same losses (a cache of its own, so the run measures).
  const std::string cache = TempPath("unet3d_auto_tensor");
  std::filesystem::remove_all(cache);
  BoundedRun searched = RunBinaryWithin(
      "train_unet3d", "--steps 8 --threads 1 --workers 2 --tensor-parallel 2 --plan auto",
      std::chrono::minutes(3), "TESSERA_CACHE_DIR=" + cache);
  std::filesystem::remove_all(cache);
  ExpectOneProcessFinalLoss(ProcessResult{searched.exit_code, searched.output}, 1e-5);
  EXPECT_NE(searched.output.find("layers of one of 2 tensor ranks"), std::string::npos)
      << searched.output;
  EXPECT_NE(searched.output.find("--plan auto chose D1 x T2 x P1"), std::string::npos)
      << searched.output;
  ExpectRefused("--steps 1 --threads 1 --workers 3 --tensor-parallel 3",
                "4 group-norm groups do not split over 3 tensor-parallel ranks");
}

// train_unet3d --spatial-parallel 2 on two workers trains the run of one process and says how the
// volumes split; slab counts the workers or the volume cannot take are refused naming the fix;
// a volume only slabs fit under a cap trains and evaluates in them.
TEST(TrainUNet3dTest, SlabWorkersTrainLikeOneProcessAndBadCountsAreRefused) {
  ProcessResult slabs =
      RunBinary("train_unet3d", "--steps 8 --threads 1 --workers 2 --spatial-parallel 2");
  ExpectOneProcessFinalLoss(slabs, 1e-6);
  EXPECT_NE(slabs.output.find("spatial parallel: each volume in 2 slabs of its depth"),
            std::string::npos)
      << slabs.output;
  // --plan auto with the slabs given: one slab's layers calibrated, the slabs probed on the
  // workers for what their halos and statistics wait, a D1 x S2 plan chosen, the same losses (a
  // cache of its own, so the run measures).
  const std::string cache = TempPath("unet3d_auto_slabs");
  std::filesystem::remove_all(cache);
  BoundedRun searched = RunBinaryWithin(
      "train_unet3d", "--steps 8 --threads 1 --workers 2 --spatial-parallel 2 --plan auto",
      std::chrono::minutes(3), "TESSERA_CACHE_DIR=" + cache);
  std::filesystem::remove_all(cache);
  ExpectOneProcessFinalLoss(ProcessResult{searched.exit_code, searched.output}, 1e-5);
  EXPECT_NE(searched.output.find("layers of one of 2 slabs"), std::string::npos) << searched.output;
  EXPECT_NE(searched.output.find("1 volume(s) in 2 slabs at once, "), std::string::npos)
      << searched.output;
  EXPECT_NE(searched.output.find("--plan auto chose D1 x S2 x P1"), std::string::npos)
      << searched.output;
  ExpectRefused("--steps 1 --threads 1 --workers 3 --spatial-parallel 2",
                "use --workers 2 (or a multiple of 2)");
  // A volume no worker fits under the cap (the planner refuses one worker at 48^3 under 24.6 MiB,
  // needing 29.3) trains in four slabs, and its Dice and held-out evaluation run in the slabs
  // too: the one process's (uncapped) figures, to the digits printed.
  const std::string volume = "--preset tiny --volume 48 --batch 1 --steps 3 --log-every 1";
  ExpectRefused(volume + " --workers 1 --host-memory-gib 0.024",
                "--host-memory-gib needs to be at least");
  ProcessResult capped = RunBinary(
      "train_unet3d", volume + " --workers 4 --spatial-parallel 4 --host-memory-gib 0.024");
  ProcessResult alone = RunBinary("train_unet3d", volume + " --threads 1");
  ASSERT_EQ(capped.exit_code, 0) << capped.output;
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  const Logged in_slabs = ParseLog(capped.output), whole = ParseLog(alone.output);
  ASSERT_EQ(in_slabs.dice.size(), 3u) << capped.output;
  EXPECT_EQ(in_slabs.dice, whole.dice) << capped.output << alone.output;
  EXPECT_GE(in_slabs.held_out_dice, 0) << capped.output;
  EXPECT_EQ(in_slabs.held_out_dice, whole.held_out_dice) << capped.output << alone.output;
  const std::regex held_out_loss(R"(held-out: loss ([0-9.]+))");
  std::smatch a, b;
  ASSERT_TRUE(std::regex_search(capped.output, a, held_out_loss)) << capped.output;
  ASSERT_TRUE(std::regex_search(alone.output, b, held_out_loss)) << alone.output;
  EXPECT_EQ(a[1], b[1]);
  // The tiny preset's volume 8 halves once: 8 / 2 = 4 planes split into 2 or 4 slabs, not 3.
  ExpectRefused("--steps 1 --threads 1 --workers 3 --spatial-parallel 3",
                "--spatial-parallel must divide");
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

// --device cuda on the simulated GPU (scrambled device memory; its kernels the CPU's, run on host
// copies, except the layer programs, which run natively on the device as on a real GPU): in this
// process and on two GPU worker processes under ZeRO-2, the U-Net trains the CPU run's losses.
TEST(TrainUNet3dTest, OnAGpuInProcessAndOnGpuWorkersItTrainsTheCpuLosses) {
  ProcessResult cpu = RunBinary("train_unet3d", "--steps 6 --threads 1");
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  const double expected = FinalLoss(cpu.output);
  ASSERT_GT(expected, 0) << cpu.output;
  for (const std::string flags : {"--device cuda", "--device cuda --workers 2 --zero-stage 2"}) {
    SCOPED_TRACE(flags);
    BoundedRun gpu = RunBinaryWithin("train_unet3d", "--steps 6 --threads 1 " + flags,
                                     std::chrono::minutes(2), "TESSERA_SIMULATED_GPU=1");
    ASSERT_EQ(gpu.exit_code, 0) << gpu.output;
    EXPECT_NEAR(FinalLoss(gpu.output), expected, 1e-6 * expected) << gpu.output;
  }
  EXPECT_NE(RunBinaryWithin("train_unet3d", "--steps 1 --device cuda", std::chrono::minutes(1),
                            "TESSERA_SIMULATED_GPU=1")
                .output.find("gpu_peak_mb="),
            std::string::npos);
}

// bf16 activations on the simulated GPU (--activations bf16: what a real GPU trains in by
// default; the simulated GPU's own default is f32): its layer programs on bf16 device objects
// train the CPU's bf16 losses, in this process exactly (the same kernels), and on two GPU worker
// processes under ZeRO-2 and as two pipeline stages (bf16 activations pushed between them)
// within 1e-3 (sums in another order, micro-batches, move a bf16 rounding now and then).
TEST(TrainUNet3dTest, OnTheSimulatedGpuBf16ActivationsTrainTheCpusBf16Losses) {
  ProcessResult cpu = RunBinary("train_unet3d", "--steps 6 --threads 1 --activations bf16");
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  EXPECT_NE(cpu.output.find("bf16 activations"), std::string::npos) << cpu.output;
  const double expected = FinalLoss(cpu.output);
  ASSERT_GT(expected, 0) << cpu.output;
  for (const auto& [flags, tolerance] :
       {std::pair{"--device cuda", 1e-6},
        std::pair{"--device cuda --workers 2 --zero-stage 2", 1e-3},
        std::pair{"--device cuda --workers 2 --pipeline-stages 2 --micro-batches 2", 1e-3}}) {
    SCOPED_TRACE(flags);
    BoundedRun gpu = RunBinaryWithin(
        "train_unet3d", std::string("--steps 6 --threads 1 --activations bf16 ") + flags,
        std::chrono::minutes(2), "TESSERA_SIMULATED_GPU=1");
    ASSERT_EQ(gpu.exit_code, 0) << gpu.output;
    EXPECT_NE(gpu.output.find("bf16 activations"), std::string::npos) << gpu.output;
    EXPECT_NEAR(FinalLoss(gpu.output), expected, tolerance * expected) << gpu.output;
  }
}

// The nnU-Net-shaped preset (31.2 M parameters: six stages of 32-320 channels, instance norm,
// leaky ReLU, strided convolutions) at a 32^3 patch on the CPU: it trains (the loss falls over
// three steps), and a patch its five halvings do not divide is refused naming the fix.
TEST(TrainUNet3dTest, TheNnUNetPresetTrainsAtASmallPatch) {
  ProcessResult run = RunBinary(
      "train_unet3d", "--preset nnunet --volume 32 --steps 3 --batch 1 --log-every 1 --threads 2");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("max_channels=320 norm=instance activation=leaky_relu "
                            "downsample=strided_conv: 31194083 parameters, volumes 32^3"),
            std::string::npos)
      << run.output;
  const Logged logged = ParseLog(run.output);
  ASSERT_EQ(logged.losses.size(), 3u) << run.output;
  EXPECT_LT(logged.losses[2], logged.losses[0]) << run.output;
  ProcessResult refused = RunBinary("train_unet3d", "--preset nnunet --volume 48 --steps 1");
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("--preset nnunet --volume 48: unet3d: volume (48) must be "
                                "divisible by 2^depth = 32"),
            std::string::npos)
      << refused.output;
}

// --deep-supervision on the nnU-Net preset: heads on decoder levels 1-3 (classes x (64, 128, 256)
// weights + biases: 1,353 parameters more), the loss their weighted sum; two data-parallel workers
// train the run of one process, and a U-Net too shallow for it is refused with the reason.
TEST(TrainUNet3dTest, DeepSupervisionTrainsOnWorkersLikeOneProcess) {
  const std::string run =
      "--preset nnunet --volume 32 --steps 2 --batch 2 --log-every 1 "
      "--threads 1 --deep-supervision";
  ProcessResult alone = RunBinary("train_unet3d", run);
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  EXPECT_NE(alone.output.find("downsample=strided_conv deep_supervision: 31195436 parameters"),
            std::string::npos)
      << alone.output;
  ProcessResult workers = RunBinary("train_unet3d", run + " --workers 2");
  ASSERT_EQ(workers.exit_code, 0) << workers.output;
  const double expected = FinalLoss(alone.output);
  ASSERT_GT(expected, 0) << alone.output;
  EXPECT_NEAR(FinalLoss(workers.output), expected, 1e-5 * expected) << workers.output;
  ProcessResult shallow = RunBinary("train_unet3d", "--preset small --deep-supervision --steps 1");
  EXPECT_NE(shallow.exit_code, 0) << shallow.output;
  EXPECT_NE(shallow.output.find("--preset small: unet3d: deep supervision needs depth >= 3, got 2"),
            std::string::npos)
      << shallow.output;
}

// NIfTI volumes on disk: generated 16^3 cases written in nnU-Net's layout, the tiny U-Net trained
// on 8^3 crops of them with flips. The loss falls and the held-out case's Dice rises; every batch
// after the first was made while the previous step ran; a resumed run continues the
// uninterrupted one (crops depend on the step only); bad datasets are named.
TEST(TrainUNet3dTest, NiftiVolumesTrainResumeAndAreChecked) {
  const std::string data = TempPath("unet3d_nifti");
  const std::string ckpt = TempPath("unet3d_nifti_ckpt");
  std::filesystem::remove_all(data);
  std::filesystem::remove_all(ckpt);
  ProcessResult written =
      RunBinary("train_unet3d", "--preset small --write-volumes " + data + " --cases 6");
  ASSERT_EQ(written.exit_code, 0) << written.output;
  EXPECT_TRUE(std::filesystem::exists(data + "/imagesTr/case_005_0000.nii.gz"));
  EXPECT_TRUE(std::filesystem::exists(data + "/labelsTr/case_005.nii.gz"));

  const std::string predicted = TempPath("unet3d_nifti_predicted");
  ProcessResult run = RunBinary("train_unet3d", "--data " + data +
                                                    " --steps 200 --log-every 50 --threads 1 "
                                                    "--predict --predict-out " +
                                                    predicted);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("data: 6 cases from " + data), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("held out: case_005"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("data: 199 of 200 batches made ahead of their steps"),
            std::string::npos)
      << run.output;
  const Logged logged = ParseLog(run.output);
  ASSERT_EQ(logged.losses.size(), 5u) << run.output;
  EXPECT_LT(logged.losses.back(), 0.6f * logged.losses.front()) << run.output;
  EXPECT_GT(logged.held_out_dice, logged.dice.front() + 0.1f) << run.output;
  // The held-out case segmented whole: 27 patches of 8^3 (x, y, z at 0, 4, 8), its label map
  // written on the case's grid, and its Dice for the spheres better than the first steps'.
  std::smatch whole_dice;
  ASSERT_TRUE(std::regex_search(
      run.output, whole_dice,
      std::regex(R"(predict case_005: 16 x 16 x 16 voxels in 27 patches of 8\^3; dice per class )"
                 R"(1=([0-9.]+) 2=([0-9.]+|n/a); mean [0-9.]+)")))
      << run.output;
  EXPECT_GT(std::stof(whole_dice[1]), logged.dice.front()) << run.output;
  ASSERT_OK_AND_ASSIGN(NiftiVolume map, ReadNifti(predicted + "/case_005.nii.gz"));
  EXPECT_EQ(map.width * map.height * map.depth, 16 * 16 * 16);
  EXPECT_EQ(map.stored, NiftiType::kUint8);
  EXPECT_TRUE(std::all_of(map.voxels.begin(), map.voxels.end(), [](float v) { return v < 3; }));
  std::filesystem::remove_all(predicted);

  ProcessResult whole = RunBinary("train_unet3d", "--data " + data + " --steps 10 --threads 1");
  ProcessResult first = RunBinary(
      "train_unet3d", "--data " + data + " --steps 5 --threads 1 --checkpoint-dir " + ckpt);
  ProcessResult rest =
      RunBinary("train_unet3d",
                "--data " + data + " --steps 10 --threads 1 --resume --checkpoint-dir " + ckpt);
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  const Logged expected = ParseLog(whole.output), resumed = ParseLog(rest.output);
  ASSERT_EQ(expected.losses.size(), 10u) << whole.output;
  ASSERT_EQ(resumed.losses.size(), 5u) << rest.output;
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(resumed.losses[i], expected.losses[5 + i]) << i;

  ProcessResult nowhere = RunBinary("train_unet3d", "--data " + data + "/nowhere --steps 1");
  EXPECT_NE(nowhere.exit_code, 0);
  EXPECT_NE(nowhere.output.find("is not a volume dataset"), std::string::npos) << nowhere.output;
  ProcessResult channels =
      RunBinary("train_unet3d", "--data " + data + " --preset tiny --steps 1 --threads 1");
  ASSERT_EQ(channels.exit_code, 0) << channels.output;  // tiny and small read 1 channel
  std::filesystem::remove(data + "/labelsTr/case_003.nii.gz");
  std::filesystem::copy_file(data + "/imagesTr/case_003_0000.nii.gz",
                             data + "/labelsTr/case_003.nii.gz");  // intensities as labels
  ProcessResult labels = RunBinary("train_unet3d", "--data " + data + " --steps 1");
  EXPECT_NE(labels.exit_code, 0);
  EXPECT_NE(labels.output.find("label map " + data + "/labelsTr/case_003.nii.gz has the value"),
            std::string::npos)
      << labels.output;
  ProcessResult both =
      RunBinary("train_unet3d", "--data " + data + " --write-volumes " + data + "2");
  EXPECT_NE(both.exit_code, 0);
  std::filesystem::remove_all(data);
  std::filesystem::remove_all(ckpt);
}

}  // namespace
}  // namespace tessera::testing

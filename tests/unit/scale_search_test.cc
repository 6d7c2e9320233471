// The plan search at scale (planner/scale_search.h) against its references: the parameter and
// FLOP counts of Megatron-LM's paper (Narayanan et al. 2021, eq. 2 and 3) and the released
// sizes, the model-state memory of the ZeRO paper (Rajbhandari et al. 2020, figure 1), the
// activation memory of Korthikanti et al. 2022; the per-chunk schedule simulation against the
// uniform one; the search's order, its memory prune and refusals, and that its choice follows
// the links. Beside the published plans: bench_plan_at_scale.
#include "planner/scale_search.h"

#include <cmath>
#include <cstdio>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "launcher/described_cluster.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

DescribedCluster A100s(int nodes) {
  DescribedCluster cluster;
  cluster.name = "a100";
  cluster.nodes = nodes;
  return cluster;  // the defaults describe DGX A100 80GB nodes
}

TransformerShape Megatron7B() {
  TransformerShape shape;
  shape.name = "megatron-7.5b";
  shape.layers = 36, shape.hidden = 4096, shape.heads = 32, shape.vocab = 51200;
  shape.seq_len = 2048;
  return shape;
}

TEST(ScaleSearchTest, ParametersMatchMegatronsCountAndTheReleasedSizes) {
  for (const char* name : {"gpt3-175b", "megatron-76b", "gpt2-1.5b"}) {
    SCOPED_TRACE(name);
    const TransformerShape shape = *TransformerShape::Preset(name);
    const int64_t l = shape.layers, h = shape.hidden, v = shape.vocab, s = shape.seq_len;
    // Megatron-LM's eq. 2, 12 l h^2 (1 + 13 / 12h + (V + s) / 12 l h), and the final norm.
    EXPECT_EQ(shape.Parameters(), 12 * l * h * h + 13 * l * h + (v + s) * h + 2 * h);
  }
  // As published: 174.6B (Narayanan et al. Table 2), 76.1B (Table 1), Llama 2 70B's checkpoint.
  EXPECT_NEAR(TransformerShape::Preset("gpt3-175b")->Parameters() / 1e9, 174.6, 0.05);
  EXPECT_NEAR(TransformerShape::Preset("megatron-76b")->Parameters() / 1e9, 76.1, 0.05);
  EXPECT_EQ(TransformerShape::Preset("llama2-70b")->Parameters(), 68976648192);
  EXPECT_EQ(TransformerShape::Preset("nope").status().code(), StatusCode::kNotFound);
}

TEST(ScaleSearchTest, FlopsMatchMegatronsCountLessTheRecompute) {
  const TransformerShape shape = *TransformerShape::Preset("gpt3-175b");
  const double s = 2048, h = 12288;
  // A layer's forward: 24 s h^2 + 4 s^2 h (Megatron-LM, section 5.1).
  EXPECT_DOUBLE_EQ(shape.LayerForwardFlops(), 24 * s * h * h + 4 * s * s * h);
  // Eq. 3 counts every layer's forward once more (recompute); the model's own count does not.
  const double megatron = MegatronStepFlops(shape, 1536), model = ModelStepFlops(shape, 1536);
  EXPECT_NEAR(megatron - model, 1536.0 * 96 * shape.LayerForwardFlops(), 1e-9 * megatron);
}

TEST(ScaleSearchTest, ActivationsMatchKorthikanti) {
  const TransformerShape shape = *TransformerShape::Preset("gpt3-175b");
  const double s = 2048, h = 12288, a = 96;
  // s b h (34 + 5 a s / h) bytes per layer, b = 1: no tensor or sequence parallelism.
  EXPECT_DOUBLE_EQ(shape.LayerActivationBytes(), s * h * 34 + 5 * a * s * s);
  // Llama 2 70B with flash attention: input, Q, K and V (8 of 64 heads), projection input; the
  // log-sum-exp; the MLP's input, gate, up and product; the norms' inputs.
  const TransformerShape llama = *TransformerShape::Preset("llama2-70b");
  const double ls = 4096, lh = 8192, kv = 1024, f = 28672;
  EXPECT_DOUBLE_EQ(llama.LayerActivationBytes(), 2 * ls * lh * 3 + 4 * ls * kv + 4 * 64 * ls +
                                                     2 * ls * lh + 6 * ls * f + 4 * ls * lh);
}

// Tensor slicing: Korthikanti et al.'s s b h (10 + 24/t + 5 a s / (h t)) activations per layer,
// the split and replicated parameters, and a plan's model state and compute shrinking with t.
TEST(ScaleSearchTest, TensorSlicingMatchesMegatronsCounts) {
  const TransformerShape shape = *TransformerShape::Preset("gpt3-175b");
  const double s = 2048, h = 12288, a = 96;
  for (int t : {1, 2, 4, 8}) {
    EXPECT_DOUBLE_EQ(shape.LayerActivationBytes(t), s * h * (10 + 24.0 / t + 5 * a * s / (h * t)))
        << t;
  }
  // Megatron-LM: 12 h^2 + 13 h per layer, of which the norms (4 h) and the two row-parallel
  // biases (2 h) stay whole on every rank.
  EXPECT_EQ(shape.LayerReplicatedParameters(), 6 * 12288);
  EXPECT_EQ(shape.LayerSplitParameters() + shape.LayerReplicatedParameters(),
            shape.LayerParameters());
  EXPECT_TRUE(shape.SplitsOver(8));
  const TransformerShape gpt2 = *TransformerShape::Preset("gpt2-1.5b");  // 25 heads
  EXPECT_FALSE(gpt2.SplitsOver(2));

  DescribedCluster roomy = A100s(48);
  roomy.gpu_memory_gib = 1e6;
  ScaleTraining training;
  training.global_batch = 1536;
  double previous_state = 0, previous_ms = 0;
  for (int t : {1, 2, 4, 8}) {
    SCOPED_TRACE(t);
    PlanChoice choice;
    choice.data_parallel = 4;
    choice.tensor_parallel = t;
    choice.pipeline_stages = 12;
    choice.micro_batches = 384;
    training.vocab_parallel = true;
    const Result<ScalePlan> plan =
        EvaluateScalePlan(roomy, shape, training, choice, 1, RankLayout::kStagesInNode);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    // ZeRO-0: 16 bytes per parameter a rank holds; its layers' and the embedding's share 1/t.
    const double stage_layers = 8;
    const double expected_params =
        stage_layers * (static_cast<double>(shape.LayerSplitParameters()) / t +
                        static_cast<double>(shape.LayerReplicatedParameters())) +
        static_cast<double>(shape.EmbeddingParameters()) / t;
    EXPECT_NEAR(plan->costs.model_state_gib * (1 << 30), 16 * expected_params,
                1e-9 * 16 * expected_params);
    if (t > 1) {
      EXPECT_LT(plan->costs.model_state_gib, previous_state);
      EXPECT_LT(plan->step_ms, previous_ms);  // on NVLink the compute shrinks faster
    }
    previous_state = plan->costs.model_state_gib;
    previous_ms = plan->step_ms;
    EXPECT_EQ(plan->choice.Flags().find("--tensor-parallel") != std::string::npos, t > 1);
    // A vocabulary T does not divide keeps the embedding whole on every rank (the runtime's
    // rule, model/gpt2.cc), as does vocab_parallel = false.
    if (t > 1) {
      TransformerShape odd = shape;
      odd.vocab = shape.vocab + 1;
      ScaleTraining whole = training;
      whole.vocab_parallel = false;
      for (const auto& [model, priced] : {std::pair{odd, training}, std::pair{shape, whole}}) {
        const Result<ScalePlan> replicated =
            EvaluateScalePlan(roomy, model, priced, choice, 1, RankLayout::kStagesInNode);
        ASSERT_TRUE(replicated.ok()) << replicated.status().message();
        const double held =
            stage_layers * (static_cast<double>(model.LayerSplitParameters()) / t +
                            static_cast<double>(model.LayerReplicatedParameters())) +
            static_cast<double>(model.EmbeddingParameters());
        EXPECT_NEAR(replicated->costs.model_state_gib * (1 << 30), 16 * held, 1e-9 * 16 * held);
      }
    }
  }
  // A degree the heads do not divide is refused, naming them.
  PlanChoice bad;
  bad.tensor_parallel = 2;
  bad.data_parallel = 4;
  bad.micro_batches = 128;
  training.global_batch = 512;
  const Result<ScalePlan> refused =
      EvaluateScalePlan(roomy, gpt2, training, bad, 1, RankLayout::kStagesInNode);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("25 heads"), std::string::npos)
      << refused.status().message();
}

// Megatron-LM's sequence parallelism: Korthikanti et al.'s s b h (34 + 5 a s / h) / t activations
// per layer (section 4.2.2); a plan sharding the sequence holds less and is no slower than the
// same plan without (the same collectives' ring time, 1/t of the element-wise work); it is
// planned only where the runtime runs it, and the search offers it.
TEST(ScaleSearchTest, SequenceParallelismMatchesKorthikanti) {
  const TransformerShape shape = *TransformerShape::Preset("gpt3-175b");
  const double s = 2048, h = 12288, a = 96;
  for (int t : {2, 4, 8}) {
    EXPECT_DOUBLE_EQ(shape.LayerActivationBytes(t, /*sequence_sharded=*/true),
                     s * h * (34 + 5 * a * s / h) / t)
        << t;
    EXPECT_LT(shape.LayerForwardTrafficBytes(t, true), shape.LayerForwardTrafficBytes(t));
  }
  DescribedCluster cluster = A100s(48);
  ScaleTraining training;
  training.global_batch = 1536;
  PlanChoice choice;
  choice.data_parallel = 4;
  choice.tensor_parallel = 8;
  choice.pipeline_stages = 12;
  choice.micro_batches = 384;
  choice.zero_stage = 1;
  ASSERT_OK_AND_ASSIGN(ScalePlan plain, EvaluateScalePlan(cluster, shape, training, choice, 1,
                                                          RankLayout::kStagesInNode));
  choice.shard_sequence = true;
  ASSERT_OK_AND_ASSIGN(ScalePlan sharded, EvaluateScalePlan(cluster, shape, training, choice, 1,
                                                            RankLayout::kStagesInNode));
  EXPECT_LT(sharded.costs.activation_gib, plain.costs.activation_gib);
  EXPECT_LE(sharded.recomputed_layers, plain.recomputed_layers);
  EXPECT_LT(sharded.step_ms, plain.step_ms);
  EXPECT_THAT(sharded.Name(), HasSubstr("T8 SP"));
  EXPECT_THAT(sharded.choice.Flags(), HasSubstr("--sequence-parallel megatron"));
  std::printf(
      "175B D4 x T8 x P12 b1 on 384 A100s: %.2f s, %.1f GiB activations, %d of %d layers "
      "recomputed; sharding the sequence: %.2f s, %.1f GiB, %d\n",
      plain.step_ms / 1e3, plain.costs.activation_gib, plain.recomputed_layers,
      plain.layers_per_stage, sharded.step_ms / 1e3, sharded.costs.activation_gib,
      sharded.recomputed_layers);
  // Where the runtime does not run it: one tensor rank, or a vocabulary T does not divide.
  TransformerShape odd = shape;
  odd.vocab = shape.vocab + 1;
  const Result<ScalePlan> refused =
      EvaluateScalePlan(cluster, odd, training, choice, 1, RankLayout::kStagesInNode);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("divide the vocabulary (51201)"));
  // The search offers both and ranks them by time.
  ScaleSpace space;
  space.gpus = {384};
  ASSERT_OK_AND_ASSIGN(auto results, SearchAtScale(cluster, shape, training, space));
  int sharding = 0, not_sharding = 0;
  for (const ScalePlan& plan : results.front().ranked) {
    if (plan.choice.tensor_parallel == 1) continue;
    ++(plan.choice.shard_sequence ? sharding : not_sharding);
  }
  EXPECT_GT(sharding, 0);
  EXPECT_GT(not_sharding, 0);
  EXPECT_TRUE(results.front().ranked.front().choice.shard_sequence)
      << results.front().ranked.front().Name();
  space.shard_sequence = {false};
  ASSERT_OK_AND_ASSIGN(auto without, SearchAtScale(cluster, shape, training, space));
  for (const ScalePlan& plan : without.front().ranked) EXPECT_FALSE(plan.choice.shard_sequence);
  EXPECT_GE(without.front().ranked.front().step_ms, results.front().ranked.front().step_ms);
}

TEST(ScaleSearchTest, ModelStatesMatchTheZeroPaper) {
  // Figure 1 of the ZeRO paper: 7.5B parameters, 64 ranks, K = 12: 120, 31.4, 16.6 and 1.9 GB
  // per GPU for the baseline and ZeRO-1, 2, 3 (mixed-precision Adam: 2 + 2 + 12 bytes).
  const double psi = 7.5e9, nd = 64;
  const double paper[4] = {120, 31.4, 16.6, 1.875};
  const double formula[4] = {16 * psi, 4 * psi + 12 * psi / nd, 2 * psi + 14 * psi / nd,
                             16 * psi / nd};
  for (int zero = 0; zero < 4; ++zero) EXPECT_NEAR(formula[zero] / 1e9, paper[zero], 0.05);

  // Tessera's figures for Megatron-LM's 7.5B on 64 ranks: the formula at its own size, plus the
  // transient buffers the runtime holds (ZeRO-2: a layer's gradient bucket; ZeRO-3: the layer
  // it runs and the next one gathered, and a gradient bucket).
  const TransformerShape shape = Megatron7B();
  const double params = static_cast<double>(shape.Parameters());
  const double layer = static_cast<double>(shape.LayerParameters());
  const double expected[4] = {16 * params, 4 * params + 12 * params / nd,
                              2 * params + 14 * params / nd + 2 * layer,
                              16 * params / nd + 6 * layer};
  DescribedCluster roomy = A100s(8);
  roomy.gpu_memory_gib = 1e6;
  ScaleTraining training;
  training.global_batch = 64;
  for (int zero = 0; zero < 4; ++zero) {
    SCOPED_TRACE(zero);
    PlanChoice choice;
    choice.data_parallel = 64;
    choice.zero_stage = zero;
    const Result<ScalePlan> plan =
        EvaluateScalePlan(roomy, shape, training, choice, 1, RankLayout::kStagesInNode);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    EXPECT_NEAR(plan->costs.model_state_gib * (1 << 30), expected[zero], 1e-6 * expected[zero]);
    EXPECT_EQ(plan->recomputed_layers, 0);
  }
}

TEST(ScaleSearchTest, PerChunkCostsReduceToTheUniformSimulation) {
  for (PipelineSchedule schedule : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B,
                                    PipelineSchedule::kInterleaved, PipelineSchedule::kZbH1}) {
    SCOPED_TRACE(ScheduleName(schedule));
    const int p = 4, m = 8, v = schedule == PipelineSchedule::kInterleaved ? 2 : 1;
    const OpCosts costs = SplitsBackward(schedule) ? OpCosts{1, 1, 1} : OpCosts{1, 2, 0};
    const auto orders = ScheduleOrder(schedule, p, m, v, costs);
    const ScheduleSimulation uniform = *SimulateSchedule(orders, p, v, m, costs);
    std::vector<OpCosts> chunks(static_cast<size_t>(p * v),
                                OpCosts{costs.forward / v, costs.backward / v, costs.weight / v});
    const ScheduleSimulation per_chunk = *SimulateSchedule(orders, p, v, m, chunks);
    EXPECT_DOUBLE_EQ(per_chunk.makespan, uniform.makespan);
    EXPECT_DOUBLE_EQ(per_chunk.bubble, uniform.bubble);
    EXPECT_EQ(per_chunk.peak_in_flight, uniform.peak_in_flight);
    // A heavier last chunk (a classifier) lengthens the step by at least its extra time once
    // per micro-batch: every micro-batch passes through it.
    chunks.back().forward += 0.5;
    EXPECT_GE(SimulateSchedule(orders, p, v, m, chunks)->makespan, uniform.makespan + 0.5 * m);
  }
  const auto orders = ScheduleOrder(PipelineSchedule::k1F1B, 2, 2, 1);
  EXPECT_EQ(SimulateSchedule(orders, 2, 1, 2, std::vector<OpCosts>(3)).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(ScaleSearchTest, SearchRanksFittingPlansDeterministically) {
  const DescribedCluster cluster = A100s(48);  // 384 GPUs
  const TransformerShape shape = *TransformerShape::Preset("gpt3-175b");
  ScaleTraining training;
  training.global_batch = 1536;
  ScaleSpace space;
  space.gpus = {384};
  const Result<std::vector<ScaleSearchResult>> first =
      SearchAtScale(cluster, shape, training, space);
  ASSERT_TRUE(first.ok()) << first.status().message();
  const ScaleSearchResult& result = first->front();
  ASSERT_FALSE(result.ranked.empty());
  EXPECT_EQ(result.considered, static_cast<int>(result.ranked.size() + result.refused.size()));
  bool tensor_parallel = false;
  for (size_t i = 0; i < result.ranked.size(); ++i) {
    const ScalePlan& plan = result.ranked[i];
    EXPECT_EQ(plan.choice.workers(), 384);
    // Tensor ranks inside a node (8 GPUs), dividing the 96 heads.
    EXPECT_EQ(8 % plan.choice.tensor_parallel, 0) << plan.Name();
    tensor_parallel |= plan.choice.tensor_parallel > 1;
    EXPECT_EQ(static_cast<int64_t>(plan.choice.data_parallel) * plan.choice.micro_batches *
                  plan.micro_batch_size,
              1536);
    EXPECT_LE(plan.peak_gib, cluster.gpu_memory_gib + 1e-9) << plan.Name();
    if (i > 0) {
      EXPECT_GE(plan.step_ms, result.ranked[i - 1].step_ms);
    }
  }
  EXPECT_TRUE(tensor_parallel) << "the search plans tensor parallelism too";
  for (const ScaleRefusal& refusal : result.refused) {
    EXPECT_GT(refusal.shortfall_gib, 0) << refusal.reason;
    EXPECT_THAT(refusal.reason, HasSubstr("GiB"));
  }
  // Most plans of 175B on 384 GPUs fit in 80 GB only with recompute. With the embedding and the
  // classifier split by vocabulary, the best fits without (D6 x T8 x P8 at the time of writing);
  // with them whole on every tensor rank, even the best recomputes.
  int recomputing = 0;
  for (const ScalePlan& plan : result.ranked) recomputing += plan.recomputed_layers > 0;
  EXPECT_GT(recomputing, static_cast<int>(result.ranked.size()) / 2);
  ScaleTraining whole_vocab = training;
  whole_vocab.vocab_parallel = false;
  const Result<std::vector<ScaleSearchResult>> whole =
      SearchAtScale(cluster, shape, whole_vocab, space);
  ASSERT_TRUE(whole.ok()) << whole.status().message();
  EXPECT_GT(whole->front().ranked.front().recomputed_layers, 0);

  const ScaleSearchResult again = SearchAtScale(cluster, shape, training, space)->front();
  ASSERT_EQ(again.ranked.size(), result.ranked.size());
  for (size_t i = 0; i < again.ranked.size(); ++i) {
    EXPECT_EQ(again.ranked[i].Name(), result.ranked[i].Name());
  }
  EXPECT_THAT(DescribeScaleSearch(result, 3), HasSubstr(result.ranked.front().Name()));
}

TEST(ScaleSearchTest, RecomputesOnlyWhatDoesNotFit) {
  DescribedCluster roomy = A100s(8);
  roomy.gpu_memory_gib = 1e6;
  const TransformerShape shape = Megatron7B();
  ScaleTraining training;
  training.global_batch = 512;
  ScaleSpace space;
  space.gpus = {64};
  const ScaleSearchResult result = SearchAtScale(roomy, shape, training, space)->front();
  EXPECT_TRUE(result.refused.empty());
  for (const ScalePlan& plan : result.ranked) EXPECT_EQ(plan.recomputed_layers, 0) << plan.Name();
}

TEST(ScaleSearchTest, ChoiceFollowsTheNetwork) {
  const TransformerShape shape = *TransformerShape::Preset("gpt3-175b");
  ScaleTraining training;
  training.global_batch = 1536;
  ScaleSpace space;
  space.gpus = {384};
  // A network as fast as NVLink: no bubble wins (pure data parallelism, ZeRO-3 to fit).
  DescribedCluster fast = A100s(48);
  fast.network_gb_per_s = fast.nvlink_gb_per_s;
  const ScalePlan fast_best = SearchAtScale(fast, shape, training, space)->front().ranked.front();
  EXPECT_EQ(fast_best.choice.pipeline_stages, 1) << fast_best.Name();
  EXPECT_EQ(fast_best.choice.zero_stage, 3) << fast_best.Name();
  // 1 GB/s between nodes: ZeRO-3's gathers cost more than a pipeline's bubble.
  DescribedCluster slow = A100s(48);
  slow.network_gb_per_s = 1;
  const ScalePlan slow_best = SearchAtScale(slow, shape, training, space)->front().ranked.front();
  EXPECT_GT(slow_best.choice.pipeline_stages, 1) << slow_best.Name();
  EXPECT_GT(slow_best.step_ms, fast_best.step_ms);

  // Collectives that do not overlap the compute never make a plan faster.
  PlanChoice zero3;
  zero3.data_parallel = 384;
  zero3.zero_stage = 3;
  const ScalePlan overlapped =
      *EvaluateScalePlan(A100s(48), shape, training, zero3, 4, RankLayout::kStagesInNode);
  training.overlap_communication = false;
  const ScalePlan serial =
      *EvaluateScalePlan(A100s(48), shape, training, zero3, 4, RankLayout::kStagesInNode);
  EXPECT_GT(serial.step_ms, overlapped.step_ms);
  EXPECT_EQ(serial.bottleneck, Bottleneck::kCompute);
}

TEST(ScaleSearchTest, RefusesWhatCannotFitWithTheShortfallAndTheFix) {
  const TransformerShape shape = *TransformerShape::Preset("gpt3-175b");
  ScaleTraining training;
  training.global_batch = 64;
  ScaleSpace space;
  space.gpus = {8};
  const Result<std::vector<ScaleSearchResult>> result =
      SearchAtScale(A100s(1), shape, training, space);
  ASSERT_EQ(result.status().code(), StatusCode::kInfeasible);
  EXPECT_THAT(result.status().message(), HasSubstr("no plan fits in 80.0 GiB per GPU"));
  EXPECT_THAT(result.status().message(), HasSubstr("short per GPU"));
  EXPECT_THAT(result.status().message(), HasSubstr("recompute"));
  EXPECT_THAT(result.status().message(), HasSubstr("more GPUs"));

  space.gpus = {16};
  EXPECT_EQ(SearchAtScale(A100s(1), shape, training, space).status().code(),
            StatusCode::kInvalidArgument);
  // The optimizer offloaded to hosts with room for the first stage's shards but not the last's
  // (Llama's untied classifier and final norm: the largest stage by a norm's width).
  const TransformerShape llama = *TransformerShape::Preset("llama2-70b");
  PlanChoice offloaded;
  offloaded.data_parallel = 8;
  offloaded.pipeline_stages = 16;  // five layers each
  offloaded.micro_batches = 8;
  offloaded.schedule = PipelineSchedule::kGPipe;
  offloaded.zero_stage = 1;
  offloaded.offload = OffloadMode::kOptimizer;
  const double layers = 5 * static_cast<double>(llama.LayerParameters());
  const double first = layers + static_cast<double>(llama.EmbeddingParameters());
  const double last = layers + static_cast<double>(llama.HeadParameters());
  ASSERT_GT(last, first);
  // 12 bytes a parameter, sharded over the 8 ranks, 8 GPUs a node.
  const auto node_gib = [](double params) { return 12 * params / 8 * 8 / (1 << 30); };
  DescribedCluster small_hosts = A100s(16);
  small_hosts.host_memory_gib = (node_gib(first) + node_gib(last)) / 2;
  const Result<ScalePlan> refused_host =
      EvaluateScalePlan(small_hosts, llama, training, offloaded, 1, RankLayout::kStagesInNode);
  EXPECT_EQ(refused_host.status().code(), StatusCode::kInfeasible);
  EXPECT_THAT(refused_host.status().message(), HasSubstr("GiB of host memory per node"));
  PlanChoice wrong_batch;
  wrong_batch.data_parallel = 8;
  EXPECT_EQ(EvaluateScalePlan(A100s(1), shape, training, wrong_batch, 1, RankLayout::kStagesInNode)
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

TEST(ScaleSearchTest, DescribedClustersParseAndNameTheirErrors) {
  for (const char* file : {"dgx-a100-80gb.yaml", "commodity-rtx4090.yaml"}) {
    SCOPED_TRACE(file);
    const Result<DescribedCluster> cluster = launcher::ReadDescribedCluster(
        std::string(TESSERA_SOURCE_DIR) + "/examples/clusters/" + file);
    ASSERT_TRUE(cluster.ok()) << cluster.status().message();
    EXPECT_GE(cluster->gpus(), 64);
  }
  const std::string base =
      "nodes: 2\ngpus_per_node: 8\ngpu_memory_gib: 80\npeak_tflops: 312\nmemory_gb_per_s: 2039\n"
      "nvlink_gb_per_s: 300\nnetwork_gb_per_s: 25\n";
  const Result<DescribedCluster> parsed = launcher::ParseDescribedCluster(base, "rack.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status().message();
  EXPECT_EQ(parsed->name, "rack");
  EXPECT_EQ(parsed->gpus(), 16);

  auto error = [](const std::string& text) {
    return launcher::ParseDescribedCluster(text, "rack.yaml").status().message();
  };
  EXPECT_THAT(error(base + "nvlink: 3\n"), HasSubstr("rack.yaml:8: unknown key 'nvlink'"));
  EXPECT_THAT(error(base + "gemm_efficiency: fast\n"), HasSubstr("not a number"));
  EXPECT_THAT(error(base + "gemm_efficiency: 1.5\n"), HasSubstr("gemm_efficiency must be in"));
  EXPECT_THAT(error("nodes: 2\ngpus_per_node: 8\n"), HasSubstr("missing key 'gpu_memory_gib'"));
  EXPECT_THAT(error("nodes: 0.5\n"), HasSubstr("whole number"));
  EXPECT_THAT(error("nodes: [1\n"), HasSubstr("not valid YAML"));
  EXPECT_EQ(launcher::ReadDescribedCluster("/nonexistent/c.yaml").status().code(),
            StatusCode::kNotFound);
}

}  // namespace
}  // namespace tessera::testing

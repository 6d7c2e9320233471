// The plan search (planner/plan_search.h): the candidates it enumerates, the layer times it
// interpolates, the ranking (by simulated step time, deterministic whatever the threads), the
// memory prune (no plan over the cap is timed; each refusal has its shortfall), the refusal when
// nothing fits, and that the choice follows the costs (free links: data parallelism; a slow
// collective link: a pipeline). Against measured runs: bench_plan_search.
#include "planner/plan_search.h"

#include <numeric>
#include <set>
#include <tuple>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model/gpt2.h"
#include "model/unet3d.h"
#include "planner/memory_model.h"
#include "planner/step_graph.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

// Eight layers: embedding, h.0 .. h.5, head.
ModelSpec SixBlocks() { return *BuildGpt2(Gpt2Config{6, 32, 4, 64, 16}); }

TrainingPlan Base() { return TrainingPlan{.batch = 8, .seq_len = 16}; }

// Times proportional to the rows: 0.1 ms a row forward, twice that backward (in halves for the
// blocks), measured at 1, 2, 4 and 8 rows.
Calibration Proportional(const ModelSpec& model) {
  Calibration calibration;
  for (int64_t rows : {1, 2, 4, 8}) {
    LayerTimesAtRows at{rows, {}};
    const double f = 0.1 * static_cast<double>(rows);
    for (const LayerSpec& layer : model.layers) {
      at.layer_ms.push_back(layer.backward_input_op.empty() ? OpCosts{f, 2 * f, 0}
                                                            : OpCosts{f, f, f});
    }
    calibration.layers.push_back(std::move(at));
  }
  calibration.task_overhead_ms = 0.01;
  return calibration;
}

TEST(PlanSearchTest, LayerTimesAreTheMeasuredOnesInterpolatedOrScaled) {
  Calibration calibration;
  calibration.layers = {{2, {OpCosts{1, 2, 0}}}, {8, {OpCosts{4, 8, 2}}}};
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> at2, LayerTimesAt(calibration, 2));
  EXPECT_EQ(at2[0].forward, 1);
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> at4,
                       LayerTimesAt(calibration, 4));  // a third of the way
  EXPECT_DOUBLE_EQ(at4[0].forward, 2);
  EXPECT_DOUBLE_EQ(at4[0].backward, 4);
  EXPECT_DOUBLE_EQ(at4[0].weight, 2.0 / 3);
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> at16, LayerTimesAt(calibration, 16));  // x 2 of 8's
  EXPECT_DOUBLE_EQ(at16[0].forward, 8);
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> at1, LayerTimesAt(calibration, 1));  // half of 2's
  EXPECT_DOUBLE_EQ(at1[0].backward, 1);
  EXPECT_EQ(LayerTimesAt(Calibration{}, 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(LayerTimesAt(calibration, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(PlanSearchTest, TheCandidatesCoverEveryDimensionAndEachIsAValidShape) {
  const ModelSpec model = SixBlocks();
  SearchSpace space;
  space.workers = 4;
  const std::vector<PlanChoice> candidates = EnumerateCandidates(model, Base(), space);
  std::set<std::string> names;
  std::set<std::tuple<int, int, int>> shapes;  // D, T, P
  std::set<std::pair<int, bool>> tensor;       // T, sequence sharded
  std::set<PipelineSchedule> schedules;
  std::set<int> zeros, micros;
  for (const PlanChoice& c : candidates) {
    EXPECT_TRUE(names.insert(c.Name()).second) << "twice: " << c.Name();
    EXPECT_EQ(c.workers(), 4) << c.Name();  // every worker unless fewer are asked for
    EXPECT_EQ(Base().batch % (int64_t{c.data_parallel} * c.micro_batches), 0) << c.Name();
    if (c.data_parallel == 1) {
      EXPECT_EQ(c.zero_stage, 0) << c.Name();
    }
    if (c.pipeline_stages > 1) {
      EXPECT_TRUE(
          CheckSchedule(c.schedule, c.pipeline_stages, c.micro_batches, c.virtual_stages).ok())
          << c.Name();
    }
    shapes.insert({c.data_parallel, c.tensor_parallel, c.pipeline_stages});
    tensor.insert({c.tensor_parallel, c.shard_sequence});
    if (c.pipeline_stages > 1) schedules.insert(c.schedule);
    zeros.insert(c.zero_stage);
    micros.insert(c.micro_batches);
  }
  // D x T x P = 4; T over the heads (4), with and without the sequence sharded.
  EXPECT_EQ(shapes, (std::set<std::tuple<int, int, int>>{
                        {4, 1, 1}, {2, 1, 2}, {1, 1, 4}, {2, 2, 1}, {1, 2, 2}, {1, 4, 1}}));
  EXPECT_EQ(tensor, (std::set<std::pair<int, bool>>{
                        {1, false}, {2, false}, {2, true}, {4, false}, {4, true}}));
  EXPECT_EQ(schedules.size(), 4u);
  EXPECT_EQ(zeros, (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(micros, (std::set<int>{1, 2, 4, 8}));
  // Fewer workers on request; the same order every time.
  space.fewer_workers = true;
  const std::vector<PlanChoice> more = EnumerateCandidates(model, Base(), space);
  EXPECT_GT(more.size(), candidates.size());
  EXPECT_EQ(more.front().workers(), 1);
  EXPECT_EQ(EnumerateCandidates(model, Base(), space).size(), more.size());
  EXPECT_EQ(PlanChoice({2, 2, 1, 4, 1, PipelineSchedule::kZbH1}).Flags(),
            "--workers 4 --pipeline-stages 2 --schedule zb-h1 --micro-batches 4 --zero-stage 1");
}

TEST(PlanSearchTest, PipelinesAlsoTryTheNearBalancedCutsOrAGivenOne) {
  const ModelSpec model = SixBlocks();
  const Calibration calibration = Proportional(model);
  SearchSpace space;
  space.workers = 4;
  space.cut_slack = 1.0;
  const std::vector<PlanChoice> without = EnumerateCandidates(model, Base(), space);
  const std::vector<PlanChoice> with = EnumerateCandidates(model, Base(), space, &calibration);
  EXPECT_GT(with.size(), without.size());
  std::set<std::string> names;
  int cut = 0;
  for (size_t i = 0; i < with.size(); ++i) {
    const PlanChoice& c = with[i];
    EXPECT_TRUE(names.insert(c.Name()).second) << "twice: " << c.Name();
    if (c.chunk_layers.empty()) continue;
    ++cut;
    EXPECT_GT(c.pipeline_stages, 1) << c.Name();
    EXPECT_EQ(c.chunk_layers.size(), static_cast<size_t>(c.pipeline_stages * c.virtual_stages));
    EXPECT_EQ(std::accumulate(c.chunk_layers.begin(), c.chunk_layers.end(), size_t{0}),
              model.layers.size());
    EXPECT_THAT(c.Name(), HasSubstr(" cut "));
    EXPECT_THAT(c.Flags(), HasSubstr("--stage-layers "));
    // The balanced cut of the same shape comes before it.
    const auto balanced = std::find_if(with.begin(), with.end(), [&c](const PlanChoice& b) {
      return b.chunk_layers.empty() && b.data_parallel == c.data_parallel &&
             b.pipeline_stages == c.pipeline_stages && b.micro_batches == c.micro_batches &&
             b.schedule == c.schedule && b.zero_stage == c.zero_stage;
    });
    ASSERT_NE(balanced, with.end()) << c.Name();
    EXPECT_LT(balanced - with.begin(), static_cast<std::ptrdiff_t>(i)) << c.Name();
  }
  EXPECT_GT(cut, 0);
  // A given cut: only plans of its chunks, all with it.
  space.chunk_layers = {3, 5};
  const std::vector<PlanChoice> given = EnumerateCandidates(model, Base(), space, &calibration);
  ASSERT_FALSE(given.empty());
  for (const PlanChoice& c : given) {
    EXPECT_EQ(c.chunk_layers, (std::vector<int>{3, 5})) << c.Name();
    EXPECT_EQ(c.pipeline_stages, 2) << c.Name();
  }
  // The search plans them: the ranked ones carry their cut to the trainer.
  ASSERT_OK_AND_ASSIGN(PlanSearchResult result,
                       PlanSearch(model, Base(), space, calibration, CpuRegistry()));
  ASSERT_FALSE(result.ranked.empty());
  EXPECT_EQ(result.ranked.front().parallel.chunk_layers, (std::vector<int>{3, 5}));
}

// Times of one rank of a split over `t` tensor ranks: Proportional's layer times over t (its
// share of the heads and columns) and 0.05 ms a task that does not shrink with the rows.
TensorSplitTimes SplitTimes(const ModelSpec& whole, int t) {
  const ModelSpec split = *whole.PlannedFor(t, 1);
  const Calibration times = Proportional(split);
  TensorSplitTimes tensor{t, times.layers};
  for (LayerTimesAtRows& at : tensor.layers) {
    for (OpCosts& c : at.layer_ms) {
      c = OpCosts{c.forward / t + 0.05, c.backward / t + 0.05, c.weight / t};
    }
  }
  return tensor;
}

// Tensor parallelism as a dimension: each degree's plans are planned on the model's split with
// the split's own layer times; sharding sequences, the sequence-sharded layers take 1/T of
// them; a degree without times is searched only when given, and then says what is missing.
TEST(PlanSearchTest, TensorParallelPlansRunOnTheirSplitsTimes) {
  const ModelSpec model = SixBlocks();
  Calibration calibration = Proportional(model);
  SearchSpace space;
  space.workers = 2;
  // No split measured: only T 1.
  ASSERT_OK_AND_ASSIGN(PlanSearchResult whole,
                       PlanSearch(model, Base(), space, calibration, CpuRegistry()));
  for (const RankedPlan& r : whole.ranked) EXPECT_EQ(r.choice.tensor_parallel, 1);
  space.tensor_parallel = {2};
  Result<PlanSearchResult> missing = PlanSearch(model, Base(), space, calibration, CpuRegistry());
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().ToString(), HasSubstr("no layer times of a rank of 2"));
  space.tensor_parallel = {3};
  Result<PlanSearchResult> wide = PlanSearch(model, Base(), space, calibration, CpuRegistry());
  ASSERT_FALSE(wide.ok());
  EXPECT_THAT(wide.status().ToString(),
              HasSubstr("give a degree from 1 to the workers that divides them"));
  space.workers = 3;  // 4 heads do not split over 3
  Result<PlanSearchResult> odd = PlanSearch(model, Base(), space, calibration, CpuRegistry());
  ASSERT_FALSE(odd.ok());
  EXPECT_THAT(odd.status().ToString(), HasSubstr("4 attention heads"));
  space.workers = 2;

  calibration.tensor_splits = {SplitTimes(model, 2)};
  space.tensor_parallel.clear();
  ASSERT_OK_AND_ASSIGN(PlanSearchResult result,
                       PlanSearch(model, Base(), space, calibration, CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(ModelSpec split, model.PlannedFor(2, 1));
  ASSERT_OK_AND_ASSIGN(ModelSpec sharded, model.PlannedFor(2, 1, /*shard_sequence=*/true));
  std::set<std::string> tensor_plans;
  for (const RankedPlan& r : result.ranked) {
    if (r.choice.tensor_parallel == 1) continue;
    tensor_plans.insert(r.choice.Name());
    EXPECT_EQ(r.choice.data_parallel, 1) << r.choice.Name();
    EXPECT_EQ(r.parallel.tensor_parallel, 2);
    EXPECT_EQ(r.parallel.shard_sequence, r.choice.shard_sequence);
    // The plan carries the times it was timed by, one per layer of its split.
    const int64_t rows = Base().batch / r.choice.micro_batches;
    ASSERT_OK_AND_ASSIGN(
        std::vector<OpCosts> expected,
        LayerTimesOf(calibration, r.choice.shard_sequence ? sharded : split, rows));
    ASSERT_EQ(r.parallel.layer_op_costs.size(), expected.size()) << r.choice.Name();
    for (size_t l = 0; l < expected.size(); ++l) {
      EXPECT_DOUBLE_EQ(r.parallel.layer_op_costs[l].forward, expected[l].forward);
    }
    EXPECT_THAT(r.choice.Flags(), HasSubstr("--tensor-parallel 2"));
  }
  EXPECT_TRUE(tensor_plans.count("D1 x T2 x P1 M1") == 1 &&
              tensor_plans.count("D1 x T2 SP x P1 M1") == 1)
      << DescribeSearch(result, 100);
  // Sharded: the sequence-sharded layers (norms, residuals) at the split's times for 1/T of the
  // rows (as many elements as 1/T of each sequence), the others as they are; below the fewest
  // rows measured, in proportion.
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> plain, LayerTimesOf(calibration, split, 4));
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> half, LayerTimesOf(calibration, split, 2));
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> shards, LayerTimesOf(calibration, sharded, 4));
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> one, LayerTimesOf(calibration, split, 1));
  ASSERT_OK_AND_ASSIGN(std::vector<OpCosts> one_shard, LayerTimesOf(calibration, sharded, 1));
  ASSERT_EQ(plain.size(), sharded.layers.size());
  int sharded_layers = 0;
  for (size_t l = 0; l < plain.size(); ++l) {
    const bool on_shard = sharded.layers[l].tensor_parallel->sequence_sharded;
    sharded_layers += on_shard ? 1 : 0;
    EXPECT_DOUBLE_EQ(shards[l].forward, on_shard ? half[l].forward : plain[l].forward)
        << sharded.layers[l].name;
    EXPECT_DOUBLE_EQ(one_shard[l].backward, on_shard ? one[l].backward / 2 : one[l].backward)
        << sharded.layers[l].name;
  }
  EXPECT_EQ(sharded_layers, 1 + 2 * 6);  // positions, then each block's mid and out
  // The whole model's count of layer times does not fit a split.
  EXPECT_FALSE(LayerTimesOf(Proportional(model), split, 4).ok());
  // A vocabulary 2 does not divide: a given T 2 plans without sharding the sequence (which
  // needs the vocabulary-parallel embedding), and asked for sharding alone says why it cannot.
  const ModelSpec odd_vocab = *BuildGpt2(Gpt2Config{6, 32, 4, 65, 16});
  space.tensor_parallel = {2};
  ASSERT_OK_AND_ASSIGN(std::vector<PlannedModel> models, PlannedModels(odd_vocab, Base(), space));
  ASSERT_EQ(models.size(), 1u);
  EXPECT_FALSE(models[0].shard_sequence);
  // GPU workers: T 1 alone (the split layers run on CPU workers only), a given T refused.
  TrainingPlan gpu = Base();
  gpu.device = Device::Cuda(0);
  EXPECT_FALSE(PlannedModels(odd_vocab, gpu, space).ok());
  space.tensor_parallel.clear();
  ASSERT_OK_AND_ASSIGN(std::vector<PlannedModel> on_gpus, PlannedModels(odd_vocab, gpu, space));
  ASSERT_EQ(on_gpus.size(), 1u);
  EXPECT_EQ(on_gpus[0].tensor_parallel, 1);
  space.tensor_parallel = {2};
  space.shard_sequence = {true};
  Result<std::vector<PlannedModel>> sharded_only = PlannedModels(odd_vocab, Base(), space);
  ASSERT_FALSE(sharded_only.ok());
  EXPECT_THAT(sharded_only.status().ToString(), HasSubstr("use a --vocab that 2 divides"));
}

// Slabs (spatial parallelism) as a dimension, for a volume model: each count's plans are planned
// on the model's split into slabs with its own layer times (D x S x P workers); a count without
// times is searched only when given; a given count fixes the slabs; under a per-worker cap a
// volume no one worker can train (batch 1: no rows to split) is planned on slabs.
TEST(PlanSearchTest, SlabPlansRunOnTheirSplitsTimesAndFitWhereOneWorkerCannot) {
  UNet3dConfig config = *UNet3dConfig::Preset("small");
  config.volume = 32;
  const ModelSpec model = *BuildUNet3d(config, CpuRegistry());
  const TrainingPlan base{.batch = 1};
  Calibration calibration = Proportional(model);
  SearchSpace space;
  space.workers = 4;
  // No slabs measured: whole-model plans only (pipelines, with batch 1).
  ASSERT_OK_AND_ASSIGN(PlanSearchResult whole,
                       PlanSearch(model, base, space, calibration, CpuRegistry()));
  for (const RankedPlan& r : whole.ranked) EXPECT_EQ(r.choice.slabs, 1) << r.choice.Name();
  space.slabs = {4};
  Result<PlanSearchResult> missing = PlanSearch(model, base, space, calibration, CpuRegistry());
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().ToString(), HasSubstr("no layer times of a rank of 4 slabs"));
  space.slabs = {3};
  Result<PlanSearchResult> uneven = PlanSearch(model, base, space, calibration, CpuRegistry());
  ASSERT_FALSE(uneven.ok());
  EXPECT_THAT(uneven.status().ToString(), HasSubstr("D x S x P workers"));
  space.slabs.clear();
  // Each slab count's rank: its split's layers at a quarter / half of the whole one's times.
  for (int s : {2, 4}) {
    const ModelSpec split = *model.PlannedFor(1, s, false, SequenceAttention::kHalo);
    TensorSplitTimes times{1, Proportional(split).layers, s};
    for (LayerTimesAtRows& at : times.layers) {
      for (OpCosts& c : at.layer_ms) c = OpCosts{c.forward / s, c.backward / s, c.weight / s};
    }
    calibration.tensor_splits.push_back(std::move(times));
  }
  ASSERT_OK_AND_ASSIGN(PlanSearchResult result,
                       PlanSearch(model, base, space, calibration, CpuRegistry()));
  std::set<std::string> slab_plans;
  for (const RankedPlan& r : result.ranked) {
    if (r.choice.slabs == 1) continue;
    slab_plans.insert(r.choice.Name());
    EXPECT_EQ(r.parallel.sequence_parallel, r.choice.slabs);
    EXPECT_EQ(r.parallel.sequence_attention, SequenceAttention::kHalo);
    EXPECT_EQ(r.parallel.data_parallel, r.choice.data_parallel * r.choice.slabs);
    EXPECT_THAT(r.choice.Flags(), HasSubstr(fmt::format("--spatial-parallel {}", r.choice.slabs)));
    EXPECT_EQ(r.choice.workers(), r.choice.slabs * r.choice.pipeline_stages);
  }
  EXPECT_TRUE(slab_plans.count("D1 x S4 x P1 M1 ZeRO-0") == 1 &&
              slab_plans.count("D1 x S2 x P2 gpipe M1 ZeRO-0") == 1)
      << DescribeSearch(result, 100);
  // A given count: its plans alone.
  space.slabs = {2};
  ASSERT_OK_AND_ASSIGN(PlanSearchResult two,
                       PlanSearch(model, base, space, calibration, CpuRegistry()));
  for (const RankedPlan& r : two.ranked) EXPECT_EQ(r.choice.slabs, 2) << r.choice.Name();
  space.slabs.clear();
  // A given tensor degree (its rank's times measured): slabs, which do not combine with it, are
  // not searched.
  calibration.tensor_splits.push_back(
      TensorSplitTimes{2, Proportional(*model.PlannedFor(2, 1)).layers, 1});
  space.tensor_parallel = {2};
  ASSERT_OK_AND_ASSIGN(PlanSearchResult tensor,
                       PlanSearch(model, base, space, calibration, CpuRegistry()));
  for (const RankedPlan& r : tensor.ranked) {
    EXPECT_EQ(r.choice.slabs, 1) << r.choice.Name();
    EXPECT_EQ(r.choice.tensor_parallel, 2) << r.choice.Name();
  }
  space.tensor_parallel.clear();
  // A cap under what one worker needs with every activation recomputed: no one-worker plan fits,
  // four slabs do (keeping every activation), and every plan ranked is under the cap.
  TrainingPlan least = base;
  least.memory.recompute_all = true;
  ASSERT_OK_AND_ASSIGN(StepGraph alone, PlanTrainingStep(model, least, CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(MemoryProfile alone_memory, PredictMemory(alone.graph));
  int64_t one_worker = 0;
  for (const WorkerMemory& w : alone_memory.workers) {
    one_worker = std::max(one_worker, w.peaks[static_cast<size_t>(MemoryTier::kHost)].bytes);
  }
  TrainingPlan capped = base;
  capped.memory.host_bytes = one_worker * 9 / 10;
  ASSERT_OK_AND_ASSIGN(PlanSearchResult fits,
                       PlanSearch(model, capped, space, calibration, CpuRegistry()));
  bool four_slabs = false;
  for (const RankedPlan& r : fits.ranked) {
    EXPECT_GT(r.choice.workers(), 1) << r.choice.Name();
    EXPECT_LE(r.peak_bytes[static_cast<size_t>(MemoryTier::kHost)], capped.memory.host_bytes)
        << r.choice.Name();
    if (r.choice.slabs == 4) {
      four_slabs = true;
      EXPECT_EQ(r.recomputed_layers + r.partly_kept_layers + r.swapped_layers, 0)
          << r.choice.Name();
    }
  }
  EXPECT_TRUE(four_slabs) << DescribeSearch(fits, 10);
  // GPU workers: no slabs (the split layers run on CPU workers only), which the search says; a
  // given count refused.
  TrainingPlan gpu = base;
  gpu.device = Device::Cuda(0);
  std::vector<std::string> left_out;
  ASSERT_OK_AND_ASSIGN(std::vector<PlannedModel> on_gpus,
                       PlannedModels(model, gpu, space, &left_out));
  for (const PlannedModel& m : on_gpus) EXPECT_EQ(m.slabs, 1);
  EXPECT_THAT(left_out,
              ::testing::Contains("slabs: spatial parallelism runs on CPU workers only so far"));
  space.slabs = {2};
  EXPECT_FALSE(PlannedModels(model, gpu, space).ok());
  space.slabs.clear();
  // bf16 activations: slabs compute in f32, so their plans are left out, and the search's table
  // says why and what to change.
  UNet3dConfig bf16_config = config;
  bf16_config.activations = DType::kBF16;
  const ModelSpec bf16_model = *BuildUNet3d(bf16_config, CpuRegistry());
  ASSERT_OK_AND_ASSIGN(PlanSearchResult bf16,
                       PlanSearch(bf16_model, base, space, calibration, CpuRegistry()));
  for (const RankedPlan& r : bf16.ranked) EXPECT_EQ(r.choice.slabs, 1) << r.choice.Name();
  ASSERT_EQ(bf16.left_out.size(), 2u) << DescribeSearch(bf16, 1);  // S2 and S4
  EXPECT_THAT(bf16.left_out.front(), HasSubstr("S2: unet3d: spatial parallelism (slabs) computes "
                                               "in f32 activations, not bf16: use --activations "
                                               "f32"));
  EXPECT_THAT(DescribeSearch(bf16, 1), HasSubstr("\nnot searched: S2: unet3d: spatial"));
}

TEST(PlanSearchTest, PlansAreRankedBySimulatedStepTimeTheSameWhateverTheThreads) {
  const ModelSpec model = SixBlocks();
  const Calibration calibration = Proportional(model);
  SearchSpace space;
  space.workers = 4;
  ASSERT_OK_AND_ASSIGN(PlanSearchResult one,
                       PlanSearch(model, Base(), space, calibration, CpuRegistry()));
  space.threads = 3;
  ASSERT_OK_AND_ASSIGN(PlanSearchResult three,
                       PlanSearch(model, Base(), space, calibration, CpuRegistry()));
  ASSERT_EQ(one.ranked.size(), three.ranked.size());
  EXPECT_EQ(one.considered, static_cast<int>(one.ranked.size() + one.refused.size()));
  for (size_t i = 0; i < one.ranked.size(); ++i) {
    EXPECT_EQ(one.ranked[i].choice.Name(), three.ranked[i].choice.Name()) << i;
    EXPECT_EQ(one.ranked[i].step_ms, three.ranked[i].step_ms) << i;
    if (i > 0) {
      EXPECT_LE(one.ranked[i - 1].step_ms, one.ranked[i].step_ms) << i;
    }
  }
  // The best plan's figure is its own step simulated again by hand.
  const RankedPlan& best = one.ranked.front();
  TrainingPlan plan = Base();
  plan.parallel = best.parallel;
  for (int w = 1; w <= best.choice.workers(); ++w) plan.parallel.workers.emplace_back(w);
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(
      std::vector<TaskTime> times,
      EstimateTaskTimes(step.graph, model, plan.parallel.layer_op_costs, CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(SimulatedStep simulated,
                       SimulateStep(step.graph, times, calibration.links, 0.01));
  EXPECT_DOUBLE_EQ(simulated.step_ms, best.step_ms);
  EXPECT_THAT(DescribeSearch(one, 5), HasSubstr(best.choice.Name()));
}

TEST(PlanSearchTest, TheChoiceFollowsTheLinks) {
  const ModelSpec model = SixBlocks();
  Calibration calibration = Proportional(model);
  SearchSpace space;
  space.workers = 4;
  // Free links: four ranks each do a quarter of the rows, with nothing to wait for.
  ASSERT_OK_AND_ASSIGN(PlanSearchResult free,
                       PlanSearch(model, Base(), space, calibration, CpuRegistry()));
  EXPECT_EQ(free.ranked.front().choice.data_parallel, 4) << DescribeSearch(free, 5);
  // Collectives at 1 MB/s and 5 ms each, pushes between stages cheap: data parallelism's
  // gradient reductions cost more than a pipeline's bubble.
  calibration.links.collective = CollectiveLink{.latency_us = 5000, .bytes_per_us = 1};
  calibration.links.collective_group = 4;
  calibration.links.point_to_point = CollectiveLink{.latency_us = 10, .bytes_per_us = 1e4};
  ASSERT_OK_AND_ASSIGN(PlanSearchResult slow,
                       PlanSearch(model, Base(), space, calibration, CpuRegistry()));
  const RankedPlan& best = slow.ranked.front();
  EXPECT_EQ(best.choice.data_parallel, 1) << DescribeSearch(slow, 5);
  EXPECT_EQ(best.choice.pipeline_stages, 4);
  // The data-parallel plans that remain are bound by their communication.
  for (const RankedPlan& r : slow.ranked) {
    if (r.choice.data_parallel == 4) {
      EXPECT_EQ(r.bottleneck, Bottleneck::kCommunication) << r.choice.Name();
    }
  }
}

TEST(PlanSearchTest, PlansOverTheCapAreRefusedWithTheirShortfallAndNeverTimed) {
  const ModelSpec model = SixBlocks();
  const Calibration calibration = Proportional(model);
  SearchSpace space;
  space.workers = 2;
  ASSERT_OK_AND_ASSIGN(PlanSearchResult uncapped,
                       PlanSearch(model, Base(), space, calibration, CpuRegistry()));
  EXPECT_TRUE(uncapped.refused.empty()) << uncapped.refused.front().reason;
  // A cap between the smallest and the largest host peak.
  int64_t least = INT64_MAX, most = 0;
  for (const RankedPlan& r : uncapped.ranked) {
    least = std::min(least, r.peak_bytes[static_cast<size_t>(MemoryTier::kHost)]);
    most = std::max(most, r.peak_bytes[static_cast<size_t>(MemoryTier::kHost)]);
  }
  ASSERT_LT(least, most);
  TrainingPlan capped = Base();
  capped.memory.host_bytes = least + (most - least) / 4;
  ASSERT_OK_AND_ASSIGN(PlanSearchResult fitted,
                       PlanSearch(model, capped, space, calibration, CpuRegistry()));
  EXPECT_FALSE(fitted.ranked.empty());
  for (const RankedPlan& r : fitted.ranked) {
    EXPECT_LE(r.peak_bytes[static_cast<size_t>(MemoryTier::kHost)], capped.memory.host_bytes)
        << r.choice.Name();
  }
  // Plans that were over it either fit now by recomputing or were refused with figures.
  int recomputing = 0;
  for (const RankedPlan& r : fitted.ranked) recomputing += r.recomputed_layers > 0 ? 1 : 0;
  EXPECT_GT(recomputing + static_cast<int>(fitted.refused.size()), 0);
  for (const RefusedPlan& r : fitted.refused) {
    EXPECT_GT(r.shortfall_bytes, 0) << r.choice.Name() << ": " << r.reason;
  }
  // Without a swap link, a plan over the cap with every activation recomputed is refused
  // before the memory plan searches it, with that figure.
  capped.memory.host_bytes = least / 2;
  Result<PlanSearchResult> none = PlanSearch(model, capped, space, calibration, CpuRegistry());
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(), HasSubstr("no plan fits"));
  EXPECT_THAT(none.status().message(), HasSubstr("every activation recomputed"));
}

// With collectives that take their time, what they read lives longer than the executor's untimed
// order says: the peaks a search reports are the larger of the two orders', and a plan over
// the cap only in the timed one is refused, saying so.
TEST(PlanSearchTest, CollectivesTakingTheirTimeKeepTheirInputsLonger) {
  const ModelSpec model = SixBlocks();
  Calibration slow = Proportional(model);
  slow.links.collective = CollectiveLink{.latency_us = 2000, .bytes_per_us = 5};
  slow.links.collective_group = 2;
  SearchSpace space;
  space.workers = 2;
  space.pipeline_stages = 1;
  space.zero_stages = {2};
  ASSERT_OK_AND_ASSIGN(PlanSearchResult search,
                       PlanSearch(model, Base(), space, slow, CpuRegistry()));
  bool longer = false;
  int64_t least_untimed = INT64_MAX;
  for (const RankedPlan& r : search.ranked) {
    TrainingPlan plan = Base();
    plan.parallel = r.parallel;
    plan.parallel.workers = {WorkerId(1), WorkerId(2)};
    ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
    ASSERT_OK_AND_ASSIGN(MemoryProfile untimed, PredictMemory(step.graph));
    int64_t peak = 0;
    for (const WorkerMemory& w : untimed.workers) {
      peak = std::max(peak, w.peaks[static_cast<size_t>(MemoryTier::kHost)].bytes);
    }
    const int64_t reported = r.peak_bytes[static_cast<size_t>(MemoryTier::kHost)];
    EXPECT_GE(reported, peak) << r.choice.Name();
    longer = longer || reported > peak;
    least_untimed = std::min(least_untimed, peak);
  }
  EXPECT_TRUE(longer) << DescribeSearch(search, 10);
  // A cap at the least untimed peak: plans over it only once timed are refused as such.
  TrainingPlan capped = Base();
  capped.memory.host_bytes = least_untimed;
  ASSERT_OK_AND_ASSIGN(PlanSearchResult at_cap,
                       PlanSearch(model, capped, space, slow, CpuRegistry()));
  int timed_refusals = 0;
  for (const RefusedPlan& r : at_cap.refused) {
    timed_refusals +=
        r.reason.find("with its collectives and copies taking their time") != std::string::npos;
    EXPECT_GT(r.shortfall_bytes, 0) << r.reason;
  }
  EXPECT_GT(timed_refusals, 0) << DescribeSearch(at_cap, 10);
  for (const RankedPlan& r : at_cap.ranked) {
    EXPECT_LE(r.peak_bytes[static_cast<size_t>(MemoryTier::kHost)], capped.memory.host_bytes);
  }
}

// The largest worker's peak on `tier`.
int64_t LargestPeak(const MemoryProfile& profile, MemoryTier tier) {
  int64_t largest = 0;
  for (const WorkerMemory& w : profile.workers) {
    largest = std::max(largest, w.peaks[static_cast<size_t>(tier)].bytes);
  }
  return largest;
}

// A search reports as each plan's expected peak what its simulated step holds, and fits it by
// the larger of that and the executor's untimed order's. The untimed order (every task a unit of
// time) paces a pipeline's stages by their counts of tasks, not their times, so what one stage
// sends another can pile up there as it does not in the simulated step: in a GPipe pipeline of 8
// micro-batches at least one plan's untimed peak is the larger.
TEST(PlanSearchTest, ExpectedPeaksAreTheSimulatedStepsAndTheFittedOnesBoundThem) {
  const ModelSpec model = SixBlocks();
  const Calibration calibration = Proportional(model);
  SearchSpace space;
  space.workers = 2;
  space.pipeline_stages = 2;
  space.micro_batches = 8;
  space.zero_stages = {0};
  space.schedules = {PipelineSchedule::kGPipe};
  ASSERT_OK_AND_ASSIGN(PlanSearchResult search,
                       PlanSearch(model, Base(), space, calibration, CpuRegistry()));
  ASSERT_FALSE(search.ranked.empty());
  int untimed_holds_more = 0;
  for (const RankedPlan& r : search.ranked) {
    TrainingPlan plan = Base();
    plan.parallel = r.parallel;
    plan.parallel.workers = {WorkerId(1), WorkerId(2)};
    ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
    ASSERT_OK_AND_ASSIGN(SimulatedStep simulated,
                         SimulatePlannedStep(step, model, plan.memory, calibration, CpuRegistry()));
    ASSERT_OK_AND_ASSIGN(MemoryProfile timed, PredictTimedMemory(step.graph, simulated));
    ASSERT_OK_AND_ASSIGN(MemoryProfile untimed, PredictMemory(step.graph));
    for (size_t t = 0; t < kMemoryTiers; ++t) {
      const auto tier = static_cast<MemoryTier>(t);
      EXPECT_EQ(r.expected_peak_bytes[t], LargestPeak(timed, tier)) << r.choice.Name();
      EXPECT_EQ(r.peak_bytes[t], std::max(LargestPeak(timed, tier), LargestPeak(untimed, tier)))
          << r.choice.Name();
    }
    const auto host = static_cast<size_t>(MemoryTier::kHost);
    EXPECT_EQ(r.timed_peak_bytes, r.expected_peak_bytes[host]);
    untimed_holds_more += r.untimed_peak_bytes > r.expected_peak_bytes[host] ? 1 : 0;
  }
  EXPECT_GT(untimed_holds_more, 0) << DescribeSearch(search, 10);
  EXPECT_THAT(DescribeSearch(search, 10), HasSubstr("peaks: as the simulated step holds them"));
}

TEST(PlanSearchTest, WhenNothingFitsTheClosestPlanAndTheFixAreNamed) {
  const ModelSpec model = SixBlocks();
  SearchSpace space;
  space.workers = 2;
  TrainingPlan tiny = Base();
  tiny.memory.host_bytes = 64 << 10;  // 64 KiB: not even the parameters
  const Result<PlanSearchResult> refused =
      PlanSearch(model, tiny, space, Proportional(model), CpuRegistry());
  ASSERT_EQ(refused.status().code(), StatusCode::kInfeasible);
  EXPECT_THAT(refused.status().message(), HasSubstr("no plan fits 2 workers"));
  EXPECT_THAT(refused.status().message(), HasSubstr("the closest, D"));
  EXPECT_THAT(refused.status().message(), HasSubstr("--host-memory-gib"));
  EXPECT_THAT(refused.status().message(), HasSubstr("--swap-dir"));
  // A space without workers, a calibration without times.
  space.workers = 0;
  EXPECT_EQ(PlanSearch(model, Base(), space, Proportional(model), CpuRegistry()).status().code(),
            StatusCode::kInvalidArgument);
  space.workers = 2;
  EXPECT_EQ(PlanSearch(model, Base(), space, Calibration{}, CpuRegistry()).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tessera::testing

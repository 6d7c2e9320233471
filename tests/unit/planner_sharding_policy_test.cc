// The sharding policies (planner/sharding_policy.h): each ZeRO stage's pieces, its parameter
// gathers, its gradient reductions and what follows its update, read off the passes that ask it.
#include "planner/sharding_policy.h"

#include <gmock/gmock.h>

#include "core/collective_task.h"
#include "core/sign_compression.h"
#include "ops/flat_layout.h"

#include "planner_test_util.h"

namespace tessera::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::unique_ptr<ShardingPolicy> Policy(int ranks, int zero,
                                       const OptimizerConfig& optimizer = OptimizerConfig{}) {
  ParallelConfig parallel;
  parallel.data_parallel = ranks;
  parallel.zero_stage = zero;
  Result<std::unique_ptr<ShardingPolicy>> policy = MakeShardingPolicy(parallel, optimizer);
  EXPECT_OK(policy.status());
  return std::move(*policy);
}

TEST(ShardingPolicyTest, OnePolicyPerStageAndDataParallelOverOneRank) {
  EXPECT_EQ(Policy(2, 0)->name(), "data parallel");
  EXPECT_EQ(Policy(2, 1)->name(), "ZeRO-1");
  EXPECT_EQ(Policy(2, 2)->name(), "ZeRO-2");
  EXPECT_EQ(Policy(2, 3)->name(), "ZeRO-3");
  for (int zero = 0; zero <= 3; ++zero) {
    EXPECT_EQ(Policy(1, zero)->name(), "data parallel") << "one rank has nothing to shard";
  }
  ParallelConfig five;
  five.zero_stage = 5;
  EXPECT_THAT(MakeShardingPolicy(five, OptimizerConfig{}).status().message(),
              HasSubstr("ZeRO stage 5 does not exist: use 0 (data parallel)"));
}

TEST(ShardingPolicyTest, PiecesAndPaddingFollowTheStage) {
  // A group of 10 elements over 2 ranks (padded to a multiple of 2 from stage 1 on).
  struct Want {
    int64_t multiple;
    bool params_sharded, update_sharded;
  };
  const Want want[] = {{1, false, false}, {2, false, true}, {2, false, true}, {2, true, true}};
  for (int zero = 0; zero <= 3; ++zero) {
    SCOPED_TRACE("stage " + std::to_string(zero));
    const auto policy = Policy(2, zero);
    EXPECT_EQ(policy->GroupMultiple(), want[zero].multiple);
    EXPECT_EQ(policy->ShardsUpdate(), want[zero].update_sharded);
    const GroupPiece params = policy->ParameterPiece(3, 1, 10);
    const GroupPiece update = policy->UpdatePiece(3, 1, 10);
    EXPECT_EQ(params.layer, 3u);
    EXPECT_EQ(params.rank, 1);
    EXPECT_EQ(params.begin, want[zero].params_sharded ? 5 : 0);
    EXPECT_EQ(params.numel, want[zero].params_sharded ? 5 : 10);
    EXPECT_EQ(update.begin, want[zero].update_sharded ? 5 : 0);
    EXPECT_EQ(update.numel, want[zero].update_sharded ? 5 : 10);
    EXPECT_EQ(policy->FullGradientRole(),
              zero >= 2 ? ObjectRole::kGradientBucket : ObjectRole::kGradient);
    EXPECT_EQ(policy->GathersUpdatedParameters(), zero == 1 || zero == 2);
  }
}

// 1-bit Adam: ZeRO-1/2 pad each group to whole 32-bit words of signs a rank, so that a shard is
// a chunk of the momentum's compressed all-reduce; in the compressed phase no gradient is
// reduced (whole and each rank's own, clipped by its own norm) and the update stays sharded.
TEST(ShardingPolicyTest, OneBitAdamShardsAreCompressionChunks) {
  OptimizerConfig onebit;
  onebit.kind = OptimizerConfig::Kind::kOneBitAdam;
  OptimizerConfig compressed = onebit;
  compressed.compressed_phase = true;
  for (int zero : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(zero));
    const auto warmup = Policy(3, zero, onebit);
    EXPECT_EQ(warmup->GroupMultiple(), 96);
    EXPECT_TRUE(warmup->ShardsUpdate());
    const auto phase = Policy(3, zero, compressed);
    EXPECT_EQ(phase->name(), zero == 1 ? "ZeRO-1" : "ZeRO-2");
    EXPECT_EQ(phase->GroupMultiple(), 96);
    EXPECT_FALSE(phase->ShardsUpdate()) << "each rank's gradient is whole";
    EXPECT_EQ(phase->FullGradientRole(), ObjectRole::kGradient);
    EXPECT_TRUE(phase->GathersUpdatedParameters());
    // A group of 100 elements pads to 192: shards of 64, SignChunkElements(100, 3).
    const GroupPiece shard = phase->UpdatePiece(0, 2, PaddedNumel(100, phase->GroupMultiple()));
    EXPECT_EQ(shard.begin, 128);
    EXPECT_EQ(shard.numel, SignChunkElements(100, 3));
    EXPECT_EQ(phase->ParameterPiece(0, 2, 192).numel, 192);
  }
  EXPECT_EQ(Policy(3, 0, compressed)->GroupMultiple(), 1) << "data parallelism pads nothing";
}

// ZeRO-3 gathers a group's shards before each use, on the group's stage and rank's worker,
// after (a control edge, holding no object) the task making the activation entering the layer
// prefetch_layers back.
TEST(ShardingPolicyTest, ZeroThreeGathersBeforeEachUsePrefetchedOneLayerAhead) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = 3});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "expand_layers"));
  const TaskSpec* gather = FindTask(state, "rank1/h.1/gather_forward");
  ASSERT_NE(gather, nullptr);
  EXPECT_EQ(gather->op, "all_gather");
  EXPECT_THAT(NamesOf(state, gather->inputs), ElementsAre("rank1/h.1.params[shard]"));
  EXPECT_THAT(gather->after, ElementsAre(FindTask(state, "rank1/embedding/forward")->id));
  EXPECT_EQ(gather->pinned_worker, WorkerId(101));
  EXPECT_EQ(gather->priority, kForwardPriority + 1);
  EXPECT_EQ(state.builder.graph().object(gather->outputs[0]).role, ObjectRole::kGatheredParameter);
  // The forward reads the gathered parameters; the backward gathers again.
  EXPECT_THAT(NamesOf(state, FindTask(state, "rank1/h.1/forward")->inputs),
              ::testing::Contains("rank1/h.1/gather_forward:params"));
  EXPECT_THAT(NamesOf(state, FindTask(state, "rank1/h.1/backward")->inputs),
              ::testing::Contains("rank1/h.1/gather_backward:params"));
  // The loss layer's gathers (its own group and the tied embedding's) are named for it and
  // serve its backward too.
  EXPECT_NE(FindTask(state, "rank0/head/gather_head"), nullptr);
  EXPECT_NE(FindTask(state, "rank0/embedding/gather_head"), nullptr);
  EXPECT_FALSE(state.builder.graph().FindTask("rank0/head/gather_backward").ok());
  // Each gather of a group is one collective over the ranks: rank 0's and 1's share an id.
  EXPECT_EQ(FindTask(state, "rank0/h.1/gather_forward")->attrs.GetInt("collective", -1),
            gather->attrs.GetInt("collective", -2));
  EXPECT_EQ(gather->attrs.GetInt("rank", -1), 1);
  EXPECT_EQ(gather->attrs.GetInt("group_size", -1), 2);
}

TEST(ShardingPolicyTest, ZeroThreeGathersOncePerStepWhenAskedAndSaysWhy) {
  const ModelSpec model = TinyGpt2();
  TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = 3, .micro = 2});
  plan.parallel.gather = GatherPolicy::kOncePerStep;
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "expand_layers"));
  EXPECT_TRUE(state.step.gather_once_per_step);
  EXPECT_EQ(state.step.gather_reason,
            "asked for (--gather step): 3 fewer gathers per layer per step");
  // One gather per group and rank, shared by both micro-batches' forwards and backwards.
  EXPECT_EQ(CountOp(state, "all_gather"), 2 * 4);
  const TaskSpec* backward = FindTask(state, "rank0/h.0/backward@1");
  ASSERT_NE(backward, nullptr);
  EXPECT_THAT(NamesOf(state, backward->inputs),
              ::testing::Contains("rank0/h.0/gather_step:params"));
  // Without a pipeline the default gathers per micro-batch, and says why.
  plan.parallel.gather = GatherPolicy::kAuto;
  PlanState per_micro(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(per_micro, "place_state"));
  EXPECT_FALSE(per_micro.step.gather_once_per_step);
  EXPECT_THAT(per_micro.step.gather_reason, HasSubstr("keeps ZeRO-3's bound of prefetch_layers"));
}

// What each stage does with a micro-batch's full gradient: data parallel all-reduces the sum
// after the last micro-batch; ZeRO-2/3 reduce-scatter every micro-batch's and add the shards;
// ZeRO-1 keeps the full sums until the reductions pass.
TEST(ShardingPolicyTest, EachStageReducesMicroBatchGradientsItsOwnWay) {
  const ModelSpec model = TinyGpt2();
  for (int zero = 0; zero <= 3; ++zero) {
    SCOPED_TRACE("stage " + std::to_string(zero));
    const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = zero, .micro = 2});
    PlanState state(model, plan, CpuRegistry());
    ASSERT_OK(RunPassesThrough(state, "expand_layers"));
    EXPECT_EQ(CountOp(state, "all_reduce"), zero == 0 ? 2 * 4 : 0);
    EXPECT_EQ(CountOp(state, "reduce_scatter"), zero >= 2 ? 2 * 2 * 4 : 0);
    const TaskSpec* accumulate = FindTask(state, "rank0/h.0/accumulate@1");
    ASSERT_NE(accumulate, nullptr);
    EXPECT_THAT(NamesOf(state, accumulate->inputs),
                zero >= 2 ? ElementsAre("rank0/h.0.grad[shard]@0", "rank0/h.0.grad[shard]@1")
                          : ElementsAre("rank0/h.0.grad@0", "rank0/h.0.grad@1"));
    const std::string kept = state.builder.graph().object(state.ranks[0].grad[1]).name;
    EXPECT_EQ(kept, zero == 0 ? "rank0/h.0.grad_reduced" : "rank0/h.0.grad_sum@1");
  }
}

// ZeRO-3 with quantized collectives (ZeRO++): every parameter gather and every gradient
// reduce-scatter, lone or fused in a bucket, carries the bits; nothing else does.
TEST(ShardingPolicyTest, ZeroThreeQuantizesItsGathersAndReduceScattersWhenAsked) {
  const ModelSpec model = TinyGpt2();
  for (int64_t bucket : {int64_t{0}, int64_t{40'000}}) {
    SCOPED_TRACE("buckets of " + std::to_string(bucket));
    TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = 3, .micro = 2, .bucket_bytes = bucket});
    plan.parallel.quantize_bits = 4;
    PlanState state(model, plan, CpuRegistry());
    ASSERT_OK(RunPassesThrough(state, "expand_layers"));
    int quantized = 0;
    for (const TaskSpec& task : state.builder.graph().tasks()) {
      const bool gather_or_scatter = task.op == "all_gather" || task.op == "reduce_scatter";
      EXPECT_EQ(task.attrs.GetInt(kQuantizeBitsAttr, 0), gather_or_scatter ? 4 : 0) << task.name;
      quantized += gather_or_scatter ? 1 : 0;
    }
    EXPECT_EQ(quantized, CountOp(state, "all_gather") + CountOp(state, "reduce_scatter"));
    EXPECT_GT(quantized, 0);
  }
  // Without ZeRO-3 there is nothing to quantize: refused by name.
  TrainingPlan zero2 = MakeTinyPlan({.ranks = 2, .zero = 2});
  zero2.parallel.quantize_bits = 8;
  PlanState refused(model, zero2, CpuRegistry());
  EXPECT_THAT(RunPassesThrough(refused, "expand_layers").message(),
              HasSubstr("quantized collectives are ZeRO-3's"));
}

// Gradient buckets: the tiny GPT-2's gradients complete head (256 B), h.1 (50,816 B), h.0
// (50,816 B), embedding (8,448 B). Buckets of 40 kB fuse head and h.1 into one collective: their
// gradients packed shard by shard, reduced, split back under the names a lone collective gives
// them; h.0 fills a bucket alone, and the embedding's is reduced alone at the backward's end.
TEST(ShardingPolicyTest, BucketsFuseGroupsUntilFullEachIntoOneCollective) {
  const ModelSpec model = TinyGpt2();
  for (int zero : {0, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(zero));
    const TrainingPlan plan =
        MakeTinyPlan({.ranks = 2, .zero = zero, .micro = 2, .bucket_bytes = 40'000});
    PlanState state(model, plan, CpuRegistry());
    ASSERT_OK(RunPassesThrough(state, "expand_layers"));
    EXPECT_EQ(state.step.buckets.bytes, 40'000);
    const std::string op = zero == 0 ? "all_reduce" : "reduce_scatter";
    // Data parallel reduces once, after the last micro-batch; ZeRO-2/3 after each.
    const std::string micro = zero == 0 ? "" : "@1";
    const std::string reduction = op + micro;  // "reduce_scatter@1"
    const TaskSpec* pack = FindTask(state, "rank0/head~h.1/pack" + micro);
    ASSERT_NE(pack, nullptr);
    EXPECT_EQ(pack->op, "pack_shards");
    EXPECT_EQ(pack->attrs.GetInt("ranks", 0), zero == 0 ? 1 : 2);
    const TaskSpec* fused = FindTask(state, "rank0/head~h.1/" + reduction);
    ASSERT_NE(fused, nullptr);
    const TaskSpec* split = FindTask(state, "rank0/head~h.1/split" + micro);
    ASSERT_NE(split, nullptr);
    const std::string suffix = zero == 0 ? ".grad_reduced" : ".grad[shard]@1";
    EXPECT_THAT(NamesOf(state, split->outputs),
                ElementsAre("rank0/head" + suffix, "rank0/h.1" + suffix));
    EXPECT_EQ(*split->attrs.GetInts("sizes"),
              (std::vector<int64_t>{64 / (zero == 0 ? 1 : 2), 12704 / (zero == 0 ? 1 : 2)}));
    // Per rank: 3 collectives where there were 4 (per micro-batch for ZeRO-2/3).
    EXPECT_EQ(CountOp(state, op), 2 * 3 * (zero == 0 ? 1 : 2));
    EXPECT_EQ(state.step.fused_reductions, zero == 0 ? 1 : 2);
    EXPECT_NE(FindTask(state, "rank0/h.0/" + reduction), nullptr);
    EXPECT_NE(FindTask(state, "rank0/embedding/" + reduction), nullptr);
  }
}

// The bucket size: what was asked for, or 9 x latency x bandwidth to the nearest power of two,
// capped at 25 MiB; an unmeasured link is taken as 50 us and 1 GB/s.
TEST(ShardingPolicyTest, BucketSizesComeFromTheLinkUnlessAskedFor) {
  ParallelConfig p;
  p.bucket_bytes = 0;
  EXPECT_EQ(ChooseGradientBuckets(p).bytes, 0);
  p.bucket_bytes = 123'456;
  EXPECT_EQ(ChooseGradientBuckets(p).bytes, 123'456);
  p.bucket_bytes = kAutoBucketBytes;
  // 9 x 50 x 1000 = 450,000 -> 2^19.
  const BucketChoice assumed = ChooseGradientBuckets(p);
  EXPECT_EQ(assumed.bytes, int64_t{1} << 19);
  EXPECT_THAT(assumed.reason, HasSubstr("not measured"));
  // 9 x 10 x 1000 = 90,000 -> 2^16 (log2 16.46); 9 x 12 x 1000 = 108,000 -> 2^17 (16.72).
  p.link = CollectiveLink{10.0, 1000.0};
  EXPECT_EQ(ChooseGradientBuckets(p).bytes, int64_t{1} << 16);
  p.link = CollectiveLink{12.0, 1000.0};
  EXPECT_EQ(ChooseGradientBuckets(p).bytes, int64_t{1} << 17);
  EXPECT_THAT(ChooseGradientBuckets(p).reason, HasSubstr("(measured)"));
  p.link = CollectiveLink{1000.0, 100'000.0};
  EXPECT_EQ(ChooseGradientBuckets(p).bytes, 25 << 20);
  EXPECT_THAT(ChooseGradientBuckets(p).reason, HasSubstr("capped at 25 MiB"));
}

// A bucket never spans two pipeline stages: its collective is over one stage's ranks.
TEST(ShardingPolicyTest, BucketsEndAtAStagesEdge) {
  const ModelSpec model = TinyGpt2();
  // Everything would fit one bucket; the cut (embedding, h.0 | h.1, head) splits it in two.
  const TrainingPlan plan = MakeTinyPlan(
      {.ranks = 2, .zero = 2, .micro = 2, .stages = 2, .bucket_bytes = int64_t{1} << 30});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "expand_layers"));
  std::vector<std::string> fused;
  for (const TaskSpec& task : state.builder.graph().tasks()) {
    if (task.op == "reduce_scatter" && task.name.starts_with("rank0/")) fused.push_back(task.name);
  }
  EXPECT_THAT(
      fused,
      ElementsAre("rank0/head~h.1/reduce_scatter@0", "rank0/h.0~embedding/reduce_scatter@0",
                  "rank0/head~h.1/reduce_scatter@1", "rank0/h.0~embedding/reduce_scatter@1"));
}

// ZeRO-1 reduce-scatters each gradient once the whole backward is done (a second input: the
// stage's last gradient, the embedding's, or its shard once reduced), smallest group first.
TEST(ShardingPolicyTest, ZeroOneReducesAfterTheWholeBackwardSmallestGroupFirst) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = 1});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "expand_layers"));
  EXPECT_EQ(CountOp(state, "reduce_scatter"), 0);
  ASSERT_OK(ReduceGradientsPass(state));
  std::vector<std::string> order;
  for (const TaskSpec& task : state.builder.graph().tasks()) {
    if (task.op == "reduce_scatter" && task.name.starts_with("rank0/")) order.push_back(task.layer);
  }
  EXPECT_THAT(order, ElementsAre("head", "embedding", "h.0", "h.1"));
  // The embedding's gradient is smaller, so already reduced: h.0's waits for its shard.
  EXPECT_THAT(NamesOf(state, FindTask(state, "rank0/embedding/reduce_scatter")->inputs),
              ElementsAre("rank0/embedding.grad"));
  EXPECT_THAT(NamesOf(state, FindTask(state, "rank0/h.0/reduce_scatter")->inputs),
              ElementsAre("rank0/h.0.grad", "rank0/embedding.grad[shard]"));
  EXPECT_EQ(FindTask(state, "rank0/h.0/reduce_scatter")->priority, kOptimizerPriority + 1);
  // The final gradients are the shards.
  ASSERT_EQ(state.step.grads.size(), 2u * 4u);
  for (const GradientObject& grad : state.step.grads) {
    EXPECT_EQ(grad.piece.numel, state.step.group_numel[grad.piece.layer] / 2);
    EXPECT_EQ(grad.piece.begin, grad.piece.rank * grad.piece.numel);
    EXPECT_THAT(state.builder.graph().object(grad.id).name, HasSubstr(".grad[shard]"));
  }
}

}  // namespace
}  // namespace tessera::testing

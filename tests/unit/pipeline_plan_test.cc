// Pipeline plans (planner/step_graph.h with pipeline_stages > 1): how the planner cuts a model into
// stages, where it places each task and object, the schedule's control edges, ZeRO-3's gathers,
// and the plans it refuses before anything runs. The losses of these plans on real workers are
// checked in tests/integration/pipeline_plans_test.cc.
#include <map>
#include <numeric>
#include <set>

#include <gmock/gmock.h>

#include "model/gpt2.h"
#include "model/model.h"
#include "planner/pipeline_cut.h"
#include "planner/step_graph.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

// Six blocks: eight layers (embedding, h.0 .. h.5, head).
Gpt2Config SixBlocks() { return Gpt2Config{6, 32, 4, 64, 16}; }

TrainingPlan PipelinePlan(int stages, int ranks, int micro, PipelineSchedule schedule,
                          int virtual_stages = 1, int zero = 0) {
  TrainingPlan plan;
  plan.batch = int64_t{2} * ranks * micro;
  plan.seq_len = 16;
  plan.parallel.pipeline_stages = stages;
  plan.parallel.data_parallel = ranks;
  plan.parallel.micro_batches = micro;
  plan.parallel.schedule = schedule;
  plan.parallel.virtual_stages = virtual_stages;
  plan.parallel.zero_stage = zero;
  for (int w = 0; w < stages * ranks; ++w) plan.parallel.workers.push_back(WorkerId(100 + w));
  return plan;
}

TEST(BalancedChunksTest, ContiguousChunksMinimizingTheLargest) {
  EXPECT_EQ(BalancedChunks({1, 1, 1, 1}, 2), (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(BalancedChunks({4, 1, 1, 1, 1}, 2), (std::vector<int>{0, 1, 1, 1, 1}));
  EXPECT_EQ(BalancedChunks({1, 2, 3, 4, 5, 6}, 3), (std::vector<int>{0, 0, 0, 1, 1, 2}));
  EXPECT_EQ(BalancedChunks({5, 5, 5}, 3), (std::vector<int>{0, 1, 2}));
}

TEST(BalancedChunksTest, NearBalancedCutsStartWithTheBalancedOneWithinTheSlack) {
  // Four equal layers in two chunks: 2+2 (largest 2), then 1+3 and 3+1 (3 = 1.5 x 2).
  EXPECT_EQ(NearBalancedCuts({1, 1, 1, 1}, 2, 0.5, 5),
            (std::vector<std::vector<int>>{{2, 2}, {1, 3}, {3, 1}}));
  EXPECT_EQ(NearBalancedCuts({1, 1, 1, 1}, 2, 0.5, 2),
            (std::vector<std::vector<int>>{{2, 2}, {1, 3}}));
  EXPECT_EQ(NearBalancedCuts({1, 1, 1, 1}, 2, 0.25, 5), (std::vector<std::vector<int>>{{2, 2}}));
  // The balanced cut leads even when another ties with it.
  const std::vector<std::vector<int>> cuts = NearBalancedCuts({4, 1, 1, 1, 1, 4}, 3, 0, 4);
  ASSERT_FALSE(cuts.empty());
  std::vector<int> counts(3, 0);
  for (int chunk : BalancedChunks({4, 1, 1, 1, 1, 4}, 3)) ++counts[static_cast<size_t>(chunk)];
  EXPECT_EQ(cuts.front(), counts);
  for (const std::vector<int>& cut : cuts) {
    EXPECT_EQ(cut.size(), 3u);
    EXPECT_EQ(std::accumulate(cut.begin(), cut.end(), 0), 6);
  }
}

TEST(PipelinePlanTest, AGivenCutIsTheStagesLayersOrRefusedWithWhatToGive) {
  const ModelSpec model = *BuildGpt2(SixBlocks());  // eight layers
  TrainingPlan plan = PipelinePlan(2, 1, 4, PipelineSchedule::k1F1B);
  plan.parallel.chunk_layers = {1, 7};
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  EXPECT_EQ(step.layer_stage, (std::vector<int>{0, 1, 1, 1, 1, 1, 1, 1}));
  for (const std::vector<int>& bad : std::vector<std::vector<int>>{{4, 3}, {8, 0}, {2, 2, 4}}) {
    plan.parallel.chunk_layers = bad;
    const Status status = PlanTrainingStep(model, plan, CpuRegistry()).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr("give 2 counts"));
    EXPECT_THAT(status.message(), HasSubstr("the model's 8 layers"));
  }
}

TEST(PipelinePlanTest, EachStageRunsItsLayersOnItsWorkersAndTheBlocksBalance) {
  const ModelSpec model = *BuildGpt2(SixBlocks());
  const TrainingPlan plan = PipelinePlan(4, 1, 4, PipelineSchedule::k1F1B);
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  ASSERT_EQ(step.layer_stage.size(), model.layers.size());
  // Stages are contiguous, in order, each with at least one layer; the blocks are alike, so no
  // stage holds more than two of them.
  std::map<int, int> blocks_per_stage;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    if (l > 0) {
      EXPECT_GE(step.layer_stage[l], step.layer_stage[l - 1]);
    }
    if (model.layers[l].name.starts_with("h.")) ++blocks_per_stage[step.layer_stage[l]];
  }
  EXPECT_EQ(step.layer_stage.front(), 0);
  EXPECT_EQ(step.layer_stage.back(), 3);
  for (const auto& [stage, blocks] : blocks_per_stage) EXPECT_LE(blocks, 2) << "stage " << stage;
  // Every task of a layer runs on its stage's worker; the state lives there too.
  for (const TaskSpec& task : step.graph.tasks()) {
    if (task.layer.empty()) continue;
    ASSERT_OK_AND_ASSIGN(const LayerSpec* layer, model.FindLayer(task.layer));
    const size_t l = static_cast<size_t>(layer - model.layers.data());
    EXPECT_EQ(task.pinned_worker, WorkerId(100 + step.layer_stage[l])) << task.name;
  }
  for (const StateObject& state : step.state) {
    EXPECT_EQ(step.WorkerOf(state.piece), WorkerId(100 + step.layer_stage[state.piece.layer]));
  }
}

TEST(PipelinePlanTest, TheScheduleIsEachWorkersOrderOfForwardsAndBackwards) {
  const ModelSpec model = *BuildGpt2(SixBlocks());
  for (PipelineSchedule schedule : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B,
                                    PipelineSchedule::kInterleaved, PipelineSchedule::kZbH1}) {
    SCOPED_TRACE(ScheduleName(schedule));
    const int virtual_stages = schedule == PipelineSchedule::kInterleaved ? 2 : 1;
    const TrainingPlan plan = PipelinePlan(2, 1, 4, schedule, virtual_stages);
    ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
    // The topological order (which includes control edges) lists each worker's forward and
    // backward tasks in the schedule's order: recover the op sequence and compare.
    ASSERT_OK_AND_ASSIGN(std::vector<TaskId> order, step.graph.TopologicalOrder());
    // What the plan recorded is what it chained; zb-h1's order follows the op cost model's F,
    // B and W (checked against its own list schedule).
    const auto expected = ScheduleOrder(schedule, 2, 4, virtual_stages, step.schedule_costs);
    EXPECT_EQ(step.schedule_order, expected);
    if (schedule == PipelineSchedule::kZbH1) {
      EXPECT_GT(step.schedule_costs.forward, 0);
      EXPECT_GT(step.schedule_costs.backward, 0);
      EXPECT_GT(step.schedule_costs.weight, 0);
    } else {
      EXPECT_EQ(expected, ScheduleOrder(schedule, 2, 4, virtual_stages));
    }
    for (int stage = 0; stage < 2; ++stage) {
      std::vector<std::string> got;
      for (TaskId id : order) {
        const TaskSpec& task = step.graph.task(id);
        if (task.pinned_worker != WorkerId(100 + stage)) continue;
        const bool forward = task.name.find("/forward") != std::string::npos;
        const bool backward = task.name.find("/backward") != std::string::npos;
        if (!forward && !backward) continue;
        // zb-h1: the blocks' weight halves are W; their input halves (and the unsplit embedding
        // and head backwards) are B.
        const bool weight = task.name.find("/backward_weight") != std::string::npos;
        if (backward) {
          EXPECT_EQ(weight || task.name.find("/backward_input") != std::string::npos,
                    schedule == PipelineSchedule::kZbH1 && task.layer.starts_with("h."))
              << task.name;
        }
        const size_t at = task.name.rfind('@');
        const int micro = std::stoi(task.name.substr(at + 1));
        ASSERT_OK_AND_ASSIGN(const LayerSpec* layer, model.FindLayer(task.layer));
        const int chunk = step.layer_chunk[static_cast<size_t>(layer - model.layers.data())];
        const PipelineOp::Kind kind = forward  ? PipelineOp::Kind::kForward
                                      : weight ? PipelineOp::Kind::kWeight
                                               : PipelineOp::Kind::kBackward;
        const std::string op = ToString(PipelineOp{kind, chunk, micro});
        if (got.empty() || got.back() != op) got.push_back(op);  // a chunk's layers: one op
      }
      std::vector<std::string> want;
      for (const PipelineOp& op : expected[static_cast<size_t>(stage)])
        want.push_back(ToString(op));
      EXPECT_EQ(got, want) << "stage " << stage;
    }
    if (schedule == PipelineSchedule::kInterleaved) {
      for (size_t l = 0; l < model.layers.size(); ++l) {
        EXPECT_EQ(step.layer_stage[l], step.layer_chunk[l] % 2);
      }
      EXPECT_EQ(step.layer_chunk.back(), 3);
    }
  }
}

// Measured F, B and W per layer (a profile) balance the stages by their sums and order zb-h1 by
// their per-chunk means; without a zero-bubble schedule nothing splits unless asked.
TEST(PipelinePlanTest, MeasuredLayerCostsCutTheStagesAndOrderZeroBubble) {
  const ModelSpec model = *BuildGpt2(SixBlocks());
  TrainingPlan plan = PipelinePlan(2, 1, 4, PipelineSchedule::kZbH1);
  // A heavy embedding (10 of 27 in all): stage 0 gets it and one block (12.5 | 14.5).
  plan.parallel.layer_op_costs.assign(model.layers.size(), OpCosts{1, 1, 0.5});
  plan.parallel.layer_op_costs[0] = OpCosts{5, 5, 0};
  plan.parallel.layer_op_costs.back() = OpCosts{1, 1, 0};
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  EXPECT_EQ(step.layer_stage, (std::vector<int>{0, 0, 1, 1, 1, 1, 1, 1}));
  // Per chunk, the mean of the two stages': F = (5 + 1 | 5 x 1 + 1) = 6, B the same,
  // W = (0.5 + 2.5) / 2.
  EXPECT_DOUBLE_EQ(step.schedule_costs.forward, 6.0);
  EXPECT_DOUBLE_EQ(step.schedule_costs.backward, 6.0);
  EXPECT_DOUBLE_EQ(step.schedule_costs.weight, 1.5);
  EXPECT_EQ(step.schedule_order, ScheduleOrder(PipelineSchedule::kZbH1, 2, 4, 1, {6, 6, 1.5}));

  plan.parallel.layer_op_costs.pop_back();
  EXPECT_EQ(PlanTrainingStep(model, plan, CpuRegistry()).status().message(),
            "7 layer op costs given for a model of 8 layers");

  auto splits = [](const StepGraph& s) {
    int count = 0;
    for (const TaskSpec& task : s.graph.tasks())
      count += task.op == "transformer_block_backward_weight";
    return count;
  };
  TrainingPlan flat;
  flat.batch = 4;
  flat.seq_len = 16;
  ASSERT_OK_AND_ASSIGN(StepGraph whole, PlanTrainingStep(model, flat, CpuRegistry()));
  EXPECT_EQ(splits(whole), 0);
  flat.parallel.split_backwards = true;
  ASSERT_OK_AND_ASSIGN(StepGraph split, PlanTrainingStep(model, flat, CpuRegistry()));
  EXPECT_EQ(splits(split), 6);
}

TEST(PipelinePlanTest, ZeroThreeGathersEachLayerOncePerStepInAPipelineAndSaysWhy) {
  const ModelSpec model = *BuildGpt2(SixBlocks());
  TrainingPlan plan = PipelinePlan(2, 2, 4, PipelineSchedule::k1F1B, 1, 3);
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(model, plan, CpuRegistry()));
  EXPECT_TRUE(step.gather_once_per_step);
  EXPECT_NE(step.gather_reason.find("7 fewer gathers per layer per step"), std::string::npos)
      << step.gather_reason;
  auto gathers = [](const StepGraph& s) {
    int count = 0;
    for (const TaskSpec& task : s.graph.tasks()) count += task.op == "all_gather";
    return count;
  };
  // One gather per group and rank (8 groups x 2 ranks): the head on stage 1 reads the tied
  // embedding's gathered group from stage 0 rather than gathering it again.
  EXPECT_EQ(gathers(step), 2 * 8);
  // Gathering before every use, when asked: per micro-batch and rank, one gather before each
  // block's forward and backward (6 x 2), one before the embedding's forward (its backward reads
  // no parameters), and two for the head (its own group and the tied embedding's, serving its
  // forward and backward).
  plan.parallel.gather = GatherPolicy::kPerMicroBatch;
  ASSERT_OK_AND_ASSIGN(StepGraph per_micro, PlanTrainingStep(model, plan, CpuRegistry()));
  EXPECT_FALSE(per_micro.gather_once_per_step);
  EXPECT_EQ(gathers(per_micro), 2 * 4 * (6 * 2 + 1 + 2));
  // Without a pipeline the default keeps ZeRO-3's per-micro-batch bound.
  TrainingPlan flat = PipelinePlan(1, 2, 4, PipelineSchedule::k1F1B, 1, 3);
  ASSERT_OK_AND_ASSIGN(StepGraph flat_step, PlanTrainingStep(model, flat, CpuRegistry()));
  EXPECT_FALSE(flat_step.gather_once_per_step);
  EXPECT_NE(flat_step.gather_reason.find("prefetch_layers"), std::string::npos);
}

TEST(PipelinePlanTest, BadPipelinesAreRefusedBeforeRunningWithWhatToChange) {
  const ModelSpec model = *BuildGpt2(SixBlocks());
  auto refusal = [&](const TrainingPlan& plan) {
    return PlanTrainingStep(model, plan, CpuRegistry()).status();
  };
  TrainingPlan too_deep = PipelinePlan(9, 1, 9, PipelineSchedule::kGPipe);
  EXPECT_EQ(refusal(too_deep).message(),
            "9 pipeline stage(s) x 1 virtual stage(s) cut the model into 9 chunks, but model "
            "'gpt2' has 8 layers: use at most 8 stages");
  TrainingPlan wrong_workers = PipelinePlan(2, 2, 2, PipelineSchedule::k1F1B);
  wrong_workers.parallel.workers.pop_back();
  EXPECT_EQ(refusal(wrong_workers).message(),
            "3 worker(s) given for 2 pipeline stages x 2 data-parallel ranks: a pipeline needs P x "
            "D = 4 workers");
  EXPECT_EQ(refusal(PipelinePlan(4, 1, 2, PipelineSchedule::k1F1B)).message(),
            "schedule 1f1b needs at least as many micro-batches as pipeline stages (2 < 4): use "
            "--micro-batches 4 or more, or --schedule gpipe");
  // Zero-bubble schedules need layers whose backward splits.
  ModelSpec unsplit = model;
  for (LayerSpec& layer : unsplit.layers) layer.backward_input_op = layer.backward_weight_op = "";
  EXPECT_EQ(PlanTrainingStep(unsplit, PipelinePlan(2, 1, 4, PipelineSchedule::kZbH1), CpuRegistry())
                .status()
                .message(),
            "schedule zb-h1 splits each backward into input and weight gradients, but no layer of "
            "model 'gpt2' has a split backward (one that returns input gradients): use "
            "--schedule 1f1b, interleaved or gpipe");
  // A cut that leaves a stage without parameters, under ZeRO: costs that put the loss layer
  // (which has none) alone on the last stage.
  ModelBuilder builder("two_layers", CpuRegistry());
  ModelValue x = builder.Input("x", DType::kF32, Shape{1, 8});
  ModelValue y = builder.Input("y", DType::kI32, Shape{1}, /*label=*/true);
  ModelValue h = builder.Layer("fc1", {x}, [](LayerBuilder& l) {
    return l.Call("linear_forward", {l.input(0), l.Param("w", Shape{8, 8}, ParamInit::Normal(0.1)),
                                     l.Param("b", Shape{8}, ParamInit::Zeros())});
  });
  ModelValue logits = builder.Layer("fc2", {h}, [](LayerBuilder& l) {
    return l.Call("linear_forward", {l.input(0), l.Param("w", Shape{3, 8}, ParamInit::Normal(0.1)),
                                     l.Param("b", Shape{3}, ParamInit::Zeros())});
  });
  builder.Loss("loss", {logits, y}, [](LayerBuilder& l) {
    return l.Call("softmax_cross_entropy", {l.input(0), l.input(1)});
  });
  ASSERT_OK_AND_ASSIGN(ModelSpec small, builder.Build());
  TrainingPlan empty_stage = PipelinePlan(2, 2, 2, PipelineSchedule::k1F1B, 1, 1);
  empty_stage.parallel.layer_costs = {1, 1, 1000};
  EXPECT_EQ(PlanTrainingStep(small, empty_stage, CpuRegistry()).status().message(),
            "pipeline stage 1 holds no parameters, but ZeRO stage 1 shards each stage's "
            "parameters over its 2 ranks: use fewer pipeline stages, give the layers costs that "
            "move the cut, or use --zero-stage 0");
  empty_stage.parallel.zero_stage = 0;  // without ZeRO such a stage is only wasteful
  EXPECT_OK(PlanTrainingStep(small, empty_stage, CpuRegistry()).status());
  TrainingPlan short_costs = PipelinePlan(2, 1, 2, PipelineSchedule::k1F1B);
  short_costs.parallel.layer_costs.assign(7, 1.0);
  EXPECT_EQ(refusal(short_costs).message(), "7 layer costs given for a model of 8 layers");
}

}  // namespace
}  // namespace tessera::testing

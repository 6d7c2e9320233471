// Step time prediction (planner/step_time.h) on planned GPT-2 steps with made-up layer times:
// layer tasks take their layer's time, recomputes a forward more, a backward that rebuilds part
// of what its forward saved a share of the forward more, everything else the op cost model's
// estimate at a measured rate of such tasks or the layers'; each worker its own sum. (Against
// measured steps: bench_memory.)
#include "planner/step_time.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model/gpt2.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

struct Gpt2Step {
  ModelSpec model = *BuildGpt2(Gpt2Config{4, 32, 4, 64, 16});  // embedding, h.0-h.3, head
  TrainingPlan plan{.batch = 4, .seq_len = 16};
  // 1 ms forwards and 2 ms whole backwards (in two halves of 1.5 and 0.5).
  std::vector<OpCosts> layer_ms = std::vector<OpCosts>(model.layers.size(), OpCosts{1, 1.5, 0.5});

  StepTimePrediction Predict(const TrainingPlan& p) const {
    Result<StepGraph> step = PlanTrainingStep(model, p, CpuRegistry());
    TESSERA_CHECK(step.ok(), "{}", step.status().ToString());
    Result<StepTimePrediction> predicted =
        PredictStepTime(step->graph, model, layer_ms, CpuRegistry());
    TESSERA_CHECK(predicted.ok(), "{}", predicted.status().ToString());
    return *predicted;
  }
};

TEST(StepTimeTest, LayerTasksTakeTheirLayersTimesAndTheRestIsEstimated) {
  const Gpt2Step g;
  const StepTimePrediction one = g.Predict(g.plan);
  ASSERT_EQ(one.worker_ms.size(), 1u);
  EXPECT_DOUBLE_EQ(one.layer_ms, 6 * (1 + 2));  // six layers, a forward and a whole backward
  EXPECT_GT(one.other_ms, 0);                   // the optimizer's updates, at the forwards' rate
  EXPECT_DOUBLE_EQ(one.step_ms, one.layer_ms + one.other_ms);
  // Two micro-batches: every layer task twice, the updates once.
  TrainingPlan two = g.plan;
  two.parallel.micro_batches = 2;
  const StepTimePrediction accumulated = g.Predict(two);
  EXPECT_DOUBLE_EQ(accumulated.layer_ms, 2 * one.layer_ms);
  EXPECT_GT(accumulated.other_ms, one.other_ms);  // the gradients' accumulation besides
  // Split backwards: the halves' own times, the same sum.
  TrainingPlan split = g.plan;
  split.parallel.split_backwards = true;
  EXPECT_DOUBLE_EQ(g.Predict(split).layer_ms, one.layer_ms);
}

// Given a measured rate for the tasks that are no layer's, each is its estimate at that rate;
// the layers' tasks keep their measured times.
TEST(StepTimeTest, TasksOfNoLayerTakeTheirMeasuredRate) {
  const Gpt2Step g;
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(g.model, g.plan, CpuRegistry()));
  const double rate = 2.5e-9;  // ms per unit
  ASSERT_OK_AND_ASSIGN(std::vector<TaskTime> times,
                       EstimateTaskTimes(step.graph, g.model, g.layer_ms, CpuRegistry(), 0, rate));
  ASSERT_OK_AND_ASSIGN(std::vector<TaskTime> at_forwards,
                       EstimateTaskTimes(step.graph, g.model, g.layer_ms, CpuRegistry()));
  ASSERT_EQ(times.size(), static_cast<size_t>(step.graph.num_tasks()));
  int others = 0;
  for (size_t t = 0; t < times.size(); ++t) {
    const TaskSpec& task = step.graph.tasks()[t];
    if (times[t].layer) {
      EXPECT_DOUBLE_EQ(times[t].ms, at_forwards[t].ms) << task.name;
      continue;
    }
    ++others;
    ASSERT_OK_AND_ASSIGN(const double units, TaskCostUnits(step.graph, task, CpuRegistry()));
    EXPECT_GT(units, 0) << task.name;
    EXPECT_DOUBLE_EQ(times[t].ms, units * rate) << task.name;
    EXPECT_NE(times[t].ms, at_forwards[t].ms) << task.name;
  }
  EXPECT_GT(others, 0);  // the optimizer's updates
}

TEST(StepTimeTest, RecomputesAndRebuildsAddToTheStep) {
  const Gpt2Step g;
  const StepTimePrediction kept = g.Predict(g.plan);
  TrainingPlan all = g.plan;
  all.memory.recompute_all = true;
  // Every block runs its forward again (the embedding saves nothing; the loss layer's backward
  // follows its forward).
  EXPECT_DOUBLE_EQ(g.Predict(all).layer_ms, kept.layer_ms + 4 * 1);
  // Half the activations: some blocks are kept in part, their backwards rebuilding the rest for a
  // share of a forward each.
  TrainingPlan half = g.plan;
  half.memory.activation_budget = 0.5;
  half.parallel.layer_op_costs = g.layer_ms;
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(g.model, half, CpuRegistry()));
  const int parts = CountChoice(step.memory.activations, ActivationChoice::kKeepPart);
  const int recomputes = CountChoice(step.memory.activations, ActivationChoice::kRecompute);
  ASSERT_GT(parts, 0) << step.memory.reason;
  ASSERT_OK_AND_ASSIGN(StepTimePrediction planned,
                       PredictStepTime(step.graph, g.model, g.layer_ms, CpuRegistry()));
  const double rebuilds = planned.layer_ms - kept.layer_ms - recomputes * 1.0;
  EXPECT_GT(rebuilds, 0);
  EXPECT_LT(rebuilds, parts * 1.0);
}

TEST(StepTimeTest, AnOverheadPerTaskIsAddedForEveryTask) {
  const Gpt2Step g;
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(g.model, g.plan, CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(StepTimePrediction bare,
                       PredictStepTime(step.graph, g.model, g.layer_ms, CpuRegistry()));
  ASSERT_OK_AND_ASSIGN(StepTimePrediction loaded,
                       PredictStepTime(step.graph, g.model, g.layer_ms, CpuRegistry(), 0.25));
  EXPECT_DOUBLE_EQ(loaded.overhead_ms, 0.25 * step.graph.num_tasks());
  EXPECT_DOUBLE_EQ(loaded.step_ms, bare.step_ms + loaded.overhead_ms);
}

// A CPU worker swapping to its swap file: the copies run beside the compute, so they add only the
// compute time they take from it, their bytes times what a byte takes.
TEST(StepTimeTest, CopiesToTheDiskAddTheProcessorTimeTheyTake) {
  const Gpt2Step g;
  TrainingPlan swapped = g.plan;
  swapped.memory.activation_budget = 0.5;
  swapped.memory.disk_link_bytes_per_us = 1e6;  // far faster than a 1 ms layer: copies hide
  swapped.parallel.layer_op_costs = g.layer_ms;
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(g.model, swapped, CpuRegistry()));
  ASSERT_GT(CountChoice(step.memory.activations, ActivationChoice::kSwap), 0) << step.memory.reason;
  int64_t copied = 0;
  for (const TaskSpec& task : step.graph.tasks()) {
    if (task.name.find("/swap_") == std::string::npos) continue;
    for (ObjectId output : task.outputs) copied += step.graph.object(output).meta.bytes();
  }
  ASSERT_GT(copied, 0);
  ASSERT_OK_AND_ASSIGN(StepTimePrediction free_copies,
                       PredictStepTime(step.graph, g.model, g.layer_ms, CpuRegistry()));
  const double us_per_byte = 1e-3;
  ASSERT_OK_AND_ASSIGN(StepTimePrediction taxed, PredictStepTime(step.graph, g.model, g.layer_ms,
                                                                 CpuRegistry(), 0, us_per_byte));
  EXPECT_DOUBLE_EQ(taxed.layer_ms, free_copies.layer_ms);
  EXPECT_NEAR(taxed.other_ms - free_copies.other_ms,
              static_cast<double>(copied) * us_per_byte / 1e3, 1e-9);
}

TEST(StepTimeTest, EachWorkerSumsItsOwnTasks) {
  const Gpt2Step g;
  TrainingPlan two = g.plan;
  two.parallel.data_parallel = 2;
  two.parallel.workers = {WorkerId(1), WorkerId(2)};
  const StepTimePrediction predicted = g.Predict(two);
  ASSERT_EQ(predicted.worker_ms.size(), 2u);
  EXPECT_DOUBLE_EQ(predicted.worker_ms[0], predicted.worker_ms[1]);
  EXPECT_DOUBLE_EQ(predicted.layer_ms, 6 * (1 + 2));  // each rank runs every layer once
}

TEST(StepTimeTest, MissingOrEmptyLayerTimesAreRefused) {
  const Gpt2Step g;
  ASSERT_OK_AND_ASSIGN(StepGraph step, PlanTrainingStep(g.model, g.plan, CpuRegistry()));
  EXPECT_THAT(
      PredictStepTime(step.graph, g.model, {OpCosts{1, 2, 0}}, CpuRegistry()).status().message(),
      HasSubstr("1 measured layer times for a model of 6 layers"));
  const std::vector<OpCosts> zeros(g.model.layers.size(), OpCosts{0, 0, 0});
  EXPECT_THAT(PredictStepTime(step.graph, g.model, zeros, CpuRegistry()).status().message(),
              HasSubstr("measure them first"));
}

}  // namespace
}  // namespace tessera::testing

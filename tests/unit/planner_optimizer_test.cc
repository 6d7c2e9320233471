// The optimizer pass (planner/optimizer_pass.cc): each update's target, addressing and names,
// and the gather that follows it where the policy asks for one.
#include <set>
#include <tuple>

#include <gmock/gmock.h>

#include "core/collective_task.h"
#include "planner_test_util.h"

namespace tessera::testing {
namespace {

using ::testing::ElementsAre;

TEST(UpdateOptimizerPassTest, AdamWAddressesItsPieceOfTheGroup) {
  const ModelSpec model = TinyGpt2();
  // Per stage: the attribute placing rank 1's shard (param_offset: the shard inside the full
  // parameters; element_offset: the parameters are the shard), and the updated target's name.
  struct Want {
    std::string offset_attr;  // empty: neither
    std::string next;
  };
  const Want want[] = {
      {"", "rank1/h.0.params.next"},
      {"param_offset", "rank1/h.0.params.next"},
      {"param_offset", "rank1/h.0.params.next"},
      {"element_offset", "rank1/h.0.params[shard].next"},
  };
  for (int zero = 0; zero <= 3; ++zero) {
    SCOPED_TRACE("stage " + std::to_string(zero));
    const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = zero});
    PlanState state(model, plan, CpuRegistry());
    ASSERT_OK(RunPassesThrough(state, "update_optimizer"));
    const TaskSpec* adamw = FindTask(state, "rank1/h.0/adamw");
    ASSERT_NE(adamw, nullptr);
    for (const std::string attr : {"param_offset", "element_offset"}) {
      EXPECT_EQ(adamw->attrs.Has(attr), attr == want[zero].offset_attr) << attr;
    }
    if (!want[zero].offset_attr.empty()) {
      EXPECT_EQ(adamw->attrs.GetInt(want[zero].offset_attr, -1), state.step.group_numel[1] / 2);
    }
    EXPECT_EQ(state.builder.graph().object(adamw->outputs[0]).name, want[zero].next);
    EXPECT_EQ(adamw->donations.size(), 3u) << "in place";
    EXPECT_EQ(adamw->priority, kOptimizerPriority);
    // ZeRO-1/2 exchange the updated shards in place inside the full parameters.
    const Result<TaskId> gather = state.builder.graph().FindTask("rank1/h.0/all_gather");
    EXPECT_EQ(gather.ok(), zero == 1 || zero == 2);
    const StateObject& params = state.step.state[state.ranks[1].param[1]];
    if (gather.ok()) {
      const TaskSpec& task = state.builder.graph().task(*gather);
      EXPECT_EQ(task.op, "all_gather_in_place");
      EXPECT_THAT(NamesOf(state, task.outputs), ElementsAre("rank1/h.0.params.gathered"));
      EXPECT_EQ(params.output, task.outputs[0]);
    } else {
      EXPECT_EQ(params.output, adamw->outputs[0]);
    }
    EXPECT_TRUE(state.builder.graph().IsOutput(params.output));
    EXPECT_TRUE(state.builder.graph().IsOutput(state.step.state[state.ranks[1].exp_avg[1]].output));
  }
}

TEST(UpdateOptimizerPassTest, SgdUpdatesTheParametersWithTheFactorAndLearningRate) {
  const ModelSpec model = TinyGpt2();
  TrainingPlan plan = MakeTinyPlan({.ranks = 2});
  plan.optimizer.kind = OptimizerConfig::Kind::kSgd;
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "update_optimizer"));
  const TaskSpec* sgd = FindTask(state, "rank0/head/sgd");
  ASSERT_NE(sgd, nullptr);
  EXPECT_THAT(
      NamesOf(state, sgd->inputs),
      ElementsAre("rank0/head.params", "rank0/head.grad_reduced", "rank0/clip_scale", "lr"));
  EXPECT_THAT(NamesOf(state, sgd->outputs), ElementsAre("rank0/head.params.next"));
  EXPECT_EQ(CountOp(state, "adamw"), 0);
}

// 0/1 Adam (planner/zero_one_adam.h): each kind of step's update of a group and what it
// communicates. Variance: 1-bit Adam's warm-up update of the all-reduced gradient. Compressed
// gradient: the rank's clipped gradient averaged compressed, then the update. Local: no
// collective but the loss's (a scalar). Sync: the local update, its accumulated updates averaged
// compressed, then the sync; its state holds every other kind's.
TEST(UpdateOptimizerPassTest, ZeroOneAdamsStepsUpdateAndCommunicateAsTheirKindSays) {
  using Step = OptimizerConfig::ZeroOneStep;
  const ModelSpec model = TinyGpt2();
  TrainingPlan plan = MakeTinyPlan({.ranks = 2});
  plan.optimizer.kind = OptimizerConfig::Kind::kZeroOneAdam;
  const auto plan_of = [&](Step step) {
    TrainingPlan kind = plan;
    kind.optimizer.zero_one_step = step;
    return kind;
  };
  const TrainingPlan variance_plan = plan_of(Step::kVariance);
  PlanState variance(model, variance_plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(variance, "update_optimizer"));
  const TaskSpec* warmup = FindTask(variance, "rank0/head/onebit_adam");
  ASSERT_NE(warmup, nullptr);
  EXPECT_EQ(NamesOf(variance, warmup->inputs)[1], "rank0/head.grad_reduced");
  EXPECT_EQ(CountOp(variance, "compressed_all_reduce"), 0);

  const TrainingPlan compressed_plan = plan_of(Step::kCompressedGradient);
  PlanState compressed(model, compressed_plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(compressed, "update_optimizer"));
  const TaskSpec* clip = FindTask(compressed, "rank0/head/clip_gradient");
  ASSERT_NE(clip, nullptr);
  EXPECT_EQ(clip->op, "scale");
  EXPECT_THAT(NamesOf(compressed, clip->inputs),
              ElementsAre("rank0/head.grad", "rank0/clip_scale"));
  const TaskSpec* average = FindTask(compressed, "rank0/head/compressed_all_reduce");
  ASSERT_NE(average, nullptr);
  EXPECT_THAT(NamesOf(compressed, average->inputs),
              ElementsAre("rank0/head.grad.clipped", "rank0/head.worker_error",
                          "rank0/head.server_error[shard]"));
  const TaskSpec* update = FindTask(compressed, "rank0/head/zero_one_adam_compressed");
  ASSERT_NE(update, nullptr);
  EXPECT_THAT(NamesOf(compressed, update->inputs),
              ElementsAre("rank0/head.params", "rank0/head.grad.averaged", "rank0/head.exp_avg",
                          "rank0/head.exp_avg_sq", "lr"));
  // No gradient is all-reduced, nor its norm: the only all-reduce is the loss's (a scalar).
  for (const TaskSpec& task : compressed.builder.graph().tasks()) {
    if (task.op != "all_reduce") continue;
    EXPECT_EQ(compressed.builder.graph().object(task.inputs[0]).meta.numel(), 1) << task.name;
  }

  const TrainingPlan local_plan = plan_of(Step::kLocal);
  PlanState local(model, local_plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(local, "update_optimizer"));
  const TaskSpec* local_update = FindTask(local, "rank1/head/zero_one_adam_local");
  ASSERT_NE(local_update, nullptr);
  EXPECT_THAT(
      NamesOf(local, local_update->inputs),
      ElementsAre("rank1/head.params", "rank1/head.grad", "rank1/head.exp_avg",
                  "rank1/head.exp_avg_sq", "rank1/head.interval_start", "rank1/clip_scale", "lr"));
  EXPECT_EQ(local_update->attrs.GetInt("sync", -1), 0);
  // Nothing but the step's mean loss (a scalar, for the report) is communicated.
  for (const TaskSpec& task : local.builder.graph().tasks()) {
    ASSERT_OK_AND_ASSIGN(std::optional<CollectiveMembership> member, CollectiveOf(task));
    if (!member.has_value()) continue;
    EXPECT_EQ(local.builder.graph().object(task.inputs[0]).meta.numel(), 1)
        << task.name << " communicates more than a scalar in a local step";
  }

  const TrainingPlan sync_plan = plan_of(Step::kSync);
  PlanState sync(model, sync_plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(sync, "update_optimizer"));
  const TaskSpec* begin = FindTask(sync, "rank0/head/zero_one_adam_local");
  ASSERT_NE(begin, nullptr);
  EXPECT_EQ(begin->attrs.GetInt("sync", -1), 1);
  const TaskSpec* accumulated = FindTask(sync, "rank0/head/compressed_all_reduce");
  ASSERT_NE(accumulated, nullptr);
  EXPECT_EQ(NamesOf(sync, accumulated->inputs)[0], "rank0/head.interval_start.local");
  const TaskSpec* end = FindTask(sync, "rank0/head/zero_one_adam_sync");
  ASSERT_NE(end, nullptr);
  EXPECT_THAT(
      NamesOf(sync, end->inputs),
      ElementsAre("rank0/head.params.local", "rank0/head.exp_avg.local",
                  "rank0/head.exp_avg_sq.local", "rank0/head.interval_start.averaged", "lr_sum"));
  EXPECT_THAT(NamesOf(sync, end->outputs),
              ElementsAre("rank0/head.params.next", "rank0/head.exp_avg.next",
                          "rank0/head.exp_avg_sq.next", "rank0/head.interval_start.next"));
  // The sync step's state is every kind's: each other kind's objects are among its own.
  const auto keys_of = [](const PlanState& state) {
    std::set<std::tuple<StateKind, size_t, int, int64_t>> keys;
    for (const StateObject& o : state.step.state) {
      keys.emplace(o.kind, o.piece.layer, o.piece.rank, o.piece.numel);
    }
    return keys;
  };
  const auto all = keys_of(sync);
  for (const PlanState* kind : {&variance, &compressed, &local}) {
    for (const auto& key : keys_of(*kind)) EXPECT_TRUE(all.contains(key));
  }
  EXPECT_GT(all.size(), keys_of(compressed).size());
  EXPECT_GT(all.size(), keys_of(local).size());
}

}  // namespace
}  // namespace tessera::testing

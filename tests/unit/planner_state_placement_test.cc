// The state placement pass (planner/state_placement.cc): the inputs per rank and micro-batch,
// and the state objects each rank holds, where they live and what they are called.
#include <gmock/gmock.h>

#include "planner_test_util.h"

namespace tessera::testing {
namespace {

using ::testing::ElementsAre;

TEST(PlaceStatePassTest, InputsPerRankAndMicroBatchOfTheMicroBatchRows) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .micro = 2});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "place_state"));
  EXPECT_EQ(state.step.micro_batch_rows, 2);
  ASSERT_EQ(state.step.inputs.size(), 2u);  // tokens, targets
  EXPECT_THAT(NamesOf(state, state.step.inputs[0]),
              ElementsAre("rank0/tokens@0", "rank0/tokens@1", "rank1/tokens@0", "rank1/tokens@1"));
  EXPECT_EQ(state.builder.meta(state.step.inputs[1][3]).shape, (Shape{2, 16}));
  EXPECT_EQ(state.builder.graph().num_tasks(), 0) << "placement adds inputs only";
}

TEST(PlaceStatePassTest, EachRankHoldsThePiecesItsStageGivesIt) {
  const ModelSpec model = TinyGpt2();
  for (int zero = 0; zero <= 3; ++zero) {
    SCOPED_TRACE("stage " + std::to_string(zero));
    const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = zero});
    PlanState state(model, plan, CpuRegistry());
    ASSERT_OK(RunPassesThrough(state, "place_state"));
    ASSERT_EQ(state.step.state.size(), 2u * 4u * 3u);  // ranks x groups x (params, 2 moments)
    const RankState& rank1 = state.ranks[1];
    const StateObject& params = state.step.state[rank1.param[1]];
    const StateObject& moment = state.step.state[rank1.exp_avg[1]];
    const int64_t full = state.step.group_numel[1];
    EXPECT_EQ(full % (zero >= 1 ? 2 : 1), 0) << "groups padded to equal shards";
    EXPECT_EQ(params.piece.numel, zero == 3 ? full / 2 : full);
    EXPECT_EQ(moment.piece.numel, zero >= 1 ? full / 2 : full);
    EXPECT_EQ(moment.piece.begin, zero >= 1 ? full / 2 : 0);
    EXPECT_EQ(state.builder.graph().object(params.input).name,
              zero == 3 ? "rank1/h.0.params[shard]" : "rank1/h.0.params");
    EXPECT_EQ(state.builder.graph().object(moment.input).name,
              zero >= 1 ? "rank1/h.0.exp_avg[shard]" : "rank1/h.0.exp_avg");
    EXPECT_EQ(rank1.master[1], kNoState) << "no master copy without a host update";
  }
}

// Under offload on GPU workers the master copy and the moments live in the host tier, with lr
// and step; the parameters stay on the GPU.
TEST(PlaceStatePassTest, AHostUpdateKeepsMasterAndMomentsOnTheHost) {
  const ModelSpec model = TinyGpt2();
  const TrainingPlan plan = MakeTinyPlan({.ranks = 2, .zero = 2, .offload_to_gpu_host = true});
  PlanState state(model, plan, CpuRegistry());
  ASSERT_OK(RunPassesThrough(state, "place_state"));
  EXPECT_EQ(state.step.state.size(), 2u * 4u * 4u);
  for (const StateObject& object : state.step.state) {
    const Device device = state.builder.meta(object.input).device;
    EXPECT_EQ(device, object.kind == StateKind::kParameter ? Device::Cuda(0) : Device::Cpu())
        << StateKindName(object.kind);
  }
  const StateObject& master = state.step.state[state.ranks[0].master[2]];
  EXPECT_EQ(master.kind, StateKind::kMasterParameter);
  EXPECT_EQ(master.piece.numel, state.step.group_numel[2] / 2);
  EXPECT_EQ(state.builder.meta(state.step.lr).device, Device::Cpu());
  EXPECT_EQ(state.builder.meta(state.step.step).device, Device::Cpu());
  EXPECT_EQ(state.builder.meta(state.step.inputs[0][0]).device, Device::Cuda(0));
}

}  // namespace
}  // namespace tessera::testing

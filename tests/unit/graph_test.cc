// The graph IR and the graph builder: structure, validation, ordering, shape inference.
#include "core/graph.h"
#include "core/collective_task.h"
#include "ops/graph_builder.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

TensorMeta F32(Shape shape) { return {std::move(shape), DType::kF32, Device::Cpu()}; }

TEST(GraphTest, BuilderInfersOutputsAndValidates) {
  GraphBuilder builder(CpuRegistry());
  ObjectId a = builder.AddInput("a", F32({4, 8}), ObjectRole::kInput);
  ObjectId b = builder.AddInput("b", F32({8, 3}), ObjectRole::kParameter);
  ASSERT_OK_AND_ASSIGN(auto c, builder.AddTask("mm", "matmul_forward", {a, b}, {}));
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(builder.meta(c[0]), F32({4, 3}));
  builder.MarkOutput(c[0]);
  ASSERT_OK_AND_ASSIGN(Graph graph, builder.Build());
  EXPECT_EQ(graph.num_tasks(), 1);
  EXPECT_EQ(graph.InputObjects(), (std::vector<ObjectId>{a, b}));
  EXPECT_EQ(graph.object(c[0]).name, "mm:c");
  EXPECT_EQ(graph.object(c[0]).producer, TaskId(1));
  EXPECT_EQ(graph.task(TaskId(1)).memory_estimate_bytes, 4 * 3 * 4);
  EXPECT_EQ(*graph.FindObject("mm:c"), c[0]);
  EXPECT_FALSE(graph.FindTask("nope").ok());
}

TEST(GraphTest, BuilderCopiesInPlacePairsIntoDonations) {
  GraphBuilder builder(CpuRegistry());
  ObjectId logits = builder.AddInput("logits", F32({2, 5}), ObjectRole::kActivation);
  ObjectId targets =
      builder.AddInput("targets", {Shape{2}, DType::kI32, Device::Cpu()}, ObjectRole::kInput);
  ASSERT_OK(builder.AddTask("xent", "softmax_cross_entropy", {logits, targets}, {}).status());
  ASSERT_OK_AND_ASSIGN(Graph graph, builder.Build());
  EXPECT_EQ(graph.task(TaskId(1)).donations, (std::vector<Donation>{{0, 1}}));
}

TEST(GraphTest, UnknownOpAndWrongArityAreReportedWithTheTask) {
  GraphBuilder builder(CpuRegistry());
  ObjectId a = builder.AddInput("a", F32({4}), ObjectRole::kInput);
  Result<std::vector<ObjectId>> unknown = builder.AddTask("t1", "no_such_op", {a}, {});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("task 't1'"), std::string::npos);
  Result<std::vector<ObjectId>> arity = builder.AddTask("t2", "add_forward", {a}, {});
  ASSERT_FALSE(arity.ok());
  EXPECT_NE(arity.status().message().find("takes 2 inputs, got 1"), std::string::npos);
}

TEST(GraphTest, ValidateRejectsDuplicateNamesAndBadDonations) {
  Graph graph;
  graph.AddObject("x", F32({4}), ObjectRole::kInput);
  graph.AddObject("x", F32({4}), ObjectRole::kInput);
  Status duplicate = graph.Validate();
  ASSERT_FALSE(duplicate.ok());
  EXPECT_NE(duplicate.message().find("two objects are named 'x'"), std::string::npos);

  Graph donation;
  ObjectId in = donation.AddObject("in", F32({4}), ObjectRole::kInput);
  ObjectId out = donation.AddObject("out", F32({8}), ObjectRole::kActivation);
  TaskSpec task;
  task.name = "t";
  task.op = "gelu_forward";
  task.inputs = {in};
  task.outputs = {out};
  task.donations = {{0, 0}};
  donation.AddTask(task);
  Status bad = donation.Validate();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("sizes or devices differ"), std::string::npos);
}

TEST(GraphTest, TopologicalOrderPrefersHigherPriorityAndDetectsCycles) {
  Graph graph;
  ObjectId x = graph.AddObject("x", F32({1}), ObjectRole::kInput);
  ObjectId y = graph.AddObject("y", F32({1}), ObjectRole::kActivation);
  ObjectId z = graph.AddObject("z", F32({1}), ObjectRole::kActivation);
  auto add = [&](std::string name, std::vector<ObjectId> in, ObjectId out, int priority) {
    TaskSpec task;
    task.name = std::move(name);
    task.op = "gelu_forward";
    task.inputs = std::move(in);
    task.outputs = {out};
    task.priority = priority;
    return graph.AddTask(task);
  };
  TaskId low = add("low", {x}, y, 0);
  TaskId high = add("high", {x}, z, 5);
  ASSERT_OK_AND_ASSIGN(auto order, graph.TopologicalOrder());
  EXPECT_EQ(order, (std::vector<TaskId>{high, low}));

  Graph cyclic;
  ObjectId a = cyclic.AddObject("a", F32({1}), ObjectRole::kActivation);
  ObjectId b = cyclic.AddObject("b", F32({1}), ObjectRole::kActivation);
  TaskSpec t1{.name = "t1", .op = "gelu_forward", .inputs = {b}, .outputs = {a}};
  TaskSpec t2{.name = "t2", .op = "gelu_forward", .inputs = {a}, .outputs = {b}};
  cyclic.AddTask(t1);
  cyclic.AddTask(t2);
  Status cycle = cyclic.Validate();
  ASSERT_FALSE(cycle.ok());
  EXPECT_NE(cycle.message().find("cycle"), std::string::npos);
}

TEST(GraphTest, ControlEdgesOrderTasksAndTheirCyclesAreRefused) {
  Graph graph;
  ObjectId x = graph.AddObject("x", F32({1}), ObjectRole::kInput);
  ObjectId y = graph.AddObject("y", F32({1}), ObjectRole::kActivation);
  ObjectId z = graph.AddObject("z", F32({1}), ObjectRole::kActivation);
  TaskId first = graph.AddTask(
      {.name = "first", .op = "gelu_forward", .inputs = {x}, .outputs = {y}, .priority = 0});
  TaskId second = graph.AddTask(
      {.name = "second", .op = "gelu_forward", .inputs = {x}, .outputs = {z}, .priority = 5});
  // Without the edge the higher priority goes first; with it, the edge decides.
  graph.AddControlEdge(first, second);
  graph.AddControlEdge(first, second);  // once is enough
  EXPECT_EQ(graph.task(second).after, (std::vector<TaskId>{first}));
  ASSERT_OK_AND_ASSIGN(auto order, graph.TopologicalOrder());
  EXPECT_EQ(order, (std::vector<TaskId>{first, second}));
  EXPECT_OK(graph.Validate());

  graph.AddControlEdge(second, first);
  Status cycle = graph.Validate();
  ASSERT_FALSE(cycle.ok());
  EXPECT_NE(cycle.message().find("cycle"), std::string::npos) << cycle.ToString();

  Graph dangling;
  ObjectId a = dangling.AddObject("a", F32({1}), ObjectRole::kInput);
  ObjectId b = dangling.AddObject("b", F32({1}), ObjectRole::kActivation);
  dangling.AddTask(
      {.name = "t", .op = "gelu_forward", .inputs = {a}, .outputs = {b}, .after = {TaskId(7)}});
  Status unknown = dangling.Validate();
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.message().find("task 't' is after"), std::string::npos) << unknown.ToString();
}

TEST(GraphTest, CostsComeFromTheRegistry) {
  ASSERT_OK_AND_ASSIGN(OpCost cost,
                       CpuRegistry().Cost("matmul_forward", {F32({4, 8}), F32({8, 3})}, {}));
  EXPECT_DOUBLE_EQ(cost.flops, 2.0 * 4 * 8 * 3);
  EXPECT_GT(cost.bytes, 0);
}

}  // namespace
}  // namespace tessera::testing

namespace tessera::testing {
namespace {

TaskSpec MemberTask(const std::string& name, int64_t collective, int rank, int size,
                    std::vector<ObjectId> inputs, std::vector<ObjectId> outputs) {
  TaskSpec task;
  task.name = name;
  task.op = "all_reduce";
  task.attrs =
      Attrs{{"collective", collective}, {"rank", int64_t{rank}}, {"group_size", int64_t{size}}};
  task.inputs = std::move(inputs);
  task.outputs = std::move(outputs);
  return task;
}

TEST(CollectiveTaskTest, MembersMustCoverEveryRankOnce) {
  std::vector<TaskSpec> tasks = {MemberTask("a0", 1, 0, 2, {}, {}),
                                 MemberTask("a1", 1, 0, 2, {}, {})};
  Status duplicate = ValidateCollectives(tasks);
  EXPECT_NE(duplicate.message().find("'a0' and 'a1' are both rank 0"), std::string::npos)
      << duplicate.ToString();
  tasks = {MemberTask("a0", 1, 0, 3, {}, {}), MemberTask("a1", 1, 1, 3, {}, {})};
  EXPECT_NE(ValidateCollectives(tasks).message().find("no member of rank 2"), std::string::npos);
  tasks = {MemberTask("a0", 1, 0, 2, {}, {}), MemberTask("a1", 1, 1, 3, {}, {})};
  EXPECT_NE(ValidateCollectives(tasks).message().find("disagrees"), std::string::npos);
  tasks = {MemberTask("a0", 1, 5, 2, {}, {})};
  EXPECT_EQ(ValidateCollectives(tasks).code(), StatusCode::kInvalidArgument);
}

// Members share a channel, one of the worker's kCollectiveChannels.
TEST(CollectiveTaskTest, MembersShareAChannelTheWorkersHave) {
  std::vector<TaskSpec> tasks = {MemberTask("a0", 1, 0, 2, {}, {}),
                                 MemberTask("a1", 1, 1, 2, {}, {})};
  tasks[0].attrs.Set(kChannelAttr, int64_t{kGatherChannel});
  tasks[1].attrs.Set(kChannelAttr, int64_t{kGatherChannel});
  ASSERT_OK_AND_ASSIGN(std::optional<CollectiveMembership> membership, CollectiveOf(tasks[0]));
  EXPECT_EQ(membership->channel, kGatherChannel);
  EXPECT_OK(ValidateCollectives(tasks));
  tasks[1].attrs.Set(kChannelAttr, int64_t{0});
  EXPECT_EQ(ValidateCollectives(tasks).message(),
            "collective 1: task 'a1' is on channel 0, its other members on channel 1");
  tasks[1].attrs.Set(kChannelAttr, int64_t{kCollectiveChannels});
  EXPECT_EQ(CollectiveOf(tasks[1]).status().message(),
            "collective task 'a1': channel 4 is not one of 0 .. 3");
  tasks[1].attrs.Set(kChannelAttr, int64_t{-1});
  EXPECT_EQ(ValidateCollectives(tasks).code(), StatusCode::kInvalidArgument);
}

// Objects 1..8; producer[o] is the task (1-based) producing object o.
struct TaskList {
  std::vector<TaskSpec> tasks;
  std::map<uint64_t, TaskId> producer;
  void Add(TaskSpec task) {
    task.id = TaskId(tasks.size() + 1);
    for (ObjectId out : task.outputs) producer[out.value()] = task.id;
    tasks.push_back(std::move(task));
  }
  Result<std::vector<int64_t>> Order() const {
    return OrderCollectives(tasks, [this](ObjectId object) {
      auto it = producer.find(object.value());
      return it == producer.end() ? TaskId() : it->second;
    });
  }
};

TEST(CollectiveTaskTest, TheOrderFollowsDependenciesNotListPositions) {
  // B's rank-0 member is listed first but B's rank-1 member depends on A: A must come first
  // (a worker running A1 then B1 and another running B0 then A0 would deadlock otherwise).
  TaskList list;
  list.Add(MemberTask("b0", 2, 0, 2, {ObjectId(1)}, {ObjectId(2)}));
  list.Add(MemberTask("a0", 1, 0, 2, {ObjectId(3)}, {ObjectId(4)}));
  list.Add(MemberTask("a1", 1, 1, 2, {ObjectId(5)}, {ObjectId(6)}));
  list.Add(MemberTask("b1", 2, 1, 2, {ObjectId(6)}, {ObjectId(7)}));
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> order, list.Order());
  EXPECT_EQ(order, (std::vector<int64_t>{1, 2}));
}

// A pipeline schedule orders tasks with control edges that can point against the list: here
// compute task c (listed last, after A's members) must run before B1 (listed first). B's member
// waits for c, and c waits for A0's result: A comes first, though B's members come first in
// the list and share no data with A.
TEST(CollectiveTaskTest, TheOrderFollowsControlEdgesToo) {
  TaskList list;
  list.Add(MemberTask("b0", 2, 0, 2, {}, {ObjectId(1)}));
  list.Add(MemberTask("b1", 2, 1, 2, {}, {ObjectId(2)}));
  list.Add(MemberTask("a0", 1, 0, 2, {}, {ObjectId(3)}));
  list.Add(MemberTask("a1", 1, 1, 2, {}, {ObjectId(4)}));
  TaskSpec compute;
  compute.name = "c";
  compute.op = "noop";
  compute.inputs = {ObjectId(3)};
  compute.outputs = {ObjectId(5)};
  list.Add(compute);
  list.tasks[1].after = {TaskId(5)};  // b1 after c
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> order, list.Order());
  EXPECT_EQ(order, (std::vector<int64_t>{1, 2}));
  // A control edge that closes a cycle is refused.
  list.tasks[2].after = {TaskId(5)};  // a0 after c, which reads a0's output
  Result<std::vector<int64_t>> cyclic = list.Order();
  ASSERT_FALSE(cyclic.ok());
  EXPECT_NE(cyclic.status().message().find("wait for each other in a cycle"), std::string::npos)
      << cyclic.status().ToString();
}

TEST(CollectiveTaskTest, CollectivesThatWaitForEachOtherAreRefused) {
  TaskList list;
  list.Add(MemberTask("a0", 1, 0, 2, {}, {ObjectId(1)}));
  list.Add(MemberTask("b0", 2, 0, 2, {ObjectId(1)}, {ObjectId(2)}));  // B after A
  list.Add(MemberTask("b1", 2, 1, 2, {}, {ObjectId(3)}));
  list.Add(MemberTask("a1", 1, 1, 2, {ObjectId(3)}, {ObjectId(4)}));  // A after B
  Result<std::vector<int64_t>> order = list.Order();
  ASSERT_FALSE(order.ok());
  EXPECT_NE(order.status().message().find("collectives 1 and 2 depend on each other"),
            std::string::npos)
      << order.status().ToString();
}

}  // namespace
}  // namespace tessera::testing

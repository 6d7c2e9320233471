// The graph IR and the graph builder: structure, validation, ordering, shape inference.
#include "core/graph.h"
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

TEST(GraphTest, CostsComeFromTheRegistry) {
  ASSERT_OK_AND_ASSIGN(OpCost cost,
                       CpuRegistry().Cost("matmul_forward", {F32({4, 8}), F32({8, 3})}, {}));
  EXPECT_DOUBLE_EQ(cost.flops, 2.0 * 4 * 8 * 3);
  EXPECT_GT(cost.bytes, 0);
}

}  // namespace
}  // namespace tessera::testing

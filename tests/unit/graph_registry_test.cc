// Decoding and checking a registered graph (scheduler/graph_registry.h: GraphFromWire). The
// registry's placement, refusals and instances are driven through SchedulerCore in
// scheduler_core_test.cc.
#include "scheduler/graph_registry.h"

#include "test_util.h"
#include "unit/scheduler_test_graphs.h"

namespace tessera::testing {
namespace {

// `graph` as a driver sends it, then decoded by the scheduler.
Result<Graph> RoundTrip(const Graph& graph, uint64_t graph_id = 4) {
  capnp::MallocMessageBuilder message;
  auto wire = message.initRoot<proto::RegisterGraph>();
  RegisterGraphToWire(graph, graph_id, wire);
  return GraphFromWire(graph_id, wire.asReader(), rpc::WireLimits{});
}

TaskSpec Gelu(const std::string& name, std::vector<ObjectId> inputs,
              std::vector<ObjectId> outputs) {
  TaskSpec spec;
  spec.name = name;
  spec.op = "gelu_forward";
  spec.inputs = std::move(inputs);
  spec.outputs = std::move(outputs);
  return spec;
}

TEST(GraphFromWireTest, AGraphComesBackWithItsProducersInputsAndOutputs) {
  Graph graph;
  const ObjectId x = graph.AddObject("x", Floats(4), ObjectRole::kInput);
  const ObjectId y = graph.AddObject("y", Floats(4), ObjectRole::kActivation);
  const ObjectId z = graph.AddObject("z", Floats(4), ObjectRole::kOutput);
  graph.AddTask(Gelu("a", {x}, {y}));
  graph.AddTask(Gelu("b", {y}, {z}));
  graph.MarkOutput(z);
  ASSERT_OK_AND_ASSIGN(Graph decoded, RoundTrip(graph));
  EXPECT_EQ(decoded.num_tasks(), 2);
  EXPECT_EQ(decoded.object(z).producer, TaskId(2));
  EXPECT_EQ(decoded.object(z).role, ObjectRole::kOutput);
  EXPECT_EQ(decoded.InputObjects(), (std::vector<ObjectId>{x}));
  EXPECT_EQ(decoded.OutputObjects(), (std::vector<ObjectId>{z}));
  EXPECT_EQ(decoded.task(TaskId(2)).name, "b");
}

TEST(GraphFromWireTest, WhatGraphValidateRefusesIsRefusedNamingTheGraph) {
  {
    Graph twins;
    const ObjectId x = twins.AddObject("x", Floats(4), ObjectRole::kInput);
    const ObjectId y = twins.AddObject("x", Floats(4), ObjectRole::kActivation);
    twins.AddTask(Gelu("a", {x}, {y}));
    const Status status = RoundTrip(twins).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(status.message(), "graph 4: two objects are named 'x'");
  }
  {
    Graph opless;
    const ObjectId x = opless.AddObject("x", Floats(4), ObjectRole::kInput);
    const ObjectId y = opless.AddObject("y", Floats(4), ObjectRole::kActivation);
    TaskSpec spec = Gelu("a", {x}, {y});
    spec.op.clear();
    opless.AddTask(std::move(spec));
    EXPECT_EQ(RoundTrip(opless).status().message(), "graph 4: task 'a' has no op");
  }
  {
    // a reads b's output and b reads a's: placed as if both read graph inputs, they would wait
    // for each other forever.
    Graph cycle;
    const ObjectId x = cycle.AddObject("x", Floats(4), ObjectRole::kActivation);
    const ObjectId y = cycle.AddObject("y", Floats(4), ObjectRole::kActivation);
    cycle.AddTask(Gelu("a", {y}, {x}));
    cycle.AddTask(Gelu("b", {x}, {y}));
    EXPECT_EQ(RoundTrip(cycle).status().message(), "graph 4: graph has a cycle through task 'a'");
  }
}

// A submitted task's one-task template: found again by what it computes (metas, op, attributes,
// wiring), whatever the cluster ids; an input read twice stays one graph input. (A miss also
// checks, inside TaskTemplate, that the key made without the graph is the graph's key.)
TEST(TaskTemplateTest, TheSameComputationOnOtherObjectsFindsTheSameTemplate) {
  GraphRegistry registry(nullptr, nullptr, nullptr);
  auto add_twice = [](uint64_t a, uint64_t b, uint64_t out) {
    TaskSpec task;
    task.name = fmt::format("add#{}", out);
    task.op = "add";
    task.inputs = {ObjectId(a), ObjectId(a), ObjectId(b)};
    task.outputs = {ObjectId(out)};
    return task;
  };
  const std::vector<TensorMeta> metas{Floats(4), Floats(4), Floats(8)};
  const std::vector<ObjectSpec> outputs{
      ObjectSpec{ObjectId(99), "sum", Floats(4), ObjectRole::kOutput, TaskId()}};
  ASSERT_OK_AND_ASSIGN(uint64_t first, registry.TaskTemplate(add_twice(1, 2, 3), metas, outputs));
  ASSERT_OK_AND_ASSIGN(uint64_t again, registry.TaskTemplate(add_twice(7, 8, 9), metas, outputs));
  EXPECT_EQ(first, again);
  const Graph& graph = registry.TemplateGraph(first);
  EXPECT_EQ(graph.InputObjects().size(), 2u);  // a and b
  EXPECT_EQ(graph.tasks()[0].inputs,
            (std::vector<ObjectId>{ObjectId(1), ObjectId(1), ObjectId(2)}));
  TaskSpec scaled = add_twice(1, 2, 3);
  scaled.attrs.Set("alpha", 2.0);
  ASSERT_OK_AND_ASSIGN(uint64_t other, registry.TaskTemplate(scaled, metas, outputs));
  EXPECT_NE(other, first);
  const std::vector<TensorMeta> wider{Floats(4), Floats(4), Floats(16)};
  ASSERT_OK_AND_ASSIGN(uint64_t shaped, registry.TaskTemplate(add_twice(1, 2, 3), wider, outputs));
  EXPECT_NE(shaped, first);
}

}  // namespace
}  // namespace tessera::testing

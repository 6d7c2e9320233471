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

}  // namespace
}  // namespace tessera::testing

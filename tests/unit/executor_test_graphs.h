// Graphs and options shared by the executor's tests (executor_test.cc, executor_runs_test.cc).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/graph.h"
#include "ops/graph_builder.h"
#include "test_util.h"
#include "worker/in_process_executor.h"

namespace tessera::testing {

inline TensorMeta F32(Shape shape) { return {std::move(shape), DType::kF32, Device::Cpu()}; }

inline ExecutorOptions TwoThreads() {
  ExecutorOptions options;
  options.threads = 2;
  options.cache_host_allocations = false;  // exact live-byte accounting
  return options;
}

// x -> gelu -> gelu -> ... (n times); returns the builder's graph, input and last output.
struct Chain {
  Graph graph;
  ObjectId input, output;
};
inline Chain GeluChain(int length, int64_t numel) {
  GraphBuilder builder(CpuRegistry());
  Chain chain;
  chain.input = builder.AddInput("x", F32({numel}), ObjectRole::kInput);
  ObjectId x = chain.input;
  for (int i = 0; i < length; ++i) {
    Result<std::vector<ObjectId>> out =
        builder.AddTask(fmt::format("gelu.{}", i), "gelu_forward", {x}, {});
    TESSERA_CHECK(out.ok());
    x = (*out)[0];
  }
  chain.output = x;
  builder.MarkOutput(x);
  chain.graph = *builder.Build();
  return chain;
}

// A worker's part of a split graph: y = gelu(x) is computed here, z = y + r where r arrives
// later from "another worker"; y is handed out as soon as it exists.
struct SplitGraph {
  Graph graph;
  ObjectId x, r, y, z;
};
inline SplitGraph MakeSplitGraph() {
  GraphBuilder builder(CpuRegistry());
  SplitGraph g;
  g.x = builder.AddInput("x", F32({64}), ObjectRole::kInput);
  g.r = builder.AddInput("r", F32({64}), ObjectRole::kActivation);
  g.y = (*builder.AddTask("gelu", "gelu_forward", {g.x}, {}))[0];
  g.z = (*builder.AddTask("add", "add_forward", {g.y, g.r}, {}))[0];
  builder.MarkOutput(g.z);
  g.graph = *builder.Build();
  return g;
}

}  // namespace tessera::testing

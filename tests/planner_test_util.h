// Helpers for the planner's per-pass tests (tests/unit/planner_*_test.cc): small plans of a tiny
// GPT-2, running the training passes up to one of them, and reading the graph built so far.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "model/gpt2.h"
#include "planner/plan_passes.h"
#include "planner/plan_state.h"
#include "test_util.h"

namespace tessera::testing {

// Four layers: embedding, h.0, h.1, head (which reads the embedding's group: a tied weight).
inline ModelSpec TinyGpt2() { return *BuildGpt2(Gpt2Config{2, 32, 4, 50, 16}); }

struct PlanShape {
  int ranks = 1;
  int zero = 0;
  int micro = 1;
  int stages = 1;
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  bool offload_to_gpu_host = false;  // offload optimizer on GPU workers (a host update)
  double max_grad_norm = 1.0;
  // 0: one collective per group, what most per-pass tests count; > 0: gradient buckets.
  int64_t bucket_bytes = 0;
};

// A plan of 8 rows of 16 tokens on workers 100, 101, ... (stage-major).
inline TrainingPlan MakeTinyPlan(const PlanShape& shape) {
  TrainingPlan plan;
  plan.batch = 8;
  plan.seq_len = 16;
  plan.optimizer.max_grad_norm = shape.max_grad_norm;
  plan.parallel.data_parallel = shape.ranks;
  plan.parallel.zero_stage = shape.zero;
  plan.parallel.micro_batches = shape.micro;
  plan.parallel.pipeline_stages = shape.stages;
  plan.parallel.schedule = shape.schedule;
  plan.parallel.bucket_bytes = shape.bucket_bytes;
  if (shape.offload_to_gpu_host) {
    plan.device = Device::Cuda(0);
    plan.parallel.offload = OffloadMode::kOptimizer;
  }
  for (int w = 0; w < shape.ranks * shape.stages; ++w) {
    plan.parallel.workers.push_back(WorkerId(100 + w));
  }
  return plan;
}

// Runs the training passes in order, through the one named `last`.
inline Status RunPassesThrough(PlanState& state, std::string_view last) {
  for (const PlanPass& pass : TrainingPasses()) {
    TESSERA_RETURN_IF_ERROR(pass.run(state));
    if (pass.name == last) return Status::Ok();
  }
  return NotFound("no pass named '{}'", last);
}

// The task named `name` in the graph built so far; nullptr (and a test failure) if none.
inline const TaskSpec* FindTask(const PlanState& state, const std::string& name) {
  Result<TaskId> id = state.builder.graph().FindTask(name);
  if (!id.ok()) {
    ADD_FAILURE() << "no task " << name;
    return nullptr;
  }
  return &state.builder.graph().task(*id);
}

// The names of a task's inputs (or of any objects).
inline std::vector<std::string> NamesOf(const PlanState& state, const std::vector<ObjectId>& ids) {
  std::vector<std::string> names;
  names.reserve(ids.size());
  for (ObjectId id : ids) names.push_back(state.builder.graph().object(id).name);
  return names;
}

// The tasks of the graph so far running `op`.
inline int CountOp(const PlanState& state, const std::string& op) {
  int count = 0;
  for (const TaskSpec& task : state.builder.graph().tasks()) count += task.op == op;
  return count;
}

}  // namespace tessera::testing

// The micro-batch and pipeline flags train_gpt2 and train_unet3d share:
//   --micro-batches M
//   --pipeline-stages P --schedule gpipe|1f1b|interleaved|zb-h1
//   [--virtual-stages V] [--gather auto|step|micro-batch] [--balance estimate|profile]
// with --workers W = P x N in all (N data-parallel ranks per stage) and --zero-stage inside
// each stage's group. --micro-batches is gradient accumulation without a pipeline and what flows
// through one with it; --grad-accum, its old name, is a hidden alias.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "core/status.h"
#include "planner/step_graph.h"
#include "training/layer_profile.h"

namespace tessera::examples {

struct PipelineFlags {
  int stages = 1;
  int micro_batches = 0;  // 0: not given (--grad-accum's value, else 1)
  int grad_accum = 0;     // the hidden alias; 0: not given
  std::string schedule = "1f1b";
  int virtual_stages = 1;
  std::string gather = "auto";
  std::string balance = "estimate";
};

inline void AddPipelineFlags(CLI::App& app, PipelineFlags& flags) {
  app.add_option("--pipeline-stages", flags.stages,
                 "P pipeline stages: the layers cut into P parts, each on a group of "
                 "--workers / P data-parallel workers")
      ->check(CLI::PositiveNumber);
  app.add_option("--micro-batches", flags.micro_batches,
                 "M micro-batches per worker per step: gradient accumulation, and what flows "
                 "through a pipeline (formerly --grad-accum, still accepted)")
      ->check(CLI::NonNegativeNumber);
  // Old command lines keep working; the help lists only --micro-batches.
  app.add_option("--grad-accum", flags.grad_accum)->check(CLI::PositiveNumber)->group("");
  app.add_option("--schedule", flags.schedule,
                 "Pipeline schedule: gpipe, 1f1b, interleaved or zb-h1");
  app.add_option("--virtual-stages", flags.virtual_stages,
                 "V model chunks per stage (--schedule interleaved)")
      ->check(CLI::PositiveNumber);
  app.add_option("--gather", flags.gather,
                 "ZeRO-3 with several micro-batches: gather each layer's parameters once per step "
                 "(step), before every use (micro-batch), or let the planner choose (auto)");
  app.add_option("--balance", flags.balance,
                 "How stages are balanced: by the op cost model's estimate of each layer "
                 "(estimate), or by each layer's time in a short profiling run in this process "
                 "(profile)")
      ->check(CLI::IsMember({"estimate", "profile"}));
}

// Sets the plan's micro-batches and pipeline from the flags and the total worker count (0: in
// process).
inline Status ApplyPipelineFlags(const PipelineFlags& flags, int workers, TrainingPlan& plan) {
  ParallelConfig& p = plan.parallel;
  TESSERA_ASSIGN_OR_RETURN(p.schedule, ParseSchedule(flags.schedule));
  if (flags.gather == "auto") {
    p.gather = GatherPolicy::kAuto;
  } else if (flags.gather == "step") {
    p.gather = GatherPolicy::kOncePerStep;
  } else if (flags.gather == "micro-batch") {
    p.gather = GatherPolicy::kPerMicroBatch;
  } else {
    return InvalidArgument("--gather '{}' is not one of: auto, step, micro-batch", flags.gather);
  }
  if (flags.micro_batches > 0 && flags.grad_accum > 1 && flags.micro_batches != flags.grad_accum) {
    return InvalidArgument(
        "--micro-batches {} and --grad-accum {} both set the micro-batches per step: give one",
        flags.micro_batches, flags.grad_accum);
  }
  p.micro_batches = flags.micro_batches > 0 ? flags.micro_batches
                    : flags.grad_accum > 0  ? flags.grad_accum
                                            : 1;
  p.pipeline_stages = flags.stages;
  p.virtual_stages = flags.virtual_stages;
  if (flags.stages == 1) return Status::Ok();
  if (workers < flags.stages || workers % flags.stages != 0) {
    return InvalidArgument(
        "--pipeline-stages {} needs --workers a multiple of {} (P x D workers: D data-parallel "
        "ranks per stage), got --workers {}",
        flags.stages, flags.stages, workers);
  }
  p.data_parallel = workers / flags.stages;
  return Status::Ok();
}

// --balance profile with a pipeline: the plan's layer costs from a short profiling run
// (training/layer_profile.h), printed on stderr as "<program>: layer times (profiled, ms per
// micro-batch, forward/backward/weight): ...". Without a pipeline it says it has nothing to do.
inline Status ApplyBalance(const PipelineFlags& flags, const ModelSpec& model,
                           const ExecutorOptions& executor, const char* program,
                           TrainingPlan& plan) {
  if (flags.balance != "profile") return Status::Ok();
  if (plan.parallel.pipeline_stages * plan.parallel.virtual_stages == 1) {
    std::fprintf(stderr,
                 "%s: --balance profile balances pipeline stages; without --pipeline-stages there "
                 "are none, so no profiling run\n",
                 program);
    return Status::Ok();
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<OpCosts> ms, ProfileLayerTimes(model, plan, executor));
  std::string text;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    text += fmt::format("{}{} {:.2f}/{:.2f}/{:.2f}", l == 0 ? "" : ", ", model.layers[l].name,
                        ms[l].forward, ms[l].backward, ms[l].weight);
    // A layer too fast to time still costs something.
    ms[l].forward = std::max(ms[l].forward, 1e-3);
    ms[l].backward = std::max(ms[l].backward, 1e-3);
  }
  std::fprintf(stderr,
               "%s: layer times (profiled, ms per micro-batch, forward/backward/weight): %s\n",
               program, text.c_str());
  plan.parallel.layer_op_costs = std::move(ms);
  return Status::Ok();
}

// "stage 0: embedding..h.2 | stage 1: h.3..head" (chunks of one stage joined by ","), and
// the ZeRO-3 gather choice, for the run's first lines; empty without a pipeline.
inline std::string DescribePipeline(const StepGraph& step, const ModelSpec& model) {
  const ParallelConfig& p = step.parallel;
  if (p.pipeline_stages == 1 && p.virtual_stages == 1) return "";
  std::string text;
  for (int stage = 0; stage < p.pipeline_stages; ++stage) {
    text += fmt::format("{}stage {}:", stage == 0 ? "" : " | ", stage);
    for (int chunk = stage; chunk < p.pipeline_stages * p.virtual_stages;
         chunk += p.pipeline_stages) {
      std::string first, last;
      for (size_t l = 0; l < model.layers.size(); ++l) {
        if (step.layer_chunk[l] != chunk) continue;
        if (first.empty()) first = model.layers[l].name;
        last = model.layers[l].name;
      }
      text += fmt::format("{} {}{}", chunk == stage ? "" : ",", first,
                          first == last ? "" : ".." + last);
    }
  }
  if (!step.gather_reason.empty()) {
    text += fmt::format("\nZeRO-3 gathers {}: {}",
                        step.gather_once_per_step ? "once per step" : "per micro-batch",
                        step.gather_reason);
  }
  return text;
}

}  // namespace tessera::examples

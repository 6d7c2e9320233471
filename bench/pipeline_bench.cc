// bench_pipeline: pipeline schedules on a local cluster of CPU workers (one thread each),
// measured from traces of real steps, next to their theory, and pipeline vs data parallel vs
// ZeRO-3 on the same model and workers, measured in the same run.
//
// Part 1, the bubble: for each P in --stages (a cluster of P workers, D = 1), each schedule and
// each M in --micro, a GPT-2 of --layers equal blocks is cut into P (interleaved: 2P) chunks
// (by a profiling run's layer times, --balance profile: they also order zb-h1);
// after --warmup steps, --steps steps are traced (Trainer::StepTimeline) and each step's idle
// fraction is computed from the spans: over the window from the first forward to the last
// backward, 1 - (forward and backward busy time summed over workers) / (P x window); zb-h1's
// input and weight halves count as backward. Printed next to the textbook bubble
// (planner/pipeline_schedule.h) and to the bubble the same order has in a simulation with the
// measured mean F, B and W times (what the stage imbalance and the runtime's gaps cost beyond
// the textbook; the textbook's zb-h1 figure assumes F = B = W).
// Part 2, activation memory: per stage, the peak bytes of activations (RunFigures, the
// executor's role meter) against what the schedule's order holds at most (PeakHeld): one
// micro-batch's activations on that stage (the bytes its forward tasks make and receive) from
// its F until its B (zb-h1: until its W, plus the stash its input half leaves, from B to W).
// Part 3, ZeRO-3 inside stages (P = 2 x D = 2): all-gathers per worker per step, once per step
// and per micro-batch, counted in the plan and in the trace.
// Part 4, step time: P-stage 1F1B (M = --compare-micro) vs data parallel vs ZeRO-3 on the same
// P workers and global batch.
#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "bench/bench_util.h"
#include "client/cluster.h"
#include "client/graph_backend.h"
#include "core/version.h"
#include "model/gpt2.h"
#include "planner/pipeline_schedule.h"
#include "training/layer_profile.h"
#include "training/token_dataset.h"
#include "training/trainer.h"

namespace {

using tessera::PipelineSchedule;
using tessera::Status;

constexpr const char* kProgram = "bench_pipeline";
[[noreturn]] void Die(const Status& status, const std::string& what) {
  tessera::bench::Die(kProgram, status, what);
}
template <typename T>
T Check(tessera::Result<T> result, const std::string& what) {
  return tessera::bench::Check(kProgram, std::move(result), what);
}
using tessera::bench::Median;

struct Flags {
  int64_t layers = 8, channels = 128, heads = 4, vocab = 256, batch = 16, seq_len = 64;
  std::vector<int> stages = {2, 4};
  std::vector<int> micro = {4, 8, 16};
  std::vector<std::string> schedules = {"gpipe", "1f1b", "interleaved", "zb-h1"};
  int steps = 3, warmup = 1;
  int compare_micro = 8;
  std::string balance = "profile";
};

tessera::Gpt2Config Model(const Flags& f) {
  return tessera::Gpt2Config{f.layers, f.channels, f.heads, f.vocab, f.seq_len};
}

struct Run {
  std::unique_ptr<tessera::Trainer> trainer;
  std::vector<double> step_ms;
  std::vector<tessera::Timeline> timelines;  // one per timed step
  tessera::StepReport last;
};

Run Train(const Flags& f, tessera::Cluster& cluster, const tessera::TrainingPlan& plan,
          const std::string& what, bool trace) {
  auto backend = Check(MakeClusterBackend(cluster, tessera::ClusterPlacement::kScheduler), what);
  Run run;
  run.trainer = Check(
      tessera::Trainer::Create(Check(tessera::BuildGpt2(Model(f)), what), plan, std::move(backend)),
      what);
  if (Status s = run.trainer->InitializeParameters(1); !s.ok()) Die(s, what);
  const tessera::TokenDataset data =
      tessera::TokenDataset::Synthetic(200'000, static_cast<int32_t>(f.vocab), 9);
  auto sampler = Check(tessera::BatchSampler::Create(data, f.batch, f.seq_len, 3), what);
  std::vector<int32_t> tokens(static_cast<size_t>(f.batch * f.seq_len)), targets(tokens.size());
  for (int step = 0; step < f.warmup + f.steps; ++step) {
    sampler.Next(tokens.data(), targets.data());
    auto batch = Check(tessera::Gpt2Batch(Model(f), tokens, targets, f.batch, f.seq_len), what);
    run.last = Check(run.trainer->Step(batch, 1e-3f), what);
    if (step < f.warmup) continue;
    run.step_ms.push_back(run.last.step_ms);
    if (trace) run.timelines.push_back(Check(run.trainer->StepTimeline(1), what));
  }
  return run;
}

bool Compute(const tessera::TimelineSpan& span) {
  using tessera::SpanKind;
  return span.kind == SpanKind::kForward || span.kind == SpanKind::kBackward ||
         span.kind == SpanKind::kBackwardInput || span.kind == SpanKind::kBackwardWeight;
}

struct Bubble {
  double measured = 0;  // idle fraction
  // Mean per chunk op (a chunk's layers, one micro-batch): F, B (the whole backward, or its
  // input half when split) and W (the weight halves; 0 unless split).
  double forward_ms = 0, backward_ms = 0, weight_ms = 0;
};

// The idle fraction of one traced step, and the mean F, B and W time per chunk op.
Bubble MeasureBubble(const tessera::Timeline& timeline, int workers, int chunk_ops) {
  int64_t first = INT64_MAX, last = 0;
  std::map<uint64_t, int64_t> busy;
  int64_t forward = 0, backward = 0, weight = 0;
  for (const tessera::TimelineSpan& span : timeline.spans) {
    if (!Compute(span)) continue;
    first = std::min(first, span.start_us);
    last = std::max(last, span.end_us);
    const int64_t us = span.end_us - span.start_us;
    busy[span.worker.value()] += us;
    if (span.kind == tessera::SpanKind::kForward) {
      forward += us;
    } else if (span.kind == tessera::SpanKind::kBackwardWeight) {
      weight += us;
    } else {
      backward += us;
    }
  }
  Bubble bubble;
  int64_t total = 0;
  for (const auto& [worker, us] : busy) total += us;
  const double window = static_cast<double>(last - first) * workers;
  bubble.measured = window > 0 ? 1.0 - static_cast<double>(total) / window : 0;
  bubble.forward_ms = forward / 1e3 / chunk_ops;
  bubble.backward_ms = backward / 1e3 / chunk_ops;
  bubble.weight_ms = weight / 1e3 / chunk_ops;
  return bubble;
}

tessera::TrainingPlan PipelinePlan(const Flags& f, int stages, int ranks, int micro,
                                   PipelineSchedule schedule, int zero = 0) {
  tessera::TrainingPlan plan;
  plan.batch = f.batch;
  plan.seq_len = f.seq_len;
  plan.parallel.pipeline_stages = stages;
  plan.parallel.data_parallel = ranks;
  plan.parallel.micro_batches = micro;
  plan.parallel.schedule = schedule;
  plan.parallel.virtual_stages = schedule == PipelineSchedule::kInterleaved ? 2 : 1;
  plan.parallel.zero_stage = zero;
  return plan;
}

// One micro-batch's activations on each stage: what its forward tasks make, plus what they
// receive from other stages (kept for the backward too); and (split backwards) the stashes its
// input halves leave for the weight halves.
struct MicroBatchBytes {
  std::vector<int64_t> activations, stashes;  // per stage
};
MicroBatchBytes BytesPerMicroBatch(const tessera::StepGraph& step, int stages) {
  const tessera::Graph& graph = step.graph;
  std::map<uint64_t, int> stage_of_worker;
  for (int s = 0; s < stages; ++s) stage_of_worker[step.parallel.WorkerOf(0, s).value()] = s;
  MicroBatchBytes bytes{std::vector<int64_t>(static_cast<size_t>(stages), 0),
                        std::vector<int64_t>(static_cast<size_t>(stages), 0)};
  for (const tessera::TaskSpec& task : graph.tasks()) {
    const size_t s = static_cast<size_t>(stage_of_worker[task.pinned_worker.value()]);
    if (task.name.ends_with("/backward_input@0") || task.name.ends_with("/backward_input")) {
      for (tessera::ObjectId out : task.outputs) {
        if (graph.object(out).name.find(":stash") != std::string::npos) {
          bytes.stashes[s] += graph.object(out).meta.bytes();
        }
      }
      continue;
    }
    if (!task.name.ends_with("/forward@0") && !task.name.ends_with("/forward")) continue;
    for (tessera::ObjectId out : task.outputs) {
      if (graph.object(out).role == tessera::ObjectRole::kActivation) {
        bytes.activations[s] += graph.object(out).meta.bytes();
      }
    }
    for (tessera::ObjectId in : task.inputs) {
      const tessera::ObjectSpec& object = graph.object(in);
      if (object.role != tessera::ObjectRole::kActivation || !object.producer.valid()) continue;
      const tessera::TaskSpec& producer = graph.task(object.producer);
      if (producer.pinned_worker != task.pinned_worker) bytes.activations[s] += object.meta.bytes();
    }
  }
  return bytes;
}

// The most bytes a stage holds running `order`, one chunk's micro-batch at a time: F adds its
// activations; B frees them, or, when the backward is split, adds the stash instead; W frees both.
double PeakHeld(const std::vector<tessera::PipelineOp>& order, double activations, double stash) {
  using Kind = tessera::PipelineOp::Kind;
  const bool split = std::any_of(order.begin(), order.end(), [](const tessera::PipelineOp& op) {
    return op.kind == Kind::kWeight;
  });
  double held = 0, peak = 0;
  for (const tessera::PipelineOp& op : order) {
    switch (op.kind) {
      case Kind::kForward:
        held += activations;
        break;
      case Kind::kBackward:
        held += split ? stash : -activations;
        break;
      case Kind::kWeight:
        held -= activations + stash;
        break;
    }
    peak = std::max(peak, held);
  }
  return peak;
}

// Parts 1 and 2 for one configuration (P = `stages`, M = `micro`, a schedule): the traced bubble
// against the textbook's and the simulated one, F, B and W times, and each stage's activation
// peak against what its order holds.
void MeasureSchedule(const Flags& f, tessera::Cluster& cluster, int stages, const std::string& name,
                     PipelineSchedule schedule, int micro) {
  const std::string what = fmt::format("P={} M={} {}", stages, micro, name);
  tessera::TrainingPlan plan = PipelinePlan(f, stages, 1, micro, schedule);
  if (Status valid = plan.Validate(Check(tessera::BuildGpt2(Model(f)), what)); !valid.ok()) {
    std::printf("%-3d %-3d %-12s refused: %s\n", stages, micro, name.c_str(),
                valid.message().c_str());
    return;
  }
  if (f.balance == "profile") {
    tessera::ExecutorOptions one_thread;
    one_thread.threads = 1;
    plan.parallel.layer_op_costs = Check(
        tessera::ProfileLayerTimes(Check(tessera::BuildGpt2(Model(f)), what), plan, one_thread),
        what);
  }
  Run run = Train(f, cluster, plan, what, /*trace=*/true);
  const int v = plan.parallel.virtual_stages;
  std::vector<double> measured;
  double forward_ms = 0, backward_ms = 0, weight_ms = 0;
  for (const tessera::Timeline& timeline : run.timelines) {
    const Bubble b = MeasureBubble(timeline, stages, stages * v * micro);
    measured.push_back(b.measured);
    forward_ms += b.forward_ms / run.timelines.size();
    backward_ms += b.backward_ms / run.timelines.size();
    weight_ms += b.weight_ms / run.timelines.size();
  }
  const auto& orders = run.trainer->step_graph().schedule_order;  // what the plan ran
  const auto sim =
      Check(tessera::SimulateSchedule(orders, stages, v, micro,
                                      {forward_ms * v, backward_ms * v, weight_ms * v}),
            what);
  const MicroBatchBytes bytes = BytesPerMicroBatch(run.trainer->step_graph(), stages);
  std::string memory;
  for (int s = 0; s < stages; ++s) {
    // A chunk holds 1/V of the stage's activations.
    const size_t i = static_cast<size_t>(s);
    const double theory = PeakHeld(orders[i], static_cast<double>(bytes.activations[i]) / v,
                                   static_cast<double>(bytes.stashes[i]) / v);
    const double peak = static_cast<double>(
        run.last.ranks[static_cast<size_t>(s)].figures.peak(tessera::ObjectRole::kActivation));
    memory += fmt::format("{}{:.2f}/{:.2f}MB({:+.0f}%)", s == 0 ? "" : " ", peak / 1e6,
                          theory / 1e6, 100 * (peak / theory - 1));
  }
  std::printf("%-3d %-3d %-12s %9.3f %9.3f %9.3f %8.2f %8.2f %8.2f  %s\n", stages, micro,
              name.c_str(), Median(measured),
              tessera::TheoreticalBubble(schedule, stages, micro, v), sim.bubble, forward_ms,
              backward_ms, weight_ms, memory.c_str());
  std::fflush(stdout);
}

// Parts 1 and 2: every P, schedule and M.
void MeasureBubbles(const Flags& f) {
  std::printf("\n## bubble (idle fraction of the step's compute window) and activation memory\n");
  std::printf("%-3s %-3s %-12s %9s %9s %9s %8s %8s %8s  %s\n", "P", "M", "schedule", "measured",
              "theory", "sim", "F_ms", "B_ms", "W_ms", "activation peak / theory per stage");
  for (int stages : f.stages) {
    tessera::LocalClusterOptions options;
    options.cpu_workers = stages;
    options.threads_per_worker = 1;
    auto cluster = Check(tessera::Cluster::StartLocal(options), "cluster");
    for (const std::string& name : f.schedules) {
      const PipelineSchedule schedule = Check(tessera::ParseSchedule(name), name);
      for (int micro : f.micro) {
        MeasureSchedule(f, *cluster, stages, name, schedule, micro);
      }
    }
  }
}

// Part 3: all-gathers per worker per step of ZeRO-3 inside stages, per gather policy.
void CountGathers(const Flags& f) {
  std::printf("\n## ZeRO-3 inside stages (P=2 x D=2, 1f1b): all-gathers per worker per step\n");
  tessera::LocalClusterOptions options;
  options.cpu_workers = 4;
  options.threads_per_worker = 1;
  auto cluster = Check(tessera::Cluster::StartLocal(options), "cluster");
  for (tessera::GatherPolicy policy :
       {tessera::GatherPolicy::kOncePerStep, tessera::GatherPolicy::kPerMicroBatch}) {
    tessera::TrainingPlan plan = PipelinePlan(f, 2, 2, 4, PipelineSchedule::k1F1B, 3);
    plan.parallel.gather = policy;
    Run run = Train(f, *cluster, plan, "zero-3 in stages", /*trace=*/true);
    std::map<uint64_t, int> planned, traced;
    for (const tessera::TaskSpec& task : run.trainer->step_graph().graph.tasks()) {
      if (task.op == "all_gather") ++planned[task.pinned_worker.value()];
    }
    for (const tessera::TimelineSpan& span : run.timelines.back().spans) {
      if (span.op == "all_gather") ++traced[span.worker.value()];
    }
    std::string per_worker;
    for (const auto& [worker, count] : planned) {
      per_worker += fmt::format(" worker{}: {} planned / {} traced", worker, count, traced[worker]);
    }
    std::printf("%-14s%s; step %.1f ms\n",
                policy == tessera::GatherPolicy::kOncePerStep ? "once per step:" : "per micro:",
                per_worker.c_str(), Median(run.step_ms));
    std::printf("  (%s)\n", run.trainer->step_graph().gather_reason.c_str());
  }
}

// Part 4: step times of pipeline, data parallel and ZeRO-3 on the same workers.
void CompareStepTimes(const Flags& f) {
  std::printf("\n## step time on the same workers and global batch (median ms)\n");
  for (int workers : f.stages) {
    tessera::LocalClusterOptions options;
    options.cpu_workers = workers;
    options.threads_per_worker = 1;
    auto cluster = Check(tessera::Cluster::StartLocal(options), "cluster");
    const double pp = Median(
        Train(f, *cluster, PipelinePlan(f, workers, 1, f.compare_micro, PipelineSchedule::k1F1B),
              "pp", false)
            .step_ms);
    tessera::TrainingPlan dp = PipelinePlan(f, 1, workers, 1, PipelineSchedule::k1F1B);
    const double dp_ms = Median(Train(f, *cluster, dp, "dp", false).step_ms);
    dp.parallel.zero_stage = 3;
    const double zero3 = Median(Train(f, *cluster, dp, "zero3", false).step_ms);
    std::printf(
        "%d workers: pipeline 1f1b (M=%d) %.1f  data parallel %.1f  ZeRO-3 %.1f  "
        "pp/dp %.2f  pp/zero3 %.2f\n",
        workers, f.compare_micro, pp, dp_ms, zero3, pp / dp_ms, pp / zero3);
  }
  std::printf(
      "\nnote: %u cores here; with more workers than cores the workers share cores, so "
      "stages wait for a core as well as for each other.\n",
      std::thread::hardware_concurrency());
}

}  // namespace

static int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{"Pipeline schedules: bubble and memory from traces vs theory; PP vs DP vs ZeRO-3"};
  app.set_version_flag("--version", tessera::VersionLine("bench_pipeline"));
  app.add_option("--layers", f.layers, "GPT-2 blocks");
  app.add_option("--channels", f.channels, "Channels");
  app.add_option("--batch", f.batch, "Global batch (rows)");
  app.add_option("--seq-len", f.seq_len, "Tokens per row");
  app.add_option("--stages", f.stages, "Pipeline stages to measure");
  app.add_option("--micro", f.micro, "Micro-batch counts to measure");
  app.add_option("--schedules", f.schedules, "Schedules to measure");
  app.add_option("--steps", f.steps, "Traced steps per configuration");
  app.add_option("--warmup", f.warmup, "Untimed steps first");
  app.add_option("--compare-micro", f.compare_micro, "Micro-batches of the PP vs DP comparison");
  app.add_option("--balance", f.balance,
                 "Part 1: cut the stages and order zb-h1 by the op cost model (estimate) or by a "
                 "profiling run's layer times (profile)")
      ->check(CLI::IsMember({"estimate", "profile"}));
  CLI11_PARSE(app, argc, argv);

  std::printf(
      "model: GPT-2 %lld blocks x %lld channels, batch %lld x %lld tokens; one thread per "
      "worker; %d timed steps after %d warm-up; stages balanced by %s\n",
      static_cast<long long>(f.layers), static_cast<long long>(f.channels),
      static_cast<long long>(f.batch), static_cast<long long>(f.seq_len), f.steps, f.warmup,
      f.balance == "profile" ? "a profiling run's layer times" : "the op cost model");
  MeasureBubbles(f);
  CountGathers(f);
  CompareStepTimes(f);
  return 0;
}

int main(int argc, char** argv) {
  return tessera::bench::RunMain("bench_pipeline", [&] { return Main(argc, argv); });
}

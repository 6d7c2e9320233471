// bench_memory: the memory plan (planner/memory_plan.cc) against the naive ways, same run: the
// step time of a model trained in this process keeping every activation, then at each
// activation budget (--budgets, a share of the activations' peak, as torch.compile's
// activation_memory_budget) planned by the activation solver and with every layer recomputed
// (checkpointing every layer, the first naive baseline), and for each the predicted and
// measured peaks. With --lru (the default), the second naive baseline: the plan keeping
// everything on a one-worker local cluster whose object store holds what the budget leaves
// (the uncapped peak less the share of the activations the budget takes away) and spills the
// least recently used objects to disk beyond it ("lru-spill"), next to the same cluster
// uncapped ("cluster-uncapped", its x_uncapped baseline: a worker process and its object store
// cost something of their own). The store holds what outlives a step (the model state) and what
// workers exchange; a step's intermediates live in the worker's executor, so the spill does not
// bound a step's activations: the lru-spill rows' measured peaks say how far over they go.
//
// Models (--models): gpt2 (--gpt2-preset, batch --gpt2-batch of the preset's sequence length)
// and unet3d (--unet-preset, batch --unet-batch). Each round (--rounds) runs every plan, in an
// order rotated by the round, --warmup steps then --steps timed ones (StepReport::step_ms,
// median); a plan's figure is the median of its rounds' medians. Prints per plan:
//   model plan budget  step_ms  x_uncapped (step time / the uncapped plan's in the same round,
//              the median over the rounds: above 1, slower)
//   pred/meas  the predicted step time (planner/step_time.h, from a profile of the step taken
//              just before the plan's run) over the measured one: the median of the rounds'
//              ratios
//   peak_mb predicted / measured (every object and the running kernel's scratch,
//   RunFigures::total_with_scratch_peak)
//   act_mb  predicted / measured (activations, the role's peak)
//   recmp   recompute tasks in the step; part: layers kept in part (their backward rebuilding
//           the rest)
//   kernel_ms  the forward and backward tasks' spans a timed step, summed over the compute slots
//           (in-process plans; the median of the rounds'): against the uncapped plan's, what a
//           plan's kernels cost more (recomputes, rebuilds, and copies slowing the kernels beside
//           them) apart from the time its slots wait;
//           then the memory plan's reason; a budget nothing fits under prints why.
// With --profile (the default) the layers are first profiled (ProfileLayerTimes) and every plan is
// made with the measured times. With --swap-dir DIR, at each budget also "planned-disk": the plan
// given a swap file in DIR (the disk tier, worker/swap_file.h) and its link's bandwidth (measured
// on it at the start, or --disk-link-gbps; and the compute time a MiB copied takes, measured per
// model by profiling its step beside copies, or --disk-copy-compute-us-per-mib), so that it may
// swap activations to the disk instead of recomputing them; its rows add the disk tier's predicted
// and measured peak (the swap file's allocator), the layers swapped and the bytes copied between
// tiers a step.
// --json PATH writes the same figures as JSON (with each round's step time); --layer-times also
// prints each plan's per-layer forward and backward milliseconds (its latest round's trace).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include "bench/bench_util.h"
#include "bench/gpt2_batch.h"

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "core/atomic_file.h"
#include "core/timeline.h"
#include "core/version.h"
#include "data/volumes.h"
#include "model/gpt2.h"
#include "model/unet3d.h"
#include "ops/standard_ops.h"
#include "planner/memory_model.h"
#include "planner/step_graph.h"
#include "planner/step_time.h"
#include "training/layer_profile.h"
#include "training/trainer.h"
#include "worker/swap_file.h"

namespace {

using tessera::Status;

constexpr const char* kProgram = "bench_memory";
template <typename T>
T Check(tessera::Result<T> result, const std::string& what) {
  return tessera::bench::Check(kProgram, std::move(result), what);
}
using tessera::bench::Median;

struct Flags {
  bool lru = true;
  bool layer_times = false;
  std::vector<std::string> models = {"gpt2", "unet3d"};
  std::string gpt2_preset = "small";
  int64_t gpt2_batch = 4;
  std::string unet_preset = "small";
  int64_t unet_batch = 2;
  std::vector<double> budgets = {0.5, 0.25};
  int rounds = 3;
  int warmup = 2;
  int steps = 6;
  int threads = 0;
  bool profile = true;
  std::string json;
  std::string swap_dir;  // empty: no planned-disk rows
  double disk_link_gbps = 0;
  double disk_copy_compute_us_per_mib = 0;
};

// A model, its plan and one batch.
struct Case {
  std::string name;
  tessera::ModelSpec model;
  tessera::TrainingPlan plan;
  std::vector<tessera::Tensor> batch;
};

Case Gpt2Case(const Flags& flags) {
  const tessera::Gpt2Config config =
      Check(tessera::Gpt2Config::Preset(flags.gpt2_preset), "preset");
  Case c{"gpt2-" + flags.gpt2_preset, Check(tessera::BuildGpt2(config), "build GPT-2"), {}, {}};
  c.plan.batch = flags.gpt2_batch;
  c.plan.seq_len = config.max_seq_len;
  c.batch =
      Check(tessera::bench::SyntheticGpt2Batch(config, c.plan.batch, c.plan.seq_len), "batch");
  return c;
}

Case UNetCase(const Flags& flags, const tessera::OpRegistry& registry) {
  const tessera::UNet3dConfig config =
      Check(tessera::UNet3dConfig::Preset(flags.unet_preset), "preset");
  Case c{"unet3d-" + flags.unet_preset,
         Check(tessera::BuildUNet3d(config, registry), "build"),
         {},
         {}};
  c.plan.batch = flags.unet_batch;
  const tessera::VolumeBatch made = Check(
      tessera::GenerateVolumes(c.plan.batch, config.volume, config.in_channels, 7), "volumes");
  const int64_t v = config.volume;
  auto floats = Check(tessera::Tensor::FromVector(
                          tessera::Shape{c.plan.batch, config.in_channels, v, v, v}, made.volumes),
                      "volumes");
  auto labels = Check(
      tessera::Tensor::FromVector(tessera::Shape{c.plan.batch, v, v, v}, made.labels), "labels");
  c.batch = {std::move(floats), std::move(labels)};
  return c;
}

// One plan of a case: how it is capped.
struct Variant {
  // uncapped, planned, planned-disk, recompute-all; on a cluster: cluster-uncapped, lru-spill
  std::string name;
  double budget = 0;
  int64_t store_bytes = 0;  // on a cluster: the worker's object store capacity (0: default)
  bool on_cluster() const { return name == "cluster-uncapped" || name == "lru-spill"; }
};

struct Row {
  std::string model, plan;
  double budget = 0;
  std::vector<double> round_ms;
  double step_ms = 0;
  int64_t predicted_peak = 0, measured_peak = 0;
  int64_t predicted_activations = 0, measured_activations = 0;
  // PredictStepTime from the round's profile, and its ratio to the round's measured step time.
  std::vector<double> round_predicted_ms, round_ratio;
  double predicted_ms = 0, predicted_ratio = 0;  // medians over the rounds (0: not profiled)
  int recomputed = 0;
  int kept_part = 0;  // layers whose backward rebuilds part of what they save
  // The forward and backward spans of a timed step, summed (in-process plans).
  std::vector<double> round_kernel_ms;
  double kernel_ms = 0;
  // Per layer, its forward (and recompute) and backward tasks' milliseconds a step (the latest
  // round's; in-process plans): where a plan's kernel time goes.
  std::vector<tessera::OpCosts> layer_ms;
  std::string reason;
  std::string refused;        // why the plan could not be made
  int64_t store_bytes = 0;    // on a cluster: the object store's capacity
  int64_t spilled_bytes = 0;  // on a cluster: written to disk over the run (warm-up included)
  bool on_cluster = false;
  // planned-disk: the disk tier's peak (the plan's; the swap file's allocator), the layers
  // swapped, and the bytes a step copies between tiers (the plan's).
  bool on_disk = false;
  int64_t predicted_disk_peak = 0, measured_disk_peak = 0, copied_bytes = 0;
  int swapped = 0;
  int swapped_part = 0;  // of those, layers swapping the part a partial keep saves
};

// The swap file of the planned-disk rows and its link (bytes per microsecond, each way).
struct Disk {
  std::shared_ptr<tessera::DeviceRuntime> file;
  double link_bytes_per_us = 0;
  double copy_compute_us_per_byte = 0;  // what a byte copied takes of the compute (per model)
};

// How the plans run: --threads executor threads.
tessera::ExecutorOptions Executor(const Flags& flags) {
  tessera::ExecutorOptions options;
  options.threads = flags.threads;
  return options;
}

// Trains `warmup` + `steps` steps of the variant; the median step time and the last step's
// figures.
// `now`: a profile taken just before, the step time is predicted from (empty: none).
void RunOnce(const Flags& flags, const Case& c, const Variant& variant,
             const tessera::OpRegistry& registry, const tessera::StepProfile& now, const Disk& disk,
             Row& row) {
  tessera::TrainingPlan plan = c.plan;
  const bool on_disk = variant.name == "planned-disk";
  if (variant.name == "planned" || on_disk) plan.memory.activation_budget = variant.budget;
  if (variant.name == "recompute-all") plan.memory.recompute_all = true;
  tessera::ExecutorOptions options = Executor(flags);
  if (on_disk) {
    plan.memory.disk_link_bytes_per_us = disk.link_bytes_per_us;
    plan.memory.disk_copy_compute_us_per_byte = disk.copy_compute_us_per_byte;
    options.disk = disk.file;
    disk.file->allocator()->ResetPeak();
  }
  std::unique_ptr<tessera::Cluster> cluster;
  tessera::Result<std::unique_ptr<tessera::Trainer>> made = tessera::Unavailable("not made");
  if (variant.on_cluster()) {
    tessera::LocalClusterOptions local;
    local.cpu_workers = 1;
    local.threads_per_worker = flags.threads;
    if (variant.store_bytes > 0) local.host_capacity_bytes = variant.store_bytes;
    cluster = Check(tessera::Cluster::StartLocal(local), "start a one-worker local cluster");
    made = tessera::Trainer::Create(c.model, plan,
                                    Check(tessera::MakeClusterBackend(*cluster), "backend"));
  } else {
    made = tessera::Trainer::Create(c.model, plan, options);
  }
  if (!made.ok()) {
    row.refused = made.status().ToString();
    return;
  }
  tessera::Trainer& trainer = **made;
  if (Status s = trainer.InitializeParameters(1); !s.ok()) tessera::bench::Die(kProgram, s, "init");
  std::vector<double> times;
  for (int step = 0; step < flags.warmup + flags.steps; ++step) {
    const tessera::StepReport report = Check(trainer.Step(c.batch, 1e-4f), "step");
    if (step >= flags.warmup) times.push_back(report.step_ms);
    if (!report.ranks.empty()) {
      row.measured_peak = report.ranks[0].figures.total_with_scratch_peak;
      row.measured_activations = report.ranks[0].figures.peak(tessera::ObjectRole::kActivation);
    }
  }
  row.round_ms.push_back(Median(times));
  if (cluster == nullptr) {
    const tessera::Timeline timeline = Check(trainer.StepTimeline(flags.steps), "the timeline");
    int64_t kernel_us = 0;
    for (const tessera::TimelineSpan& span : timeline.spans) {
      switch (span.kind) {
        case tessera::SpanKind::kForward:
        case tessera::SpanKind::kBackward:
        case tessera::SpanKind::kBackwardInput:
        case tessera::SpanKind::kBackwardWeight:
          kernel_us += span.end_us - span.start_us;
          break;
        default:
          break;
      }
    }
    row.round_kernel_ms.push_back(static_cast<double>(kernel_us) / 1e3 / flags.steps);
    row.layer_ms =
        Check(tessera::LayerTimesFromTimeline(c.model, timeline, flags.steps), "layer times");
  }
  if (cluster != nullptr) {
    row.on_cluster = true;
    row.store_bytes = variant.store_bytes;
    // What the worker spilled over the run, as of its next heartbeat (every 500 ms).
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));
    const tessera::ClusterInfo info = Check(cluster->Info(), "cluster info");
    row.spilled_bytes = 0;  // the latest round's
    for (const tessera::WorkerInfo& worker : info.workers) {
      row.spilled_bytes += worker.spilled_total_bytes;
      // A one-rank plan the scheduler placed reports no rank figures: the worker's last run's.
      row.measured_peak = worker.last_run.total_with_scratch_peak;
      row.measured_activations = worker.last_run.peak(tessera::ObjectRole::kActivation);
    }
  }
  const tessera::MemoryDecision& memory = trainer.step_graph().memory;
  if (memory.peak_bytes > 0) {
    row.predicted_peak = memory.peak_bytes;
    row.predicted_activations = memory.activation_peak_bytes;
  } else {
    const tessera::MemoryProfile profile =
        Check(tessera::PredictMemory(trainer.step_graph().graph), "predict");
    row.predicted_peak = profile.workers[0].total_with_scratch_peak;
    row.predicted_activations =
        profile.workers[0].role_peaks[static_cast<size_t>(tessera::ObjectRole::kActivation)];
  }
  row.recomputed = 0;  // recompute tasks in the step (per rank and micro-batch)
  for (const tessera::TaskSpec& task : trainer.step_graph().graph.tasks()) {
    if (task.name.find("/recompute") != std::string::npos) ++row.recomputed;
  }
  row.kept_part = tessera::CountChoice(memory.activations, tessera::ActivationChoice::kKeepPart);
  if (on_disk) {
    const tessera::MemoryProfile profile =
        Check(tessera::PredictMemory(trainer.step_graph().graph), "predict");
    row.on_disk = true;
    row.predicted_disk_peak =
        profile.workers[0].peaks[static_cast<size_t>(tessera::MemoryTier::kDisk)].bytes;
    row.measured_disk_peak = disk.file->memory().peak_bytes;
    row.copied_bytes = profile.workers[0].tier_copy_bytes;
    row.swapped = tessera::CountChoice(memory.activations, tessera::ActivationChoice::kSwap);
    row.swapped_part = 0;
    for (const tessera::ActivationDecision& decision : memory.activations) {
      row.swapped_part +=
          decision.choice == tessera::ActivationChoice::kSwap && !decision.rebuild.empty();
    }
  }
  if (!now.layer_ms.empty() && cluster == nullptr) {
    // The profile ran the plan's micro-batch; a plan split into more (the memory plan's own
    // change) runs smaller ones, whose layers take time in proportion to their rows.
    const double rows = static_cast<double>(trainer.step_graph().micro_batch_rows) /
                        static_cast<double>(c.plan.parallel.MicroBatchRows(c.plan.batch));
    std::vector<tessera::OpCosts> layer_ms = now.layer_ms;
    for (tessera::OpCosts& ms : layer_ms) {
      ms = tessera::OpCosts{ms.forward * rows, ms.backward * rows, ms.weight * rows};
    }
    const double predicted =
        Check(tessera::PredictStepTime(trainer.step_graph().graph, c.model, layer_ms, registry,
                                       now.TaskOverheadMs(),
                                       plan.memory.disk_copy_compute_us_per_byte),
              "predict the step time")
            .step_ms;
    row.round_predicted_ms.push_back(predicted);
    row.round_ratio.push_back(predicted / row.round_ms.back());
  }
  row.reason = memory.reason;
}

// How a profile runs: --warmup and --steps steps, whole backwards (as the plans run them).
tessera::LayerProfileOptions ProfileOptions(const Flags& flags) {
  tessera::LayerProfileOptions profile;
  profile.warmup_steps = flags.warmup;
  profile.steps = flags.steps;
  profile.split_backwards = false;
  return profile;
}

// The case's step at one micro-batch, profiled.
tessera::StepProfile Profile(const Flags& flags, const Case& c) {
  std::fprintf(stderr, "%s: %s: profiling the layers\n", kProgram, c.name.c_str());
  return Check(tessera::ProfileStep(c.model, c.plan, Executor(flags), ProfileOptions(flags)),
               "profile");
}

double Mb(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace

static int Main(int argc, char** argv) {
  Flags flags;
  CLI::App app{
      "The memory plan's step time against keeping everything and recomputing every "
      "layer, in this process (see the header for the figures)"};
  app.set_version_flag("--version", tessera::VersionLine("bench_memory"));
  app.add_option("--models", flags.models, "gpt2 and/or unet3d")
      ->check(CLI::IsMember({"gpt2", "unet3d"}));
  app.add_option("--gpt2-preset", flags.gpt2_preset, "tiny, small or gpt2-124m");
  app.add_option("--gpt2-batch", flags.gpt2_batch, "Sequences per step")
      ->check(CLI::PositiveNumber);
  app.add_option("--unet-preset", flags.unet_preset, "tiny or small");
  app.add_option("--unet-batch", flags.unet_batch, "Volumes per step")->check(CLI::PositiveNumber);
  app.add_option("--budgets", flags.budgets, "Activation budgets, shares of the peak")
      ->check(CLI::Range(0.01, 1.0));
  app.add_option("--rounds", flags.rounds, "Rounds of every plan (alternating order)")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", flags.warmup, "Untimed steps per plan and round")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", flags.steps, "Timed steps per plan and round")
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", flags.threads, "Executor threads (0: one per core)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--profile,!--no-profile", flags.profile,
               "Plan with measured layer times and predict each plan's step time from them "
               "(default); --no-profile plans with the op cost model's estimates");
  app.add_flag("--lru,!--no-lru", flags.lru,
               "Also run the plan keeping everything on a one-worker local cluster whose object "
               "store holds what each budget leaves, spilling to disk (default), and that cluster "
               "uncapped");
  app.add_option("--json", flags.json, "Also write the figures to this JSON file");
  app.add_flag("--layer-times", flags.layer_times,
               "Also print each plan's per-layer forward and backward milliseconds a step (its "
               "latest round's, from the trace)");
  app.add_option("--swap-dir", flags.swap_dir,
                 "Also plan each budget with a swap file in this directory (planned-disk rows: "
                 "activations may be swapped to the disk)");
  app.add_option("--disk-link-gbps", flags.disk_link_gbps,
                 "With --swap-dir: the swap file's bandwidth each way in GB/s (0: measured)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--disk-copy-compute-us-per-mib", flags.disk_copy_compute_us_per_mib,
                 "With --swap-dir: the compute time a MiB copied to or from the swap file takes, "
                 "in microseconds (0: measured per model, the step profiled beside copies)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  Disk disk;
  if (!flags.swap_dir.empty()) {
    tessera::SwapFileOptions swap;
    swap.directory = flags.swap_dir;
    disk.file = Check(tessera::OpenSwapFile(swap), "--swap-dir");
    disk.link_bytes_per_us = flags.disk_link_gbps > 0
                                 ? flags.disk_link_gbps * 1e3
                                 : Check(tessera::MeasureHostLink(*disk.file), "disk link");
    std::fprintf(stderr, "%s: %s, %.2f GB/s each way%s\n", kProgram, disk.file->Describe().c_str(),
                 disk.link_bytes_per_us / 1e3, flags.disk_link_gbps > 0 ? "" : " (measured)");
  }

  tessera::OpRegistry registry;
  if (Status s = tessera::RegisterStandardOps(registry); !s.ok()) {
    tessera::bench::Die(kProgram, s, "register the ops");
  }
  std::vector<Row> rows;
  for (const std::string& model : flags.models) {
    Case c = model == "gpt2" ? Gpt2Case(flags) : UNetCase(flags, registry);
    // Every plan is made with the measured layer times (as --balance profile does).
    if (flags.profile) {
      const tessera::StepProfile profile = Profile(flags, c);
      c.plan.parallel.layer_op_costs = profile.layer_ms;
      // What the swap file's copies take from this model's step (as --balance profile does).
      if (disk.file != nullptr && flags.disk_copy_compute_us_per_mib == 0) {
        disk.copy_compute_us_per_byte =
            Check(tessera::MeasureCopyCompute(c.model, c.plan, Executor(flags), *disk.file, profile,
                                              ProfileOptions(flags)),
                  "what the swap file's copies take from the compute");
      }
    }
    if (disk.file != nullptr) {
      if (flags.disk_copy_compute_us_per_mib > 0) {
        disk.copy_compute_us_per_byte = flags.disk_copy_compute_us_per_mib / (1 << 20);
      }
      std::fprintf(stderr,
                   "%s: %s: a MiB copied to or from the swap file takes %.1f us of the "
                   "compute%s\n",
                   kProgram, c.name.c_str(), disk.copy_compute_us_per_byte * (1 << 20),
                   flags.disk_copy_compute_us_per_mib > 0 ? "" : " (measured)");
    }
    std::vector<Variant> variants = {{"uncapped", 0}};
    for (double budget : flags.budgets) {
      variants.push_back({"planned", budget});
      if (disk.file != nullptr) variants.push_back({"planned-disk", budget});
      variants.push_back({"recompute-all", budget});
    }
    if (flags.lru) {
      // What each budget leaves: the uncapped peak less the activations it takes away.
      const tessera::StepGraph uncapped =
          Check(tessera::PlanTrainingStep(c.model, c.plan, registry), "plan");
      const tessera::MemoryProfile profile =
          Check(tessera::PredictMemory(uncapped.graph), "predict");
      const tessera::WorkerMemory& worker = profile.workers[0];
      const auto activations = static_cast<double>(
          worker.role_peaks[static_cast<size_t>(tessera::ObjectRole::kActivation)]);
      variants.push_back({"cluster-uncapped", 0});
      for (double budget : flags.budgets) {
        const auto store = static_cast<int64_t>(static_cast<double>(worker.total_peak) -
                                                (1 - budget) * activations);
        // The store's capacity is whole MiB: round up (in the spill's favour).
        variants.push_back({"lru-spill", budget, ((store >> 20) + 1) << 20});
      }
    }
    // recompute-all does not depend on the budget: run it once, report it at every budget.
    std::vector<Variant> run;
    for (const Variant& v : variants) {
      if (v.name != "recompute-all" || v.budget == flags.budgets.front()) run.push_back(v);
    }
    std::vector<Row> case_rows(run.size());
    for (int round = 0; round < flags.rounds; ++round) {
      for (size_t i = 0; i < run.size(); ++i) {
        const size_t v = (i + static_cast<size_t>(round)) % run.size();
        std::fprintf(stderr, "%s: %s round %d/%d: %s %.2f\n", kProgram, c.name.c_str(), round + 1,
                     flags.rounds, run[v].name.c_str(), run[v].budget);
        // The step time is predicted from a profile taken just before: the machine's speed
        // drifts over minutes.
        const tessera::StepProfile now =
            flags.profile && !run[v].on_cluster() ? Profile(flags, c) : tessera::StepProfile{};
        RunOnce(flags, c, run[v], registry, now, disk, case_rows[v]);
      }
    }
    for (size_t v = 0; v < run.size(); ++v) {
      Row& row = case_rows[v];
      row.model = c.name;
      row.plan = run[v].name;
      row.budget = run[v].budget;
      if (row.refused.empty()) row.step_ms = Median(row.round_ms);
      if (!row.round_kernel_ms.empty()) row.kernel_ms = Median(row.round_kernel_ms);
      if (!row.round_ratio.empty()) {
        row.predicted_ms = Median(row.round_predicted_ms);
        row.predicted_ratio = Median(row.round_ratio);
      }
      rows.push_back(row);
    }
  }
  std::printf("%-14s %-14s %6s %9s %10s %9s %19s %19s %5s %5s %9s\n", "model", "plan", "budget",
              "step_ms", "x_uncapped", "pred/meas", "peak_mb pred/meas", "act_mb pred/meas",
              "recmp", "part", "kernel_ms");
  std::string json = "[\n";
  for (const Row& row : rows) {
    // A cluster's rows against the cluster uncapped, the others against this process's: the
    // median over the rounds of the round's ratio (a round runs every plan within a minute or
    // two; the machine's speed drifts between rounds).
    const char* baseline = row.on_cluster ? "cluster-uncapped" : "uncapped";
    double x_uncapped = 0;
    for (const Row& other : rows) {
      if (other.model != row.model || other.plan != baseline) continue;
      std::vector<double> ratios;
      for (size_t r = 0; r < row.round_ms.size() && r < other.round_ms.size(); ++r) {
        if (other.round_ms[r] > 0) ratios.push_back(row.round_ms[r] / other.round_ms[r]);
      }
      if (!ratios.empty()) x_uncapped = Median(ratios);
    }
    if (!row.refused.empty()) {
      std::printf("%-14s %-14s %6.2f refused: %s\n", row.model.c_str(), row.plan.c_str(),
                  row.budget, row.refused.c_str());
    } else {
      std::printf(
          "%-14s %-14s %6.2f %9.1f %10.3f %9.3f %9.2f / %-7.2f %9.2f / %-7.2f %5d %5d %9.1f\n",
          row.model.c_str(), row.plan.c_str(), row.budget, row.step_ms, x_uncapped,
          row.predicted_ratio, Mb(row.predicted_peak), Mb(row.measured_peak),
          Mb(row.predicted_activations), Mb(row.measured_activations), row.recomputed,
          row.kept_part, row.kernel_ms);
      if (row.on_cluster) {
        std::printf("%-14s %-14s %6.2f   object store %.2f MiB, %.2f MiB spilled to disk\n", "", "",
                    row.budget, Mb(row.store_bytes), Mb(row.spilled_bytes));
      }
      if (row.on_disk) {
        std::printf(
            "%-14s %-14s %6.2f   disk tier %.2f / %.2f MiB (predicted / measured), %d layer(s) "
            "swapped (%d of them in part), %.2f MiB copied between tiers a step\n",
            "", "", row.budget, Mb(row.predicted_disk_peak), Mb(row.measured_disk_peak),
            row.swapped, row.swapped_part, Mb(row.copied_bytes));
      }
    }
    json += fmt::format(
        "  {{\"model\": \"{}\", \"plan\": \"{}\", \"budget\": {}, \"step_ms\": {:.3f}, "
        "\"x_uncapped\": {:.4f}, \"predicted_ms\": {:.3f}, \"predicted_ratio\": {:.4f}, "
        "\"predicted_peak\": {}, "
        "\"measured_peak\": {}, "
        "\"predicted_activations\": {}, \"measured_activations\": {}, \"recomputed\": {}, "
        "\"kept_part\": {}, \"store_bytes\": {}, \"spilled_bytes\": {}, \"swapped\": {}, "
        "\"swapped_part\": {}, \"predicted_disk_peak\": {}, \"measured_disk_peak\": {}, "
        "\"copied_bytes\": {}, "
        "\"kernel_ms\": {:.3f}, \"round_ms\": [{:.3f}], \"refused\": {}}}{}\n",
        row.model, row.plan, row.budget, row.step_ms, x_uncapped, row.predicted_ms,
        row.predicted_ratio, row.predicted_peak, row.measured_peak, row.predicted_activations,
        row.measured_activations, row.recomputed, row.kept_part, row.store_bytes, row.spilled_bytes,
        row.swapped, row.swapped_part, row.predicted_disk_peak, row.measured_disk_peak,
        row.copied_bytes, row.kernel_ms, fmt::join(row.round_ms, ", "),
        row.refused.empty() ? "false" : "true", &row == &rows.back() ? "" : ",");
  }
  json += "]\n";
  for (const Row& row : rows) {
    if (!flags.layer_times || row.layer_ms.empty()) continue;
    std::string text;
    for (size_t l = 0; l < row.layer_ms.size(); ++l) {
      text += fmt::format("{}{:.1f}/{:.1f}", l == 0 ? "" : " ", row.layer_ms[l].forward,
                          row.layer_ms[l].backward + row.layer_ms[l].weight);
    }
    std::printf("%s %s %.2f: layer ms forward/backward: %s\n", row.model.c_str(), row.plan.c_str(),
                row.budget, text.c_str());
  }
  for (const Row& row : rows) {
    if (!row.reason.empty()) {
      std::printf("%s %s %.2f: %s\n", row.model.c_str(), row.plan.c_str(), row.budget,
                  row.reason.c_str());
    }
  }
  if (!flags.json.empty()) {
    if (Status s = tessera::WriteFileAtomically(flags.json, json); !s.ok()) {
      tessera::bench::Die(kProgram, s, "--json");
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  return tessera::bench::RunMain(kProgram, [&] { return Main(argc, argv); });
}

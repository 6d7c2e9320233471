// bench_streaming: Harmony's case in miniature. A GPT-2 on the simulated GPU (worker/
// simulated_gpu.h: device memory that is host memory, capped by its allocator, copies that are
// real copies) whose model states (fp32 parameters, gradients and Adam's two moments: 16 bytes a
// parameter) are --states-over-cap times the device's memory. The memory plan finds that nothing
// fits with the state on the device and moves the parameters to the host (OffloadMode::
// kParameters): each layer's are copied up before its forward and its backward, prefetch_layers
// ahead, its gradient copied down as it completes, the update run on the host; the activation
// solver fits the activations in what is left.
//
// Same run, alternated order (--rounds, each --warmup then --steps timed steps; a plan's figure is
// the median of its rounds' medians): the same model and batch on the simulated GPU uncapped
// ("uncapped", the state on the device), uncapped with the optimizer offloaded ("zero-offload":
// master weights, moments and the update on the host, the parameters on the device; the update
// runs on the host as the streamed plan's does, so the two differ only in where the parameters
// live) and capped ("streamed"). Prints per plan:
//   step_ms, x_uncapped   the median step time, and over the uncapped plan's (above 1: slower)
//   dev_mb pred/meas      the device tier's predicted peak (planner/memory_model.h) and the
//                         simulated GPU's allocator peak over the run (under the cap, which the
//                         allocator enforces: a step over it fails)
//   copy_mb plan/meas     bytes copied between the tiers a step: the plan's (the copy tasks'
//                         outputs, MemoryProfile tier_copy_bytes) and the trace's (what each copy
//                         task copied, per timed step)
//   hidden                of the copy tasks' time, the share their worker was also computing
//                         (core/timeline.h HiddenUnderCompute over the timed steps' traces)
// and the memory plan's reason. --json PATH writes the figures as JSON.
//
// What the simulated GPU is not: its copies are memcpy plus a scramble on the host and its
// kernels the CPU's, so the link's speed and the compute's are the host's; the figures say the
// plan moves what it says and overlaps it, not what a PCIe link would cost (scripts/gpu_check.sh
// on a real GPU).
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "bench/bench_util.h"
#include "bench/gpt2_batch.h"

#include "core/atomic_file.h"
#include "core/timeline.h"
#include "core/version.h"
#include "model/gpt2.h"
#include "planner/memory_model.h"
#include "planner/step_graph.h"
#include "training/trainer.h"
#include "worker/gpu.h"

namespace {

using tessera::Status;

constexpr const char* kProgram = "bench_streaming";
template <typename T>
T Check(tessera::Result<T> result, const std::string& what) {
  return tessera::bench::Check(kProgram, std::move(result), what);
}
using tessera::bench::Median;

struct Flags {
  std::string preset = "small";
  int64_t batch = 4;
  double states_over_cap = 3.0;
  int rounds = 3;
  int warmup = 1;
  int steps = 3;
  int threads = 0;
  std::string json;
};

struct Row {
  std::string plan;
  int64_t cap = 0;
  std::vector<double> round_ms, round_hidden;
  double step_ms = 0, hidden = 0;
  int64_t predicted_device_peak = 0, measured_device_peak = 0;
  int64_t planned_copy = 0, measured_copy = 0;  // per step
  std::string offload, reason;
};

double Mb(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// Trains the plan `warmup` + `steps` steps on a fresh simulated GPU capped at `cap` (0: none).
void RunOnce(const Flags& flags, const tessera::ModelSpec& model, const tessera::TrainingPlan& plan,
             const std::vector<tessera::Tensor>& batch, int64_t cap, Row& row) {
  tessera::ExecutorOptions options;
  options.threads = flags.threads;
  options.device = Check(tessera::OpenGpu(0, cap), "open the simulated GPU");
  auto trainer = Check(tessera::Trainer::Create(model, plan, options), "plan " + row.plan);
  if (Status s = trainer->InitializeParameters(1); !s.ok())
    tessera::bench::Die(kProgram, s, "init");
  std::vector<double> times;
  for (int step = 0; step < flags.warmup + flags.steps; ++step) {
    const tessera::StepReport report = Check(trainer->Step(batch, 1e-4f), "step");
    if (step >= flags.warmup) times.push_back(report.step_ms);
  }
  row.round_ms.push_back(Median(times));
  row.measured_device_peak =
      std::max(row.measured_device_peak, options.device->memory().peak_bytes);
  const tessera::Timeline timeline = Check(trainer->StepTimeline(flags.steps), "trace");
  const auto copies = [](const tessera::TimelineSpan& span) {
    return span.kind == tessera::SpanKind::kTransfer && span.bytes > 0;
  };
  int64_t copied = 0;
  for (const tessera::TimelineSpan& span : timeline.spans) copied += copies(span) ? span.bytes : 0;
  row.measured_copy = copied / flags.steps;
  const tessera::OverlapFigures overlap = tessera::HiddenUnderCompute(timeline, copies);
  if (overlap.spans > 0) row.round_hidden.push_back(overlap.hidden());
  const tessera::StepGraph& step = trainer->step_graph();
  const tessera::MemoryProfile profile = Check(tessera::PredictMemory(step.graph), "predict");
  row.predicted_device_peak =
      profile.workers[0].peaks[static_cast<size_t>(tessera::MemoryTier::kDevice)].bytes;
  row.planned_copy = profile.workers[0].tier_copy_bytes;
  row.offload = tessera::OffloadModeName(step.parallel.offload);
  row.reason = step.memory.reason;
}

}  // namespace

static int Main(int argc, char** argv) {
  Flags flags;
  CLI::App app{
      "A GPT-2 whose model states are several times the (simulated) GPU's memory, trained with "
      "its parameters streamed from the host, against the same GPT-2 uncapped (see the header "
      "for the figures)"};
  app.set_version_flag("--version", tessera::VersionLine("bench_streaming"));
  app.add_option("--preset", flags.preset, "GPT-2 preset: tiny, small or gpt2-124m");
  app.add_option("--batch", flags.batch, "Sequences per step")->check(CLI::PositiveNumber);
  app.add_option("--states-over-cap", flags.states_over_cap,
                 "The model states (16 bytes a parameter) over the device's memory cap")
      ->check(CLI::Range(1.0, 100.0));
  app.add_option("--rounds", flags.rounds, "Rounds of both plans (alternating order)")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", flags.warmup, "Untimed steps per plan and round")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", flags.steps, "Timed steps per plan and round")
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", flags.threads, "Executor threads (0: one per core)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--json", flags.json, "Also write the figures to this JSON file");
  CLI11_PARSE(app, argc, argv);
  ::setenv("TESSERA_SIMULATED_GPU", "1", 1);

  tessera::Gpt2Config config = Check(tessera::Gpt2Config::Preset(flags.preset), "preset");
  config.activations = tessera::GpuActivations();
  const tessera::ModelSpec model = Check(tessera::BuildGpt2(config), "build GPT-2");
  tessera::TrainingPlan plan;
  plan.batch = flags.batch;
  plan.seq_len = config.max_seq_len;
  plan.device = tessera::Device::Cuda(0);
  const std::vector<tessera::Tensor> batch =
      Check(tessera::bench::SyntheticGpt2Batch(config, plan.batch, plan.seq_len), "batch");
  const int64_t states = 16 * model.NumParameters();
  const auto cap = static_cast<int64_t>(static_cast<double>(states) / flags.states_over_cap);
  std::fprintf(stderr,
               "%s: gpt2-%s, %.1fM parameters: model states %.1f MiB, device cap %.1f MiB\n",
               kProgram, flags.preset.c_str(), model.NumParameters() / 1e6, Mb(states), Mb(cap));
  tessera::TrainingPlan capped = plan;
  capped.memory.device_bytes = cap;
  tessera::TrainingPlan optimizer_offload = plan;
  optimizer_offload.parallel.offload = tessera::OffloadMode::kOptimizer;
  std::vector<Row> rows(3);
  std::vector<const tessera::TrainingPlan*> plans = {&plan, &optimizer_offload, &capped};
  rows[0].plan = "uncapped";
  rows[1].plan = "zero-offload";
  rows[2].plan = "streamed";
  rows[2].cap = cap;
  for (int round = 0; round < flags.rounds; ++round) {
    for (size_t i = 0; i < rows.size(); ++i) {
      const size_t v = (i + static_cast<size_t>(round)) % rows.size();
      std::fprintf(stderr, "%s: round %d/%d: %s\n", kProgram, round + 1, flags.rounds,
                   rows[v].plan.c_str());
      RunOnce(flags, model, *plans[v], batch, rows[v].cap, rows[v]);
    }
  }
  std::printf("%-12s %10s %9s %10s %21s %21s %7s\n", "plan", "offload", "step_ms", "x_uncapped",
              "dev_mb pred/meas", "copy_mb plan/meas", "hidden");
  std::string json = "[\n";
  for (Row& row : rows) {
    row.step_ms = Median(row.round_ms);
    row.hidden = row.round_hidden.empty() ? 0 : Median(row.round_hidden);
    const double x = row.step_ms / rows[0].step_ms;
    std::printf("%-12s %10s %9.1f %10.3f %9.2f / %-9.2f %9.2f / %-9.2f %7.3f\n", row.plan.c_str(),
                row.offload.c_str(), row.step_ms, x, Mb(row.predicted_device_peak),
                Mb(row.measured_device_peak), Mb(row.planned_copy), Mb(row.measured_copy),
                row.hidden);
    json += fmt::format(
        "  {{\"plan\": \"{}\", \"offload\": \"{}\", \"device_cap\": {}, \"model_states\": {}, "
        "\"step_ms\": {:.3f}, \"x_uncapped\": {:.4f}, \"predicted_device_peak\": {}, "
        "\"measured_device_peak\": {}, \"planned_copy_bytes\": {}, \"measured_copy_bytes\": {}, "
        "\"hidden\": {:.4f}}}{}\n",
        row.plan, row.offload, row.cap, states, row.step_ms, x, row.predicted_device_peak,
        row.measured_device_peak, row.planned_copy, row.measured_copy, row.hidden,
        &row == &rows.back() ? "" : ",");
  }
  json += "]\n";
  for (const Row& row : rows) {
    if (!row.reason.empty()) std::printf("%s: %s\n", row.plan.c_str(), row.reason.c_str());
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

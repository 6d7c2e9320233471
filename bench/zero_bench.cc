// bench_zero: GPT-2 training step time under data parallel (ZeRO stage 0) and ZeRO-1/2/3 on a
// local cluster of CPU workers (one thread each), next to PyTorch DistributedDataParallel (gloo,
// CPU, one thread per rank) on the same model and global batch, measured in the same run.
//
// For each worker count in --workers: a local cluster of that many workers, then for each stage
// in --stages a Trainer with plan.parallel = {data_parallel = N, zero_stage = S}, --warmup
// steps, then --steps timed steps (StepReport::step_ms, median). PyTorch's figure comes from
// bench/torch_ddp_gpt2.py (run once per worker count with the python in --torch; the slowest
// rank's step time, median). Prints a table:
//   workers stage  tessera_ms  torch_ddp_ms  ratio (tessera / torch: below 1, Tessera is faster)
//   model_state_mb   per-rank peak parameters + gradients + optimizer state (RunFigures)
//   sent_mb          per-rank collective bytes sent in one step
//   hidden           the overlap figure of the last timed steps' traces (core/timeline.h
//                    HiddenUnderCompute): of the time each worker's collectives ran, the share
//                    during which that worker was also computing, for the forward pass's
//                    parameter gathers, the backward pass's, and the gradient reductions
//                    (all_reduce, reduce_scatter); "-" where a plan has none
// and, with --json PATH, the same figures as JSON.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "bench/bench_util.h"

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "client/trace.h"
#include "core/timeline.h"
#include "core/version.h"
#include "model/gpt2.h"
#include "training/token_dataset.h"
#include "training/trainer.h"

namespace {

using tessera::Status;

constexpr const char* kProgram = "bench_zero";
[[noreturn]] void Die(const Status& status, const std::string& what) {
  tessera::bench::Die(kProgram, status, what);
}
template <typename T>
T Check(tessera::Result<T> result, const std::string& what) {
  return tessera::bench::Check(kProgram, std::move(result), what);
}
using tessera::bench::Median;

struct Flags {
  int64_t layers = 4;
  int64_t channels = 128;
  int64_t heads = 4;
  int64_t vocab = 256;
  int64_t batch = 8;
  int64_t seq_len = 64;
  int steps = 20;
  int warmup = 3;
  std::vector<int> workers = {2, 4};
  std::vector<int> stages = {0, 1, 2, 3};
  std::string torch = "/usr/bin/python3";
  bool no_torch = false;
  std::string json;
  std::string trace_dir;
  double bucket_mb = -1;  // negative: auto (sized from the measured link)
};

struct Row {
  int workers = 0;
  int stage = 0;
  double tessera_ms = 0;
  double torch_ms = -1;                   // negative: not measured
  std::vector<int64_t> model_state_peak;  // per rank, bytes
  std::vector<int64_t> bytes_sent;        // per rank, one step
  float final_loss = 0;
  // Over the last timed steps (negative: none of the kind).
  double hidden_forward_gathers = -1;
  double hidden_backward_gathers = -1;
  double hidden_reductions = -1;
  std::string buckets;  // examples' DescribeBuckets: size, fused collectives, why
};

// The overlap figures of the trainer's last `steps` step traces.
void MeasureOverlap(const Flags& flags, tessera::Trainer& trainer, int steps, Row& row) {
  const tessera::Timeline timeline = Check(trainer.StepTimeline(steps), "the steps' traces");
  if (!flags.trace_dir.empty()) {
    const std::string path =
        fmt::format("{}/zero_w{}_s{}.json", flags.trace_dir, row.workers, row.stage);
    if (Status s = tessera::WriteChromeTrace(path, timeline); !s.ok()) Die(s, "write the trace");
  }
  const auto hidden = [&](auto selected) {
    const tessera::OverlapFigures figures = tessera::HiddenUnderCompute(timeline, selected);
    return figures.spans == 0 ? -1.0 : figures.hidden();
  };
  const auto gather = [](const tessera::TimelineSpan& span) {
    return span.op.rfind("all_gather", 0) == 0;
  };
  const auto backward = [](const tessera::TimelineSpan& span) {
    return span.name.find("backward") != std::string::npos;
  };
  row.hidden_forward_gathers =
      hidden([&](const tessera::TimelineSpan& span) { return gather(span) && !backward(span); });
  row.hidden_backward_gathers =
      hidden([&](const tessera::TimelineSpan& span) { return gather(span) && backward(span); });
  row.hidden_reductions = hidden([](const tessera::TimelineSpan& span) {
    return span.op == "all_reduce" || span.op == "reduce_scatter";
  });
}

std::string Percent(double fraction) {
  return fraction < 0 ? "-" : fmt::format("{:.0f}%", 100 * fraction);
}

std::string JsonFraction(double fraction) {
  return fraction < 0 ? "null" : fmt::format("{:.4f}", fraction);
}

using tessera::bench::Capture;
using tessera::bench::JsonNumber;

// PyTorch DDP's median step ms at `workers` ranks, or a negative number when it could not run.
double TorchDdpMs(const Flags& flags, int workers) {
  const std::string script = std::string(TESSERA_SOURCE_DIR) + "/bench/torch_ddp_gpt2.py";
  const std::string command = fmt::format(
      "{} {} --workers {} --layers {} --channels {} --heads {} --vocab {} --seq-len {} "
      "--batch {} --steps {} --warmup {} 2>/dev/null",
      flags.torch, script, workers, flags.layers, flags.channels, flags.heads, flags.vocab,
      flags.seq_len, flags.batch, flags.steps, flags.warmup);
  return JsonNumber(Capture(command), "median_ms");
}

tessera::Gpt2Config ModelConfig(const Flags& flags) {
  return tessera::Gpt2Config{.layers = flags.layers,
                             .channels = flags.channels,
                             .heads = flags.heads,
                             .vocab = flags.vocab,
                             .max_seq_len = flags.seq_len};
}

Row MeasureTessera(const Flags& flags, tessera::Cluster& cluster, int workers, int stage) {
  const tessera::Gpt2Config config = ModelConfig(flags);
  tessera::TrainingPlan plan;
  plan.batch = flags.batch;
  plan.seq_len = flags.seq_len;
  plan.parallel.data_parallel = workers;
  plan.parallel.zero_stage = stage;
  if (flags.bucket_mb >= 0)
    plan.parallel.bucket_bytes = static_cast<int64_t>(flags.bucket_mb * 1e6);
  const std::string what = fmt::format("{} workers, stage {}", workers, stage);
  auto backend = Check(MakeClusterBackend(cluster, tessera::ClusterPlacement::kScheduler), what);
  auto trainer = Check(
      tessera::Trainer::Create(Check(tessera::BuildGpt2(config), what), plan, std::move(backend)),
      what);
  if (Status s = trainer->InitializeParameters(1); !s.ok()) Die(s, what);
  Row row{.workers = workers, .stage = stage};
  const tessera::BucketChoice& buckets = trainer->step_graph().buckets;
  if (!buckets.reason.empty()) {
    row.buckets = fmt::format("{:.2f} MB, {} fused per step: {}", buckets.bytes / 1e6,
                              trainer->step_graph().fused_reductions, buckets.reason);
  }
  const tessera::TokenDataset data =
      tessera::TokenDataset::Synthetic(200'000, static_cast<int32_t>(flags.vocab), 9);
  auto sampler = Check(tessera::BatchSampler::Create(data, flags.batch, flags.seq_len, 3), what);
  std::vector<int32_t> tokens(flags.batch * flags.seq_len), targets(tokens.size());
  std::vector<double> times;
  for (int step = 0; step < flags.warmup + flags.steps; ++step) {
    sampler.Next(tokens.data(), targets.data());
    auto batch =
        Check(tessera::Gpt2Batch(config, tokens, targets, flags.batch, flags.seq_len), what);
    const tessera::StepReport report = Check(trainer->Step(batch, 1e-3f), what);
    if (step < flags.warmup) continue;
    times.push_back(report.step_ms);
    row.final_loss = report.loss;
    row.model_state_peak.clear();
    row.bytes_sent.clear();
    for (const tessera::RankFigures& rank : report.ranks) {
      row.model_state_peak.push_back(rank.figures.model_state_peak);
      row.bytes_sent.push_back(rank.figures.collective_bytes_sent);
    }
  }
  row.tessera_ms = Median(times);
  // The scheduler keeps the last trace_instances (16) instances' spans.
  MeasureOverlap(flags, *trainer, std::min(flags.steps, 8), row);
  return row;
}

// "1.23/1.23/..." in MB, one figure per rank.
std::string PerRankMb(const std::vector<int64_t>& bytes) {
  std::string out;
  for (size_t r = 0; r < bytes.size(); ++r) {
    out += fmt::format("{}{:.2f}", r == 0 ? "" : "/", static_cast<double>(bytes[r]) / 1e6);
  }
  return out.empty() ? "-" : out;
}

std::string JsonArray(const std::vector<int64_t>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i)
    out += fmt::format("{}{}", i == 0 ? "" : ",", values[i]);
  return out + "]";
}

void WriteJson(const Flags& flags, int64_t params, const std::vector<Row>& rows) {
  std::ofstream out(flags.json);
  out << fmt::format(
      "{{\"layers\":{},\"channels\":{},\"heads\":{},\"vocab\":{},\"seq_len\":{},\"batch\":{},"
      "\"params\":{},\"steps\":{},\"warmup\":{},\"rows\":[",
      flags.layers, flags.channels, flags.heads, flags.vocab, flags.seq_len, flags.batch, params,
      flags.steps, flags.warmup);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    out << fmt::format(
        "{}{{\"workers\":{},\"stage\":{},\"tessera_ms\":{:.3f},\"torch_ddp_ms\":{},"
        "\"model_state_peak_bytes\":{},\"collective_bytes_sent\":{},\"final_loss\":{:.5f},"
        "\"hidden_forward_gathers\":{},\"hidden_backward_gathers\":{},"
        "\"hidden_reductions\":{}}}",
        i == 0 ? "" : ",", row.workers, row.stage, row.tessera_ms,
        row.torch_ms < 0 ? std::string("null") : fmt::format("{:.3f}", row.torch_ms),
        JsonArray(row.model_state_peak), JsonArray(row.bytes_sent), row.final_loss,
        JsonFraction(row.hidden_forward_gathers), JsonFraction(row.hidden_backward_gathers),
        JsonFraction(row.hidden_reductions));
  }
  out << "]}\n";
  if (!out) {
    std::fprintf(stderr, "bench_zero: could not write %s\n", flags.json.c_str());
    std::exit(1);
  }
}

}  // namespace

static int Main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"GPT-2 step time: Tessera data parallel and ZeRO-1/2/3 vs PyTorch DDP (gloo)"};
  app.set_version_flag("--version", tessera::VersionLine("bench_zero"));
  app.add_option("--layers", flags.layers, "Transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--channels", flags.channels, "Model width")->check(CLI::PositiveNumber);
  app.add_option("--heads", flags.heads, "Attention heads")->check(CLI::PositiveNumber);
  app.add_option("--vocab", flags.vocab, "Vocabulary size")->check(CLI::PositiveNumber);
  app.add_option("--batch", flags.batch, "Global batch (rows per step over all ranks)")
      ->check(CLI::PositiveNumber);
  app.add_option("--seq-len", flags.seq_len, "Sequence length (also the model's max_seq_len)")
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", flags.steps, "Timed steps per measurement (median)")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", flags.warmup, "Untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--workers", flags.workers, "CPU worker counts, e.g. 2,4")
      ->delimiter(',')
      ->check(CLI::Range(1, 64));
  app.add_option("--stages", flags.stages, "ZeRO stages, e.g. 0,1,2,3")
      ->delimiter(',')
      ->check(CLI::Range(0, 3));
  app.add_option("--torch", flags.torch, "Python with PyTorch for bench/torch_ddp_gpt2.py");
  app.add_flag("--no-torch", flags.no_torch, "Skip the side-by-side PyTorch DDP measurement");
  app.add_option("--json", flags.json, "Also write the figures as JSON to this file");
  app.add_option("--trace-dir", flags.trace_dir,
                 "Also write each row's last timed steps as a Chrome trace "
                 "(DIR/zero_w<workers>_s<stage>.json)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--bucket-mb", flags.bucket_mb,
                 "Gradient buckets of this many MB (0: one collective per layer; default: sized "
                 "from the collectives' latency and bandwidth, measured on the workers)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);

  const tessera::Gpt2Config config = ModelConfig(flags);
  if (Status s = config.Validate(); !s.ok()) Die(s, "model");
  const int64_t params = config.NumParameters();
  std::printf(
      "bench_zero: GPT-2 layers=%lld channels=%lld heads=%lld vocab=%lld seq_len=%lld "
      "global batch=%lld, %lld parameters; %d timed steps after %d warm-up, 1 thread per "
      "worker\n",
      static_cast<long long>(flags.layers), static_cast<long long>(flags.channels),
      static_cast<long long>(flags.heads), static_cast<long long>(flags.vocab),
      static_cast<long long>(flags.seq_len), static_cast<long long>(flags.batch),
      static_cast<long long>(params), flags.steps, flags.warmup);
  std::printf("%7s %5s %11s %13s %7s  %-27s  %-25s  %s\n", "workers", "stage", "tessera_ms",
              "torch_ddp_ms", "ratio", "model_state_mb (per rank)", "sent_mb/step (per rank)",
              "hidden gathers fwd/bwd, reductions");
  std::fflush(stdout);

  std::vector<Row> rows;
  for (int workers : flags.workers) {
    if (flags.batch % workers != 0) {
      std::fprintf(stderr, "bench_zero: --batch %lld is not divisible by %d workers; skipped\n",
                   static_cast<long long>(flags.batch), workers);
      continue;
    }
    double torch_ms = -1;
    if (!flags.no_torch) {
      torch_ms = TorchDdpMs(flags, workers);
      if (torch_ms < 0) {
        std::fprintf(stderr,
                     "bench_zero: PyTorch DDP did not run with %s (install python3-torch, or "
                     "pass --no-torch)\n",
                     flags.torch.c_str());
      }
    }
    tessera::LocalClusterOptions options;
    options.cpu_workers = workers;
    options.threads_per_worker = 1;
    auto cluster = Check(tessera::Cluster::StartLocal(options),
                         fmt::format("start a local cluster of {} workers", workers));
    for (int stage : flags.stages) {
      Row row = MeasureTessera(flags, *cluster, workers, stage);
      row.torch_ms = torch_ms;
      const std::string torch_text = torch_ms < 0 ? "-" : fmt::format("{:.2f}", torch_ms);
      const std::string ratio =
          torch_ms < 0 ? "-" : fmt::format("{:.3f}", row.tessera_ms / torch_ms);
      std::printf(
          "%7d %5d %11.2f %13s %7s  %-27s  %-25s  %s/%s, %s\n", workers, stage, row.tessera_ms,
          torch_text.c_str(), ratio.c_str(), PerRankMb(row.model_state_peak).c_str(),
          PerRankMb(row.bytes_sent).c_str(), Percent(row.hidden_forward_gathers).c_str(),
          Percent(row.hidden_backward_gathers).c_str(), Percent(row.hidden_reductions).c_str());
      if (!row.buckets.empty()) std::printf("        gradient buckets %s\n", row.buckets.c_str());
      std::fflush(stdout);
      rows.push_back(std::move(row));
    }
  }
  if (!flags.json.empty()) WriteJson(flags, params, rows);
  return 0;
}

int main(int argc, char** argv) {
  return tessera::bench::RunMain("bench_zero", [&] { return Main(argc, argv); });
}

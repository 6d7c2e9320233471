// bench_adamw: the CPU AdamW update (the optimizer step ZeRO-Offload runs on the host) in
// parameters per second, Tessera's kernel next to a plain loop and PyTorch's CPU AdamW, measured
// in the same run on the same machine.
//
// For each size in --numel: one flat fp32 group with gradient and Adam state, weight decay on the
// whole group (lr 1e-3, betas 0.9/0.95, eps 1e-8, decay 0.1: the GPT-2 training settings). Rows:
//   plain loop (scalar)      the update as a straightforward loop, vectorisation disabled, 1 thread
//   plain loop (compiler)    the same loop as GCC -O3 vectorises it for this build, 1 thread
//   tessera <isa>            cpu::AdamWUpdate forced to each instruction set the CPU has, 1 thread
//   tessera <best> xT        cpu::AdamWUpdate as the worker runs it: best ISA, TBB over T threads
//   torch foreach=F/T [xT]   torch.optim.AdamW.step() (bench/torch_adamw_cpu.py), 1 and T threads
// Each figure is the median of --repeats calls after --warmup calls. Columns: median ms, params/s,
// effective GB/s (28 bytes per parameter: read p, m, v, g; write p, m, v), and ratios against the
// plain scalar loop and against PyTorch's faster implementation at the same thread count (above
// 1: Tessera is faster).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <tbb/global_control.h>
#include <CLI/CLI.hpp>

#include "bench/bench_util.h"
#include "core/statistics.h"
#include "core/version.h"
#include "ops/cpu/kernels.h"

namespace {

using tessera::cpu::AdamWConfig;
using tessera::cpu::SimdLevel;

constexpr float kLr = 1e-3f;
constexpr AdamWConfig kConfig{.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
constexpr double kBytesPerParam = 28;

struct Flags {
  std::vector<int64_t> numel = {1 << 20, 1 << 24};
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int repeats = 10;
  int warmup = 2;
  std::string torch = "/usr/bin/python3";
  bool no_torch = false;
  std::string json;
};

struct Row {
  std::string impl;
  int64_t numel = 0;
  int threads = 1;
  double median_s = 0;
  bool tessera = false;  // our kernel (its ratio against torch is reported)
  bool plain = false;    // the scalar plain loop (the baseline of the "vs plain" column)
};

struct Group {
  std::vector<float> param, grad, m, v;
  explicit Group(int64_t n) : param(n), grad(n), m(n, 0.0f), v(n, 0.0f) {
    for (int64_t i = 0; i < n; ++i) {
      param[static_cast<size_t>(i)] = 0.02f * static_cast<float>((i * 7919) % 2001 - 1000) / 1000;
      grad[static_cast<size_t>(i)] = 0.01f * static_cast<float>((i * 104729) % 2001 - 1000) / 1000;
    }
  }
};

// The update a user would write first: one loop, whole group decayed, the same scalar algebra.
// One body, compiled twice: once with GCC's vectoriser off (the scalar baseline) and once as the
// build compiles any loop (functions with different optimisation options cannot share an inlined
// helper, hence the macro).
#define TESSERA_PLAIN_ADAMW_BODY                                                     \
  const double bias_correction1 = 1.0 - std::pow(0.9, static_cast<double>(step));    \
  const double bias_correction2 = 1.0 - std::pow(0.95, static_cast<double>(step));   \
  const float step_size = static_cast<float>(kLr / bias_correction1);                \
  const float bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));            \
  const float decay = 1.0f - kLr * kConfig.weight_decay;                             \
  for (size_t i = 0; i < g.param.size(); ++i) {                                      \
    g.param[i] *= decay;                                                             \
    g.m[i] = kConfig.beta1 * g.m[i] + (1 - kConfig.beta1) * g.grad[i];               \
    g.v[i] = kConfig.beta2 * g.v[i] + (1 - kConfig.beta2) * g.grad[i] * g.grad[i];   \
    g.param[i] -= step_size * g.m[i] / (std::sqrt(g.v[i]) / bc2_sqrt + kConfig.eps); \
  }

__attribute__((optimize("no-tree-vectorize"))) void PlainLoopScalar(Group& g, int64_t step) {
  TESSERA_PLAIN_ADAMW_BODY
}
void PlainLoopCompiler(Group& g, int64_t step) { TESSERA_PLAIN_ADAMW_BODY }
#undef TESSERA_PLAIN_ADAMW_BODY

template <typename Update>
double MedianSeconds(const Flags& flags, int64_t n, const Update& update) {
  Group group(n);
  std::vector<double> times;
  for (int i = 0; i < flags.warmup + flags.repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    update(group, static_cast<int64_t>(i) + 1);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i >= flags.warmup) times.push_back(seconds);
  }
  return tessera::Median(std::move(times));
}

std::vector<Row> MeasureTessera(const Flags& flags, int64_t n) {
  std::vector<Row> rows;
  rows.push_back({.impl = "plain loop (scalar)",
                  .numel = n,
                  .median_s = MedianSeconds(flags, n, PlainLoopScalar),
                  .plain = true});
  rows.push_back({.impl = "plain loop (compiler-vectorised)",
                  .numel = n,
                  .median_s = MedianSeconds(flags, n, PlainLoopCompiler)});
  const int64_t whole[] = {0, n};
  auto tessera = [&](tessera::cpu::KernelExecution execution) {
    return [&, execution](Group& g, int64_t step) {
      tessera::cpu::AdamWUpdate(g.param.data(), g.m.data(), g.v.data(), g.grad.data(), n, kConfig,
                                kLr, step, 1.0f, whole, 1, 0, execution);
    };
  };
  const SimdLevel best = tessera::cpu::BestSimdLevel();
  for (SimdLevel level : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (level > best) break;
    rows.push_back(
        {.impl = fmt::format("tessera {}", tessera::cpu::SimdLevelName(level)),
         .numel = n,
         .median_s = MedianSeconds(flags, n, tessera({.simd = level, .parallel = false})),
         .tessera = true});
  }
  rows.push_back(
      {.impl = fmt::format("tessera {} x{}", tessera::cpu::SimdLevelName(best), flags.threads),
       .numel = n,
       .threads = flags.threads,
       .median_s = MedianSeconds(flags, n, tessera({.simd = best, .parallel = true})),
       .tessera = true});
  return rows;
}

// PyTorch's rows at `threads` intra-op threads (empty when it could not run).
std::vector<Row> MeasureTorch(const Flags& flags, int64_t n, int threads) {
  const std::string script = std::string(TESSERA_SOURCE_DIR) + "/bench/torch_adamw_cpu.py";
  const std::string output = tessera::bench::Capture(
      fmt::format("{} {} --numel {} --threads {} --repeats {} --warmup {} 2>/dev/null", flags.torch,
                  script, n, threads, flags.repeats, flags.warmup));
  std::vector<Row> rows;
  size_t line_start = 0;
  while (line_start < output.size()) {
    size_t line_end = output.find('\n', line_start);
    if (line_end == std::string::npos) line_end = output.size();
    const std::string line = output.substr(line_start, line_end - line_start);
    line_start = line_end + 1;
    const size_t impl_at = line.find("\"impl\": \"");
    const double median = tessera::bench::JsonNumber(line, "median_s");
    if (impl_at == std::string::npos || median <= 0) continue;
    const size_t name_begin = impl_at + 9;
    std::string impl = line.substr(name_begin, line.find('"', name_begin) - name_begin);
    if (threads > 1) impl += fmt::format(" x{}", threads);
    rows.push_back({.impl = impl, .numel = n, .threads = threads, .median_s = median});
  }
  return rows;
}

// The fastest PyTorch row of the same size and thread count, or nullptr.
const Row* BestTorch(const std::vector<Row>& rows, const Row& row) {
  const Row* best = nullptr;
  for (const Row& other : rows) {
    if (other.tessera || other.impl.rfind("torch", 0) != 0 || other.numel != row.numel ||
        other.threads != row.threads) {
      continue;
    }
    if (best == nullptr || other.median_s < best->median_s) best = &other;
  }
  return best;
}

const Row* PlainFor(const std::vector<Row>& rows, int64_t n) {
  for (const Row& row : rows) {
    if (row.plain && row.numel == n) return &row;
  }
  return nullptr;
}

std::string Report(const std::vector<Row>& rows, std::string* json) {
  std::string text = fmt::format("{:>10} {:<38} {:>9} {:>11} {:>7} {:>9} {:>9}\n", "numel", "impl",
                                 "ms", "Mparams/s", "GB/s", "vs_plain", "vs_torch");
  *json = "[";
  for (const Row& row : rows) {
    const double params_per_s = static_cast<double>(row.numel) / row.median_s;
    const Row* plain = PlainFor(rows, row.numel);
    const Row* torch = row.tessera ? BestTorch(rows, row) : nullptr;
    const double vs_plain = plain != nullptr ? plain->median_s / row.median_s : -1;
    const double vs_torch = torch != nullptr ? torch->median_s / row.median_s : -1;
    text += fmt::format("{:>10} {:<38} {:>9.3f} {:>11.1f} {:>7.2f} {:>9.2f} {:>9}\n", row.numel,
                        row.impl, row.median_s * 1e3, params_per_s * 1e-6,
                        params_per_s * kBytesPerParam * 1e-9, vs_plain,
                        torch != nullptr ? fmt::format("{:.2f}", vs_torch) : "-");
    *json += fmt::format(
        "{}{{\"numel\": {}, \"impl\": \"{}\", \"threads\": {}, \"median_s\": {:.6g}, "
        "\"params_per_s\": {:.6g}, \"vs_plain\": {:.4g}, \"vs_torch\": {:.4g}}}",
        json->size() > 1 ? ",\n " : "", row.numel, row.impl, row.threads, row.median_s,
        params_per_s, vs_plain, vs_torch);
  }
  *json += "]\n";
  return text;
}

}  // namespace

static int Main(int argc, char** argv) {
  Flags flags;
  CLI::App app{
      "bench_adamw: CPU AdamW params/s, Tessera's kernel vs a plain loop vs PyTorch's CPU "
      "AdamW, in the same run"};
  app.set_version_flag("--version", tessera::VersionLine("bench_adamw"));
  app.add_option("--numel", flags.numel, "group sizes (parameters)")->capture_default_str();
  app.add_option("--threads", flags.threads, "threads of the parallel rows")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--repeats", flags.repeats, "timed calls per row (median)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", flags.warmup, "untimed calls first")->capture_default_str();
  app.add_option("--torch", flags.torch, "python with PyTorch, for the peer rows")
      ->capture_default_str();
  app.add_flag("--no-torch", flags.no_torch, "skip PyTorch");
  app.add_option("--json", flags.json, "also write the rows as JSON to this file");
  CLI11_PARSE(app, argc, argv);
  for (int64_t n : flags.numel) {
    if (n <= 0) {
      std::fprintf(stderr, "bench_adamw: --numel %lld is not a positive size\n",
                   static_cast<long long>(n));
      return 2;
    }
  }

  tbb::global_control threads(tbb::global_control::max_allowed_parallelism,
                              static_cast<size_t>(flags.threads));
  std::fprintf(stderr, "bench_adamw: best instruction set %s, %d threads\n",
               std::string(tessera::cpu::SimdLevelName(tessera::cpu::BestSimdLevel())).c_str(),
               flags.threads);
  std::vector<Row> rows;
  for (int64_t n : flags.numel) {
    std::fprintf(stderr, "bench_adamw: %lld parameters ...\n", static_cast<long long>(n));
    for (Row& row : MeasureTessera(flags, n)) rows.push_back(std::move(row));
    if (flags.no_torch) continue;
    std::vector<int> torch_threads = {1};
    if (flags.threads > 1) torch_threads.push_back(flags.threads);
    for (int t : torch_threads) {
      std::vector<Row> torch = MeasureTorch(flags, n, t);
      if (torch.empty()) {
        std::fprintf(stderr,
                     "bench_adamw: PyTorch did not run with %s (install python3-torch, or pass "
                     "--no-torch)\n",
                     flags.torch.c_str());
        return 1;
      }
      for (Row& row : torch) rows.push_back(std::move(row));
    }
  }
  std::string json;
  std::fputs(Report(rows, &json).c_str(), stdout);
  if (!flags.json.empty()) {
    std::ofstream out(flags.json);
    out << json;
    if (!out) {
      std::fprintf(stderr, "bench_adamw: cannot write %s\n", flags.json.c_str());
      return 1;
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  return tessera::bench::RunMain("bench_adamw", [&] { return Main(argc, argv); });
}

// bench_executor: the executor's own cost per task, without processes or messages. A graph of
// --tasks empty tasks (op noop) and one join that reads them all, prepared once and run --runs
// times on an InProcessExecutor of --threads threads. This is the worker's share of
// bench_runtime's tasks_per_s_graph (issue 33): that figure adds the RunGraph round trip through
// the scheduler and the spans of each instance. Prints the median over the runs:
//   tasks_per_s       tasks / wall seconds of a run (Run: bind, run every task, end)
//   ns_per_task       its inverse
#include <chrono>
#include <cstdio>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "bench/bench_util.h"
#include "core/version.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/graph_builder.h"
#include "worker/in_process_executor.h"

namespace {

constexpr const char* kProgram = "bench_executor";
template <typename T>
T Check(tessera::Result<T> result, const std::string& what) {
  return tessera::bench::Check(kProgram, std::move(result), what);
}

int Main(int argc, char** argv) {
  int tasks = 50'000, runs = 20, threads = 1;
  CLI::App app{"Executor cost per task: empty tasks and a join, in process"};
  app.set_version_flag("--version", tessera::VersionLine("bench_executor"));
  app.add_option("--tasks", tasks, "Empty tasks per run")->check(CLI::Range(1, 1'000'000));
  app.add_option("--runs", runs, "Timed runs (median)")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "Executor threads")->check(CLI::Range(1, 256));
  CLI11_PARSE(app, argc, argv);

  const tessera::OpRegistry registry = Check(tessera::MakeCpuOpRegistry(), "registry");
  tessera::GraphBuilder builder(registry);
  std::vector<tessera::ObjectId> outs;
  outs.reserve(static_cast<size_t>(tasks));
  for (int i = 0; i < tasks; ++i) {
    outs.push_back(Check(builder.AddTask(fmt::format("t{}", i), "noop", {}, {}), "build")[0]);
  }
  builder.MarkOutput(Check(builder.AddTask("join", "noop", outs, {}), "build")[0]);
  tessera::ExecutorOptions options;
  options.threads = threads;
  tessera::InProcessExecutor executor(registry, options);
  const tessera::PreparedGraph prepared =
      Check(executor.Prepare(Check(builder.Build(), "build")), "prepare");
  Check(executor.Run(prepared, {}), "warm-up run");
  std::vector<double> seconds;
  for (int run = 0; run < runs; ++run) {
    const auto start = std::chrono::steady_clock::now();
    Check(executor.Run(prepared, {}), "run");
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  const double median = tessera::bench::Median(seconds);
  const double per_run = static_cast<double>(tasks + 1);
  std::printf("bench_executor: %d empty tasks and a join, %d thread(s), median of %d runs\n", tasks,
              threads, runs);
  std::printf("tasks_per_s=%.0f\n", per_run / median);
  std::printf("ns_per_task=%.1f\n", median * 1e9 / per_run);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::bench::RunMain(kProgram, [&] { return Main(argc, argv); });
}

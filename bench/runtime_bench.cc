// bench_runtime: the distributed runtime's overheads on a local cluster of 2 CPU workers.
//
// Prints one `name=value` per line:
//   tasks_per_s_dynamic   empty tasks submitted one by one from one driver (asynchronously),
//                         until all have finished
//   task_latency_us_p50   one trivial task's round trip: Submit, then Get of its result
//   task_latency_us_p99
//   tasks_per_s_graph     empty tasks run through a registered graph (per worker: many tasks and
//                         a join), instance after instance
//   transfer_gbps         a 64 MiB object pulled from one worker by another (data plane time,
//                         reported by the pulling worker)
//   memcpy_gbps           single-threaded memcpy of 64 MiB in this process, for scale
// Ray's published figures for comparison (docs/benchmarks.md): about 8,000 asynchronous tasks/s
// from one client and about 1 ms per synchronous task on a 64-core machine.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench/bench_util.h"
#include "client/cluster.h"
#include "core/version.h"
#include "ops/graph_builder.h"
#include "ops/standard_ops.h"

namespace {

using Clock = std::chrono::steady_clock;
using tessera::Cluster;
using tessera::ObjectRef;
using tessera::Status;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

[[noreturn]] void Die(const Status& status, const char* what) {
  std::fprintf(stderr, "bench_runtime: %s: %s\n", what, status.ToString().c_str());
  std::exit(1);
}

template <typename T>
T Check(tessera::Result<T> result, const char* what) {
  if (!result.ok()) Die(result.status(), what);
  return std::move(result).value();
}

double DynamicTasksPerSecond(Cluster& cluster, int tasks) {
  std::vector<ObjectRef> refs;
  refs.reserve(static_cast<size_t>(tasks));
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < tasks; ++i) {
    refs.push_back(Check(cluster.Submit("noop", {}), "submit")[0]);
  }
  if (Status s = cluster.Wait(refs, 120'000); !s.ok()) Die(s, "wait");
  return tasks / Seconds(start);
}

std::pair<double, double> LatencyMicros(Cluster& cluster, int rounds) {
  std::vector<double> micros;
  for (int i = 0; i < rounds; ++i) {
    const Clock::time_point start = Clock::now();
    ObjectRef out = Check(cluster.Submit("noop", {}), "submit")[0];
    Check(cluster.Get(out, 10'000), "get");
    micros.push_back(Seconds(start) * 1e6);
  }
  std::sort(micros.begin(), micros.end());
  return {micros[micros.size() / 2], micros[micros.size() * 99 / 100]};
}

double TransferGbps(Cluster& cluster, int repeats) {
  tessera::ClusterInfo info = Check(cluster.Info(), "status");
  if (info.workers.size() < 2) Die(tessera::Unavailable("need 2 workers"), "transfer");
  const tessera::WorkerId producer = info.workers[0].id, consumer = info.workers[1].id;
  const int64_t floats = int64_t{16} << 20;  // 64 MiB
  tessera::Tensor value =
      Check(tessera::Tensor::Zeros({tessera::Shape{floats}, tessera::DType::kF32},
                                   std::make_shared<tessera::AlignedHostAllocator>()),
            "allocate");
  ObjectRef seed = Check(cluster.Put(value), "put");
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    // A 64 MiB object on the producer (pulled there from this driver: set-up, not measured).
    ObjectRef held =
        Check(cluster.Submit("sleep", {seed}, {{"ms", int64_t{0}}}, {.pinned_worker = producer}),
              "produce")[0];
    if (Status s = cluster.Wait({held}, 30'000); !s.ok()) Die(s, "produce");
    auto pulled_before = [&] {
      for (const auto& w : Check(cluster.Info(), "status").workers) {
        if (w.id == consumer) return std::make_pair(w.bytes_pulled, w.pull_micros);
      }
      return std::make_pair(int64_t{0}, int64_t{0});
    };
    const auto before = pulled_before();
    ObjectRef reduced = Check(
        cluster.Submit("sum_of_squares", {held}, {}, {.pinned_worker = consumer}), "consume")[0];
    if (Status s = cluster.Wait({reduced}, 30'000); !s.ok()) Die(s, "consume");
    // The consumer's heartbeat carries its data-plane counters.
    for (int wait = 0; wait < 100; ++wait) {
      const auto after = pulled_before();
      if (after.first - before.first >= floats * 4) {
        const double seconds = static_cast<double>(after.second - before.second) * 1e-6;
        best = std::max(best, static_cast<double>(after.first - before.first) / seconds / 1e9);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return best;
}

// Per worker: `per_worker` empty tasks pinned to it and one join that waits for them all (the
// graph's output). Each instance is one RunGraph: one message per worker through the scheduler.
double GraphTasksPerSecond(Cluster& cluster, int per_worker, int instances) {
  tessera::OpRegistry registry;
  if (Status s = tessera::RegisterStandardOps(registry); !s.ok()) Die(s, "registry");
  tessera::GraphBuilder builder(registry);
  std::vector<tessera::WorkerId> workers;
  for (const auto& w : Check(cluster.Info(), "status").workers) workers.push_back(w.id);
  for (size_t w = 0; w < workers.size(); ++w) {
    tessera::TaskOptions options;
    options.pinned_worker = workers[w];
    std::vector<tessera::ObjectId> outs;
    outs.reserve(static_cast<size_t>(per_worker));
    for (int i = 0; i < per_worker; ++i) {
      outs.push_back(Check(builder.AddTask(fmt::format("w{}.t{}", w, i), "noop", {}, {}, options),
                           "build")[0]);
    }
    builder.MarkOutput(
        Check(builder.AddTask(fmt::format("w{}.join", w), "noop", outs, {}, options), "build")[0]);
  }
  tessera::Graph graph = Check(builder.Build(), "build");
  const tessera::GraphHandle handle = Check(cluster.RegisterGraph(graph), "register");
  auto run_once = [&] {
    auto outputs = Check(cluster.RunGraph(handle, {}), "run");
    std::vector<ObjectRef> refs;
    refs.reserve(outputs.size());
    for (auto& [id, ref] : outputs) refs.push_back(ref);
    if (Status s = cluster.Wait(refs, 60'000); !s.ok()) Die(s, "run");
  };
  run_once();  // warm-up: first allocations
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < instances; ++i) run_once();
  return static_cast<double>(instances) * graph.num_tasks() / Seconds(start);
}

double MemcpyGbps() {
  const size_t bytes = size_t{64} << 20;
  std::vector<char> source(bytes, 1), dest(bytes, 2);
  double best = 0;
  for (int i = 0; i < 10; ++i) {
    const Clock::time_point start = Clock::now();
    std::memcpy(dest.data(), source.data(), bytes);
    asm volatile("" : : "r"(dest.data()) : "memory");  // the copy must happen
    best = std::max(best, static_cast<double>(bytes) / Seconds(start) / 1e9);
  }
  return best;
}

}  // namespace

static int Main(int argc, char** argv) {
  int tasks = 20'000, rounds = 2000, repeats = 5, workers = 2, graph_tasks = 50'000,
      graph_instances = 10;
  std::vector<std::string> only;
  CLI::App app{"Runtime overheads of Tessera on a local cluster (see the header for metrics)"};
  app.set_version_flag("--version", tessera::VersionLine("bench_runtime"));
  app.add_option("--tasks", tasks, "Empty tasks for the throughput runs")
      ->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "Round trips for latency")->check(CLI::PositiveNumber);
  app.add_option("--repeats", repeats, "64 MiB transfers")->check(CLI::PositiveNumber);
  app.add_option("--workers", workers, "CPU workers")->check(CLI::Range(2, 64));
  app.add_option("--graph-tasks", graph_tasks, "Empty tasks per worker in the registered graph")
      ->check(CLI::PositiveNumber);
  app.add_option("--graph-instances", graph_instances, "Timed instances of the registered graph")
      ->check(CLI::PositiveNumber);
  app.add_option("--only", only, "Run only these measurements (default: all)")
      ->check(CLI::IsMember({"dynamic", "latency", "graph", "transfer"}));
  CLI11_PARSE(app, argc, argv);
  auto wanted = [&](const char* name) {
    return only.empty() || std::find(only.begin(), only.end(), name) != only.end();
  };

  tessera::LocalClusterOptions options;
  options.cpu_workers = workers;
  auto cluster = Check(Cluster::StartLocal(options), "start a local cluster");
  if (wanted("dynamic")) {
    DynamicTasksPerSecond(*cluster, 2000);  // warm-up
    std::printf("tasks_per_s_dynamic=%.0f\n", DynamicTasksPerSecond(*cluster, tasks));
    std::fflush(stdout);
  }
  if (wanted("latency")) {
    LatencyMicros(*cluster, 100);  // warm-up
    const auto [p50, p99] = LatencyMicros(*cluster, rounds);
    std::printf("task_latency_us_p50=%.1f\ntask_latency_us_p99=%.1f\n", p50, p99);
    std::fflush(stdout);
  }
  if (wanted("graph")) {
    std::printf("tasks_per_s_graph=%.0f\n",
                GraphTasksPerSecond(*cluster, graph_tasks, graph_instances));
    std::fflush(stdout);
  }
  if (wanted("transfer")) std::printf("transfer_gbps=%.2f\n", TransferGbps(*cluster, repeats));
  std::printf("memcpy_gbps=%.2f\n", MemcpyGbps());
  return 0;
}

int main(int argc, char** argv) {
  return tessera::bench::RunMain("bench_runtime", [&] { return Main(argc, argv); });
}

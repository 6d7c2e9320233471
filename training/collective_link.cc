#include "training/collective_link.h"

#include <algorithm>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "core/collective_task.h"
#include "core/statistics.h"
#include "ops/graph_builder.h"
#include "ops/standard_ops.h"

namespace tessera {

namespace {

constexpr int64_t kSmallElements = 256;      // 1 KiB of f32
constexpr int64_t kLargeElements = 1 << 18;  // 1 MiB
constexpr int kSmallRounds = 8;
constexpr int kLargeRounds = 4;
constexpr int kTimedRuns = 3;

struct Probe {
  Graph graph;
  std::vector<ObjectId> inputs;  // per worker: the small buffer, then the large one
};

// Per worker, a chain of all-reduces of a small buffer, then of a large one ("link/small3",
// "link/large0"; every worker's member of a round shares the round's collective).
Result<Probe> BuildProbe(const OpRegistry& registry, const std::vector<WorkerId>& workers,
                         Device device) {
  GraphBuilder builder(registry);
  Probe probe;
  const auto size = static_cast<int64_t>(workers.size());
  for (int64_t r = 0; r < size; ++r) {
    TaskOptions options;
    options.pinned_worker = workers[static_cast<size_t>(r)];
    options.device_kind = device.kind;
    int64_t id = 0;
    for (const auto& [what, elements, rounds] :
         {std::tuple{"small", kSmallElements, kSmallRounds},
          std::tuple{"large", kLargeElements, kLargeRounds}}) {
      ObjectId x =
          builder.AddInput(fmt::format("rank{}/link/{}", r, what),
                           TensorMeta{Shape{elements}, DType::kF32, device}, ObjectRole::kInput);
      probe.inputs.push_back(x);
      for (int round = 0; round < rounds; ++round) {
        const Attrs attrs{{kCollectiveAttr, ++id},
                          {kRankAttr, r},
                          {kGroupSizeAttr, size},
                          {"reduce", std::string("sum")}};
        TESSERA_ASSIGN_OR_RETURN(
            auto out, builder.AddTask(fmt::format("rank{}/link/{}{}", r, what, round), "all_reduce",
                                      {x}, attrs, options));
        x = out[0];
      }
      builder.MarkOutput(x);
    }
  }
  TESSERA_ASSIGN_OR_RETURN(probe.graph, builder.Build());
  return probe;
}

// Zeros for every input of the probe, on the backend.
Result<ValueMap> ProbeInputs(GraphBackend& backend, const Probe& probe, Device device) {
  ValueMap inputs;
  for (ObjectId id : probe.inputs) {
    TensorMeta meta = probe.graph.object(id).meta;
    meta.device = Device::Cpu();
    TESSERA_ASSIGN_OR_RETURN(Tensor zeros, Tensor::Zeros(meta, backend.allocator()));
    TESSERA_ASSIGN_OR_RETURN(inputs[id], backend.UploadTo(std::move(zeros), device));
  }
  return inputs;
}

}  // namespace

Result<CollectiveLink> MeasureCollectiveLink(GraphBackend& backend,
                                             const std::vector<WorkerId>& workers, Device device) {
  if (workers.size() < 2) {
    return InvalidArgument("measuring the collectives' link needs two or more workers, got {}",
                           workers.size());
  }
  const auto fail = [](const Status& status) {
    return status.WithContext("measuring the collectives' latency and bandwidth");
  };
  OpRegistry registry;
  if (Status s = RegisterStandardOps(registry); !s.ok()) return fail(s);
  Result<Probe> probe = BuildProbe(registry, workers, device);
  if (!probe.ok()) return fail(probe.status());
  Result<int> handle = backend.Register(probe->graph);
  if (!handle.ok()) return fail(handle.status());
  // Once to connect the communicators, then kTimedRuns timed.
  for (int run = 0; run < 1 + kTimedRuns; ++run) {
    Result<ValueMap> inputs = ProbeInputs(backend, *probe, device);
    if (!inputs.ok()) return fail(inputs.status());
    if (Result<ValueMap> out = backend.Run(*handle, *std::move(inputs)); !out.ok()) {
      return fail(out.status());
    }
  }
  Result<Timeline> timeline = backend.LastTimeline(*handle, kTimedRuns);
  if (!timeline.ok()) return fail(timeline.status());
  // Per run and collective ("link/small3"), its shortest member span.
  std::map<std::pair<uint64_t, std::string>, int64_t> shortest;
  for (const TimelineSpan& span : timeline->spans) {
    if (span.op != "all_reduce") continue;
    const size_t slash = span.name.find('/');
    if (slash == std::string::npos) continue;
    auto [it, added] = shortest.emplace(std::pair{span.instance, span.name.substr(slash + 1)},
                                        std::numeric_limits<int64_t>::max());
    it->second = std::min(it->second, span.end_us - span.start_us);
  }
  // Per run: the median small collective and the median large one.
  std::map<uint64_t, std::vector<double>> small_us, large_us;
  for (const auto& [key, us] : shortest) {
    const auto& [instance, round] = key;
    (round.starts_with("link/small") ? small_us : large_us)[instance].push_back(
        static_cast<double>(us));
  }
  std::vector<double> latencies, bandwidths;
  for (auto& [instance, small] : small_us) {
    std::vector<double>& large = large_us[instance];
    if (small.size() != static_cast<size_t>(kSmallRounds) ||
        large.size() != static_cast<size_t>(kLargeRounds)) {
      return fail(
          Internal("a probe run's trace holds {} small and {} large collectives, not {} "
                   "and {}",
                   small.size(), large.size(), kSmallRounds, kLargeRounds));
    }
    // A span has microsecond ends: at least 1 us.
    const double latency = std::max(1.0, Median(small));
    latencies.push_back(latency);
    const double extra_bytes = static_cast<double>((kLargeElements - kSmallElements) * 4);
    bandwidths.push_back(extra_bytes / std::max(1.0, Median(large) - latency));
  }
  if (latencies.size() != static_cast<size_t>(kTimedRuns)) {
    return fail(Internal("the trace holds {} probe runs, not {}", latencies.size(), kTimedRuns));
  }
  // The median run's figures: one run disturbed by the rest of the machine does not decide.
  CollectiveLink link;
  link.latency_us = Median(latencies);
  link.bytes_per_us = Median(bandwidths);
  return link;
}

namespace {

constexpr int kSmallHops = 16;  // tasks: hops + 1, so the chain ends on the worker it starts on
constexpr int kLargeHops = 8;
// Each hop's task works this long before its object leaves (a stage's layers between two hops):
// the receiver has been idle that long, as in a step. Back to back, with both workers just
// awake, a hop measured 31-73 us; a four-stage U-Net pipeline's hops took about 450 us in its
// step; after 2 ms of the sender's work, 69-124 us.
constexpr int64_t kHopWorkMs = 2;

// A chain of `hops` + 1 tasks passing a buffer of `elements` floats along, each kHopWorkMs long
// (the `sleep` op), alternating between `from` and `to` ("hop0" on `from`, "hop1" on `to`, ...).
Result<Graph> BuildChain(const OpRegistry& registry, WorkerId from, WorkerId to, Device device,
                         int64_t elements, int hops) {
  GraphBuilder builder(registry);
  ObjectId x = builder.AddInput("hop/input", TensorMeta{Shape{elements}, DType::kF32, device},
                                ObjectRole::kInput);
  for (int i = 0; i <= hops; ++i) {
    TaskOptions options;
    options.pinned_worker = i % 2 == 0 ? from : to;
    options.device_kind = device.kind;
    Attrs attrs;
    attrs.Set("ms", kHopWorkMs);
    TESSERA_ASSIGN_OR_RETURN(
        auto out, builder.AddTask(fmt::format("hop{}", i), "sleep", {x}, attrs, options));
    x = out[0];
  }
  builder.MarkOutput(x);
  return builder.Build();
}

// Per timed run of the chain, what a hop takes: the chain's time less its tasks', over the hops.
Result<std::vector<double>> HopMicros(GraphBackend& backend, const OpRegistry& registry,
                                      WorkerId from, WorkerId to, Device device, int64_t elements,
                                      int hops) {
  TESSERA_ASSIGN_OR_RETURN(Graph chain, BuildChain(registry, from, to, device, elements, hops));
  TESSERA_ASSIGN_OR_RETURN(const int handle, backend.Register(chain));
  const ObjectId input = chain.InputObjects().front();
  for (int run = 0; run < 1 + kTimedRuns; ++run) {
    TensorMeta meta = chain.object(input).meta;
    meta.device = Device::Cpu();
    TESSERA_ASSIGN_OR_RETURN(Tensor zeros, Tensor::Zeros(meta, backend.allocator()));
    ValueMap inputs;
    TESSERA_ASSIGN_OR_RETURN(inputs[input], backend.UploadTo(std::move(zeros), device));
    TESSERA_RETURN_IF_ERROR(backend.Run(handle, std::move(inputs)).status());
  }
  TESSERA_ASSIGN_OR_RETURN(Timeline timeline, backend.LastTimeline(handle, kTimedRuns));
  struct Run {
    int64_t first_start = std::numeric_limits<int64_t>::max(), last_end = 0, busy = 0;
    int tasks = 0;
  };
  std::map<uint64_t, Run> runs;
  for (const TimelineSpan& span : timeline.spans) {
    if (span.op != "sleep") continue;
    Run& run = runs[span.instance];
    run.first_start = std::min(run.first_start, span.start_us);
    run.last_end = std::max(run.last_end, span.end_us);
    run.busy += span.end_us - span.start_us;
    ++run.tasks;
  }
  std::vector<double> hop_us;
  for (const auto& [instance, run] : runs) {
    if (run.tasks != hops + 1) {
      return Internal("a chain run's trace holds {} tasks, not {}", run.tasks, hops + 1);
    }
    hop_us.push_back(
        static_cast<double>(std::max<int64_t>(0, run.last_end - run.first_start - run.busy)) /
        hops);
  }
  if (hop_us.size() != static_cast<size_t>(kTimedRuns)) {
    return Internal("the trace holds {} chain runs, not {}", hop_us.size(), kTimedRuns);
  }
  return hop_us;
}

}  // namespace

Result<CollectiveLink> MeasurePushLink(GraphBackend& backend, WorkerId from, WorkerId to,
                                       Device device) {
  const auto fail = [](const Status& status) {
    return status.WithContext("measuring the push link");
  };
  if (from == to) {
    return fail(
        InvalidArgument("the push link needs two distinct workers, got {} twice", from.value()));
  }
  OpRegistry registry;
  if (Status s = RegisterStandardOps(registry); !s.ok()) return fail(s);
  Result<std::vector<double>> small =
      HopMicros(backend, registry, from, to, device, kSmallElements, kSmallHops);
  if (!small.ok()) return fail(small.status());
  Result<std::vector<double>> large =
      HopMicros(backend, registry, from, to, device, kLargeElements, kLargeHops);
  if (!large.ok()) return fail(large.status());
  // A span has microsecond ends: at least 1 us.
  const double latency = std::max(1.0, Median(*small));
  const double extra_bytes = static_cast<double>((kLargeElements - kSmallElements) * 4);
  return CollectiveLink{latency, extra_bytes / std::max(1.0, Median(*large) - latency)};
}

}  // namespace tessera

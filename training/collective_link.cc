#include "training/collective_link.h"

#include <algorithm>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "core/collective_task.h"
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

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
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

}  // namespace tessera

#include "training/layer_profile.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <iterator>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/statistics.h"
#include "ops/standard_ops.h"
#include "planner/step_time.h"
#include "training/trainer.h"

namespace tessera {

namespace {

bool Computes(const TimelineSpan& span) {
  return span.stream >= 0 && span.kind != SpanKind::kCollective && span.kind != SpanKind::kTransfer;
}

// Per span, the microseconds of the worker's compute it had: its duration, shared equally with
// the compute spans of its worker running at the same time (processor sharing). 0 for spans that
// do not compute.
std::vector<double> SharedMicros(const Timeline& timeline) {
  const std::vector<TimelineSpan>& spans = timeline.spans;
  std::vector<double> shared(spans.size(), 0);
  std::map<WorkerId, std::vector<size_t>> by_worker;
  for (size_t i = 0; i < spans.size(); ++i) {
    if (Computes(spans[i])) by_worker[spans[i].worker].push_back(i);
  }
  for (const auto& [worker, indices] : by_worker) {
    // Starts (+1) and ends (-1) in time order, ends first at equal times.
    std::vector<std::pair<int64_t, int>> events;
    events.reserve(2 * indices.size());
    for (size_t i : indices) {
      events.emplace_back(spans[i].start_us, 1);
      events.emplace_back(spans[i].end_us, -1);
    }
    std::sort(events.begin(), events.end());
    // Each span's share is the integral of 1 / (spans running) over its interval: the running
    // integral at its end less that at its start.
    std::vector<std::pair<int64_t, double>> integral;  // (time, integral up to it)
    integral.reserve(events.size());
    int running = 0;
    double total = 0;
    int64_t last = events.empty() ? 0 : events.front().first;
    for (const auto& [time, delta] : events) {
      if (running > 0) total += static_cast<double>(time - last) / running;
      integral.emplace_back(time, total);
      running += delta;
      last = time;
    }
    const auto at = [&integral](int64_t time) {
      auto it = std::upper_bound(
          integral.begin(), integral.end(), time,
          [](int64_t t, const std::pair<int64_t, double>& point) { return t < point.first; });
      return it == integral.begin() ? 0.0 : std::prev(it)->second;
    };
    for (size_t i : indices) shared[i] = at(spans[i].end_us) - at(spans[i].start_us);
  }
  return shared;
}

// Whether LayerTimesFromTimeline counts the span: a task of one of the model's layers (`layers`
// their names) running its forward or (half of its) backward.
bool IsLayerSpan(const TimelineSpan& span, const std::map<std::string, size_t>& layers) {
  if (!layers.contains(span.layer)) return false;
  return span.kind == SpanKind::kForward || span.kind == SpanKind::kBackward ||
         span.kind == SpanKind::kBackwardInput || span.kind == SpanKind::kBackwardWeight;
}

std::map<std::string, size_t> LayerIndex(const ModelSpec& model) {
  std::map<std::string, size_t> index;
  for (size_t l = 0; l < model.layers.size(); ++l) index[model.layers[l].name] = l;
  return index;
}

// StepProfile::other_ms_per_unit of `timeline` (whose per-span shares are `shared`), a run of
// `graph`'s tasks.
Result<double> OtherMsPerUnit(const ModelSpec& model, const Graph& graph, const Timeline& timeline,
                              const std::vector<double>& shared) {
  OpRegistry registry;
  TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry));
  const std::map<std::string, size_t> layers = LayerIndex(model);
  double micros = 0, units = 0;
  for (size_t i = 0; i < timeline.spans.size(); ++i) {
    const TimelineSpan& span = timeline.spans[i];
    if (!Computes(span) || IsLayerSpan(span, layers)) continue;
    Result<TaskId> task = graph.FindTask(span.name);
    if (!task.ok()) continue;  // not the step graph's (another graph's instance)
    TESSERA_ASSIGN_OR_RETURN(const double estimate,
                             TaskCostUnits(graph, graph.task(*task), registry));
    micros += shared[i];
    units += estimate;
  }
  return units > 0 ? micros / 1e3 / units : 0.0;
}

}  // namespace

Result<std::vector<OpCosts>> LayerTimesFromTimeline(const ModelSpec& model,
                                                    const Timeline& timeline, int steps) {
  if (steps < 1) return InvalidArgument("layer times need at least one step, got {}", steps);
  const std::vector<double> shared = SharedMicros(timeline);
  const std::map<std::string, size_t> index = LayerIndex(model);
  std::vector<OpCosts> ms(model.layers.size(), OpCosts{0, 0, 0});
  for (size_t i = 0; i < timeline.spans.size(); ++i) {
    const TimelineSpan& span = timeline.spans[i];
    if (!IsLayerSpan(span, index)) continue;
    OpCosts& layer = ms[index.at(span.layer)];
    double* total = nullptr;
    switch (span.kind) {
      case SpanKind::kForward:
        total = &layer.forward;
        break;
      case SpanKind::kBackward:
      case SpanKind::kBackwardInput:
        total = &layer.backward;
        break;
      case SpanKind::kBackwardWeight:
        total = &layer.weight;
        break;
      default:
        continue;
    }
    *total += shared[i] / 1e3 / steps;
  }
  return ms;
}

double StepProfile::TaskOverheadMs() const {
  return tasks > 0 ? std::max(0.0, step_ms - busy_ms) / tasks : 0.0;
}

Result<std::vector<OpCosts>> ProfileLayerTimes(const ModelSpec& model, const TrainingPlan& plan,
                                               const ExecutorOptions& executor,
                                               const LayerProfileOptions& options) {
  TESSERA_ASSIGN_OR_RETURN(StepProfile profile, ProfileStep(model, plan, executor, options));
  return std::move(profile.layer_ms);
}

Result<StepProfile> ProfileStep(const ModelSpec& model, const TrainingPlan& plan,
                                const ExecutorOptions& executor,
                                const LayerProfileOptions& options) {
  if (options.steps < 1 || options.warmup_steps < 0) {
    return InvalidArgument("profiling the layers needs steps >= 1 and warmup_steps >= 0");
  }
  TrainingPlan one;
  one.batch = plan.parallel.MicroBatchRows(plan.batch);
  one.seq_len = plan.seq_len;
  one.optimizer = plan.optimizer;
  one.device = plan.device;
  one.parallel.split_backwards = options.split_backwards;
  if (one.batch < 1) {
    return InvalidArgument(
        "profiling the layers: the batch of {} rows gives no row per micro-batch over {} rank(s) "
        "x {} micro-batch(es)",
        plan.batch, plan.parallel.data_parallel, plan.parallel.micro_batches);
  }
  auto trainer = Trainer::Create(model, one, executor);
  if (!trainer.ok()) return trainer.status().WithContext("profiling the layers");
  std::vector<Tensor> batch;
  for (const ModelInput& input : model.inputs) {
    TESSERA_ASSIGN_OR_RETURN(
        Tensor zeros, Tensor::Zeros(input.Meta(one.batch, one.seq_len), SharedHostAllocator()));
    batch.push_back(std::move(zeros));
  }
  StepProfile profile;
  for (int step = 0; step < options.warmup_steps + options.steps; ++step) {
    // A zero learning rate: the profile leaves nothing to train, and nothing diverges.
    Result<StepReport> ran = (*trainer)->Step(batch, 0.0f);
    if (!ran.ok()) return ran.status().WithContext("profiling the layers");
    if (step >= options.warmup_steps) profile.step_ms += ran->step_ms / options.steps;
  }
  TESSERA_ASSIGN_OR_RETURN(Timeline timeline, (*trainer)->StepTimeline(options.steps));
  TESSERA_ASSIGN_OR_RETURN(profile.layer_ms,
                           LayerTimesFromTimeline(model, timeline, options.steps));
  const std::vector<double> shared = SharedMicros(timeline);
  for (double micros : shared) profile.busy_ms += micros / 1e3 / options.steps;
  profile.tasks = static_cast<double>(timeline.spans.size()) / options.steps;
  TESSERA_ASSIGN_OR_RETURN(profile.other_ms_per_unit,
                           OtherMsPerUnit(model, (*trainer)->step_graph().graph, timeline, shared));
  return profile;
}

}  // namespace tessera

namespace tessera {

Result<double> MeasureHostLink(DeviceRuntime& device, int64_t bytes, int repeats) {
  if (bytes < 1 || repeats < 1) {
    return InvalidArgument("measuring the host link: {} bytes {} times; both must be >= 1", bytes,
                           repeats);
  }
  const int64_t floats = (bytes + 3) / 4;
  TESSERA_ASSIGN_OR_RETURN(
      Tensor host,
      Tensor::Zeros(TensorMeta{Shape{floats}, DType::kF32, Device::Cpu()}, SharedHostAllocator()));
  TESSERA_ASSIGN_OR_RETURN(
      Tensor on_device,
      Tensor::Empty(TensorMeta{Shape{floats}, DType::kF32, device.device()}, device.allocator()));
  // Each direction timed to its end: a host destination is written when Copy returns; a device
  // one once the stream has done it.
  auto time_us = [&](bool up) -> Result<double> {
    const auto start = std::chrono::steady_clock::now();
    if (up) {
      TESSERA_RETURN_IF_ERROR(device.Copy(on_device.raw_data(), device.device(), host.raw_data(),
                                          Device::Cpu(), bytes));
      TESSERA_RETURN_IF_ERROR(device.Synchronize());
    } else {
      TESSERA_RETURN_IF_ERROR(device.Copy(host.raw_data(), Device::Cpu(), on_device.raw_data(),
                                          device.device(), bytes));
    }
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
        .count();
  };
  double slowest = 0;
  for (const bool up : {true, false}) {
    TESSERA_RETURN_IF_ERROR(time_us(up).status());  // untimed: first touch, pinning
    std::vector<double> times;
    for (int i = 0; i < repeats; ++i) {
      TESSERA_ASSIGN_OR_RETURN(double us, time_us(up));
      times.push_back(us);
    }
    slowest = std::max(slowest, Median(std::move(times)));
  }
  return static_cast<double>(bytes) / std::max(slowest, 1e-3);
}

Result<double> MeasureCopyCompute(const ModelSpec& model, const TrainingPlan& plan,
                                  const ExecutorOptions& executor, DeviceRuntime& link,
                                  const StepProfile& alone, const LayerProfileOptions& options) {
  constexpr int64_t kChunk = int64_t{16} << 20;
  constexpr int64_t kFloats = kChunk / 4;
  TESSERA_ASSIGN_OR_RETURN(
      Tensor host,
      Tensor::Zeros(TensorMeta{Shape{kFloats}, DType::kF32, Device::Cpu()}, SharedHostAllocator()));
  Result<Tensor> far =
      Tensor::Empty(TensorMeta{Shape{kFloats}, DType::kF32, link.device()}, link.allocator());
  if (!far.ok()) {
    return far.status().WithContext(
        fmt::format("measuring what copies to {} take from the compute", link.Describe()));
  }
  std::atomic<bool> stop{false};
  std::atomic<int64_t> copied{0};
  Status copy_status = Status::Ok();  // written by the copier, read after it is joined
  std::thread copier([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      Status down =
          link.Copy(far->raw_data(), link.device(), host.raw_data(), Device::Cpu(), kChunk);
      if (down.ok()) down = link.Synchronize();
      if (down.ok()) {
        down = link.Copy(host.raw_data(), Device::Cpu(), far->raw_data(), link.device(), kChunk);
      }
      if (!down.ok()) {
        copy_status = std::move(down);
        return;
      }
      copied.fetch_add(2 * kChunk, std::memory_order_relaxed);
    }
  });
  const auto start = std::chrono::steady_clock::now();
  Result<StepProfile> beside = ProfileStep(model, plan, executor, options);
  const double elapsed_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  stop.store(true, std::memory_order_relaxed);
  copier.join();
  const std::string what =
      fmt::format("measuring what copies to {} take from the compute", link.Describe());
  if (!copy_status.ok()) return copy_status.WithContext(what);
  if (!beside.ok()) return beside.status().WithContext(what);
  // The bytes a step of the profile saw copied beside it, at the copier's mean rate.
  const double per_step = static_cast<double>(copied.load()) / elapsed_us * beside->step_ms * 1e3;
  if (per_step <= 0) return 0.0;
  return std::max(0.0, (beside->step_ms - alone.step_ms) * 1e3) / per_step;
}

}  // namespace tessera

#include "planner/step_time.h"

#include <algorithm>
#include <map>
#include <string>

#include "core/disk_tasks.h"
#include "core/timeline.h"  // SpanKind
#include "ops/standard_ops.h"

namespace tessera {
namespace {

Result<double> UnitsOf(const Graph& graph, const TaskSpec& task, const OpRegistry& registry,
                       const Attrs& attrs) {
  std::vector<TensorMeta> inputs;
  inputs.reserve(task.inputs.size());
  for (ObjectId input : task.inputs) inputs.push_back(graph.object(input).meta);
  TESSERA_ASSIGN_OR_RETURN(OpCost cost, registry.Cost(task.op, inputs, attrs));
  return CostUnits(cost);
}

// What a task of the layer runs: its forward op (the forward, or a recompute), its backward op
// whole or in halves; kOther for anything else (accumulations, gathers, updates).
SpanKind LayerTaskKind(const LayerSpec& layer, const TaskSpec& task) {
  if (task.op == layer.forward_op) return SpanKind::kForward;
  if (task.op == layer.backward_op) return SpanKind::kBackward;
  if (!layer.backward_input_op.empty() && task.op == layer.backward_input_op) {
    return SpanKind::kBackwardInput;
  }
  if (!layer.backward_weight_op.empty() && task.op == layer.backward_weight_op) {
    return SpanKind::kBackwardWeight;
  }
  return SpanKind::kOther;
}

bool IsRecompute(const TaskSpec& task) { return task.name.find("/recompute") != std::string::npos; }

}  // namespace

Result<double> TaskCostUnits(const Graph& graph, const TaskSpec& task, const OpRegistry& registry) {
  return UnitsOf(graph, task, registry, task.attrs);
}

Result<std::vector<TaskTime>> EstimateTaskTimes(const Graph& graph, const ModelSpec& model,
                                                const std::vector<OpCosts>& layer_ms,
                                                const OpRegistry& registry,
                                                double disk_copy_compute_us_per_byte,
                                                double other_ms_per_unit) {
  if (layer_ms.size() != model.layers.size()) {
    return InvalidArgument("step time: {} measured layer times for a model of {} layers",
                           layer_ms.size(), model.layers.size());
  }
  std::map<std::string, size_t> index;
  for (size_t l = 0; l < model.layers.size(); ++l) index[model.layers[l].name] = l;
  const auto layer_of = [&](const TaskSpec& task) -> int {
    auto it = index.find(task.layer);
    return it == index.end() ? -1 : static_cast<int>(it->second);
  };
  // The rate the layers' forwards ran at (milliseconds per estimated unit), and each layer's
  // forward estimate (to scale a rebuild by).
  std::vector<double> forward_units(model.layers.size(), 0);
  double measured = 0, estimated = 0;
  for (const TaskSpec& task : graph.tasks()) {
    const int l = layer_of(task);
    if (l < 0 || IsRecompute(task) ||
        LayerTaskKind(model.layers[static_cast<size_t>(l)], task) != SpanKind::kForward) {
      continue;
    }
    auto& units = forward_units[static_cast<size_t>(l)];
    if (units > 0) continue;  // once per layer (every micro-batch has the same shapes)
    TESSERA_ASSIGN_OR_RETURN(units, UnitsOf(graph, task, registry, task.attrs));
    measured += layer_ms[static_cast<size_t>(l)].forward;
    estimated += units;
  }
  if (measured <= 0 || estimated <= 0) {
    return InvalidArgument(
        "step time: the layers' forwards were measured at {} ms and estimated at {} units; "
        "measure them first (ProfileLayerTimes)",
        measured, estimated);
  }
  const double ms_per_unit = measured / estimated;
  const double other_rate = other_ms_per_unit > 0 ? other_ms_per_unit : ms_per_unit;

  std::vector<TaskTime> times;
  times.reserve(graph.tasks().size());
  for (const TaskSpec& task : graph.tasks()) {
    TaskTime& time = times.emplace_back();
    if (TouchesDisk(graph, task)) {  // on the I/O thread, beside the compute: what it takes of it
      int64_t bytes = 0;
      for (ObjectId output : task.outputs) bytes += graph.object(output).meta.bytes();
      time.on_disk = true;
      time.ms = static_cast<double>(bytes) * disk_copy_compute_us_per_byte / 1e3;
      continue;
    }
    const int l = layer_of(task);
    const SpanKind kind =
        l < 0 ? SpanKind::kOther : LayerTaskKind(model.layers[static_cast<size_t>(l)], task);
    if (kind == SpanKind::kOther) {
      TESSERA_ASSIGN_OR_RETURN(double units, UnitsOf(graph, task, registry, task.attrs));
      time.ms = units * other_rate;
      continue;
    }
    const OpCosts& ms = layer_ms[static_cast<size_t>(l)];
    time.layer = true;
    time.ms = kind == SpanKind::kForward          ? ms.forward
              : kind == SpanKind::kBackwardWeight ? ms.weight
              : kind == SpanKind::kBackwardInput  ? ms.backward
                                                  : ms.backward + ms.weight;
    if (task.attrs.Has(kRebuildAttr) && kind != SpanKind::kForward) {
      Attrs whole = task.attrs;
      whole.Set(kRebuildAttr, std::string());  // "": the op rebuilds nothing
      TESSERA_ASSIGN_OR_RETURN(double with, UnitsOf(graph, task, registry, task.attrs));
      TESSERA_ASSIGN_OR_RETURN(double without, UnitsOf(graph, task, registry, whole));
      const double units = forward_units[static_cast<size_t>(l)];
      if (units > 0) time.ms += ms.forward * std::max(0.0, with - without) / units;
    }
  }
  return times;
}

Result<StepTimePrediction> PredictStepTime(const Graph& graph, const ModelSpec& model,
                                           const std::vector<OpCosts>& layer_ms,
                                           const OpRegistry& registry, double task_overhead_ms,
                                           double disk_copy_compute_us_per_byte) {
  TESSERA_ASSIGN_OR_RETURN(
      std::vector<TaskTime> times,
      EstimateTaskTimes(graph, model, layer_ms, registry, disk_copy_compute_us_per_byte));
  std::vector<WorkerId> workers;  // in order of first appearance
  std::vector<double> layer_part, other_part, overhead_part;
  for (size_t t = 0; t < times.size(); ++t) {
    const TaskSpec& task = graph.tasks()[t];
    auto found = std::find(workers.begin(), workers.end(), task.pinned_worker);
    const auto w = static_cast<size_t>(found - workers.begin());
    if (found == workers.end()) {
      workers.push_back(task.pinned_worker);
      layer_part.push_back(0);
      other_part.push_back(0);
      overhead_part.push_back(0);
    }
    overhead_part[w] += task_overhead_ms;
    (times[t].layer ? layer_part : other_part)[w] += times[t].ms;
  }
  StepTimePrediction prediction;
  for (size_t w = 0; w < workers.size(); ++w) {
    const double busy = layer_part[w] + other_part[w] + overhead_part[w];
    prediction.worker_ms.push_back(busy);
    if (busy >= prediction.step_ms) {
      prediction.step_ms = busy;
      prediction.layer_ms = layer_part[w];
      prediction.other_ms = other_part[w];
      prediction.overhead_ms = overhead_part[w];
    }
  }
  return prediction;
}

}  // namespace tessera

#include "training/layer_profile.h"

#include <map>
#include <string>

#include "training/trainer.h"

namespace tessera {

Result<std::vector<OpCosts>> LayerTimesFromTimeline(const ModelSpec& model,
                                                    const Timeline& timeline, int steps) {
  if (steps < 1) return InvalidArgument("layer times need at least one step, got {}", steps);
  std::map<std::string, size_t> index;
  for (size_t l = 0; l < model.layers.size(); ++l) index[model.layers[l].name] = l;
  std::vector<OpCosts> ms(model.layers.size(), OpCosts{0, 0, 0});
  for (const TimelineSpan& span : timeline.spans) {
    auto it = index.find(span.layer);
    if (it == index.end()) continue;
    OpCosts& layer = ms[it->second];
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
    *total += static_cast<double>(span.end_us - span.start_us) / 1e3 / steps;
  }
  return ms;
}

Result<std::vector<OpCosts>> ProfileLayerTimes(const ModelSpec& model, const TrainingPlan& plan,
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
  one.parallel.split_backwards = true;
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
  for (int step = 0; step < options.warmup_steps + options.steps; ++step) {
    // A zero learning rate: the profile leaves nothing to train, and nothing diverges.
    Result<StepReport> ran = (*trainer)->Step(batch, 0.0f);
    if (!ran.ok()) return ran.status().WithContext("profiling the layers");
  }
  TESSERA_ASSIGN_OR_RETURN(Timeline timeline, (*trainer)->StepTimeline(options.steps));
  return LayerTimesFromTimeline(model, timeline, options.steps);
}

}  // namespace tessera

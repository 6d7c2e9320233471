// PlanTrainingStep: the passes of planner/plan_passes.h over one plan state. And the small
// helpers of the plan types (planner/training_plan.h, planner/step_graph.h).
#include "planner/step_graph.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "ops/flat_layout.h"
#include "planner/plan_passes.h"
#include "planner/plan_state.h"

namespace tessera {

std::string ParallelConfig::ToString() const {
  std::string text =
      fmt::format("data_parallel={} zero_stage={} offload={} micro_batches={}", data_parallel,
                  zero_stage, OffloadModeName(offload), micro_batches);
  if (tensor_parallel > 1) text += fmt::format(" tensor_parallel={}", tensor_parallel);
  if (quantize_bits > 0) text += fmt::format(" quantize_collectives=int{}", quantize_bits);
  if (shard_sequence) text += " sequence_parallel=megatron";
  if (sequence_parallel > 1) {
    text += fmt::format(" sequence_parallel={} ({})", sequence_parallel,
                        SequenceAttentionName(sequence_attention));
  }
  if (pipeline_stages > 1 || virtual_stages > 1) {
    text += fmt::format(" pipeline_stages={} schedule={}", pipeline_stages, ScheduleName(schedule));
    if (virtual_stages > 1) text += fmt::format(" virtual_stages={}", virtual_stages);
  }
  if (bucket_bytes != kAutoBucketBytes) text += fmt::format(" bucket_bytes={}", bucket_bytes);
  return text;
}

BucketChoice ChooseGradientBuckets(const ParallelConfig& parallel) {
  if (parallel.bucket_bytes >= 0) {
    return BucketChoice{parallel.bucket_bytes,
                        parallel.bucket_bytes == 0
                            ? std::string("asked for: one collective per group")
                            : fmt::format("asked for: {:.2f} MB", parallel.bucket_bytes / 1e6)};
  }
  constexpr double kLatencyShare = 0.1;
  constexpr double kMaxBytes = 25.0 * (1 << 20);
  const CollectiveLink link =
      parallel.link.measured() ? parallel.link : CollectiveLink{50.0, 1000.0};
  const double wanted = (1 - kLatencyShare) / kLatencyShare * link.latency_us * link.bytes_per_us;
  // A power of two: links measured a little differently from run to run plan the same buckets.
  const double rounded = std::exp2(std::round(std::log2(std::max(wanted, 1.0))));
  const auto bytes = static_cast<int64_t>(std::min(rounded, kMaxBytes));
  return BucketChoice{
      bytes,
      fmt::format("{:.2f} MB, the power of two nearest 9 x latency x bandwidth ({:.2f} MB): a "
                  "collective's {:.1f} us latency is about {:.0f}% of a bucket's time at {:.2f} "
                  "GB/s ({}){}",
                  bytes / 1e6, wanted / 1e6, link.latency_us, 100 * kLatencyShare,
                  link.bytes_per_us / 1e3,
                  parallel.link.measured() ? "measured" : "not measured: 10 GbE assumed",
                  rounded > kMaxBytes ? ", capped at 25 MiB" : "")};
}

Result<OffloadMode> ParseOffload(std::string_view text) {
  if (text == "none") return OffloadMode::kNone;
  if (text == "optimizer") return OffloadMode::kOptimizer;
  if (text == "parameters") return OffloadMode::kParameters;
  return InvalidArgument("offload '{}' is not one of: none, optimizer, parameters", text);
}

const char* OffloadModeName(OffloadMode mode) {
  switch (mode) {
    case OffloadMode::kNone:
      return "none";
    case OffloadMode::kOptimizer:
      return "optimizer";
    case OffloadMode::kParameters:
      return "parameters";
  }
  return "none";
}

const char* StateKindName(StateKind kind) {
  switch (kind) {
    case StateKind::kParameter:
      return "params";
    case StateKind::kExpAvg:
      return "exp_avg";
    case StateKind::kExpAvgSq:
      return "exp_avg_sq";
    case StateKind::kMasterParameter:
      return "master_params";
    case StateKind::kWorkerError:
      return "worker_error";
    case StateKind::kServerError:
      return "server_error";
    case StateKind::kIntervalStart:
      return "interval_start";
  }
  return "?";
}

const std::vector<PlanPass>& TrainingPasses() {
  // The slots of the passes to come (planner/plan_passes.h): a tensor/sequence-parallel pass
  // before place_state, a memory pass after expand_layers, gradient compression around the
  // sharding policy's reductions.
  static const std::vector<PlanPass> passes = {
      {"validate", &ValidatePlanPass},
      {"cut", &CutPipelinePass},
      {"place_state", &PlaceStatePass},
      {"expand_layers", &ExpandLayersPass},
      {"reduce_gradients", &ReduceGradientsPass},
      {"add_loss", &AddLossPass},
      {"clip_gradients", &ClipGradientsPass},
      {"offload_downloads", &OffloadDownloadsPass},
      {"update_optimizer", &UpdateOptimizerPass},
      {"order_schedule", &OrderSchedulePass},
      {"settle_reductions", &SettleReductionsPass},
  };
  return passes;
}

Result<PlannedPasses> RunTrainingPasses(const ModelSpec& model, const TrainingPlan& plan,
                                        const OpRegistry& registry,
                                        std::vector<ActivationDecision> activation_choices,
                                        bool serialize_micro_batches) {
  PlanState state(model, plan, registry);
  state.activation_choices = std::move(activation_choices);
  state.serialize_micro_batches = serialize_micro_batches;
  for (const PlanPass& pass : TrainingPasses()) TESSERA_RETURN_IF_ERROR(pass.run(state));
  TESSERA_ASSIGN_OR_RETURN(state.step.graph, state.builder.Build());
  PlannedPasses planned;
  for (const RankState& rank : state.ranks) {
    planned.forward_task.push_back(rank.forward_task);
    planned.backward_task.push_back(rank.backward_task);
  }
  planned.step = std::move(state.step);
  return planned;
}

Result<StepGraph> PlanTrainingStep(const ModelSpec& model, const TrainingPlan& plan,
                                   const OpRegistry& registry) {
  return PlanWithinMemory(model, plan, registry);
}

}  // namespace tessera

// The validation pass and the checks behind it: TrainingPlan::Validate, in the order its
// messages are given (the first problem found is the one reported).
#include <cmath>

#include <fmt/format.h>

#include "core/block_quantization.h"
#include "planner/model_facts.h"
#include "planner/plan_passes.h"
#include "planner/sharding_policy.h"
#include "planner/training_plan.h"

namespace tessera {

namespace {

Status CheckOptimizer(const OptimizerConfig& o) {
  if (o.has_moments() &&
      (o.beta1 < 0 || o.beta1 >= 1 || o.beta2 < 0 || o.beta2 >= 1 || o.eps <= 0)) {
    return InvalidArgument("{} needs 0 <= beta1, beta2 < 1 and eps > 0 (got {}, {}, {})",
                           o.kind == OptimizerConfig::Kind::kAdamW        ? "AdamW"
                           : o.kind == OptimizerConfig::Kind::kOneBitAdam ? "1-bit Adam"
                                                                          : "0/1 Adam",
                           o.beta1, o.beta2, o.eps);
  }
  if (o.weight_decay < 0) {
    return InvalidArgument("weight_decay must be >= 0, got {}", o.weight_decay);
  }
  return Status::Ok();
}

// 1-bit and 0/1 Adam (`name`) run on data-parallel and pipeline plans only.
Status CheckCompressedOptimizerPlan(const ParallelConfig& p, const char* name) {
  if (p.offload != OffloadMode::kNone || p.tensor_parallel > 1 || p.sequence_parallel > 1) {
    return InvalidArgument(
        "{} runs on data-parallel (and pipeline) plans without offload, tensor or sequence "
        "parallelism for now: drop --offload / --tensor-parallel / --sequence-parallel, or use "
        "AdamW",
        name);
  }
  return Status::Ok();
}

// Each sequence of `seq_len` positions split over `ranks` ranks of `kind` ("sequence", ...).
Status CheckSequenceSplits(int64_t seq_len, int ranks, const char* kind) {
  if (seq_len % ranks == 0) return Status::Ok();
  return InvalidArgument(
      "seq_len {} does not split over {} {} ranks: use a --seq-len that is a multiple of {} "
      "(e.g. {})",
      seq_len, ranks, kind, ranks, (seq_len / ranks + 1) * ranks);
}

// The ranks, micro-batches and ZeRO stage, and the batch they split.
Status CheckRanks(const TrainingPlan& plan) {
  const ParallelConfig& p = plan.parallel;
  TESSERA_RETURN_IF_ERROR(CheckZeroStage(p.zero_stage));
  if (p.data_parallel < 1) {
    return InvalidArgument("data_parallel (--workers) must be >= 1, got {}", p.data_parallel);
  }
  if (p.micro_batches < 1) {
    return InvalidArgument("micro_batches must be >= 1, got {}", p.micro_batches);
  }
  if (p.tensor_parallel < 1) {
    return InvalidArgument("tensor_parallel (--tensor-parallel) must be >= 1, got {}",
                           p.tensor_parallel);
  }
  if (p.tensor_parallel > 1 && !plan.device.is_cpu()) {
    return InvalidArgument(
        "tensor parallelism runs the model's split layer programs, which run on CPU workers: use "
        "--tensor-parallel 1 on {}",
        plan.device.ToString());
  }
  if (p.sequence_parallel < 1 || p.data_parallel % p.sequence_parallel != 0) {
    return InvalidArgument(
        "sequence_parallel (--sequence-degree) {} must be >= 1 and divide the {} data-parallel "
        "ranks (each group of that many ranks splits the same rows' sequence)",
        p.sequence_parallel, p.data_parallel);
  }
  if (p.sequence_parallel > 1) {
    if (!plan.device.is_cpu()) {
      const bool slabs = p.sequence_attention == SequenceAttention::kHalo;
      return InvalidArgument(
          "{} parallelism runs the model's split layer programs, which run on CPU workers: use "
          "{} on {}",
          slabs ? "spatial" : "sequence",
          slabs ? "--spatial-parallel 1" : "--sequence-parallel none", plan.device.ToString());
    }
    // Slabs split a volume's depth, which the model's split checks (ModelSpec::split_into_slabs).
    if (p.sequence_attention != SequenceAttention::kHalo) {
      TESSERA_RETURN_IF_ERROR(CheckSequenceSplits(plan.seq_len, p.sequence_parallel, "sequence"));
    }
  }
  if (p.shard_sequence) {
    if (p.tensor_parallel < 2) {
      return InvalidArgument(
          "Megatron sequence parallelism shards each sequence over the tensor ranks, but the plan "
          "has {}: use --tensor-parallel 2 or more with it",
          p.tensor_parallel);
    }
    TESSERA_RETURN_IF_ERROR(CheckSequenceSplits(plan.seq_len, p.tensor_parallel,
                                                "tensor (Megatron sequence parallelism)"));
  }
  if (p.quantize_bits != 0) {
    TESSERA_RETURN_IF_ERROR(CheckQuantizationBits(p.quantize_bits));
    if (p.zero_stage != 3 || p.data_parallel < 2) {
      return InvalidArgument(
          "quantized collectives are ZeRO-3's parameter gathers and gradient reduce-scatters "
          "(ZeRO++): use --zero-stage 3 over several data-parallel ranks, or drop "
          "--quantize-collectives");
    }
  }
  if (p.prefetch_layers < 0) {
    return InvalidArgument("prefetch_layers must be >= 0, got {}", p.prefetch_layers);
  }
  if (plan.optimizer.kind == OptimizerConfig::Kind::kOneBitAdam) {
    if (plan.optimizer.freeze_step < 1) {
      return InvalidArgument("1-bit Adam's freeze step must be >= 1 (warm-up steps), got {}",
                             plan.optimizer.freeze_step);
    }
    if (p.zero_stage == 3 && p.data_parallel > 1) {
      return InvalidArgument(
          "1-bit Adam runs with ZeRO stages 0-2 (each rank's momentum is averaged whole, "
          "compressed, and needs the whole gradient and parameters): use --zero-stage 2, or "
          "AdamW with ZeRO-3");
    }
    TESSERA_RETURN_IF_ERROR(CheckCompressedOptimizerPlan(p, "1-bit Adam"));
  }
  if (plan.optimizer.kind == OptimizerConfig::Kind::kZeroOneAdam) {
    const OptimizerConfig& o = plan.optimizer;
    if (o.var_freeze_step < 1 || o.var_update_scaler < 1 || o.local_step_scaler < 1 ||
        o.local_step_clipper < 1) {
      return InvalidArgument(
          "0/1 Adam needs var_freeze_step, var_update_scaler, local_step_scaler and "
          "local_step_clipper >= 1 (got {}, {}, {}, {}): step 1 always updates the variance",
          o.var_freeze_step, o.var_update_scaler, o.local_step_scaler, o.local_step_clipper);
    }
    if (p.zero_stage > 0 && p.data_parallel > 1) {
      return InvalidArgument(
          "0/1 Adam runs on data-parallel (and pipeline) plans without ZeRO for now (its local "
          "steps update every rank's whole parameters): use --zero-stage 0, or --optimizer "
          "onebit-adam, which composes with ZeRO-1 and ZeRO-2");
    }
    TESSERA_RETURN_IF_ERROR(CheckCompressedOptimizerPlan(p, "0/1 Adam"));
  }
  if (plan.optimizer.kind == OptimizerConfig::Kind::kSgd && ShardsOptimizerState(p)) {
    return InvalidArgument("SGD has no optimizer state to shard: use ZeRO stage 0 or AdamW");
  }
  if (p.offload == OffloadMode::kParameters && !plan.device.is_cpu() &&
      !UpdatesTheParametersItKeeps(p)) {
    return InvalidArgument(
        "--offload parameters keeps each rank's parameters in the host tier and updates them "
        "there, but ZeRO-{} would all-gather the updated shards into every rank's full host "
        "copy: use --zero-stage 3 (each rank keeps and updates its shard) or 0",
        p.zero_stage);
  }
  const int row_groups = p.data_parallel / p.sequence_parallel;
  const int64_t splits = int64_t{row_groups} * p.micro_batches;
  if (plan.batch % splits != 0) {
    return InvalidArgument(
        "the batch of {} rows does not split evenly over {} worker(s){} x {} micro-batch(es): use "
        "a batch that is a multiple of {} (e.g. {}), or change --workers / --micro-batches",
        plan.batch, row_groups,
        p.sequence_parallel > 1 ? fmt::format(" (groups of {} sequence ranks)", p.sequence_parallel)
                                : std::string(),
        p.micro_batches, splits, (plan.batch / splits + 1) * splits);
  }
  return Status::Ok();
}

Status CheckPipeline(const ParallelConfig& p, const ModelSpec& model) {
  if (p.pipeline_stages < 1) {
    return InvalidArgument("pipeline stages must be >= 1, got {}", p.pipeline_stages);
  }
  if (p.pipeline_stages == 1 && p.virtual_stages == 1) return Status::Ok();
  TESSERA_RETURN_IF_ERROR(
      CheckSchedule(p.schedule, p.pipeline_stages, p.micro_batches, p.virtual_stages));
  const size_t chunks =
      static_cast<size_t>(p.pipeline_stages) * static_cast<size_t>(p.virtual_stages);
  if (chunks > model.layers.size()) {
    return InvalidArgument(
        "{} pipeline stage(s) x {} virtual stage(s) cut the model into {} chunks, but model "
        "'{}' has {} layers: use at most {} stages",
        p.pipeline_stages, p.virtual_stages, chunks, model.name, model.layers.size(),
        model.layers.size() / static_cast<size_t>(p.virtual_stages));
  }
  if (SplitsBackward(p.schedule)) {
    bool any = false;
    for (size_t l = 0; l < model.layers.size(); ++l) any |= SplitsLayerBackward(model, l);
    if (!any) {
      return Infeasible(
          "schedule {} splits each backward into input and weight gradients, but no layer of "
          "model '{}' has a split backward (one that returns input gradients): use --schedule "
          "1f1b, interleaved or gpipe",
          ScheduleName(p.schedule), model.name);
    }
  }
  return Status::Ok();
}

Status CheckCostsAndWorkers(const ParallelConfig& p, const ModelSpec& model) {
  if (!p.layer_costs.empty() && p.layer_costs.size() != model.layers.size()) {
    return InvalidArgument("{} layer costs given for a model of {} layers", p.layer_costs.size(),
                           model.layers.size());
  }
  if (!p.layer_op_costs.empty() && p.layer_op_costs.size() != model.layers.size()) {
    return InvalidArgument("{} layer op costs given for a model of {} layers",
                           p.layer_op_costs.size(), model.layers.size());
  }
  if (!p.resident_params.empty() && p.resident_params.size() != model.layers.size()) {
    return InvalidArgument("resident_params names {} layers for a model of {} layers",
                           p.resident_params.size(), model.layers.size());
  }
  if (!p.workers.empty() && static_cast<int>(p.workers.size()) != p.num_workers()) {
    if (p.pipeline_stages > 1 && p.tensor_parallel == 1) {
      return InvalidArgument(
          "{} worker(s) given for {} pipeline stages x {} data-parallel ranks: a pipeline needs "
          "P x D = {} workers",
          p.workers.size(), p.pipeline_stages, p.data_parallel, p.num_workers());
    }
    return InvalidArgument(
        "{} worker(s) given for {} data-parallel x {} tensor-parallel ranks x {} stage(s): the "
        "plan needs D x T x P = {} workers",
        p.workers.size(), p.data_parallel, p.tensor_parallel, p.pipeline_stages, p.num_workers());
  }
  return Status::Ok();
}

}  // namespace

Status TrainingPlan::Validate(const ModelSpec& model) const {
  // A whole model is checked as the step will be planned on it: split for the tensor or
  // sequence ranks.
  if (model.tensor_parallel != parallel.tensor_parallel ||
      model.sequence_parallel != parallel.sequence_parallel ||
      (model.rewritten() && model.shards_sequence != parallel.shard_sequence) ||
      (model.sequence_parallel > 1 && model.sequence_attention != parallel.sequence_attention)) {
    if (model.rewritten()) {
      return InvalidArgument(
          "the plan splits layers over {} tensor-parallel and sequences over {} rank(s) ({}) but "
          "model '{}' is split for {} and {} ({}): give the whole model",
          parallel.tensor_parallel, parallel.sequence_parallel,
          SequenceAttentionName(parallel.sequence_attention), model.name, model.tensor_parallel,
          model.sequence_parallel, SequenceAttentionName(model.sequence_attention));
    }
    TESSERA_ASSIGN_OR_RETURN(
        ModelSpec split, model.PlannedFor(parallel.tensor_parallel, parallel.sequence_parallel,
                                          parallel.shard_sequence, parallel.sequence_attention));
    return Validate(split);
  }
  TESSERA_RETURN_IF_ERROR(CheckShapeOfBatch(model, batch, seq_len));
  TESSERA_RETURN_IF_ERROR(CheckOptimizer(optimizer));
  TESSERA_RETURN_IF_ERROR(CheckRanks(*this));
  TESSERA_RETURN_IF_ERROR(CheckPipeline(parallel, model));
  if (memory.device_bytes < 0 || memory.host_bytes < 0) {
    return InvalidArgument("memory caps must be >= 0 bytes (0: uncapped), not device {} host {}",
                           memory.device_bytes, memory.host_bytes);
  }
  if (!(memory.host_link_bytes_per_us >= 0) || std::isinf(memory.host_link_bytes_per_us)) {
    return InvalidArgument("the host link's bandwidth {} bytes/us must be finite and >= 0",
                           memory.host_link_bytes_per_us);
  }
  if (!(memory.disk_link_bytes_per_us >= 0) || std::isinf(memory.disk_link_bytes_per_us)) {
    return InvalidArgument("the disk link's bandwidth {} bytes/us must be finite and >= 0",
                           memory.disk_link_bytes_per_us);
  }
  if (!(memory.disk_copy_compute_us_per_byte >= 0) ||
      std::isinf(memory.disk_copy_compute_us_per_byte)) {
    return InvalidArgument(
        "the compute time a byte copied to the disk takes, {} us, must be finite and >= 0",
        memory.disk_copy_compute_us_per_byte);
  }
  if (!(memory.activation_budget >= 0 && memory.activation_budget <= 1)) {
    return InvalidArgument(
        "the activation budget {} is not a fraction of the activations' peak in [0, 1] (0: none)",
        memory.activation_budget);
  }
  return CheckCostsAndWorkers(parallel, model);
}

Status ValidatePlanPass(PlanState& state) {
  TESSERA_RETURN_IF_ERROR(state.plan.Validate(state.model));
  const ParallelConfig& p = state.parallel;
  if (state.model.tensor_parallel != p.tensor_parallel ||
      state.model.sequence_parallel != p.sequence_parallel ||
      state.model.shards_sequence != (p.shard_sequence && p.tensor_parallel > 1) ||
      (p.sequence_parallel > 1 && state.model.sequence_attention != p.sequence_attention)) {
    return InvalidArgument(
        "the plan splits layers over {} tensor-parallel ranks and sequences over {}: plan the "
        "split model, model.PlannedFor({}, {}) (the trainer does)",
        p.tensor_parallel, p.sequence_parallel, p.tensor_parallel, p.sequence_parallel);
  }
  if (p.workers.empty() && p.num_workers() > 1) {
    const std::string ranks = p.tensor_parallel > 1
                                  ? fmt::format("{} data-parallel x {} tensor-parallel ranks",
                                                p.data_parallel, p.tensor_parallel)
                                  : fmt::format("{} data-parallel ranks", p.data_parallel);
    return InvalidArgument(
        "{} x {} pipeline stages need a worker each: run on a cluster with at least {} workers",
        ranks, p.pipeline_stages, p.num_workers());
  }
  TESSERA_ASSIGN_OR_RETURN(state.sharding, MakeShardingPolicy(p, state.plan.optimizer));
  return Status::Ok();
}

}  // namespace tessera

#include "planner/plan_state.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/collective_task.h"

namespace tessera {

PlanState::PlanState(const ModelSpec& model_in, const TrainingPlan& plan_in,
                     const OpRegistry& registry_in)
    : model(model_in),
      plan(plan_in),
      parallel(plan_in.parallel),
      registry(registry_in),
      num_ranks(plan_in.parallel.ranks_per_stage()),
      num_data_ranks(plan_in.parallel.data_parallel),
      tensor_parallel(plan_in.parallel.tensor_parallel),
      num_micro_batches(plan_in.parallel.micro_batches),
      num_stages(plan_in.parallel.pipeline_stages),
      num_layers(model_in.layers.size()),
      adam_moments(plan_in.optimizer.has_moments()),
      onebit_adam(plan_in.optimizer.kind == OptimizerConfig::Kind::kOneBitAdam),
      compressed_momentum(onebit_adam && plan_in.optimizer.compressed_phase &&
                          plan_in.parallel.data_parallel > 1),
      zero_one_adam(plan_in.optimizer.kind == OptimizerConfig::Kind::kZeroOneAdam),
      zero_one_step(plan_in.optimizer.zero_one_step),
      reduces_gradients(
          !compressed_momentum &&
          !(zero_one_adam && zero_one_step != OptimizerConfig::ZeroOneStep::kVariance)),
      error_feedback(compressed_momentum ||
                     (zero_one_adam && plan_in.parallel.data_parallel > 1 &&
                      (zero_one_step == OptimizerConfig::ZeroOneStep::kCompressedGradient ||
                       zero_one_step == OptimizerConfig::ZeroOneStep::kSync))),
      takes_local_steps(zero_one_adam && (zero_one_step == OptimizerConfig::ZeroOneStep::kLocal ||
                                          zero_one_step == OptimizerConfig::ZeroOneStep::kSync)),
      host_update(plan_in.parallel.offload != OffloadMode::kNone && !plan_in.device.is_cpu()),
      host_params(plan_in.parallel.offload == OffloadMode::kParameters && !plan_in.device.is_cpu()),
      builder(registry_in),
      last_gradient(static_cast<size_t>(std::max(plan_in.parallel.pipeline_stages, 1)), 0) {}

PlanState::~PlanState() = default;

std::string PlanState::Name(int r, const std::string& name) const {
  return num_ranks > 1 ? fmt::format("rank{}/{}", r, name) : name;
}

std::string PlanState::Micro(int k, const std::string& name) const {
  return num_micro_batches > 1 ? fmt::format("{}@{}", name, k) : name;
}

std::string PlanState::Staged(int s, const std::string& name) const {
  return num_stages > 1 ? fmt::format("stage{}/{}", s, name) : name;
}

TaskOptions PlanState::OnStage(int r, int s, const std::string& layer, int32_t priority,
                               std::vector<std::string> output_names,
                               std::vector<ObjectRole> output_roles) const {
  TaskOptions options;
  options.layer = layer;
  options.priority = priority;
  options.output_names = std::move(output_names);
  options.output_roles = std::move(output_roles);
  options.pinned_worker = parallel.WorkerOf(r, s);
  options.device_kind = plan.device.kind;
  return options;
}

TaskOptions PlanState::On(int r, const std::string& layer, int32_t priority,
                          std::vector<std::string> output_names,
                          std::vector<ObjectRole> output_roles) const {
  return OnStage(r, stage_of_name.at(layer), layer, priority, std::move(output_names),
                 std::move(output_roles));
}

TaskOptions PlanState::OnOptimizerDevice(TaskOptions options) const {
  options.priority = kOptimizerPriority;
  if (host_update) options.device_kind = DeviceKind::kCpu;
  return options;
}

TaskOptions PlanState::OnOptimizerDevice(int r, const std::string& layer,
                                         std::vector<std::string> output_names,
                                         std::vector<ObjectRole> output_roles) const {
  return OnOptimizerDevice(
      On(r, layer, kOptimizerPriority, std::move(output_names), std::move(output_roles)));
}

bool PlanState::ProducedOnStage(ObjectId id, int s) const {
  const TaskId producer = ProducerOf(id);
  if (!producer.valid()) return false;
  const std::string& layer = builder.graph().task(producer).layer;
  auto it = stage_of_name.find(layer);
  return it != stage_of_name.end() && it->second == s;
}

int64_t PlanState::CollectiveId(const std::string& name) {
  auto [it, inserted] =
      collective_ids.emplace(name, static_cast<int64_t>(collective_ids.size()) + 1);
  return it->second;
}

GroupPiece PlanState::ParameterPiece(size_t l, int r) const {
  GroupPiece piece = sharding->ParameterPiece(l, DataRank(r), step.group_numel[l]);
  piece.rank = r;
  return piece;
}

GroupPiece PlanState::UpdatePiece(size_t l, int r) const {
  GroupPiece piece = sharding->UpdatePiece(l, DataRank(r), step.group_numel[l]);
  piece.rank = r;
  return piece;
}

Attrs PlanState::DataCollective(const std::string& name, int r) {
  const int64_t id =
      CollectiveId(tensor_parallel > 1 ? fmt::format("tp{}/{}", TensorRank(r), name) : name);
  return Attrs{{kCollectiveAttr, id},
               {kRankAttr, int64_t{DataRank(r)}},
               {kGroupSizeAttr, int64_t{num_data_ranks}}};
}

Attrs PlanState::TensorCollective(const std::string& name, int r) {
  const int64_t id =
      CollectiveId(num_data_ranks > 1 ? fmt::format("dp{}/{}", DataRank(r), name) : name);
  return Attrs{{kCollectiveAttr, id},
               {kRankAttr, int64_t{TensorRank(r)}},
               {kGroupSizeAttr, int64_t{tensor_parallel}},
               {kChannelAttr, int64_t{kTensorChannel}}};
}

Attrs PlanState::SequenceCollective(const std::string& name, int r) {
  const int groups = parallel.data_parallel / parallel.sequence_parallel;
  const int64_t id =
      CollectiveId(groups > 1 ? fmt::format("sp{}/{}", parallel.RowGroupOf(r), name) : name);
  return Attrs{{kCollectiveAttr, id},
               {kRankAttr, int64_t{parallel.SequenceRankOf(r)}},
               {kGroupSizeAttr, int64_t{parallel.sequence_parallel}},
               {kChannelAttr, int64_t{kTensorChannel}}};
}

Result<ObjectId> PlanState::Sum(int r, int s, const std::string& name,
                                const std::vector<ObjectId>& parts) {
  if (parts.empty()) return ObjectId();
  ObjectId sum = parts[0];
  for (size_t i = 1; i < parts.size(); ++i) {
    TESSERA_ASSIGN_OR_RETURN(
        auto added,
        builder.AddTask(fmt::format("{}/sum{}", name, i), "accumulate", {sum, parts[i]}, {},
                        OnStage(r, s, "", kBackwardPriority, {fmt::format("{}:sum{}", name, i)})));
    sum = added[0];
  }
  return sum;
}

}  // namespace tessera

#include "planner/zero_one_adam.h"

#include <algorithm>

namespace tessera {

const char* ZeroOneStepName(OptimizerConfig::ZeroOneStep step) {
  switch (step) {
    case OptimizerConfig::ZeroOneStep::kVariance:
      return "variance";
    case OptimizerConfig::ZeroOneStep::kCompressedGradient:
      return "compressed-gradient";
    case OptimizerConfig::ZeroOneStep::kLocal:
      return "local";
    case OptimizerConfig::ZeroOneStep::kSync:
      return "sync";
  }
  return "?";
}

ZeroOneAdamSchedule::ZeroOneAdamSchedule(const OptimizerConfig& config)
    : var_freeze_step_(config.var_freeze_step),
      var_update_scaler_(std::max(config.var_update_scaler, 1)),
      local_step_scaler_(std::max(config.local_step_scaler, 1)),
      local_step_clipper_(std::max(config.local_step_clipper, 1)) {}

ZeroOneAdamSchedule ZeroOneAdamSchedule::After(const OptimizerConfig& config, int64_t steps) {
  ZeroOneAdamSchedule schedule(config);
  while (schedule.steps_taken() < steps) schedule.Advance();
  return schedule;
}

OptimizerConfig::ZeroOneStep ZeroOneAdamSchedule::Next() const {
  const int64_t step = steps_ + 1;
  if (step <= var_freeze_step_) {
    return step % variance_interval_ == 0 ? OptimizerConfig::ZeroOneStep::kVariance
                                          : OptimizerConfig::ZeroOneStep::kCompressedGradient;
  }
  return step % local_interval_ == 0 ? OptimizerConfig::ZeroOneStep::kSync
                                     : OptimizerConfig::ZeroOneStep::kLocal;
}

void ZeroOneAdamSchedule::Advance() {
  const OptimizerConfig::ZeroOneStep kind = Next();
  ++steps_;
  synchronized_ = kind != OptimizerConfig::ZeroOneStep::kLocal;
  if (steps_ <= var_freeze_step_) {
    if (kind == OptimizerConfig::ZeroOneStep::kVariance &&
        ++variance_updates_ == var_update_scaler_) {
      variance_updates_ = 0;
      variance_interval_ *= 2;
    }
    return;
  }
  if (++frozen_steps_ == local_step_scaler_) {
    frozen_steps_ = 0;
    local_interval_ = std::min(local_step_clipper_, local_interval_ * 2);
  }
}

}  // namespace tessera

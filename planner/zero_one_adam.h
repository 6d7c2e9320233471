// 0/1 Adam's schedule (Lu et al. 2022, "Maximizing Communication Efficiency for Large-scale
// Training via 0/1 Adam"; DeepSpeed's ZeroOneAdam): which kind of step each step of a run is.
//
// Steps are numbered from 1. Up to OptimizerConfig::var_freeze_step a step is a variance step
// (kVariance: gradients all-reduced in full precision, momentum and variance updated) when its
// number is a multiple of the variance interval, else a compressed-gradient step
// (kCompressedGradient: gradients averaged by the error-feedback compressed all-reduce, the
// variance kept). The interval starts at 1 and doubles after every var_update_scaler variance
// steps, so the variance freezes gradually (the paper's T_v). Past var_freeze_step every step is
// local (kLocal: no communication; each rank updates its own parameters) or, when its number is
// a multiple of the local-step interval, a synchronisation (kSync: the ranks' moves since the
// interval's start averaged by the compressed all-reduce, the parameters set to the start plus
// the average, the momentum recovered from it: the paper's T_u). That
// interval starts at 1 and doubles every local_step_scaler frozen steps, up to
// local_step_clipper.
//
// The schedule is a pure function of the configuration and the step number: a resumed run
// replays it (After) instead of saving its counters.
#pragma once

#include <cstdint>

#include "planner/training_plan.h"

namespace tessera {

const char* ZeroOneStepName(OptimizerConfig::ZeroOneStep step);  // "variance", ...

class ZeroOneAdamSchedule {
 public:
  explicit ZeroOneAdamSchedule(const OptimizerConfig& config);
  // The schedule after `steps` steps (their counters replayed).
  static ZeroOneAdamSchedule After(const OptimizerConfig& config, int64_t steps);

  // The kind of step number steps_taken() + 1.
  OptimizerConfig::ZeroOneStep Next() const;
  // Past that step.
  void Advance();

  int64_t steps_taken() const { return steps_; }
  // Every rank holds the same parameters: no local step since the last synchronisation.
  bool synchronized() const { return synchronized_; }
  int64_t variance_interval() const { return variance_interval_; }
  int64_t local_step_interval() const { return local_interval_; }

 private:
  int64_t var_freeze_step_, var_update_scaler_, local_step_scaler_, local_step_clipper_;
  int64_t steps_ = 0;
  int64_t variance_interval_ = 1, variance_updates_ = 0;
  int64_t local_interval_ = 1, frozen_steps_ = 0;
  bool synchronized_ = true;
};

}  // namespace tessera

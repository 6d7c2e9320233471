// Batches made ahead: while step N runs, a background thread makes the batch of step N + 1 (reads
// and crops volumes, normalises, flips), so a step waits on data only when making a batch takes
// longer than a step. The time steps did wait is kept and printed with the run's summary.
//
// The batch of a step depends only on the step number (as TrainingLoop::Hooks::batch requires),
// so a batch made ahead is the batch the step would have made: asked for another step (a
// recovery rewound the loop), the prefetcher makes that one now and drops the one made ahead.
//
// Thread safety: Get is called from one thread (the training loop's); `make` runs on a background
// thread, one call at a time, and must not touch state the loop thread uses.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <optional>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace tessera::examples {

class Prefetcher {
 public:
  using Make = std::function<Result<std::vector<Tensor>>(int64_t step)>;

  // Batches are made ahead up to `last_step` (the run's last).
  Prefetcher(Make make, int64_t last_step) : make_(std::move(make)), last_step_(last_step) {}
  ~Prefetcher();  // waits for the batch being made
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The batch of `step`, then starts making the one of `step + 1` (up to the last step).
  Result<std::vector<Tensor>> Get(int64_t step);

  // Seconds Get spent waiting for batches (made ahead or made on the spot), and batches served.
  double waited_seconds() const { return waited_seconds_; }
  int64_t served() const { return served_; }
  int64_t made_ahead() const { return made_ahead_; }  // of those served
  // "data: 199 of 200 batches made ahead of their steps; steps waited 0.12 s for data in all".
  std::string Summary() const;

 private:
  Make make_;
  const int64_t last_step_;
  std::optional<int64_t> ahead_step_;
  std::future<Result<std::vector<Tensor>>> ahead_;
  double waited_seconds_ = 0;
  int64_t served_ = 0;
  int64_t made_ahead_ = 0;
};

}  // namespace tessera::examples

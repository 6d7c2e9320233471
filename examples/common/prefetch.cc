#include "examples/common/prefetch.h"

#include <chrono>

#include <fmt/format.h>

namespace tessera::examples {

Prefetcher::~Prefetcher() {
  if (ahead_.valid()) ahead_.wait();
}

Result<std::vector<Tensor>> Prefetcher::Get(int64_t step) {
  const auto started = std::chrono::steady_clock::now();
  Result<std::vector<Tensor>> batch = Internal("no batch");
  if (ahead_step_ == step && ahead_.valid()) {
    batch = ahead_.get();
    ++made_ahead_;
  } else {
    if (ahead_.valid()) ahead_.wait();  // made for another step: dropped
    batch = make_(step);
  }
  ahead_step_.reset();
  waited_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  ++served_;
  if (batch.ok() && step < last_step_) {
    ahead_step_ = step + 1;
    ahead_ = std::async(std::launch::async, [this, next = step + 1] { return make_(next); });
  }
  return batch;
}

std::string Prefetcher::Summary() const {
  return fmt::format(
      "data: {} of {} batches made ahead of their steps; steps waited {:.2f} s "
      "for data in all",
      made_ahead_, served_, waited_seconds_);
}

}  // namespace tessera::examples

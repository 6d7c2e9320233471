// A GPT-2 batch for the benchmarks that train one: tokens and targets drawn from the vocabulary by
// fixed strides (no data files), the same for every run.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "model/gpt2.h"

namespace tessera::bench {

inline Result<std::vector<Tensor>> SyntheticGpt2Batch(const Gpt2Config& config, int64_t batch,
                                                      int64_t seq_len) {
  const auto tokens = static_cast<size_t>(batch * seq_len);
  std::vector<int32_t> ids(tokens), targets(tokens);
  for (size_t i = 0; i < tokens; ++i) {
    ids[i] = static_cast<int32_t>((i * 7919) % static_cast<size_t>(config.vocab));
    targets[i] = static_cast<int32_t>((i * 104729 + 1) % static_cast<size_t>(config.vocab));
  }
  return Gpt2Batch(config, ids, targets, batch, seq_len);
}

}  // namespace tessera::bench

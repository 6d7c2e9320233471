// What CPU and GPU kernels read from an op's attributes the same way, so the two devices
// cannot drift apart: AdamW's hyper-parameters and where its group sits. Internal to ops/
// (ops/cpu, ops/cuda).
#pragma once

#include <cstdint>
#include <vector>

#include "core/attrs.h"
#include "core/tensor.h"
#include "ops/flat_layout.h"

namespace tessera {

struct AdamWAttrs {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  // With param_offset the gradient is a shard of the (larger) parameter group, updated in place
  // at that offset; element_offset is the shard's first element's index in the group (for the
  // decay ranges).
  int64_t param_offset = 0;
  int64_t element_offset = 0;
  // [begin, end) pairs of weight-decayed elements of the group; all of it when the attribute
  // is absent.
  std::vector<int64_t> decay_ranges;
};

// The attributes of an "adamw" task whose gradient has n elements.
inline AdamWAttrs ReadAdamWAttrs(const Attrs& attrs, int64_t n) {
  AdamWAttrs a;
  a.beta1 = static_cast<float>(attrs.GetFloat("beta1", 0.9));
  a.beta2 = static_cast<float>(attrs.GetFloat("beta2", 0.999));
  a.eps = static_cast<float>(attrs.GetFloat("eps", 1e-8));
  a.weight_decay = static_cast<float>(attrs.GetFloat("weight_decay", 0.0));
  a.param_offset = attrs.GetInt("param_offset", 0);
  a.element_offset = attrs.GetInt("element_offset", a.param_offset);
  if (attrs.Has("decay_ranges")) {
    a.decay_ranges = *attrs.GetInts("decay_ranges");
  } else {
    a.decay_ranges = {0, n + a.element_offset};
  }
  return a;
}

// A transformer block op's attribute "rebuild" (absent: kNothing).
// REQUIRES: shape inference validated it.
inline BlockRebuild ReadBlockRebuild(const Attrs& attrs) {
  if (!attrs.Has("rebuild")) return BlockRebuild::kNothing;
  Result<std::string> name = attrs.GetString("rebuild");
  if (!name.ok()) return BlockRebuild::kNothing;
  Result<BlockRebuild> rebuild = ParseBlockRebuild(*name);
  return rebuild.ok() ? *rebuild : BlockRebuild::kNothing;
}

// The dimensions of a transformer layer op from its attributes and its activation x [B, T, C].
// REQUIRES: shape inference validated them (the kernel runs on inferred shapes).
inline TransformerDims ReadTransformerDims(const Attrs& attrs, const TensorMeta& x) {
  return TransformerDims{.batch = x.shape[0],
                         .seq_len = x.shape[1],
                         .channels = attrs.GetInt("channels", 0),
                         .heads = attrs.GetInt("heads", 1),
                         .vocab = attrs.GetInt("vocab", 0),
                         .max_seq_len = attrs.GetInt("max_seq_len", 0),
                         .rebuild = ReadBlockRebuild(attrs)};
}

}  // namespace tessera

// Helpers for writing op definitions (OpDef, ops/op_registry.h): gradient rules, byte counts and
// dtype checks, for the files that register Tessera's ops (standard_ops*.cc, volume_ops.cc) and
// for plugins' (ops/plugin.h; installed with the SDK).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "ops/op_registry.h"

namespace tessera::op_def {

// Gradient rules (OpDef::gradient): Rule(backward op, what it reads, the inputs it returns
// gradients of). The backward op reads OutGrad(i), the gradient of forward output i; In(i),
// forward input i; Out(i), forward output i.
inline GradientRule::Arg OutGrad(int i) { return {GradientRule::From::kOutputGradient, i}; }
inline GradientRule::Arg In(int i) { return {GradientRule::From::kInput, i}; }
inline GradientRule::Arg Out(int i) { return {GradientRule::From::kOutput, i}; }
inline GradientRule Rule(std::string op, std::vector<GradientRule::Arg> inputs,
                         std::vector<int> gradient_of) {
  return GradientRule{std::move(op), std::move(inputs), std::move(gradient_of)};
}

// `rule` with its split (GradientRule::input_op, weight_op, split_at).
inline GradientRule Split(GradientRule rule, std::string input_op, std::string weight_op,
                          int split_at) {
  rule.input_op = std::move(input_op);
  rule.weight_op = std::move(weight_op);
  rule.split_at = split_at;
  return rule;
}

// The bytes of all of `metas` (for cost functions).
inline double Bytes(const std::vector<TensorMeta>& metas) {
  double bytes = 0;
  for (const TensorMeta& meta : metas) bytes += static_cast<double>(meta.bytes());
  return bytes;
}

// InvalidArgument "input '<name>' is <meta> but must be <dtype>" unless `meta` has `dtype`.
inline Status CheckDType(const char* name, const TensorMeta& meta, DType dtype) {
  if (meta.dtype != dtype) {
    return InvalidArgument("input '{}' is {} but must be {}", name, meta.ToString(),
                           DTypeName(dtype));
  }
  return Status::Ok();
}

}  // namespace tessera::op_def

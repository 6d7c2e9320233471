// GPT-2 defined with the model API (model/model.h): every layer a program of primitive ops
// (embedding, layernorm, linear, attention, GELU, residual add, softmax cross-entropy) whose
// backward is derived from their gradient rules, instead of DescribeGpt2's hand-fused layer ops.
// The architecture is the fused model's (GPT-2 / nanoGPT / llm.c):
//
//   embedding  x = wte[tokens] + wpe[positions]
//   h.{l}      x = x + proj(attention(qkv(ln1(x))));  x = x + fcproj(gelu(fc(ln2(x))))
//   head       loss = cross_entropy(lnf(x) @ wte^T, targets)   (wte read from "embedding")
//
// Each layer's parameter group has exactly the fused model's layout (ops/flat_layout.h:
// TokenPositionEmbeddingParamLayout, TransformerBlockParamLayout, TiedLmHeadParamLayout: the same
// slots, order, shapes and decay flags), so the groups of a trainer of one can be copied into a
// trainer of the other (Trainer::ReadGroup / WriteGroup) and both compute the same training run.
// Parameters are named "embedding.wte", "h.0.qkv_w", "head.lnf_w". They start as nanoGPT's:
// matrices and embeddings N(0, 0.02), the residual projections (proj_w, fcproj_w) N(0, 0.02 /
// sqrt(2 L)), biases 0, layernorm gains 1 (the same distributions as the fused model, not the same
// draws).
//
// Inputs: "tokens" and "targets", i32 [B, max_seq_len] sequence inputs (the plan's seq_len
// replaces dimension 1); targets is a label input.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/dtype.h"
#include "core/status.h"
#include "model/model_spec.h"
#include "ops/op_registry.h"

namespace tessera {

// GPT-2 / nanoGPT / llm.c: learned position embeddings, pre-norm blocks, GELU (tanh), a final
// layernorm, and a classifier tied to the token embedding.
struct Gpt2Config {
  int64_t layers = 2;
  int64_t channels = 64;
  int64_t heads = 4;
  int64_t vocab = 256;
  int64_t max_seq_len = 64;  // positions in wpe; a batch's seq_len may be shorter
  // The type of activations between and inside layers: f32 on CPUs, bf16 on GPUs (parameters,
  // gradients and optimizer state stay f32 either way).
  DType activations = DType::kF32;

  // InvalidArgument naming the field and a fix (e.g. channels not divisible by heads).
  Status Validate() const;
  // "tiny", "small", "gpt2-124m"; NotFound listing the presets otherwise.
  static Result<Gpt2Config> Preset(std::string_view name);
  // Parameters without padding (the figure papers quote: 124,439,808 for GPT-2 124M).
  int64_t NumParameters() const;
  std::string ToString() const;
  friend bool operator==(const Gpt2Config&, const Gpt2Config&) = default;
};

// GPT-2 as the planners take it with its hand-fused layer ops (ops/standard_ops.h:
// gpt2_embedding/block/head_forward and _backward: the fast path, what train_gpt2 runs), named
// "gpt2". REQUIRES: config.Validate() is OK.
ModelSpec DescribeGpt2(const Gpt2Config& config);

// The model above, named "gpt2_api". `registry` must hold the standard ops and the layer program
// ops (RegisterStandardOps). InvalidArgument when the config is invalid (its Validate message)
// or the model API refuses a layer (naming it).
Result<ModelSpec> BuildGpt2(const Gpt2Config& config, const OpRegistry& registry);

}  // namespace tessera

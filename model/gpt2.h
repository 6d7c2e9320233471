// GPT-2 (GPT-2 / nanoGPT / llm.c): learned position embeddings, pre-LayerNorm blocks with a GELU
// (tanh) MLP, a final layernorm, and a classifier tied to the token embedding:
//
//   embedding  x = wte[tokens] + wpe[positions]
//   h.{l}      x = x + proj(attention(qkv(ln1(x))));  x = x + fcproj(gelu(fc(ln2(x))))
//   head       loss = cross_entropy(lnf(x) @ wte^T, targets)   (wte read from "embedding")
//
// BuildGpt2 is the one description of the model, with a choice of how its layers run:
//   kFused      the transformer layer ops (ops/standard_ops.h: token_position_embedding_*,
//               transformer_block_*, tied_lm_head_*), hand-fused with a hand-written backward:
//               the fast path, and the only one with GPU kernels and bf16 activations;
//   kPrimitive  layer programs of primitive ops (model/model.h: embedding, layernorm, linear,
//               attention, GELU, residual add, softmax cross-entropy) whose backward is derived
//               from their gradient rules: the reference the fused ops are checked against.
// Both have the same layers ("embedding", "h.0" ... "h.{L-1}", "head"), the same parameter groups
// (ops/flat_layout.h: TokenPositionEmbeddingParamLayout, TransformerBlockParamLayout,
// TiedLmHeadParamLayout: slots, order, shapes, decay flags), the same parameter names ("wte",
// "wpe", "h.<l>.<slot>", "lnf_w", "lnf_b", as nanoGPT and tests/reference/make_gpt2_reference.py
// name them), the same initialisation (nanoGPT's: matrices and embeddings N(0, 0.02), the
// residual projections proj_w and fcproj_w N(0, 0.02 / sqrt(2 L)), biases 0, layernorm gains 1;
// so a seed gives both the same values) and the same checkpoint identity (ModelSpec::config: the
// Gpt2Config's five dimensions), so groups and checkpoints move between the two and both train
// the same run (within float rounding).
//
// Inputs: "tokens" and "targets", i32 [B, max_seq_len] sequence inputs (the plan's seq_len
// replaces dimension 1); targets is a label input. Gpt2Batch / Gpt2Prompt build them from token
// ids for Trainer::Step, EvalLoss and Predict (whose result is the logits, f32 [B, T, vocab]).
//
// Stateless functions; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"
#include "model/model_spec.h"

namespace tessera {

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

enum class Gpt2LayerImpl : uint8_t {
  kFused,      // the transformer layer ops: the fast path (default)
  kPrimitive,  // layer programs of primitive ops: the reference, CPU only
};
// "fused" or "primitive".
std::string_view Gpt2LayerImplName(Gpt2LayerImpl impl);
// InvalidArgument naming both choices otherwise.
Result<Gpt2LayerImpl> ParseGpt2LayerImpl(std::string_view name);

// GPT-2 as the planners take it, named "gpt2". InvalidArgument when the config is invalid (its
// Validate message), or for kPrimitive with activations other than f32 (layer programs run on
// CPUs).
Result<ModelSpec> BuildGpt2(const Gpt2Config& config, Gpt2LayerImpl layers = Gpt2LayerImpl::kFused);

// The config BuildGpt2 made `model` from: its ModelSpec::config, and the activation type of its
// layers. InvalidArgument when `model` is not a GPT-2 of BuildGpt2's (naming the missing field).
Result<Gpt2Config> Gpt2ConfigOf(const ModelSpec& model);

// A batch of token windows as the model's inputs: tokens and their targets, each batch x seq_len
// ids in row-major order, as i32 [batch, seq_len] tensors (ModelSpec::inputs order).
// InvalidArgument when a count is not batch x seq_len, or when an id lies outside the vocabulary
// ("token id 300 at index 5 is outside the vocabulary [0, 256); ..."), so a bad batch is refused
// before a step runs.
Result<std::vector<Tensor>> Gpt2Batch(const Gpt2Config& config, std::span<const int32_t> tokens,
                                      std::span<const int32_t> targets, int64_t batch,
                                      int64_t seq_len);
// The tokens alone (the targets an undefined tensor), for Trainer::Predict: any batch, any
// seq_len up to max_seq_len. The errors of Gpt2Batch.
Result<std::vector<Tensor>> Gpt2Prompt(const Gpt2Config& config, std::span<const int32_t> tokens,
                                       int64_t batch, int64_t seq_len);

}  // namespace tessera

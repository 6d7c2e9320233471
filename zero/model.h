// Model descriptions: what the planners take as input.
//
// A model is a list of layers, each with its parameters as one flat group (a FlatLayout naming
// the tensors inside it). Planners turn a ModelSpec plus a parallel configuration into a step
// graph with placements; they never look at parameter values.
//
// GPT-2 here follows GPT-2 / nanoGPT / llm.c: learned position embeddings, pre-norm blocks,
// GELU (tanh), a final layernorm, and a classifier tied to the token embedding.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "ops/flat_layout.h"

namespace tessera {

struct Gpt2Config {
  int64_t layers = 2;
  int64_t channels = 64;
  int64_t heads = 4;
  int64_t vocab = 256;
  int64_t max_seq_len = 64;  // positions in wpe; a batch's seq_len may be shorter

  // InvalidArgument naming the field and a fix (e.g. channels not divisible by heads).
  Status Validate() const;
  // "tiny", "small", "gpt2-124m"; NotFound listing the presets otherwise.
  static Result<Gpt2Config> Preset(std::string_view name);
  // Parameters without padding (the figure papers quote: 124,439,808 for GPT-2 124M).
  int64_t NumParameters() const;
  std::string ToString() const;
};

enum class LayerKind { kEmbedding, kBlock, kHead };

struct LayerSpec {
  std::string name;  // "embedding", "h.0" ... "h.{L-1}", "head"
  LayerKind kind;
  FlatLayout params;
};

struct ModelSpec {
  Gpt2Config config;
  std::vector<LayerSpec> layers;  // in forward order

  int64_t NumParameters() const;
  // NotFound otherwise.
  Result<const LayerSpec*> FindLayer(std::string_view name) const;
};

// REQUIRES: config.Validate() is OK.
ModelSpec DescribeGpt2(const Gpt2Config& config);

}  // namespace tessera

#include "model/gpt2.h"

#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "model/model.h"
#include "ops/standard_ops.h"

namespace tessera {

Status Gpt2Config::Validate() const {
  auto positive = [](const char* flag, int64_t value) -> Status {
    if (value <= 0) return InvalidArgument("{} must be positive, got {}", flag, value);
    return Status::Ok();
  };
  TESSERA_RETURN_IF_ERROR(positive("layers", layers));
  TESSERA_RETURN_IF_ERROR(positive("channels", channels));
  TESSERA_RETURN_IF_ERROR(positive("heads", heads));
  TESSERA_RETURN_IF_ERROR(positive("vocab", vocab));
  TESSERA_RETURN_IF_ERROR(positive("max_seq_len", max_seq_len));
  if (channels % heads != 0) {
    return InvalidArgument("channels ({}) must be divisible by heads ({}); e.g. use --heads {}",
                           channels, heads, channels % 4 == 0 ? 4 : 1);
  }
  if (vocab > (int64_t{1} << 31) - 1) {
    return InvalidArgument("vocab {} does not fit 32-bit token ids", vocab);
  }
  return Status::Ok();
}

Result<Gpt2Config> Gpt2Config::Preset(std::string_view name) {
  if (name == "tiny") return Gpt2Config{2, 64, 4, 256, 64};
  if (name == "small") return Gpt2Config{6, 384, 6, 256, 256};
  if (name == "gpt2-124m") return Gpt2Config{12, 768, 12, 50257, 1024};
  return NotFound("unknown preset '{}' (expected tiny, small or gpt2-124m)", name);
}

int64_t Gpt2Config::NumParameters() const { return DescribeGpt2(*this).NumParameters(); }

std::string Gpt2Config::ToString() const {
  return fmt::format("layers={} channels={} heads={} vocab={} max_seq_len={}", layers, channels,
                     heads, vocab, max_seq_len);
}

namespace {

LayerArg FusedActivation(size_t layer) { return {LayerArg::Kind::kActivation, layer, 0}; }
LayerArg FusedParams(size_t layer) { return {LayerArg::Kind::kParams, layer, 0}; }
LayerArg FusedInput(size_t input) { return {LayerArg::Kind::kModelInput, input, 0}; }
BackwardArg FusedBack(BackwardArg::Kind kind, size_t index) { return {kind, index}; }

}  // namespace

ModelSpec DescribeGpt2(const Gpt2Config& config) {
  using B = BackwardArg::Kind;
  ModelSpec model;
  model.name = "gpt2";
  model.inputs = {ModelInput{.name = "tokens",
                             .dtype = DType::kI32,
                             .shape = Shape{1, config.max_seq_len},
                             .sequence = true},
                  ModelInput{.name = "targets",
                             .dtype = DType::kI32,
                             .shape = Shape{1, config.max_seq_len},
                             .sequence = true,
                             .label = true}};
  Attrs attrs{{"channels", config.channels},
              {"heads", config.heads},
              {"vocab", config.vocab},
              {"max_seq_len", config.max_seq_len}};
  if (config.activations != DType::kF32) {
    attrs.Set(kActivationDTypeAttr, std::string(DTypeName(config.activations)));
  }
  // embedding(tokens) -> x; its backward adds the token rows' gradient to the gradient of wte
  // the tied classifier computed, in place.
  model.layers.push_back(LayerSpec{
      .name = "embedding",
      .params =
          TokenPositionEmbeddingParamLayout(config.vocab, config.max_seq_len, config.channels),
      .forward_op = "token_position_embedding_forward",
      .backward_op = "token_position_embedding_backward",
      .attrs = attrs,
      .forward_args = {FusedInput(0), FusedParams(0)},
      .backward_args = {FusedBack(B::kOutputGradient, 0), FusedBack(B::kForwardArg, 0),
                        FusedBack(B::kGradientSoFar, 1)},
      .backward_outputs = {1}});
  for (int64_t l = 0; l < config.layers; ++l) {
    const size_t index = model.layers.size();
    model.layers.push_back(
        LayerSpec{.name = fmt::format("h.{}", l),
                  .params = TransformerBlockParamLayout(config.channels),
                  .forward_op = "transformer_block_forward",
                  .backward_op = "transformer_block_backward",
                  .attrs = attrs,
                  .forward_args = {FusedActivation(index - 1), FusedParams(index)},
                  .backward_args = {FusedBack(B::kOutputGradient, 0), FusedBack(B::kForwardArg, 0),
                                    FusedBack(B::kForwardOutput, 1), FusedBack(B::kForwardArg, 1)},
                  .backward_outputs = {0, 1},
                  .backward_input_op = "transformer_block_backward_input",
                  .backward_weight_op = "transformer_block_backward_weight"});
  }
  const size_t head = model.layers.size();
  model.layers.push_back(LayerSpec{
      .name = "head",
      .params = TiedLmHeadParamLayout(config.channels),
      .forward_op = "tied_lm_head_forward",
      .backward_op = "tied_lm_head_backward",
      .attrs = attrs,
      .forward_args = {FusedActivation(head - 1), FusedParams(head), FusedParams(0), FusedInput(1)},
      .backward_args = {FusedBack(B::kForwardArg, 0), FusedBack(B::kForwardOutput, 1),
                        FusedBack(B::kForwardArg, 1), FusedBack(B::kForwardArg, 2)},
      .backward_outputs = {0, 1, 2},
      .loss = true,
      .predict_op = "tied_lm_head_logits"});
  return model;
}

namespace {

// The fused model's slots, in its order, with nanoGPT's initialisation.
LayerValue Slot(LayerBuilder& l, const FlatSlot& slot, double residual_std) {
  ParamInit init = ParamInit::Zeros();
  if (slot.shape.rank() == 2) {
    const bool residual = slot.name == "proj_w" || slot.name == "fcproj_w";
    init = ParamInit::Normal(residual ? residual_std : 0.02);
  } else if (slot.name.ends_with("_w")) {
    init = ParamInit::Ones();  // layernorm gains
  }
  return l.Param(slot.name, slot.shape, init, slot.weight_decay);
}

// The layer's parameters, declared from `layout` (so its group is the fused layer's), by name.
struct Params {
  std::vector<std::string> names;
  std::vector<LayerValue> values;
  LayerValue operator[](std::string_view name) const {
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] == name) return values[i];
    }
    return LayerValue{};  // the builder reports the use of an invalid value
  }
};

Params Declare(LayerBuilder& l, const FlatLayout& layout, double residual_std) {
  Params params;
  for (const FlatSlot& slot : layout.slots()) {
    params.names.push_back(slot.name);
    params.values.push_back(Slot(l, slot, residual_std));
  }
  return params;
}

}  // namespace

Result<ModelSpec> BuildGpt2(const Gpt2Config& config, const OpRegistry& registry) {
  TESSERA_RETURN_IF_ERROR(config.Validate());
  const int64_t c = config.channels;
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config.layers));
  ModelBuilder model("gpt2_api", registry);
  ModelValue tokens = model.SequenceInput("tokens", DType::kI32, Shape{1, config.max_seq_len});
  ModelValue targets = model.SequenceInput("targets", DType::kI32, Shape{1, config.max_seq_len},
                                           /*label=*/true);

  ModelValue x = model.Layer("embedding", {tokens}, [&](LayerBuilder& l) {
    const Params p = Declare(
        l, TokenPositionEmbeddingParamLayout(config.vocab, config.max_seq_len, c), residual_std);
    // vocab and max_seq_len size the backward's gradients of wte and wpe.
    return l.Call("embedding_forward", {l.input(0), p["wte"], p["wpe"]},
                  Attrs{{"vocab", config.vocab}, {"max_seq_len", config.max_seq_len}}, "embed");
  });
  for (int64_t b = 0; b < config.layers; ++b) {
    x = model.Layer(fmt::format("h.{}", b), {x}, [&](LayerBuilder& l) {
      const Params p = Declare(l, TransformerBlockParamLayout(c), residual_std);
      const LayerValue in = l.input(0);
      const LayerValue ln1 = l.Call("layernorm_forward", {in, p["ln1_w"], p["ln1_b"]}, {}, "ln1");
      const LayerValue qkv = l.Call("linear_forward", {ln1, p["qkv_w"], p["qkv_b"]}, {}, "qkv");
      const LayerValue att =
          l.Call("attention_forward", {qkv}, Attrs{{"heads", config.heads}}, "attention");
      const LayerValue proj = l.Call("linear_forward", {att, p["proj_w"], p["proj_b"]}, {}, "proj");
      const LayerValue mid = l.Call("add_forward", {in, proj}, {}, "residual1");
      const LayerValue ln2 = l.Call("layernorm_forward", {mid, p["ln2_w"], p["ln2_b"]}, {}, "ln2");
      const LayerValue fc = l.Call("linear_forward", {ln2, p["fc_w"], p["fc_b"]}, {}, "fc");
      const LayerValue gelu = l.Call("gelu_forward", {fc}, {}, "gelu");
      const LayerValue fcproj =
          l.Call("linear_forward", {gelu, p["fcproj_w"], p["fcproj_b"]}, {}, "fcproj");
      return l.Call("add_forward", {mid, fcproj}, {}, "residual2");
    });
  }
  model.Loss("head", {x, targets}, [&](LayerBuilder& l) {
    const Params p = Declare(l, TiedLmHeadParamLayout(c), residual_std);
    const LayerValue wte = l.SharedParam("embedding", "wte");
    // Rows of tokens: [B, T, C] -> [B*T, C] before the classifier (cheaper than reshaping the
    // [B, T, V] logits, and the same values).
    const LayerValue rows =
        l.Call("reshape", {l.input(0)}, Attrs{{"shape", std::vector<int64_t>{-1, c}}}, "rows");
    const LayerValue lnf = l.Call("layernorm_forward", {rows, p["lnf_w"], p["lnf_b"]}, {}, "lnf");
    const LayerValue logits = l.Call("linear_no_bias_forward", {lnf, wte}, {}, "classifier");
    const LayerValue flat_targets =
        l.Call("reshape", {l.input(1)}, Attrs{{"shape", std::vector<int64_t>{-1}}}, "flat_targets");
    return l.Call("softmax_cross_entropy", {logits, flat_targets}, {}, "cross_entropy");
  });
  return model.Build();
}

}  // namespace tessera

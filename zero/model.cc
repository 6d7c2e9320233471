#include "zero/model.h"

#include <fmt/format.h>

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

int64_t ModelSpec::NumParameters() const {
  int64_t total = 0;
  for (const LayerSpec& layer : layers) total += layer.params.numel();
  return total;
}

Result<const LayerSpec*> ModelSpec::FindLayer(std::string_view layer_name) const {
  for (const LayerSpec& layer : layers) {
    if (layer.name == layer_name) return &layer;
  }
  return NotFound("model has no layer named '{}'", layer_name);
}

Result<size_t> ModelSpec::LossLayer() const {
  if (layers.empty() || !layers.back().loss) {
    return InvalidArgument("model '{}' has no loss layer: its last layer must compute the loss",
                           name);
  }
  return layers.size() - 1;
}

Status ModelSpec::Validate() const {
  TESSERA_RETURN_IF_ERROR(LossLayer().status());
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerSpec& layer = layers[l];
    if (layer.loss && l + 1 != layers.size()) {
      return InvalidArgument("layer '{}' computes the loss but is not the last layer", layer.name);
    }
    if (layer.forward_args.empty()) {
      return InvalidArgument("layer '{}' reads nothing", layer.name);
    }
    for (size_t a = 0; a < layer.forward_args.size(); ++a) {
      const LayerArg& arg = layer.forward_args[a];
      switch (arg.kind) {
        case LayerArg::Kind::kModelInput:
          if (arg.index >= inputs.size()) {
            return InvalidArgument("layer '{}' argument {} reads model input {}, but there are {}",
                                   layer.name, a, arg.index, inputs.size());
          }
          break;
        case LayerArg::Kind::kActivation:
          if (arg.index >= l) {
            return InvalidArgument(
                "layer '{}' argument {} reads layer {} ('{}'), which is not before it: layers "
                "must be in forward order and form no cycle",
                layer.name, a, arg.index, arg.index < layers.size() ? layers[arg.index].name : "?");
          }
          if (arg.output < 0 || arg.output >= layers[arg.index].activations) {
            return InvalidArgument("layer '{}' argument {} reads output {} of '{}', which has {}",
                                   layer.name, a, arg.output, layers[arg.index].name,
                                   layers[arg.index].activations);
          }
          break;
        case LayerArg::Kind::kParams:
          if (arg.index > l) {
            return InvalidArgument("layer '{}' reads the parameters of a later layer ('{}')",
                                   layer.name,
                                   arg.index < layers.size() ? layers[arg.index].name : "?");
          }
          break;
      }
    }
    for (const BackwardArg& arg : layer.backward_args) {
      const bool output = arg.kind == BackwardArg::Kind::kOutputGradient;
      if (output && (layer.loss || arg.index >= static_cast<size_t>(layer.activations))) {
        return InvalidArgument("layer '{}' backward reads the gradient of output {}", layer.name,
                               arg.index);
      }
      if (!output && arg.kind != BackwardArg::Kind::kForwardOutput &&
          arg.index >= layer.forward_args.size()) {
        return InvalidArgument("layer '{}' backward reads forward argument {}, but there are {}",
                               layer.name, arg.index, layer.forward_args.size());
      }
      if (arg.kind == BackwardArg::Kind::kGradientSoFar &&
          layer.forward_args[arg.index].kind != LayerArg::Kind::kParams) {
        return InvalidArgument(
            "layer '{}' backward adds to the gradient of an argument that is "
            "not a parameter group",
            layer.name);
      }
    }
    for (size_t target : layer.backward_outputs) {
      if (target >= layer.forward_args.size() ||
          layer.forward_args[target].kind == LayerArg::Kind::kModelInput) {
        return InvalidArgument(
            "layer '{}' backward returns a gradient of forward argument {}, which is not an "
            "activation or parameters",
            layer.name, target);
      }
    }
  }
  return Status::Ok();
}

namespace {

LayerArg Activation(size_t layer) { return {LayerArg::Kind::kActivation, layer, 0}; }
LayerArg Params(size_t layer) { return {LayerArg::Kind::kParams, layer, 0}; }
LayerArg Input(size_t input) { return {LayerArg::Kind::kModelInput, input, 0}; }
BackwardArg Back(BackwardArg::Kind kind, size_t index) { return {kind, index}; }

}  // namespace

ModelSpec DescribeGpt2(const Gpt2Config& config) {
  using B = BackwardArg::Kind;
  ModelSpec model;
  model.name = "gpt2";
  model.config = config;
  model.inputs = {ModelInput{.name = "tokens",
                             .dtype = DType::kI32,
                             .shape = Shape{1, config.max_seq_len},
                             .sequence = true},
                  ModelInput{.name = "targets",
                             .dtype = DType::kI32,
                             .shape = Shape{1, config.max_seq_len},
                             .sequence = true,
                             .label = true}};
  const Attrs attrs{{"channels", config.channels},
                    {"heads", config.heads},
                    {"vocab", config.vocab},
                    {"max_seq_len", config.max_seq_len}};
  // embedding(tokens) -> x; its backward adds the token rows' gradient to the gradient of wte
  // the tied classifier computed, in place.
  model.layers.push_back(LayerSpec{
      .name = "embedding",
      .params = Gpt2EmbeddingParamLayout(config.vocab, config.max_seq_len, config.channels),
      .forward_op = "gpt2_embedding_forward",
      .backward_op = "gpt2_embedding_backward",
      .attrs = attrs,
      .forward_args = {Input(0), Params(0)},
      .backward_args = {Back(B::kOutputGradient, 0), Back(B::kForwardArg, 0),
                        Back(B::kGradientSoFar, 1)},
      .backward_outputs = {1}});
  for (int64_t l = 0; l < config.layers; ++l) {
    const size_t index = model.layers.size();
    model.layers.push_back(
        LayerSpec{.name = fmt::format("h.{}", l),
                  .params = Gpt2BlockParamLayout(config.channels),
                  .forward_op = "gpt2_block_forward",
                  .backward_op = "gpt2_block_backward",
                  .attrs = attrs,
                  .forward_args = {Activation(index - 1), Params(index)},
                  .backward_args = {Back(B::kOutputGradient, 0), Back(B::kForwardArg, 0),
                                    Back(B::kForwardOutput, 1), Back(B::kForwardArg, 1)},
                  .backward_outputs = {0, 1}});
  }
  const size_t head = model.layers.size();
  model.layers.push_back(
      LayerSpec{.name = "head",
                .params = Gpt2HeadParamLayout(config.channels),
                .forward_op = "gpt2_head_forward",
                .backward_op = "gpt2_head_backward",
                .attrs = attrs,
                .forward_args = {Activation(head - 1), Params(head), Params(0), Input(1)},
                .backward_args = {Back(B::kForwardArg, 0), Back(B::kForwardOutput, 1),
                                  Back(B::kForwardArg, 1), Back(B::kForwardArg, 2)},
                .backward_outputs = {0, 1, 2},
                .loss = true,
                .predict_op = "gpt2_head_logits"});
  return model;
}

}  // namespace tessera

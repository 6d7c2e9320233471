#include "zero/model.h"

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

Result<const LayerSpec*> ModelSpec::FindLayer(std::string_view name) const {
  for (const LayerSpec& layer : layers) {
    if (layer.name == name) return &layer;
  }
  return NotFound("model has no layer named '{}'", name);
}

ModelSpec DescribeGpt2(const Gpt2Config& config) {
  ModelSpec model;
  model.config = config;
  model.layers.push_back(
      LayerSpec{"embedding", LayerKind::kEmbedding,
                Gpt2EmbeddingParamLayout(config.vocab, config.max_seq_len, config.channels)});
  for (int64_t l = 0; l < config.layers; ++l) {
    model.layers.push_back(LayerSpec{fmt::format("h.{}", l), LayerKind::kBlock,
                                     Gpt2BlockParamLayout(config.channels)});
  }
  model.layers.push_back(LayerSpec{"head", LayerKind::kHead, Gpt2HeadParamLayout(config.channels)});
  return model;
}

}  // namespace tessera

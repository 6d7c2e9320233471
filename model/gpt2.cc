#include "model/gpt2.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "model/model.h"
#include "ops/flat_layout.h"
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

int64_t Gpt2Config::NumParameters() const {
  return TokenPositionEmbeddingParamLayout(vocab, max_seq_len, channels).numel() +
         layers * TransformerBlockParamLayout(channels).numel() +
         TiedLmHeadParamLayout(channels).numel();
}

std::string Gpt2Config::ToString() const {
  return fmt::format("layers={} channels={} heads={} vocab={} max_seq_len={}", layers, channels,
                     heads, vocab, max_seq_len);
}

std::string_view Gpt2LayerImplName(Gpt2LayerImpl impl) {
  return impl == Gpt2LayerImpl::kFused ? "fused" : "primitive";
}

Result<Gpt2LayerImpl> ParseGpt2LayerImpl(std::string_view name) {
  if (name == "fused") return Gpt2LayerImpl::kFused;
  if (name == "primitive") return Gpt2LayerImpl::kPrimitive;
  return InvalidArgument(
      "GPT-2 layer implementation '{}' is not one of: fused (the hand-fused layer ops), "
      "primitive (layer programs of primitive ops)",
      name);
}

namespace {

// nanoGPT's initialisation of a slot of GPT-2's layouts: matrices and embeddings N(0, 0.02), the
// residual projections N(0, 0.02 / sqrt(2 L)), layernorm gains 1, biases 0.
ParamInit SlotInit(const FlatSlot& slot, double residual_std) {
  if (slot.shape.rank() == 2) {
    const bool residual = slot.name == "proj_w" || slot.name == "fcproj_w";
    return ParamInit::Normal(residual ? residual_std : 0.02);
  }
  return slot.name.ends_with("_w") ? ParamInit::Ones() : ParamInit::Zeros();
}

std::vector<ParamInit> LayoutInit(const FlatLayout& layout, double residual_std) {
  std::vector<ParamInit> init;
  for (const FlatSlot& slot : layout.slots()) init.push_back(SlotInit(slot, residual_std));
  return init;
}

double ResidualStd(const Gpt2Config& config) {
  return 0.02 / std::sqrt(2.0 * static_cast<double>(config.layers));
}

// What both implementations share: the name, inputs, checkpoint identity and parameter names.
void DescribeCommon(const Gpt2Config& config, ModelSpec& model) {
  model.name = "gpt2";
  model.config = Attrs{{"layers", config.layers},
                       {"channels", config.channels},
                       {"heads", config.heads},
                       {"vocab", config.vocab},
                       {"max_seq_len", config.max_seq_len}};
  // nanoGPT's names: "wte", "lnf_w", but "h.0.qkv_w".
  model.layers.front().param_prefix = "";
  model.layers.back().param_prefix = "";
}

LayerArg FusedActivation(size_t layer) { return {LayerArg::Kind::kActivation, layer, 0}; }
LayerArg FusedParams(size_t layer) { return {LayerArg::Kind::kParams, layer, 0}; }
LayerArg FusedInput(size_t input) { return {LayerArg::Kind::kModelInput, input, 0}; }
BackwardArg FusedBack(BackwardArg::Kind kind, size_t index) { return {kind, index}; }

ModelSpec DescribeFused(const Gpt2Config& config) {
  using B = BackwardArg::Kind;
  const double residual_std = ResidualStd(config);
  ModelSpec model;
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
  FlatLayout embedding =
      TokenPositionEmbeddingParamLayout(config.vocab, config.max_seq_len, config.channels);
  std::vector<ParamInit> embedding_init = LayoutInit(embedding, residual_std);
  model.layers.push_back(
      LayerSpec{.name = "embedding",
                .params = std::move(embedding),
                .forward_op = "token_position_embedding_forward",
                .backward_op = "token_position_embedding_backward",
                .attrs = attrs,
                .forward_args = {FusedInput(0), FusedParams(0)},
                .backward_args = {FusedBack(B::kOutputGradient, 0), FusedBack(B::kForwardArg, 0),
                                  FusedBack(B::kGradientSoFar, 1)},
                .backward_outputs = {1},
                .init = std::move(embedding_init)});
  for (int64_t l = 0; l < config.layers; ++l) {
    const size_t index = model.layers.size();
    FlatLayout block = TransformerBlockParamLayout(config.channels);
    std::vector<ParamInit> block_init = LayoutInit(block, residual_std);
    model.layers.push_back(
        LayerSpec{.name = fmt::format("h.{}", l),
                  .params = std::move(block),
                  .forward_op = "transformer_block_forward",
                  .backward_op = "transformer_block_backward",
                  .attrs = attrs,
                  .forward_args = {FusedActivation(index - 1), FusedParams(index)},
                  .backward_args = {FusedBack(B::kOutputGradient, 0), FusedBack(B::kForwardArg, 0),
                                    FusedBack(B::kForwardOutput, 1), FusedBack(B::kForwardArg, 1)},
                  .backward_outputs = {0, 1},
                  .backward_input_op = "transformer_block_backward_input",
                  .backward_weight_op = "transformer_block_backward_weight",
                  .init = std::move(block_init)});
  }
  const size_t head = model.layers.size();
  FlatLayout head_params = TiedLmHeadParamLayout(config.channels);
  std::vector<ParamInit> head_init = LayoutInit(head_params, residual_std);
  model.layers.push_back(LayerSpec{
      .name = "head",
      .params = std::move(head_params),
      .forward_op = "tied_lm_head_forward",
      .backward_op = "tied_lm_head_backward",
      .attrs = attrs,
      .forward_args = {FusedActivation(head - 1), FusedParams(head), FusedParams(0), FusedInput(1)},
      .backward_args = {FusedBack(B::kForwardArg, 0), FusedBack(B::kForwardOutput, 1),
                        FusedBack(B::kForwardArg, 1), FusedBack(B::kForwardArg, 2)},
      .backward_outputs = {0, 1, 2},
      .loss = true,
      .predict_op = "tied_lm_head_logits",
      .init = std::move(head_init)});
  return model;
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
    params.values.push_back(
        l.Param(slot.name, slot.shape, SlotInit(slot, residual_std), slot.weight_decay));
  }
  return params;
}

// A block: x + proj(attention(qkv(ln1(x)))), then + fcproj(gelu(fc(ln2(.)))).
LayerValue Block(LayerBuilder& l, const Params& p, int64_t heads) {
  const LayerValue in = l.input(0);
  const LayerValue ln1 = l.Call("layernorm_forward", {in, p["ln1_w"], p["ln1_b"]}, {}, "ln1");
  const LayerValue qkv = l.Call("linear_forward", {ln1, p["qkv_w"], p["qkv_b"]}, {}, "qkv");
  const LayerValue att = l.Call("attention_forward", {qkv}, Attrs{{"heads", heads}}, "attention");
  const LayerValue proj = l.Call("linear_forward", {att, p["proj_w"], p["proj_b"]}, {}, "proj");
  const LayerValue mid = l.Call("add_forward", {in, proj}, {}, "residual1");
  const LayerValue ln2 = l.Call("layernorm_forward", {mid, p["ln2_w"], p["ln2_b"]}, {}, "ln2");
  const LayerValue fc = l.Call("linear_forward", {ln2, p["fc_w"], p["fc_b"]}, {}, "fc");
  const LayerValue gelu = l.Call("gelu_forward", {fc}, {}, "gelu");
  const LayerValue fcproj =
      l.Call("linear_forward", {gelu, p["fcproj_w"], p["fcproj_b"]}, {}, "fcproj");
  return l.Call("add_forward", {mid, fcproj}, {}, "residual2");
}

// The tied head on x [B, T, C] and targets [B, T] (inputs 0 and 1): the final layernorm, the
// classifier reading the embedding's wte, and the mean cross-entropy. Rows of tokens: [B, T, C]
// -> [B*T, C] before the classifier (cheaper than reshaping the [B, T, V] logits, and the same
// values).
LayerValue TiedHeadLoss(LayerBuilder& l, LayerValue lnf_w, LayerValue lnf_b, int64_t channels) {
  const LayerValue wte = l.SharedParam("embedding", "wte");
  const LayerValue rows =
      l.Call("reshape", {l.input(0)}, Attrs{{"shape", std::vector<int64_t>{-1, channels}}}, "rows");
  const LayerValue lnf = l.Call("layernorm_forward", {rows, lnf_w, lnf_b}, {}, "lnf");
  const LayerValue logits = l.Call("linear_no_bias_forward", {lnf, wte}, {}, "classifier");
  const LayerValue flat_targets =
      l.Call("reshape", {l.input(1)}, Attrs{{"shape", std::vector<int64_t>{-1}}}, "flat_targets");
  return l.Call("softmax_cross_entropy", {logits, flat_targets}, {}, "cross_entropy");
}

// The primitive layers (and so every split of GPT-2) run on CPUs with f32 activations.
// `what` names the layers refused, `fix` what to do instead.
Status CheckPrimitiveActivations(const Gpt2Config& config, const char* what, const char* fix) {
  if (config.activations == DType::kF32) return Status::Ok();
  return InvalidArgument("GPT-2's {} run on CPUs with f32 activations, not {}: {}", what,
                         DTypeName(config.activations), fix);
}

constexpr const char* kPlanWithoutSplits = "plan without tensor or sequence parallelism on a GPU";

Result<ModelSpec> BuildPrimitive(const Gpt2Config& config) {
  TESSERA_RETURN_IF_ERROR(CheckPrimitiveActivations(
      config, "primitive layers", "use the fused layers on a GPU (--layer-impl fused)"));
  // The model API infers shapes with the ops' definitions (no kernels needed).
  OpRegistry registry;
  TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry));
  const int64_t c = config.channels;
  const double residual_std = ResidualStd(config);
  ModelBuilder model("gpt2", registry);
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
      return Block(l, Declare(l, TransformerBlockParamLayout(c), residual_std), config.heads);
    });
  }
  model.Loss("head", {x, targets}, [&](LayerBuilder& l) {
    const Params p = Declare(l, TiedLmHeadParamLayout(c), residual_std);
    return TiedHeadLoss(l, p["lnf_w"], p["lnf_b"], c);
  });
  return model.Build();
}

// What a rewrite of GPT-2 (tensor or sequence parallel) declares its parameters by: each slot of
// GPT-2's layouts under the whole model's name `prefix + slot`, initialised as nanoGPT does, split
// as `split` (replicated by default), so that the rewrite's parameters map onto the whole model's.
class WholeModelSlots {
 public:
  explicit WholeModelSlots(const Gpt2Config& config)
      : embedding(
            TokenPositionEmbeddingParamLayout(config.vocab, config.max_seq_len, config.channels)),
        block(TransformerBlockParamLayout(config.channels)),
        head(TiedLmHeadParamLayout(config.channels)),
        residual_std_(ResidualStd(config)) {}

  LayerValue operator()(LayerBuilder& l, const FlatLayout& layout, const std::string& prefix,
                        const char* slot, SlotSplit split = {}) const {
    const FlatSlot& whole = **layout.Find(slot);
    return l.SlicedParam(prefix + slot, whole.shape, split, SlotInit(whole, residual_std_),
                         whole.weight_decay);
  }

  const FlatLayout embedding, block, head;

 private:
  double residual_std_;
};

std::string BlockPrefix(int64_t b) { return fmt::format("h.{}.", b); }

// A tensor- or sequence-parallel rewrite of GPT-2 built: the whole model's description, and
// its parameters keeping the whole model's names (every layer's prefix empty).
Result<ModelSpec> BuildRewrite(const ModelBuilder& model, const Gpt2Config& config) {
  TESSERA_ASSIGN_OR_RETURN(ModelSpec rewrite, model.Build());
  DescribeCommon(config, rewrite);
  for (LayerSpec& layer : rewrite.layers) layer.param_prefix = "";
  return rewrite;
}

// GPT-2 split over `ranks` ranks (Megatron-LM's tensor slicing): what each rank runs. Each block
// is four layers, so that every all-reduce sits between layers and every replicated parameter
// gets its whole gradient on every rank:
//   h.<b>.attn  QKV column-parallel (this rank's heads' rows of Q, K and V), attention over its
//               heads, the projection row-parallel without its bias: a partial sum; the gradient
//               of its input (ln1's output) is one too
//   h.<b>.mid   x + the attention's sum + proj_b, then ln2 (replicated)
//   h.<b>.mlp   fc column-parallel, GELU, fcproj row-parallel without its bias: a partial sum
//   h.<b>.out   the residual + the MLP's sum + fcproj_b, then the next block's ln1 (replicated)
//               (after the last block: the final norm, when the classifier is split)
// When T divides the vocabulary (Megatron-LM's vocabulary parallelism; no rank holds the whole
// vocabulary's logits):
//   embedding   this rank's V/T rows of wte looked up, zeros for other ranks' tokens: a partial
//               sum
//   positions   the sum + wpe, then h.0's ln1 (replicated)
//   head        the tied classifier over this rank's rows of wte: logits [R, V/T], reduced to
//               statistics [R, T + 1] (vocab_shard_logit_stats): a partial sum; its input's
//               gradient is one too
//   loss        the cross-entropy from the summed statistics (replicated)
// Otherwise the embedding (with h.0's ln1) and the head (final norm, tied classifier and
// cross-entropy) are replicated.
// Parameters keep the whole model's names (every layer's prefix is empty).
//
// With `shard_sequence` (Megatron-LM's sequence parallelism; T must divide the vocabulary), the
// replicated layers (positions, h.<b>.mid, h.<b>.out) run on this rank's 1/T of the positions:
// the embedding's, attention's and MLP's partial sums are reduce-scattered along the sequence
// instead of all-reduced, the norms' outputs all-gathered for the split layers reading them
// (whose input gradients the gathers' reduce-scatters sum), and the sharded layers' parameter
// gradients all-reduced. The same bytes move as under plain tensor parallelism; the norms' and
// residuals' activations are 1/T as large.
Result<ModelSpec> BuildPrimitiveSplit(const Gpt2Config& config, int ranks, bool shard_sequence) {
  TESSERA_RETURN_IF_ERROR(
      CheckPrimitiveActivations(config, "tensor-parallel layers", kPlanWithoutSplits));
  if (config.heads % ranks != 0) {
    return InvalidArgument(
        "GPT-2's {} attention heads do not split over {} tensor-parallel ranks: use a degree "
        "that divides the heads",
        config.heads, ranks);
  }
  if (shard_sequence && config.vocab % ranks != 0) {
    return InvalidArgument(
        "Megatron sequence parallelism over {} tensor ranks shards the embedding's sum, which "
        "needs the vocabulary-parallel embedding: use a --vocab that {} divides ({} does not)",
        ranks, ranks, config.vocab);
  }
  if (shard_sequence && config.max_seq_len % ranks != 0) {
    return InvalidArgument(
        "Megatron sequence parallelism over {} tensor ranks splits every sequence {} ways: use a "
        "max_seq_len (train_gpt2: --seq-len) that {} divides ({} does not)",
        ranks, ranks, ranks, config.max_seq_len);
  }
  // Under sequence sharding: a partial sum reduce-scattered rather than all-reduced, a norm's
  // output gathered for the split layer reading it, and the layer on its 1/T of the positions.
  const auto sum_of = [shard_sequence](LayerBuilder& l, LayerValue part) {
    if (shard_sequence) {
      l.ScatterSum(part);
    } else {
      l.PartialSum(part);
    }
  };
  const auto for_split_readers = [shard_sequence](LayerBuilder& l, LayerValue norm) {
    if (shard_sequence) l.GatherSequence(norm);
  };
  const auto on_shard = [shard_sequence](LayerBuilder& l) {
    if (shard_sequence) l.ShardSequence();
  };
  OpRegistry registry;
  TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry));
  const int64_t c = config.channels;
  const WholeModelSlots declare(config);
  const FlatLayout &embedding = declare.embedding, &block = declare.block, &head = declare.head;
  const SlotSplit rows{.dim = 0}, qkv_rows{.dim = 0, .blocks = 3}, columns{.dim = 1};
  ModelBuilder model("gpt2", registry);
  model.SplitOver(ranks, shard_sequence);
  ModelValue tokens = model.SequenceInput("tokens", DType::kI32, Shape{1, config.max_seq_len});
  ModelValue targets = model.SequenceInput("targets", DType::kI32, Shape{1, config.max_seq_len},
                                           /*label=*/true);
  // Megatron's vocabulary-parallel embedding and cross-entropy when the degree divides the
  // vocabulary: each rank holds V/T rows of wte, looks up its tokens (a partial sum) and computes
  // its V/T logits, of which only R (T + 1) statistics are summed; otherwise both replicated.
  const bool vocab_parallel = config.vocab % ranks == 0;
  std::string residual;  // the layer whose outputs are x and ln1(x)
  if (vocab_parallel) {
    model.Layer("embedding", {tokens}, [&](LayerBuilder& l) {
      const LayerValue wte = declare(l, embedding, "", "wte", rows);
      const LayerValue part =
          l.Call("vocab_shard_embedding_forward", {l.input(0), wte}, {}, "embed");
      sum_of(l, part);
      return part;
    });
    model.LayerWithOutputs(
        "positions", {ModelBuilder::LayerOutput("embedding")}, [&](LayerBuilder& l) {
          const LayerValue wpe = declare(l, embedding, "", "wpe");
          const LayerValue ln1_w = declare(l, block, BlockPrefix(0), "ln1_w");
          const LayerValue ln1_b = declare(l, block, BlockPrefix(0), "ln1_b");
          on_shard(l);
          const LayerValue x = l.Call("position_add_forward", {l.input(0), wpe}, {}, "positions");
          const LayerValue ln1 = l.Call("layernorm_forward", {x, ln1_w, ln1_b}, {}, "ln1");
          for_split_readers(l, ln1);
          return std::vector<LayerValue>{x, ln1};
        });
    residual = "positions";
  } else {
    model.LayerWithOutputs("embedding", {tokens}, [&](LayerBuilder& l) {
      const LayerValue wte = declare(l, embedding, "", "wte");
      const LayerValue wpe = declare(l, embedding, "", "wpe");
      const LayerValue ln1_w = declare(l, block, BlockPrefix(0), "ln1_w");
      const LayerValue ln1_b = declare(l, block, BlockPrefix(0), "ln1_b");
      const LayerValue x =
          l.Call("embedding_forward", {l.input(0), wte, wpe},
                 Attrs{{"vocab", config.vocab}, {"max_seq_len", config.max_seq_len}}, "embed");
      return std::vector<LayerValue>{x, l.Call("layernorm_forward", {x, ln1_w, ln1_b}, {}, "ln1")};
    });
    residual = "embedding";
  }
  for (int64_t b = 0; b < config.layers; ++b) {
    const std::string h = BlockPrefix(b);
    model.Layer(h + "attn", {ModelBuilder::LayerOutput(residual, 1)}, [&](LayerBuilder& l) {
      const LayerValue qkv_w = declare(l, block, h, "qkv_w", qkv_rows);
      const LayerValue qkv_b = declare(l, block, h, "qkv_b", qkv_rows);
      const LayerValue proj_w = declare(l, block, h, "proj_w", columns);
      l.PartialGradient(0);
      const LayerValue qkv = l.Call("linear_forward", {l.input(0), qkv_w, qkv_b}, {}, "qkv");
      const LayerValue att =
          l.Call("attention_forward", {qkv}, Attrs{{"heads", config.heads / ranks}}, "attention");
      const LayerValue part = l.Call("linear_no_bias_forward", {att, proj_w}, {}, "proj");
      sum_of(l, part);
      return part;
    });
    model.LayerWithOutputs(
        h + "mid", {ModelBuilder::LayerOutput(residual, 0), ModelBuilder::LayerOutput(h + "attn")},
        [&](LayerBuilder& l) {
          const LayerValue proj_b = declare(l, block, h, "proj_b");
          const LayerValue ln2_w = declare(l, block, h, "ln2_w");
          const LayerValue ln2_b = declare(l, block, h, "ln2_b");
          on_shard(l);
          const LayerValue sum = l.Call("add_forward", {l.input(0), l.input(1)}, {}, "residual1");
          const LayerValue mid = l.Call("bias_add_forward", {sum, proj_b}, {}, "proj_bias");
          const LayerValue ln2 = l.Call("layernorm_forward", {mid, ln2_w, ln2_b}, {}, "ln2");
          for_split_readers(l, ln2);
          return std::vector<LayerValue>{mid, ln2};
        });
    model.Layer(h + "mlp", {ModelBuilder::LayerOutput(h + "mid", 1)}, [&](LayerBuilder& l) {
      const LayerValue fc_w = declare(l, block, h, "fc_w", rows);
      const LayerValue fc_b = declare(l, block, h, "fc_b", rows);
      const LayerValue fcproj_w = declare(l, block, h, "fcproj_w", columns);
      l.PartialGradient(0);
      const LayerValue fc = l.Call("linear_forward", {l.input(0), fc_w, fc_b}, {}, "fc");
      const LayerValue gelu = l.Call("gelu_forward", {fc}, {}, "gelu");
      const LayerValue part = l.Call("linear_no_bias_forward", {gelu, fcproj_w}, {}, "fcproj");
      sum_of(l, part);
      return part;
    });
    const bool last = b + 1 == config.layers;
    model.LayerWithOutputs(
        h + "out", {ModelBuilder::LayerOutput(h + "mid", 0), ModelBuilder::LayerOutput(h + "mlp")},
        [&](LayerBuilder& l) {
          const LayerValue fcproj_b = declare(l, block, h, "fcproj_b");
          // The next block's ln1; after the last block, the final norm when the classifier is
          // split (its input gradient is then a partial sum, which a norm's parameters must not
          // see).
          LayerValue norm_w, norm_b;
          if (!last) {
            norm_w = declare(l, block, BlockPrefix(b + 1), "ln1_w");
            norm_b = declare(l, block, BlockPrefix(b + 1), "ln1_b");
          } else if (vocab_parallel) {
            norm_w = declare(l, head, "", "lnf_w");
            norm_b = declare(l, head, "", "lnf_b");
          }
          on_shard(l);
          const LayerValue sum = l.Call("add_forward", {l.input(0), l.input(1)}, {}, "residual2");
          const LayerValue x = l.Call("bias_add_forward", {sum, fcproj_b}, {}, "fcproj_bias");
          if (last && !vocab_parallel) return std::vector<LayerValue>{x};
          const LayerValue norm =
              l.Call("layernorm_forward", {x, norm_w, norm_b}, {}, last ? "lnf" : "ln1");
          for_split_readers(l, norm);
          if (last) return std::vector<LayerValue>{norm};
          return std::vector<LayerValue>{x, norm};
        });
    residual = h + "out";
  }
  if (vocab_parallel) {
    model.Layer("head", {ModelBuilder::LayerOutput(residual, 0), targets}, [&](LayerBuilder& l) {
      const LayerValue wte = l.SharedParam("embedding", "wte");
      l.PartialGradient(0);
      const LayerValue flat =
          l.Call("reshape", {l.input(0)}, Attrs{{"shape", std::vector<int64_t>{-1, c}}}, "rows");
      const LayerValue logits = l.Call("linear_no_bias_forward", {flat, wte}, {}, "classifier");
      const LayerValue flat_targets = l.Call(
          "reshape", {l.input(1)}, Attrs{{"shape", std::vector<int64_t>{-1}}}, "flat_targets");
      const LayerValue stats = l.Call("vocab_shard_logit_stats", {logits, flat_targets},
                                      Attrs{{"ranks", int64_t{ranks}}}, "logit_stats");
      l.PartialSum(stats);
      return stats;
    });
    model.Loss("loss", {ModelBuilder::LayerOutput("head")}, [&](LayerBuilder& l) {
      return l.Call("cross_entropy_from_stats", {l.input(0)}, {}, "cross_entropy");
    });
  } else {
    model.Loss("head", {ModelBuilder::LayerOutput(residual, 0), targets}, [&](LayerBuilder& l) {
      const LayerValue lnf_w = declare(l, head, "", "lnf_w");  // in slot order
      const LayerValue lnf_b = declare(l, head, "", "lnf_b");
      return TiedHeadLoss(l, lnf_w, lnf_b, c);
    });
  }
  return BuildRewrite(model, config);
}

// GPT-2 for P sequence ranks: what each rank runs on its S/P positions of the same rows, every
// parameter whole, attention over the whole sequence by `attention`.
//
// DeepSpeed-Ulysses (kUlysses): each block is three layers, an all-to-all after each of the first
// two:
//   h.<b>.qkv        ln1, then QKV of the rank's positions, laid out by head group
//                    (heads_to_chunks): exchanged into the sequence order, so rank j receives
//                    QKV [B, S, 3 Hp d] of head group j
//   h.<b>.attention  causal attention over the whole sequence for the rank's Hp = ceil(H/P)
//                    heads (padded heads, where P does not divide H, are zero): exchanged back
//                    from the sequence order, each rank receiving its positions of every group
//   h.<b>.post       proj over the received heads in place (heads_linear: no regrouped copy
//                    kept), the residual, ln2, the MLP and the residual
// so that a block keeps what the whole model's block keeps, a quarter as much per rank at P 4:
// the block's input (read by qkv and post), ln1's output, QKV (the attention's input, as the
// all-to-all leaves it), the attention's output (post's input) and the MLP's values.
//
// Ring attention (kRing): every head stays on every rank; the rank's keys and values go round
// the ring, one rotation (kRingNext: to rank r + 1, from r - 1) per step, so that after k steps
// rank r holds the block rank (r - k) mod P made. Each block is 2P + 1 layers:
//   h.<b>.qkv        ln1, QKV of the rank's positions parted into Q [B, S/P, C] and the rank's
//                    own K/V block [B, S/P, 2C]
//   h.<b>.ring0      Q over its own block (the diagonal, causal): out and the log-sum-exp lse
//   h.<b>.kv<k>      k = 1 .. P-1: the block of step k - 1 handed on, rotated to the next rank
//                    (LayerBuilder::HandOnRotation): a layer of its own, so that a rotation
//                    waits only for the previous one, not for the attention over the block
//   h.<b>.ring<k>    k = 1 .. P-1: Q over the block of step k merged into out and lse by the
//                    log-sum-exp (attention_block_accumulate_forward at ring_step k: wholly
//                    visible when the block came from an earlier rank, wholly masked from a
//                    later one); the last outputs only out
//   h.<b>.post       proj over out, the residual, ln2, the MLP and the residual
// The attention ops' backwards compute the block's scores again rather than keep them, and the
// planner re-derives each step's block for its backward by rotating the rank's own block the
// other way (planner/layer_expansion.cc: the forward's rotated copies are freed as soon as they
// are read), so a rank keeps per block its queries, its own block, the chain of merged outputs
// (one per step: S h per row in all, the part that does not shrink with P) and what the whole
// model's block keeps beyond attention, on its S/P positions. The gradients of the keys and
// values go back round the ring the other way (kRingPrevious), each rank summing those of the
// blocks it attended.
//
// Either way the embedding looks up the rank's tokens and adds the positions of its shard
// (position_add reads the plan's sequence_rank); the head is the whole model's, on the rank's
// positions. Parameters keep the whole model's names.
Result<ModelSpec> BuildPrimitiveSequenceSplit(const Gpt2Config& config, int ranks,
                                              SequenceAttention attention) {
  TESSERA_RETURN_IF_ERROR(
      CheckPrimitiveActivations(config, "sequence-parallel layers", kPlanWithoutSplits));
  OpRegistry registry;
  TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry));
  const int64_t c = config.channels;
  const int64_t heads_per_rank = (config.heads + ranks - 1) / ranks;
  const bool ring = attention == SequenceAttention::kRing;
  const WholeModelSlots declare(config);
  const FlatLayout &embedding = declare.embedding, &block = declare.block, &head = declare.head;
  const Attrs chunks{{"heads", config.heads}, {"ranks", int64_t{ranks}}};
  const auto ring_step = [&](int64_t step) {
    return Attrs{{"heads", config.heads}, {kRingStepAttr, step}, {"ranks", int64_t{ranks}}};
  };
  ModelBuilder model("gpt2", registry);
  model.SplitSequenceOver(ranks, attention);
  ModelValue tokens = model.SequenceInput("tokens", DType::kI32, Shape{1, config.max_seq_len});
  ModelValue targets = model.SequenceInput("targets", DType::kI32, Shape{1, config.max_seq_len},
                                           /*label=*/true);
  model.Layer("embedding", {tokens}, [&](LayerBuilder& l) {
    const LayerValue wte = declare(l, embedding, "", "wte");
    const LayerValue wpe = declare(l, embedding, "", "wpe");
    const LayerValue tok = l.Call("vocab_shard_embedding_forward", {l.input(0), wte}, {}, "embed");
    return l.Call("position_add_forward", {tok, wpe}, {}, "positions");
  });
  std::string residual = "embedding";  // the layer whose output is the block's input
  for (int64_t b = 0; b < config.layers; ++b) {
    const std::string h = BlockPrefix(b);
    // ln1 and QKV of the rank's positions.
    const auto qkv_of = [&](LayerBuilder& l) {
      const LayerValue ln1_w = declare(l, block, h, "ln1_w");
      const LayerValue ln1_b = declare(l, block, h, "ln1_b");
      const LayerValue qkv_w = declare(l, block, h, "qkv_w");
      const LayerValue qkv_b = declare(l, block, h, "qkv_b");
      const LayerValue ln1 = l.Call("layernorm_forward", {l.input(0), ln1_w, ln1_b}, {}, "ln1");
      return l.Call("linear_forward", {ln1, qkv_w, qkv_b}, {}, "qkv");
    };
    std::string attended = h + "attention";  // the layer whose output 0 is attention's
    if (ring) {
      model.LayerWithOutputs(
          h + "qkv", {ModelBuilder::LayerOutput(residual)}, [&](LayerBuilder& l) {
            return l.CallAll("split_last_forward", {qkv_of(l)}, Attrs{{"first", c}}, "q_kv");
          });
      const ModelValue q = ModelBuilder::LayerOutput(h + "qkv", 0);
      ModelValue kv = ModelBuilder::LayerOutput(h + "qkv", 1);
      model.LayerWithOutputs(h + "ring0", {q, kv}, [&](LayerBuilder& l) {
        return l.CallAll("attention_block_forward", {l.input(0), l.input(1)}, ring_step(0),
                         "diagonal");
      });
      ModelValue out = ModelBuilder::LayerOutput(h + "ring0", 0);
      ModelValue lse = ModelBuilder::LayerOutput(h + "ring0", 1);
      for (int64_t step = 1; step < ranks; ++step) {
        const std::string hand_on = fmt::format("{}kv{}", h, step);
        model.Layer(hand_on, {kv}, [](LayerBuilder& l) { return l.HandOnRotation(); });
        kv = ModelBuilder::LayerOutput(hand_on);
        const bool last = step + 1 == ranks;
        attended = fmt::format("{}ring{}", h, step);
        model.LayerWithOutputs(attended, {q, kv, out, lse}, [&](LayerBuilder& l) {
          std::vector<LayerValue> merged =
              l.CallAll("attention_block_accumulate_forward",
                        {l.input(0), l.input(1), l.input(2), l.input(3)}, ring_step(step), "block");
          if (last) merged.pop_back();  // the log-sum-exp is read by no later step
          return merged;
        });
        out = ModelBuilder::LayerOutput(attended, 0);
        lse = ModelBuilder::LayerOutput(attended, 1);
      }
    } else {
      model.Layer(h + "qkv", {ModelBuilder::LayerOutput(residual)}, [&](LayerBuilder& l) {
        Attrs by_head = chunks;
        by_head.Set("groups", int64_t{3});
        const LayerValue out = l.Call("heads_to_chunks", {qkv_of(l)}, by_head, "by_head");
        l.Exchange(out, ExchangeLayout::kToSequence);
        return out;
      });
      model.Layer(attended, {ModelBuilder::LayerOutput(h + "qkv")}, [&](LayerBuilder& l) {
        const LayerValue att = l.Call("attention_forward", {l.input(0)},
                                      Attrs{{"heads", heads_per_rank}}, "attention");
        l.Exchange(att, ExchangeLayout::kFromSequence);
        return att;
      });
    }
    model.Layer(
        h + "post", {ModelBuilder::LayerOutput(residual), ModelBuilder::LayerOutput(attended)},
        [&](LayerBuilder& l) {
          const LayerValue proj_w = declare(l, block, h, "proj_w");
          const LayerValue proj_b = declare(l, block, h, "proj_b");
          const LayerValue ln2_w = declare(l, block, h, "ln2_w");
          const LayerValue ln2_b = declare(l, block, h, "ln2_b");
          const LayerValue fc_w = declare(l, block, h, "fc_w");
          const LayerValue fc_b = declare(l, block, h, "fc_b");
          const LayerValue fcproj_w = declare(l, block, h, "fcproj_w");
          const LayerValue fcproj_b = declare(l, block, h, "fcproj_b");
          const LayerValue proj =
              ring ? l.Call("linear_forward", {l.input(1), proj_w, proj_b}, {}, "proj")
                   : l.Call("heads_linear_forward", {l.input(1), proj_w, proj_b}, chunks, "proj");
          const LayerValue mid = l.Call("add_forward", {l.input(0), proj}, {}, "residual1");
          const LayerValue ln2 = l.Call("layernorm_forward", {mid, ln2_w, ln2_b}, {}, "ln2");
          const LayerValue fc = l.Call("linear_forward", {ln2, fc_w, fc_b}, {}, "fc");
          const LayerValue gelu = l.Call("gelu_forward", {fc}, {}, "gelu");
          const LayerValue fcproj =
              l.Call("linear_forward", {gelu, fcproj_w, fcproj_b}, {}, "fcproj");
          return l.Call("add_forward", {mid, fcproj}, {}, "residual2");
        });
    residual = h + "post";
  }
  model.Loss("head", {ModelBuilder::LayerOutput(residual, 0), targets}, [&](LayerBuilder& l) {
    const LayerValue lnf_w = declare(l, head, "", "lnf_w");  // in slot order
    const LayerValue lnf_b = declare(l, head, "", "lnf_b");
    return TiedHeadLoss(l, lnf_w, lnf_b, c);
  });
  return BuildRewrite(model, config);
}

// `ids` as an i32 [batch, seq_len] tensor, every id checked against the vocabulary.
Result<Tensor> IdTensor(const Gpt2Config& config, std::span<const int32_t> ids, const char* what,
                        int64_t batch, int64_t seq_len) {
  if (static_cast<int64_t>(ids.size()) != batch * seq_len) {
    return InvalidArgument("batch has {} {}s but [{}, {}] needs {}", ids.size(), what, batch,
                           seq_len, batch * seq_len);
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= config.vocab) {
      return InvalidArgument(
          "{} id {} at index {} is outside the vocabulary [0, {}); use a larger --vocab or "
          "other data",
          what, ids[i], i, config.vocab);
    }
  }
  return Tensor::FromVector(Shape{batch, seq_len}, std::vector<int32_t>(ids.begin(), ids.end()));
}

}  // namespace

Result<ModelSpec> BuildGpt2(const Gpt2Config& config, Gpt2LayerImpl layers) {
  TESSERA_RETURN_IF_ERROR(config.Validate());
  ModelSpec model;
  if (layers == Gpt2LayerImpl::kFused) {
    model = DescribeFused(config);
  } else {
    TESSERA_ASSIGN_OR_RETURN(model, BuildPrimitive(config));
  }
  // Either way a rank of a split runs the primitive layers' rewrite: its parameters keep the
  // whole model's names and shapes, which the fused and primitive layers share, so a trainer
  // maps the fused model's parameters onto the split's slices by name (Trainer::MapSlices).
  model.split_for_tensor_parallel = [config](int ranks) {
    return BuildPrimitiveSplit(config, ranks, /*shard_sequence=*/false);
  };
  model.split_sharding_sequence = [config](int ranks) {
    return BuildPrimitiveSplit(config, ranks, /*shard_sequence=*/true);
  };
  model.split_for_sequence_parallel = [config](int ranks) {
    return BuildPrimitiveSequenceSplit(config, ranks, SequenceAttention::kUlysses);
  };
  model.split_for_ring_attention = [config](int ranks) {
    return BuildPrimitiveSequenceSplit(config, ranks, SequenceAttention::kRing);
  };
  DescribeCommon(config, model);
  return model;
}

Result<Gpt2Config> Gpt2ConfigOf(const ModelSpec& model) {
  if (model.name != "gpt2" || model.layers.empty()) {
    return InvalidArgument("model '{}' is not a GPT-2 (model/gpt2.h's BuildGpt2)", model.name);
  }
  Gpt2Config config;
  for (auto [name, field] :
       {std::pair{"layers", &config.layers}, std::pair{"channels", &config.channels},
        std::pair{"heads", &config.heads}, std::pair{"vocab", &config.vocab},
        std::pair{"max_seq_len", &config.max_seq_len}}) {
    TESSERA_ASSIGN_OR_RETURN(*field, model.config.GetInt(name));
  }
  const Attrs& attrs = model.layers.front().attrs;
  if (attrs.Has(kActivationDTypeAttr)) {
    TESSERA_ASSIGN_OR_RETURN(std::string dtype, attrs.GetString(kActivationDTypeAttr));
    TESSERA_ASSIGN_OR_RETURN(config.activations, ParseDType(dtype));
  }
  return config;
}

Result<std::vector<Tensor>> Gpt2Batch(const Gpt2Config& config, std::span<const int32_t> tokens,
                                      std::span<const int32_t> targets, int64_t batch,
                                      int64_t seq_len) {
  TESSERA_ASSIGN_OR_RETURN(Tensor x, IdTensor(config, tokens, "token", batch, seq_len));
  TESSERA_ASSIGN_OR_RETURN(Tensor y, IdTensor(config, targets, "target", batch, seq_len));
  return std::vector<Tensor>{std::move(x), std::move(y)};
}

Result<std::vector<Tensor>> Gpt2Prompt(const Gpt2Config& config, std::span<const int32_t> tokens,
                                       int64_t batch, int64_t seq_len) {
  TESSERA_ASSIGN_OR_RETURN(Tensor x, IdTensor(config, tokens, "token", batch, seq_len));
  return std::vector<Tensor>{std::move(x), Tensor()};
}

}  // namespace tessera

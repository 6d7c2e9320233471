// The standard ops' transformer layers: token and position embedding, the transformer block
// (whole backward, or split into input and weight halves) and the tied LM head, each on one
// flat parameter group with a hand-fused backward (CPU kernels: ops/cpu/transformer_layers.h).
#include <string>
#include <utility>
#include <vector>

#include "ops/flat_layout.h"
#include "ops/kernel_attrs.h"
#include "ops/op_def_util.h"
#include "ops/standard_ops.h"
#include "ops/standard_ops_internal.h"

namespace tessera::detail {

using op_def::Bytes;
using op_def::CheckDType;
using op_def::In;
namespace {

// Attribute activation_dtype: "f32" (absent) or "bf16" (the transformer layers on a GPU).
Result<DType> ActivationDTypeOf(const Attrs& attrs) {
  if (!attrs.Has(kActivationDTypeAttr)) return DType::kF32;
  TESSERA_ASSIGN_OR_RETURN(std::string name, attrs.GetString(kActivationDTypeAttr));
  if (name == "f32") return DType::kF32;
  if (name == "bf16") return DType::kBF16;
  return InvalidArgument("attribute '{}' is '{}'; use f32 or bf16", kActivationDTypeAttr, name);
}

// Reads channels (always), and heads / vocab+max_seq_len when asked; checks x is
// <activations>[B,T,C].
Result<TransformerShape> ReadTransformerShape(const Attrs& attrs, const TensorMeta& x,
                                              bool needs_heads, bool needs_vocab) {
  TransformerShape s{};
  TESSERA_ASSIGN_OR_RETURN(s.activations, ActivationDTypeOf(attrs));
  TESSERA_ASSIGN_OR_RETURN(s.channels, PositiveAttr(attrs, "channels"));
  if (needs_heads) {
    TESSERA_ASSIGN_OR_RETURN(s.heads, PositiveAttr(attrs, "heads"));
    if (s.channels % s.heads != 0) {
      return InvalidArgument("channels {} is not divisible by heads {}", s.channels, s.heads);
    }
  }
  if (needs_heads && attrs.Has(kRebuildAttr)) {
    TESSERA_ASSIGN_OR_RETURN(std::string rebuild, attrs.GetString(kRebuildAttr));
    TESSERA_ASSIGN_OR_RETURN(s.rebuild, ParseBlockRebuild(rebuild));
    if (s.rebuild != BlockRebuild::kNothing && s.activations != DType::kF32) {
      return Infeasible(
          "a block's backward rebuilds what its forward did not save ('{}' = '{}') on f32 "
          "activations (CPU workers) only, not {}: drop the attribute",
          kRebuildAttr, rebuild, DTypeName(s.activations));
    }
  }
  if (needs_vocab) {
    TESSERA_ASSIGN_OR_RETURN(s.vocab, PositiveAttr(attrs, "vocab"));
    TESSERA_ASSIGN_OR_RETURN(s.max_seq_len, PositiveAttr(attrs, "max_seq_len"));
  }
  TESSERA_RETURN_IF_ERROR(CheckDType("x", x, s.activations));
  if (x.shape.rank() != 3 || x.shape[2] != s.channels) {
    return InvalidArgument("input 'x' has shape {} but the layer expects [B, T, {}] (channels={})",
                           x.shape.ToString(), s.channels, s.channels);
  }
  s.batch = x.shape[0];
  s.seq_len = x.shape[1];
  return s;
}

// A parameter group: the layout's elements, padded up to a multiple of attribute
// 'param_multiple' (default 1) so that ZeRO can cut it into equal shards. Kernels ignore the
// padding on input and write zeros there on output.
Status CheckParams(const char* name, const TensorMeta& meta, const FlatLayout& layout,
                   const Attrs& attrs) {
  const int64_t multiple = attrs.GetInt(kParamMultipleAttr, 1);
  if (multiple < 1) {
    return InvalidArgument("attribute '{}' must be >= 1, got {}", kParamMultipleAttr, multiple);
  }
  return CheckShape(name, meta, Shape{PaddedNumel(layout.numel(), multiple)});
}

Status CheckSaved(const char* name, const TensorMeta& meta, const FlatLayout& layout,
                  DType dtype = DType::kF32) {
  return CheckShape(name, meta, Shape{layout.numel()}, dtype);
}

// What a transformer block's / LM head's forward saves, in the activations' type (flat_layout.h).
FlatLayout BlockSaved(const TransformerShape& s) {
  return s.activations == DType::kBF16
             ? TransformerBlockSavedLayoutBf16(s.batch, s.seq_len, s.channels, s.heads)
             : TransformerBlockSavedLayout(s.batch, s.seq_len, s.channels, s.heads, s.rebuild);
}
FlatLayout BlockStash(const TransformerShape& s) {
  return TransformerBlockStashLayout(s.batch, s.seq_len, s.channels);
}
// The split block backward has f32 (CPU) kernels only.
Status CheckSplitActivations(const TransformerShape& s) {
  if (s.rebuild != BlockRebuild::kNothing) {
    return Infeasible(
        "the split block backward (zero-bubble schedules) rebuilds nothing: drop attribute '{}' "
        "('{}'), or use --schedule 1f1b",
        kRebuildAttr, BlockRebuildName(s.rebuild));
  }
  if (s.activations == DType::kF32) return Status::Ok();
  return Infeasible(
      "the split block backward (zero-bubble schedules) runs on f32 activations only, not {}: "
      "use --schedule 1f1b on GPUs",
      DTypeName(s.activations));
}
FlatLayout HeadSaved(const TransformerShape& s) {
  return s.activations == DType::kBF16
             ? TiedLmHeadSavedLayoutBf16(s.batch, s.seq_len, s.channels, s.vocab)
             : TiedLmHeadSavedLayout(s.batch, s.seq_len, s.channels, s.vocab);
}
TensorMeta SavedMeta(const TransformerShape& s, const FlatLayout& layout) {
  return TensorMeta{Shape{layout.numel()}, s.activations, Device::Cpu()};
}

// Forward flops of a transformer block on B*T tokens: the four linears plus causal attention.
double BlockForwardFlops(const TransformerShape& s) {
  const double n = static_cast<double>(s.batch * s.seq_len), c = static_cast<double>(s.channels);
  const double linears = 2.0 * n * 12.0 * c * c;
  const double attention = 2.0 * 2.0 * static_cast<double>(s.batch) *
                           static_cast<double>(s.seq_len) * static_cast<double>(s.seq_len) * c;
  return linears + attention;
}

// The forward work a block's backward repeats to rebuild what its forward did not save: two
// layernorms and a GELU (memory-bound: their bytes), and with attention, attention's forward and
// the output projection.
OpCost BlockRebuildCost(const TransformerShape& s) {
  if (s.rebuild == BlockRebuild::kNothing) return OpCost{};
  const double n = static_cast<double>(s.batch * s.seq_len), c = static_cast<double>(s.channels);
  const double f32 = sizeof(float);
  OpCost cost{.flops = 0, .bytes = f32 * n * (2 * 2 * c + 2 * 4 * c)};
  if (s.rebuild == BlockRebuild::kNormsGeluAttention) {
    cost.flops += 2.0 * 2.0 * static_cast<double>(s.batch) * static_cast<double>(s.seq_len) *
                      static_cast<double>(s.seq_len) * c +
                  2.0 * n * c * c;
    cost.bytes += f32 * n * (3 * c + 3 * c);  // qkv in; atty, x_mid out and x read
  }
  return cost;
}

// The CPU kernel's scratch of a layer op whose activation x [B, T, C] is in[x]: `floats(dims)`
// floats (ops/flat_layout.h); none for shapes inference refuses.
WorkspaceFn LayerScratch(size_t x, int64_t (*floats)(const TransformerDims&)) {
  return [x, floats](const Metas& in, const Attrs& attrs) -> int64_t {
    if (in.size() <= x || in[x].shape.rank() != 3) return 0;
    return 4 * floats(ReadTransformerDims(attrs, in[x]));
  };
}

}  // namespace

Status AddTransformerLayerOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "token_position_embedding_forward",
      .doc = "token + position embedding",
      .input_names = {"tokens", "params"},
      .output_names = {"x"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(int64_t c, PositiveAttr(attrs, "channels"));
        TESSERA_ASSIGN_OR_RETURN(int64_t vocab, PositiveAttr(attrs, "vocab"));
        TESSERA_ASSIGN_OR_RETURN(int64_t max_t, PositiveAttr(attrs, "max_seq_len"));
        TESSERA_RETURN_IF_ERROR(CheckDType("tokens", in[0], DType::kI32));
        if (in[0].shape.rank() != 2 || in[0].shape[1] > max_t) {
          return InvalidArgument("input 'tokens' has shape {} but must be [B, T] with T <= {}",
                                 in[0].shape.ToString(), max_t);
        }
        TESSERA_RETURN_IF_ERROR(CheckParams(
            "params", in[1], TokenPositionEmbeddingParamLayout(vocab, max_t, c), attrs));
        TESSERA_ASSIGN_OR_RETURN(DType activations, ActivationDTypeOf(attrs));
        return Metas{TensorMeta{Shape{in[0].shape[0], in[0].shape[1], c}, activations}};
      },
      .cost = ElementwiseCost(0),
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "token_position_embedding_backward",
      .doc = "adds dx, scattered by token and position, to the tied classifier's gradient",
      .input_names = {"dx", "tokens", "dparams_partial"},
      .output_names = {"dparams"},
      .in_place = {{2, 0}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(TransformerShape s,
                                 ReadTransformerShape(attrs, in[0], false, true));
        TESSERA_RETURN_IF_ERROR(CheckTokens("tokens", in[1], s.batch, s.seq_len));
        TESSERA_RETURN_IF_ERROR(CheckParams(
            "dparams_partial", in[2],
            TokenPositionEmbeddingParamLayout(s.vocab, s.max_seq_len, s.channels), attrs));
        return Metas{in[2]};
      },
      .cost = ElementwiseCost(2),
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "transformer_block_forward",
      .doc = "pre-LayerNorm causal transformer block with a GELU MLP: x + attn(ln1(x)), then + "
             "mlp(ln2(.))",
      .input_names = {"x", "params"},
      .output_names = {"y", "saved"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(TransformerShape s,
                                 ReadTransformerShape(attrs, in[0], true, false));
        TESSERA_RETURN_IF_ERROR(
            CheckParams("params", in[1], TransformerBlockParamLayout(s.channels), attrs));
        return Metas{in[0], SavedMeta(s, BlockSaved(s))};
      },
      .cost =
          [](const Metas& in, const Attrs& attrs) {
            Result<TransformerShape> s = ReadTransformerShape(attrs, in[0], true, false);
            return OpCost{s.ok() ? BlockForwardFlops(*s) : 0.0, 2 * Bytes(in)};
          },
      .workspace = LayerScratch(0, TransformerBlockForwardWorkspace),
      .rebuild_options = {BlockRebuildName(BlockRebuild::kNormsAndGelu),
                          BlockRebuildName(BlockRebuild::kNormsGeluAttention)},
      .rebuild_cost = [](const OpRegistry&, const Metas& in, const Attrs& attrs) -> Result<OpCost> {
        TESSERA_ASSIGN_OR_RETURN(TransformerShape s,
                                 ReadTransformerShape(attrs, in[0], true, false));
        return BlockRebuildCost(s);
      },
  }));
  // The block's backward, whole or split for zero-bubble pipelines (ops/cpu/transformer_layers.h):
  // the input half returns dx and a stash, the weight half the parameter gradients from it.
  // Inputs: dy (the weight half: the stash), x, saved, params.
  enum class Part { kWhole, kInput, kWeight };
  auto block_backward = [](std::string name, std::string doc, Part part) {
    const bool whole = part == Part::kWhole;
    return OpDef{
        .name = std::move(name),
        .doc = std::move(doc),
        .input_names = {part == Part::kWeight ? "stash" : "dy", "x", "saved", "params"},
        .output_names = whole                  ? std::vector<std::string>{"dx", "dparams"}
                        : part == Part::kInput ? std::vector<std::string>{"dx", "stash"}
                                               : std::vector<std::string>{"dparams"},
        .in_place = part == Part::kWeight ? std::vector<std::pair<int, int>>{}
                                          : std::vector<std::pair<int, int>>{{0, 0}},
        .infer = [part, whole](const Metas& in, const Attrs& attrs) -> Result<Metas> {
          TESSERA_ASSIGN_OR_RETURN(TransformerShape s,
                                   ReadTransformerShape(attrs, in[1], true, false));
          if (!whole) TESSERA_RETURN_IF_ERROR(CheckSplitActivations(s));
          if (part == Part::kWeight) {
            TESSERA_RETURN_IF_ERROR(CheckShape("stash", in[0], Shape{BlockStash(s).numel()}));
          } else {
            TESSERA_RETURN_IF_ERROR(CheckSameShape("dy", in[0], "x", in[1]));
          }
          TESSERA_RETURN_IF_ERROR(CheckSaved("saved", in[2], BlockSaved(s), s.activations));
          TESSERA_RETURN_IF_ERROR(
              CheckParams("params", in[3], TransformerBlockParamLayout(s.channels), attrs));
          if (whole) return Metas{in[1], in[3]};
          if (part == Part::kInput) return Metas{in[1], F32({BlockStash(s).numel()})};
          return Metas{in[3]};
        },
        // In forwards' flops (plus what it rebuilds): the whole backward 2.5, of which the dx
        // products and attention's backward 1.5 and the dW products 1.
        .cost =
            [part](const Metas& in, const Attrs& attrs) {
              Result<TransformerShape> s = ReadTransformerShape(attrs, in[1], true, false);
              const double forwards =
                  part == Part::kWhole ? 2.5 : (part == Part::kInput ? 1.5 : 1.0);
              if (!s.ok()) return OpCost{0.0, 2 * Bytes(in)};
              const OpCost rebuild = BlockRebuildCost(*s);
              return OpCost{forwards * BlockForwardFlops(*s) + rebuild.flops,
                            2 * Bytes(in) + rebuild.bytes};
            },
        .workspace = part == Part::kWeight ? WorkspaceFn()
                     : whole               ? LayerScratch(1, TransformerBlockBackwardWorkspace)
                                           : LayerScratch(1, TransformerBlockInputWorkspace),
    };
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(block_backward("transformer_block_backward", "", Part::kWhole)));
  TESSERA_RETURN_IF_ERROR(r.AddOp(block_backward(
      "transformer_block_backward_input",
      "a block's input gradient, and the stash its weight gradients are computed from",
      Part::kInput)));
  TESSERA_RETURN_IF_ERROR(r.AddOp(block_backward(
      "transformer_block_backward_weight",
      "a block's parameter gradients from the stash of transformer_block_backward_input",
      Part::kWeight)));
  auto head_flops = [](const TransformerShape& s, double factor) {
    return factor * 2.0 * static_cast<double>(s.batch * s.seq_len * s.channels * s.vocab);
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "tied_lm_head_forward",
      .doc = "final layernorm, tied classifier and fused softmax cross-entropy; keeps dlogits",
      .input_names = {"x", "params", "embedding_params", "targets"},
      .output_names = {"loss", "saved"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(TransformerShape s,
                                 ReadTransformerShape(attrs, in[0], false, true));
        TESSERA_RETURN_IF_ERROR(
            CheckParams("params", in[1], TiedLmHeadParamLayout(s.channels), attrs));
        TESSERA_RETURN_IF_ERROR(CheckParams(
            "embedding_params", in[2],
            TokenPositionEmbeddingParamLayout(s.vocab, s.max_seq_len, s.channels), attrs));
        TESSERA_RETURN_IF_ERROR(CheckTokens("targets", in[3], s.batch, s.seq_len));
        return Metas{Scalar(), SavedMeta(s, HeadSaved(s))};
      },
      .cost =
          [head_flops](const Metas& in, const Attrs& attrs) {
            Result<TransformerShape> s = ReadTransformerShape(attrs, in[0], false, true);
            return OpCost{s.ok() ? head_flops(*s, 1.0) : 0.0, 2 * Bytes(in)};
          },
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "tied_lm_head_backward",
      .input_names = {"x", "saved", "params", "embedding_params"},
      .output_names = {"dx", "dparams", "dembedding_partial"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(TransformerShape s,
                                 ReadTransformerShape(attrs, in[0], false, true));
        TESSERA_RETURN_IF_ERROR(CheckSaved("saved", in[1], HeadSaved(s), s.activations));
        TESSERA_RETURN_IF_ERROR(
            CheckParams("params", in[2], TiedLmHeadParamLayout(s.channels), attrs));
        TESSERA_RETURN_IF_ERROR(CheckParams(
            "embedding_params", in[3],
            TokenPositionEmbeddingParamLayout(s.vocab, s.max_seq_len, s.channels), attrs));
        return Metas{in[0], in[2], in[3]};
      },
      .cost =
          [head_flops](const Metas& in, const Attrs& attrs) {
            Result<TransformerShape> s = ReadTransformerShape(attrs, in[0], false, true);
            return OpCost{s.ok() ? head_flops(*s, 2.0) : 0.0, 2 * Bytes(in)};
          },
      .workspace = LayerScratch(0, TiedLmHeadWorkspace),
  }));
  return r.AddOp(OpDef{
      .name = "tied_lm_head_logits",
      .doc = "final layernorm and tied classifier: logits for inference",
      .input_names = {"x", "params", "embedding_params"},
      .output_names = {"logits"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(TransformerShape s,
                                 ReadTransformerShape(attrs, in[0], false, true));
        TESSERA_RETURN_IF_ERROR(
            CheckParams("params", in[1], TiedLmHeadParamLayout(s.channels), attrs));
        TESSERA_RETURN_IF_ERROR(CheckParams(
            "embedding_params", in[2],
            TokenPositionEmbeddingParamLayout(s.vocab, s.max_seq_len, s.channels), attrs));
        return Metas{F32({s.batch, s.seq_len, s.vocab})};
      },
      .cost =
          [head_flops](const Metas& in, const Attrs& attrs) {
            Result<TransformerShape> s = ReadTransformerShape(attrs, in[0], false, true);
            return OpCost{s.ok() ? head_flops(*s, 1.0) : 0.0, 2 * Bytes(in)};
          },
      .workspace = LayerScratch(0, TiedLmHeadWorkspace),
  });
}

}  // namespace tessera::detail

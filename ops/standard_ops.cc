#include "ops/standard_ops.h"

#include <vector>

#include "core/collective_task.h"
#include "ops/flat_layout.h"
#include "ops/layer_program.h"
#include "ops/op_def_util.h"
#include "ops/volume_ops.h"

namespace tessera {

namespace {

using Metas = std::vector<TensorMeta>;
using op_def::Bytes;
using op_def::CheckDType;
using op_def::In;
using op_def::Out;
using op_def::OutGrad;
using op_def::Rule;
using op_def::Split;

TensorMeta F32(Shape shape) { return TensorMeta{std::move(shape), DType::kF32, Device::Cpu()}; }
TensorMeta Scalar() { return F32(Shape{}); }

// ---- checks whose messages name the input and both shapes ----

Status CheckShape(const char* name, const TensorMeta& meta, const Shape& expected,
                  DType dtype = DType::kF32) {
  TESSERA_RETURN_IF_ERROR(CheckDType(name, meta, dtype));
  if (meta.shape != expected) {
    return InvalidArgument("input '{}' has shape {} but {} was expected", name,
                           meta.shape.ToString(), expected.ToString());
  }
  return Status::Ok();
}

Status CheckRankAtLeast(const char* name, const TensorMeta& meta, int rank) {
  if (meta.shape.rank() < rank) {
    return InvalidArgument("input '{}' has shape {} but needs rank >= {}", name,
                           meta.shape.ToString(), rank);
  }
  return Status::Ok();
}

Status CheckSameShape(const char* name, const TensorMeta& meta, const char* other_name,
                      const TensorMeta& other) {
  if (meta.shape != other.shape || meta.dtype != other.dtype) {
    return InvalidArgument("input '{}' is {} but input '{}' is {}; they must match", name,
                           meta.ToString(), other_name, other.ToString());
  }
  return Status::Ok();
}

// Shape with the last dimension replaced.
Shape WithLastDim(const Shape& shape, int64_t last) {
  std::vector<int64_t> dims = shape.dims();
  dims.back() = last;
  return Shape(std::move(dims));
}

int64_t RowsOf(const Shape& shape) { return shape.rank() == 0 ? 1 : shape.numel() / shape[-1]; }

Result<int64_t> PositiveAttr(const Attrs& attrs, const char* name) {
  TESSERA_ASSIGN_OR_RETURN(int64_t value, attrs.GetInt(name));
  if (value <= 0) return InvalidArgument("attribute '{}' must be positive, got {}", name, value);
  return value;
}

// Elementwise-style cost: a few flops per element of the first input, every byte touched once.
CostFn ElementwiseCost(double flops_per_element) {
  return [flops_per_element](const Metas& in, const Attrs&) {
    return OpCost{flops_per_element * static_cast<double>(in[0].numel()), 2 * Bytes(in)};
  };
}

// ---- transformer layer dimensions from attributes and the activation x[B,T,C] ----

struct TransformerShape {
  int64_t batch, seq_len, channels, heads, vocab, max_seq_len;
  DType activations;  // attribute activation_dtype: f32 (CPU) or bf16 (GPU)
};

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
             : TransformerBlockSavedLayout(s.batch, s.seq_len, s.channels, s.heads);
}
FlatLayout BlockStash(const TransformerShape& s) {
  return TransformerBlockStashLayout(s.batch, s.seq_len, s.channels);
}
// The split block backward has f32 (CPU) kernels only.
Status CheckSplitActivations(const TransformerShape& s) {
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

Status CheckTokens(const char* name, const TensorMeta& meta, int64_t batch, int64_t seq_len) {
  return CheckShape(name, meta, Shape{batch, seq_len}, DType::kI32);
}

// Forward flops of a transformer block on B*T tokens: the four linears plus causal attention.
double BlockForwardFlops(const TransformerShape& s) {
  const double n = static_cast<double>(s.batch * s.seq_len), c = static_cast<double>(s.channels);
  const double linears = 2.0 * n * 12.0 * c * c;
  const double attention = 2.0 * 2.0 * static_cast<double>(s.batch) *
                           static_cast<double>(s.seq_len) * static_cast<double>(s.seq_len) * c;
  return linears + attention;
}

// ---- primitive ops ----

Status AddEmbeddingOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "embedding_forward",
      .doc = "out[b,t] = wte[tokens[b,t]] + wpe[t]",
      .input_names = {"tokens", "wte", "wpe"},
      .output_names = {"out"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("tokens", in[0], DType::kI32));
        if (in[0].shape.rank() != 2) {
          return InvalidArgument("input 'tokens' has shape {} but must be [B, T]",
                                 in[0].shape.ToString());
        }
        if (in[1].shape.rank() != 2) {
          return InvalidArgument("input 'wte' has shape {} but must be [V, C]",
                                 in[1].shape.ToString());
        }
        const int64_t c = in[1].shape[1];
        if (in[2].shape.rank() != 2 || in[2].shape[1] != c || in[2].shape[0] < in[0].shape[1]) {
          return InvalidArgument("input 'wpe' has shape {} but must be [>= {}, {}]",
                                 in[2].shape.ToString(), in[0].shape[1], c);
        }
        return Metas{F32({in[0].shape[0], in[0].shape[1], c})};
      },
      .cost = ElementwiseCost(0),
      .gradient = Rule("embedding_backward", {OutGrad(0), In(0)}, {1, 2})}));
  return r.AddOp(OpDef{
      .name = "embedding_backward",
      .doc = "dwte, dwpe: dout scattered by token and position",
      .input_names = {"dout", "tokens"},
      .output_names = {"dwte", "dwpe"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(int64_t vocab, PositiveAttr(attrs, "vocab"));
        TESSERA_ASSIGN_OR_RETURN(int64_t max_seq_len, PositiveAttr(attrs, "max_seq_len"));
        TESSERA_RETURN_IF_ERROR(CheckDType("dout", in[0], DType::kF32));
        if (in[0].shape.rank() != 3) {
          return InvalidArgument("input 'dout' has shape {} but must be [B, T, C]",
                                 in[0].shape.ToString());
        }
        TESSERA_RETURN_IF_ERROR(CheckTokens("tokens", in[1], in[0].shape[0], in[0].shape[1]));
        const int64_t c = in[0].shape[2];
        return Metas{F32({vocab, c}), F32({max_seq_len, c})};
      },
      .cost = ElementwiseCost(2),
  });
}

Status AddLayerNormOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "layernorm_forward",
      .doc = "LayerNorm over the last dimension (eps 1e-5); also returns mean and 1/std per row",
      .input_names = {"x", "weight", "bias"},
      .output_names = {"out", "mean", "rstd"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckRankAtLeast("x", in[0], 1));
        TESSERA_RETURN_IF_ERROR(CheckDType("x", in[0], DType::kF32));
        const int64_t c = in[0].shape[-1];
        TESSERA_RETURN_IF_ERROR(CheckShape("weight", in[1], Shape{c}));
        TESSERA_RETURN_IF_ERROR(CheckShape("bias", in[2], Shape{c}));
        const int64_t rows = RowsOf(in[0].shape);
        return Metas{in[0], F32({rows}), F32({rows})};
      },
      .cost = ElementwiseCost(8),
      .gradient =
          Rule("layernorm_backward", {OutGrad(0), In(0), In(1), Out(1), Out(2)}, {0, 1, 2})}));
  return r.AddOp(OpDef{
      .name = "layernorm_backward",
      .input_names = {"dout", "x", "weight", "mean", "rstd"},
      .output_names = {"dx", "dweight", "dbias"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckRankAtLeast("x", in[1], 1));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("dout", in[0], "x", in[1]));
        const int64_t c = in[1].shape[-1];
        const int64_t rows = RowsOf(in[1].shape);
        TESSERA_RETURN_IF_ERROR(CheckShape("weight", in[2], Shape{c}));
        TESSERA_RETURN_IF_ERROR(CheckShape("mean", in[3], Shape{rows}));
        TESSERA_RETURN_IF_ERROR(CheckShape("rstd", in[4], Shape{rows}));
        return Metas{in[1], F32({c}), F32({c})};
      },
      .cost = ElementwiseCost(12),
  });
}

Status AddLinearOps(OpRegistry& r) {
  // x [..., K] and weight [OC, K] (inputs x and w of `in`): OC. The linears' shared check.
  auto linear_out_channels = [](const Metas& in, int x, int w) -> Result<int64_t> {
    TESSERA_RETURN_IF_ERROR(CheckRankAtLeast("x", in[x], 1));
    const int64_t k = in[x].shape[-1];
    if (in[w].shape.rank() != 2 || in[w].shape[1] != k) {
      return InvalidArgument("input 'weight' has shape {} but x {} needs [OC, {}]",
                             in[w].shape.ToString(), in[x].shape.ToString(), k);
    }
    return in[w].shape[0];
  };
  // A product per output element: 2 flops forward, 4 backward (x is input `x`, weight `w`).
  auto linear_cost = [](double flops_per_product, int x, int w) -> CostFn {
    return [=](const Metas& in, const Attrs&) {
      return OpCost{flops_per_product * static_cast<double>(in[x].numel() * in[w].shape[0]),
                    2 * Bytes(in)};
    };
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(
      OpDef{.name = "linear_forward",
            .doc = "out = x @ weight^T + bias, weight [OC, K]",
            .input_names = {"x", "weight", "bias"},
            .output_names = {"out"},
            .infer = [linear_out_channels](const Metas& in, const Attrs&) -> Result<Metas> {
              TESSERA_RETURN_IF_ERROR(CheckRankAtLeast("x", in[0], 1));
              TESSERA_RETURN_IF_ERROR(CheckDType("x", in[0], DType::kF32));
              TESSERA_RETURN_IF_ERROR(CheckDType("weight", in[1], DType::kF32));
              TESSERA_ASSIGN_OR_RETURN(const int64_t oc, linear_out_channels(in, 0, 1));
              TESSERA_RETURN_IF_ERROR(CheckShape("bias", in[2], Shape{oc}));
              return Metas{F32(WithLastDim(in[0].shape, oc))};
            },
            .cost = linear_cost(2.0, 0, 1),
            .gradient = Split(Rule("linear_backward", {OutGrad(0), In(0), In(1)}, {0, 1, 2}),
                              "linear_backward_input", "linear_backward_weight", 1)}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "linear_backward",
      .input_names = {"dout", "x", "weight"},
      .output_names = {"dx", "dweight", "dbias"},
      .infer = [linear_out_channels](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(const int64_t oc, linear_out_channels(in, 1, 2));
        TESSERA_RETURN_IF_ERROR(CheckShape("dout", in[0], WithLastDim(in[1].shape, oc)));
        return Metas{in[1], in[2], F32({oc})};
      },
      .cost = linear_cost(4.0, 1, 2),
  }));
  // The tied classifier: logits = x @ weight^T with no bias (weight is another layer's wte).
  TESSERA_RETURN_IF_ERROR(r.AddOp(
      OpDef{.name = "linear_no_bias_forward",
            .doc = "out = x @ weight^T, weight [OC, K] (a linear without bias: a tied classifier)",
            .input_names = {"x", "weight"},
            .output_names = {"out"},
            .infer = [linear_out_channels](const Metas& in, const Attrs&) -> Result<Metas> {
              TESSERA_RETURN_IF_ERROR(CheckRankAtLeast("x", in[0], 1));
              TESSERA_RETURN_IF_ERROR(CheckDType("x", in[0], DType::kF32));
              TESSERA_RETURN_IF_ERROR(CheckDType("weight", in[1], DType::kF32));
              TESSERA_ASSIGN_OR_RETURN(const int64_t oc, linear_out_channels(in, 0, 1));
              return Metas{F32(WithLastDim(in[0].shape, oc))};
            },
            .cost = linear_cost(2.0, 0, 1),
            .gradient = Split(Rule("linear_no_bias_backward", {OutGrad(0), In(0), In(1)}, {0, 1}),
                              "linear_backward_input", "linear_no_bias_backward_weight", 1)}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "linear_no_bias_backward",
      .input_names = {"dout", "x", "weight"},
      .output_names = {"dx", "dweight"},
      .infer = [linear_out_channels](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(const int64_t oc, linear_out_channels(in, 1, 2));
        TESSERA_RETURN_IF_ERROR(CheckShape("dout", in[0], WithLastDim(in[1].shape, oc)));
        return Metas{in[1], in[2]};
      },
      .cost = linear_cost(4.0, 1, 2),
  }));
  // The linears' backward in halves (GradientRule::input_op / weight_op): dx alone, and dweight
  // (and dbias) alone, from the same inputs as linear_backward.
  auto linear_backward_half = [linear_out_channels, linear_cost](std::string name, std::string doc,
                                                                 std::vector<std::string> outputs,
                                                                 bool input, bool bias) {
    return OpDef{
        .name = std::move(name),
        .doc = std::move(doc),
        .input_names = {"dout", "x", "weight"},
        .output_names = std::move(outputs),
        .infer = [linear_out_channels, input, bias](const Metas& in,
                                                    const Attrs&) -> Result<Metas> {
          TESSERA_ASSIGN_OR_RETURN(const int64_t oc, linear_out_channels(in, 1, 2));
          TESSERA_RETURN_IF_ERROR(CheckShape("dout", in[0], WithLastDim(in[1].shape, oc)));
          if (input) return Metas{in[1]};
          return bias ? Metas{in[2], F32({oc})} : Metas{in[2]};
        },
        .cost = linear_cost(2.0, 1, 2),
    };
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(linear_backward_half(
      "linear_backward_input", "dx = dout @ weight (a linear's input gradient alone)", {"dx"},
      /*input=*/true, false)));
  TESSERA_RETURN_IF_ERROR(r.AddOp(linear_backward_half(
      "linear_backward_weight", "dweight = dout^T x, dbias = sum of dout (a linear's alone)",
      {"dweight", "dbias"}, /*input=*/false, /*bias=*/true)));
  TESSERA_RETURN_IF_ERROR(r.AddOp(linear_backward_half(
      "linear_no_bias_backward_weight", "dweight = dout^T x (a linear's without bias, alone)",
      {"dweight"}, /*input=*/false, /*bias=*/false)));
  auto matmul_dims = [](const Metas& in, int a, int b) -> Status {
    TESSERA_RETURN_IF_ERROR(CheckDType("a", in[a], DType::kF32));
    TESSERA_RETURN_IF_ERROR(CheckDType("b", in[b], DType::kF32));
    if (in[a].shape.rank() != 2 || in[b].shape.rank() != 2 || in[a].shape[1] != in[b].shape[0]) {
      return InvalidArgument("inputs 'a' {} and 'b' {} cannot be multiplied ([M,K] @ [K,N])",
                             in[a].shape.ToString(), in[b].shape.ToString());
    }
    return Status::Ok();
  };
  auto matmul_flops = [](const Metas& in, int a, int b) {
    return 2.0 * static_cast<double>(in[a].shape[0] * in[a].shape[1] * in[b].shape[1]);
  };
  TESSERA_RETURN_IF_ERROR(
      r.AddOp(OpDef{.name = "matmul_forward",
                    .doc = "c = a @ b",
                    .input_names = {"a", "b"},
                    .output_names = {"c"},
                    .infer = [matmul_dims](const Metas& in, const Attrs&) -> Result<Metas> {
                      TESSERA_RETURN_IF_ERROR(matmul_dims(in, 0, 1));
                      return Metas{F32({in[0].shape[0], in[1].shape[1]})};
                    },
                    .cost =
                        [matmul_flops](const Metas& in, const Attrs&) {
                          return OpCost{matmul_flops(in, 0, 1), 2 * Bytes(in)};
                        },
                    .gradient = Rule("matmul_backward", {OutGrad(0), In(0), In(1)}, {0, 1})}));
  return r.AddOp(OpDef{
      .name = "matmul_backward",
      .input_names = {"dc", "a", "b"},
      .output_names = {"da", "db"},
      .infer = [matmul_dims](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(matmul_dims(in, 1, 2));
        TESSERA_RETURN_IF_ERROR(CheckShape("dc", in[0], Shape{in[1].shape[0], in[2].shape[1]}));
        return Metas{in[1], in[2]};
      },
      .cost =
          [matmul_flops](const Metas& in, const Attrs&) {
            return OpCost{2 * matmul_flops(in, 1, 2), 2 * Bytes(in)};
          },
  });
}

Status AddAttentionOps(OpRegistry& r) {
  // qkv [B,T,3C] -> (B, T, C, heads)
  auto read = [](const TensorMeta& qkv, const Attrs& attrs) -> Result<TransformerShape> {
    TESSERA_ASSIGN_OR_RETURN(int64_t heads, PositiveAttr(attrs, "heads"));
    TESSERA_RETURN_IF_ERROR(CheckDType("qkv", qkv, DType::kF32));
    if (qkv.shape.rank() != 3 || qkv.shape[2] % 3 != 0 || (qkv.shape[2] / 3) % heads != 0) {
      return InvalidArgument(
          "input 'qkv' has shape {} but must be [B, T, 3C] with C divisible "
          "by heads={}",
          qkv.shape.ToString(), heads);
    }
    return TransformerShape{qkv.shape[0], qkv.shape[1], qkv.shape[2] / 3, heads, 0, 0};
  };
  auto cost = [read](double factor) -> CostFn {
    return [read, factor](const Metas& in, const Attrs& attrs) {
      Result<TransformerShape> s =
          read(in.back().shape.rank() == 3 ? in[in.size() == 1 ? 0 : 1] : in[0], attrs);
      if (!s.ok()) return OpCost{0, 2 * Bytes(in)};
      return OpCost{
          factor * 4.0 * static_cast<double>(s->batch * s->seq_len * s->seq_len * s->channels),
          2 * Bytes(in)};
    };
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "attention_forward",
      .doc = "causal multi-head self-attention over packed qkv; keeps the softmax log-sum-exp",
      .input_names = {"qkv"},
      .output_names = {"out", "lse"},
      .infer = [read](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(TransformerShape s, read(in[0], attrs));
        return Metas{F32({s.batch, s.seq_len, s.channels}), F32({s.batch, s.heads, s.seq_len})};
      },
      .cost = cost(1.0),
      .gradient = Rule("attention_backward", {OutGrad(0), In(0), Out(1)}, {0})}));
  return r.AddOp(OpDef{
      .name = "attention_backward",
      .input_names = {"dout", "qkv", "lse"},
      .output_names = {"dqkv"},
      .infer = [read](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(TransformerShape s, read(in[1], attrs));
        TESSERA_RETURN_IF_ERROR(CheckShape("dout", in[0], Shape{s.batch, s.seq_len, s.channels}));
        TESSERA_RETURN_IF_ERROR(CheckShape("lse", in[2], Shape{s.batch, s.heads, s.seq_len}));
        return Metas{in[1]};
      },
      .cost = cost(2.5),
  });
}

Status AddElementwiseOps(OpRegistry& r) {
  auto same_as_first = [](const Metas& in, const Attrs&) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckDType("x", in[0], DType::kF32));
    for (size_t i = 1; i < in.size(); ++i) {
      TESSERA_RETURN_IF_ERROR(CheckSameShape("input", in[i], "x", in[0]));
    }
    return Metas{in[0]};
  };
  TESSERA_RETURN_IF_ERROR(
      r.AddOp(OpDef{.name = "gelu_forward",
                    .doc = "GELU, tanh approximation",
                    .input_names = {"x"},
                    .output_names = {"out"},
                    .infer = same_as_first,
                    .cost = ElementwiseCost(10),
                    .gradient = Rule("gelu_backward", {OutGrad(0), In(0)}, {0})}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{.name = "gelu_backward",
                                        .input_names = {"dout", "x"},
                                        .output_names = {"dx"},
                                        .infer = same_as_first,
                                        .cost = ElementwiseCost(16)}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{.name = "add_forward",
                                        .doc = "out = a + b (residual connection)",
                                        .input_names = {"a", "b"},
                                        .output_names = {"out"},
                                        .infer = same_as_first,
                                        .cost = ElementwiseCost(1),
                                        .gradient = Rule("add_backward", {OutGrad(0)}, {0, 1})}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "reshape",
      .doc = "the same elements in attribute 'shape' (one dimension may be -1: inferred)",
      .input_names = {"x"},
      .output_names = {"out"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> dims, attrs.GetInts("shape"));
        int64_t known = 1;
        int inferred = -1;
        for (size_t i = 0; i < dims.size(); ++i) {
          if (dims[i] == -1 && inferred < 0) {
            inferred = static_cast<int>(i);
          } else if (dims[i] <= 0) {
            return InvalidArgument(
                "attribute 'shape' has dimension {}: use positive sizes and at "
                "most one -1",
                dims[i]);
          } else {
            known *= dims[i];
          }
        }
        if (inferred >= 0 && known > 0 && in[0].numel() % known == 0) {
          dims[static_cast<size_t>(inferred)] = in[0].numel() / known;
        }
        TensorMeta out{Shape(dims), in[0].dtype, in[0].device};
        if (out.numel() != in[0].numel() || (inferred >= 0 && in[0].numel() % known != 0)) {
          return InvalidArgument("input 'x' has shape {} ({} elements), which shape {} cannot hold",
                                 in[0].shape.ToString(), in[0].numel(),
                                 Shape(*attrs.GetInts("shape")).ToString());
        }
        return Metas{out};
      },
      .cost = ElementwiseCost(0),
      .gradient = Rule("reshape_backward", {OutGrad(0), In(0)}, {0})}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(
      OpDef{.name = "reshape_backward",
            .doc = "dout in x's shape",
            .input_names = {"dout", "x"},
            .output_names = {"dx"},
            .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
              if (in[0].numel() != in[1].numel()) {
                return InvalidArgument("input 'dout' {} does not have the elements of 'x' {}",
                                       in[0].ToString(), in[1].ToString());
              }
              return Metas{TensorMeta{in[1].shape, in[0].dtype, in[0].device}};
            },
            .cost = ElementwiseCost(0)}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{.name = "accumulate",
                                        .doc = "sum = sum + x, in place (gradient accumulation)",
                                        .input_names = {"sum", "x"},
                                        .output_names = {"sum"},
                                        .in_place = {{0, 0}},
                                        .infer = same_as_first,
                                        .cost = ElementwiseCost(1)}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "copy",
      .doc = "out = x, on the device the task runs on: the transfer between a worker's GPU and "
             "its host tier (ZeRO-Offload's gradient download and parameter upload)",
      .input_names = {"x"},
      .output_names = {"out"},
      .crosses_devices = true,
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> { return Metas{in[0]}; },
      .cost =
          [](const Metas& in, const Attrs&) {
            return OpCost{0, 2.0 * static_cast<double>(in[0].bytes())};
          },
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "write_file",
      .doc = "writes x's bytes to the file at attribute 'path' atomically (temporary file, fsync, "
             "rename; parent directories created); receipt = i64 [bytes, FNV-1a of the bytes]. "
             "How a worker saves its own pieces of a checkpoint",
      .input_names = {"x"},
      .output_names = {"receipt"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(std::string path, attrs.GetString("path"));
        if (path.empty()) return InvalidArgument("attribute 'path' is empty");
        return Metas{TensorMeta{Shape{2}, DType::kI64, in[0].device}};
      },
      .cost =
          [](const Metas& in, const Attrs&) {
            return OpCost{0, static_cast<double>(in[0].bytes())};
          },
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "constant",
      .doc = "an f32 scalar fixed when planning (attribute 'value'), e.g. the clipping factor 1 "
             "when clipping is off, so updates need not wait for the global norm",
      .input_names = {},
      .output_names = {"out"},
      .infer = [](const Metas&, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(double value, attrs.GetFloat("value"));
        (void)value;
        return Metas{Scalar()};
      },
      .cost =
          [](const Metas&, const Attrs&) {
            return OpCost{0, 4};
          },
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "noop",
      .doc = "ignores its inputs (any number) and returns a scalar zero: an empty task, or a "
             "barrier that only orders others (runtime benchmarks and tests)",
      .input_names = {"ignored"},
      .output_names = {"out"},
      .variadic_inputs = true,
      .infer = [](const Metas&, const Attrs&) -> Result<Metas> { return Metas{Scalar()}; },
      .cost =
          [](const Metas&, const Attrs&) {
            return OpCost{0, 4};
          },
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "sum_scalars",
      .doc = "the sum of its f32 scalar inputs (any number), times attribute 'scale' (default 1)",
      .input_names = {"x"},
      .output_names = {"sum"},
      .variadic_inputs = true,
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        for (size_t i = 0; i < in.size(); ++i) {
          if (in[i].dtype != DType::kF32 || in[i].numel() != 1) {
            return InvalidArgument("input {} is {}; sum_scalars adds f32 scalars", i,
                                   in[i].ToString());
          }
        }
        return Metas{Scalar()};
      },
      .cost =
          [](const Metas& in, const Attrs&) {
            return OpCost{static_cast<double>(in.size()), 4.0 * static_cast<double>(in.size() + 1)};
          },
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "sleep",
      .doc = "waits attribute 'ms' milliseconds, then returns its input (failure-handling tests)",
      .input_names = {"x"},
      .output_names = {"out"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(int64_t ms, attrs.GetInt("ms"));
        if (ms < 0) return InvalidArgument("attribute 'ms' must be >= 0, got {}", ms);
        return Metas{in[0]};
      },
      .cost = ElementwiseCost(0),
  }));
  return r.AddOp(OpDef{.name = "add_backward",
                       .doc = "da = db = dout",
                       .input_names = {"dout"},
                       .output_names = {"da", "db"},
                       .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
                         TESSERA_RETURN_IF_ERROR(CheckDType("dout", in[0], DType::kF32));
                         return Metas{in[0], in[0]};
                       },
                       .cost = ElementwiseCost(0)});
}

Status AddLossAndOptimizerOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "softmax_cross_entropy",
      .doc = "mean cross-entropy of softmax(logits) against targets, and its gradient "
             "(times grad_scale) computed in place over the logits",
      .input_names = {"logits", "targets"},
      .output_names = {"loss", "dlogits"},
      .in_place = {{0, 1}},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("logits", in[0], DType::kF32));
        if (in[0].shape.rank() != 2) {
          return InvalidArgument("input 'logits' has shape {} but must be [N, V]",
                                 in[0].shape.ToString());
        }
        TESSERA_RETURN_IF_ERROR(CheckShape("targets", in[1], Shape{in[0].shape[0]}, DType::kI32));
        return Metas{Scalar(), in[0]};
      },
      .cost = ElementwiseCost(8),
      .gradient = Rule("loss_gradient", {OutGrad(0), Out(1)}, {0})}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "loss_gradient",
      .doc = "dlogits * dloss: the gradient a loss op computed in its forward (per unit of loss), "
             "scaled by the loss's own gradient",
      .input_names = {"dloss", "dlogits"},
      .output_names = {"dx"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckShape("dloss", in[0], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckDType("dlogits", in[1], DType::kF32));
        return Metas{in[1]};
      },
      .cost = ElementwiseCost(1),
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "adamw",
      .doc = "AdamW update of a flat parameter group in place (torch.optim.AdamW arithmetic), "
             "gradients scaled by the clipping factor",
      .input_names = {"param", "grad", "exp_avg", "exp_avg_sq", "clip_scale", "lr", "step"},
      .output_names = {"param_out", "exp_avg_out", "exp_avg_sq_out"},
      .in_place = {{0, 0}, {2, 1}, {3, 2}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("param", in[0], DType::kF32));
        if (attrs.Has("param_offset")) {
          // A shard's update inside the full (replicated) parameter group: ZeRO-1/2.
          TESSERA_ASSIGN_OR_RETURN(int64_t offset, attrs.GetInt("param_offset"));
          TESSERA_RETURN_IF_ERROR(CheckDType("grad", in[1], DType::kF32));
          if (in[1].shape.rank() != 1 || offset < 0 || offset + in[1].numel() > in[0].numel()) {
            return InvalidArgument("grad shard {} at param_offset {} does not fit in param {}",
                                   in[1].ToString(), offset, in[0].ToString());
          }
        } else {
          TESSERA_RETURN_IF_ERROR(CheckSameShape("grad", in[1], "param", in[0]));
        }
        TESSERA_RETURN_IF_ERROR(CheckSameShape("exp_avg", in[2], "grad", in[1]));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("exp_avg_sq", in[3], "grad", in[1]));
        TESSERA_RETURN_IF_ERROR(CheckShape("clip_scale", in[4], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckShape("lr", in[5], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckShape("step", in[6], Shape{}, DType::kI64));
        if (attrs.Has("decay_ranges")) {
          TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> ranges, attrs.GetInts("decay_ranges"));
          if (ranges.size() % 2 != 0) {
            return InvalidArgument("attribute 'decay_ranges' needs [begin, end) pairs");
          }
        }
        return Metas{in[0], in[2], in[3]};
      },
      .cost =
          [](const Metas& in, const Attrs&) {
            return OpCost{14.0 * static_cast<double>(in[1].numel()),
                          2 * Bytes({in[1], in[1], in[1], in[1]})};
          },
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "sgd",
      .doc = "p -= lr * (grad * clip_scale + weight_decay * p), in place",
      .input_names = {"param", "grad", "clip_scale", "lr"},
      .output_names = {"param_out"},
      .in_place = {{0, 0}},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("param", in[0], DType::kF32));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("grad", in[1], "param", in[0]));
        TESSERA_RETURN_IF_ERROR(CheckShape("clip_scale", in[2], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckShape("lr", in[3], Shape{}));
        return Metas{in[0]};
      },
      .cost = ElementwiseCost(4),
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "sum_of_squares",
      .doc = "sum of squared elements (a gradient's contribution to the global norm)",
      .input_names = {"x"},
      .output_names = {"sum"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("x", in[0], DType::kF32));
        return Metas{Scalar()};
      },
      .cost = ElementwiseCost(2),
  }));
  return r.AddOp(OpDef{
      .name = "clip_scale",
      .doc = "global norm = sqrt(sum of the inputs); scale = min(1, max_norm / (norm + 1e-6))",
      .input_names = {"sum_of_squares"},
      .output_names = {"scale", "norm"},
      .variadic_inputs = true,
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        if (in.empty()) return InvalidArgument("needs at least one sum of squares");
        for (const TensorMeta& meta : in) {
          TESSERA_RETURN_IF_ERROR(CheckShape("sum_of_squares", meta, Shape{}));
        }
        return Metas{Scalar(), Scalar()};
      },
      .cost = ElementwiseCost(1),
  });
}

// ---- transformer layer ops (flat parameter groups, hand-fused backward) ----

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
        // In forwards' flops: the whole backward 2.5, of which the dx products and attention's
        // backward 1.5 and the dW products 1.
        .cost =
            [part](const Metas& in, const Attrs& attrs) {
              Result<TransformerShape> s = ReadTransformerShape(attrs, in[1], true, false);
              const double forwards =
                  part == Part::kWhole ? 2.5 : (part == Part::kInput ? 1.5 : 1.0);
              return OpCost{s.ok() ? forwards * BlockForwardFlops(*s) : 0.0, 2 * Bytes(in)};
            },
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
  });
}

// ---- collective members (see core/collective_task.h for the attributes) ----

Status CheckCollective(const TensorMeta& x, const Attrs& attrs, bool reduces) {
  TESSERA_ASSIGN_OR_RETURN(int64_t size, PositiveAttr(attrs, kGroupSizeAttr));
  TESSERA_ASSIGN_OR_RETURN(int64_t rank, attrs.GetInt(kRankAttr));
  TESSERA_RETURN_IF_ERROR(attrs.GetInt(kCollectiveAttr).status());
  if (rank < 0 || rank >= size) {
    return InvalidArgument("attribute 'rank' is {} but the group has {} members", rank, size);
  }
  if (reduces) {
    if (x.dtype != DType::kF32 && x.dtype != DType::kBF16 && x.dtype != DType::kF16 &&
        x.dtype != DType::kI32) {
      return InvalidArgument("input 'x' is {}; collectives reduce f32, bf16, f16 and i32",
                             x.ToString());
    }
    TESSERA_ASSIGN_OR_RETURN(std::string op, attrs.GetString("reduce"));
    if (op != "sum" && op != "avg" && op != "max" && op != "min") {
      return InvalidArgument("attribute 'reduce' is '{}'; use sum, avg, max or min", op);
    }
  }
  return Status::Ok();
}

// The group size, for a member whose x holds one equal block per member (reduce-scatter,
// all-gather in place); InvalidArgument when it does not divide.
Result<int64_t> BlockCount(const TensorMeta& x, const Attrs& attrs) {
  const int64_t size = attrs.GetInt(kGroupSizeAttr, 1);
  if (x.numel() % size != 0) {
    return InvalidArgument(
        "input 'x' has {} elements, not a multiple of the group's {} members (pad it)", x.numel(),
        size);
  }
  return size;
}

// Bytes one member sends: a ring moves (n-1)/n of the buffer per phase.
CostFn CollectiveCost(double phases) {
  return [phases](const Metas& in, const Attrs& attrs) {
    const double n = static_cast<double>(attrs.GetInt(kGroupSizeAttr, 1));
    return OpCost{static_cast<double>(in[0].numel()), phases * Bytes(in) * (n - 1) / n};
  };
}

Status AddCollectiveOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "all_reduce",
      .doc = "member of an all-reduce: out = reduce (attribute 'reduce') of every member's x",
      .input_names = {"x"},
      .output_names = {"out"},
      .control_inputs = true,
      .in_place = {{0, 0}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckCollective(in[0], attrs, /*reduces=*/true));
        return Metas{in[0]};
      },
      .cost = CollectiveCost(2),
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "reduce_scatter",
      .doc = "member of a reduce-scatter: x (flat, group_size blocks) reduced over the members; "
             "rank r keeps block r",
      .input_names = {"x"},
      .output_names = {"out"},
      .control_inputs = true,
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckCollective(in[0], attrs, /*reduces=*/true));
        TESSERA_ASSIGN_OR_RETURN(const int64_t size, BlockCount(in[0], attrs));
        return Metas{TensorMeta{Shape{in[0].numel() / size}, in[0].dtype, in[0].device}};
      },
      .cost = CollectiveCost(1),
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "all_gather",
      .doc = "member of an all-gather: out (flat) holds every member's x, in rank order",
      .input_names = {"x"},
      .output_names = {"out"},
      .control_inputs = true,
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckCollective(in[0], attrs, /*reduces=*/false));
        const int64_t size = attrs.GetInt(kGroupSizeAttr, 1);
        return Metas{TensorMeta{Shape{in[0].numel() * size}, in[0].dtype, in[0].device}};
      },
      .cost =
          [](const Metas& in, const Attrs& attrs) {
            const double n = static_cast<double>(attrs.GetInt(kGroupSizeAttr, 1));
            return OpCost{0, Bytes(in) * (n - 1)};
          },
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "all_gather_in_place",
      .doc = "member of an all-gather within one buffer: x (flat, group_size blocks) holds this "
             "member's block at rank r; out = x with every member's block (ZeRO-1/2 parameters "
             "after a sharded update)",
      .input_names = {"x"},
      .output_names = {"out"},
      .control_inputs = true,
      .in_place = {{0, 0}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckCollective(in[0], attrs, /*reduces=*/false));
        TESSERA_RETURN_IF_ERROR(BlockCount(in[0], attrs).status());
        return Metas{in[0]};
      },
      .cost =
          [](const Metas& in, const Attrs& attrs) {
            const double n = static_cast<double>(attrs.GetInt(kGroupSizeAttr, 1));
            return OpCost{0, Bytes(in) * (n - 1) / n};
          },
  }));
  return r.AddOp(OpDef{
      .name = "broadcast",
      .doc = "member of a broadcast: out = x of the member whose rank is attribute 'root'",
      .input_names = {"x"},
      .output_names = {"out"},
      .control_inputs = true,
      .in_place = {{0, 0}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckCollective(in[0], attrs, /*reduces=*/false));
        TESSERA_ASSIGN_OR_RETURN(int64_t root, attrs.GetInt("root"));
        if (root < 0 || root >= attrs.GetInt(kGroupSizeAttr, 1)) {
          return InvalidArgument("attribute 'root' is {}, not a rank of the group", root);
        }
        return Metas{in[0]};
      },
      .cost = CollectiveCost(1),
  });
}

}  // namespace

Status RegisterStandardOps(OpRegistry& registry) {
  TESSERA_RETURN_IF_ERROR(AddCollectiveOps(registry));
  TESSERA_RETURN_IF_ERROR(AddEmbeddingOps(registry));
  TESSERA_RETURN_IF_ERROR(AddLayerNormOps(registry));
  TESSERA_RETURN_IF_ERROR(AddLinearOps(registry));
  TESSERA_RETURN_IF_ERROR(AddAttentionOps(registry));
  TESSERA_RETURN_IF_ERROR(AddElementwiseOps(registry));
  TESSERA_RETURN_IF_ERROR(AddLossAndOptimizerOps(registry));
  TESSERA_RETURN_IF_ERROR(AddTransformerLayerOps(registry));
  TESSERA_RETURN_IF_ERROR(RegisterVolumeOps(registry));
  return RegisterLayerProgramOps(registry);
}

}  // namespace tessera

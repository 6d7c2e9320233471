// The standard ops' primitive layers: embedding, layer norm, linear and attention (definitions;
// CPU kernels in ops/cpu/).
#include <string>
#include <utility>
#include <vector>

#include "ops/op_def_util.h"
#include "ops/standard_ops_internal.h"

namespace tessera::detail {

using op_def::Bytes;
using op_def::CheckDType;
using op_def::In;
using op_def::Out;
using op_def::OutGrad;
using op_def::Rule;
using op_def::Split;

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

}  // namespace tessera::detail

// The standard ops' losses and optimizers (definitions; CPU kernels in ops/cpu/).
#include <vector>

#include "ops/op_def_util.h"
#include "ops/standard_ops_internal.h"

namespace tessera::detail {

using op_def::Bytes;
using op_def::CheckDType;
using op_def::Out;
using op_def::OutGrad;
using op_def::Rule;

namespace {

// An optimizer's attribute 'decay_ranges', where given: [begin, end) pairs.
Status CheckDecayRanges(const Attrs& attrs) {
  if (!attrs.Has("decay_ranges")) return Status::Ok();
  TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> ranges, attrs.GetInts("decay_ranges"));
  if (ranges.size() % 2 != 0) {
    return InvalidArgument("attribute 'decay_ranges' needs [begin, end) pairs");
  }
  return Status::Ok();
}

// An update's piece of state `name` (the gradient, or the frozen variance) against its
// parameters: the same shape, or with attribute 'param_offset' a shard of the (larger, flat)
// parameter group updated in place at that offset (ZeRO-1/2).
Status CheckPieceOfParam(const char* name, const TensorMeta& piece, const TensorMeta& param,
                         const Attrs& attrs) {
  if (!attrs.Has("param_offset")) return CheckSameShape(name, piece, "param", param);
  TESSERA_ASSIGN_OR_RETURN(int64_t offset, attrs.GetInt("param_offset"));
  TESSERA_RETURN_IF_ERROR(CheckDType(name, piece, DType::kF32));
  if (piece.shape.rank() != 1 || param.shape.rank() != 1 || offset < 0 ||
      offset + piece.numel() > param.numel()) {
    return InvalidArgument("{} shard {} at param_offset {} does not fit in param {}", name,
                           piece.ToString(), offset, param.ToString());
  }
  return Status::Ok();
}

}  // namespace

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
             "scaled by the loss's own gradient (dlogits f32, or bf16 computed in f32)",
      .input_names = {"dloss", "dlogits"},
      .output_names = {"dx"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckShape("dloss", in[0], Shape{}));
        // bf16: a volume loss's gradient over bf16 logits (ops/volume_ops.h).
        if (!CarriesGradients(in[1].dtype)) {
          return InvalidArgument("input 'dlogits' is {} but must be f32 or bf16", in[1].ToString());
        }
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
        TESSERA_RETURN_IF_ERROR(CheckPieceOfParam("grad", in[1], in[0], attrs));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("exp_avg", in[2], "grad", in[1]));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("exp_avg_sq", in[3], "grad", in[1]));
        TESSERA_RETURN_IF_ERROR(CheckShape("clip_scale", in[4], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckShape("lr", in[5], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckShape("step", in[6], Shape{}, DType::kI64));
        TESSERA_RETURN_IF_ERROR(CheckDecayRanges(attrs));
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
  // 1-bit Adam (DeepSpeed's OnebitAdam; ops/cpu/kernels.h has the arithmetic): the warm-up's
  // update, and the compressed phase's two halves around the momentum's compressed all-reduce.
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "onebit_adam",
      .doc = "1-bit Adam's warm-up update in place (Adam without bias correction, the weight "
             "decay added to the update: DeepSpeed's OnebitAdam before its freeze step), "
             "gradients scaled by the clipping factor; param_offset as adamw's",
      .input_names = {"param", "grad", "exp_avg", "exp_avg_sq", "clip_scale", "lr"},
      .output_names = {"param_out", "exp_avg_out", "exp_avg_sq_out"},
      .in_place = {{0, 0}, {2, 1}, {3, 2}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("param", in[0], DType::kF32));
        TESSERA_RETURN_IF_ERROR(CheckPieceOfParam("grad", in[1], in[0], attrs));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("exp_avg", in[2], "grad", in[1]));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("exp_avg_sq", in[3], "grad", in[1]));
        TESSERA_RETURN_IF_ERROR(CheckShape("clip_scale", in[4], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckShape("lr", in[5], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckDecayRanges(attrs));
        return Metas{in[0], in[2], in[3]};
      },
      .cost =
          [](const Metas& in, const Attrs&) {
            return OpCost{12.0 * static_cast<double>(in[1].numel()),
                          2 * Bytes({in[1], in[1], in[1], in[1]})};
          },
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "onebit_adam_momentum",
      .doc = "1-bit Adam's compressed phase, first half: exp_avg = beta1 exp_avg + (1 - beta1) "
             "grad * clip_scale in place (this rank's momentum, before its compressed "
             "all-reduce)",
      .input_names = {"exp_avg", "grad", "clip_scale"},
      .output_names = {"exp_avg_out"},
      .in_place = {{0, 0}},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("exp_avg", in[0], DType::kF32));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("grad", in[1], "exp_avg", in[0]));
        TESSERA_RETURN_IF_ERROR(CheckShape("clip_scale", in[2], Shape{}));
        return Metas{in[0]};
      },
      .cost = ElementwiseCost(3),
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "onebit_adam_frozen",
      .doc = "1-bit Adam's compressed phase, second half: param -= lr * (exp_avg / "
             "(sqrt(exp_avg_sq) + eps) + weight_decay * param) in place, exp_avg the ranks' "
             "(compressed) average, exp_avg_sq frozen since the warm-up (passed through: the "
             "step's next value of it); with param_offset exp_avg_sq is a shard and the update "
             "is of that piece of param (and of exp_avg, as long as param)",
      .input_names = {"param", "exp_avg", "exp_avg_sq", "lr"},
      .output_names = {"param_out", "exp_avg_sq_out"},
      .in_place = {{0, 0}, {2, 1}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("param", in[0], DType::kF32));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("exp_avg", in[1], "param", in[0]));
        TESSERA_RETURN_IF_ERROR(CheckPieceOfParam("exp_avg_sq", in[2], in[0], attrs));
        TESSERA_RETURN_IF_ERROR(CheckShape("lr", in[3], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckDecayRanges(attrs));
        return Metas{in[0], in[2]};
      },
      .cost = ElementwiseCost(5),
  }));
  // 0/1 Adam (DeepSpeed's ZeroOneAdam; ops/cpu/kernels.h has the arithmetic): the compressed
  // gradient step's update, and the local step's, with its synchronisation's two halves around
  // the compressed all-reduce of the ranks' moves since the interval's start. Its variance steps
  // are onebit_adam's.
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "zero_one_adam_compressed",
      .doc = "0/1 Adam's compressed-gradient step in place: exp_avg = beta1 exp_avg + (1 - "
             "beta1) grad, grad the ranks' compressed average of their clipped gradients, then "
             "param -= lr * (exp_avg / (sqrt(exp_avg_sq) + eps) + weight_decay * param); "
             "exp_avg_sq kept (passed through)",
      .input_names = {"param", "grad", "exp_avg", "exp_avg_sq", "lr"},
      .output_names = {"param_out", "exp_avg_out", "exp_avg_sq_out"},
      .in_place = {{0, 0}, {2, 1}, {3, 2}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("param", in[0], DType::kF32));
        for (int i = 1; i <= 3; ++i) {
          TESSERA_RETURN_IF_ERROR(CheckSameShape(i == 1   ? "grad"
                                                 : i == 2 ? "exp_avg"
                                                          : "exp_avg_sq",
                                                 in[static_cast<size_t>(i)], "param", in[0]));
        }
        TESSERA_RETURN_IF_ERROR(CheckShape("lr", in[4], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckDecayRanges(attrs));
        return Metas{in[0], in[2], in[3]};
      },
      .cost = ElementwiseCost(7),
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "zero_one_adam_local",
      .doc = "0/1 Adam's local step in place: exp_avg from this rank's gradient (times "
             "clip_scale), param -= lr * (exp_avg / (sqrt(exp_avg_sq) + eps) + weight_decay * "
             "param); with attribute 'sync' 1 then param is set to interval_start (the "
             "parameters at the last sync) and interval_start to the move since, times "
             "sqrt(exp_avg_sq) + eps (what the ranks average)",
      .input_names = {"param", "grad", "exp_avg", "exp_avg_sq", "interval_start", "clip_scale",
                      "lr"},
      .output_names = {"param_out", "exp_avg_out", "exp_avg_sq_out", "interval_start_out"},
      .in_place = {{0, 0}, {2, 1}, {3, 2}, {4, 3}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("param", in[0], DType::kF32));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("grad", in[1], "param", in[0]));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("exp_avg", in[2], "param", in[0]));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("exp_avg_sq", in[3], "param", in[0]));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("interval_start", in[4], "param", in[0]));
        TESSERA_RETURN_IF_ERROR(CheckShape("clip_scale", in[5], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckShape("lr", in[6], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckDecayRanges(attrs));
        return Metas{in[0], in[2], in[3], in[4]};
      },
      .cost = ElementwiseCost(9),
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "zero_one_adam_sync",
      .doc = "0/1 Adam's synchronisation, second half, in place: interval_start the ranks' "
             "average of their moves, param the interval's start: exp_avg = -interval_start / "
             "lr_sum - weight_decay * param * (sqrt(exp_avg_sq) + eps), param += interval_start "
             "/ (sqrt(exp_avg_sq) + eps), interval_start = param (the next interval's); lr_sum "
             "the learning rates of the interval's steps summed",
      .input_names = {"param", "exp_avg", "exp_avg_sq", "interval_start", "lr_sum"},
      .output_names = {"param_out", "exp_avg_out", "exp_avg_sq_out", "interval_start_out"},
      .in_place = {{0, 0}, {1, 1}, {2, 2}, {3, 3}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("param", in[0], DType::kF32));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("exp_avg", in[1], "param", in[0]));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("exp_avg_sq", in[2], "param", in[0]));
        TESSERA_RETURN_IF_ERROR(CheckSameShape("interval_start", in[3], "param", in[0]));
        TESSERA_RETURN_IF_ERROR(CheckShape("lr_sum", in[4], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckDecayRanges(attrs));
        return Metas{in[0], in[1], in[2], in[3]};
      },
      .cost = ElementwiseCost(8),
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "scale",
      .doc = "x *= scale in place (an f32 scalar input: e.g. a rank's clipping factor on its "
             "gradient before a compressed all-reduce)",
      .input_names = {"x", "scale"},
      .output_names = {"y"},
      .in_place = {{0, 0}},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("x", in[0], DType::kF32));
        TESSERA_RETURN_IF_ERROR(CheckShape("scale", in[1], Shape{}));
        return Metas{in[0]};
      },
      .cost = ElementwiseCost(1),
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "sum_of_squares",
      .doc = "sum of squared elements (a gradient's contribution to the global norm); with "
             "attribute 'ranges' [begin0, end0, begin1, end1, ...], of those elements only (a "
             "tensor-parallel rank leaving out the replicated slots another rank counts)",
      .input_names = {"x"},
      .output_names = {"sum"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("x", in[0], DType::kF32));
        if (attrs.Has("ranges")) {
          TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> ranges, attrs.GetInts("ranges"));
          for (size_t i = 0; i < ranges.size(); i += 2) {
            if (i + 1 >= ranges.size() || ranges[i] < 0 || ranges[i] > ranges[i + 1] ||
                ranges[i + 1] > in[0].numel()) {
              return InvalidArgument(
                  "attribute 'ranges' must be pairs begin <= end within x's {} elements",
                  in[0].numel());
            }
          }
        }
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

}  // namespace tessera::detail

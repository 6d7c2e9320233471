// The standard ops' elementwise family (definitions; CPU kernels in ops/cpu/elementwise.cc).
#include <string>
#include <vector>

#include "ops/op_def_util.h"
#include "ops/standard_ops_internal.h"

namespace tessera::detail {

using op_def::CheckDType;
using op_def::In;
using op_def::OutGrad;
using op_def::Rule;

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
      .name = "bias_add_forward",
      .doc = "out = x + b, b [C] added to every row of x [..., C] (a row-parallel linear's bias, "
             "added once after its partial sums are all-reduced)",
      .input_names = {"x", "b"},
      .output_names = {"out"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("x", in[0], DType::kF32));
        TESSERA_RETURN_IF_ERROR(CheckDType("b", in[1], DType::kF32));
        if (in[0].shape.rank() < 1 || in[1].shape.rank() != 1 ||
            in[1].shape[0] != in[0].shape[in[0].shape.rank() - 1]) {
          return InvalidArgument("bias 'b' of shape {} does not match the last dimension of x {}",
                                 in[1].shape.ToString(), in[0].shape.ToString());
        }
        return Metas{in[0]};
      },
      .cost = ElementwiseCost(1),
      .gradient = Rule("bias_add_backward", {OutGrad(0)}, {0, 1})}));
  TESSERA_RETURN_IF_ERROR(
      r.AddOp(OpDef{.name = "bias_add_backward",
                    .doc = "dx = dout; db = dout summed over every row",
                    .input_names = {"dout"},
                    .output_names = {"dx", "db"},
                    .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
                      TESSERA_RETURN_IF_ERROR(CheckDType("dout", in[0], DType::kF32));
                      if (in[0].shape.rank() < 1)
                        return InvalidArgument("dout is a scalar; it needs rows of C");
                      const int64_t c = in[0].shape[in[0].shape.rank() - 1];
                      return Metas{in[0], TensorMeta{Shape{c}, DType::kF32, in[0].device}};
                    },
                    .cost = ElementwiseCost(1)}));
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
  // f32, or bf16 (a bf16 activation's gradient summed over its readers: read as f32, added,
  // rounded once).
  TESSERA_RETURN_IF_ERROR(r.AddOp(
      OpDef{.name = "accumulate",
            .doc = "sum = sum + x, in place (gradient accumulation); f32, or bf16 added in f32",
            .input_names = {"sum", "x"},
            .output_names = {"sum"},
            .in_place = {{0, 0}},
            .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
              if (!CarriesGradients(in[0].dtype)) {
                return InvalidArgument("input 'sum' is {} but accumulate adds f32 or bf16",
                                       in[0].ToString());
              }
              TESSERA_RETURN_IF_ERROR(CheckSameShape("x", in[1], "sum", in[0]));
              return Metas{in[0]};
            },
            .cost = ElementwiseCost(1)}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "identity",
      .doc = "out = x, a new value: what a layer hands on unchanged (ring attention's keys and "
             "values, on to their next rotation); its own gradient rule",
      .input_names = {"x"},
      .output_names = {"out"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> { return Metas{in[0]}; },
      .cost =
          [](const Metas& in, const Attrs&) {
            return OpCost{0, 2.0 * static_cast<double>(in[0].bytes())};
          },
      .gradient = Rule("identity", {OutGrad(0)}, {0}),
  }));
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

}  // namespace tessera::detail

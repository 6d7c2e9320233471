#include "ops/volume_ops.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "ops/op_def_util.h"

namespace tessera {

namespace {

// The column matrix of one chunk: 8 MB, wide enough that its GEMM splits into many pieces.
constexpr int64_t kColumnFloats = int64_t{1} << 21;
constexpr int64_t kChunkQuantum = 64;

}  // namespace

int64_t Conv3dPositionsPerChunk(int64_t column_rows, int64_t out_volume) {
  int64_t chunk = kColumnFloats / std::max<int64_t>(column_rows, 1);
  chunk = std::max<int64_t>(chunk / kChunkQuantum * kChunkQuantum, kChunkQuantum);
  return std::max<int64_t>(1, std::min(chunk, out_volume));
}

int64_t DepthPadding(const Attrs& attrs) {
  return attrs.GetInt(kDepthPaddingAttr, attrs.GetInt("padding", 0));
}

int64_t Conv3dWorkspaceFloats(int64_t column_rows, int64_t out_volume) {
  return column_rows * std::min(Conv3dPositionsPerChunk(column_rows, out_volume), out_volume);
}

namespace {

using Metas = std::vector<TensorMeta>;
using op_def::Bytes;
using op_def::In;
using op_def::Out;
using op_def::OutGrad;
using op_def::Rule;
using op_def::Split;

// Outputs live where the op's first input does.
TensorMeta F32Like(const TensorMeta& like, Shape shape) {
  return TensorMeta{std::move(shape), DType::kF32, like.device};
}
// An activation output: the dtype (f32 or bf16) and device of the activation it is made from.
TensorMeta ActivationLike(const TensorMeta& like, Shape shape) {
  return TensorMeta{std::move(shape), like.dtype, like.device};
}

Status CheckF32(const char* name, const TensorMeta& meta) {
  return op_def::CheckDType(name, meta, DType::kF32);
}

// Activations (volumes, their gradients, logits) are f32 or bf16; parameters, their gradients
// and statistics are f32 (ops/volume_ops.h).
Status CheckActivation(const char* name, const TensorMeta& meta) {
  if (!CarriesGradients(meta.dtype)) {
    return InvalidArgument("input '{}' is {} but an activation must be f32 or bf16", name,
                           meta.ToString());
  }
  return Status::Ok();
}

// Unlike standard_ops.cc's CheckShape (a dtype message, then a shape message), one message names
// the expected dtype and shape together, e.g. "... but i32[2, 8, 8, 8] was expected".
Status CheckMeta(const char* name, const TensorMeta& meta, const Shape& expected,
                 DType dtype = DType::kF32) {
  if (meta.dtype != dtype || meta.shape != expected) {
    return InvalidArgument("input '{}' is {} but {}{} was expected", name, meta.ToString(),
                           DTypeName(dtype), expected.ToString());
  }
  return Status::Ok();
}

// An NCDHW volume of activations (f32 or bf16).
Status CheckVolume(const char* op, const char* name, const TensorMeta& meta) {
  TESSERA_RETURN_IF_ERROR(CheckActivation(name, meta));
  if (meta.shape.rank() != 5) {
    return InvalidArgument("input '{}' has shape {} ({} dims) but {} needs [N, C, D, H, W]", name,
                           meta.shape.ToString(), meta.shape.rank(), op);
  }
  return Status::Ok();
}

// Adds the volume ops to a registry. Their CPU kernels take bf16 activations by computing in f32
// copies of them (ops/cpu/volume_registration.cc: ThroughF32): scratch on the host, which each
// op's workspace counts beside the kernel's own (an output computed in place over an input
// shares its copy).
class VolumeOpRegistry {
 public:
  explicit VolumeOpRegistry(OpRegistry& registry) : registry_(registry) {}

  Status AddOp(OpDef def) {
    def.workspace = [infer = def.infer, kernel_scratch = std::move(def.workspace),
                     in_place = def.in_place](const Metas& in, const Attrs& attrs) -> int64_t {
      int64_t bytes = kernel_scratch ? kernel_scratch(in, attrs) : 0;
      for (const TensorMeta& meta : in) bytes += F32CopyBytes(meta);
      Result<Metas> out = infer(in, attrs);
      if (!out.ok()) return bytes;
      for (size_t i = 0; i < out->size(); ++i) {
        const bool shared = std::any_of(in_place.begin(), in_place.end(), [i](const auto& pair) {
          return pair.second == static_cast<int>(i);
        });
        if (!shared) bytes += F32CopyBytes((*out)[i]);
      }
      return bytes;
    };
    return registry_.AddOp(std::move(def));
  }

 private:
  static int64_t F32CopyBytes(const TensorMeta& meta) {
    return meta.dtype == DType::kBF16 ? meta.numel() * int64_t{4} : int64_t{0};
  }

  OpRegistry& registry_;
};

// An integer attribute with a default, at least `minimum`.
Result<int64_t> IntAttr(const Attrs& attrs, const char* name, int64_t fallback, int64_t minimum) {
  int64_t value = fallback;
  if (attrs.Has(name)) {
    TESSERA_ASSIGN_OR_RETURN(value, attrs.GetInt(name));
  }
  if (value < minimum) {
    return InvalidArgument("attribute '{}' must be >= {}, got {}", name, minimum, value);
  }
  return value;
}

double Numel(const TensorMeta& meta) { return static_cast<double>(meta.numel()); }

// Cost from the op's own inference: `flops(inputs, outputs)`, every input and output byte
// touched once. Inputs that fail inference cost their bytes only.
CostFn CostOf(InferFn infer, std::function<double(const Metas&, const Metas&)> flops) {
  return [infer = std::move(infer), flops = std::move(flops)](const Metas& in, const Attrs& attrs) {
    Result<Metas> out = infer(in, attrs);
    if (!out.ok()) return OpCost{0, Bytes(in)};
    return OpCost{flops(in, *out), Bytes(in) + Bytes(*out)};
  };
}

// ---- convolutions ----

constexpr const char* kConvWeightLayout = "[Cout, Cin, kD, kH, kW]";
constexpr const char* kTransposedWeightLayout = "[Cin, Cout, kD, kH, kW]";

// Checks x, weight and bias of conv3d (transposed: conv_transpose3d) and returns y's shape.
Result<Shape> ConvOutputShape(const Metas& in, int x_index, const Attrs& attrs, bool transposed) {
  const char* op = transposed ? "conv_transpose3d" : "conv3d";
  const TensorMeta& x = in[x_index];
  const TensorMeta& weight = in[x_index + 1];
  TESSERA_ASSIGN_OR_RETURN(const int64_t stride, IntAttr(attrs, "stride", 1, 1));
  TESSERA_ASSIGN_OR_RETURN(const int64_t padding, IntAttr(attrs, "padding", 0, 0));
  TESSERA_ASSIGN_OR_RETURN(const int64_t depth_padding,
                           IntAttr(attrs, kDepthPaddingAttr, padding, 0));
  TESSERA_RETURN_IF_ERROR(CheckVolume(op, "x", x));
  TESSERA_RETURN_IF_ERROR(CheckF32("weight", weight));
  const int64_t in_channels = x.shape[1];
  const char* layout = transposed ? kTransposedWeightLayout : kConvWeightLayout;
  if (weight.shape.rank() != 5) {
    return InvalidArgument("input 'weight' has shape {} ({} dims) but {} needs {}",
                           weight.shape.ToString(), weight.shape.rank(), op, layout);
  }
  const int64_t weight_in = transposed ? weight.shape[0] : weight.shape[1];
  if (weight_in != in_channels) {
    return InvalidArgument("input 'weight' has shape {} but x {} has Cin = {}; {} needs {}",
                           weight.shape.ToString(), x.shape.ToString(), in_channels, op, layout);
  }
  const int64_t out_channels = transposed ? weight.shape[1] : weight.shape[0];
  std::vector<int64_t> dims = {x.shape[0], out_channels};
  for (int axis = 2; axis < 5; ++axis) {
    const int64_t extent = x.shape[axis], kernel = weight.shape[axis];
    const int64_t pad = axis == 2 ? depth_padding : padding;
    if (kernel < 1) {
      return InvalidArgument("input 'weight' has shape {}: kernel extents must be >= 1",
                             weight.shape.ToString());
    }
    const int64_t out = transposed ? (extent - 1) * stride - 2 * pad + kernel
                                   : (extent + 2 * pad - kernel) / stride + 1;
    if (extent < 1 || out < 1 || (!transposed && extent + 2 * pad < kernel)) {
      return InvalidArgument(
          "{} of x {} with weight {}, stride {}, padding {} leaves no output along axis {}", op,
          x.shape.ToString(), weight.shape.ToString(), stride, pad, axis);
    }
    dims.push_back(out);
  }
  return Shape(std::move(dims));
}

// The CPU kernels' scratch for a convolution from `volume` to `grid` (conv3d's x to y; the
// transposed op's y to x): one column matrix, at least one float.
int64_t ConvScratchBytes(const TensorMeta& volume, const TensorMeta& weight,
                         const TensorMeta& grid) {
  if (volume.shape.rank() != 5 || weight.shape.rank() != 5 || grid.shape.rank() != 5) return 0;
  const int64_t rows = volume.shape[1] * weight.shape[2] * weight.shape[3] * weight.shape[4];
  const int64_t positions = grid.shape[2] * grid.shape[3] * grid.shape[4];
  return 4 * std::max<int64_t>(1, Conv3dWorkspaceFloats(rows, positions));
}

// conv3d and conv_transpose3d add a bias; conv3d_no_bias does not (the row-parallel half of a
// tensor-parallel pair of convolutions, whose partial sums are added before its bias is).
struct ConvVariant {
  bool transposed = false;
  bool bias = true;
  std::string Name() const {
    if (transposed) return "conv_transpose3d";
    return bias ? "conv3d" : "conv3d_no_bias";
  }
};

Status AddConvOps(VolumeOpRegistry& r, ConvVariant variant) {
  const bool transposed = variant.transposed, bias = variant.bias;
  const std::string name = variant.Name();
  const InferFn forward_infer = [transposed, bias](const Metas& in,
                                                   const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(Shape y, ConvOutputShape(in, 0, attrs, transposed));
    if (bias) TESSERA_RETURN_IF_ERROR(CheckMeta("bias", in[2], Shape{y[1]}));
    return Metas{ActivationLike(in[0], std::move(y))};
  };
  // One multiply-add per weight tap of each output of the underlying convolution: conv3d's y,
  // or for the transposed op (the adjoint, which maps its y back to its x) x. weight[0] is that
  // convolution's output channels in both layouts.
  auto conv_flops = [transposed](const TensorMeta& x, const TensorMeta& weight,
                                 const TensorMeta& y) {
    const double taps = Numel(weight) / static_cast<double>(weight.shape[0]);
    return 2.0 * (transposed ? Numel(x) : Numel(y)) * taps;
  };
  const char* doc = transposed ? "3D transposed convolution (the adjoint of conv3d) plus bias, "
                                 "NCDHW; attrs stride, padding"
                    : bias     ? "3D convolution plus bias, NCDHW, as im2col + GEMM; attrs stride, "
                                 "padding"
                           : "3D convolution without bias, NCDHW, as im2col + GEMM; attrs stride, "
                             "padding";
  std::vector<std::string> forward_inputs = {"x", "weight"};
  std::vector<std::string> backward_outputs = {"dx", "dweight"};
  std::vector<std::string> weight_outputs = {"dweight"};
  std::vector<int> gradient_of = {0, 1};
  if (bias) {
    forward_inputs.emplace_back("bias");
    backward_outputs.emplace_back("dbias");
    weight_outputs.emplace_back("dbias");
    gradient_of.push_back(2);
  }
  // The bias-free convolution's input half is conv3d's: the same inputs, the same dx.
  const std::string input_half = (bias ? name : std::string("conv3d")) + "_backward_input";
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = name + "_forward",
      .doc = doc,
      .input_names = forward_inputs,
      .output_names = {"y"},
      .infer = forward_infer,
      .cost = CostOf(forward_infer,
                     [conv_flops, bias](const Metas& in, const Metas& out) {
                       return conv_flops(in[0], in[1], out[0]) + (bias ? Numel(out[0]) : 0.0);
                     }),
      .workspace = [forward_infer, transposed](const Metas& in, const Attrs& attrs) -> int64_t {
        Result<Metas> y = forward_infer(in, attrs);
        if (!y.ok()) return 0;
        return transposed ? ConvScratchBytes((*y)[0], in[1], in[0])
                          : ConvScratchBytes(in[0], in[1], (*y)[0]);
      },
      .gradient = Split(Rule(name + "_backward", {OutGrad(0), In(0), In(1)}, gradient_of),
                        input_half, name + "_backward_weight", 1),
  }));
  // The backwards' (in: dy, x, weight): one column matrix at a time.
  const WorkspaceFn backward_scratch = [transposed](const Metas& in, const Attrs&) -> int64_t {
    return transposed ? ConvScratchBytes(in[0], in[2], in[1])
                      : ConvScratchBytes(in[1], in[2], in[0]);
  };
  const InferFn backward_infer = [transposed, bias](const Metas& in,
                                                    const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(Shape y, ConvOutputShape(in, 1, attrs, transposed));
    TESSERA_RETURN_IF_ERROR(CheckMeta("dy", in[0], y, in[1].dtype));
    if (!bias) return Metas{in[1], in[2]};
    return Metas{in[1], in[2], F32Like(in[1], Shape{y[1]})};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = name + "_backward",
      .doc = (bias ? "dx, dweight, dbias of " : "dx, dweight of ") + name + "_forward",
      .input_names = {"dy", "x", "weight"},
      .output_names = backward_outputs,
      .infer = backward_infer,
      .cost = CostOf(backward_infer,
                     [conv_flops](const Metas& in, const Metas&) {
                       return 2.0 * conv_flops(in[1], in[2], in[0]) + Numel(in[0]);
                     }),
      .workspace = backward_scratch,
  }));
  // The halves of the backward (zero-bubble pipelines): dx alone, and dweight and dbias alone,
  // from the same inputs.
  const InferFn input_infer = [backward_infer](const Metas& in,
                                               const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(Metas all, backward_infer(in, attrs));
    return Metas{all[0]};
  };
  const InferFn weight_infer = [backward_infer](const Metas& in,
                                                const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(Metas all, backward_infer(in, attrs));
    return Metas(all.begin() + 1, all.end());
  };
  if (bias) {
    TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
        .name = name + "_backward_input",
        .doc = "dx of " + name + "_forward (the input half of its backward)",
        .input_names = {"dy", "x", "weight"},
        .output_names = {"dx"},
        .infer = input_infer,
        .cost = CostOf(input_infer,
                       [conv_flops](const Metas& in, const Metas&) {
                         return conv_flops(in[1], in[2], in[0]);
                       }),
        .workspace = backward_scratch,
    }));
  }
  return r.AddOp(OpDef{
      .name = name + "_backward_weight",
      .doc = (bias ? "dweight, dbias of " : "dweight of ") + name +
             "_forward (the weight half of its backward)",
      .input_names = {"dy", "x", "weight"},
      .output_names = weight_outputs,
      .infer = weight_infer,
      .cost = CostOf(weight_infer,
                     [conv_flops, bias](const Metas& in, const Metas&) {
                       return conv_flops(in[1], in[2], in[0]) + (bias ? Numel(in[0]) : 0.0);
                     }),
      .workspace = backward_scratch,
  });
}

// ---- the per-channel bias ----

Status AddChannelBiasOps(VolumeOpRegistry& r) {
  const InferFn forward_infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckActivation("x", in[0]));
    if (in[0].shape.rank() < 2) {
      return InvalidArgument("input 'x' has shape {} but channel_bias_add needs [N, C, ...]",
                             in[0].shape.ToString());
    }
    TESSERA_RETURN_IF_ERROR(CheckMeta("bias", in[1], Shape{in[0].shape[1]}));
    return Metas{in[0]};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "channel_bias_add_forward",
      .doc = "y[n, c, ...] = x[n, c, ...] + bias[c] (a convolution's bias added on its own)",
      .input_names = {"x", "bias"},
      .output_names = {"y"},
      .infer = forward_infer,
      .cost = CostOf(forward_infer, [](const Metas& in, const Metas&) { return Numel(in[0]); }),
      .gradient = Rule("channel_bias_add_backward", {OutGrad(0)}, {0, 1}),
  }));
  const InferFn backward_infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckActivation("dy", in[0]));
    if (in[0].shape.rank() < 2) {
      return InvalidArgument("input 'dy' has shape {} but channel_bias_add needs [N, C, ...]",
                             in[0].shape.ToString());
    }
    return Metas{in[0], F32Like(in[0], Shape{in[0].shape[1]})};
  };
  return r.AddOp(OpDef{
      .name = "channel_bias_add_backward",
      .doc = "dx = dy, dbias[c] = sum of dy[n, c, ...] over n and the rest",
      .input_names = {"dy"},
      .output_names = {"dx", "dbias"},
      .infer = backward_infer,
      .cost = CostOf(backward_infer, [](const Metas& in, const Metas&) { return Numel(in[0]); }),
  });
}

// ---- resampling: nearest upsampling and max pooling ----

Status AddResamplingOps(VolumeOpRegistry& r) {
  const InferFn upsample_infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(const int64_t scale, IntAttr(attrs, "scale", 2, 1));
    TESSERA_RETURN_IF_ERROR(CheckVolume("upsample_nearest3d", "x", in[0]));
    const Shape& x = in[0].shape;
    return Metas{
        ActivationLike(in[0], Shape{x[0], x[1], x[2] * scale, x[3] * scale, x[4] * scale})};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "upsample_nearest3d_forward",
      .doc = "nearest-neighbour upsampling of each spatial axis by attr scale (default 2)",
      .input_names = {"x"},
      .output_names = {"y"},
      .infer = upsample_infer,
      .cost = CostOf(upsample_infer, [](const Metas&, const Metas&) { return 0.0; }),
      .gradient = Rule("upsample_nearest3d_backward", {OutGrad(0)}, {0}),
  }));
  const InferFn upsample_backward_infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(const int64_t scale, IntAttr(attrs, "scale", 2, 1));
    TESSERA_RETURN_IF_ERROR(CheckVolume("upsample_nearest3d_backward", "dy", in[0]));
    const Shape& dy = in[0].shape;
    for (int axis = 2; axis < 5; ++axis) {
      if (dy[axis] % scale != 0) {
        return InvalidArgument(
            "input 'dy' has shape {} but its spatial extents must be multiples of scale {}",
            dy.ToString(), scale);
      }
    }
    return Metas{
        ActivationLike(in[0], Shape{dy[0], dy[1], dy[2] / scale, dy[3] / scale, dy[4] / scale})};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "upsample_nearest3d_backward",
      .doc = "dx: each element sums its scale^3 block of dy",
      .input_names = {"dy"},
      .output_names = {"dx"},
      .infer = upsample_backward_infer,
      .cost = CostOf(upsample_backward_infer,
                     [](const Metas& in, const Metas&) { return Numel(in[0]); }),
  }));

  const InferFn pool_infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(const int64_t kernel, IntAttr(attrs, "kernel", 2, 1));
    TESSERA_RETURN_IF_ERROR(CheckVolume("max_pool3d", "x", in[0]));
    const Shape& x = in[0].shape;
    if (x[2] < kernel || x[3] < kernel || x[4] < kernel) {
      return InvalidArgument(
          "input 'x' has shape {} but max_pool3d's kernel {} needs D, H, W >= {}", x.ToString(),
          kernel, kernel);
    }
    if (x[2] * x[3] * x[4] > int64_t{1} << 31) {
      return InvalidArgument(
          "input 'x' has shape {}: a volume of more than 2^31 voxels does not fit "
          "max_pool3d's i32 indices",
          x.ToString());
    }
    Shape y{x[0], x[1], x[2] / kernel, x[3] / kernel, x[4] / kernel};
    return Metas{ActivationLike(in[0], y), TensorMeta{y, DType::kI32, in[0].device}};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "max_pool3d_forward",
      .doc = "max pooling with kernel = stride = attr kernel (default 2), floor mode; indices "
             "(i32) hold each maximum's flat index within its (n, c) volume",
      .input_names = {"x"},
      .output_names = {"y", "indices"},
      .infer = pool_infer,
      .cost = CostOf(pool_infer, [](const Metas& in, const Metas&) { return Numel(in[0]); }),
      .gradient = Rule("max_pool3d_backward", {OutGrad(0), In(0), Out(1)}, {0}),
  }));
  const InferFn pool_backward_infer = [pool_infer](const Metas& in,
                                                   const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(Metas forward, pool_infer(Metas{in[1]}, attrs));
    TESSERA_RETURN_IF_ERROR(CheckMeta("dy", in[0], forward[0].shape, in[1].dtype));
    TESSERA_RETURN_IF_ERROR(CheckMeta("indices", in[2], forward[1].shape, DType::kI32));
    return Metas{in[1]};
  };
  return r.AddOp(OpDef{
      .name = "max_pool3d_backward",
      .doc = "dx: dy routed to each window's maximum (x is read for its shape only)",
      .input_names = {"dy", "x", "indices"},
      .output_names = {"dx"},
      .infer = pool_backward_infer,
      .cost =
          CostOf(pool_backward_infer, [](const Metas& in, const Metas&) { return Numel(in[0]); }),
  });
}

// ---- group normalisation ----

// Checks x [N, C, *], weight [C] (and bias) and the groups attribute; returns G.
Result<int64_t> CheckGroupNorm(const TensorMeta& x, const TensorMeta& weight, const Attrs& attrs) {
  TESSERA_ASSIGN_OR_RETURN(const int64_t groups, attrs.GetInt("groups"));
  if (attrs.Has("eps")) {
    TESSERA_ASSIGN_OR_RETURN(const double eps, attrs.GetFloat("eps"));
    if (!(eps > 0)) return InvalidArgument("attribute 'eps' must be positive, got {}", eps);
  }
  TESSERA_RETURN_IF_ERROR(CheckActivation("x", x));
  if (x.shape.rank() < 2) {
    return InvalidArgument("input 'x' has shape {} but group_norm needs [N, C, ...]",
                           x.shape.ToString());
  }
  const int64_t channels = x.shape[1];
  if (groups < 1 || channels % groups != 0) {
    return InvalidArgument("attribute 'groups' is {} but must divide x {}'s C = {}", groups,
                           x.shape.ToString(), channels);
  }
  TESSERA_RETURN_IF_ERROR(CheckMeta("weight", weight, Shape{channels}));
  return groups;
}

Status AddGroupNormOps(VolumeOpRegistry& r) {
  const InferFn forward_infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(const int64_t groups, CheckGroupNorm(in[0], in[1], attrs));
    TESSERA_RETURN_IF_ERROR(CheckMeta("bias", in[2], Shape{in[0].shape[1]}));
    const Shape stats{in[0].shape[0], groups};
    return Metas{ActivationLike(in[0], in[0].shape), F32Like(in[0], stats), F32Like(in[0], stats)};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "group_norm_forward",
      .doc = "GroupNorm over [N, C, *] (attrs groups, eps default 1e-5): y = (x - mean) * rstd * "
             "weight[c] + bias[c] per (sample, group); also returns mean and rstd [N, G]",
      .input_names = {"x", "weight", "bias"},
      .output_names = {"y", "mean", "rstd"},
      .infer = forward_infer,
      .cost =
          CostOf(forward_infer, [](const Metas& in, const Metas&) { return 8.0 * Numel(in[0]); }),
      .gradient =
          Rule("group_norm_backward", {OutGrad(0), In(0), In(1), Out(1), Out(2)}, {0, 1, 2}),
  }));
  const InferFn backward_infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(const int64_t groups, CheckGroupNorm(in[1], in[2], attrs));
    TESSERA_RETURN_IF_ERROR(CheckMeta("dy", in[0], in[1].shape, in[1].dtype));
    const Shape stats{in[1].shape[0], groups};
    TESSERA_RETURN_IF_ERROR(CheckMeta("mean", in[3], stats));
    TESSERA_RETURN_IF_ERROR(CheckMeta("rstd", in[4], stats));
    return Metas{in[1], in[2], in[2]};
  };
  return r.AddOp(OpDef{
      .name = "group_norm_backward",
      .doc = "dx, dweight, dbias of group_norm_forward",
      .input_names = {"dy", "x", "weight", "mean", "rstd"},
      .output_names = {"dx", "dweight", "dbias"},
      .infer = backward_infer,
      .cost =
          CostOf(backward_infer, [](const Metas& in, const Metas&) { return 12.0 * Numel(in[0]); }),
  });
}

// ---- slabs: a volume split along its depth over spatial-parallel ranks ----

// [N, C, D, H, W] with D replaced by `depth`.
Shape WithDepth(const Shape& shape, int64_t depth) {
  std::vector<int64_t> dims = shape.dims();
  dims[2] = depth;
  return Shape(std::move(dims));
}

// A slab's volume: spatial parallelism's ops take f32 activations only (model/unet3d.h).
Status CheckSlab(const char* op, const char* name, const TensorMeta& meta) {
  TESSERA_RETURN_IF_ERROR(CheckF32(name, meta));
  return CheckVolume(op, name, meta);
}

// Whether `plane` is one D-plane of `volume`: [N, C, 1, H, W] beside [N, C, D, H, W].
Status CheckPlane(const char* name, const TensorMeta& plane, const TensorMeta& volume) {
  return CheckMeta(name, plane, WithDepth(volume.shape, 1));
}

Status AddHaloOps(VolumeOpRegistry& r) {
  const InferFn planes_infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckSlab("slab_planes", "x", in[0]));
    TESSERA_ASSIGN_OR_RETURN(const int64_t depth, IntAttr(attrs, "depth", 0, 1));
    if (depth != in[0].shape[2]) {
      return InvalidArgument("attribute 'depth' is {} but x {} has D = {}", depth,
                             in[0].shape.ToString(), in[0].shape[2]);
    }
    const TensorMeta plane = F32Like(in[0], WithDepth(in[0].shape, 1));
    return Metas{plane, plane};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "slab_planes_forward",
      .doc = "first, last: x's first and last D-planes [N, C, 1, H, W] (a slab's halos, passed to "
             "the ranks before and after it); attribute depth (required): x's D, so that the "
             "backward needs nothing of x",
      .input_names = {"x"},
      .output_names = {"first", "last"},
      .infer = planes_infer,
      .cost = CostOf(planes_infer, [](const Metas&, const Metas&) { return 0.0; }),
      .gradient = Rule("slab_planes_backward", {OutGrad(0), OutGrad(1)}, {0}),
  }));
  const InferFn planes_backward_infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckSlab("slab_planes_backward", "dfirst", in[0]));
    TESSERA_ASSIGN_OR_RETURN(const int64_t depth, IntAttr(attrs, "depth", 0, 1));
    const TensorMeta dx = F32Like(in[0], WithDepth(in[0].shape, depth));
    TESSERA_RETURN_IF_ERROR(CheckPlane("dfirst", in[0], dx));
    TESSERA_RETURN_IF_ERROR(CheckPlane("dlast", in[1], dx));
    return Metas{dx};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "slab_planes_backward",
      .doc = "dx [N, C, depth, H, W]: zeros but for dfirst added at D-plane 0 and dlast at "
             "D-plane depth - 1 (attribute depth, the forward's)",
      .input_names = {"dfirst", "dlast"},
      .output_names = {"dx"},
      .infer = planes_backward_infer,
      .cost = CostOf(planes_backward_infer, [](const Metas&, const Metas&) { return 0.0; }),
  }));
  const InferFn join_infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckSlab("halo_join", "x", in[1]));
    TESSERA_RETURN_IF_ERROR(CheckPlane("above", in[0], in[1]));
    TESSERA_RETURN_IF_ERROR(CheckPlane("below", in[2], in[1]));
    return Metas{F32Like(in[1], WithDepth(in[1].shape, in[1].shape[2] + 2))};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "halo_join_forward",
      .doc = "out [N, C, D + 2, H, W] = [above; x; below] along D: a slab with the plane of the "
             "slab before it and of the one after it (zeros past the volume's ends), which a "
             "convolution with depth_padding 0 reads as the whole volume's would",
      .input_names = {"above", "x", "below"},
      .output_names = {"out"},
      .infer = join_infer,
      .cost = CostOf(join_infer, [](const Metas&, const Metas&) { return 0.0; }),
      .gradient = Rule("halo_join_backward", {OutGrad(0)}, {0, 1, 2}),
  }));
  const InferFn join_backward_infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckSlab("halo_join_backward", "dout", in[0]));
    if (in[0].shape[2] < 3) {
      return InvalidArgument("input 'dout' has shape {}: a joined slab has at least 3 D-planes",
                             in[0].shape.ToString());
    }
    const TensorMeta plane = F32Like(in[0], WithDepth(in[0].shape, 1));
    return Metas{plane, F32Like(in[0], WithDepth(in[0].shape, in[0].shape[2] - 2)), plane};
  };
  return r.AddOp(OpDef{
      .name = "halo_join_backward",
      .doc = "dabove, dx, dbelow: dout's first D-plane, the middle ones and its last",
      .input_names = {"dout"},
      .output_names = {"dabove", "dx", "dbelow"},
      .infer = join_backward_infer,
      .cost = CostOf(join_backward_infer, [](const Metas&, const Metas&) { return 0.0; }),
  });
}

// The statistics group_norm_stats makes for `ranks` ranks of x [N, C, *]: [P, N, G, 4].
Shape SlabStatsShape(int64_t ranks, const TensorMeta& x, int64_t groups) {
  return Shape{ranks, x.shape[0], groups, kSlabStatsWidth};
}

Status AddSlabNormOps(VolumeOpRegistry& r) {
  const InferFn stats_infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(const int64_t ranks, IntAttr(attrs, "ranks", 1, 1));
    TESSERA_RETURN_IF_ERROR(CheckF32("x", in[0]));
    TESSERA_ASSIGN_OR_RETURN(const int64_t groups, attrs.GetInt("groups"));
    if (in[0].shape.rank() < 2 || groups < 1 || in[0].shape[1] % groups != 0) {
      return InvalidArgument(
          "input 'x' {} must be [N, C, ...] with attribute 'groups' ({}) "
          "dividing C",
          in[0].shape.ToString(), groups);
    }
    return Metas{F32Like(in[0], SlabStatsShape(ranks, in[0], groups))};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "group_norm_stats_forward",
      .doc = "stats [P, N, G, 4]: this slab's sum and sum of squares over each (sample, group) "
             "of x [N, C, *] (attrs groups, ranks P), each as a high and a low f32 whose sum is "
             "the double (hi(sum), lo(sum), hi(squares), lo(squares)), the same in each of the "
             "P blocks: an all-to-all of blocks hands every rank every slab's",
      .input_names = {"x"},
      .output_names = {"stats"},
      .infer = stats_infer,
      .cost = CostOf(stats_infer, [](const Metas& in, const Metas&) { return 2.0 * Numel(in[0]); }),
      .gradient = Rule("group_norm_stats_backward", {OutGrad(0), In(0)}, {0}),
  }));
  const InferFn stats_backward_infer = [stats_infer](const Metas& in,
                                                     const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(Metas forward, stats_infer({in[1]}, attrs));
    TESSERA_RETURN_IF_ERROR(CheckMeta("dstats", in[0], forward[0].shape));
    return Metas{in[1]};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "group_norm_stats_backward",
      .doc = "dx = sum over the P blocks of (dstats[.., 0] + 2 x dstats[.., 2]): the high parts "
             "carry the gradient of each sum",
      .input_names = {"dstats", "x"},
      .output_names = {"dx"},
      .infer = stats_backward_infer,
      .cost = CostOf(stats_backward_infer,
                     [](const Metas& in, const Metas&) { return 3.0 * Numel(in[1]); }),
  }));
  // x [N, C, *], stats [P, N, G, 4] (every slab's), weight, bias.
  const InferFn slab_infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckF32("x", in[0]));
    TESSERA_ASSIGN_OR_RETURN(const int64_t groups, CheckGroupNorm(in[0], in[2], attrs));
    TESSERA_RETURN_IF_ERROR(CheckMeta("bias", in[3], Shape{in[0].shape[1]}));
    const int64_t ranks = in[1].shape.rank() == 4 ? in[1].shape[0] : 0;
    TESSERA_RETURN_IF_ERROR(
        CheckMeta("stats", in[1], SlabStatsShape(std::max<int64_t>(ranks, 1), in[0], groups)));
    const Shape stats{in[0].shape[0], groups};
    return Metas{F32Like(in[0], in[0].shape), F32Like(in[0], stats), F32Like(in[0], stats)};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "group_norm_slab_forward",
      .doc = "group_norm_forward of a slab with the statistics of every slab of the volume "
             "(stats [P, N, G, 4] from group_norm_stats, exchanged): mean and variance over all "
             "P equal slabs (attrs groups, eps default 1e-5); y, mean and rstd [N, G] as "
             "group_norm_forward's",
      .input_names = {"x", "stats", "weight", "bias"},
      .output_names = {"y", "mean", "rstd"},
      .infer = slab_infer,
      .cost = CostOf(slab_infer, [](const Metas& in, const Metas&) { return 4.0 * Numel(in[0]); }),
      .gradient = Rule("group_norm_slab_backward",
                       {OutGrad(0), In(0), In(1), In(2), Out(1), Out(2)}, {0, 1, 2, 3}),
  }));
  const InferFn slab_backward_infer = [slab_infer](const Metas& in,
                                                   const Attrs& attrs) -> Result<Metas> {
    // dy, x, stats, weight, mean, rstd.
    TESSERA_ASSIGN_OR_RETURN(Metas forward, slab_infer({in[1], in[2], in[3], in[3]}, attrs));
    TESSERA_RETURN_IF_ERROR(CheckMeta("dy", in[0], in[1].shape));
    TESSERA_RETURN_IF_ERROR(CheckMeta("mean", in[4], forward[1].shape));
    TESSERA_RETURN_IF_ERROR(CheckMeta("rstd", in[5], forward[2].shape));
    return Metas{in[1], in[2], in[3], in[3]};
  };
  return r.AddOp(OpDef{
      .name = "group_norm_slab_backward",
      .doc = "dx (this slab's own term), dstats (the gradients of the volume's sum and sum of "
             "squares, in both parts of every block: group_norm_stats_backward adds their term "
             "to every slab's dx), dweight, dbias (this slab's sums)",
      .input_names = {"dy", "x", "stats", "weight", "mean", "rstd"},
      .output_names = {"dx", "dstats", "dweight", "dbias"},
      .infer = slab_backward_infer,
      .cost = CostOf(slab_backward_infer,
                     [](const Metas& in, const Metas&) { return 8.0 * Numel(in[0]); }),
  });
}

// ---- elementwise activations and channel concatenation ----

Status AddActivationOps(VolumeOpRegistry& r) {
  const InferFn forward_infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckActivation("x", in[0]));
    return Metas{in[0]};
  };
  const InferFn backward_infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckActivation("x", in[1]));
    TESSERA_RETURN_IF_ERROR(CheckMeta("dy", in[0], in[1].shape, in[1].dtype));
    return Metas{in[1]};
  };
  struct Activation {
    const char* name;
    const char* doc;
    double flops;
  };
  for (const Activation& a :
       {Activation{"relu", "y = max(x, 0)", 1.0}, Activation{"silu", "y = x * sigmoid(x)", 6.0},
        Activation{"leaky_relu", "y = x if x > 0 else 0.01 x (nnU-Net's slope)", 1.0}}) {
    const std::string name = a.name;
    const double flops = a.flops;
    TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
        .name = name + "_forward",
        .doc = a.doc,
        .input_names = {"x"},
        .output_names = {"y"},
        .infer = forward_infer,
        .cost = CostOf(forward_infer,
                       [flops](const Metas& in, const Metas&) { return flops * Numel(in[0]); }),
        .gradient = Rule(name + "_backward", {OutGrad(0), In(0)}, {0}),
    }));
    TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
        .name = name + "_backward",
        .doc = "dx = dy * " + name + "'(x)",
        .input_names = {"dy", "x"},
        .output_names = {"dx"},
        .infer = backward_infer,
        .cost =
            CostOf(backward_infer,
                   [flops](const Metas& in, const Metas&) { return (flops + 2.0) * Numel(in[0]); }),
    }));
  }
  return Status::Ok();
}

// Whether a [N, Ca, *] and b [N, Cb, *] have the same rank (at least 2) and agree everywhere but
// dimension 1.
bool SameExceptChannels(const Shape& a, const Shape& b) {
  bool same = a.rank() >= 2 && a.rank() == b.rank();
  for (int axis = 0; same && axis < a.rank(); ++axis) same = axis == 1 || a[axis] == b[axis];
  return same;
}

Status CheckConcatenable(const TensorMeta& a, const TensorMeta& b) {
  TESSERA_RETURN_IF_ERROR(CheckActivation("a", a));
  if (b.dtype != a.dtype) {
    return InvalidArgument("input 'b' is {} but 'a' is {}: both must have one dtype", b.ToString(),
                           a.ToString());
  }
  if (!SameExceptChannels(a.shape, b.shape)) {
    return InvalidArgument(
        "inputs 'a' {} and 'b' {} cannot be concatenated along dimension 1: they must be "
        "[N, Ca, ...] and [N, Cb, ...] with the same other dimensions",
        a.shape.ToString(), b.shape.ToString());
  }
  return Status::Ok();
}

Shape WithChannels(const Shape& shape, int64_t channels) {
  std::vector<int64_t> dims = shape.dims();
  dims[1] = channels;
  return Shape(std::move(dims));
}

Status AddConcatOps(VolumeOpRegistry& r) {
  const InferFn forward_infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckConcatenable(in[0], in[1]));
    return Metas{ActivationLike(in[0], WithChannels(in[0].shape, in[0].shape[1] + in[1].shape[1]))};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "concat_forward",
      .doc = "out = [a, b] along the channel dimension 1 (U-Net skip connections)",
      .input_names = {"a", "b"},
      .output_names = {"out"},
      .infer = forward_infer,
      .cost = CostOf(forward_infer, [](const Metas&, const Metas&) { return 0.0; }),
      .gradient = Rule("concat_backward", {OutGrad(0), In(0)}, {0, 1}),
  }));
  const InferFn backward_infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckActivation("dout", in[0]));
    if (in[1].dtype != in[0].dtype) {
      return InvalidArgument("input 'a' is {} but 'dout' is {}: both must have one dtype",
                             in[1].ToString(), in[0].ToString());
    }
    // a is dout's first channels, and at least one is left for b.
    if (!SameExceptChannels(in[0].shape, in[1].shape) || in[1].shape[1] >= in[0].shape[1]) {
      return InvalidArgument(
          "input 'dout' has shape {} but input 'a' {} is not its first channels with at least "
          "one left for b",
          in[0].shape.ToString(), in[1].shape.ToString());
    }
    return Metas{in[1],
                 ActivationLike(in[1], WithChannels(in[0].shape, in[0].shape[1] - in[1].shape[1]))};
  };
  return r.AddOp(OpDef{
      .name = "concat_backward",
      .doc = "da, db: dout split along dimension 1 (a is read for its shape only)",
      .input_names = {"dout", "a"},
      .output_names = {"da", "db"},
      .infer = backward_infer,
      .cost = CostOf(backward_infer, [](const Metas&, const Metas&) { return 0.0; }),
  });
}

// ---- casts between activation dtypes ----

Result<DType> CastTarget(const Attrs& attrs) {
  TESSERA_ASSIGN_OR_RETURN(std::string name, attrs.GetString("dtype"));
  if (name == "f32") return DType::kF32;
  if (name == "bf16") return DType::kBF16;
  return InvalidArgument("attribute 'dtype' of cast is '{}' but must be f32 or bf16", name);
}

Status AddCastOps(OpRegistry& r) {
  const InferFn forward_infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(const DType dtype, CastTarget(attrs));
    TESSERA_RETURN_IF_ERROR(CheckActivation("x", in[0]));
    return Metas{TensorMeta{in[0].shape, dtype, in[0].device}};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "cast_forward",
      .doc = "y = x in attribute dtype's type (f32 or bf16; to bf16 rounds to nearest even): a "
             "volume's voxels into the activations' type",
      .input_names = {"x"},
      .output_names = {"y"},
      .infer = forward_infer,
      .cost = CostOf(forward_infer, [](const Metas& in, const Metas&) { return Numel(in[0]); }),
      .gradient = Rule("cast_backward", {OutGrad(0), In(0)}, {0}),
  }));
  const InferFn backward_infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckActivation("dy", in[0]));
    TESSERA_RETURN_IF_ERROR(CheckActivation("x", in[1]));
    if (in[0].shape != in[1].shape) {
      return InvalidArgument("input 'dy' has shape {} but x is {}", in[0].shape.ToString(),
                             in[1].ToString());
    }
    return Metas{in[1]};
  };
  return r.AddOp(OpDef{
      .name = "cast_backward",
      .doc = "dx = dy in x's type (x is read for its type only)",
      .input_names = {"dy", "x"},
      .output_names = {"dx"},
      .infer = backward_infer,
      .cost = CostOf(backward_infer, [](const Metas& in, const Metas&) { return Numel(in[0]); }),
  });
}

// ---- segmentation loss and metric ----

// logits [N, C, *] (f32 or bf16) and targets i32 [N, *].
Status CheckSegmentation(const char* op, const TensorMeta& logits, const TensorMeta& targets) {
  TESSERA_RETURN_IF_ERROR(CheckActivation("logits", logits));
  if (logits.shape.rank() < 2) {
    return InvalidArgument("input 'logits' has shape {} but {} needs [N, C, ...]",
                           logits.shape.ToString(), op);
  }
  std::vector<int64_t> dims = logits.shape.dims();
  dims.erase(dims.begin() + 1);
  return CheckMeta("targets", targets, Shape(std::move(dims)), DType::kI32);
}

Status AddSegmentationOps(VolumeOpRegistry& r) {
  const InferFn loss_infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    if (attrs.Has("grad_scale")) TESSERA_RETURN_IF_ERROR(attrs.GetFloat("grad_scale").status());
    if (attrs.Has("weight")) {
      TESSERA_ASSIGN_OR_RETURN(const double weight, attrs.GetFloat("weight"));
      if (!std::isfinite(weight) || weight < 0) {
        return InvalidArgument(
            "attribute 'weight' of voxel_cross_entropy must be finite and >= 0, got {}", weight);
      }
    }
    TESSERA_RETURN_IF_ERROR(CheckSegmentation("voxel_cross_entropy", in[0], in[1]));
    return Metas{F32Like(in[0], Shape{}), in[0]};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "voxel_cross_entropy",
      .doc = "mean over voxels of the cross-entropy of softmax over channels against targets, "
             "times attribute weight (default 1: a term of a weighted sum of losses, e.g. deep "
             "supervision's), and its gradient (times weight and grad_scale) computed in place "
             "over the logits",
      .input_names = {"logits", "targets"},
      .output_names = {"loss", "dlogits"},
      .in_place = {{0, 1}},
      .infer = loss_infer,
      .cost = CostOf(loss_infer, [](const Metas& in, const Metas&) { return 8.0 * Numel(in[0]); }),
      // As softmax_cross_entropy: the gradient is dlogits (computed in the forward) scaled by
      // the loss's own gradient, so a model API loss layer can end in this op.
      .gradient = Rule("loss_gradient", {OutGrad(0), Out(1)}, {0}),
  }));
  const InferFn dice_infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckSegmentation("dice_score", in[0], in[1]));
    if (in[0].shape[1] < 2) {
      return InvalidArgument(
          "input 'logits' has shape {} but dice_score needs C >= 2 (class 0 "
          "is background)",
          in[0].shape.ToString());
    }
    return Metas{F32Like(in[0], Shape{})};
  };
  // Label maps at a coarser level (deep supervision's targets): nearest-exact sampling, the voxel
  // at factor * k + factor / 2 along each axis (what PyTorch's interpolate(mode="nearest-exact")
  // picks for a scale of 1 / factor).
  const InferFn downsample_infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(const int64_t factor, IntAttr(attrs, "factor", 2, 1));
    const TensorMeta& targets = in[0];
    if (targets.dtype != DType::kI32 || targets.shape.rank() != 4) {
      return InvalidArgument("input 'targets' is {} but downsample_labels needs i32 [N, D, H, W]",
                             targets.ToString());
    }
    std::vector<int64_t> dims = targets.shape.dims();
    for (size_t axis = 1; axis < dims.size(); ++axis) {
      if (dims[axis] % factor != 0) {
        return InvalidArgument(
            "input 'targets' has shape {} but its spatial extents must be multiples of factor {}",
            targets.shape.ToString(), factor);
      }
      dims[axis] /= factor;
    }
    return Metas{TensorMeta{Shape(std::move(dims)), DType::kI32, targets.device}};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "downsample_labels",
      .doc = "a label map [N, D, H, W] at 1/factor of each extent (attribute factor, default 2): "
             "the voxel at factor * k + factor / 2 along each axis (nearest-exact)",
      .input_names = {"targets"},
      .output_names = {"coarse"},
      .infer = downsample_infer,
      .cost = CostOf(downsample_infer, [](const Metas&, const Metas&) { return 0.0; }),
  }));
  return r.AddOp(OpDef{
      .name = "dice_score",
      .doc = "hard Dice of argmax over channels against targets: per foreground class 1..C-1 over "
             "the whole batch 2|P and T| / (|P| + |T|) (1 when both are empty), averaged",
      .input_names = {"logits", "targets"},
      .output_names = {"score"},
      .infer = dice_infer,
      .cost = CostOf(dice_infer, [](const Metas& in, const Metas&) { return 2.0 * Numel(in[0]); }),
  });
}

}  // namespace

Status RegisterVolumeOps(OpRegistry& registry) {
  VolumeOpRegistry volume(registry);
  TESSERA_RETURN_IF_ERROR(AddConvOps(volume, ConvVariant{}));
  TESSERA_RETURN_IF_ERROR(AddConvOps(volume, ConvVariant{.bias = false}));
  TESSERA_RETURN_IF_ERROR(AddConvOps(volume, ConvVariant{.transposed = true}));
  TESSERA_RETURN_IF_ERROR(AddChannelBiasOps(volume));
  TESSERA_RETURN_IF_ERROR(AddResamplingOps(volume));
  TESSERA_RETURN_IF_ERROR(AddGroupNormOps(volume));
  TESSERA_RETURN_IF_ERROR(AddHaloOps(volume));
  TESSERA_RETURN_IF_ERROR(AddSlabNormOps(volume));
  TESSERA_RETURN_IF_ERROR(AddActivationOps(volume));
  TESSERA_RETURN_IF_ERROR(AddConcatOps(volume));
  TESSERA_RETURN_IF_ERROR(AddCastOps(registry));
  return AddSegmentationOps(volume);
}

}  // namespace tessera

// The volume ops' kCuda kernels (ops/cuda/cuda_op_kernels.h: RegisterVolumeCudaKernels), and
// loss_gradient, which their loss's gradient rule runs: the
// launchers of volume_kernels.h bound to the registry with the same inputs, outputs and attributes
// as the CPU kernels (ops/cpu/volume_registration.cc), for f32 or bf16 activations (parameters,
// their gradients and norm statistics f32; a bf16 convolution's weights are cast to bf16 scratch
// and its weight gradient cast back).
//
// Convolutions go through the context's cuDNN (CudaContext::Convolutions), one call at a time.
// A target outside [0, classes) in the loss or the Dice score is found by reading the kernel's
// report back (a wait on the stream, once per call: both run once per step); pooling indices are
// the forward's own and are not checked on the GPU.
#include <algorithm>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "ops/cuda/cuda_context.h"
#include "ops/cuda/cuda_op_kernels.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/volume_kernels.h"
#include "ops/volume_ops.h"

namespace tessera::cuda {

namespace {

using Tensors = std::vector<Tensor>;
using VolumeKernelFn = Status (*)(CudaContext& cuda, const Tensors& in, const Tensors& out,
                                  const Attrs& attrs);

// The CudaContext of a kernel's context, made current on this thread.
Result<CudaContext*> ContextOf(const KernelContext& context) {
  if (context.device == nullptr || context.device->device().is_cpu()) {
    return Infeasible("a GPU task ran in a process that opened no GPU (ExecutorOptions::device)");
  }
  auto* cuda = static_cast<CudaContext*>(context.device->native());
  TESSERA_RETURN_IF_ERROR(cuda->Activate());
  return cuda;
}

Status RegisterVolume(OpRegistry& r, std::string_view op, VolumeKernelFn body) {
  return r.AddKernel(op, DeviceKind::kCuda,
                     [body](const KernelContext& context, const Tensors& in, const Tensors& out,
                            const Attrs& attrs) -> Status {
                       TESSERA_ASSIGN_OR_RETURN(CudaContext * cuda, ContextOf(context));
                       return body(*cuda, in, out, attrs);
                     });
}

bool IsBf16(const Tensor& t) { return t.dtype() == DType::kBF16; }
float* F(const Tensor& t) { return t.data<float>(); }
bf16* B(const Tensor& t) { return static_cast<bf16*>(t.raw_data()); }
const int32_t* I(const Tensor& t) { return t.data<int32_t>(); }

// Activations are f32 or bf16, all of one call's alike.
Status CheckActivations(std::initializer_list<const Tensor*> tensors, std::string_view op) {
  const DType first = (*tensors.begin())->dtype();
  for (const Tensor* t : tensors) {
    if ((t->dtype() != DType::kF32 && t->dtype() != DType::kBF16) || t->dtype() != first) {
      return InvalidArgument("{} on the GPU takes f32 or bf16 activations, all alike; got {}", op,
                             t->meta().ToString());
    }
  }
  return Status::Ok();
}

int64_t Spatial(const Tensor& t) {
  const int64_t planes = t.shape()[0] * t.shape()[1];
  return planes == 0 ? 0 : t.numel() / planes;
}
int64_t PerSample(const Tensor& t) { return t.shape()[0] == 0 ? 0 : t.numel() / t.shape()[0]; }

// The convolution from `volume` [N, Cin, D, H, W] to `grid` [N, Cout, Do, Ho, Wo] with a weight
// [Cout, Cin, kD, kH, kW] (as the CPU's Geometry).
VolumeConvShape ConvShape(const Tensor& volume, const Tensor& weight, const Tensor& grid,
                          const Attrs& attrs) {
  const Shape& v = volume.shape();
  const Shape& w = weight.shape();
  const Shape& y = grid.shape();
  return {.batch = v[0],
          .in_channels = v[1],
          .in_d = v[2],
          .in_h = v[3],
          .in_w = v[4],
          .out_channels = y[1],
          .out_d = y[2],
          .out_h = y[3],
          .out_w = y[4],
          .kd = w[2],
          .kh = w[3],
          .kw = w[4],
          .stride = attrs.GetInt("stride", 1),
          .padding = attrs.GetInt("padding", 0),
          .padding_d = DepthPadding(attrs)};
}

// A bf16 copy of an f32 weight, in scratch that lives as long as the result.
Result<std::shared_ptr<Buffer>> Bf16Weight(CudaContext& cuda, const Tensor& weight) {
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> copy,
                           cuda.Scratch(weight.numel() * static_cast<int64_t>(sizeof(bf16))));
  TESSERA_RETURN_IF_ERROR(
      CastF32ToBf16(static_cast<bf16*>(copy->data()), F(weight), weight.numel(), cuda.stream()));
  return copy;
}

// y = conv(x, w) (+ bias) from `volume` x to `grid` y.
Status ConvForward(CudaContext& cuda, const Tensor& y, const Tensor& x, const Tensor& weight,
                   const Tensor* bias, const VolumeConvShape& s) {
  TESSERA_RETURN_IF_ERROR(CheckActivations({&y, &x}, "conv3d"));
  TESSERA_ASSIGN_OR_RETURN(CudnnConvolutions * conv, cuda.Convolutions());
  if (IsBf16(x)) {
    TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> w, Bf16Weight(cuda, weight));
    TESSERA_RETURN_IF_ERROR(conv->Forward(B(y), B(x), static_cast<bf16*>(w->data()), s));
    if (bias == nullptr) return Status::Ok();
    return ChannelBiasAdd(B(y), B(y), F(*bias), s.batch, s.out_channels,
                          s.out_d * s.out_h * s.out_w, cuda.stream());
  }
  TESSERA_RETURN_IF_ERROR(conv->Forward(F(y), F(x), F(weight), s));
  if (bias == nullptr) return Status::Ok();
  return ChannelBiasAdd(F(y), F(y), F(*bias), s.batch, s.out_channels, s.out_d * s.out_h * s.out_w,
                        cuda.stream());
}

// x = conv^T(y, w) (+ bias on x's channels): from `grid` y back to `volume` x.
Status ConvBackwardData(CudaContext& cuda, const Tensor& x, const Tensor& y, const Tensor& weight,
                        const Tensor* bias, const VolumeConvShape& s) {
  TESSERA_RETURN_IF_ERROR(CheckActivations({&y, &x}, "conv3d"));
  TESSERA_ASSIGN_OR_RETURN(CudnnConvolutions * conv, cuda.Convolutions());
  const int64_t in_volume = s.in_d * s.in_h * s.in_w;
  if (IsBf16(x)) {
    TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> w, Bf16Weight(cuda, weight));
    TESSERA_RETURN_IF_ERROR(conv->BackwardData(B(x), B(y), static_cast<bf16*>(w->data()), s));
    if (bias == nullptr) return Status::Ok();
    return ChannelBiasAdd(B(x), B(x), F(*bias), s.batch, s.in_channels, in_volume, cuda.stream());
  }
  TESSERA_RETURN_IF_ERROR(conv->BackwardData(F(x), F(y), F(weight), s));
  if (bias == nullptr) return Status::Ok();
  return ChannelBiasAdd(F(x), F(x), F(*bias), s.batch, s.in_channels, in_volume, cuda.stream());
}

// dweight (f32) = d<dy, conv(x, w)>/dw, from `volume` x and `grid` dy.
Status ConvBackwardFilter(CudaContext& cuda, const Tensor& dweight, const Tensor& x,
                          const Tensor& dy, const VolumeConvShape& s) {
  TESSERA_RETURN_IF_ERROR(CheckActivations({&dy, &x}, "conv3d"));
  TESSERA_ASSIGN_OR_RETURN(CudnnConvolutions * conv, cuda.Convolutions());
  if (!IsBf16(x)) return conv->BackwardFilter(F(dweight), F(x), F(dy), s);
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> dw,
                           cuda.Scratch(dweight.numel() * static_cast<int64_t>(sizeof(bf16))));
  TESSERA_RETURN_IF_ERROR(conv->BackwardFilter(static_cast<bf16*>(dw->data()), B(x), B(dy), s));
  return CastBf16ToF32(F(dweight), static_cast<bf16*>(dw->data()), dweight.numel(), cuda.stream());
}

Status Sums(CudaContext& cuda, const Tensor& out, const Tensor& t, int64_t batch, int64_t channels,
            int64_t spatial) {
  return IsBf16(t) ? ChannelSums(F(out), B(t), batch, channels, spatial, cuda.stream())
                   : ChannelSums(F(out), F(t), batch, channels, spatial, cuda.stream());
}

// The convolutions' backward halves; in: dy, x, weight (as the CPU's).
Status Conv3dDx(CudaContext& cuda, const Tensors& in, const Tensor& dx, const Attrs& attrs) {
  return ConvBackwardData(cuda, dx, in[0], in[2], nullptr, ConvShape(in[1], in[2], in[0], attrs));
}
Status Conv3dDw(CudaContext& cuda, const Tensors& in, const Tensor& dweight, const Tensor* dbias,
                const Attrs& attrs) {
  const VolumeConvShape s = ConvShape(in[1], in[2], in[0], attrs);
  TESSERA_RETURN_IF_ERROR(ConvBackwardFilter(cuda, dweight, in[1], in[0], s));
  if (dbias == nullptr) return Status::Ok();
  return Sums(cuda, *dbias, in[0], s.batch, s.out_channels, s.out_d * s.out_h * s.out_w);
}
Status ConvTranspose3dDx(CudaContext& cuda, const Tensors& in, const Tensor& dx,
                         const Attrs& attrs) {
  return ConvForward(cuda, dx, in[0], in[2], nullptr, ConvShape(in[0], in[2], in[1], attrs));
}
Status ConvTranspose3dDw(CudaContext& cuda, const Tensors& in, const Tensor& dweight,
                         const Tensor& dbias, const Attrs& attrs) {
  const VolumeConvShape s = ConvShape(in[0], in[2], in[1], attrs);
  TESSERA_RETURN_IF_ERROR(ConvBackwardFilter(cuda, dweight, in[0], in[1], s));
  return Sums(cuda, dbias, in[0], s.batch, s.in_channels, s.in_d * s.in_h * s.in_w);
}

// A device int32 set to -1, for a kernel's bad-index report, and reading it back.
Result<std::shared_ptr<Buffer>> BadIndex(CudaContext& cuda) {
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> flag, cuda.Scratch(sizeof(int32_t)));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flag->data(), 0xFF, sizeof(int32_t), cuda.stream()));
  return flag;
}
Status CheckTargets(CudaContext& cuda, const Buffer& flag, const Tensor& targets, int64_t classes,
                    std::string_view op) {
  int32_t bad = -1;
  TESSERA_RETURN_IF_ERROR(cuda.Copy(&bad, Device::Cpu(), flag.data(), cuda.device(), sizeof(bad)));
  if (bad < 0) return Status::Ok();
  int32_t value = 0;
  TESSERA_RETURN_IF_ERROR(
      cuda.Copy(&value, Device::Cpu(), I(targets) + bad, cuda.device(), sizeof(value)));
  return InvalidArgument("{}: target {} at voxel {} is outside [0, {})", op, value, bad, classes);
}

Status RegisterConvolutions(OpRegistry& r) {
  for (const char* op : {"conv3d_forward", "conv3d_no_bias_forward"}) {
    TESSERA_RETURN_IF_ERROR(RegisterVolume(
        r, op, [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
          return ConvForward(cuda, out[0], in[0], in[1], in.size() > 2 ? &in[2] : nullptr,
                             ConvShape(in[0], in[1], out[0], attrs));
        }));
  }
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "conv3d_backward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        TESSERA_RETURN_IF_ERROR(Conv3dDx(cuda, in, out[0], attrs));
        return Conv3dDw(cuda, in, out[1], &out[2], attrs);
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "conv3d_no_bias_backward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        TESSERA_RETURN_IF_ERROR(Conv3dDx(cuda, in, out[0], attrs));
        return Conv3dDw(cuda, in, out[1], nullptr, attrs);
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "conv3d_no_bias_backward_weight",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        return Conv3dDw(cuda, in, out[0], nullptr, attrs);
      }));
  TESSERA_RETURN_IF_ERROR(
      RegisterVolume(r, "conv3d_backward_input",
                     [](CudaContext& cuda, const Tensors& in, const Tensors& out,
                        const Attrs& attrs) { return Conv3dDx(cuda, in, out[0], attrs); }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "conv3d_backward_weight",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        return Conv3dDw(cuda, in, out[0], &out[1], attrs);
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "conv_transpose3d_forward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        // y = conv^T(x) + bias: the convolution runs from y's shape to x's.
        return ConvBackwardData(cuda, out[0], in[0], in[1], &in[2],
                                ConvShape(out[0], in[1], in[0], attrs));
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "conv_transpose3d_backward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        TESSERA_RETURN_IF_ERROR(ConvTranspose3dDx(cuda, in, out[0], attrs));
        return ConvTranspose3dDw(cuda, in, out[1], out[2], attrs);
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "conv_transpose3d_backward_input",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        return ConvTranspose3dDx(cuda, in, out[0], attrs);
      }));
  return RegisterVolume(
      r, "conv_transpose3d_backward_weight",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        return ConvTranspose3dDw(cuda, in, out[0], out[1], attrs);
      });
}

Status RegisterNormsAndActivations(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "group_norm_forward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        TESSERA_RETURN_IF_ERROR(CheckActivations({&in[0], &out[0]}, "group_norm_forward"));
        const Shape& x = in[0].shape();
        const int64_t groups = attrs.GetInt("groups", 1);
        const float eps = static_cast<float>(attrs.GetFloat("eps", 1e-5));
        if (IsBf16(in[0])) {
          return GroupNormForward(B(out[0]), F(out[1]), F(out[2]), B(in[0]), F(in[1]), F(in[2]),
                                  x[0], x[1], Spatial(in[0]), groups, eps, cuda.stream());
        }
        return GroupNormForward(F(out[0]), F(out[1]), F(out[2]), F(in[0]), F(in[1]), F(in[2]), x[0],
                                x[1], Spatial(in[0]), groups, eps, cuda.stream());
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "group_norm_backward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        // in: dy, x, weight, mean, rstd; out: dx, dweight, dbias.
        TESSERA_RETURN_IF_ERROR(CheckActivations({&in[0], &in[1], &out[0]}, "group_norm_backward"));
        const Shape& x = in[1].shape();
        const int64_t groups = attrs.GetInt("groups", 1);
        TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> scratch,
                                 cuda.Scratch(GroupNormBackwardScratch(x[0], x[1], groups) *
                                              static_cast<int64_t>(sizeof(float))));
        float* s = static_cast<float*>(scratch->data());
        if (IsBf16(in[0])) {
          return GroupNormBackward(B(out[0]), F(out[1]), F(out[2]), s, B(in[0]), B(in[1]), F(in[2]),
                                   F(in[3]), F(in[4]), x[0], x[1], Spatial(in[1]), groups,
                                   cuda.stream());
        }
        return GroupNormBackward(F(out[0]), F(out[1]), F(out[2]), s, F(in[0]), F(in[1]), F(in[2]),
                                 F(in[3]), F(in[4]), x[0], x[1], Spatial(in[1]), groups,
                                 cuda.stream());
      }));
  struct Activation {
    const char* name;
    VolumeActivation kind;
  };
  for (const Activation& a :
       {Activation{"relu", VolumeActivation::kRelu}, Activation{"silu", VolumeActivation::kSilu},
        Activation{"leaky_relu", VolumeActivation::kLeakyRelu}}) {
    const std::string name = a.name;
    // One registration per kind, the kind captured.
    const auto forward = [](VolumeActivation kind) {
      return [kind](const KernelContext& context, const Tensors& in, const Tensors& out,
                    const Attrs&) -> Status {
        TESSERA_ASSIGN_OR_RETURN(CudaContext * cuda, ContextOf(context));
        TESSERA_RETURN_IF_ERROR(CheckActivations({&in[0], &out[0]}, "activation"));
        return IsBf16(in[0])
                   ? ActivationForward(kind, B(out[0]), B(in[0]), in[0].numel(), cuda->stream())
                   : ActivationForward(kind, F(out[0]), F(in[0]), in[0].numel(), cuda->stream());
      };
    };
    const auto backward = [](VolumeActivation kind) {
      return [kind](const KernelContext& context, const Tensors& in, const Tensors& out,
                    const Attrs&) -> Status {
        // in: dy, x.
        TESSERA_ASSIGN_OR_RETURN(CudaContext * cuda, ContextOf(context));
        TESSERA_RETURN_IF_ERROR(CheckActivations({&in[0], &in[1], &out[0]}, "activation"));
        return IsBf16(in[0]) ? ActivationBackward(kind, B(out[0]), B(in[0]), B(in[1]),
                                                  in[0].numel(), cuda->stream())
                             : ActivationBackward(kind, F(out[0]), F(in[0]), F(in[1]),
                                                  in[0].numel(), cuda->stream());
      };
    };
    TESSERA_RETURN_IF_ERROR(r.AddKernel(name + "_forward", DeviceKind::kCuda, forward(a.kind)));
    TESSERA_RETURN_IF_ERROR(r.AddKernel(name + "_backward", DeviceKind::kCuda, backward(a.kind)));
  }
  return Status::Ok();
}

Status RegisterTheRest(OpRegistry& r) {
  // The model API's loss layers end in it (voxel_cross_entropy's gradient rule): dx = dlogits *
  // dloss, dloss a scalar on the device.
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "loss_gradient",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs&) {
        TESSERA_RETURN_IF_ERROR(CheckActivations({&in[1], &out[0]}, "loss_gradient"));
        return IsBf16(in[1])
                   ? ScaleByScalar(B(out[0]), B(in[1]), F(in[0]), in[1].numel(), cuda.stream())
                   : ScaleByScalar(F(out[0]), F(in[1]), F(in[0]), in[1].numel(), cuda.stream());
      }));
  // cast_forward and cast_backward (in: dy, x, read for its type only): f32 <-> bf16.
  const VolumeKernelFn cast = [](CudaContext& cuda, const Tensors& in, const Tensors& out,
                                 const Attrs&) -> Status {
    TESSERA_RETURN_IF_ERROR(CheckActivations({&in[0]}, "cast"));
    TESSERA_RETURN_IF_ERROR(CheckActivations({&out[0]}, "cast"));
    if (in[0].dtype() == out[0].dtype()) {
      TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out[0].raw_data(), in[0].raw_data(),
                                                   static_cast<size_t>(in[0].bytes()),
                                                   cudaMemcpyDeviceToDevice, cuda.stream()));
      return Status::Ok();
    }
    return IsBf16(out[0]) ? CastF32ToBf16(B(out[0]), F(in[0]), in[0].numel(), cuda.stream())
                          : CastBf16ToF32(F(out[0]), B(in[0]), in[0].numel(), cuda.stream());
  };
  TESSERA_RETURN_IF_ERROR(RegisterVolume(r, "cast_forward", cast));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(r, "cast_backward", cast));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "channel_bias_add_forward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs&) {
        const Shape& x = in[0].shape();
        TESSERA_RETURN_IF_ERROR(CheckActivations({&in[0], &out[0]}, "channel_bias_add"));
        return IsBf16(in[0]) ? ChannelBiasAdd(B(out[0]), B(in[0]), F(in[1]), x[0], x[1],
                                              Spatial(in[0]), cuda.stream())
                             : ChannelBiasAdd(F(out[0]), F(in[0]), F(in[1]), x[0], x[1],
                                              Spatial(in[0]), cuda.stream());
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "channel_bias_add_backward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs&) {
        const Shape& dy = in[0].shape();
        TESSERA_RETURN_IF_ERROR(cuda.Copy(out[0].raw_data(), out[0].meta().device, in[0].raw_data(),
                                          in[0].meta().device, in[0].bytes()));
        return Sums(cuda, out[1], in[0], dy[0], dy[1], Spatial(in[0]));
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "concat_forward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs&) {
        TESSERA_RETURN_IF_ERROR(CheckActivations({&in[0], &in[1], &out[0]}, "concat"));
        const int64_t outer = in[0].shape()[0];
        return IsBf16(in[0]) ? ConcatForward(B(out[0]), B(in[0]), B(in[1]), outer, PerSample(in[0]),
                                             PerSample(in[1]), cuda.stream())
                             : ConcatForward(F(out[0]), F(in[0]), F(in[1]), outer, PerSample(in[0]),
                                             PerSample(in[1]), cuda.stream());
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "concat_backward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs&) {
        TESSERA_RETURN_IF_ERROR(CheckActivations({&in[0], &out[0], &out[1]}, "concat"));
        const int64_t outer = out[0].shape()[0];
        return IsBf16(in[0]) ? ConcatBackward(B(out[0]), B(out[1]), B(in[0]), outer,
                                              PerSample(out[0]), PerSample(out[1]), cuda.stream())
                             : ConcatBackward(F(out[0]), F(out[1]), F(in[0]), outer,
                                              PerSample(out[0]), PerSample(out[1]), cuda.stream());
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "upsample_nearest3d_forward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        TESSERA_RETURN_IF_ERROR(CheckActivations({&in[0], &out[0]}, "upsample_nearest3d"));
        const Shape& x = in[0].shape();
        const int64_t scale = attrs.GetInt("scale", 2);
        return IsBf16(in[0]) ? UpsampleNearest3dForward(B(out[0]), B(in[0]), x[0] * x[1], x[2],
                                                        x[3], x[4], scale, cuda.stream())
                             : UpsampleNearest3dForward(F(out[0]), F(in[0]), x[0] * x[1], x[2],
                                                        x[3], x[4], scale, cuda.stream());
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "upsample_nearest3d_backward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        TESSERA_RETURN_IF_ERROR(CheckActivations({&in[0], &out[0]}, "upsample_nearest3d"));
        const Shape& x = out[0].shape();
        const int64_t scale = attrs.GetInt("scale", 2);
        return IsBf16(in[0]) ? UpsampleNearest3dBackward(B(out[0]), B(in[0]), x[0] * x[1], x[2],
                                                         x[3], x[4], scale, cuda.stream())
                             : UpsampleNearest3dBackward(F(out[0]), F(in[0]), x[0] * x[1], x[2],
                                                         x[3], x[4], scale, cuda.stream());
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "max_pool3d_forward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        TESSERA_RETURN_IF_ERROR(CheckActivations({&in[0], &out[0]}, "max_pool3d"));
        const Shape& x = in[0].shape();
        const int64_t k = attrs.GetInt("kernel", 2);
        int32_t* indices = out[1].data<int32_t>();
        return IsBf16(in[0]) ? MaxPool3dForward(B(out[0]), indices, B(in[0]), x[0] * x[1], x[2],
                                                x[3], x[4], k, cuda.stream())
                             : MaxPool3dForward(F(out[0]), indices, F(in[0]), x[0] * x[1], x[2],
                                                x[3], x[4], k, cuda.stream());
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "max_pool3d_backward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs&) {
        // in: dy, x, indices.
        TESSERA_RETURN_IF_ERROR(CheckActivations({&in[0], &out[0]}, "max_pool3d"));
        TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> flag, BadIndex(cuda));
        const int64_t planes = in[1].shape()[0] * in[1].shape()[1];
        auto* bad = static_cast<int32_t*>(flag->data());
        return IsBf16(in[0]) ? MaxPool3dBackward(B(out[0]), bad, B(in[0]), I(in[2]), planes,
                                                 Spatial(in[1]), Spatial(in[0]), cuda.stream())
                             : MaxPool3dBackward(F(out[0]), bad, F(in[0]), I(in[2]), planes,
                                                 Spatial(in[1]), Spatial(in[0]), cuda.stream());
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "voxel_cross_entropy",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) -> Status {
        // out[1] holds the logits (in place) and gets their gradient; out[0] the loss.
        TESSERA_RETURN_IF_ERROR(CheckActivations({&out[1]}, "voxel_cross_entropy"));
        const Shape& logits = out[1].shape();
        const int64_t spatial = Spatial(out[1]);
        TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> scratch,
                                 cuda.Scratch(VoxelCrossEntropyScratch(logits[0], spatial) *
                                              static_cast<int64_t>(sizeof(float))));
        TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> flag, BadIndex(cuda));
        auto* bad = static_cast<int32_t*>(flag->data());
        const float grad_scale = static_cast<float>(attrs.GetFloat("grad_scale", 1.0));
        const float weight = static_cast<float>(attrs.GetFloat("weight", 1.0));
        auto* partials = static_cast<float*>(scratch->data());
        if (IsBf16(out[1])) {
          TESSERA_RETURN_IF_ERROR(VoxelCrossEntropy(F(out[0]), B(out[1]), partials, bad, B(out[1]),
                                                    I(in[1]), logits[0], logits[1], spatial,
                                                    grad_scale, cuda.stream(), weight));
        } else {
          TESSERA_RETURN_IF_ERROR(VoxelCrossEntropy(F(out[0]), F(out[1]), partials, bad, F(out[1]),
                                                    I(in[1]), logits[0], logits[1], spatial,
                                                    grad_scale, cuda.stream(), weight));
        }
        return CheckTargets(cuda, *flag, in[1], logits[1], "voxel_cross_entropy");
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "downsample_labels",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        const Shape& fine = in[0].shape();
        return DownsampleLabels(out[0].data<int32_t>(), I(in[0]), fine[0], fine[1], fine[2],
                                fine[3], attrs.GetInt("factor", 2), cuda.stream());
      }));
  // A loss layer's sum of terms (deep supervision's): f32, as the losses are.
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "add_forward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs&) -> Status {
        if (in[0].dtype() != DType::kF32) {
          return InvalidArgument("add_forward on a GPU adds f32 tensors, got {}",
                                 DTypeName(in[0].dtype()));
        }
        return AddF32(F(out[0]), F(in[0]), F(in[1]), out[0].numel(), cuda.stream());
      }));
  TESSERA_RETURN_IF_ERROR(RegisterVolume(
      r, "add_backward",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs&) -> Status {
        for (const Tensor& d : out) {
          TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d.raw_data(), in[0].raw_data(),
                                                       static_cast<size_t>(in[0].bytes()),
                                                       cudaMemcpyDeviceToDevice, cuda.stream()));
        }
        return Status::Ok();
      }));
  return RegisterVolume(
      r, "dice_score",
      [](CudaContext& cuda, const Tensors& in, const Tensors& out, const Attrs&) -> Status {
        TESSERA_RETURN_IF_ERROR(CheckActivations({&in[0]}, "dice_score"));
        const Shape& logits = in[0].shape();
        TESSERA_ASSIGN_OR_RETURN(
            std::shared_ptr<Buffer> counts,
            cuda.Scratch(DiceScoreCounts(logits[1]) *
                         static_cast<int64_t>(sizeof(unsigned long long))));  // NOLINT
        TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> flag, BadIndex(cuda));
        auto* bad = static_cast<int32_t*>(flag->data());
        auto* count = static_cast<unsigned long long*>(counts->data());  // NOLINT
        if (IsBf16(in[0])) {
          TESSERA_RETURN_IF_ERROR(DiceScore(F(out[0]), count, bad, B(in[0]), I(in[1]), logits[0],
                                            logits[1], Spatial(in[0]), cuda.stream()));
        } else {
          TESSERA_RETURN_IF_ERROR(DiceScore(F(out[0]), count, bad, F(in[0]), I(in[1]), logits[0],
                                            logits[1], Spatial(in[0]), cuda.stream()));
        }
        return CheckTargets(cuda, *flag, in[1], logits[1], "dice_score");
      });
}

}  // namespace

Status RegisterVolumeCudaKernels(OpRegistry& registry) {
  TESSERA_RETURN_IF_ERROR(RegisterConvolutions(registry));
  TESSERA_RETURN_IF_ERROR(RegisterNormsAndActivations(registry));
  return RegisterTheRest(registry);
}

}  // namespace tessera::cuda

// RegisterVolumeKernels (volume_kernels.h): the volume ops' CPU kernels (volume_kernels.cc)
// bound to the op registry, with the convolutions' geometry read from the tensors.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/half.h"

#include "ops/cpu/kernel_glue.h"
#include "ops/cpu/volume_kernels.h"
#include "ops/volume_ops.h"

namespace tessera {

namespace {

using cpu::detail::F;
using cpu::detail::I;
using cpu::detail::Register;
using cpu::detail::Tensors;
using cpu::detail::Workspace;

// Elements per (n, c) plane of an [N, C, *] tensor.
int64_t Spatial(const Tensor& t) {
  const int64_t planes = t.shape()[0] * t.shape()[1];
  return planes == 0 ? 0 : t.numel() / planes;
}
// Elements per sample of an [N, ...] tensor.
int64_t PerSample(const Tensor& t) { return t.shape()[0] == 0 ? 0 : t.numel() / t.shape()[0]; }

// The convolution from `volume` [N, Cin, D, H, W] to `grid` [N, Cout, Do, Ho, Wo] with a weight
// [Cout, Cin, kD, kH, kW]: conv3d's x to y, conv_transpose3d's y to x (its adjoint).
cpu::Conv3dGeometry Geometry(const Tensor& volume, const Tensor& weight, const Tensor& grid,
                             const Attrs& attrs) {
  const Shape& v = volume.shape();
  const Shape& w = weight.shape();
  const Shape& y = grid.shape();
  cpu::Conv3dGeometry g{.batch = v[0],
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
  g.positions_per_chunk = cpu::DefaultPositionsPerChunk(g.ColumnRows(), g.OutVolume());
  return g;
}

// `from` into `to` of the same shape: f32 <-> bf16 (to bf16 rounding to nearest even), or a copy
// where the types agree (cast_forward and cast_backward, and ThroughF32's copies).
Status CastInto(const Tensor& from, const Tensor& to) {
  const int64_t n = from.numel();
  if (from.dtype() == to.dtype()) {
    std::memcpy(to.raw_data(), from.raw_data(), static_cast<size_t>(from.bytes()));
  } else if (from.dtype() == DType::kF32 && to.dtype() == DType::kBF16) {
    const float* x = F(from);
    auto* y = static_cast<uint16_t*>(to.raw_data());
    for (int64_t i = 0; i < n; ++i) y[i] = FloatToBf16(x[i]);
  } else if (from.dtype() == DType::kBF16 && to.dtype() == DType::kF32) {
    const auto* x = static_cast<const uint16_t*>(from.raw_data());
    float* y = F(to);
    for (int64_t i = 0; i < n; ++i) y[i] = Bf16ToFloat(x[i]);
  } else {
    return InvalidArgument("cast from {} to {} is not built: f32 and bf16 only",
                           DTypeName(from.dtype()), DTypeName(to.dtype()));
  }
  return Status::Ok();
}

// The kernel for bf16 activations too: each bf16 input copied into f32 scratch, the f32 kernel
// run on the copies, each bf16 output rounded from its f32 result (to nearest even, as the GPU
// kernels store) — the GPU's numerics (bf16 storage, f32 arithmetic) as a CPU reference. The
// copies come from the executor's allocator (the op's workspace counts them: ops/volume_ops.cc
// VolumeOpRegistry). `in_place`: the op's (input, output) pairs whose output starts as the input
// (the kernel works over it), which share the input's copy. f32 calls go straight to the kernel.
KernelFn ThroughF32(KernelFn kernel, std::vector<std::pair<int, int>> in_place) {
  return [kernel = std::move(kernel), in_place = std::move(in_place)](
             const KernelContext& context, const Tensors& in, const Tensors& out,
             const Attrs& attrs) -> Status {
    const auto bf16 = [](const Tensor& t) { return t.dtype() == DType::kBF16; };
    if (std::none_of(in.begin(), in.end(), bf16) && std::none_of(out.begin(), out.end(), bf16)) {
      return kernel(context, in, out, attrs);
    }
    const auto f32_scratch = [&context](const Tensor& t) {
      return Tensor::Empty(TensorMeta{t.shape(), DType::kF32, Device::Cpu()}, context.allocator);
    };
    Tensors in32 = in, out32 = out;
    for (size_t i = 0; i < in.size(); ++i) {
      if (!bf16(in[i])) continue;
      TESSERA_ASSIGN_OR_RETURN(in32[i], f32_scratch(in[i]));
      TESSERA_RETURN_IF_ERROR(CastInto(in[i], in32[i]));
    }
    for (size_t o = 0; o < out.size(); ++o) {
      if (!bf16(out[o])) continue;
      const auto pair = std::find_if(in_place.begin(), in_place.end(), [o](const auto& p) {
        return p.second == static_cast<int>(o);
      });
      if (pair != in_place.end()) {
        out32[o] = in32[static_cast<size_t>(pair->first)];
      } else {
        TESSERA_ASSIGN_OR_RETURN(out32[o], f32_scratch(out[o]));
      }
    }
    TESSERA_RETURN_IF_ERROR(kernel(context, in32, out32, attrs));
    for (size_t o = 0; o < out.size(); ++o) {
      if (bf16(out[o])) TESSERA_RETURN_IF_ERROR(CastInto(out32[o], out[o]));
    }
    return Status::Ok();
  };
}

// The registry, for the volume ops' kernels: each registered through f32 for bf16 activations.
struct VolumeKernelRegistry {
  OpRegistry& registry;
};

// The op's in-place pairs come from its definition (ThroughF32 shares their copies).
Status Register(VolumeKernelRegistry& r, std::string_view op, KernelFn kernel) {
  TESSERA_ASSIGN_OR_RETURN(const OpDef* def, r.registry.Find(op));
  return Register(r.registry, op, ThroughF32(std::move(kernel), def->in_place));
}

// Spatial parallelism's kernels (slab_kernels.cc): f32 only (their ops refuse bf16).
Status RegisterSlabKernels(OpRegistry& r) {
  // x [N, C, D, H, W]: its (n, c) rows, D-planes and voxels a plane.
  struct Slab {
    int64_t rows, depth, plane;
  };
  const auto slab = [](const Tensor& x) {
    const Shape& s = x.shape();
    return Slab{s[0] * s[1], s[2], s[3] * s[4]};
  };
  TESSERA_RETURN_IF_ERROR(
      Register(r, "slab_planes_forward",
               [slab](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 const Slab s = slab(in[0]);
                 cpu::SlabPlanes(F(out[0]), F(out[1]), F(in[0]), s.rows, s.depth, s.plane);
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "slab_planes_backward",
               [slab](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 const Slab s = slab(out[0]);  // in: dfirst, dlast
                 cpu::SlabPlanesBackward(F(out[0]), F(in[0]), F(in[1]), s.rows, s.depth, s.plane);
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "halo_join_forward",
               [slab](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 const Slab s = slab(in[1]);  // in: above, x, below
                 cpu::HaloJoin(F(out[0]), F(in[0]), F(in[1]), F(in[2]), s.rows, s.depth, s.plane);
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "halo_join_backward",
      [slab](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
        const Slab s = slab(out[1]);  // out: dabove, dx, dbelow
        cpu::HaloJoinBackward(F(out[0]), F(out[1]), F(out[2]), F(in[0]), s.rows, s.depth, s.plane);
        return Status::Ok();
      }));
  // x [N, C, *] and the ranks (stats' leading dimension).
  const auto norm = [](const Tensor& x, const Tensor& stats, const Attrs& attrs) {
    return cpu::SlabNormShape{.batch = x.shape()[0],
                              .channels = x.shape()[1],
                              .spatial = Spatial(x),
                              .groups = attrs.GetInt("groups", 1),
                              .ranks = stats.shape()[0]};
  };
  TESSERA_RETURN_IF_ERROR(Register(
      r, "group_norm_stats_forward",
      [norm](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        cpu::GroupNormSlabStats(F(out[0]), F(in[0]), norm(in[0], out[0], attrs));
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "group_norm_stats_backward",
      [norm](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        // in: dstats, x.
        cpu::GroupNormSlabStatsBackward(F(out[0]), F(in[0]), F(in[1]), norm(in[1], in[0], attrs));
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "group_norm_slab_forward",
      [norm](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        // in: x, stats, weight, bias.
        cpu::GroupNormSlabForward(F(out[0]), F(out[1]), F(out[2]), F(in[0]), F(in[1]), F(in[2]),
                                  F(in[3]), norm(in[0], in[1], attrs),
                                  static_cast<float>(attrs.GetFloat("eps", 1e-5)));
        return Status::Ok();
      }));
  return Register(
      r, "group_norm_slab_backward",
      [norm](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        // in: dy, x, stats, weight, mean, rstd; out: dx, dstats, dweight, dbias.
        cpu::GroupNormSlabBackward(F(out[0]), F(out[1]), F(out[2]), F(out[3]), F(in[0]), F(in[1]),
                                   F(in[3]), F(in[4]), F(in[5]), norm(in[1], in[2], attrs));
        return Status::Ok();
      });
}

// The column-matrix workspace (at least one float).
Result<Tensor> ConvWorkspace(const KernelContext& context, const cpu::Conv3dGeometry& g) {
  return Workspace(context, std::max<int64_t>(1, cpu::Conv3dWorkspaceFloats(g)));
}

// The halves of the convolutions' backwards; in: dy, x, weight.
// conv3d: dx = conv^T(dy), dweight from dy and x, dbias = dy's channel sums (none for
// conv3d_no_bias: `dbias` null).
Status Conv3dDx(const KernelContext& ctx, const Tensors& in, const Tensor& dx, const Attrs& attrs) {
  const cpu::Conv3dGeometry g = Geometry(in[1], in[2], in[0], attrs);
  TESSERA_ASSIGN_OR_RETURN(Tensor workspace, ConvWorkspace(ctx, g));
  cpu::Conv3dInputGradient(F(dx), F(in[0]), F(in[2]), nullptr, g, F(workspace),
                           ctx.gemm_split_min_flops);
  return Status::Ok();
}
Status Conv3dDw(const KernelContext& ctx, const Tensors& in, const Tensor& dweight,
                const Tensor* dbias, const Attrs& attrs) {
  const cpu::Conv3dGeometry g = Geometry(in[1], in[2], in[0], attrs);
  TESSERA_ASSIGN_OR_RETURN(Tensor workspace, ConvWorkspace(ctx, g));
  cpu::Conv3dWeightGradient(F(dweight), F(in[0]), F(in[1]), g, F(workspace),
                            ctx.gemm_split_min_flops);
  if (dbias != nullptr) {
    cpu::ChannelSums(F(*dbias), F(in[0]), g.batch, g.out_channels, g.OutVolume());
  }
  return Status::Ok();
}
// conv_transpose3d, y = conv^T(x): dx = conv(dy), and <dy, conv^T(x)> = <conv(dy), x> gives
// dweight as conv's weight gradient with x in dy's place.
Status ConvTranspose3dDx(const KernelContext& ctx, const Tensors& in, const Tensor& dx,
                         const Attrs& attrs) {
  const cpu::Conv3dGeometry g = Geometry(in[0], in[2], in[1], attrs);
  TESSERA_ASSIGN_OR_RETURN(Tensor workspace, ConvWorkspace(ctx, g));
  cpu::Conv3dForward(F(dx), F(in[0]), F(in[2]), nullptr, g, F(workspace), ctx.gemm_split_min_flops);
  return Status::Ok();
}
Status ConvTranspose3dDw(const KernelContext& ctx, const Tensors& in, const Tensor& dweight,
                         const Tensor& dbias, const Attrs& attrs) {
  const cpu::Conv3dGeometry g = Geometry(in[0], in[2], in[1], attrs);
  TESSERA_ASSIGN_OR_RETURN(Tensor workspace, ConvWorkspace(ctx, g));
  cpu::Conv3dWeightGradient(F(dweight), F(in[1]), F(in[0]), g, F(workspace),
                            ctx.gemm_split_min_flops);
  cpu::ChannelSums(F(dbias), F(in[0]), g.batch, g.in_channels, g.InVolume());
  return Status::Ok();
}

Status RegisterConvKernels(VolumeKernelRegistry& r) {
  // conv3d_forward (in: x, weight, bias) and conv3d_no_bias_forward (in: x, weight).
  for (const char* op : {"conv3d_forward", "conv3d_no_bias_forward"}) {
    TESSERA_RETURN_IF_ERROR(Register(
        r, op,
        [](const KernelContext& ctx, const Tensors& in, const Tensors& out,
           const Attrs& attrs) -> Status {
          const cpu::Conv3dGeometry g = Geometry(in[0], in[1], out[0], attrs);
          TESSERA_ASSIGN_OR_RETURN(Tensor workspace, ConvWorkspace(ctx, g));
          cpu::Conv3dForward(F(out[0]), F(in[0]), F(in[1]), in.size() > 2 ? F(in[2]) : nullptr, g,
                             F(workspace), ctx.gemm_split_min_flops);
          return Status::Ok();
        }));
  }
  TESSERA_RETURN_IF_ERROR(Register(r, "conv3d_backward",
                                   [](const KernelContext& ctx, const Tensors& in,
                                      const Tensors& out, const Attrs& attrs) -> Status {
                                     // in: dy, x, weight; out: dx, dweight, dbias.
                                     TESSERA_RETURN_IF_ERROR(Conv3dDx(ctx, in, out[0], attrs));
                                     return Conv3dDw(ctx, in, out[1], &out[2], attrs);
                                   }));
  TESSERA_RETURN_IF_ERROR(Register(r, "conv3d_no_bias_backward",
                                   [](const KernelContext& ctx, const Tensors& in,
                                      const Tensors& out, const Attrs& attrs) -> Status {
                                     // in: dy, x, weight; out: dx, dweight.
                                     TESSERA_RETURN_IF_ERROR(Conv3dDx(ctx, in, out[0], attrs));
                                     return Conv3dDw(ctx, in, out[1], nullptr, attrs);
                                   }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "conv3d_no_bias_backward_weight",
               [](const KernelContext& ctx, const Tensors& in, const Tensors& out,
                  const Attrs& attrs) { return Conv3dDw(ctx, in, out[0], nullptr, attrs); }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "conv3d_backward_input",
               [](const KernelContext& ctx, const Tensors& in, const Tensors& out,
                  const Attrs& attrs) { return Conv3dDx(ctx, in, out[0], attrs); }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "conv3d_backward_weight",
               [](const KernelContext& ctx, const Tensors& in, const Tensors& out,
                  const Attrs& attrs) { return Conv3dDw(ctx, in, out[0], &out[1], attrs); }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "conv_transpose3d_forward",
               [](const KernelContext& ctx, const Tensors& in, const Tensors& out,
                  const Attrs& attrs) -> Status {
                 // y = conv^T(x): the convolution runs from y's shape to x's.
                 const cpu::Conv3dGeometry g = Geometry(out[0], in[1], in[0], attrs);
                 TESSERA_ASSIGN_OR_RETURN(Tensor workspace, ConvWorkspace(ctx, g));
                 cpu::Conv3dInputGradient(F(out[0]), F(in[0]), F(in[1]), F(in[2]), g, F(workspace),
                                          ctx.gemm_split_min_flops);
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(Register(r, "conv_transpose3d_backward",
                                   [](const KernelContext& ctx, const Tensors& in,
                                      const Tensors& out, const Attrs& attrs) -> Status {
                                     TESSERA_RETURN_IF_ERROR(
                                         ConvTranspose3dDx(ctx, in, out[0], attrs));
                                     return ConvTranspose3dDw(ctx, in, out[1], out[2], attrs);
                                   }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "conv_transpose3d_backward_input",
               [](const KernelContext& ctx, const Tensors& in, const Tensors& out,
                  const Attrs& attrs) { return ConvTranspose3dDx(ctx, in, out[0], attrs); }));
  return Register(
      r, "conv_transpose3d_backward_weight",
      [](const KernelContext& ctx, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        return ConvTranspose3dDw(ctx, in, out[0], out[1], attrs);
      });
}

Status RegisterOtherKernels(VolumeKernelRegistry& r) {
  TESSERA_RETURN_IF_ERROR(
      Register(r, "upsample_nearest3d_forward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 const Shape& x = in[0].shape();
                 cpu::UpsampleNearest3dForward(F(out[0]), F(in[0]), x[0] * x[1], x[2], x[3], x[4],
                                               attrs.GetInt("scale", 2));
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "upsample_nearest3d_backward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 const Shape& x = out[0].shape();
                 cpu::UpsampleNearest3dBackward(F(out[0]), F(in[0]), x[0] * x[1], x[2], x[3], x[4],
                                                attrs.GetInt("scale", 2));
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "max_pool3d_forward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 const Shape& x = in[0].shape();
                 cpu::MaxPool3dForward(F(out[0]), out[1].data<int32_t>(), F(in[0]), x[0] * x[1],
                                       x[2], x[3], x[4], attrs.GetInt("kernel", 2));
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "max_pool3d_backward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 // in: dy, x, indices.
                 return cpu::MaxPool3dBackward(F(out[0]), F(in[0]), I(in[2]),
                                               in[1].shape()[0] * in[1].shape()[1], Spatial(in[1]),
                                               Spatial(in[0]));
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "group_norm_forward",
      [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
        const Shape& x = in[0].shape();
        cpu::GroupNormForward(F(out[0]), F(out[1]), F(out[2]), F(in[0]), F(in[1]), F(in[2]), x[0],
                              x[1], Spatial(in[0]), attrs.GetInt("groups", 1),
                              static_cast<float>(attrs.GetFloat("eps", 1e-5)));
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "group_norm_backward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 // in: dy, x, weight, mean, rstd.
                 const Shape& x = in[1].shape();
                 cpu::GroupNormBackward(F(out[0]), F(out[1]), F(out[2]), F(in[0]), F(in[1]),
                                        F(in[2]), F(in[3]), F(in[4]), x[0], x[1], Spatial(in[1]),
                                        attrs.GetInt("groups", 1));
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(RegisterSlabKernels(r.registry));
  struct Activation {
    const char* name;
    void (*forward)(float* y, const float* x, int64_t n);
    void (*backward)(float* dx, const float* dy, const float* x, int64_t n);
  };
  for (const Activation& a :
       {Activation{"relu", cpu::ReluForward, cpu::ReluBackward},
        Activation{"silu", cpu::SiluForward, cpu::SiluBackward},
        Activation{"leaky_relu", cpu::LeakyReluForward, cpu::LeakyReluBackward}}) {
    const std::string name = a.name;
    TESSERA_RETURN_IF_ERROR(Register(r, name + "_forward",
                                     [forward = a.forward](const KernelContext&, const Tensors& in,
                                                           const Tensors& out, const Attrs&) {
                                       forward(F(out[0]), F(in[0]), in[0].numel());
                                       return Status::Ok();
                                     }));
    TESSERA_RETURN_IF_ERROR(
        Register(r, name + "_backward",
                 [backward = a.backward](const KernelContext&, const Tensors& in,
                                         const Tensors& out, const Attrs&) {
                   // in: dy, x.
                   backward(F(out[0]), F(in[0]), F(in[1]), in[0].numel());
                   return Status::Ok();
                 }));
  }
  TESSERA_RETURN_IF_ERROR(
      Register(r, "channel_bias_add_forward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 const Shape& x = in[0].shape();
                 cpu::ChannelBiasAdd(F(out[0]), F(in[0]), F(in[1]), x[0], x[1], Spatial(in[0]));
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "channel_bias_add_backward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 const Shape& dy = in[0].shape();
                 std::copy_n(F(in[0]), in[0].numel(), F(out[0]));
                 cpu::ChannelSums(F(out[1]), F(in[0]), dy[0], dy[1], Spatial(in[0]));
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "concat_forward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 cpu::ConcatForward(F(out[0]), F(in[0]), F(in[1]), in[0].shape()[0],
                                    PerSample(in[0]), PerSample(in[1]));
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "concat_backward",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
                 cpu::ConcatBackward(F(out[0]), F(out[1]), F(in[0]), out[0].shape()[0],
                                     PerSample(out[0]), PerSample(out[1]));
                 return Status::Ok();
               }));
  TESSERA_RETURN_IF_ERROR(Register(
      r, "voxel_cross_entropy",
      [](const KernelContext&, const Tensors& in, const Tensors& out,
         const Attrs& attrs) -> Status {
        // out[1] holds the logits (in place); the kernel overwrites them with their
        // gradient.
        const Shape& logits = out[1].shape();
        const double weight = attrs.GetFloat("weight", 1.0);
        TESSERA_ASSIGN_OR_RETURN(
            const float loss,
            cpu::VoxelCrossEntropy(F(out[1]), F(out[1]), I(in[1]), logits[0], logits[1],
                                   Spatial(out[1]),
                                   static_cast<float>(attrs.GetFloat("grad_scale", 1.0) * weight)));
        *F(out[0]) = static_cast<float>(weight * loss);
        return Status::Ok();
      }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "downsample_labels",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 const Shape& fine = in[0].shape();
                 cpu::DownsampleLabels(out[0].data<int32_t>(), I(in[0]), fine[0], fine[1], fine[2],
                                       fine[3], attrs.GetInt("factor", 2));
                 return Status::Ok();
               }));
  return Register(
      r, "dice_score",
      [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) -> Status {
        const Shape& logits = in[0].shape();
        TESSERA_ASSIGN_OR_RETURN(const float score, cpu::DiceScore(F(in[0]), I(in[1]), logits[0],
                                                                   logits[1], Spatial(in[0])));
        *F(out[0]) = score;
        return Status::Ok();
      });
}

Status RegisterCastKernels(OpRegistry& r) {
  const KernelFn cast = [](const KernelContext&, const Tensors& in, const Tensors& out,
                           const Attrs&) { return CastInto(in[0], out[0]); };
  TESSERA_RETURN_IF_ERROR(Register(r, "cast_forward", cast));
  return Register(r, "cast_backward", cast);  // in: dy, x (read for its type only)
}

}  // namespace

Status RegisterVolumeKernels(OpRegistry& registry) {
  VolumeKernelRegistry volume{registry};
  TESSERA_RETURN_IF_ERROR(RegisterConvKernels(volume));
  TESSERA_RETURN_IF_ERROR(RegisterCastKernels(registry));
  return RegisterOtherKernels(volume);
}

}  // namespace tessera

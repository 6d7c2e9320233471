// Definitions of the ops a 3D U-Net needs, on volumes laid out NCDHW. Kernels are registered
// separately (ops/cpu/volume_kernels.h).
//
// Activations (x, y, their gradients, logits) are f32 or bf16, all of one call alike, and an
// op's activation outputs have its activation inputs' type; parameters, their gradients, norm
// statistics, losses and scores are f32 (bf16 is mixed precision's storage: the GPU kernels read
// it into f32 and accumulate in f32; the CPU kernels compute bf16 calls in f32 copies, rounding
// the outputs as the GPU's do, a reference for them whose copies the ops' workspace counts).
// Spatial parallelism's ops (slab_planes, halo_join, group_norm_stats, group_norm_slab) take f32
// only.
//
// Every differentiable forward op carries a GradientRule (ops/op_registry.h) naming its
// `<name>_backward` op. A backward op's inputs are the gradients of the forward's outputs, then
// the forward inputs and outputs it needs; its outputs are the gradients of the differentiable
// forward inputs, in forward-input order. Backward ops get the forward op's attributes.
//
//   conv3d_forward            x [N,Cin,D,H,W], weight [Cout,Cin,kD,kH,kW], bias [Cout] -> y
//                             attrs stride (default 1), padding (default 0), the same on every
//                             spatial axis but D's where attr depth_padding is given (a slab of
//                             a volume joined with its neighbours' halo planes: 0); y's extent
//                             per axis is (in + 2*padding - k) / stride + 1
//   conv3d_backward           dy, x, weight -> dx, dweight, dbias
//   conv3d_no_bias_forward    x, weight -> y: conv3d without a bias (the row-parallel half of a
//                             tensor-parallel pair, whose partial sums are added before the
//                             bias is: channel_bias_add); conv3d_no_bias_backward -> dx, dweight
//   channel_bias_add_forward  x [N,C,*], bias [C] -> y = x + bias[c]
//   channel_bias_add_backward dy -> dx = dy, dbias (dy's sums per channel)
//   conv_transpose3d_forward  x [N,Cin,D,H,W], weight [Cin,Cout,kD,kH,kW] (PyTorch's layout),
//                             bias [Cout] -> y; attrs stride (default 1), padding (default 0);
//                             y's extent is (in - 1) * stride - 2*padding + k (no output_padding).
//                             The adjoint of conv3d: kernel 2, stride 2 doubles each extent
//   conv_transpose3d_backward dy, x, weight -> dx, dweight, dbias
//   upsample_nearest3d_forward  x [N,C,D,H,W] -> y [N,C,sD,sH,sW]; attr scale (default 2)
//   upsample_nearest3d_backward dy -> dx (each dx element sums its s^3 block of dy)
//   max_pool3d_forward        x [N,C,D,H,W] -> y [N,C,D/k,H/k,W/k] (floor), indices (i32, same
//                             shape: the flat D*H*W index of each maximum within its (n, c)
//                             volume, as PyTorch's return_indices); attr kernel (= stride,
//                             default 2). Ties keep the first maximum; NaN wins, as in PyTorch
//   max_pool3d_backward       dy, x, indices -> dx (x is read for its shape only)
//   group_norm_forward        x [N,C,*], weight [C], bias [C] -> y, mean [N,G], rstd [N,G];
//                             attrs groups (required, divides C), eps (default 1e-5). mean and
//                             rstd are saved for the backward; gradients flowing into them are
//                             ignored
//   group_norm_backward       dy, x, weight, mean, rstd -> dx, dweight, dbias
//   Spatial parallelism (a volume's slabs along D, one a rank; model/unet3d.h):
//   slab_planes_forward       x [N,C,D,H,W] -> first, last [N,C,1,H,W]: its first and last
//                             D-planes, the halos it passes to the slabs before and after it;
//                             attr depth = D (required: the backward keeps nothing of x)
//   slab_planes_backward      dfirst, dlast -> dx (zeros but for the two planes)
//   halo_join_forward         above, x, below -> out [N,C,D+2,H,W] = [above; x; below] along D
//                             (what a convolution with depth_padding 0 reads)
//   halo_join_backward        dout -> dabove, dx, dbelow
//   group_norm_stats_forward  x [N,C,*] -> stats [P,N,G,4]: the slab's sum and sum of squares
//                             per (sample, group), each a double as a high and a low f32, in
//                             each of P blocks (attrs groups, ranks P): an all-to-all of blocks
//                             hands every rank every slab's
//   group_norm_stats_backward dstats, x -> dx (the high parts carry each sum's gradient)
//   group_norm_slab_forward   x, stats [P,N,G,4] (every slab's), weight, bias -> y, mean, rstd:
//                             group_norm_forward with the whole volume's mean and variance
//   group_norm_slab_backward  dy, x, stats, weight, mean, rstd -> dx (the slab's own term),
//                             dstats, dweight, dbias
//   relu_forward, silu_forward    x (any shape) -> y
//   relu_backward, silu_backward  dy, x -> dx
//   leaky_relu_forward/_backward  the same; slope kLeakyReluSlope (0.01, nnU-Net's) below zero
//   concat_forward            a [N,Ca,*], b [N,Cb,*] -> out [N,Ca+Cb,*] (channel dimension 1)
//   concat_backward           dout, a -> da, db (a is read for its shape only)
//   cast_forward              x -> y: x in attribute dtype's type ("f32" or "bf16"; rounding
//                             to nearest even), e.g. the input volume into bf16 activations
//   cast_backward             dy, x -> dx in x's type (x is read for its type only)
//   voxel_cross_entropy       logits [N,C,*], targets i32 [N,*] -> loss (f32 scalar, mean over
//                             the N*prod(*) voxels of -log softmax over C at the target class),
//                             dlogits (its gradient times attr grad_scale, default 1, computed in
//                             place over the logits). Its GradientRule, like
//                             softmax_cross_entropy's, is loss_gradient (dloss, dlogits -> dx =
//                             dlogits * dloss): the gradient comes out of the same pass, and a
//                             model API loss layer (model/model.h) can end in this op
//   dice_score                logits [N,C,*], targets i32 [N,*] -> score (f32 scalar): hard Dice
//                             of argmax_c logits against targets, per foreground class
//                             1..C-1 over the whole batch, 2|P and T| / (|P| + |T|) (1 when the
//                             class is absent from both), averaged over those classes; C >= 2.
//                             A metric: no gradient
#pragma once

#include <cstdint>

#include "core/status.h"
#include "ops/op_registry.h"

namespace tessera {

// The CPU convolution kernels' scratch (OpDef::workspace; ops/cpu/volume_kernels.h): one column
// matrix of `column_rows` rows (Cin * kD * kH * kW of the convolution's input side) by the output
// positions unfolded at once: a few MB, and wide enough for a GEMM to split into many pieces (a
// function of the shape only).
int64_t Conv3dPositionsPerChunk(int64_t column_rows, int64_t out_volume);
int64_t Conv3dWorkspaceFloats(int64_t column_rows, int64_t out_volume);

// The last dimension of group_norm_stats' statistics: hi(sum), lo(sum), hi(squares),
// lo(squares).
inline constexpr int64_t kSlabStatsWidth = 4;

// A convolution's zero padding along D (axis 2 of x): attribute depth_padding, else padding (as
// along H and W), else 0.
inline constexpr const char* kDepthPaddingAttr = "depth_padding";
int64_t DepthPadding(const Attrs& attrs);

// Adds the volume ops above. Called by RegisterStandardOps; AlreadyExists if called twice.
Status RegisterVolumeOps(OpRegistry& registry);

}  // namespace tessera

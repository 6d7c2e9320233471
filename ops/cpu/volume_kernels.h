// CPU kernels of the volume ops (ops/volume_ops.h): fp32, NCDHW, parallel over the calling
// thread's TBB arena.
//
// Convolution is vol2col + GEMM. A convolution maps a volume x [N, Cin, D, H, W] to a grid
// y [N, Cout, Do, Ho, Wo] (Conv3dGeometry); for each sample, chunks of output positions are
// unfolded into a column matrix col [Cin*kD*kH*kW, chunk] and multiplied by the weight
// [Cout, Cin*kD*kH*kW]. The transposed convolution is the adjoint of a convolution, so three
// kernels serve both ops:
//   Conv3dForward         y = conv(x) (+ bias)               conv3d fwd; conv_transpose3d dx
//   Conv3dInputGradient   x = conv^T(y) (+ bias), col2vol    conv3d dx; conv_transpose3d fwd
//   Conv3dWeightGradient  dW = sum over samples of y . col(x)^T
//
// Determinism: nothing depends on the thread count. Chunks are a function of the shape only
// (Conv3dGeometry::positions_per_chunk) and run one after another; within a chunk, vol2col writes
// disjoint rows, col2vol gives each channel to one task (which adds its kernel taps in a fixed
// order), and GEMMs split by shape only (blas.h). Reductions (bias gradients, norm statistics,
// losses) run over fixed ranges combined in a fixed order. Results are bit-identical on 1 or 64
// threads.
//
// REQUIRES (every function): pointers valid for the stated sizes; outputs do not alias inputs
// unless stated. Outputs are overwritten.
#pragma once

#include <cstdint>

#include "core/status.h"
#include "ops/op_registry.h"

namespace tessera {

// Adds the CPU kernel of every op of RegisterVolumeOps. REQUIRES: those ops are registered.
Status RegisterVolumeKernels(OpRegistry& registry);

}  // namespace tessera

namespace tessera::cpu {

// A convolution from x [batch, in_channels, in_d, in_h, in_w] to
// y [batch, out_channels, out_d, out_h, out_w] with weight [out_channels, in_channels, kd, kh, kw],
// the same stride and zero padding on every axis but D's (padding_d): y position o reads x at
// o * stride - padding + k.
struct Conv3dGeometry {
  int64_t batch = 1;
  int64_t in_channels = 1, in_d = 1, in_h = 1, in_w = 1;
  int64_t out_channels = 1, out_d = 1, out_h = 1, out_w = 1;
  int64_t kd = 1, kh = 1, kw = 1;
  int64_t stride = 1, padding = 0, padding_d = 0;
  // Output positions unfolded at once (the column matrix is [ColumnRows(), this]).
  int64_t positions_per_chunk = 1;

  int64_t InVolume() const { return in_d * in_h * in_w; }
  int64_t OutVolume() const { return out_d * out_h * out_w; }
  int64_t ColumnRows() const { return in_channels * kd * kh * kw; }
};

// Positions per chunk for a column matrix of `column_rows` rows: a few MB of workspace, and wide
// enough for a GEMM to split into many pieces. A function of the shape only.
int64_t DefaultPositionsPerChunk(int64_t column_rows, int64_t out_volume);
// Floats of workspace the convolution kernels need: one column matrix.
int64_t Conv3dWorkspaceFloats(const Conv3dGeometry& g);

// y = conv(x, weight) + bias (bias may be null: no bias).
void Conv3dForward(float* y, const float* x, const float* weight, const float* bias,
                   const Conv3dGeometry& g, float* workspace, int64_t split_min_flops);
// x = conv^T(y, weight) + bias[in_channel] (bias may be null): the gradient of <y, conv(x)> with
// respect to x, and the transposed convolution of y.
void Conv3dInputGradient(float* x, const float* y, const float* weight, const float* bias,
                         const Conv3dGeometry& g, float* workspace, int64_t split_min_flops);
// dweight = d<dy, conv(x, weight)>/dweight.
void Conv3dWeightGradient(float* dweight, const float* dy, const float* x, const Conv3dGeometry& g,
                          float* workspace, int64_t split_min_flops);
// out[c] = sum over n and s of t[n, c, s] (t is [batch, channels, spatial]); the bias gradient.
void ChannelSums(float* out, const float* t, int64_t batch, int64_t channels, int64_t spatial);
// y[n, c, s] = x[n, c, s] + bias[c]; y may be x.
void ChannelBiasAdd(float* y, const float* x, const float* bias, int64_t batch, int64_t channels,
                    int64_t spatial);

// ---- nearest upsampling: x [planes, d, h, w] -> y [planes, d*s, h*s, w*s] ----
void UpsampleNearest3dForward(float* y, const float* x, int64_t planes, int64_t d, int64_t h,
                              int64_t w, int64_t scale);
// dx [planes, d, h, w]: each element the sum of its scale^3 block of dy.
void UpsampleNearest3dBackward(float* dx, const float* dy, int64_t planes, int64_t d, int64_t h,
                               int64_t w, int64_t scale);

// ---- max pooling, kernel = stride = k, floor mode: x [planes, d, h, w] -> y, indices ----
// indices hold the flat d*h*w index of each window's maximum (the first on ties; NaN wins).
void MaxPool3dForward(float* y, int32_t* indices, const float* x, int64_t planes, int64_t d,
                      int64_t h, int64_t w, int64_t k);
// dx [planes, d, h, w]: dy[o] added at indices[o], zeros elsewhere. InvalidArgument names the
// first index outside the plane.
Status MaxPool3dBackward(float* dx, const float* dy, const int32_t* indices, int64_t planes,
                         int64_t volume, int64_t pooled_volume);

// ---- group normalisation over x [batch, channels, spatial], `groups` dividing channels ----
void GroupNormForward(float* y, float* mean, float* rstd, const float* x, const float* weight,
                      const float* bias, int64_t batch, int64_t channels, int64_t spatial,
                      int64_t groups, float eps);
void GroupNormBackward(float* dx, float* dweight, float* dbias, const float* dy, const float* x,
                       const float* weight, const float* mean, const float* rstd, int64_t batch,
                       int64_t channels, int64_t spatial, int64_t groups);

// ---- spatial parallelism (slab_kernels.cc): `rows` (n, c) rows of `depth` D-planes of `plane`
// voxels ----
void SlabPlanes(float* first, float* last, const float* x, int64_t rows, int64_t depth,
                int64_t plane);
void SlabPlanesBackward(float* dx, const float* dfirst, const float* dlast, int64_t rows,
                        int64_t depth, int64_t plane);
// out has depth + 2 planes a row: above's, x's, below's.
void HaloJoin(float* out, const float* above, const float* x, const float* below, int64_t rows,
              int64_t depth, int64_t plane);
void HaloJoinBackward(float* dabove, float* dx, float* dbelow, const float* dout, int64_t rows,
                      int64_t depth, int64_t plane);
// Group norm over the `ranks` equal slabs of a volume: x [batch, channels, spatial] is this
// rank's, stats [ranks, batch, groups, kSlabStatsWidth].
struct SlabNormShape {
  int64_t batch = 1, channels = 1, spatial = 1, groups = 1, ranks = 1;
};
void GroupNormSlabStats(float* stats, const float* x, const SlabNormShape& s);
void GroupNormSlabStatsBackward(float* dx, const float* dstats, const float* x,
                                const SlabNormShape& s);
void GroupNormSlabForward(float* y, float* mean, float* rstd, const float* x, const float* stats,
                          const float* weight, const float* bias, const SlabNormShape& s,
                          float eps);
void GroupNormSlabBackward(float* dx, float* dstats, float* dweight, float* dbias, const float* dy,
                           const float* x, const float* weight, const float* mean,
                           const float* rstd, const SlabNormShape& s);

// ---- activations ----
void ReluForward(float* y, const float* x, int64_t n);
// dx = dy where x > 0, else 0. dx may alias dy.
void ReluBackward(float* dx, const float* dy, const float* x, int64_t n);
// Leaky ReLU with slope kLeakyReluSlope below zero (PyTorch's default, and nnU-Net's).
inline constexpr float kLeakyReluSlope = 0.01f;
void LeakyReluForward(float* y, const float* x, int64_t n);
void LeakyReluBackward(float* dx, const float* dy, const float* x, int64_t n);
void SiluForward(float* y, const float* x, int64_t n);
// dx = dy * s * (1 + x * (1 - s)), s = sigmoid(x). dx may alias dy.
void SiluBackward(float* dx, const float* dy, const float* x, int64_t n);

// ---- concatenation along dimension 1: a [outer, a_inner], b [outer, b_inner] ----
// out [outer, a_inner + b_inner] (a_inner = Ca * spatial).
void ConcatForward(float* out, const float* a, const float* b, int64_t outer, int64_t a_inner,
                   int64_t b_inner);
void ConcatBackward(float* da, float* db, const float* dout, int64_t outer, int64_t a_inner,
                    int64_t b_inner);

// ---- segmentation: logits [batch, classes, spatial], targets [batch, spatial] ----
// Returns the mean over batch*spatial voxels of logsumexp_c(logits) - logits[target], and writes
// dlogits = (softmax - onehot(target)) * grad_scale / (batch*spatial) (null: loss only). dlogits
// may alias logits. InvalidArgument names the first target outside [0, classes).
Result<float> VoxelCrossEntropy(float* dlogits, const float* logits, const int32_t* targets,
                                int64_t batch, int64_t classes, int64_t spatial, float grad_scale);
// coarse [batch, d/f, h/f, w/f] = targets [batch, d, h, w] at f * k + f / 2 along each axis (the
// extents multiples of f: ops/volume_ops.h's downsample_labels).
void DownsampleLabels(int32_t* coarse, const int32_t* targets, int64_t batch, int64_t d, int64_t h,
                      int64_t w, int64_t factor);
// Hard Dice averaged over classes 1..classes-1 (see ops/volume_ops.h). InvalidArgument names the
// first target outside [0, classes).
Result<float> DiceScore(const float* logits, const int32_t* targets, int64_t batch, int64_t classes,
                        int64_t spatial);

}  // namespace tessera::cpu

// CUDA kernels of the volume ops (ops/volume_ops.h): the GPU counterparts of
// ops/cpu/volume_kernels.h for the 3D U-Net, each checked against its CPU kernel in
// tests/gpu/cuda_volume_test.cc.
//
// Activations (x, y, dy, dx, logits) are T = float or bf16, one launcher per type; anything read
// back at full precision (norm statistics, parameters and their gradients, losses, scores) is
// fp32, and every sum is accumulated in fp32. Layout NCDHW, as on the CPU: a [batch, channels,
// spatial] view where spatial = D*H*W.
//
// Convolutions call cuDNN (its convolution API: forward, backward data, backward filter; the
// deterministic algorithm cuDNN's heuristics rank first; math in fp32, tensor cores allowed for
// bf16 only, so an f32 convolution is not computed in TF32). A bf16 convolution takes bf16
// weights: the caller casts its fp32 parameters (CastF32ToBf16, ops/cuda/kernels.h), and the bf16
// weight gradient cuDNN writes is cast back. Biases are separate (ChannelBiasAdd, ChannelSums).
// Without cuDNN in the build the convolution launchers return Unavailable.
//
// Conventions as ops/cuda/kernels.h: launchers check sizes, launch on `stream`, check the
// launch, and return without waiting; outputs are overwritten; reductions are deterministic
// (fixed order, or integer counts) unless a function says otherwise. A target outside
// [0, classes) or a pooling index outside its plane is not an error the launcher can see: the
// kernel writes the first such position into *bad_index, which the caller initialises to -1 and
// reads once the stream has reached this point.
#pragma once

#include <cstdint>
#include <memory>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "core/status.h"
#include "ops/op_registry.h"

namespace tessera::cuda {

using bf16 = __nv_bfloat16;

// ---- group normalisation over x [batch, channels, spatial], `groups` dividing channels ----
// mean and rstd are [batch, groups] (fp32); rstd = 1 / sqrt(var + eps) of the biased variance.
// Instance norm is groups == channels.
Status GroupNormForward(float* y, float* mean, float* rstd, const float* x, const float* weight,
                        const float* bias, int64_t batch, int64_t channels, int64_t spatial,
                        int64_t groups, float eps, cudaStream_t stream);
Status GroupNormForward(bf16* y, float* mean, float* rstd, const bf16* x, const float* weight,
                        const float* bias, int64_t batch, int64_t channels, int64_t spatial,
                        int64_t groups, float eps, cudaStream_t stream);
// dx, and dweight / dbias [channels] (fp32, overwritten). scratch: GroupNormBackwardScratch floats.
Status GroupNormBackward(float* dx, float* dweight, float* dbias, float* scratch, const float* dy,
                         const float* x, const float* weight, const float* mean, const float* rstd,
                         int64_t batch, int64_t channels, int64_t spatial, int64_t groups,
                         cudaStream_t stream);
Status GroupNormBackward(bf16* dx, float* dweight, float* dbias, float* scratch, const bf16* dy,
                         const bf16* x, const float* weight, const float* mean, const float* rstd,
                         int64_t batch, int64_t channels, int64_t spatial, int64_t groups,
                         cudaStream_t stream);
int64_t GroupNormBackwardScratch(int64_t batch, int64_t channels, int64_t groups);

// ---- activations (n elements; y may alias x, dx may alias dy) ----
enum class VolumeActivation { kRelu, kLeakyRelu, kSilu };
Status ActivationForward(VolumeActivation kind, float* y, const float* x, int64_t n,
                         cudaStream_t stream);
Status ActivationForward(VolumeActivation kind, bf16* y, const bf16* x, int64_t n,
                         cudaStream_t stream);
Status ActivationBackward(VolumeActivation kind, float* dx, const float* dy, const float* x,
                          int64_t n, cudaStream_t stream);
Status ActivationBackward(VolumeActivation kind, bf16* dx, const bf16* dy, const bf16* x, int64_t n,
                          cudaStream_t stream);

// ---- a loss's gradient: y = x * (*scale), scale a device scalar (loss_gradient) ----
Status ScaleByScalar(float* y, const float* x, const float* scale, int64_t n, cudaStream_t stream);
Status ScaleByScalar(bf16* y, const bf16* x, const float* scale, int64_t n, cudaStream_t stream);

// ---- channel bias: y[n, c, s] = x[n, c, s] + bias[c] (y may be x); its gradient ----
Status ChannelBiasAdd(float* y, const float* x, const float* bias, int64_t batch, int64_t channels,
                      int64_t spatial, cudaStream_t stream);
Status ChannelBiasAdd(bf16* y, const bf16* x, const float* bias, int64_t batch, int64_t channels,
                      int64_t spatial, cudaStream_t stream);
// out[c] (fp32) = sum over n and s of t[n, c, s].
Status ChannelSums(float* out, const float* t, int64_t batch, int64_t channels, int64_t spatial,
                   cudaStream_t stream);
Status ChannelSums(float* out, const bf16* t, int64_t batch, int64_t channels, int64_t spatial,
                   cudaStream_t stream);

// ---- concatenation along dimension 1: a [outer, a_inner], b [outer, b_inner] ----
Status ConcatForward(float* out, const float* a, const float* b, int64_t outer, int64_t a_inner,
                     int64_t b_inner, cudaStream_t stream);
Status ConcatForward(bf16* out, const bf16* a, const bf16* b, int64_t outer, int64_t a_inner,
                     int64_t b_inner, cudaStream_t stream);
Status ConcatBackward(float* da, float* db, const float* dout, int64_t outer, int64_t a_inner,
                      int64_t b_inner, cudaStream_t stream);
Status ConcatBackward(bf16* da, bf16* db, const bf16* dout, int64_t outer, int64_t a_inner,
                      int64_t b_inner, cudaStream_t stream);

// ---- nearest upsampling: x [planes, d, h, w] -> y [planes, d*s, h*s, w*s] ----
Status UpsampleNearest3dForward(float* y, const float* x, int64_t planes, int64_t d, int64_t h,
                                int64_t w, int64_t scale, cudaStream_t stream);
Status UpsampleNearest3dForward(bf16* y, const bf16* x, int64_t planes, int64_t d, int64_t h,
                                int64_t w, int64_t scale, cudaStream_t stream);
// dx [planes, d, h, w]: each element the fp32 sum of its scale^3 block of dy, in block order.
Status UpsampleNearest3dBackward(float* dx, const float* dy, int64_t planes, int64_t d, int64_t h,
                                 int64_t w, int64_t scale, cudaStream_t stream);
Status UpsampleNearest3dBackward(bf16* dx, const bf16* dy, int64_t planes, int64_t d, int64_t h,
                                 int64_t w, int64_t scale, cudaStream_t stream);

// ---- max pooling, kernel = stride = k, floor mode: x [planes, d, h, w] -> y, indices ----
// indices: the flat d*h*w index of each window's maximum (the first on ties; NaN wins).
Status MaxPool3dForward(float* y, int32_t* indices, const float* x, int64_t planes, int64_t d,
                        int64_t h, int64_t w, int64_t k, cudaStream_t stream);
Status MaxPool3dForward(bf16* y, int32_t* indices, const bf16* x, int64_t planes, int64_t d,
                        int64_t h, int64_t w, int64_t k, cudaStream_t stream);
// dx [planes, volume]: dy[o] at indices[o], zeros elsewhere (windows do not overlap, so no two
// outputs write one element). An index outside [0, volume) is skipped and reported in *bad_index.
Status MaxPool3dBackward(float* dx, int32_t* bad_index, const float* dy, const int32_t* indices,
                         int64_t planes, int64_t volume, int64_t pooled_volume,
                         cudaStream_t stream);
Status MaxPool3dBackward(bf16* dx, int32_t* bad_index, const bf16* dy, const int32_t* indices,
                         int64_t planes, int64_t volume, int64_t pooled_volume,
                         cudaStream_t stream);

// ---- segmentation: logits [batch, classes, spatial], targets [batch, spatial] ----
// *loss (fp32) = the mean over batch*spatial voxels of logsumexp_c(logits) - logits[target];
// dlogits = (softmax - onehot(target)) * grad_scale / (batch*spatial) (null: loss only; it may
// alias logits), both times `weight` (a term of a weighted sum of losses). A target outside
// [0, classes) counts nothing and is reported in *bad_index.
// scratch: VoxelCrossEntropyScratch floats (per-block partial sums, added in block order).
Status VoxelCrossEntropy(float* loss, float* dlogits, float* scratch, int32_t* bad_index,
                         const float* logits, const int32_t* targets, int64_t batch,
                         int64_t classes, int64_t spatial, float grad_scale, cudaStream_t stream,
                         float weight = 1.0f);
Status VoxelCrossEntropy(float* loss, bf16* dlogits, float* scratch, int32_t* bad_index,
                         const bf16* logits, const int32_t* targets, int64_t batch, int64_t classes,
                         int64_t spatial, float grad_scale, cudaStream_t stream,
                         float weight = 1.0f);
// coarse [batch, d/f, h/f, w/f] = targets [batch, d, h, w] at f * k + f / 2 along each axis
// (downsample_labels; the extents multiples of f).
Status DownsampleLabels(int32_t* coarse, const int32_t* targets, int64_t batch, int64_t d,
                        int64_t h, int64_t w, int64_t factor, cudaStream_t stream);
// out = a + b over n floats (the model API's add_forward: a loss layer's sum of terms).
Status AddF32(float* out, const float* a, const float* b, int64_t n, cudaStream_t stream);
int64_t VoxelCrossEntropyScratch(int64_t batch, int64_t spatial);
// *score (fp32): hard Dice of argmax_c logits against targets per foreground class 1..classes-1
// over the whole batch, 2|P n T| / (|P| + |T|) (1 when the class is in neither), averaged.
// counts: DiceScoreCounts integers (per class: both, predicted, target; integer sums, so the
// order atomics take does not matter).
Status DiceScore(float* score, unsigned long long* counts, int32_t* bad_index,  // NOLINT
                 const float* logits, const int32_t* targets, int64_t batch, int64_t classes,
                 int64_t spatial, cudaStream_t stream);
Status DiceScore(float* score, unsigned long long* counts, int32_t* bad_index,  // NOLINT
                 const bf16* logits, const int32_t* targets, int64_t batch, int64_t classes,
                 int64_t spatial, cudaStream_t stream);
int64_t DiceScoreCounts(int64_t classes);

// The volume ops' kCuda kernels (volume_op_kernels.cc), as RegisterCudaKernels adds them.
Status RegisterVolumeCudaKernels(OpRegistry& registry);

// ---- depth windows (the convolutions' split along D): tensors viewed as [rows, depth, plane] ----
// dst [rows, depth, plane] = src's planes first .. first + depth - 1, zeros outside
// [0, src_depth) (a window with its padding planes made explicit).
Status CopyDepthWindow(float* dst, const float* src, int64_t rows, int64_t src_depth, int64_t plane,
                       int64_t first, int64_t depth, cudaStream_t stream);
Status CopyDepthWindow(bf16* dst, const bf16* src, int64_t rows, int64_t src_depth, int64_t plane,
                       int64_t first, int64_t depth, cudaStream_t stream);
// dst's planes first .. first + depth - 1 that lie in [0, dst_depth) set to src
// [rows, depth, plane]'s, or with `add` increased by them (in f32, bf16 rounded once).
Status PlaceDepthWindow(float* dst, const float* src, int64_t rows, int64_t dst_depth,
                        int64_t plane, int64_t first, int64_t depth, bool add, cudaStream_t stream);
Status PlaceDepthWindow(bf16* dst, const bf16* src, int64_t rows, int64_t dst_depth, int64_t plane,
                        int64_t first, int64_t depth, bool add, cudaStream_t stream);

// ---- convolutions (cuDNN): x [N, Cin, D, H, W], weight [Cout, Cin, kd, kh, kw], the same stride
// and zero padding on every axis, y [N, Cout, Do, Ho, Wo] as ops/volume_ops.h computes it ----
struct VolumeConvShape {
  int64_t batch = 1;
  int64_t in_channels = 1, in_d = 1, in_h = 1, in_w = 1;
  int64_t out_channels = 1, out_d = 1, out_h = 1, out_w = 1;
  int64_t kd = 1, kh = 1, kw = 1;
  int64_t stride = 1, padding = 0, padding_d = 0;  // padding_d: along D
};
// cuDNN's handle, bound to a stream, and a workspace it may grow. Thread-safe: calls from several
// threads run one at a time (they enqueue on the one stream). Unavailable when the build has no
// cuDNN or cuDNN cannot start.
//
// cuDNN's descriptors take 32-bit strides: a call's tensors hold fewer than 2^31 elements. A
// convolution whose input or output holds more than `max_elements` (default 2^31 - 1) runs split
// along D: chunks of output planes, each with the input planes it reads copied into a packed
// window with its depth padding made explicit (CopyDepthWindow), of at most min(max_elements,
// 2^28) elements each; the forward places each chunk's output, the input gradient adds each
// window's (planes read by two chunks get both), the weight gradient accumulates over the chunks
// (cuDNN's beta = 1; a bf16 one is rounded after each chunk). The windows are stream-ordered
// allocations freed after the call (scratch the memory model does not count). A single output
// plane whose window is beyond the limit is refused.
class CudnnConvolutions {
 public:
  static Result<std::unique_ptr<CudnnConvolutions>> Create(cudaStream_t stream,
                                                           int64_t max_elements = INT32_MAX);
  virtual ~CudnnConvolutions() = default;
  // y = conv(x, w) (no bias).
  virtual Status Forward(float* y, const float* x, const float* w, const VolumeConvShape& s) = 0;
  virtual Status Forward(bf16* y, const bf16* x, const bf16* w, const VolumeConvShape& s) = 0;
  // dx = conv^T(dy, w): conv3d's input gradient, and conv_transpose3d's forward (with the shape's
  // roles swapped by the caller).
  virtual Status BackwardData(float* dx, const float* dy, const float* w,
                              const VolumeConvShape& s) = 0;
  virtual Status BackwardData(bf16* dx, const bf16* dy, const bf16* w,
                              const VolumeConvShape& s) = 0;
  // dw = d<dy, conv(x, w)>/dw.
  virtual Status BackwardFilter(float* dw, const float* x, const float* dy,
                                const VolumeConvShape& s) = 0;
  virtual Status BackwardFilter(bf16* dw, const bf16* x, const bf16* dy,
                                const VolumeConvShape& s) = 0;
};

}  // namespace tessera::cuda

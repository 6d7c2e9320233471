// CUDA kernels: bf16 activations with fp32 accumulation, fp32 parameters, gradients and
// optimizer state. The GPU counterparts of ops/cpu/kernels.h, launched on a caller's stream.
//
// Each function is one launcher (the kernels themselves live in the matching .cu file): it checks
// its shape preconditions, launches on `stream`, checks the launch, and returns without waiting
// for the GPU. Conventions, as on the CPU:
//   - N is the number of rows (tokens, B*T), C the channels, V the vocabulary.
//   - Activations (x, layernorm outputs, qkv, attention output, MLP hidden) are bf16; anything a
//     later step reads back at full precision (layernorm mean/rstd, attention log-sum-exp, losses,
//     parameters, their gradients, Adam moments) is fp32. Every sum is accumulated in fp32.
//   - Outputs are overwritten unless the parameter says "accumulates" (+=).
//   - All pointers are device pointers valid for the stated sizes; outputs do not alias inputs
//     unless stated. bf16 rows of C elements are 16-byte aligned when C % 8 == 0 (kernels may use
//     vector loads only then).
//   - Errors: InvalidArgument for sizes a kernel does not support (named, with what to change);
//     Unavailable (core/cuda_check.h) when a launch fails.
//   - Reductions over rows (weight and bias gradients, norms, the mean loss) are deterministic
//     (fixed order, no atomics) unless the function says otherwise.
// Every kernel is checked against its CPU counterpart in tests/gpu/cuda_kernels_test.cc.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "core/status.h"

namespace tessera::cuda {

using bf16 = __nv_bfloat16;

// ---- casts ----
Status CastF32ToBf16(bf16* out, const float* in, int64_t n, cudaStream_t stream);
Status CastBf16ToF32(float* out, const bf16* in, int64_t n, cudaStream_t stream);

// ---- embedding ----
// out[b,t,:] = bf16(wte[tokens[b,t],:] + wpe[t,:]). A token outside [0, vocab) writes zeros for
// its row and its index (b*T+t, the first such) into *bad_token_index, which the caller
// initialises to -1 and reads after the stream reaches this point.
Status EmbeddingForward(bf16* out, int32_t* bad_token_index, const int32_t* tokens,
                        const float* wte, const float* wpe, int64_t batch, int64_t seq_len,
                        int64_t channels, int64_t vocab, cudaStream_t stream);
// Accumulates: dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[t,:] += sum over b of dout[b,t,:].
// REQUIRES: tokens validated by the forward. dwte's accumulation order may vary between runs
// (several rows may carry the same token); dwpe's does not.
Status EmbeddingBackward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens,
                         int64_t batch, int64_t seq_len, int64_t channels, cudaStream_t stream);

// ---- layernorm over the last dimension, eps 1e-5 ----
Status LayerNormForward(bf16* out, float* mean, float* rstd, const bf16* x, const float* weight,
                        const float* bias, int64_t rows, int64_t channels, cudaStream_t stream);
// dx accumulates when accumulate_dx, else is overwritten (dx may be the same buffer as dout only
// when !accumulate_dx). dweight and dbias are overwritten. scratch: LayerNormBackwardScratch
// floats (per-block partial sums, reduced in a fixed order).
Status LayerNormBackward(bf16* dx, float* dweight, float* dbias, float* scratch, const bf16* dout,
                         const bf16* x, const float* weight, const float* mean, const float* rstd,
                         int64_t rows, int64_t channels, bool accumulate_dx, cudaStream_t stream);
int64_t LayerNormBackwardScratch(int64_t rows, int64_t channels);

// ---- elementwise ----
// out = a + b (bf16 sum of the fp32 sum). out may alias a or b.
Status Add(bf16* out, const bf16* a, const bf16* b, int64_t n, cudaStream_t stream);
// GELU, tanh approximation. out may alias x.
Status GeluForward(bf16* out, const bf16* x, int64_t n, cudaStream_t stream);
// dx = dout * gelu'(x). dx may alias dout.
Status GeluBackward(bf16* dx, const bf16* dout, const bf16* x, int64_t n, cudaStream_t stream);
// Column sums of a row-major [rows, cols] bf16 matrix: out[cols] (fp32) is overwritten, or
// accumulates when `accumulate`. scratch: SumRowsScratch floats.
Status SumRows(float* out, float* scratch, const bf16* x, int64_t rows, int64_t cols,
               bool accumulate, cudaStream_t stream);
int64_t SumRowsScratch(int64_t rows, int64_t cols);

// ---- causal multi-head self-attention, flash style (never materialises T x T) ----
// qkv [B,T,3C] holds q, k, v side by side; head h uses channels [h*hs, (h+1)*hs) of each,
// hs = C / heads. out [B,T,C]; lse [B,heads,T] (fp32) is each softmax row's log-sum-exp (natural
// log, of the scores scaled by 1/sqrt(hs)), as on the CPU. Supported head sizes: 16, 32, 64, 128
// (InvalidArgument otherwise).
Status AttentionForward(bf16* out, float* lse, const bf16* qkv, int64_t batch, int64_t seq_len,
                        int64_t channels, int64_t heads, cudaStream_t stream);
// dqkv [B,T,3C] is overwritten. out and lse are the forward's. scratch: AttentionBackwardScratch
// bytes (e.g. fp32 dQ accumulators and the per-row dot(dout, out)).
Status AttentionBackward(bf16* dqkv, void* scratch, const bf16* dout, const bf16* out,
                         const bf16* qkv, const float* lse, int64_t batch, int64_t seq_len,
                         int64_t channels, int64_t heads, cudaStream_t stream);
int64_t AttentionBackwardScratch(int64_t batch, int64_t seq_len, int64_t channels, int64_t heads);

// ---- fused softmax + cross-entropy over the vocabulary ----
// logits [N, padded_vocab] (bf16), columns [0, vocab) real. For each row n:
//   losses[n] = logsumexp(logits[n, :V]) - logits[n, targets[n]]   (fp32, from fp32 math)
//   logits[n, :V] is overwritten by (softmax - onehot(targets[n])) * grad_scale / N, the
//   gradient of grad_scale * mean(losses); logits[n, V:] by zeros.
// When `write_gradient` is false the logits are left alone. A target outside [0, V) gives a NaN
// loss for its row and its index (the first such) in *bad_target_index (initialised to -1 by the
// caller).
Status SoftmaxCrossEntropy(bf16* logits, float* losses, int32_t* bad_target_index,
                           const int32_t* targets, int64_t rows, int64_t vocab,
                           int64_t padded_vocab, float grad_scale, bool write_gradient,
                           cudaStream_t stream);
// *out = mean of x[0, n) (fp32, one block, fixed order).
Status Mean(float* out, const float* x, int64_t n, cudaStream_t stream);

// ---- optimizer, over flat fp32 parameter groups ----
struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};
// Weight-decayed element ranges [begin, end) of a group, relative to element_offset.
inline constexpr int kMaxDecayRanges = 32;
struct DecayRanges {
  int count = 0;
  int64_t begin[kMaxDecayRanges] = {};
  int64_t end[kMaxDecayRanges] = {};
};
// The arithmetic of cpu::AdamWUpdate (torch.optim.AdamW), element for element:
//   g = grad * (*grad_scale); p *= 1 - lr * wd (inside decay ranges only);
//   m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//   p -= (lr / (1 - b1^step)) * m / (sqrt(v) / sqrt(1 - b2^step) + eps)
// lr, step and grad_scale are device scalars (graph objects); grad_scale may be null (1).
// Element i of the group is element element_offset + i of the full group the ranges describe.
Status AdamWUpdate(float* param, float* m, float* v, const float* grad, int64_t n,
                   const AdamWConfig& config, const float* lr, const int64_t* step,
                   const float* grad_scale, const DecayRanges& decay, int64_t element_offset,
                   cudaStream_t stream);
// *out = sum of x[i]^2 (fp32 partials per block, reduced in a fixed order in double).
// scratch: SumOfSquaresScratch bytes.
Status SumOfSquares(float* out, void* scratch, const float* x, int64_t n, cudaStream_t stream);
int64_t SumOfSquaresScratch(int64_t n);
// norm = sqrt(sum of *sums[i]); scale = max_norm > 0 ? min(1, max_norm / (norm + 1e-6)) : 1,
// as cpu::ClipScale. At most kMaxClipInputs sums.
inline constexpr int kMaxClipInputs = 512;
Status ClipScale(float* scale, float* norm, const float* const* sums, int count, float max_norm,
                 cudaStream_t stream);

}  // namespace tessera::cuda

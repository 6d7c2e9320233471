// CPU kernels: fp32, row-major, parallel over the calling thread's TBB arena.
//
// Each function is one op's forward or backward on raw pointers; ops/cpu/cpu_kernels.cc wraps
// them as registry kernels, and the transformer layer kernels compose them. Conventions:
//   - N is the number of rows (tokens, B*T), C the channels, V the vocabulary.
//   - Outputs are overwritten unless the parameter says "accumulates" (+=).
//   - Reductions over rows (weight and bias gradients, norms, mean losses) sum fixed chunks in a
//     fixed order, so results do not depend on the number of threads or on scheduling.
//   - REQUIRES: pointers are valid for the stated sizes; outputs do not alias inputs unless
//     stated.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/status.h"
#include "ops/cpu/blas.h"

namespace tessera::cpu {

// ---- embedding ----
// out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]. InvalidArgument names the first token >= V.
Status EmbeddingForward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                        int64_t batch, int64_t seq_len, int64_t channels, int64_t vocab);
// Accumulates: dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[t,:] += dout[b,t,:].
// REQUIRES: tokens already validated by the forward (< V).
void EmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                       int64_t batch, int64_t seq_len, int64_t channels);

// ---- layernorm (over the last dimension, eps 1e-5) ----
inline constexpr float kLayerNormEps = 1e-5f;
void LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* weight,
                      const float* bias, int64_t rows, int64_t channels);
// dx accumulates when accumulate_dx, else is overwritten; dweight and dbias are overwritten.
void LayerNormBackward(float* dx, float* dweight, float* dbias, const float* dout, const float* x,
                       const float* weight, const float* mean, const float* rstd, int64_t rows,
                       int64_t channels, bool accumulate_dx);

// ---- linear: out[N,OC] = x[N,K] @ w[OC,K]^T + bias[OC] (+ residual[N,OC]) ----
// bias and residual may be null. residual may alias out (out += x w^T + b).
void LinearForward(float* out, const float* x, const float* weight, const float* bias,
                   const float* residual, int64_t rows, int64_t in_features, int64_t out_features,
                   int64_t split_min_flops);
// dx (null to skip) accumulates when accumulate_dx; dweight (null to skip, with dbias: the input
// gradient alone) is overwritten; dbias (null to skip) is overwritten.
void LinearBackward(float* dx, float* dweight, float* dbias, const float* dout, const float* x,
                    const float* weight, int64_t rows, int64_t in_features, int64_t out_features,
                    bool accumulate_dx, int64_t split_min_flops);

// ---- matmul: c[M,N] = a[M,K] @ b[K,N] ----
void MatmulForward(float* c, const float* a, const float* b, int64_t m, int64_t k, int64_t n,
                   int64_t split_min_flops);
// da = dc @ b^T, db = a^T @ dc (overwritten).
void MatmulBackward(float* da, float* db, const float* dc, const float* a, const float* b,
                    int64_t m, int64_t k, int64_t n, int64_t split_min_flops);

// ---- causal multi-head self-attention ----
// qkv [B,T,3C] holds q, k, v side by side; head h uses channels [h*hs, (h+1)*hs) of each, with
// hs = C / heads. out [B,T,C]; lse [B,heads,T] is each softmax row's log-sum-exp, kept so the
// backward can rebuild the probabilities without storing the T x T matrix.
void AttentionForward(float* out, float* lse, const float* qkv, int64_t batch, int64_t seq_len,
                      int64_t channels, int64_t heads);
// dqkv [B,T,3C] is overwritten.
void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                       int64_t batch, int64_t seq_len, int64_t channels, int64_t heads);

// ---- GELU, tanh approximation ----
void GeluForward(float* out, const float* x, int64_t n);
// dx = dout * gelu'(x). dx may alias dout.
void GeluBackward(float* dx, const float* dout, const float* x, int64_t n);
// GeluBackward, also writing GeluForward's out (bit for bit) in the same pass: a backward that
// rebuilds the forward's GELU values pays one tanh per element for both. dx may alias dout.
void GeluBackwardRebuilding(float* dx, float* out, const float* dout, const float* x, int64_t n);

// ---- elementwise ----
// out = a + b. out may alias a or b.
void Add(float* out, const float* a, const float* b, int64_t n);

// ---- fused softmax + cross-entropy over the vocabulary ----
// For each row n: loss_n = logsumexp(logits[n,:]) - logits[n, targets[n]], and
// dlogits[n,:] = (softmax(logits[n,:]) - onehot(targets[n])) * grad_scale / rows, the gradient
// of grad_scale * mean(loss). dlogits may alias logits (computed in place); it may be null to
// compute the loss only. Returns the mean loss over rows. InvalidArgument names the first target
// outside [0, V).
Result<float> SoftmaxCrossEntropy(float* dlogits, const float* logits, const int32_t* targets,
                                  int64_t rows, int64_t vocab, float grad_scale);

// ---- optimizers, on flat parameter groups ----
struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};
// Instruction sets the optimizer kernels pick at run time (the build may target an older CPU than
// the one it runs on, and the benchmark compares the paths on one machine).
enum class SimdLevel : uint8_t { kScalar, kAvx2, kAvx512 };
// The widest level this CPU supports (x86-64: cpuid; elsewhere kScalar).
SimdLevel BestSimdLevel();
std::string_view SimdLevelName(SimdLevel level);
// How AdamWUpdate runs: the instruction set (capped at BestSimdLevel()) and whether the group is
// split across the calling thread's TBB arena.
struct KernelExecution {
  SimdLevel simd = BestSimdLevel();
  bool parallel = true;
};

// One fused pass, element for element the arithmetic of torch.optim.AdamW (foreach=False):
//   g = grad * grad_scale; p *= 1 - lr * wd (inside decay ranges only);
//   m = beta1 * m + (1 - beta1) * g; v = beta2 * v + (1 - beta2) * g^2;
//   p -= (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps).
// decay_ranges holds [begin, end) element pairs of the group that take weight decay;
// element_offset is the group's first element's index (for a shard of a larger group).
// REQUIRES: step >= 1.
void AdamWUpdate(float* param, float* m, float* v, const float* grad, int64_t n,
                 const AdamWConfig& config, float lr, int64_t step, float grad_scale,
                 const int64_t* decay_ranges, int64_t num_decay_ranges, int64_t element_offset,
                 const KernelExecution& execution = {});
// 1-bit Adam (DeepSpeed's OnebitAdam): Adam without bias correction, its weight decay added to
// the update (inside decay ranges only, as AdamWUpdate's: [begin, end) pairs of the group,
// element_offset the first element's index in it). Per element, in this order:
//   warm-up:   g = grad * grad_scale; m = m * beta1 + (1 - beta1) * g;
//              v = v * beta2 + ((1 - beta2) * g) * g;  then the update below;
//   momentum:  m = m * beta1 + (1 - beta1) * (grad * grad_scale)   (the compressed phase's local
//              momentum, before its compressed all-reduce; v stays frozen);
//   update:    param = param - lr * (m / (sqrt(v) + eps) + wd * param).
struct OneBitAdamConfig {
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.f;
};
void OneBitAdamWarmup(float* param, float* m, float* v, const float* grad, int64_t n,
                      const OneBitAdamConfig& config, float lr, float grad_scale,
                      const int64_t* decay_ranges, int64_t num_decay_ranges,
                      int64_t element_offset);
void OneBitAdamMomentum(float* m, const float* grad, int64_t n, float beta1, float grad_scale);
void OneBitAdamFrozenUpdate(float* param, const float* m, const float* v, int64_t n,
                            const OneBitAdamConfig& config, float lr, const int64_t* decay_ranges,
                            int64_t num_decay_ranges, int64_t element_offset);
// 0/1 Adam (Lu et al. 2022, DeepSpeed's ZeroOneAdam; planner/zero_one_adam.h), weight decay
// inside decay ranges as OneBitAdam's. Per element, in this order (d = sqrt(v) + eps):
//   compressed step: m = m * beta1 + (1 - beta1) * grad (grad: the ranks' compressed average),
//                    then OneBitAdam's update (v frozen or kept);
//   local step:      m = m * beta1 + (1 - beta1) * (grad * grad_scale);
//                    param = param - lr * (m / d + wd * param);
//     with sync:     then delta = param - start; param = start (the interval's start, the same
//                    bits on every rank); start = delta * d (what the ranks average);
//   sync end:        (param the interval's start, start the ranks' average of delta * d)
//                    m = -start / lr_sum - wd * param * d;  param = param + start / d;
//                    start = param (the next interval's).
// DeepSpeed's accumulates the updates and subtracts them again (p - u), which rounds each rank
// to a slightly different start; keeping the start keeps the replicas' bits equal. The sync's
// momentum leaves the weight decay out (exact at one local step a sync, else the decay at the
// interval's start): DeepSpeed's folds it into the momentum.
void ZeroOneAdamLocal(float* param, float* m, const float* v, float* start, const float* grad,
                      int64_t n, const OneBitAdamConfig& config, float lr, float grad_scale,
                      bool sync, const int64_t* decay_ranges, int64_t num_decay_ranges,
                      int64_t element_offset);
void ZeroOneAdamSyncEnd(float* param, float* m, const float* v, float* start, int64_t n,
                        const OneBitAdamConfig& config, float lr_sum, const int64_t* decay_ranges,
                        int64_t num_decay_ranges, int64_t element_offset);
// x *= scale
void ScaleInPlace(float* x, int64_t n, float scale);
// p -= lr * (grad * grad_scale + weight_decay * p)
void SgdUpdate(float* param, const float* grad, int64_t n, float lr, float weight_decay,
               float grad_scale);

// Sum of squares, accumulated in double over fixed chunks (2^16 elements; within each, eight
// interleaved partial sums added in order: core/lane_sum.h), the chunks' sums added in order:
// the same bits for any thread count and CPU.
double SumOfSquares(const float* x, int64_t n);
// The clipping factor torch.nn.utils.clip_grad_norm_ applies: min(1, max_norm / (norm + 1e-6)).
// max_norm <= 0 disables clipping (returns 1).
float ClipScale(double norm, double max_norm);

// Column sums of a row-major [rows, cols] matrix into out[cols] (overwritten).
void SumRows(float* out, const float* x, int64_t rows, int64_t cols);

}  // namespace tessera::cpu

// Causal multi-head self-attention that keeps only the log-sum-exp of each softmax row.
//
// Forward, per (batch, head):  S = Q K^T / sqrt(hs);  P = causal_softmax(S);  O = P V.
// Backward rebuilds P from Q, K and the saved lse instead of storing the T x T matrix (the
// flash-attention trade: one extra Q K^T product for O(T) instead of O(T^2) saved memory):
//   dP = dO V^T;  D_i = sum_j P_ij dP_ij;  dS = P * (dP - D);
//   dQ = dS K / sqrt(hs);  dK = dS^T Q / sqrt(hs);  dV = P^T dO.
// (batch, head) pairs run in parallel, each with single-threaded GEMMs on strided views of qkv.
#include <cmath>
#include <limits>
#include <vector>

#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_for.h>

#include "ops/cpu/kernels.h"

namespace tessera::cpu {

namespace {

struct HeadView {
  int64_t t, hs, qkv_stride;
  const float* q;
  const float* k;
  const float* v;
};

HeadView ViewHead(const float* qkv, int64_t b, int64_t h, int64_t seq_len, int64_t channels,
                  int64_t heads) {
  const int64_t hs = channels / heads;
  const float* base = qkv + b * seq_len * 3 * channels + h * hs;
  return {seq_len, hs, 3 * channels, base, base + channels, base + 2 * channels};
}

// scores[T,T] = Q K^T * scale (all of it; the causal mask is applied by the callers).
void Scores(float* scores, const HeadView& head, float scale) {
  Gemm(Transpose::kNo, Transpose::kYes, head.t, head.t, head.hs, scale, head.q, head.qkv_stride,
       head.k, head.qkv_stride, 0.0f, scores, head.t, kNeverSplit);
}

// Runs fn(head, b, h, scratch) for every (batch, head) pair in parallel; scratch holds
// scratch_floats floats private to the running thread.
template <typename Fn>
void ForEachHead(const float* qkv, int64_t batch, int64_t seq_len, int64_t channels, int64_t heads,
                 int64_t scratch_floats, const Fn& fn) {
  tbb::enumerable_thread_specific<std::vector<float>> scratch;
  tbb::parallel_for(int64_t{0}, batch * heads, [&](int64_t pair) {
    const int64_t b = pair / heads, h = pair % heads;
    std::vector<float>& buffer = scratch.local();
    if (static_cast<int64_t>(buffer.size()) < scratch_floats) {
      buffer.resize(static_cast<size_t>(scratch_floats));
    }
    fn(ViewHead(qkv, b, h, seq_len, channels, heads), b, h, buffer.data());
  });
}

float SoftmaxScale(int64_t channels, int64_t heads) {
  const int64_t head_size = channels / heads;  // whole: channels split evenly over the heads
  return 1.0f / std::sqrt(static_cast<float>(head_size));
}

}  // namespace

void AttentionForward(float* out, float* lse, const float* qkv, int64_t batch, int64_t seq_len,
                      int64_t channels, int64_t heads) {
  const int64_t t_len = seq_len;
  const float scale = SoftmaxScale(channels, heads);
  ForEachHead(qkv, batch, seq_len, channels, heads, t_len * t_len,
              [&](const HeadView& head, int64_t b, int64_t h, float* p) {
                Scores(p, head, scale);
                float* lse_row = lse + (b * heads + h) * t_len;
                for (int64_t i = 0; i < t_len; ++i) {
                  float* row = p + i * t_len;
                  float max_value = -std::numeric_limits<float>::infinity();
                  for (int64_t j = 0; j <= i; ++j) max_value = std::max(max_value, row[j]);
                  float sum = 0.0f;
                  for (int64_t j = 0; j <= i; ++j) {
                    row[j] = std::exp(row[j] - max_value);
                    sum += row[j];
                  }
                  const float inv_sum = 1.0f / sum;
                  for (int64_t j = 0; j <= i; ++j) row[j] *= inv_sum;
                  for (int64_t j = i + 1; j < t_len; ++j) row[j] = 0.0f;
                  lse_row[i] = max_value + std::log(sum);
                }
                float* o = out + b * t_len * channels + h * head.hs;
                Gemm(Transpose::kNo, Transpose::kNo, t_len, head.hs, t_len, 1.0f, p, t_len, head.v,
                     head.qkv_stride, 0.0f, o, channels, kNeverSplit);
              });
}

void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                       int64_t batch, int64_t seq_len, int64_t channels, int64_t heads) {
  const int64_t t_len = seq_len;
  const float scale = SoftmaxScale(channels, heads);
  ForEachHead(qkv, batch, seq_len, channels, heads, 2 * t_len * t_len,
              [&](const HeadView& head, int64_t b, int64_t h, float* p) {
                float* dp = p + t_len * t_len;
                const float* lse_row = lse + (b * heads + h) * t_len;
                const float* d_o = dout + b * t_len * channels + h * head.hs;

                Scores(p, head, scale);
                for (int64_t i = 0; i < t_len; ++i) {
                  float* row = p + i * t_len;
                  for (int64_t j = 0; j <= i; ++j) row[j] = std::exp(row[j] - lse_row[i]);
                  for (int64_t j = i + 1; j < t_len; ++j) row[j] = 0.0f;
                }
                // dP = dO V^T
                Gemm(Transpose::kNo, Transpose::kYes, t_len, t_len, head.hs, 1.0f, d_o, channels,
                     head.v, head.qkv_stride, 0.0f, dp, t_len, kNeverSplit);
                // dS = P * (dP - rowsum(P * dP)), written over dP.
                for (int64_t i = 0; i < t_len; ++i) {
                  const float* p_row = p + i * t_len;
                  float* ds_row = dp + i * t_len;
                  float d = 0.0f;
                  for (int64_t j = 0; j <= i; ++j) d += p_row[j] * ds_row[j];
                  for (int64_t j = 0; j <= i; ++j) ds_row[j] = p_row[j] * (ds_row[j] - d);
                  for (int64_t j = i + 1; j < t_len; ++j) ds_row[j] = 0.0f;
                }
                float* dq = dqkv + b * t_len * 3 * channels + h * head.hs;
                float* dk = dq + channels;
                float* dv = dq + 2 * channels;
                const int64_t stride = head.qkv_stride;
                Gemm(Transpose::kNo, Transpose::kNo, t_len, head.hs, t_len, scale, dp, t_len,
                     head.k, stride, 0.0f, dq, stride, kNeverSplit);
                Gemm(Transpose::kYes, Transpose::kNo, t_len, head.hs, t_len, scale, dp, t_len,
                     head.q, stride, 0.0f, dk, stride, kNeverSplit);
                Gemm(Transpose::kYes, Transpose::kNo, t_len, head.hs, t_len, 1.0f, p, t_len, d_o,
                     channels, 0.0f, dv, stride, kNeverSplit);
              });
}

}  // namespace tessera::cpu

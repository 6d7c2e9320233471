// Causal multi-head self-attention that keeps only the log-sum-exp of each softmax row.
//
// Forward, per (batch, head):  S = Q K^T / sqrt(hs);  P = causal_softmax(S);  O = P V.
// Backward rebuilds P from Q, K and the saved lse instead of storing the T x T matrix (the
// flash-attention trade: one extra Q K^T product for O(T) instead of O(T^2) saved memory); both
// run a block of query rows at a time against the keys the block can see:
//   dP = dO V^T;  D_i = sum_j P_ij dP_ij;  dS = P * (dP - D);
//   dQ = dS K / sqrt(hs);  dK = dS^T Q / sqrt(hs);  dV = P^T dO.
// (batch, head) pairs run in parallel, each with single-threaded GEMMs on strided views of qkv.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_for.h>

#include "ops/cpu/kernels.h"

namespace tessera::cpu {

namespace {

struct HeadView {
  int64_t hs, qkv_stride;
  const float* q;
  const float* k;
  const float* v;
};

HeadView ViewHead(const float* qkv, int64_t b, int64_t h, int64_t seq_len, int64_t channels,
                  int64_t heads) {
  const int64_t hs = channels / heads;
  const float* base = qkv + b * seq_len * 3 * channels + h * hs;
  return {hs, 3 * channels, base, base + channels, base + 2 * channels};
}

// Query rows are taken kQueryBlock at a time, each block against the keys it can see (causal:
// those up to its last row), so a thread's scratch is kQueryBlock rows of scores (two in the
// backward), not T x T: 64 x 4096 floats, 1 MiB, where the whole matrix would take 64 MiB.
constexpr int64_t kQueryBlock = 64;

// scores[i1 - i0, i1] = Q[i0:i1] K[0:i1]^T * scale (the causal mask is applied by the callers).
void Scores(float* scores, const HeadView& head, int64_t i0, int64_t i1, float scale) {
  Gemm(Transpose::kNo, Transpose::kYes, i1 - i0, i1, head.hs, scale, head.q + i0 * head.qkv_stride,
       head.qkv_stride, head.k, head.qkv_stride, 0.0f, scores, i1, kNeverSplit);
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
  ForEachHead(qkv, batch, seq_len, channels, heads, kQueryBlock * t_len,
              [&](const HeadView& head, int64_t b, int64_t h, float* p) {
                float* lse_head = lse + (b * heads + h) * t_len;
                float* o = out + b * t_len * channels + h * head.hs;
                for (int64_t i0 = 0; i0 < t_len; i0 += kQueryBlock) {
                  // Rows [i0, i1) see keys [0, i1): P [rows, i1], rows of stride i1.
                  const int64_t i1 = std::min(t_len, i0 + kQueryBlock), rows = i1 - i0;
                  Scores(p, head, i0, i1, scale);
                  for (int64_t i = i0; i < i1; ++i) {
                    float* row = p + (i - i0) * i1;
                    float max_value = -std::numeric_limits<float>::infinity();
                    for (int64_t j = 0; j <= i; ++j) max_value = std::max(max_value, row[j]);
                    float sum = 0.0f;
                    for (int64_t j = 0; j <= i; ++j) {
                      row[j] = std::exp(row[j] - max_value);
                      sum += row[j];
                    }
                    const float inv_sum = 1.0f / sum;
                    for (int64_t j = 0; j <= i; ++j) row[j] *= inv_sum;
                    for (int64_t j = i + 1; j < i1; ++j) row[j] = 0.0f;
                    lse_head[i] = max_value + std::log(sum);
                  }
                  Gemm(Transpose::kNo, Transpose::kNo, rows, head.hs, i1, 1.0f, p, i1, head.v,
                       head.qkv_stride, 0.0f, o + i0 * channels, channels, kNeverSplit);
                }
              });
}

void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                       int64_t batch, int64_t seq_len, int64_t channels, int64_t heads) {
  const int64_t t_len = seq_len;
  const float scale = SoftmaxScale(channels, heads);
  ForEachHead(qkv, batch, seq_len, channels, heads, 2 * kQueryBlock * t_len,
              [&](const HeadView& head, int64_t b, int64_t h, float* p) {
                float* dp = p + kQueryBlock * t_len;
                const float* lse_head = lse + (b * heads + h) * t_len;
                const float* d_o = dout + b * t_len * channels + h * head.hs;
                float* dq = dqkv + b * t_len * 3 * channels + h * head.hs;
                float* dk = dq + channels;
                float* dv = dq + 2 * channels;
                const int64_t stride = head.qkv_stride;
                // dK and dV add up over the query blocks, in block order.
                for (int64_t t = 0; t < t_len; ++t) {
                  std::fill(dk + t * stride, dk + t * stride + head.hs, 0.0f);
                  std::fill(dv + t * stride, dv + t * stride + head.hs, 0.0f);
                }
                for (int64_t i0 = 0; i0 < t_len; i0 += kQueryBlock) {
                  const int64_t i1 = std::min(t_len, i0 + kQueryBlock), rows = i1 - i0;
                  Scores(p, head, i0, i1, scale);
                  for (int64_t i = i0; i < i1; ++i) {
                    float* row = p + (i - i0) * i1;
                    for (int64_t j = 0; j <= i; ++j) row[j] = std::exp(row[j] - lse_head[i]);
                    for (int64_t j = i + 1; j < i1; ++j) row[j] = 0.0f;
                  }
                  // dP = dO V^T
                  Gemm(Transpose::kNo, Transpose::kYes, rows, i1, head.hs, 1.0f,
                       d_o + i0 * channels, channels, head.v, stride, 0.0f, dp, i1, kNeverSplit);
                  // dS = P * (dP - rowsum(P * dP)), written over dP.
                  for (int64_t i = i0; i < i1; ++i) {
                    const float* p_row = p + (i - i0) * i1;
                    float* ds_row = dp + (i - i0) * i1;
                    float d = 0.0f;
                    for (int64_t j = 0; j <= i; ++j) d += p_row[j] * ds_row[j];
                    for (int64_t j = 0; j <= i; ++j) ds_row[j] = p_row[j] * (ds_row[j] - d);
                    for (int64_t j = i + 1; j < i1; ++j) ds_row[j] = 0.0f;
                  }
                  Gemm(Transpose::kNo, Transpose::kNo, rows, head.hs, i1, scale, dp, i1, head.k,
                       stride, 0.0f, dq + i0 * stride, stride, kNeverSplit);
                  Gemm(Transpose::kYes, Transpose::kNo, i1, head.hs, rows, scale, dp, i1,
                       head.q + i0 * stride, stride, 1.0f, dk, stride, kNeverSplit);
                  Gemm(Transpose::kYes, Transpose::kNo, i1, head.hs, rows, 1.0f, p, i1,
                       d_o + i0 * channels, channels, 1.0f, dv, stride, kNeverSplit);
                }
              });
}

}  // namespace tessera::cpu

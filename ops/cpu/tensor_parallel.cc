#include "ops/cpu/tensor_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ops/cpu/blas.h"
#include "ops/cpu/kernel_glue.h"
#include "ops/cpu/kernels.h"
#include "ops/cpu/parallel.h"
#include "ops/standard_ops.h"

namespace tessera {

namespace {

using cpu::Gemm;
using cpu::kNeverSplit;
using cpu::Transpose;
using cpu::detail::F;
using cpu::detail::I;
using cpu::detail::ParallelChunks;
using cpu::detail::ParallelFor;
using cpu::detail::Register;
using cpu::detail::Tensors;

constexpr int64_t kRowGrain = 16;
constexpr int64_t kChannelBlock = 64;

int64_t TensorRank(const Attrs& attrs) { return attrs.GetInt(kTensorRankAttr, 0); }

Status CheckIds(const int32_t* ids, int64_t n, int64_t limit, const char* what) {
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= limit) {
      return InvalidArgument("{} id {} at index {} is outside the vocabulary [0, {})", what, ids[i],
                             i, limit);
    }
  }
  return Status::Ok();
}

// The row of `id` in the shard of rank `rank` holding `rows` rows, or -1 when another rank's.
int64_t ShardRow(int64_t id, int64_t rank, int64_t rows) {
  const int64_t local = id - rank * rows;
  return local >= 0 && local < rows ? local : -1;
}

Status VocabShardEmbeddingForward(const KernelContext&, const Tensors& in, const Tensors& out,
                                  const Attrs& attrs) {
  const int64_t rows = in[1].shape()[0], c = in[1].shape()[1], n = in[0].numel();
  TESSERA_RETURN_IF_ERROR(CheckIds(I(in[0]), n, std::numeric_limits<int32_t>::max(), "token"));
  const int64_t rank = TensorRank(attrs);
  ParallelFor(n, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* y = F(out[0]) + i * c;
      const int64_t row = ShardRow(I(in[0])[i], rank, rows);
      if (row < 0) {
        std::fill(y, y + c, 0.0f);
      } else {
        std::memcpy(y, F(in[1]) + row * c, static_cast<size_t>(c) * sizeof(float));
      }
    }
  });
  return Status::Ok();
}

Status VocabShardEmbeddingBackward(const KernelContext&, const Tensors& in, const Tensors& out,
                                   const Attrs& attrs) {
  const int64_t rows = in[2].shape()[0], c = in[2].shape()[1], n = in[1].numel();
  const int64_t rank = TensorRank(attrs);
  float* dwte = F(out[0]);
  std::fill(dwte, dwte + out[0].numel(), 0.0f);
  // Over channel blocks: a token repeated adds to the same row, so splitting rows would race;
  // every row's sum runs in token order.
  ParallelChunks(c, kChannelBlock, [&](int64_t, int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = ShardRow(I(in[1])[i], rank, rows);
      if (row < 0) continue;
      const float* g = F(in[0]) + i * c;
      float* d = dwte + row * c;
      for (int64_t j = c0; j < c1; ++j) d[j] += g[j];
    }
  });
  return Status::Ok();
}

// The first position of a sequence shard of `seq` positions (attribute sequence_rank).
int64_t FirstPosition(const Attrs& attrs, int64_t seq) {
  return attrs.GetInt(kSequenceRankAttr, 0) * seq;
}

Status PositionAddForward(const KernelContext&, const Tensors& in, const Tensors& out,
                          const Attrs& attrs) {
  const int64_t seq = in[0].shape()[1], c = in[0].shape()[2], n = in[0].numel() / c;
  const float* wpe = F(in[1]) + FirstPosition(attrs, seq) * c;
  ParallelFor(n, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* x = F(in[0]) + i * c;
      const float* p = wpe + (i % seq) * c;
      float* y = F(out[0]) + i * c;
      for (int64_t j = 0; j < c; ++j) y[j] = x[j] + p[j];
    }
  });
  return Status::Ok();
}

Status PositionAddBackward(const KernelContext&, const Tensors& in, const Tensors& out,
                           const Attrs& attrs) {
  const int64_t batch = in[0].shape()[0], seq = in[0].shape()[1], c = in[0].shape()[2];
  if (out[0].raw_data() != in[0].raw_data()) {
    std::memcpy(out[0].raw_data(), in[0].raw_data(), static_cast<size_t>(in[0].bytes()));
  }
  // Each position's row summed over the batch in batch order (dout as [B, S C]); zero elsewhere.
  float* dwpe = F(out[1]);
  std::fill(dwpe, dwpe + out[1].numel(), 0.0f);
  cpu::SumRows(dwpe + FirstPosition(attrs, seq) * c, F(in[0]), batch, seq * c);
  return Status::Ok();
}

// heads_to_chunks and chunks_to_heads: x [rows, G, H, d] and chunks [P, rows, G, Hp, d], head h
// of x at block h / Hp, head h % Hp; `to_chunks` copies x into the chunks (padding zero),
// otherwise the chunks into x.
Status MoveHeadChunks(const Tensor& x, const Tensor& chunks, const Attrs& attrs, bool to_chunks) {
  const int64_t heads = attrs.GetInt("heads", 1), ranks = attrs.GetInt("ranks", 1);
  const int64_t groups = attrs.GetInt("groups", 1);
  const int64_t per_rank = (heads + ranks - 1) / ranks;
  const int64_t rows = x.numel() / x.shape()[-1];
  const int64_t d = x.shape()[-1] / (groups * heads);
  float* xs = F(x);
  float* cs = F(chunks);
  if (to_chunks) std::fill(cs, cs + chunks.numel(), 0.0f);
  const size_t bytes = static_cast<size_t>(d) * sizeof(float);
  ParallelFor(rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t h = 0; h < heads; ++h) {
          float* whole = xs + ((i * groups + g) * heads + h) * d;
          float* block =
              cs + (((h / per_rank * rows + i) * groups + g) * per_rank + h % per_rank) * d;
          if (to_chunks) {
            std::memcpy(block, whole, bytes);
          } else {
            std::memcpy(whole, block, bytes);
          }
        }
      }
    }
  });
  return Status::Ok();
}

// heads_linear: per block j, the rows' first n_j heads (n_j = those of the group under H) times
// their columns of w. in: chunks [P, R, Hp d]; w [O, H d].
struct HeadBlocks {
  int64_t ranks, rows, per_rank_width, head_size, heads, outputs;
  int64_t Width(int64_t j) const {  // the valid columns of block j
    const int64_t per_rank = per_rank_width / head_size;
    return std::clamp<int64_t>(heads - j * per_rank, 0, per_rank) * head_size;
  }
};

HeadBlocks HeadBlocksOf(const Tensor& chunks, const Tensor& w, const Attrs& attrs) {
  HeadBlocks b{};
  b.ranks = chunks.shape()[0];
  b.per_rank_width = chunks.shape()[-1];
  b.rows = chunks.numel() / b.per_rank_width / b.ranks;
  b.heads = attrs.GetInt("heads", 1);
  b.head_size = w.shape()[1] / b.heads;
  b.outputs = w.shape()[0];
  return b;
}

Status HeadsLinearForward(const KernelContext& context, const Tensors& in, const Tensors& out,
                          const Attrs& attrs) {
  const HeadBlocks b = HeadBlocksOf(in[0], in[1], attrs);
  float* y = F(out[0]);
  for (int64_t r = 0; r < b.rows; ++r) {
    std::memcpy(y + r * b.outputs, F(in[2]), static_cast<size_t>(b.outputs) * sizeof(float));
  }
  for (int64_t j = 0; j < b.ranks; ++j) {
    if (b.Width(j) == 0) continue;
    cpu::Gemm(cpu::Transpose::kNo, cpu::Transpose::kYes, b.rows, b.outputs, b.Width(j), 1.0f,
              F(in[0]) + j * b.rows * b.per_rank_width, b.per_rank_width,
              F(in[1]) + j * b.per_rank_width, b.heads * b.head_size, 1.0f, y, b.outputs,
              context.gemm_split_min_flops);
  }
  return Status::Ok();
}

Status HeadsLinearBackward(const KernelContext& context, const Tensors& in, const Tensors& out,
                           const Attrs& attrs) {
  const HeadBlocks b = HeadBlocksOf(in[1], in[2], attrs);
  const float* dout = F(in[0]);
  std::fill(F(out[0]), F(out[0]) + out[0].numel(), 0.0f);
  std::fill(F(out[1]), F(out[1]) + out[1].numel(), 0.0f);
  const int64_t ldw = b.heads * b.head_size;
  for (int64_t j = 0; j < b.ranks; ++j) {
    if (b.Width(j) == 0) continue;
    // dchunks_j = dout w_j; dw_j = dout^T chunks_j.
    cpu::Gemm(cpu::Transpose::kNo, cpu::Transpose::kNo, b.rows, b.Width(j), b.outputs, 1.0f, dout,
              b.outputs, F(in[2]) + j * b.per_rank_width, ldw, 0.0f,
              F(out[0]) + j * b.rows * b.per_rank_width, b.per_rank_width,
              context.gemm_split_min_flops);
    cpu::Gemm(cpu::Transpose::kYes, cpu::Transpose::kNo, b.outputs, b.Width(j), b.rows, 1.0f, dout,
              b.outputs, F(in[1]) + j * b.rows * b.per_rank_width, b.per_rank_width, 0.0f,
              F(out[1]) + j * b.per_rank_width, ldw, context.gemm_split_min_flops);
  }
  cpu::SumRows(F(out[2]), dout, b.rows, b.outputs);  // as linear_backward's bias gradient
  return Status::Ok();
}

Status VocabShardLogitStats(const KernelContext&, const Tensors& in, const Tensors& out,
                            const Attrs& attrs) {
  const int64_t rows = in[0].shape()[0], shard = in[0].shape()[1];
  const int64_t width = out[0].shape()[1], ranks = width - 1, rank = TensorRank(attrs);
  TESSERA_RETURN_IF_ERROR(CheckIds(I(in[1]), rows, ranks * shard, "target"));
  ParallelFor(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* l = F(in[0]) + r * shard;
      float max_value = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < shard; ++j) max_value = std::max(max_value, l[j]);
      float sum = 0.0f;
      for (int64_t j = 0; j < shard; ++j) sum += std::exp(l[j] - max_value);
      float* stats = F(out[0]) + r * width;
      std::fill(stats, stats + width, 0.0f);
      stats[rank] =
          static_cast<float>(static_cast<double>(max_value) + std::log(static_cast<double>(sum)));
      const int64_t target = ShardRow(I(in[1])[r], rank, shard);
      if (target >= 0) stats[ranks] = l[target];
    }
  });
  return Status::Ok();
}

Status VocabShardLogitStatsBackward(const KernelContext&, const Tensors& in, const Tensors& out,
                                    const Attrs& attrs) {
  const int64_t rows = in[1].shape()[0], shard = in[1].shape()[1];
  const int64_t width = in[0].shape()[1], ranks = width - 1, rank = TensorRank(attrs);
  ParallelFor(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* l = F(in[1]) + r * shard;
      const float* dstats = F(in[0]) + r * width;
      const float lse = F(in[3])[r * width + rank];
      float* d = F(out[0]) + r * shard;
      for (int64_t j = 0; j < shard; ++j) d[j] = dstats[rank] * std::exp(l[j] - lse);
      const int64_t target = ShardRow(I(in[2])[r], rank, shard);
      if (target >= 0) d[target] += dstats[ranks];
    }
  });
  return Status::Ok();
}

// Each row's log sum_t exp(stats[r, t]) over the T ranks' columns, in double.
double RowLogSumExp(const float* stats, int64_t ranks) {
  double max_value = -std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < ranks; ++t) max_value = std::max(max_value, double{stats[t]});
  double sum = 0.0;
  for (int64_t t = 0; t < ranks; ++t) sum += std::exp(double{stats[t]} - max_value);
  return max_value + std::log(sum);
}

Status CrossEntropyFromStats(const KernelContext&, const Tensors& in, const Tensors& out,
                             const Attrs&) {
  const int64_t rows = in[0].shape()[0], width = in[0].shape()[1];
  double total = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* stats = F(in[0]) + r * width;
    total += RowLogSumExp(stats, width - 1) - double{stats[width - 1]};
  }
  *F(out[0]) = rows == 0 ? 0.0f : static_cast<float>(total / static_cast<double>(rows));
  return Status::Ok();
}

Status CrossEntropyFromStatsBackward(const KernelContext&, const Tensors& in, const Tensors& out,
                                     const Attrs&) {
  const int64_t rows = in[1].shape()[0], width = in[1].shape()[1];
  const double scale = rows == 0 ? 0.0 : double{*F(in[0])} / static_cast<double>(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const float* stats = F(in[1]) + r * width;
    float* d = F(out[0]) + r * width;
    const double lse = RowLogSumExp(stats, width - 1);
    for (int64_t t = 0; t + 1 < width; ++t) {
      d[t] = static_cast<float>(scale * std::exp(double{stats[t]} - lse));
    }
    d[width - 1] = static_cast<float>(-scale);
  }
  return Status::Ok();
}

// ---- ring attention's parts: the QKV parted, block attention and the log-sum-exp merge ----

// x [rows, N] -> a [rows, n], b [rows, N - n] (`join`: the other way round).
void CopyColumns(float* x, float* a, float* b, int64_t rows, int64_t n, int64_t first, bool join) {
  ParallelFor(rows, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = x + r * n;
      float* ar = a + r * first;
      float* br = b + r * (n - first);
      if (join) {
        std::copy(ar, ar + first, row);
        std::copy(br, br + n - first, row + first);
      } else {
        std::copy(row, row + first, ar);
        std::copy(row + first, row + n, br);
      }
    }
  });
}

Status SplitLastForward(const KernelContext&, const Tensors& in, const Tensors& out, const Attrs&) {
  const int64_t n = in[0].shape()[in[0].shape().rank() - 1];
  const int64_t first = out[0].shape()[out[0].shape().rank() - 1];
  CopyColumns(F(in[0]), F(out[0]), F(out[1]), in[0].numel() / n, n, first, /*join=*/false);
  return Status::Ok();
}

Status SplitLastBackward(const KernelContext&, const Tensors& in, const Tensors& out,
                         const Attrs&) {
  const int64_t n = out[0].shape()[out[0].shape().rank() - 1];
  const int64_t first = in[0].shape()[in[0].shape().rank() - 1];
  CopyColumns(F(out[0]), F(in[0]), F(in[1]), out[0].numel() / n, n, first, /*join=*/true);
  return Status::Ok();
}

// Attention of q [B, S, C] over the block kv [B, Sk, 2C] (keys, then values) at key_offset.
struct AttentionBlock {
  int64_t batch = 0, queries = 0, keys = 0, channels = 0, heads = 1, head_size = 1;
  int64_t key_offset = 0;
  float scale = 1;
  // Keys query i sees: those with key_offset + j <= i.
  int64_t Visible(int64_t i) const { return std::clamp<int64_t>(i - key_offset + 1, 0, keys); }
  int64_t Q(int64_t b, int64_t i, int64_t h) const {
    return (b * queries + i) * channels + h * head_size;
  }
  int64_t K(int64_t b, int64_t j, int64_t h) const {
    return (b * keys + j) * 2 * channels + h * head_size;
  }
  int64_t V(int64_t b, int64_t j, int64_t h) const { return K(b, j, h) + channels; }
  int64_t Lse(int64_t b, int64_t h, int64_t i) const { return (b * heads + h) * queries + i; }
};

AttentionBlock AttentionBlockOf(const Tensor& q, const Tensor& kv, const Attrs& attrs) {
  AttentionBlock g;
  g.batch = q.shape()[0];
  g.queries = q.shape()[1];
  g.channels = q.shape()[2];
  g.keys = kv.shape()[1];
  g.heads = attrs.GetInt("heads", 1);
  g.head_size = g.channels / g.heads;
  g.key_offset = AttentionBlockKeyOffset(attrs, g.keys);
  g.scale = 1.0f / std::sqrt(static_cast<float>(g.head_size));
  return g;
}

double Dot(const float* a, const float* b, int64_t n) {
  double sum = 0;
  for (int64_t c = 0; c < n; ++c) sum += static_cast<double>(a[c]) * b[c];
  return sum;
}

constexpr float kNoKeys = -std::numeric_limits<float>::infinity();

// The merge's weights of one (batch, head, query): e^(lse_a - lse), e^(lse_b - lse), and lse;
// both zero (lse -inf) where neither part saw a key.
struct MergeWeights {
  double a = 0, b = 0;
  float lse = kNoKeys;
};
MergeWeights MergeWeightsOf(float lse_a, float lse_b) {
  MergeWeights w;
  const double most = std::max(lse_a, lse_b);
  if (std::isinf(most) && most < 0) return w;
  const double lse = most + std::log(std::exp(lse_a - most) + std::exp(lse_b - most));
  w.a = std::exp(lse_a - lse);
  w.b = std::exp(lse_b - lse);
  w.lse = static_cast<float>(lse);
  return w;
}

// [B, S, C] outputs and [B, H, S] log-sum-exps: per (b, h, i) fn(row offset, lse index).
template <typename Fn>
void ForEachHeadRow(const Tensor& out, const Attrs& attrs, const Fn& fn) {
  const int64_t batch = out.shape()[0], queries = out.shape()[1], channels = out.shape()[2];
  const int64_t heads = attrs.GetInt("heads", 1), head_size = channels / heads;
  ParallelFor(batch * heads, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / heads, h = p % heads;
      for (int64_t i = 0; i < queries; ++i) {
        fn((b * queries + i) * channels + h * head_size, (b * heads + h) * queries + i, head_size);
      }
    }
  });
}

Status AttentionMergeForward(const KernelContext&, const Tensors& in, const Tensors& out,
                             const Attrs& attrs) {
  const float *out_a = F(in[0]), *lse_a = F(in[1]), *out_b = F(in[2]), *lse_b = F(in[3]);
  float *y = F(out[0]), *lse = F(out[1]);
  ForEachHeadRow(in[0], attrs, [&](int64_t row, int64_t l, int64_t n) {
    const MergeWeights w = MergeWeightsOf(lse_a[l], lse_b[l]);
    lse[l] = w.lse;
    for (int64_t c = 0; c < n; ++c) {
      y[row + c] = static_cast<float>(w.a * out_a[row + c] + w.b * out_b[row + c]);
    }
  });
  return Status::Ok();
}

// in: dout, dlse, out_a, lse_a, out_b, lse_b, out, lse; out: dout_a, dlse_a, dout_b, dlse_b.
// dlse_a = w_a (dout . out_a - dout . out + dlse), likewise for b.
Status AttentionMergeBackward(const KernelContext&, const Tensors& in, const Tensors& out,
                              const Attrs& attrs) {
  const float *dout = F(in[0]), *dlse = F(in[1]), *out_a = F(in[2]), *lse_a = F(in[3]);
  const float *out_b = F(in[4]), *lse_b = F(in[5]), *y = F(in[6]);
  float *dout_a = F(out[0]), *dlse_a = F(out[1]), *dout_b = F(out[2]), *dlse_b = F(out[3]);
  ForEachHeadRow(in[2], attrs, [&](int64_t row, int64_t l, int64_t n) {
    const MergeWeights w = MergeWeightsOf(lse_a[l], lse_b[l]);
    const double through_out = Dot(dout + row, y + row, n);
    for (int64_t c = 0; c < n; ++c) {
      dout_a[row + c] = static_cast<float>(w.a * dout[row + c]);
      dout_b[row + c] = static_cast<float>(w.b * dout[row + c]);
    }
    dlse_a[l] = static_cast<float>(w.a * (Dot(dout + row, out_a + row, n) - through_out + dlse[l]));
    dlse_b[l] = static_cast<float>(w.b * (Dot(dout + row, out_b + row, n) - through_out + dlse[l]));
  });
  return Status::Ok();
}

// The block ops run a (batch, head) pair at a time, kQueryRows queries at a time against the keys
// the last of them sees, with single-threaded GEMMs on strided views (as attention_forward's
// kernel does, ops/cpu/attention.cc): S = scale Q K^T; P = softmax over each row's visible keys
// (its log-sum-exp l); O = P V. The backwards compute P and O again, then, with each row's
// gradient dO and scalar g (the softmax's: dS = P (dO V^T + g)):
//   dQ = scale dS K;  dK += scale dS^T Q;  dV += P^T dO.
constexpr int64_t kQueryRows = 64;

// Per thread: P and dP [kQueryRows, keys], O and dO [kQueryRows, head_size], and l per row.
struct BlockScratch {
  std::vector<float> p, dp, o, d_o, lse;
  explicit BlockScratch(const AttentionBlock& g)
      : p(static_cast<size_t>(kQueryRows * g.keys)),
        dp(static_cast<size_t>(kQueryRows * g.keys)),
        o(static_cast<size_t>(kQueryRows * g.head_size)),
        d_o(static_cast<size_t>(kQueryRows * g.head_size)),
        lse(static_cast<size_t>(kQueryRows)) {}
};

// Rows [i0, i1) of (b, h): P (stride `seen`) and l per row into the scratch, then O = P V.
// Returns `seen`, the keys the last row sees (0: none, P and O left unset).
int64_t BlockRows(const AttentionBlock& g, const float* q, const float* kv, int64_t b, int64_t h,
                  int64_t i0, int64_t i1, BlockScratch& s) {
  const int64_t seen = g.Visible(i1 - 1), rows = i1 - i0;
  for (int64_t i = i0; i < i1; ++i) s.lse[static_cast<size_t>(i - i0)] = kNoKeys;
  if (seen == 0) return 0;
  Gemm(Transpose::kNo, Transpose::kYes, rows, seen, g.head_size, g.scale, q + g.Q(b, i0, h),
       g.channels, kv + g.K(b, 0, h), 2 * g.channels, 0.0f, s.p.data(), seen, kNeverSplit);
  for (int64_t i = i0; i < i1; ++i) {
    float* row = s.p.data() + (i - i0) * seen;
    const int64_t visible = g.Visible(i);
    float most = kNoKeys;
    for (int64_t j = 0; j < visible; ++j) most = std::max(most, row[j]);
    double total = 0;
    for (int64_t j = 0; j < visible; ++j) {
      row[j] = std::exp(row[j] - most);
      total += row[j];
    }
    for (int64_t j = visible; j < seen; ++j) row[j] = 0.0f;
    if (visible == 0) continue;
    const auto inverse = static_cast<float>(1.0 / total);
    for (int64_t j = 0; j < visible; ++j) row[j] *= inverse;
    s.lse[static_cast<size_t>(i - i0)] = most + static_cast<float>(std::log(total));
  }
  Gemm(Transpose::kNo, Transpose::kNo, rows, g.head_size, seen, 1.0f, s.p.data(), seen,
       kv + g.V(b, 0, h), 2 * g.channels, 0.0f, s.o.data(), g.head_size, kNeverSplit);
  return seen;
}

// The gradients of rows [i0, i1) (BlockRows' P and O in the scratch, `seen` keys) from each row's
// dO (s.d_o) and scalar g (`g_rows`): dQ rows written, dK and dV rows [0, seen) added to.
void BlockRowsBackward(const AttentionBlock& g, const float* q, const float* kv, int64_t b,
                       int64_t h, int64_t i0, int64_t i1, int64_t seen, const float* g_rows,
                       BlockScratch& s, float* dq, float* dkv) {
  const int64_t rows = i1 - i0;
  if (seen == 0) return;  // dQ rows stay zero
  Gemm(Transpose::kNo, Transpose::kYes, rows, seen, g.head_size, 1.0f, s.d_o.data(), g.head_size,
       kv + g.V(b, 0, h), 2 * g.channels, 0.0f, s.dp.data(), seen, kNeverSplit);
  for (int64_t r = 0; r < rows; ++r) {
    const float* p_row = s.p.data() + r * seen;
    float* ds_row = s.dp.data() + r * seen;
    for (int64_t j = 0; j < seen; ++j) ds_row[j] = p_row[j] * (ds_row[j] + g_rows[r]);
  }
  Gemm(Transpose::kNo, Transpose::kNo, rows, g.head_size, seen, g.scale, s.dp.data(), seen,
       kv + g.K(b, 0, h), 2 * g.channels, 0.0f, dq + g.Q(b, i0, h), g.channels, kNeverSplit);
  Gemm(Transpose::kYes, Transpose::kNo, seen, g.head_size, rows, g.scale, s.dp.data(), seen,
       q + g.Q(b, i0, h), g.channels, 1.0f, dkv + g.K(b, 0, h), 2 * g.channels, kNeverSplit);
  Gemm(Transpose::kYes, Transpose::kNo, seen, g.head_size, rows, 1.0f, s.p.data(), seen,
       s.d_o.data(), g.head_size, 1.0f, dkv + g.V(b, 0, h), 2 * g.channels, kNeverSplit);
}

// Runs fn(b, h, i0, i1, scratch) over every (batch, head) pair in parallel (each pair writes
// only its own columns), the query blocks of a pair in order, after BlockRows put the block's P
// and O for rows [i0, i1) in the scratch (fn's `seen`: BlockRows' return).
template <typename Fn>
void ForEachBlockRows(const AttentionBlock& g, const float* q, const float* kv, const Fn& fn) {
  ParallelFor(g.batch * g.heads, 1, [&](int64_t p0, int64_t p1) {
    BlockScratch scratch(g);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / g.heads, h = p % g.heads;
      for (int64_t i0 = 0; i0 < g.queries; i0 += kQueryRows) {
        const int64_t i1 = std::min(g.queries, i0 + kQueryRows);
        const int64_t seen = BlockRows(g, q, kv, b, h, i0, i1, scratch);
        fn(b, h, i0, i1, seen, scratch);
      }
    }
  });
}

// A block backward's dq and dkv start at zero (dkv adds up over the query blocks).
void ZeroQueryAndKeyGradients(const Tensors& out) {
  std::fill(F(out[0]), F(out[0]) + out[0].numel(), 0.0f);
  std::fill(F(out[1]), F(out[1]) + out[1].numel(), 0.0f);
}

Status AttentionBlockForward(const KernelContext&, const Tensors& in, const Tensors& out,
                             const Attrs& attrs) {
  const AttentionBlock g = AttentionBlockOf(in[0], in[1], attrs);
  const float *q = F(in[0]), *kv = F(in[1]);
  float *y = F(out[0]), *lse = F(out[1]);
  ForEachBlockRows(
      g, q, kv, [&](int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t seen, BlockScratch& s) {
        for (int64_t i = i0; i < i1; ++i) {
          lse[g.Lse(b, h, i)] = s.lse[static_cast<size_t>(i - i0)];
          float* yi = y + g.Q(b, i, h);
          const float* oi = s.o.data() + (i - i0) * g.head_size;
          for (int64_t c = 0; c < g.head_size; ++c) yi[c] = seen == 0 ? 0.0f : oi[c];
        }
      });
  return Status::Ok();
}

// in: dout, dlse, q, kv; out: dq, dkv. P and O computed again; g = dlse - dO . O per row.
Status AttentionBlockBackward(const KernelContext&, const Tensors& in, const Tensors& out,
                              const Attrs& attrs) {
  const AttentionBlock g = AttentionBlockOf(in[2], in[3], attrs);
  const float *dout = F(in[0]), *dlse = F(in[1]), *q = F(in[2]), *kv = F(in[3]);
  float *dq = F(out[0]), *dkv = F(out[1]);
  ZeroQueryAndKeyGradients(out);
  ForEachBlockRows(
      g, q, kv, [&](int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t seen, BlockScratch& s) {
        float g_rows[kQueryRows];
        for (int64_t i = i0; i < i1; ++i) {
          const float* d = dout + g.Q(b, i, h);
          float* d_o = s.d_o.data() + (i - i0) * g.head_size;
          std::copy(d, d + g.head_size, d_o);
          g_rows[i - i0] = static_cast<float>(
              dlse[g.Lse(b, h, i)] - Dot(d, s.o.data() + (i - i0) * g.head_size, g.head_size));
        }
        BlockRowsBackward(g, q, kv, b, h, i0, i1, seen, g_rows, s, dq, dkv);
      });
  return Status::Ok();
}

// in: q, kv, out_prev, lse_prev; out: out, lse. The block's attention merged into the steps
// before, row by row: attention_block_forward then attention_merge_forward, the block's output
// not kept.
Status AttentionBlockAccumulateForward(const KernelContext&, const Tensors& in, const Tensors& out,
                                       const Attrs& attrs) {
  const AttentionBlock g = AttentionBlockOf(in[0], in[1], attrs);
  const float *q = F(in[0]), *kv = F(in[1]), *out_prev = F(in[2]), *lse_prev = F(in[3]);
  float *y = F(out[0]), *lse = F(out[1]);
  ForEachBlockRows(
      g, q, kv, [&](int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t seen, BlockScratch& s) {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t l = g.Lse(b, h, i), at = g.Q(b, i, h);
          const MergeWeights w = MergeWeightsOf(lse_prev[l], s.lse[static_cast<size_t>(i - i0)]);
          lse[l] = w.lse;
          const float* oi = s.o.data() + (i - i0) * g.head_size;
          for (int64_t c = 0; c < g.head_size; ++c) {
            const double block = seen == 0 ? 0.0 : w.b * oi[c];
            y[at + c] = static_cast<float>(w.a * out_prev[at + c] + block);
          }
        }
      });
  return Status::Ok();
}

// in: dout, dlse, q, kv, out_prev, lse_prev; out: dq, dkv, dout_prev, dlse_prev. P, O, the merge
// weights w_a, w_b and the merged output computed again; the block's rows get dO = w_b dout and
// g = w_b (dlse - dout . out) (AttentionMergeBackward's gradients through the block's).
Status AttentionBlockAccumulateBackward(const KernelContext&, const Tensors& in, const Tensors& out,
                                        const Attrs& attrs) {
  const AttentionBlock g = AttentionBlockOf(in[2], in[3], attrs);
  const float *dout = F(in[0]), *dlse = F(in[1]), *q = F(in[2]), *kv = F(in[3]);
  const float *out_prev = F(in[4]), *lse_prev = F(in[5]);
  float *dq = F(out[0]), *dkv = F(out[1]), *dout_prev = F(out[2]), *dlse_prev = F(out[3]);
  ZeroQueryAndKeyGradients(out);
  ForEachBlockRows(
      g, q, kv, [&](int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t seen, BlockScratch& s) {
        float g_rows[kQueryRows];
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t l = g.Lse(b, h, i), at = g.Q(b, i, h);
          const MergeWeights w = MergeWeightsOf(lse_prev[l], s.lse[static_cast<size_t>(i - i0)]);
          const float* oi = s.o.data() + (i - i0) * g.head_size;
          float* d_o = s.d_o.data() + (i - i0) * g.head_size;
          double through_out = 0, along_prev = 0;
          for (int64_t c = 0; c < g.head_size; ++c) {
            // The merged output as the forward wrote it (rounded to f32).
            const auto merged =
                static_cast<float>(w.a * out_prev[at + c] + (seen == 0 ? 0.0 : w.b * oi[c]));
            through_out += double{dout[at + c]} * merged;
            along_prev += double{dout[at + c]} * out_prev[at + c];
            dout_prev[at + c] = static_cast<float>(w.a * dout[at + c]);
            d_o[c] = static_cast<float>(w.b * dout[at + c]);
          }
          dlse_prev[l] = static_cast<float>(w.a * (along_prev - through_out + dlse[l]));
          g_rows[i - i0] = static_cast<float>(w.b * (dlse[l] - through_out));
        }
        BlockRowsBackward(g, q, kv, b, h, i0, i1, seen, g_rows, s, dq, dkv);
      });
  return Status::Ok();
}

}  // namespace

Status RegisterTensorParallelKernels(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(Register(r, "vocab_shard_embedding_forward", VocabShardEmbeddingForward));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "vocab_shard_embedding_backward", VocabShardEmbeddingBackward));
  TESSERA_RETURN_IF_ERROR(Register(r, "position_add_forward", PositionAddForward));
  TESSERA_RETURN_IF_ERROR(Register(r, "position_add_backward", PositionAddBackward));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "heads_to_chunks",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 return MoveHeadChunks(in[0], out[0], attrs, /*to_chunks=*/true);
               }));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "chunks_to_heads",
               [](const KernelContext&, const Tensors& in, const Tensors& out, const Attrs& attrs) {
                 return MoveHeadChunks(out[0], in[0], attrs, /*to_chunks=*/false);
               }));
  TESSERA_RETURN_IF_ERROR(Register(r, "heads_linear_forward", HeadsLinearForward));
  TESSERA_RETURN_IF_ERROR(Register(r, "split_last_forward", SplitLastForward));
  TESSERA_RETURN_IF_ERROR(Register(r, "split_last_backward", SplitLastBackward));
  TESSERA_RETURN_IF_ERROR(Register(r, "attention_block_forward", AttentionBlockForward));
  TESSERA_RETURN_IF_ERROR(Register(r, "attention_block_backward", AttentionBlockBackward));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "attention_block_accumulate_forward", AttentionBlockAccumulateForward));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "attention_block_accumulate_backward", AttentionBlockAccumulateBackward));
  TESSERA_RETURN_IF_ERROR(Register(r, "attention_merge_forward", AttentionMergeForward));
  TESSERA_RETURN_IF_ERROR(Register(r, "attention_merge_backward", AttentionMergeBackward));
  TESSERA_RETURN_IF_ERROR(Register(r, "heads_linear_backward", HeadsLinearBackward));
  TESSERA_RETURN_IF_ERROR(Register(r, "vocab_shard_logit_stats", VocabShardLogitStats));
  TESSERA_RETURN_IF_ERROR(
      Register(r, "vocab_shard_logit_stats_backward", VocabShardLogitStatsBackward));
  TESSERA_RETURN_IF_ERROR(Register(r, "cross_entropy_from_stats", CrossEntropyFromStats));
  return Register(r, "cross_entropy_from_stats_backward", CrossEntropyFromStatsBackward);
}

}  // namespace tessera

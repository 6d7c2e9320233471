// The standard ops' tensor-parallel family (definitions; CPU kernels in
// ops/cpu/tensor_parallel.cc): a vocabulary-parallel embedding and cross-entropy (Megatron-LM's),
// in which no rank holds the whole vocabulary's rows or logits.
//
// Tensor rank t of T holds rows [t V/T, (t + 1) V/T) of the token embedding wte. Its embedding
// part looks up the tokens in its rows and writes zeros for the rest, so the parts sum to the
// whole embedding (an all-reduce between layers). The classifier's logits [R, V/T] of rank t are
// reduced to statistics [R, T + 1]: column t the log-sum-exp of the rank's logits, column T the
// target's logit where the target is one of the rank's rows, zeros elsewhere. Their sum over the
// ranks (again an all-reduce, of R (T + 1) values, not R V) holds every rank's log-sum-exp and the
// target logit, from which every rank computes the loss, log sum_t exp(lse_t) - logit[target].
// Every sum adds zeros to one rank's value: exact.
//
// The ops read the rank from attribute tensor_rank (kTensorRankAttr), which the planner sets on
// a split layer's tasks and the layer program hands to each of its ops; absent, 0.
//
// Sequence parallelism (DeepSpeed-Ulysses): P sequence ranks each hold S/P positions of every
// row. Around attention an all-to-all turns the sequence split into a head split and back (its
// layouts to_sequence and from_sequence join and split the sequence: core/exchange_layout.h);
// these ops lay the heads out as its P contiguous blocks, block j going to rank j:
//   heads_to_chunks     [B, S/P, G H d] -> [P, B, S/P, G Hp d]: block j holds head group j
//                       (heads [j Hp, (j + 1) Hp), Hp = ceil(H / P); the heads past H are zero, so
//                       a head count P does not divide runs as padded heads, not refused)
//   chunks_to_heads     [P, B, S/P, G Hp d] -> [B, S/P, G H d]: heads_to_chunks' adjoint
//   heads_linear        a linear over the heads as chunks_to_heads would regroup them, read in
//                       place: the projection after attention, without a regrouped copy kept
// (G = 3 for the fused Q, K, V.) position_add_forward reads attribute sequence_rank
// (kSequenceRankAttr): its x holds positions [sequence_rank S, (sequence_rank + 1) S).
//
// Ring attention's parts: causal attention of a shard's queries over one block of keys and
// values, and the merge of two such partial results by their log-sum-exp, so that the blocks of a
// whole sequence, merged in any order, give attention_forward's output:
//   split_last_forward       x [..., N] -> a [..., n], b [..., N - n] (attribute first = n): the
//                            fused QKV parted into Q and the K/V block that rotates
//   attention_block_forward  q [B, S, C], kv [B, Sk, 2 C] (K then V) -> out [B, S, C], lse
//                            [B, H, S]; attributes heads, key_offset (key j sits at position
//                            key_offset + j, query i at i: visible when key_offset + j <= i), or
//                            ring_step and ranks (AttentionBlockKeyOffset: the block k rotations
//                            of the ring brought). A query that sees no key gets out 0 and lse
//                            -inf. Its backward reads q and kv only, computing the block's out
//                            and lse again row by row (as flash attention does), so a layer
//                            keeps nothing of them for it
//   attention_merge_forward  out_a, lse_a, out_b, lse_b -> out, lse: lse = log(e^lse_a +
//                            e^lse_b), out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b
//                            per head (attribute heads)
//   attention_block_accumulate_forward  q, kv, out_prev, lse_prev -> out, lse: the two in one
//                            op (a ring step), its backward computing the block's output again
//                            rather than keeping it
// Their backwards take the gradients of both outputs (the merge differentiates through lse).
#include <algorithm>
#include <vector>

#include <fmt/format.h>

#include "ops/op_def_util.h"
#include "ops/standard_ops.h"
#include "ops/standard_ops_internal.h"

namespace tessera::detail {

using op_def::CheckDType;
using op_def::In;
using op_def::Out;
using op_def::OutGrad;
using op_def::Rule;

namespace {

Status CheckMatrix(const char* name, const TensorMeta& meta, const char* dims) {
  TESSERA_RETURN_IF_ERROR(CheckDType(name, meta, DType::kF32));
  if (meta.shape.rank() != 2) {
    return InvalidArgument("input '{}' has shape {} but must be {}", name, meta.shape.ToString(),
                           dims);
  }
  return Status::Ok();
}

// x (or its gradient) [B, S, C] f32 and wpe [>= (sequence_rank + 1) S, C].
Status CheckPositions(const char* name, const TensorMeta& x, const TensorMeta& wpe,
                      const Attrs& attrs) {
  const int64_t shard = attrs.GetInt(kSequenceRankAttr, 0);
  if (shard < 0) {
    return InvalidArgument("attribute '{}' is {}; must be >= 0", kSequenceRankAttr, shard);
  }
  TESSERA_RETURN_IF_ERROR(CheckDType(name, x, DType::kF32));
  if (x.shape.rank() != 3) {
    return InvalidArgument("input '{}' has shape {} but must be [B, S, C]", name,
                           x.shape.ToString());
  }
  TESSERA_RETURN_IF_ERROR(CheckMatrix("wpe", wpe, "[max_seq_len, C]"));
  if (wpe.shape[0] < (shard + 1) * x.shape[1] || wpe.shape[1] != x.shape[2]) {
    return InvalidArgument("input 'wpe' has shape {} but must be [>= {}, {}] for {} {}{}",
                           wpe.shape.ToString(), (shard + 1) * x.shape[1], x.shape[2], name,
                           x.shape.ToString(),
                           shard > 0 ? fmt::format(" at sequence rank {}", shard) : "");
  }
  return Status::Ok();
}

// Attribute `ranks` (T) and tensor_rank (t < T, default 0).
Result<std::pair<int64_t, int64_t>> RanksOf(const Attrs& attrs) {
  TESSERA_ASSIGN_OR_RETURN(int64_t ranks, PositiveAttr(attrs, "ranks"));
  const int64_t rank = attrs.GetInt(kTensorRankAttr, 0);
  if (rank < 0 || rank >= ranks) {
    return InvalidArgument("attribute '{}' is {} but must be in [0, {}) (attribute 'ranks')",
                           kTensorRankAttr, rank, ranks);
  }
  return std::pair{ranks, rank};
}

Status AddVocabShardEmbeddingOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "vocab_shard_embedding_forward",
      .doc = "out[b,s] = wte_shard[tokens[b,s] - tensor_rank * V_shard] where the token is one of "
             "the shard's rows, else 0: one tensor rank's part of a vocabulary-parallel embedding",
      .input_names = {"tokens", "wte_shard"},
      .output_names = {"out"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("tokens", in[0], DType::kI32));
        if (in[0].shape.rank() != 2) {
          return InvalidArgument("input 'tokens' has shape {} but must be [B, S]",
                                 in[0].shape.ToString());
        }
        TESSERA_RETURN_IF_ERROR(CheckMatrix("wte_shard", in[1], "[V / T, C]"));
        return Metas{F32({in[0].shape[0], in[0].shape[1], in[1].shape[1]})};
      },
      .cost = ElementwiseCost(0),
      .gradient = Rule("vocab_shard_embedding_backward", {OutGrad(0), In(0), In(1)}, {1})}));
  return r.AddOp(OpDef{
      .name = "vocab_shard_embedding_backward",
      .doc = "dwte_shard: dout added to the shard's row of each token that is one of them",
      .input_names = {"dout", "tokens", "wte_shard"},
      .output_names = {"dwte_shard"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("dout", in[0], DType::kF32));
        TESSERA_RETURN_IF_ERROR(CheckMatrix("wte_shard", in[2], "[V / T, C]"));
        TESSERA_RETURN_IF_ERROR(
            CheckShape("dout", in[0], Shape{in[1].shape[0], in[1].shape[1], in[2].shape[1]}));
        TESSERA_RETURN_IF_ERROR(CheckTokens("tokens", in[1], in[0].shape[0], in[0].shape[1]));
        return Metas{in[2]};
      },
      .cost = ElementwiseCost(1),
  });
}

Status AddPositionAddOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "position_add_forward",
      .doc = "out[b,s] = x[b,s] + wpe[s + sequence_rank S]: the position embedding added to a "
             "token embedding (attribute sequence_rank, default 0: the sequence shard x holds)",
      .input_names = {"x", "wpe"},
      .output_names = {"out"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckPositions("x", in[0], in[1], attrs));
        return Metas{in[0]};
      },
      .cost = ElementwiseCost(1),
      .gradient = Rule("position_add_backward", {OutGrad(0), In(1)}, {0, 1})}));
  return r.AddOp(OpDef{
      .name = "position_add_backward",
      .doc = "dx = dout; dwpe[s + sequence_rank S] = sum over the batch of dout[b,s] (0 "
             "elsewhere)",
      .input_names = {"dout", "wpe"},
      .output_names = {"dx", "dwpe"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckPositions("dout", in[0], in[1], attrs));
        return Metas{in[0], in[1]};
      },
      .cost = ElementwiseCost(1),
  });
}

// Attributes heads (H), ranks (P) and groups (G, default 1), and Hp = ceil(H / P).
struct HeadChunks {
  int64_t heads, ranks, groups, heads_per_rank;
};

Result<HeadChunks> HeadChunksOf(const Attrs& attrs) {
  HeadChunks c{};
  TESSERA_ASSIGN_OR_RETURN(c.heads, PositiveAttr(attrs, "heads"));
  TESSERA_ASSIGN_OR_RETURN(c.ranks, PositiveAttr(attrs, "ranks"));
  c.groups = attrs.GetInt("groups", 1);
  if (c.groups < 1) return InvalidArgument("attribute 'groups' is {}; must be >= 1", c.groups);
  c.heads_per_rank = (c.heads + c.ranks - 1) / c.ranks;
  return c;
}

// The head size d of `x` [..., per_row], per_row = groups x heads x d.
Result<int64_t> HeadSize(const char* name, const TensorMeta& x, int64_t groups, int64_t heads) {
  TESSERA_RETURN_IF_ERROR(CheckDType(name, x, DType::kF32));
  const int64_t per_row = x.shape.rank() == 0 ? 0 : x.shape[-1];
  if (per_row == 0 || per_row % (groups * heads) != 0) {
    return InvalidArgument(
        "input '{}' has shape {} but its last dimension must be groups x heads x d = {} x {} x d",
        name, x.shape.ToString(), groups, heads);
  }
  return per_row / (groups * heads);
}

// The head size d of chunks [P, ..., groups x Hp x d] (P = attribute ranks).
Result<int64_t> ChunkHeadSize(const TensorMeta& chunks, const HeadChunks& c, int64_t groups) {
  TESSERA_RETURN_IF_ERROR(CheckRankAtLeast("chunks", chunks, 3));
  if (chunks.shape[0] != c.ranks) {
    return InvalidArgument("input 'chunks' has shape {} but must have {} blocks (ranks)",
                           chunks.shape.ToString(), c.ranks);
  }
  return HeadSize("chunks", chunks, groups, c.heads_per_rank);
}

Status AddSequenceParallelOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "heads_to_chunks",
      .doc = "x [B, S, G H d] as P blocks [P, B, S, G Hp d], block j the heads [j Hp, (j+1) Hp) "
             "(Hp = ceil(H / P); heads past H zero): what an all-to-all sends from a sequence "
             "rank to the head ranks (attributes heads, ranks, groups)",
      .input_names = {"x"},
      .output_names = {"chunks"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(HeadChunks c, HeadChunksOf(attrs));
        TESSERA_RETURN_IF_ERROR(CheckRankAtLeast("x", in[0], 2));
        TESSERA_ASSIGN_OR_RETURN(int64_t d, HeadSize("x", in[0], c.groups, c.heads));
        std::vector<int64_t> dims = {c.ranks};
        for (int i = 0; i + 1 < in[0].shape.rank(); ++i) dims.push_back(in[0].shape[i]);
        dims.push_back(c.groups * c.heads_per_rank * d);
        return Metas{F32(Shape(dims))};
      },
      .cost = ElementwiseCost(0),
      .gradient = Rule("chunks_to_heads", {OutGrad(0)}, {0})}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(
      OpDef{.name = "chunks_to_heads",
            .doc = "the adjoint of heads_to_chunks: [P, B, S, G Hp d] -> [B, S, G H d], the padded "
                   "heads dropped",
            .input_names = {"chunks"},
            .output_names = {"x"},
            .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
              TESSERA_ASSIGN_OR_RETURN(HeadChunks c, HeadChunksOf(attrs));
              TESSERA_ASSIGN_OR_RETURN(int64_t d, ChunkHeadSize(in[0], c, c.groups));
              std::vector<int64_t> dims(in[0].shape.dims().begin() + 1, in[0].shape.dims().end());
              dims.back() = c.groups * c.heads * d;
              return Metas{F32(Shape(dims))};
            },
            .cost = ElementwiseCost(0),
            .gradient = Rule("heads_to_chunks", {OutGrad(0)}, {0})}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "heads_linear_forward",
      .doc = "out = chunks_to_heads(chunks) @ w^T + b, read from the chunks [P, B, S, Hp d] in "
             "place (attributes heads, ranks): w [O, H d], b [O] -> out [B, S, O]",
      .input_names = {"chunks", "w", "b"},
      .output_names = {"out"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(HeadChunks c, HeadChunksOf(attrs));
        TESSERA_ASSIGN_OR_RETURN(int64_t d, ChunkHeadSize(in[0], c, 1));
        TESSERA_RETURN_IF_ERROR(CheckMatrix("w", in[1], "[O, H d]"));
        if (in[1].shape[1] != c.heads * d) {
          return InvalidArgument("input 'w' has shape {} but must be [O, {}] ({} heads of {})",
                                 in[1].shape.ToString(), c.heads * d, c.heads, d);
        }
        TESSERA_RETURN_IF_ERROR(CheckShape("b", in[2], Shape{in[1].shape[0]}));
        std::vector<int64_t> dims(in[0].shape.dims().begin() + 1, in[0].shape.dims().end());
        dims.back() = in[1].shape[0];
        return Metas{F32(Shape(dims))};
      },
      .cost =
          [](const Metas& in, const Attrs&) {
            const int64_t rows_made = in[0].numel() / in[0].shape[-1] / in[0].shape[0];
            const auto rows = static_cast<double>(rows_made);
            return OpCost{2 * rows * static_cast<double>(in[1].numel()), op_def::Bytes(in)};
          },
      .gradient = Rule("heads_linear_backward", {OutGrad(0), In(0), In(1)}, {0, 1, 2})}));
  return r.AddOp(OpDef{
      .name = "heads_linear_backward",
      .doc = "dchunks (zero at padded heads), dw, db of heads_linear_forward",
      .input_names = {"dout", "chunks", "w"},
      .output_names = {"dchunks", "dw", "db"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(HeadChunks c, HeadChunksOf(attrs));
        TESSERA_RETURN_IF_ERROR(CheckRankAtLeast("chunks", in[1], 3));
        TESSERA_RETURN_IF_ERROR(CheckMatrix("w", in[2], "[O, H d]"));
        TESSERA_RETURN_IF_ERROR(CheckDType("dout", in[0], DType::kF32));
        if (in[0].numel() != in[1].numel() / in[1].shape[-1] / c.ranks * in[2].shape[0]) {
          return InvalidArgument("input 'dout' has shape {} but chunks {} and w {} make {}",
                                 in[0].shape.ToString(), in[1].shape.ToString(),
                                 in[2].shape.ToString(), "[B, S, O]");
        }
        return Metas{in[1], in[2], F32({in[2].shape[0]})};
      },
      .cost =
          [](const Metas& in, const Attrs&) {
            const int64_t rows_read = in[0].numel() / in[0].shape[-1];
            const auto rows = static_cast<double>(rows_read);
            return OpCost{4 * rows * static_cast<double>(in[2].numel()), op_def::Bytes(in)};
          },
  });
}

Status AddVocabParallelCrossEntropyOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "vocab_shard_logit_stats",
      .doc = "stats [R, T + 1] of one tensor rank's logits [R, V / T]: column tensor_rank the "
             "log-sum-exp of each row, column T the target's logit where the target is one of "
             "the rank's rows; zeros elsewhere (attribute ranks: T)",
      .input_names = {"logits", "targets"},
      .output_names = {"stats"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(auto ranks, RanksOf(attrs));
        TESSERA_RETURN_IF_ERROR(CheckMatrix("logits", in[0], "[R, V / T]"));
        TESSERA_RETURN_IF_ERROR(CheckShape("targets", in[1], Shape{in[0].shape[0]}, DType::kI32));
        return Metas{F32({in[0].shape[0], ranks.first + 1})};
      },
      .cost = ElementwiseCost(4),
      .gradient =
          Rule("vocab_shard_logit_stats_backward", {OutGrad(0), In(0), In(1), Out(0)}, {0})}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "vocab_shard_logit_stats_backward",
      .doc = "dlogits = dstats[:, t] softmax(logits) + dstats[:, T] at the target's column",
      .input_names = {"dstats", "logits", "targets", "stats"},
      .output_names = {"dlogits"},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(auto ranks, RanksOf(attrs));
        TESSERA_RETURN_IF_ERROR(CheckMatrix("logits", in[1], "[R, V / T]"));
        const Shape stats{in[1].shape[0], ranks.first + 1};
        TESSERA_RETURN_IF_ERROR(CheckShape("dstats", in[0], stats));
        TESSERA_RETURN_IF_ERROR(CheckShape("targets", in[2], Shape{in[1].shape[0]}, DType::kI32));
        TESSERA_RETURN_IF_ERROR(CheckShape("stats", in[3], stats));
        return Metas{in[1]};
      },
      .cost = ElementwiseCost(4),
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "cross_entropy_from_stats",
      .doc = "mean over the rows of log sum_t exp(stats[:, t]) - stats[:, T]: the cross-entropy "
             "from the summed statistics of vocab_shard_logit_stats",
      .input_names = {"stats"},
      .output_names = {"loss"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckMatrix("stats", in[0], "[R, T + 1]"));
        if (in[0].shape[1] < 2) {
          return InvalidArgument("input 'stats' has shape {} but must be [R, T + 1] with T >= 1",
                                 in[0].shape.ToString());
        }
        return Metas{Scalar()};
      },
      .cost = ElementwiseCost(4),
      .gradient = Rule("cross_entropy_from_stats_backward", {OutGrad(0), In(0)}, {0})}));
  return r.AddOp(OpDef{
      .name = "cross_entropy_from_stats_backward",
      .doc = "dstats: dloss / R times softmax(stats[:, :T]) per row, and -dloss / R in column T",
      .input_names = {"dloss", "stats"},
      .output_names = {"dstats"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckShape("dloss", in[0], Shape{}));
        TESSERA_RETURN_IF_ERROR(CheckMatrix("stats", in[1], "[R, T + 1]"));
        return Metas{in[1]};
      },
      .cost = ElementwiseCost(4),
  });
}

// split_last_forward and its backward (above): the last dimension parted at attribute first.
Status AddSplitLastOps(OpRegistry& r) {
  const InferFn infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckDType("x", in[0], DType::kF32));
    TESSERA_ASSIGN_OR_RETURN(const int64_t first, attrs.GetInt("first"));
    const Shape& x = in[0].shape;
    if (x.rank() < 1 || first < 1 || first >= x[x.rank() - 1]) {
      return InvalidArgument(
          "attribute first ({}) must part input 'x' {}'s last dimension into two non-empty "
          "pieces",
          first, x.ToString());
    }
    std::vector<int64_t> a = x.dims(), b = x.dims();
    a.back() = first;
    b.back() -= first;
    return Metas{F32(Shape(std::move(a))), F32(Shape(std::move(b)))};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "split_last_forward",
      .doc = "a, b: x [..., N] parted along its last dimension, a its first attribute 'first' "
             "columns and b the rest",
      .input_names = {"x"},
      .output_names = {"a", "b"},
      .infer = infer,
      .cost =
          [](const Metas& in, const Attrs&) {
            return OpCost{0, 2 * static_cast<double>(in[0].bytes())};
          },
      .gradient = Rule("split_last_backward", {OutGrad(0), OutGrad(1)}, {0})}));
  return r.AddOp(OpDef{
      .name = "split_last_backward",
      .doc = "dx: da and db joined along their last dimension",
      .input_names = {"da", "db"},
      .output_names = {"dx"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckDType("da", in[0], DType::kF32));
        TESSERA_RETURN_IF_ERROR(CheckDType("db", in[1], DType::kF32));
        const Shape &a = in[0].shape, &b = in[1].shape;
        std::vector<int64_t> joined = a.dims();
        bool same = a.rank() == b.rank() && a.rank() >= 1;
        for (int d = 0; same && d + 1 < a.rank(); ++d) same = a[d] == b[d];
        if (!same) {
          return InvalidArgument(
              "inputs 'da' {} and 'db' {} must differ in the last dimension only", a.ToString(),
              b.ToString());
        }
        joined.back() += b[b.rank() - 1];
        return Metas{F32(Shape(std::move(joined)))};
      },
      .cost =
          [](const Metas& in, const Attrs&) {
            return OpCost{0, 2 * static_cast<double>(op_def::Bytes(in))};
          },
  });
}

// Ring attention's block attention and log-sum-exp merge (above).
Status AddRingAttentionOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(AddSplitLastOps(r));
  const auto heads_of = [](const Attrs& attrs, const TensorMeta& q) -> Result<int64_t> {
    TESSERA_ASSIGN_OR_RETURN(const int64_t heads, attrs.GetInt("heads"));
    if (heads < 1 || q.shape.rank() != 3 || q.shape[2] % heads != 0) {
      return InvalidArgument(
          "input 'q' has shape {} but must be [B, S, C] with C a multiple of "
          "attribute heads ({})",
          q.shape.ToString(), heads);
    }
    return heads;
  };
  const InferFn block_infer = [heads_of](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckDType("q", in[0], DType::kF32));
    TESSERA_ASSIGN_OR_RETURN(const int64_t heads, heads_of(attrs, in[0]));
    const Shape& q = in[0].shape;
    TESSERA_RETURN_IF_ERROR(CheckDType("kv", in[1], DType::kF32));
    if (in[1].shape.rank() != 3 || in[1].shape[0] != q[0] || in[1].shape[2] != 2 * q[2]) {
      return InvalidArgument("input 'kv' has shape {} but q {} needs [{}, Sk, {}]",
                             in[1].shape.ToString(), q.ToString(), q[0], 2 * q[2]);
    }
    if (attrs.Has(kRingStepAttr)) {
      TESSERA_ASSIGN_OR_RETURN(const int64_t step, attrs.GetInt(kRingStepAttr));
      TESSERA_ASSIGN_OR_RETURN(const int64_t ranks, attrs.GetInt("ranks"));
      if (ranks < 1 || step < 0 || step >= ranks || attrs.Has("key_offset")) {
        return InvalidArgument(
            "attribute ring_step {} of ranks {}: must be in [0, ranks), without key_offset", step,
            ranks);
      }
      if (in[1].shape[1] != q[1]) {
        return InvalidArgument(
            "a ring step's block of keys kv {} must hold as many positions as the queries q {}",
            in[1].shape.ToString(), q.ToString());
      }
    }
    return Metas{F32(q), F32({q[0], heads, q[1]})};
  };
  const auto block_flops = [](const Metas& in) {
    return 4.0 * static_cast<double>(in[0].numel()) * static_cast<double>(in[1].shape[1]);
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "attention_block_forward",
      .doc = "causal attention of q [B, S, C] over one block of keys and values kv [B, Sk, 2C] at "
             "attribute key_offset (attribute heads): out, and the softmax's log-sum-exp lse "
             "[B, H, S] (-inf where a query sees no key)",
      .input_names = {"q", "kv"},
      .output_names = {"out", "lse"},
      .infer = block_infer,
      .cost =
          [block_flops](const Metas& in, const Attrs&) {
            return OpCost{block_flops(in), 2 * op_def::Bytes(in)};
          },
      .gradient =
          Rule("attention_block_backward", {OutGrad(0), OutGrad(1), In(0), In(1)}, {0, 1})}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "attention_block_backward",
      .doc = "dq, dkv of attention_block_forward from the gradients of out and lse (the block's "
             "out and lse computed again, row by row, rather than kept)",
      .input_names = {"dout", "dlse", "q", "kv"},
      .output_names = {"dq", "dkv"},
      .infer = [block_infer](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(Metas forward, block_infer(Metas{in[2], in[3]}, attrs));
        TESSERA_RETURN_IF_ERROR(CheckShape("dout", in[0], forward[0].shape));
        TESSERA_RETURN_IF_ERROR(CheckShape("dlse", in[1], forward[1].shape));
        return Metas{in[2], in[3]};
      },
      .cost =
          [block_flops](const Metas& in, const Attrs&) {
            return OpCost{3.5 * block_flops(Metas{in[2], in[3]}), 2 * op_def::Bytes(in)};
          },
  }));
  // The block attended and merged into the steps before in one op, nothing of the block kept.
  const InferFn accumulate_infer = [block_infer](const Metas& in,
                                                 const Attrs& attrs) -> Result<Metas> {
    TESSERA_ASSIGN_OR_RETURN(Metas block, block_infer(Metas{in[0], in[1]}, attrs));
    TESSERA_RETURN_IF_ERROR(CheckShape("out_prev", in[2], block[0].shape));
    TESSERA_RETURN_IF_ERROR(CheckShape("lse_prev", in[3], block[1].shape));
    return block;
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "attention_block_accumulate_forward",
      .doc = "attention_block_forward of q over kv merged into out_prev and lse_prev "
             "(attention_merge_forward) in one op: out, lse. Ring attention's step; the backward "
             "computes the block's own output again instead of keeping it",
      .input_names = {"q", "kv", "out_prev", "lse_prev"},
      .output_names = {"out", "lse"},
      .infer = accumulate_infer,
      .cost =
          [block_flops](const Metas& in, const Attrs&) {
            return OpCost{block_flops(in) + 3.0 * static_cast<double>(in[0].numel()),
                          op_def::Bytes(in)};
          },
      .gradient = Rule("attention_block_accumulate_backward",
                       {OutGrad(0), OutGrad(1), In(0), In(1), In(2), In(3)}, {0, 1, 2, 3})}));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "attention_block_accumulate_backward",
      .doc = "dq, dkv, dout_prev, dlse_prev of attention_block_accumulate_forward (the block's "
             "and the merge's outputs computed again, row by row, rather than kept)",
      .input_names = {"dout", "dlse", "q", "kv", "out_prev", "lse_prev"},
      .output_names = {"dq", "dkv", "dout_prev", "dlse_prev"},
      .infer = [accumulate_infer](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(Metas forward,
                                 accumulate_infer(Metas{in[2], in[3], in[4], in[5]}, attrs));
        TESSERA_RETURN_IF_ERROR(CheckShape("dout", in[0], forward[0].shape));
        TESSERA_RETURN_IF_ERROR(CheckShape("dlse", in[1], forward[1].shape));
        return Metas{in[2], in[3], in[4], in[5]};
      },
      .cost =
          [block_flops](const Metas& in, const Attrs&) {
            return OpCost{3.5 * block_flops(Metas{in[2], in[3]}), op_def::Bytes(in)};
          },
  }));
  const InferFn merge_infer = [heads_of](const Metas& in, const Attrs& attrs) -> Result<Metas> {
    TESSERA_RETURN_IF_ERROR(CheckDType("out_a", in[0], DType::kF32));
    TESSERA_ASSIGN_OR_RETURN(const int64_t heads, heads_of(attrs, in[0]));
    const Shape& out = in[0].shape;
    const Shape lse{out[0], heads, out[1]};
    TESSERA_RETURN_IF_ERROR(CheckShape("lse_a", in[1], lse));
    TESSERA_RETURN_IF_ERROR(CheckShape("out_b", in[2], out));
    TESSERA_RETURN_IF_ERROR(CheckShape("lse_b", in[3], lse));
    return Metas{in[0], in[1]};
  };
  TESSERA_RETURN_IF_ERROR(r.AddOp(
      OpDef{.name = "attention_merge_forward",
            .doc = "two partial attentions merged by their log-sum-exp (attribute heads): lse = "
                   "log(e^lse_a + e^lse_b), out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b",
            .input_names = {"out_a", "lse_a", "out_b", "lse_b"},
            .output_names = {"out", "lse"},
            .infer = merge_infer,
            .cost =
                [](const Metas& in, const Attrs&) {
                  return OpCost{3.0 * static_cast<double>(in[0].numel()), op_def::Bytes(in)};
                },
            .gradient = Rule("attention_merge_backward",
                             {OutGrad(0), OutGrad(1), In(0), In(1), In(2), In(3), Out(0), Out(1)},
                             {0, 1, 2, 3})}));
  return r.AddOp(OpDef{
      .name = "attention_merge_backward",
      .doc = "dout_a, dlse_a, dout_b, dlse_b of attention_merge_forward",
      .input_names = {"dout", "dlse", "out_a", "lse_a", "out_b", "lse_b", "out", "lse"},
      .output_names = {"dout_a", "dlse_a", "dout_b", "dlse_b"},
      .infer = [merge_infer](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(merge_infer(Metas{in[2], in[3], in[4], in[5]}, attrs).status());
        TESSERA_RETURN_IF_ERROR(CheckShape("dout", in[0], in[2].shape));
        TESSERA_RETURN_IF_ERROR(CheckShape("dlse", in[1], in[3].shape));
        TESSERA_RETURN_IF_ERROR(CheckShape("out", in[6], in[2].shape));
        TESSERA_RETURN_IF_ERROR(CheckShape("lse", in[7], in[3].shape));
        return Metas{in[2], in[3], in[4], in[5]};
      },
      .cost =
          [](const Metas& in, const Attrs&) {
            return OpCost{6.0 * static_cast<double>(in[0].numel()), op_def::Bytes(in)};
          },
  });
}

}  // namespace

Status AddTensorParallelOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(AddVocabShardEmbeddingOps(r));
  TESSERA_RETURN_IF_ERROR(AddPositionAddOps(r));
  TESSERA_RETURN_IF_ERROR(AddSequenceParallelOps(r));
  TESSERA_RETURN_IF_ERROR(AddRingAttentionOps(r));
  return AddVocabParallelCrossEntropyOps(r);
}

}  // namespace tessera::detail

namespace tessera {

int64_t AttentionBlockKeyOffset(const Attrs& attrs, int64_t keys) {
  if (!attrs.Has(kRingStepAttr)) return attrs.GetInt("key_offset", 0);
  const int64_t ranks = std::max<int64_t>(attrs.GetInt("ranks", 1), 1);
  const int64_t rank = attrs.GetInt(kSequenceRankAttr, 0);
  const int64_t source = ((rank - attrs.GetInt(kRingStepAttr, 0)) % ranks + ranks) % ranks;
  return (source - rank) * keys;
}

}  // namespace tessera

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
#include <vector>

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

// x (or its gradient) [B, S, C] f32 and wpe [>= S, C].
Status CheckPositions(const char* name, const TensorMeta& x, const TensorMeta& wpe) {
  TESSERA_RETURN_IF_ERROR(CheckDType(name, x, DType::kF32));
  if (x.shape.rank() != 3) {
    return InvalidArgument("input '{}' has shape {} but must be [B, S, C]", name,
                           x.shape.ToString());
  }
  TESSERA_RETURN_IF_ERROR(CheckMatrix("wpe", wpe, "[max_seq_len, C]"));
  if (wpe.shape[0] < x.shape[1] || wpe.shape[1] != x.shape[2]) {
    return InvalidArgument("input 'wpe' has shape {} but must be [>= {}, {}] for {} {}",
                           wpe.shape.ToString(), x.shape[1], x.shape[2], name, x.shape.ToString());
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
  TESSERA_RETURN_IF_ERROR(r.AddOp(
      OpDef{.name = "position_add_forward",
            .doc = "out[b,s] = x[b,s] + wpe[s]: the position embedding added to a token embedding",
            .input_names = {"x", "wpe"},
            .output_names = {"out"},
            .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
              TESSERA_RETURN_IF_ERROR(CheckPositions("x", in[0], in[1]));
              return Metas{in[0]};
            },
            .cost = ElementwiseCost(1),
            .gradient = Rule("position_add_backward", {OutGrad(0), In(1)}, {0, 1})}));
  return r.AddOp(OpDef{
      .name = "position_add_backward",
      .doc = "dx = dout; dwpe[s] = sum over the batch of dout[b,s] (0 past the sequence)",
      .input_names = {"dout", "wpe"},
      .output_names = {"dx", "dwpe"},
      .infer = [](const Metas& in, const Attrs&) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckPositions("dout", in[0], in[1]));
        return Metas{in[0], in[1]};
      },
      .cost = ElementwiseCost(1),
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

}  // namespace

Status AddTensorParallelOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(AddVocabShardEmbeddingOps(r));
  TESSERA_RETURN_IF_ERROR(AddPositionAddOps(r));
  return AddVocabParallelCrossEntropyOps(r);
}

}  // namespace tessera::detail

// What the sources of the standard ops share (internal to ops/): shape checks whose messages
// name the input and both shapes, attribute readers, and each op family's Add*Ops, which
// RegisterStandardOps (standard_ops.cc) calls. The families:
//   standard_ops_layers.cc          embedding, layer norm, linear, attention
//   standard_ops_elementwise.cc     elementwise ops
//   standard_ops_loss_optimizer.cc  losses and optimizers
//   standard_ops_transformer.cc     transformer layers (flat parameter groups, fused backward)
//   standard_ops_collective.cc      collective members
//   standard_ops_tensor_parallel.cc vocabulary-parallel embedding and cross-entropy
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/attrs.h"
#include "core/status.h"
#include "core/tensor.h"
#include "ops/flat_layout.h"
#include "ops/op_registry.h"

namespace tessera::detail {

using Metas = std::vector<TensorMeta>;

inline TensorMeta F32(Shape shape) {
  return TensorMeta{std::move(shape), DType::kF32, Device::Cpu()};
}
inline TensorMeta Scalar() { return F32(Shape{}); }

// ---- checks whose messages name the input and both shapes ----

Status CheckShape(const char* name, const TensorMeta& meta, const Shape& expected,
                  DType dtype = DType::kF32);
Status CheckRankAtLeast(const char* name, const TensorMeta& meta, int rank);
Status CheckSameShape(const char* name, const TensorMeta& meta, const char* other_name,
                      const TensorMeta& other);
// Token ids: i32 [batch, seq_len].
Status CheckTokens(const char* name, const TensorMeta& meta, int64_t batch, int64_t seq_len);

// Shape with the last dimension replaced.
Shape WithLastDim(const Shape& shape, int64_t last);

inline int64_t RowsOf(const Shape& shape) {
  return shape.rank() == 0 ? 1 : shape.numel() / shape[-1];
}

// Integer attribute `name`; InvalidArgument unless it is positive.
Result<int64_t> PositiveAttr(const Attrs& attrs, const char* name);

// Elementwise-style cost: a few flops per element of the first input, every byte touched once.
CostFn ElementwiseCost(double flops_per_element);

// Transformer layer dimensions, from attributes and the activation x[B,T,C]
// (standard_ops_transformer.cc); attention reads them from its qkv input.
struct TransformerShape {
  int64_t batch, seq_len, channels, heads, vocab, max_seq_len;
  DType activations;  // attribute activation_dtype: f32 (CPU) or bf16 (GPU)
  BlockRebuild rebuild = BlockRebuild::kNothing;  // attribute rebuild (blocks only)
};

// ---- the op families ----

Status AddEmbeddingOps(OpRegistry& r);
Status AddLayerNormOps(OpRegistry& r);
Status AddLinearOps(OpRegistry& r);
Status AddAttentionOps(OpRegistry& r);
Status AddElementwiseOps(OpRegistry& r);
Status AddLossAndOptimizerOps(OpRegistry& r);
Status AddTransformerLayerOps(OpRegistry& r);
Status AddCollectiveOps(OpRegistry& r);
Status AddTensorParallelOps(OpRegistry& r);

}  // namespace tessera::detail

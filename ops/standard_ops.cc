// The standard ops (standard_ops.h): RegisterStandardOps, and the shape checks and attribute
// readers their definitions share (standard_ops_internal.h lists the files of each family).
#include "ops/standard_ops.h"

#include <vector>

#include "ops/layer_program.h"
#include "ops/op_def_util.h"
#include "ops/plugin.h"
#include "ops/standard_ops_internal.h"
#include "ops/volume_ops.h"

namespace tessera {

namespace detail {

using op_def::Bytes;
using op_def::CheckDType;

Status CheckShape(const char* name, const TensorMeta& meta, const Shape& expected, DType dtype) {
  TESSERA_RETURN_IF_ERROR(CheckDType(name, meta, dtype));
  if (meta.shape != expected) {
    return InvalidArgument("input '{}' has shape {} but {} was expected", name,
                           meta.shape.ToString(), expected.ToString());
  }
  return Status::Ok();
}

Status CheckRankAtLeast(const char* name, const TensorMeta& meta, int rank) {
  if (meta.shape.rank() < rank) {
    return InvalidArgument("input '{}' has shape {} but needs rank >= {}", name,
                           meta.shape.ToString(), rank);
  }
  return Status::Ok();
}

Status CheckSameShape(const char* name, const TensorMeta& meta, const char* other_name,
                      const TensorMeta& other) {
  if (meta.shape != other.shape || meta.dtype != other.dtype) {
    return InvalidArgument("input '{}' is {} but input '{}' is {}; they must match", name,
                           meta.ToString(), other_name, other.ToString());
  }
  return Status::Ok();
}

Status CheckTokens(const char* name, const TensorMeta& meta, int64_t batch, int64_t seq_len) {
  return CheckShape(name, meta, Shape{batch, seq_len}, DType::kI32);
}

Shape WithLastDim(const Shape& shape, int64_t last) {
  std::vector<int64_t> dims = shape.dims();
  dims.back() = last;
  return Shape(std::move(dims));
}

Result<int64_t> PositiveAttr(const Attrs& attrs, const char* name) {
  TESSERA_ASSIGN_OR_RETURN(int64_t value, attrs.GetInt(name));
  if (value <= 0) return InvalidArgument("attribute '{}' must be positive, got {}", name, value);
  return value;
}

CostFn ElementwiseCost(double flops_per_element) {
  return [flops_per_element](const Metas& in, const Attrs&) {
    return OpCost{flops_per_element * static_cast<double>(in[0].numel()), 2 * Bytes(in)};
  };
}

}  // namespace detail

Status RegisterStandardOps(OpRegistry& registry) {
  TESSERA_RETURN_IF_ERROR(detail::AddCollectiveOps(registry));
  TESSERA_RETURN_IF_ERROR(detail::AddEmbeddingOps(registry));
  TESSERA_RETURN_IF_ERROR(detail::AddLayerNormOps(registry));
  TESSERA_RETURN_IF_ERROR(detail::AddLinearOps(registry));
  TESSERA_RETURN_IF_ERROR(detail::AddAttentionOps(registry));
  TESSERA_RETURN_IF_ERROR(detail::AddElementwiseOps(registry));
  TESSERA_RETURN_IF_ERROR(detail::AddLossAndOptimizerOps(registry));
  TESSERA_RETURN_IF_ERROR(detail::AddTransformerLayerOps(registry));
  TESSERA_RETURN_IF_ERROR(detail::AddTensorParallelOps(registry));
  TESSERA_RETURN_IF_ERROR(RegisterVolumeOps(registry));
  TESSERA_RETURN_IF_ERROR(RegisterLayerProgramOps(registry));
  return AddLoadedPluginOps(registry);
}

}  // namespace tessera

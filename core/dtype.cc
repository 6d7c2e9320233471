#include "core/dtype.h"

#include <array>

namespace tessera {

namespace {
constexpr std::array<DType, 6> kAllDTypes = {DType::kF32, DType::kBF16, DType::kF16,
                                             DType::kI32, DType::kI64,  DType::kU16};
}  // namespace

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
    case DType::kU16:
      return "u16";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view name) {
  for (DType dtype : kAllDTypes) {
    if (DTypeName(dtype) == name) return dtype;
  }
  return InvalidArgument("unknown dtype '{}' (expected one of f32, bf16, f16, i32, i64, u16)",
                         name);
}

}  // namespace tessera

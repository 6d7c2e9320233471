// Element types of tensors.
//
// f32 is the CPU compute type; bf16/f16 are GPU compute and storage types; i32/i64 hold token
// ids and indices; u16 is the storage type of token files (llm.c / nanoGPT .bin format).
#pragma once

#include <cstdint>
#include <string_view>

#include "core/status.h"

namespace tessera {

enum class DType : uint8_t { kF32, kBF16, kF16, kI32, kI64, kU16 };

// Bytes per element.
constexpr int64_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kU16:
      return 2;
  }
  return 0;
}

// The types activations carry gradients in: f32, and bf16 (mixed precision: the gradients of
// bf16 activations are bf16, parameters' stay f32).
constexpr bool CarriesGradients(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16;
}

// "f32", "bf16", "f16", "i32", "i64", "u16".
std::string_view DTypeName(DType dtype);
// Inverse of DTypeName; InvalidArgument naming the accepted names otherwise.
Result<DType> ParseDType(std::string_view name);

// Maps a C++ element type to its DType (used by Tensor::data<T>() to check accesses).
template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType kValue = DType::kF32;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType kValue = DType::kI32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType kValue = DType::kI64;
};
template <>
struct DTypeOf<uint16_t> {
  static constexpr DType kValue = DType::kU16;
};

}  // namespace tessera

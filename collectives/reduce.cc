#include "collectives/reduce.h"

#include <algorithm>

#include "core/half.h"

namespace tessera {

namespace {

// The op is a template parameter so each loop is branch-free and vectorises (f32 and i32 are
// plain loads; bf16/f16 widen to float, combine, and round once).
template <ReduceOp kOp, typename T, typename Load, typename Store>
void CombineWith(T* __restrict dst, const T* __restrict src, int64_t count, Load load,
                 Store store) {
  for (int64_t i = 0; i < count; ++i) {
    const auto a = load(dst[i]);
    const auto b = load(src[i]);
    if constexpr (kOp == ReduceOp::kSum || kOp == ReduceOp::kAvg) {
      dst[i] = store(a + b);
    } else if constexpr (kOp == ReduceOp::kMax) {
      dst[i] = store(a > b ? a : b);
    } else {
      dst[i] = store(a < b ? a : b);
    }
  }
}

template <typename T, typename Load, typename Store>
void Combine(void* dst, const void* src, int64_t count, ReduceOp op, Load load, Store store) {
  T* d = static_cast<T*>(dst);
  const T* s = static_cast<const T*>(src);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return CombineWith<ReduceOp::kSum>(d, s, count, load, store);
    case ReduceOp::kMax:
      return CombineWith<ReduceOp::kMax>(d, s, count, load, store);
    case ReduceOp::kMin:
      return CombineWith<ReduceOp::kMin>(d, s, count, load, store);
  }
}

constexpr auto kIdentity = [](auto x) { return x; };

template <typename T>
void DivideAll(T* data, int64_t count, T divisor) {
  for (int64_t i = 0; i < count; ++i) data[i] /= divisor;
}

}  // namespace

std::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

bool CollectiveSupports(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16 ||
         dtype == DType::kI32;
}

Status Accumulate(void* dst, const void* src, int64_t count, DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::kF32:
      Combine<float>(dst, src, count, op, kIdentity, kIdentity);
      return Status::Ok();
    case DType::kI32:
      Combine<int32_t>(dst, src, count, op, kIdentity, kIdentity);
      return Status::Ok();
    case DType::kBF16:
      Combine<uint16_t>(dst, src, count, op, Bf16ToFloat, FloatToBf16);
      return Status::Ok();
    case DType::kF16:
      Combine<uint16_t>(dst, src, count, op, HalfToFloat, FloatToHalf);
      return Status::Ok();
    default:
      return InvalidArgument("collectives do not reduce {} (f32, bf16, f16, i32 only)",
                             DTypeName(dtype));
  }
}

Status Finish(void* data, int64_t count, DType dtype, ReduceOp op, int ranks) {
  if (op != ReduceOp::kAvg || ranks <= 1) return Status::Ok();
  switch (dtype) {
    case DType::kF32:
      DivideAll(static_cast<float*>(data), count, static_cast<float>(ranks));
      return Status::Ok();
    case DType::kI32:
      DivideAll(static_cast<int32_t*>(data), count, ranks);
      return Status::Ok();
    case DType::kBF16:
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(data);
      const bool bf16 = dtype == DType::kBF16;
      for (int64_t i = 0; i < count; ++i) {
        const float v = (bf16 ? Bf16ToFloat(d[i]) : HalfToFloat(d[i])) / static_cast<float>(ranks);
        d[i] = bf16 ? FloatToBf16(v) : FloatToHalf(v);
      }
      return Status::Ok();
    }
    default:
      return InvalidArgument("collectives do not reduce {} (f32, bf16, f16, i32 only)",
                             DTypeName(dtype));
  }
}

}  // namespace tessera

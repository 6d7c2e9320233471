// 16-bit floating point: bfloat16 and IEEE half, converted through float.
//
// Conversions to 16 bits round to nearest, ties to even; NaN stays NaN; values beyond half's
// range become infinity. Used where host code touches bf16/f16 tensors (collective reductions,
// checking GPU kernels against CPU ones).
#pragma once

#include <cstdint>
#include <cstring>

namespace tessera {

inline float Bf16ToFloat(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

inline uint16_t FloatToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  }
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float HalfToFloat(uint16_t value);
uint16_t FloatToHalf(float value);

}  // namespace tessera

// Helpers for the gpu-labelled tests: skip cleanly without a device, move vectors to and from
// device buffers, draw random inputs, compare by relative error.
//
// How GPU results are judged (every kernel against its CPU counterpart, ops/cpu/kernels.h):
// inputs are drawn at random (never zeros), rounded to bf16 where the GPU reads bf16 so both sides
// compute on the same numbers, outputs are poisoned (NaN bytes) before the kernel runs so an
// element it forgets to write fails, and the comparison is ||gpu - cpu|| / ||cpu|| against a
// tolerance stated at each check (bf16 outputs carry 8 bits of mantissa: ~4e-3 per rounding).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/cuda_device.h"

namespace tessera::testing {

// Skips the calling test, with the reason, when no CUDA device is usable.
#define TESSERA_REQUIRE_GPU()                                                        \
  do {                                                                               \
    const ::tessera::CudaDevices probe_ = ::tessera::ProbeCudaDevices();             \
    if (probe_.devices.empty()) GTEST_SKIP() << "no CUDA device: " << probe_.reason; \
  } while (0)

#define TESSERA_ASSERT_CUDA(call)                                                  \
  do {                                                                             \
    const cudaError_t error_ = (call);                                             \
    ASSERT_EQ(error_, cudaSuccess) << #call << ": " << cudaGetErrorString(error_); \
  } while (0)

// A device buffer of n elements of T, freed on destruction.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(int64_t n) : n_(n) {
    if (cudaMalloc(reinterpret_cast<void**>(&data_),
                   static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T)) != cudaSuccess) {
      data_ = nullptr;
    }
  }
  explicit DeviceBuffer(const std::vector<T>& host)
      : DeviceBuffer(static_cast<int64_t>(host.size())) {
    Upload(host);
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return data_; }
  int64_t size() const { return n_; }
  void Upload(const std::vector<T>& host) {
    cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  // Fills every byte with 0xFF: NaN for floats and bf16, -1 for integers.
  void Poison() { cudaMemset(data_, 0xFF, static_cast<size_t>(n_) * sizeof(T)); }
  std::vector<T> Download() const {
    std::vector<T> host(static_cast<size_t>(n_));
    cudaDeviceSynchronize();
    cudaMemcpy(host.data(), data_, host.size() * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }

 private:
  T* data_ = nullptr;
  int64_t n_ = 0;
};

inline std::vector<float> RandomFloats(int64_t n, uint64_t seed, float lo = -1.0f,
                                       float hi = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

inline std::vector<int32_t> RandomInts(int64_t n, uint64_t seed, int32_t lo, int32_t hi_exclusive) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(lo, hi_exclusive - 1);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int32_t& x : v) x = dist(rng);
  return v;
}

inline std::vector<__nv_bfloat16> ToBf16(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}

inline std::vector<float> ToF32(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

// The values a bf16 tensor of v would hold (so CPU references see exactly the GPU's inputs).
inline std::vector<float> RoundToBf16(const std::vector<float>& v) { return ToF32(ToBf16(v)); }

// ||got - want|| / ||want||; infinity when sizes differ or anything is NaN in got.
inline double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return INFINITY;
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

}  // namespace tessera::testing

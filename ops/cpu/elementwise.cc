// Embedding, GELU, elementwise arithmetic and column sums.
#include <cmath>
#include <cstring>

#include "ops/cpu/kernels.h"
#include "ops/cpu/parallel.h"
#include "ops/cpu/vector_math.h"

namespace tessera::cpu {

using detail::ParallelChunks;
using detail::ParallelFor;

namespace {
constexpr int64_t kElementGrain = 1 << 14;
// sqrt(2/pi) and the cubic coefficient of the tanh approximation of GELU.
constexpr float kGeluBeta = 0.7978845608028654f;
constexpr float kGeluKappa = 0.044715f;

// One element's GELU pieces, shared by the forward, the backward and the backward that rebuilds
// the forward's values: the same expressions compile to the same roundings, so a rebuilt value
// equals the forward's bit for bit.
inline float GeluTanh(float v) { return VectorTanh(kGeluBeta * (v + kGeluKappa * v * v * v)); }
inline float GeluFromTanh(float v, float tanh_inner) { return 0.5f * v * (1.0f + tanh_inner); }
inline float GeluDerivative(float v, float tanh_inner) {
  const float v2 = v * v;
  const float left = 0.5f * (1.0f + tanh_inner);
  const float right =
      0.5f * v * (1.0f - tanh_inner * tanh_inner) * kGeluBeta * (1.0f + 3.0f * kGeluKappa * v2);
  return left + right;
}
}  // namespace

Status EmbeddingForward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                        int64_t batch, int64_t seq_len, int64_t channels, int64_t vocab) {
  const int64_t rows = batch * seq_len;
  for (int64_t r = 0; r < rows; ++r) {
    if (tokens[r] < 0 || tokens[r] >= vocab) {
      return InvalidArgument(
          "token id {} at batch {}, position {} is outside the vocabulary "
          "[0, {})",
          tokens[r], r / seq_len, r % seq_len, vocab);
    }
  }
  ParallelFor(rows, std::max<int64_t>(1, kElementGrain / channels),
              [&](int64_t begin, int64_t end) {
                for (int64_t r = begin; r < end; ++r) {
                  const float* token_row = wte + static_cast<int64_t>(tokens[r]) * channels;
                  const float* position_row = wpe + (r % seq_len) * channels;
                  float* out_row = out + r * channels;
                  for (int64_t c = 0; c < channels; ++c)
                    out_row[c] = token_row[c] + position_row[c];
                }
              });
  return Status::Ok();
}

void EmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                       int64_t batch, int64_t seq_len, int64_t channels) {
  // Parallel over channel blocks: a token repeated in the batch adds to the same row of dwte,
  // so splitting rows would race; splitting channels never does, and keeps a fixed order.
  constexpr int64_t kChannelBlock = 64;
  ParallelChunks(channels, kChannelBlock, [&](int64_t, int64_t c0, int64_t c1) {
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t t = 0; t < seq_len; ++t) {
        const float* g = dout + (b * seq_len + t) * channels;
        float* token_row = dwte + static_cast<int64_t>(tokens[b * seq_len + t]) * channels;
        float* position_row = dwpe + t * channels;
        for (int64_t c = c0; c < c1; ++c) {
          token_row[c] += g[c];
          position_row[c] += g[c];
        }
      }
    }
  });
}

void GeluForward(float* out, const float* x, int64_t n) {
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = GeluFromTanh(x[i], GeluTanh(x[i]));
  });
}

void GeluBackward(float* dx, const float* dout, const float* x, int64_t n) {
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dx[i] = dout[i] * GeluDerivative(x[i], GeluTanh(x[i]));
  });
}

void GeluBackwardRebuilding(float* dx, float* out, const float* dout, const float* x, int64_t n) {
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float v = x[i];
      const float tanh_inner = GeluTanh(v);
      out[i] = GeluFromTanh(v, tanh_inner);
      dx[i] = dout[i] * GeluDerivative(v, tanh_inner);
    }
  });
}

void Add(float* out, const float* a, const float* b, int64_t n) {
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = a[i] + b[i];
  });
}

void SumRows(float* out, const float* x, int64_t rows, int64_t cols) {
  constexpr int64_t kColumnBlock = 256;
  ParallelChunks(cols, kColumnBlock, [&](int64_t, int64_t c0, int64_t c1) {
    float* o = out + c0;
    const int64_t width = c1 - c0;
    std::memset(o, 0, static_cast<size_t>(width) * sizeof(float));
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = x + r * cols + c0;
      for (int64_t c = 0; c < width; ++c) o[c] += row[c];
    }
  });
}

}  // namespace tessera::cpu

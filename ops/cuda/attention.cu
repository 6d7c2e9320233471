// Causal multi-head self-attention on tensor cores, flash-attention style: the T x T score matrix
// only ever exists as 64 x 64 tiles in registers.
//
// Work split. Every kernel runs one block of 4 warps (128 threads) per (batch*head, 64-row tile);
// each warp owns 16 rows of the block's tile and loops over the 64-row tiles of the other side:
//   forward   query tile i, key tiles 0..i:   S = Q K^T, online softmax, O += P V
//   dq        query tile i, key tiles 0..i:   S, P = exp(S - lse), dP = dO V^T,
//                                             dS = P (dP - D), dQ += dS K; also writes D
//   dk/dv     key tile j, query tiles j..end: S^T = K Q^T, P^T, dV += P^T dO,
//                                             dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q
// with D_i = rowsum(dO_i * O_i) (fp32, computed by the dq kernel into scratch, read by dk/dv).
// The backward is two kernels rather than one with atomics: dQ and dK/dV each sum over their own
// loop in a fixed order, so the backward is deterministic (bitwise reproducible), at the price of
// recomputing S and dP once more (7 tile products per tile pair instead of 5).
//
// Products. mma.sync m16n8k16 (bf16 in, fp32 accumulate). A 16-row warp slab of Q (or dO, K, V)
// is held as A fragments in registers (loaded with ldmatrix once, or per tile where registers
// are short: kForwardSlabInRegisters, kBackwardSlabsInRegisters); the other operand is a 64 x HS
// shared-memory tile read with ldmatrix (plain for X Y^T, transposed for P Y). A score
// accumulator (16 x 64, fp32) has exactly the register layout of the bf16 A fragments of the next
// product, so P and dS go from registers to the tensor cores without touching shared memory.
//
// Shared memory. Tiles are 64 rows x HS bf16, each row padded by 16 bytes so the 8 rows one
// ldmatrix reads fall on distinct banks. The streamed tiles (K, V in forward and dq; Q, dO, lse,
// D in dk/dv) are double-buffered: cp.async fetches tile j+1 while tile j is used. Rows at or past
// T are zero-filled, so a ragged last tile adds nothing; its scores are masked with the causal
// diagonal (key > query, or key >= T), which can only happen in the diagonal tile (and, for
// dk/dv, the last query tile).
//
// Numerics. Scores are scaled by log2(e)/sqrt(hs) and exponentiated with exp2 (ex2.approx); the
// running row max and sum are fp32 (the sum kept per thread and reduced across the 4 lanes of a
// row at the end); P and dS are rounded to bf16 as tensor-core inputs, everything else
// accumulates in fp32. lse = ln(2) * (max2 + log2(sum)) is stored in natural log, as on the CPU.
#include "ops/cuda/common.cuh"  // first: see there

#include <cmath>
#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "ops/cuda/kernels.h"

namespace tessera::cuda {

namespace {

constexpr int kTile = 64;  // rows of a query or key tile
constexpr int kWarps = 4;  // each owns kTile / kWarps = 16 rows of the block's tile
constexpr int kThreads = kWarps * 32;
constexpr int kMaxTiles = 65535;  // gridDim.y limit
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// A 64 x HS bf16 tile in shared memory, rows padded by 8 elements (16 bytes).
template <int HS>
struct Tile {
  static constexpr int kStride = HS + 8;
  static constexpr int kElems = kTile * kStride;
  static constexpr int kBytes = kElems * static_cast<int>(sizeof(bf16));
};

// A warp's A-operand fragments stay in registers across the loop up to these head sizes, and are
// reloaded from shared memory per tile above them (the backward holds two slabs and two 16 x HS
// accumulators, so it runs out of registers sooner).
template <int HS>
constexpr bool kForwardSlabInRegisters = HS <= 64;
template <int HS>
constexpr bool kBackwardSlabsInRegisters = HS <= 32;
// Resident blocks the backward kernels are compiled for: 3 caps them at 168 registers, which cost
// a few bytes of spills at HS = 64 but ran 7% faster than 2 blocks of ~240 (H200); at HS = 128 the
// cap spilled kilobytes and ran 50% slower, so it gets none.
template <int HS>
constexpr int kBackwardMinBlocks = HS <= 64 ? 3 : 1;

// Shared-memory bytes of each kernel (see the layouts at the top of each kernel).
template <int HS>
constexpr int kForwardSmem = 5 * Tile<HS>::kBytes;  // Q, 2 x K, 2 x V
template <int HS>
constexpr int kDqSmem = 6 * Tile<HS>::kBytes + kTile * 4;  // Q, dO, 2 x K, 2 x V, D
template <int HS>
constexpr int kDkDvSmem = 6 * Tile<HS>::kBytes + 4 * kTile * 4;  // K, V, 2 x (Q, dO, lse, D)

// ---- PTX wrappers ----

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zero-fills the destination when !valid (then `src`
// is not read but must still be a valid address).
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddress(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most `kPending` of this thread's most recent groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 bf16 matrices; lane l gives the address of row l % 8 of matrix l / 8 and receives, in
// r[m], elements (l / 4, 2 * (l % 4) + {0, 1}) of matrix m (transposed first with Trans).
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(p))
               : "memory");
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(p))
               : "memory");
}

// d (16x8, fp32) += a (16x16 bf16, row-major fragments) * b (16x8 bf16, column fragments).
// Lane l holds d[0..1] at (row l/4, cols 2*(l%4) + {0,1}) and d[2..3] at row l/4 + 8.
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x, one MUFU.EX2 (relative error ~2^-22; 2^-inf = +0, tiny results flush to 0). exp2f proper
// adds range handling around the same instruction, which cost the backward 5% (H200, T = 1024).
__device__ __forceinline__ float Exp2Approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  uint32_t bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits;
}

// ---- tile helpers (all warps of the block call them with the same arguments) ----

// Starts copying rows [row0, row0 + 64) of a [seq_len, HS] view (rows row_stride elements apart)
// into `tile`; rows at or past seq_len become zeros.
template <int HS>
__device__ __forceinline__ void LoadTileAsync(bf16* tile, const bf16* view, int64_t row_stride,
                                              int row0, int seq_len) {
  constexpr int kChunks = HS / 8;  // 16-byte pieces per row
  static_assert(kTile * kChunks % kThreads == 0);
#pragma unroll
  for (int it = 0; it < kTile * kChunks / kThreads; ++it) {
    const int i = it * kThreads + static_cast<int>(threadIdx.x);
    const int r = i / kChunks, c = i % kChunks;
    const int row = row0 + r;
    const bool valid = row < seq_len;
    CpAsync16(tile + r * Tile<HS>::kStride + c * 8, view + (valid ? row : 0) * row_stride + c * 8,
              valid);
  }
}

// A fragments of the 16 x HS slab at rows [row0, row0 + 16) of a tile, one per 16-wide k step.
template <int HS>
__device__ __forceinline__ void LoadSlab(uint32_t (&a)[HS / 16][4], const bf16* tile, int row0,
                                         int lane) {
  const bf16* p = tile + (row0 + (lane & 15)) * Tile<HS>::kStride + (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < HS / 16; ++kk) LdMatrixX4(a[kk], p + kk * 16);
}

// acc (16 x 64) = A B^T: A a 16 x HS slab (fragments), B a 64 x HS tile (row n of B is column n
// of the result).
template <int HS>
__device__ __forceinline__ void MmaSlabTileT(float (&acc)[8][4], const uint32_t (&a)[HS / 16][4],
                                             const bf16* b_tile, int lane) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
  }
  // Matrix m of the x4 load: rows 8*(m/2).. of B (n), columns 8*(m%2).. of the k step, giving
  // {b0b1, b2b3} of n-tile 2*np and then of n-tile 2*np + 1.
  const int m = lane >> 3;
  const bf16* p = b_tile + ((m >> 1) * 8 + (lane & 7)) * Tile<HS>::kStride + (m & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < HS / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t b[4];
      LdMatrixX4(b, p + np * 16 * Tile<HS>::kStride + kk * 16);
      Mma16816(acc[2 * np], a[kk], b[0], b[1]);
      Mma16816(acc[2 * np + 1], a[kk], b[2], b[3]);
    }
  }
}

// acc (16 x HS) += P B: P a 16 x 64 score accumulator (rounded to bf16 here), B a 64 x HS tile.
template <int HS>
__device__ __forceinline__ void MmaScoresTile(float (&acc)[HS / 8][4], const float (&p)[8][4],
                                              const bf16* b_tile, int lane) {
  // Matrix m of the transposed x4 load: rows 8*(m%2).. of the k step (B's rows), columns
  // 8*(m/2).. of n, giving {b0b1, b2b3} of n-tile 2*np and then of n-tile 2*np + 1.
  const int m = lane >> 3;
  const bf16* p_lane = b_tile + ((m & 1) * 8 + (lane & 7)) * Tile<HS>::kStride + (m >> 1) * 8;
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    // The accumulators of n-tiles 2kk and 2kk+1 are exactly the A fragment of k step kk.
    const uint32_t a[4] = {
        PackBf16(p[2 * kk][0], p[2 * kk][1]), PackBf16(p[2 * kk][2], p[2 * kk][3]),
        PackBf16(p[2 * kk + 1][0], p[2 * kk + 1][1]), PackBf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int np = 0; np < HS / 16; ++np) {
      uint32_t b[4];
      LdMatrixX4Trans(b, p_lane + kk * 16 * Tile<HS>::kStride + np * 16);
      Mma16816(acc[2 * np], a, b[0], b[1]);
      Mma16816(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// Writes a warp's 16 x HS accumulator, times `scale`, as bf16 rows [row0, row0 + 16) of a view
// (rows row_stride elements apart); rows at or past seq_len are skipped.
template <int HS>
__device__ __forceinline__ void StoreSlab(bf16* view, int64_t row_stride, int row0, int seq_len,
                                          const float (&acc)[HS / 8][4], float scale_a,
                                          float scale_b, int lane) {
  const int row_a = row0 + (lane >> 2), row_b = row_a + 8;
#pragma unroll
  for (int nt = 0; nt < HS / 8; ++nt) {
    const int col = nt * 8 + 2 * (lane & 3);
    if (row_a < seq_len) {
      *reinterpret_cast<__nv_bfloat162*>(view + row_a * row_stride + col) =
          __floats2bfloat162_rn(acc[nt][0] * scale_a, acc[nt][1] * scale_a);
    }
    if (row_b < seq_len) {
      *reinterpret_cast<__nv_bfloat162*>(view + row_b * row_stride + col) =
          __floats2bfloat162_rn(acc[nt][2] * scale_b, acc[nt][3] * scale_b);
    }
  }
}

__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---- kernels ----
// Grid: x = batch * heads (b = x / heads, h = x % heads), y = tile. Forward and dq take the
// heaviest (last) query tiles first so the causal triangle's long rows do not trail.

template <int HS>
__global__ void __launch_bounds__(kThreads)
    AttentionForwardKernel(bf16* __restrict__ out, float* __restrict__ lse,
                           const bf16* __restrict__ qkv, int seq_len, int channels, int heads,
                           float scale_log2) {
  extern __shared__ __align__(16) unsigned char smem[];
  using T = Tile<HS>;
  bf16* q_s = reinterpret_cast<bf16*>(smem);
  bf16* k_s = q_s + T::kElems;      // 2 stages
  bf16* v_s = k_s + 2 * T::kElems;  // 2 stages

  const int bh = static_cast<int>(blockIdx.x), b = bh / heads, h = bh % heads;
  const int q_tile = static_cast<int>(gridDim.y - 1 - blockIdx.y), q0 = q_tile * kTile;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int slab = warp * 16;  // the warp's first row within the tile
  const int64_t qkv_stride = 3 * static_cast<int64_t>(channels);
  const bf16* q_g = qkv + static_cast<int64_t>(b) * seq_len * qkv_stride + h * HS;
  const bf16* k_g = q_g + channels;
  const bf16* v_g = q_g + 2 * channels;

  LoadTileAsync<HS>(q_s, q_g, qkv_stride, q0, seq_len);
  LoadTileAsync<HS>(k_s, k_g, qkv_stride, 0, seq_len);
  LoadTileAsync<HS>(v_s, v_g, qkv_stride, 0, seq_len);
  CpAsyncCommit();

  // Rows row_a = q0 + slab + lane/4 and row_b = row_a + 8 of the tile belong to this thread.
  const int row_a = q0 + slab + (lane >> 2), row_b = row_a + 8;
  float o[HS / 8][4] = {};
  float max_a = -INFINITY, max_b = -INFINITY;  // running row max of the log2-scaled scores
  float sum_a = 0.0f, sum_b = 0.0f;            // this thread's part of the running row sum
  uint32_t q_frag[HS / 16][4] = {};

  const int n_kv = q_tile + 1;
  for (int j = 0; j < n_kv; ++j) {
    if (j + 1 < n_kv) {
      const int stage = (j + 1) & 1;
      LoadTileAsync<HS>(k_s + stage * T::kElems, k_g, qkv_stride, (j + 1) * kTile, seq_len);
      LoadTileAsync<HS>(v_s + stage * T::kElems, v_g, qkv_stride, (j + 1) * kTile, seq_len);
    }
    CpAsyncCommit();
    CpAsyncWait<1>();  // everything but the prefetch just issued has landed
    __syncthreads();
    if (!kForwardSlabInRegisters<HS> || j == 0) LoadSlab<HS>(q_frag, q_s, slab, lane);
    const bf16* k_t = k_s + (j & 1) * T::kElems;
    const bf16* v_t = v_s + (j & 1) * T::kElems;

    float s[8][4];
    MmaSlabTileT<HS>(s, q_frag, k_t, lane);
    // Scale to log2 units; mask the future (and keys past T) in the diagonal tile, the only tile
    // that has any: earlier tiles end before q0 <= every row here.
    const bool diagonal = j == n_kv - 1;
    float tile_max_a = max_a, tile_max_b = max_b;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = j * kTile + nt * 8 + 2 * (lane & 3) + (e & 1);
        const int row = e < 2 ? row_a : row_b;
        float x = s[nt][e] * scale_log2;
        if (diagonal && (col > row || col >= seq_len)) x = -INFINITY;
        s[nt][e] = x;
      }
      tile_max_a = fmaxf(tile_max_a, fmaxf(s[nt][0], s[nt][1]));
      tile_max_b = fmaxf(tile_max_b, fmaxf(s[nt][2], s[nt][3]));
    }
    // Every row sees key 0 in tile 0, so the max is finite from then on; the guard only keeps
    // exp2(-inf - -inf) out should that ever change.
    const float new_max_a = QuadMax(tile_max_a), new_max_b = QuadMax(tile_max_b);
    const float base_a = new_max_a == -INFINITY ? 0.0f : new_max_a;
    const float base_b = new_max_b == -INFINITY ? 0.0f : new_max_b;
    const float alpha_a = Exp2Approx(max_a - base_a), alpha_b = Exp2Approx(max_b - base_b);
    max_a = new_max_a;
    max_b = new_max_b;
    float tile_sum_a = 0.0f, tile_sum_b = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      s[nt][0] = Exp2Approx(s[nt][0] - base_a);
      s[nt][1] = Exp2Approx(s[nt][1] - base_a);
      s[nt][2] = Exp2Approx(s[nt][2] - base_b);
      s[nt][3] = Exp2Approx(s[nt][3] - base_b);
      tile_sum_a += s[nt][0] + s[nt][1];
      tile_sum_b += s[nt][2] + s[nt][3];
    }
    sum_a = sum_a * alpha_a + tile_sum_a;
    sum_b = sum_b * alpha_b + tile_sum_b;
#pragma unroll
    for (int nt = 0; nt < HS / 8; ++nt) {
      o[nt][0] *= alpha_a;
      o[nt][1] *= alpha_a;
      o[nt][2] *= alpha_b;
      o[nt][3] *= alpha_b;
    }
    MmaScoresTile<HS>(o, s, v_t, lane);
    __syncthreads();  // stage j & 1 is refilled by the next iteration's prefetch
  }

  sum_a = QuadSum(sum_a);
  sum_b = QuadSum(sum_b);
  const int64_t out_row0 = static_cast<int64_t>(b) * seq_len;
  StoreSlab<HS>(out + out_row0 * channels + h * HS, channels, q0 + slab, seq_len, o, 1.0f / sum_a,
                1.0f / sum_b, lane);
  if ((lane & 3) == 0) {
    float* lse_row = lse + static_cast<int64_t>(bh) * seq_len;
    if (row_a < seq_len) lse_row[row_a] = (max_a + log2f(sum_a)) * kLn2;
    if (row_b < seq_len) lse_row[row_b] = (max_b + log2f(sum_b)) * kLn2;
  }
}

// dQ for one query tile, and D = rowsum(dO * O) of its rows into d_rows [B, heads, T].
template <int HS>
__global__ void __launch_bounds__(kThreads, kBackwardMinBlocks<HS>)
    AttentionBackwardDqKernel(bf16* __restrict__ dqkv, float* __restrict__ d_rows,
                              const bf16* __restrict__ dout, const bf16* __restrict__ out,
                              const bf16* __restrict__ qkv, const float* __restrict__ lse,
                              int seq_len, int channels, int heads, float scale, float scale_log2) {
  extern __shared__ __align__(16) unsigned char smem[];
  using T = Tile<HS>;
  bf16* q_s = reinterpret_cast<bf16*>(smem);
  bf16* do_s = q_s + T::kElems;
  bf16* k_s = do_s + T::kElems;     // 2 stages
  bf16* v_s = k_s + 2 * T::kElems;  // 2 stages
  float* d_s = reinterpret_cast<float*>(v_s + 2 * T::kElems);

  const int bh = static_cast<int>(blockIdx.x), b = bh / heads, h = bh % heads;
  const int q_tile = static_cast<int>(gridDim.y - 1 - blockIdx.y), q0 = q_tile * kTile;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int slab = warp * 16;
  const int64_t qkv_stride = 3 * static_cast<int64_t>(channels);
  const int64_t row0 = static_cast<int64_t>(b) * seq_len;
  const bf16* q_g = qkv + row0 * qkv_stride + h * HS;
  const bf16* k_g = q_g + channels;
  const bf16* v_g = q_g + 2 * channels;
  const bf16* do_g = dout + row0 * channels + h * HS;
  const bf16* o_g = out + row0 * channels + h * HS;

  LoadTileAsync<HS>(q_s, q_g, qkv_stride, q0, seq_len);
  LoadTileAsync<HS>(do_s, do_g, channels, q0, seq_len);
  LoadTileAsync<HS>(k_s, k_g, qkv_stride, 0, seq_len);
  LoadTileAsync<HS>(v_s, v_g, qkv_stride, 0, seq_len);
  CpAsyncCommit();

  // D of the tile's rows straight from global memory, two threads per row (HS/2 columns each).
  {
    const int r = static_cast<int>(threadIdx.x) / 2, half = static_cast<int>(threadIdx.x) % 2;
    const int row = q0 + r;
    const int64_t offset = static_cast<int64_t>(row) * channels + half * (HS / 2);
    float d = 0.0f;
    if (row < seq_len) {
      const uint4* a = reinterpret_cast<const uint4*>(do_g + offset);
      const uint4* c = reinterpret_cast<const uint4*>(o_g + offset);
#pragma unroll
      for (int v = 0; v < HS / 16; ++v) {
        const uint4 x = a[v], y = c[v];
        const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&x);
        const __nv_bfloat162* y2 = reinterpret_cast<const __nv_bfloat162*>(&y);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 xf = __bfloat1622float2(x2[k]), yf = __bfloat1622float2(y2[k]);
          d += xf.x * yf.x + xf.y * yf.y;
        }
      }
    }
    d += __shfl_xor_sync(0xffffffffu, d, 1);
    if (half == 0) {
      d_s[r] = d;  // read after the loop's first barrier
      if (row < seq_len) d_rows[static_cast<int64_t>(bh) * seq_len + row] = d;
    }
  }

  const int row_a = q0 + slab + (lane >> 2), row_b = row_a + 8;
  const float* lse_row = lse + static_cast<int64_t>(bh) * seq_len;
  const float lse_a = row_a < seq_len ? lse_row[row_a] * kLog2e : 0.0f;
  const float lse_b = row_b < seq_len ? lse_row[row_b] * kLog2e : 0.0f;
  float d_a = 0.0f, d_b = 0.0f;
  float dq[HS / 8][4] = {};
  uint32_t q_frag[HS / 16][4] = {};
  uint32_t do_frag[HS / 16][4] = {};

  const int n_kv = q_tile + 1;
  for (int j = 0; j < n_kv; ++j) {
    if (j + 1 < n_kv) {
      const int stage = (j + 1) & 1;
      LoadTileAsync<HS>(k_s + stage * T::kElems, k_g, qkv_stride, (j + 1) * kTile, seq_len);
      LoadTileAsync<HS>(v_s + stage * T::kElems, v_g, qkv_stride, (j + 1) * kTile, seq_len);
    }
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();
    if (j == 0) {
      d_a = d_s[slab + (lane >> 2)];
      d_b = d_s[slab + (lane >> 2) + 8];
    }
    if (!kBackwardSlabsInRegisters<HS> || j == 0) {
      LoadSlab<HS>(q_frag, q_s, slab, lane);
      LoadSlab<HS>(do_frag, do_s, slab, lane);
    }
    const bf16* k_t = k_s + (j & 1) * T::kElems;
    const bf16* v_t = v_s + (j & 1) * T::kElems;

    float p[8][4];
    MmaSlabTileT<HS>(p, q_frag, k_t, lane);
    const bool diagonal = j == n_kv - 1;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = j * kTile + nt * 8 + 2 * (lane & 3) + (e & 1);
        const int row = e < 2 ? row_a : row_b;
        const bool masked = diagonal && (col > row || col >= seq_len);
        p[nt][e] = masked ? 0.0f : Exp2Approx(p[nt][e] * scale_log2 - (e < 2 ? lse_a : lse_b));
      }
    }
    float ds[8][4];
    MmaSlabTileT<HS>(ds, do_frag, v_t, lane);  // dP
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      ds[nt][0] = p[nt][0] * (ds[nt][0] - d_a);
      ds[nt][1] = p[nt][1] * (ds[nt][1] - d_a);
      ds[nt][2] = p[nt][2] * (ds[nt][2] - d_b);
      ds[nt][3] = p[nt][3] * (ds[nt][3] - d_b);
    }
    MmaScoresTile<HS>(dq, ds, k_t, lane);
    __syncthreads();
  }

  StoreSlab<HS>(dqkv + row0 * qkv_stride + h * HS, qkv_stride, q0 + slab, seq_len, dq, scale, scale,
                lane);
}

// dK and dV for one key tile. REQUIRES: d_rows written by AttentionBackwardDqKernel.
template <int HS>
__global__ void __launch_bounds__(kThreads, kBackwardMinBlocks<HS>)
    AttentionBackwardDkDvKernel(bf16* __restrict__ dqkv, const float* __restrict__ d_rows,
                                const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                const float* __restrict__ lse, int seq_len, int channels, int heads,
                                float scale, float scale_log2) {
  extern __shared__ __align__(16) unsigned char smem[];
  using T = Tile<HS>;
  bf16* k_s = reinterpret_cast<bf16*>(smem);
  bf16* v_s = k_s + T::kElems;
  bf16* q_s = v_s + T::kElems;                                    // 2 stages
  bf16* do_s = q_s + 2 * T::kElems;                               // 2 stages
  float* lse_s = reinterpret_cast<float*>(do_s + 2 * T::kElems);  // 2 stages, log2 units
  float* d_s = lse_s + 2 * kTile;                                 // 2 stages

  const int bh = static_cast<int>(blockIdx.x), b = bh / heads, h = bh % heads;
  const int k_tile = static_cast<int>(blockIdx.y), k0 = k_tile * kTile;
  const int n_q = static_cast<int>(gridDim.y);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int slab = warp * 16;
  const int64_t qkv_stride = 3 * static_cast<int64_t>(channels);
  const int64_t row0 = static_cast<int64_t>(b) * seq_len;
  const bf16* q_g = qkv + row0 * qkv_stride + h * HS;
  const bf16* k_g = q_g + channels;
  const bf16* v_g = q_g + 2 * channels;
  const bf16* do_g = dout + row0 * channels + h * HS;
  const float* lse_row = lse + static_cast<int64_t>(bh) * seq_len;
  const float* d_row = d_rows + static_cast<int64_t>(bh) * seq_len;

  // Query tile i into stage `stage`: Q and dO asynchronously, lse and D by plain stores (both
  // visible after the barrier that follows the wait for the tile).
  auto load_query_tile = [&](int i, int stage) {
    LoadTileAsync<HS>(q_s + stage * T::kElems, q_g, qkv_stride, i * kTile, seq_len);
    LoadTileAsync<HS>(do_s + stage * T::kElems, do_g, channels, i * kTile, seq_len);
    if (threadIdx.x < kTile) {
      const int row = i * kTile + static_cast<int>(threadIdx.x);
      lse_s[stage * kTile + threadIdx.x] = row < seq_len ? lse_row[row] * kLog2e : 0.0f;
      d_s[stage * kTile + threadIdx.x] = row < seq_len ? d_row[row] : 0.0f;
    }
  };

  LoadTileAsync<HS>(k_s, k_g, qkv_stride, k0, seq_len);
  LoadTileAsync<HS>(v_s, v_g, qkv_stride, k0, seq_len);
  load_query_tile(k_tile, 0);
  CpAsyncCommit();

  // Keys key_a = k0 + slab + lane/4 and key_b = key_a + 8 belong to this thread.
  const int key_a = k0 + slab + (lane >> 2), key_b = key_a + 8;
  float dk[HS / 8][4] = {};
  float dv[HS / 8][4] = {};
  uint32_t k_frag[HS / 16][4] = {};
  uint32_t v_frag[HS / 16][4] = {};

  for (int i = k_tile; i < n_q; ++i) {
    const int stage = (i - k_tile) & 1;
    if (i + 1 < n_q) load_query_tile(i + 1, stage ^ 1);
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();
    if (!kBackwardSlabsInRegisters<HS> || i == k_tile) {
      LoadSlab<HS>(k_frag, k_s, slab, lane);
      LoadSlab<HS>(v_frag, v_s, slab, lane);
    }
    const bf16* q_t = q_s + stage * T::kElems;
    const bf16* do_t = do_s + stage * T::kElems;
    const float* lse_t = lse_s + stage * kTile;
    const float* d_t = d_s + stage * kTile;

    // P^T: rows are this warp's keys, columns the tile's queries. Masked: queries before the key
    // (only in the diagonal tile) and queries past T (only in the last tile).
    float p[8][4];
    MmaSlabTileT<HS>(p, k_frag, q_t, lane);
    const bool edge = i == k_tile || i == n_q - 1;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * (lane & 3) + (e & 1);
        const int query = i * kTile + col;
        const int key = e < 2 ? key_a : key_b;
        const bool masked = edge && (query < key || query >= seq_len);
        p[nt][e] = masked ? 0.0f : Exp2Approx(p[nt][e] * scale_log2 - lse_t[col]);
      }
    }
    MmaScoresTile<HS>(dv, p, do_t, lane);
    float ds[8][4];
    MmaSlabTileT<HS>(ds, v_frag, do_t, lane);  // dP^T
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        ds[nt][e] = p[nt][e] * (ds[nt][e] - d_t[nt * 8 + 2 * (lane & 3) + (e & 1)]);
      }
    }
    MmaScoresTile<HS>(dk, ds, q_t, lane);
    __syncthreads();
  }

  bf16* dk_g = dqkv + row0 * qkv_stride + channels + h * HS;
  StoreSlab<HS>(dk_g, qkv_stride, k0 + slab, seq_len, dk, scale, scale, lane);
  StoreSlab<HS>(dk_g + channels, qkv_stride, k0 + slab, seq_len, dv, 1.0f, 1.0f, lane);
}

// ---- launchers ----

// Checks the sizes every attention launcher shares; on success *head_size is C / heads.
Status CheckAttentionShape(const char* op, int64_t batch, int64_t seq_len, int64_t channels,
                           int64_t heads, int* head_size) {
  if (batch <= 0 || seq_len <= 0 || channels <= 0 || heads <= 0) {
    return InvalidArgument("{}: batch {}, seq_len {}, channels {} and heads {} must be positive",
                           op, batch, seq_len, channels, heads);
  }
  if (channels % heads != 0) {
    return InvalidArgument("{}: channels {} is not a multiple of heads {}", op, channels, heads);
  }
  const int64_t hs = channels / heads;
  if (hs != 16 && hs != 32 && hs != 64 && hs != 128) {
    return InvalidArgument(
        "{}: head size {} (channels {} / heads {}) is not supported; choose channels/heads of "
        "16, 32, 64 or 128",
        op, hs, channels, heads);
  }
  const int64_t tiles = (seq_len + kTile - 1) / kTile;
  if (tiles > kMaxTiles || batch * heads > INT32_MAX || 3 * channels > INT32_MAX ||
      seq_len > INT32_MAX / 2) {
    return InvalidArgument(
        "{}: batch {} x heads {}, seq_len {} or channels {} too large (at most {} tokens of {} "
        "rows, 2^31 - 1 batch x heads)",
        op, batch, heads, seq_len, channels, kMaxTiles * kTile, kTile);
  }
  *head_size = static_cast<int>(hs);
  return Status::Ok();
}

// Runs fn.template operator()<HS>() for the head size (one of the supported four).
template <typename Fn>
Status DispatchHeadSize(int hs, const Fn& fn) {
  switch (hs) {
    case 16:
      return fn.template operator()<16>();
    case 32:
      return fn.template operator()<32>();
    case 64:
      return fn.template operator()<64>();
    default:
      return fn.template operator()<128>();
  }
}

// Lets `kernel` take `bytes` of dynamic shared memory. Set on every launch rather than once: the
// attribute belongs to the current device's copy of the kernel, and it costs little.
template <typename Kernel>
cudaError_t AllowSharedMemory(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

float SoftmaxScale(int hs) { return 1.0f / std::sqrt(static_cast<float>(hs)); }

}  // namespace

Status AttentionForward(bf16* out, float* lse, const bf16* qkv, int64_t batch, int64_t seq_len,
                        int64_t channels, int64_t heads, cudaStream_t stream) {
  int hs = 0;
  TESSERA_RETURN_IF_ERROR(
      CheckAttentionShape("AttentionForward", batch, seq_len, channels, heads, &hs));
  const dim3 grid(static_cast<unsigned>(batch * heads),
                  static_cast<unsigned>((seq_len + kTile - 1) / kTile));
  return DispatchHeadSize(hs, [&]<int HS>() -> Status {
    constexpr int smem = kForwardSmem<HS>;
    TESSERA_CUDA_RETURN_IF_ERROR(AllowSharedMemory(AttentionForwardKernel<HS>, smem));
    AttentionForwardKernel<HS><<<grid, kThreads, smem, stream>>>(
        out, lse, qkv, static_cast<int>(seq_len), static_cast<int>(channels),
        static_cast<int>(heads), SoftmaxScale(HS) * kLog2e);
    TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return Status::Ok();
  });
}

Status AttentionBackward(bf16* dqkv, void* scratch, const bf16* dout, const bf16* out,
                         const bf16* qkv, const float* lse, int64_t batch, int64_t seq_len,
                         int64_t channels, int64_t heads, cudaStream_t stream) {
  int hs = 0;
  TESSERA_RETURN_IF_ERROR(
      CheckAttentionShape("AttentionBackward", batch, seq_len, channels, heads, &hs));
  float* d_rows = static_cast<float*>(scratch);  // [B, heads, T]
  const dim3 grid(static_cast<unsigned>(batch * heads),
                  static_cast<unsigned>((seq_len + kTile - 1) / kTile));
  const int t = static_cast<int>(seq_len), c = static_cast<int>(channels);
  const int nh = static_cast<int>(heads);
  return DispatchHeadSize(hs, [&]<int HS>() -> Status {
    const float scale = SoftmaxScale(HS), scale_log2 = scale * kLog2e;
    constexpr int dq_smem = kDqSmem<HS>;
    TESSERA_CUDA_RETURN_IF_ERROR(AllowSharedMemory(AttentionBackwardDqKernel<HS>, dq_smem));
    AttentionBackwardDqKernel<HS><<<grid, kThreads, dq_smem, stream>>>(
        dqkv, d_rows, dout, out, qkv, lse, t, c, nh, scale, scale_log2);
    TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    constexpr int dkdv_smem = kDkDvSmem<HS>;
    TESSERA_CUDA_RETURN_IF_ERROR(AllowSharedMemory(AttentionBackwardDkDvKernel<HS>, dkdv_smem));
    AttentionBackwardDkDvKernel<HS><<<grid, kThreads, dkdv_smem, stream>>>(
        dqkv, d_rows, dout, qkv, lse, t, c, nh, scale, scale_log2);
    TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return Status::Ok();
  });
}

int64_t AttentionBackwardScratch(int64_t batch, int64_t seq_len, int64_t channels, int64_t heads) {
  (void)channels;
  return batch * heads * seq_len * static_cast<int64_t>(sizeof(float));  // D per row
}

}  // namespace tessera::cuda

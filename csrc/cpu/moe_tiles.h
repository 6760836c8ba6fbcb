// fused_moe, vector path: the tile shape and the micro-kernels that run a tile of weight
// rows against token panels and leftover rows; included by moe.cpp only (its anonymous
// namespace keeps them private to that file).
#pragma once

#include "vec_common.h"

#include <cstdint>

namespace opmux_cpu {
namespace {

// A tile is kW weight rows. Against a panel it holds kW x 2 vector accumulators (12 of the 16
// AVX2 registers: twelve independent FMA chains per step, where one vector of lanes per row
// would give six, too few to cover the FMA latency); against leftover rows, kW x kR dot
// products (kR = 2 on AVX2: each token vector feeds six FMAs). With AVX-512 every row is a
// leftover row: its 32 registers hold 6 x 4 dot products (24 accumulators, each weight vector
// feeding four FMAs and each token vector six), faster than the panels (benchmarks/moe_cpu.py),
// where a panel of 32 lanes is mostly half full and each broadcast weight element feeds as
// few FMAs.
constexpr int kW = 6;
constexpr int64_t kUnits = kW / 2;  // intermediate units per gate/up tile
constexpr int64_t kP = 2 * kF;      // token lanes per panel
constexpr int64_t kTiles = 8;       // tiles per task
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kR = 4;
constexpr bool kPanels = false;
#else
constexpr int kR = 2;
constexpr bool kPanels = true;
#endif

// Row stride of the fp32 work rows of n floats: a whole number of vectors plus one cache line,
// so that rows are never a multiple of 4 KiB apart (rows that are share L1 sets and evict each
// other while a tile reads them side by side).
inline int64_t padded(int64_t n) { return (n + 15) / 16 * 16 + 16; }

// Rows of an expert's n that go into token panels (the others are leftover rows): whole
// vectors of kF rows, or all n when the last panel would hold at least kPadFrom rows; that
// panel then has zero lanes up to the vector boundary. Without it an expert of, say, 13-15
// rows would run a half panel (six accumulators: too few FMA chains) and 5-7 dot rows; one
// padded panel is faster (benchmarks/moe_cpu.py).
constexpr int64_t kPadFrom = 9;
inline int64_t panel_rows(int64_t n) {
  if (!kPanels) return 0;
  return n % kP >= kPadFrom ? n : n / kF * kF;
}

// step(k) for k = 0 .. n-1. When next is given, its kW rows are prefetched alongside: one line
// of each per 16 k (pf bytes per 16 elements of its dtype).
template <typename Step>
__attribute__((always_inline)) inline void for_k_prefetching(int64_t n, const char* const* next,
                                                             int64_t pf, const Step& step) {
  for (int64_t k0 = 0; k0 < n; k0 += 16) {
    if (next) {
      for (int w = 0; w < kW; ++w) __builtin_prefetch(next[w] + (k0 / 16) * pf, 0, 2);
    }
    const int64_t k1 = std::min(n, k0 + 16);
    for (int64_t k = k0; k < k1; ++k) step(k);
  }
}

// acc[w][v] = sum over k < n of rows[w][k] * panel[k * kP + v * kF + lane], for NV vectors of
// lanes, prefetching next's rows (for_k_prefetching).
template <int NV>
inline void tile_kernel(const float* const* rows, const float* xp, int64_t n,
                        const char* const* next, int64_t pf, fVec (&acc)[kW][2]) {
  fVec a[kW][NV];
  for (int w = 0; w < kW; ++w) {
    for (int v = 0; v < NV; ++v) a[w][v] = fVec(0.f);
  }
  static_assert(kW == 6, "the loads below name the six rows");
  const float *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3], *r4 = rows[4],
              *r5 = rows[5];
  for_k_prefetching(n, next, pf, [&](int64_t k) __attribute__((always_inline)) {
    fVec xv[NV];
    for (int v = 0; v < NV; ++v) xv[v] = fVec::loadu(xp + k * kP + v * kF);
    const float wk[kW] = {r0[k], r1[k], r2[k], r3[k], r4[k], r5[k]};
    for (int w = 0; w < kW; ++w) {
      const fVec wb(wk[w]);
      for (int v = 0; v < NV; ++v) a[w][v] = at::vec::fmadd(wb, xv[v], a[w][v]);
    }
  });
  for (int w = 0; w < kW; ++w) {
    for (int v = 0; v < NV; ++v) acc[w][v] = a[w][v];
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// c0 += w * x0 and c1 += w * x1 for one weight element w: one row's step of the panel below.
__attribute__((always_inline)) inline void fma_pair(const float* w, __m256 x0, __m256 x1,
                                                    __m256& c0, __m256& c1) {
  const __m256 b = _mm256_broadcast_ss(w);
  c0 = _mm256_fmadd_ps(b, x0, c0);
  c1 = _mm256_fmadd_ps(b, x1, c1);
}

// The full panel on AVX2 with the 12 accumulators as named registers: with the array above,
// GCC stores and reloads all 12 around every block of 16 steps (the prefetch's loop)
// (benchmarks/moe_cpu.py).
template <>
inline void tile_kernel<2>(const float* const* rows, const float* xp, int64_t n,
                           const char* const* next, int64_t pf, fVec (&acc)[kW][2]) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3], *r4 = rows[4],
              *r5 = rows[5];
  for_k_prefetching(n, next, pf, [&](int64_t k) __attribute__((always_inline)) {
    const __m256 x0 = _mm256_loadu_ps(xp + k * kP), x1 = _mm256_loadu_ps(xp + k * kP + kF);
    fma_pair(r0 + k, x0, x1, c00, c01);
    fma_pair(r1 + k, x0, x1, c10, c11);
    fma_pair(r2 + k, x0, x1, c20, c21);
    fma_pair(r3 + k, x0, x1, c30, c31);
    fma_pair(r4 + k, x0, x1, c40, c41);
    fma_pair(r5 + k, x0, x1, c50, c51);
  });
  acc[0][0] = c00, acc[0][1] = c01, acc[1][0] = c10, acc[1][1] = c11, acc[2][0] = c20;
  acc[2][1] = c21, acc[3][0] = c30, acc[3][1] = c31, acc[4][0] = c40, acc[4][1] = c41;
  acc[5][0] = c50, acc[5][1] = c51;
}
#endif

// acc[w][r] = dot(w_rows[w], x_rows[r]) over n elements, for NR token rows.
template <int NR>
inline void dot_tile(const float* const* wr, const float* x, int64_t x_stride, int64_t n,
                     float (&res)[kW][kR]) {
  fVec acc[kW][NR];
  for (int w = 0; w < kW; ++w) {
    for (int r = 0; r < NR; ++r) acc[w][r] = fVec(0.f);
  }
  int64_t i = 0;
  for (; i + kF <= n; i += kF) {
    fVec wv[kW];
    for (int w = 0; w < kW; ++w) wv[w] = fVec::loadu(wr[w] + i);
    for (int r = 0; r < NR; ++r) {
      const fVec xv = fVec::loadu(x + r * x_stride + i);
      for (int w = 0; w < kW; ++w) acc[w][r] = at::vec::fmadd(wv[w], xv, acc[w][r]);
    }
  }
  for (int w = 0; w < kW; ++w) {
    for (int r = 0; r < NR; ++r) {
      float s = hsum(acc[w][r]);
      for (int64_t j = i; j < n; ++j) s += wr[w][j] * x[r * x_stride + j];
      res[w][r] = s;
    }
  }
}

// Dot products of the weight rows wr against token rows x[0..count) (x_stride apart).
inline void dot_rows(const float* const* wr, const float* x, int64_t x_stride, int64_t count,
                     int64_t n, float (&res)[kW][kR]) {
  if constexpr (kR > 3) {
    if (count == 4) return dot_tile<(kR > 3 ? 4 : kR)>(wr, x, x_stride, n, res);
  }
  if constexpr (kR > 2) {
    if (count == 3) return dot_tile<(kR > 2 ? 3 : kR)>(wr, x, x_stride, n, res);
  }
  if (count == 2) return dot_tile<2>(wr, x, x_stride, n, res);
  dot_tile<1>(wr, x, x_stride, n, res);
}

// The kW rows src[0..kW) of n elements, as fp32 rows ld apart in dst.
template <typename T>
inline void widen_rows(const T* const* src, int64_t n, float* dst, int64_t ld) {
  for (int w = 0; w < kW; ++w) {
    const T* from = src[w];
    float* to = dst + w * ld;
    for_each_vec(n, [&](int64_t j, int64_t c) { load_n(from + j, c).store(to + j, c); });
  }
}

// silu(g) * u on whole vectors (exp_u20, as silu_and_mul in activation.cpp), not a scalar
// std::exp per activation (benchmarks/moe_cpu.py).
inline fVec silu_mul(const fVec& g, const fVec& u) {
  return g / (fVec(1.f) + g.neg().exp_u20()) * u;
}

}  // namespace
}  // namespace opmux_cpu

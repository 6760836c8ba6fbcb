// paged_attention, per-row kernels: the work-item description and the score (q·k) and
// value (p·v) micro-kernels of the decode path, over rows of the fp32 scratch; included
// by paged_attention.cpp only (its anonymous namespace keeps them private to that file).
#pragma once

#include "vec_common.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace opmux_cpu {
namespace {


constexpr int64_t kTokenChunk = 64;  // keys scored per step
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool kHasBf16Pairs = true;
#else
constexpr bool kHasBf16Pairs = false;
#endif
constexpr int64_t kMaxRows = 32;     // query rows (q positions x GQA group) per work item
constexpr int64_t kSplitTokens = 512;  // split-KV: fewest keys per split
constexpr int64_t kMaxSplits = 64;     // split-KV: most splits of one sequence

struct WorkItem {
  int32_t seq;
  int32_t kv_begin;  // kv heads [kv_begin, kv_end)
  int32_t kv_end;
  int32_t q_begin;  // query rows relative to the sequence's first one
  int32_t q_end;
  // Split-KV (decode only): keys [t_begin, t_end) of the sequence, written unnormalised to
  // partial slot `part` for the merge; part < 0 means the whole range, written to out.
  int32_t t_begin = 0;
  int32_t t_end = 0;
  int32_t part = -1;
};

// The split-KV items of one (sequence, kv head range): partial slots [part0, part0 + n_parts).
struct SplitGroup {
  int32_t seq;
  int32_t kv_begin;
  int32_t kv_end;
  int32_t part0;
  int32_t n_parts;
};

// Partial results of split-KV items: per slot and row the unnormalised accumulator
// (head_size floats), the running max and the running sum.
struct Partials {
  float* acc;
  float* m;
  float* l;
  int64_t rows;  // rows per slot (kMaxRows)
};

struct Params {
  int64_t num_heads, num_kv_heads, head_size, padded, block_size, max_blocks;
  int64_t q_stride0, q_stride1;
  float scale, soft_cap;
  int64_t window;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  Partials partials;
  int64_t block_stride;  // elements from one cache block to the next (dense inside a block)
};

inline float dot(const float* a, const float* b, int64_t n) {
  fVec acc0(0.f);
  fVec acc1(0.f);
  int64_t i = 0;
  for (; i + 2 * kF <= n; i += 2 * kF) {
    acc0 = at::vec::fmadd(fVec::loadu(a + i), fVec::loadu(b + i), acc0);
    acc1 = at::vec::fmadd(fVec::loadu(a + i + kF), fVec::loadu(b + i + kF), acc1);
  }
  for (; i < n; i += kF) acc0 = at::vec::fmadd(fVec::loadu(a + i), fVec::loadu(b + i), acc0);
  return hsum(acc0 + acc1);
}

#if defined(CPU_CAPABILITY_AVX512)
// Horizontal sums of 16 vectors at once: lane i of the result is the sum of v[i]. A transpose
// tree of 15 shuffle+add steps instead of 16 separate reductions.
inline __m512 reduce16(const __m512* v) {
  __m512 w[8];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 x[4];
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(w[2 * j]);
    const __m512d b = _mm512_castps_pd(w[2 * j + 1]);
    x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 y[2];
  for (int j = 0; j < 2; ++j) {
    y[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

// out[i] = q . k[i] for i < n; every k[i] (and q) has `padded` elements; k[n..] may be read
// and must point at valid rows (the caller pads with a zero row).
inline void qk_row(const float* q, const float* const* k, int64_t n, int64_t padded,
                   float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    __m512 acc[16];
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < padded; c += 16) {
      const __m512 qv = _mm512_loadu_ps(q + c);
      for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[t0 + t] + c), acc[t]);
    }
    const __m512 sums = reduce16(acc);
    const int64_t m = std::min<int64_t>(16, n - t0);
    _mm512_mask_storeu_ps(out + t0, static_cast<__mmask16>((1u << m) - 1u), sums);
  }
#else
  for (int64_t t = 0; t < n; ++t) out[t] = dot(q, k[t], padded);
#endif
}

// acc[0, U*kF) += sum_t p[t] * v[t][0, U*kF): U independent accumulators in registers, so
// the FMAs over t do not wait on each other.
template <int U>
inline void pv_block(float* acc, const float* p, const float* const* v, int64_t n,
                     int64_t off) {
  fVec a[U];
  for (int u = 0; u < U; ++u) a[u] = fVec::loadu(acc + off + u * kF);
  for (int64_t t = 0; t < n; ++t) {
    const fVec pt(p[t]);
    const float* vt = v[t] + off;
    for (int u = 0; u < U; ++u) a[u] = at::vec::fmadd(pt, fVec::loadu(vt + u * kF), a[u]);
  }
  for (int u = 0; u < U; ++u) a[u].store(acc + off + u * kF);
}

// acc += sum_t p[t] * v[t] over n rows of `padded` elements.
inline void pv_row(float* acc, const float* p, const float* const* v, int64_t n,
                   int64_t padded) {
  int64_t off = 0;
  for (; off + 8 * kF <= padded; off += 8 * kF) pv_block<8>(acc, p, v, n, off);
  if (off + 4 * kF <= padded) {
    pv_block<4>(acc, p, v, n, off);
    off += 4 * kF;
  }
  if (off + 2 * kF <= padded) {
    pv_block<2>(acc, p, v, n, off);
    off += 2 * kF;
  }
  if (off < padded) pv_block<1>(acc, p, v, n, off);
}

#if defined(CPU_CAPABILITY_AVX512)
// Scores of 4 query rows against 4 keys: 16 accumulators from 8 loads per 16 FMAs (one key
// load serves four rows), reduced with one reduce16. Lane 4 * i + j is q[i] . k[j]; row i's
// four scores go to out[i][0, 4).
inline void qk_tile4(const float* const* q, float* const* out, const float* const* k,
                     int64_t padded) {
  const float* q0 = q[0];
  const float* q1 = q[1];
  const float* q2 = q[2];
  const float* q3 = q[3];
  const float* k0 = k[0];
  const float* k1 = k[1];
  const float* k2 = k[2];
  const float* k3 = k[3];
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < padded; c += 16) {
    const __m512 qv[4] = {_mm512_loadu_ps(q0 + c), _mm512_loadu_ps(q1 + c),
                          _mm512_loadu_ps(q2 + c), _mm512_loadu_ps(q3 + c)};
    const __m512 kv[4] = {_mm512_loadu_ps(k0 + c), _mm512_loadu_ps(k1 + c),
                          _mm512_loadu_ps(k2 + c), _mm512_loadu_ps(k3 + c)};
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 4; ++j) acc[4 * i + j] = _mm512_fmadd_ps(qv[i], kv[j], acc[4 * i + j]);
    }
  }
  const __m512 sums = reduce16(acc);
  _mm_storeu_ps(out[0], _mm512_extractf32x4_ps(sums, 0));
  _mm_storeu_ps(out[1], _mm512_extractf32x4_ps(sums, 1));
  _mm_storeu_ps(out[2], _mm512_extractf32x4_ps(sums, 2));
  _mm_storeu_ps(out[3], _mm512_extractf32x4_ps(sums, 3));
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// bf16 scores straight from the bf16 query and cache rows with AVX512-BF16 pair dot products
// (exact bf16 products, fp32 sums): no fp32 copy of the keys and half the FMAs. The head size
// must be a multiple of 32; `scale` is applied to the sums.
// Like qk_tile4 on bf16 rows of d elements.
inline void qk_tile4_bf16(const at::BFloat16* const* q, float* const* out,
                          const at::BFloat16* const* k, int64_t d, __m512 scale) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    const __m512i qv[4] = {_mm512_loadu_si512(q[0] + c), _mm512_loadu_si512(q[1] + c),
                           _mm512_loadu_si512(q[2] + c), _mm512_loadu_si512(q[3] + c)};
    const __m512i kv[4] = {_mm512_loadu_si512(k[0] + c), _mm512_loadu_si512(k[1] + c),
                           _mm512_loadu_si512(k[2] + c), _mm512_loadu_si512(k[3] + c)};
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 4; ++j) {
        acc[4 * i + j] = _mm512_dpbf16_ps(acc[4 * i + j], (__m512bh)qv[i], (__m512bh)kv[j]);
      }
    }
  }
  const __m512 sums = _mm512_mul_ps(reduce16(acc), scale);
  _mm_storeu_ps(out[0], _mm512_extractf32x4_ps(sums, 0));
  _mm_storeu_ps(out[1], _mm512_extractf32x4_ps(sums, 1));
  _mm_storeu_ps(out[2], _mm512_extractf32x4_ps(sums, 2));
  _mm_storeu_ps(out[3], _mm512_extractf32x4_ps(sums, 3));
}

// Like qk_rows on bf16 rows: k has 16 valid row pointers (n <= 16 of them real keys).
inline void qk_rows_bf16(const at::BFloat16* const* q, float* const* out, int64_t nr,
                         const at::BFloat16* const* k, int64_t n, int64_t d, float scale) {
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t r = 0;
  for (; r + 4 <= nr; r += 4) {
    for (int64_t t0 = 0; t0 < n; t0 += 4) {
      float* o[4] = {out[r] + t0, out[r + 1] + t0, out[r + 2] + t0, out[r + 3] + t0};
      qk_tile4_bf16(q + r, o, k + t0, d, sc);
    }
  }
  for (; r < nr; ++r) {
    __m512 acc[16];
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 32) {
      const __m512i qv = _mm512_loadu_si512(q[r] + c);
      for (int t = 0; t < 16; ++t) {
        acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)qv, (__m512bh)_mm512_loadu_si512(k[t] + c));
      }
    }
    const __m512 sums = _mm512_mul_ps(reduce16(acc), sc);
    _mm512_mask_storeu_ps(out[r], static_cast<__mmask16>((1u << n) - 1u), sums);
  }
}
#endif

// Scores of nr query rows (q[i], written to out[i][0, n)) that share one kv head against n
// keys. Rows go four at a time through qk_tile4, so each key row is loaded once per four query
// rows (GQA groups, prefill positions); k[n..] must point at valid rows, rounded up to 16.
inline void qk_rows(const float* const* q, float* const* out, int64_t nr, const float* const* k,
                    int64_t n, int64_t padded) {
  int64_t r = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; r + 4 <= nr; r += 4) {
    for (int64_t t0 = 0; t0 < n; t0 += 4) {
      float* o[4] = {out[r] + t0, out[r + 1] + t0, out[r + 2] + t0, out[r + 3] + t0};
      qk_tile4(q + r, o, k + t0, padded);
    }
  }
#endif
  for (; r < nr; ++r) qk_row(q[r], k, n, padded, out[r]);
}

// acc[r][off, off + U*kF) += sum_t p[r][t] * v[t][...] for R rows: each value vector is loaded
// once and used by all R rows (R*U accumulators stay in registers).
template <int R, int U>
inline void pv_tile(float* const* acc, const float* const* p, const float* const* v, int64_t n,
                    int64_t off) {
  fVec a[R][U];
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < U; ++u) a[r][u] = fVec::loadu(acc[r] + off + u * kF);
  }
  for (int64_t t = 0; t < n; ++t) {
    fVec pt[R];
    for (int r = 0; r < R; ++r) pt[r] = fVec(p[r][t]);
    const float* vt = v[t] + off;
    for (int u = 0; u < U; ++u) {
      const fVec x = fVec::loadu(vt + u * kF);
      for (int r = 0; r < R; ++r) a[r][u] = at::vec::fmadd(pt[r], x, a[r][u]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < U; ++u) a[r][u].store(acc[r] + off + u * kF);
  }
}

template <int R>
inline void pv_tile_row(float* const* acc, const float* const* p, const float* const* v,
                        int64_t n, int64_t padded) {
  int64_t off = 0;
  for (; off + 8 * kF <= padded; off += 8 * kF) pv_tile<R, 8>(acc, p, v, n, off);
  if (off + 4 * kF <= padded) {
    pv_tile<R, 4>(acc, p, v, n, off);
    off += 4 * kF;
  }
  if (off + 2 * kF <= padded) {
    pv_tile<R, 2>(acc, p, v, n, off);
    off += 2 * kF;
  }
  if (off < padded) pv_tile<R, 1>(acc, p, v, n, off);
}

// acc[i] += sum_t p[i][t] * v[t] for nr rows sharing one kv head, three rows at a time.
inline void pv_rows(float* const* acc, const float* const* p, int64_t nr,
                    const float* const* v, int64_t n, int64_t padded) {
  int64_t r = 0;
  for (; r + 3 <= nr; r += 3) pv_tile_row<3>(acc + r, p + r, v, n, padded);
  if (r + 2 <= nr) {
    pv_tile_row<2>(acc + r, p + r, v, n, padded);
    r += 2;
  }
  if (r < nr) pv_row(acc[r], p[r], v, n, padded);
}

// acc[r][off, off + U*kF) += sum_t p[r][t] * v[t][...] for R rows, the value rows read in
// their cache dtype and widened in registers (no fp32 copy of the chunk's values).
template <int R, int U, typename T>
inline void pv_tile_t(float* const* acc, const float* const* p, const T* const* v, int64_t n,
                      int64_t off) {
  fVec a[R][U];
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < U; ++u) a[r][u] = fVec::loadu(acc[r] + off + u * kF);
  }
  for (int64_t t = 0; t < n; ++t) {
    const T* vt = v[t] + off;
    fVec x[U];
    for (int u = 0; u < U; ++u) x[u] = load_f(vt + u * kF);
    for (int r = 0; r < R; ++r) {
      const fVec pt(p[r][t]);
      for (int u = 0; u < U; ++u) a[r][u] = at::vec::fmadd(pt, x[u], a[r][u]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < U; ++u) a[r][u].store(acc[r] + off + u * kF);
  }
}

// pv_tile_t over a head size d that is a multiple of kF: U vectors at a time, then U / 2,
// then one.
template <int R, int U, typename T>
inline void pv_tile_t_row(float* const* acc, const float* const* p, const T* const* v,
                          int64_t n, int64_t d) {
  int64_t off = 0;
  for (; off + U * kF <= d; off += U * kF) pv_tile_t<R, U>(acc, p, v, n, off);
  if constexpr (U >= 4) {
    if (off + (U / 2) * kF <= d) {
      pv_tile_t<R, U / 2>(acc, p, v, n, off);
      off += (U / 2) * kF;
    }
  }
  for (; off < d; off += kF) pv_tile_t<R, 1>(acc, p, v, n, off);  // d is a multiple of kF
}

// acc[i] += sum_t p[i][t] * v[t] for nr rows sharing one kv head, with the value rows in
// their cache dtype: eight rows at a time (each value vector widened once per eight rows),
// then four, then one. Needs d % kF == 0.
template <typename T>
inline void pv_rows_t(float* const* acc, const float* const* p, int64_t nr, const T* const* v,
                      int64_t n, int64_t d) {
  int64_t r = 0;
  for (; r + 8 <= nr; r += 8) pv_tile_t_row<8, 2>(acc + r, p + r, v, n, d);
  for (; r + 4 <= nr; r += 4) pv_tile_t_row<4, 4>(acc + r, p + r, v, n, d);
  for (; r < nr; ++r) pv_tile_t_row<1, 8>(acc + r, p + r, v, n, d);
}

// Returns an fp32 view of a cache row of `d` elements, converting into `buf` (padded with
// zeros up to `padded`) unless the row can be read in place.
template <typename T>
inline const float* as_float_row(const T* src, float* buf, int64_t d, int64_t padded) {
  if constexpr (std::is_same_v<T, float>) {
    if (d == padded) return src;
  }
  for_each_vec(padded, [&](int64_t j, int64_t n) {
    const int64_t valid = std::max<int64_t>(0, std::min(n, d - j));
    (valid == kF ? load_f(src + j) : load_f(src + j, valid)).store(buf + j);
  });
  return buf;
}

}  // namespace
}  // namespace opmux_cpu

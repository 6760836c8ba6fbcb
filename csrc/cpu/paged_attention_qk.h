// paged_attention, score kernels: the q·k micro-kernels of the decode path over rows of the
// fp32 scratch (tiles of rows against keys, query groups in vector lanes, bf16 pair dot
// products); included by paged_attention.cpp only (its anonymous namespace keeps them
// private to that file).
#pragma once

#include "paged_attention_rows.h"
#include "vec_common.h"

#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace opmux_cpu {
namespace {

#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
// Horizontal sums of 8 vectors at once: lane i of the result is the sum of v[i] (the AVX2
// form of reduce16: two in-lane shuffle+add levels, then the two 128-bit halves added).
inline __m256 reduce8(const __m256* v) {
  __m256 w[4];
  for (int i = 0; i < 4; ++i) {
    w[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m256 x[2];
  for (int j = 0; j < 2; ++j) {
    const __m256d a = _mm256_castps_pd(w[2 * j]);
    const __m256d b = _mm256_castps_pd(w[2 * j + 1]);
    x[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20),
                       _mm256_permute2f128_ps(x[0], x[1], 0x31));
}

// Scores of R (1 to 3) query rows against 4 keys: 4R accumulators, each query vector loaded
// once for four keys. With R = 3 the 12 accumulators leave too few of the 16 registers for the
// keys, so the compiler makes them FMA memory operands (15 loads per 12 FMAs, from L1); tiles
// of two rows (all in registers, 6 loads per 8 FMAs) are no faster
// (benchmarks/paged_attention_cpu.py). Row i's four scores go to out[i][0, 4).
template <int R>
inline void qk_tile_r4(const float* const* q, float* const* out, const float* const* k,
                       int64_t padded) {
  static_assert(R >= 1 && R <= 3, "1 to 3 rows");
  constexpr int kAcc = 4 * R;
  __m256 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_setzero_ps();
  const float* k0 = k[0];
  const float* k1 = k[1];
  const float* k2 = k[2];
  const float* k3 = k[3];
  for (int64_t c = 0; c < padded; c += 8) {
    const __m256 kv[4] = {_mm256_loadu_ps(k0 + c), _mm256_loadu_ps(k1 + c),
                          _mm256_loadu_ps(k2 + c), _mm256_loadu_ps(k3 + c)};
    for (int i = 0; i < R; ++i) {
      const __m256 qv = _mm256_loadu_ps(q[i] + c);
      for (int j = 0; j < 4; ++j) acc[4 * i + j] = _mm256_fmadd_ps(qv, kv[j], acc[4 * i + j]);
    }
  }
  for (int i = 0; i < R; i += 2) {  // rows i and i + 1 (a lone last row is reduced twice)
    const int i1 = i + 1 < R ? i + 1 : i;
    const __m256 v[8] = {acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3],
                         acc[4 * i1], acc[4 * i1 + 1], acc[4 * i1 + 2], acc[4 * i1 + 3]};
    const __m256 sums = reduce8(v);
    _mm_storeu_ps(out[i], _mm256_castps256_ps128(sums));
    if (i + 1 < R) _mm_storeu_ps(out[i + 1], _mm256_extractf128_ps(sums, 1));
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
// GQA 8 scores with the group's rows in the eight lanes (the AVX2 form of qk_group): qpack[8c +
// g] is element c of row g (pack_rows8, once per item), each key element is broadcast to all
// eight rows, so one FMA advances the whole group and a key is read once for it (the row tiles
// read it once per three rows and reduce every sum across lanes). Lane g of acc[j] is row g's
// score of key j; one 8 x 8 transpose per eight keys puts row g's scores in out[g][t0, t0 + 8).
// k has 16 valid row pointers (n <= 16 real keys); d counts elements. The element loop goes four
// at a time, so the eight key rows are read at one shared offset (eight pointer increments per
// element otherwise; benchmarks/paged_attention_cpu.py).
inline void pack_rows8(const float* const* rows, float* qpack, int64_t d) {
  for (int64_t c = 0; c < d; ++c) {
    for (int g = 0; g < 8; ++g) qpack[8 * c + g] = rows[g][c];
  }
}

inline void qk_rows8(const float* qpack, float* const* out, const float* const* k, int64_t n,
                     int64_t d) {
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const float* kt[8];
    for (int j = 0; j < 8; ++j) kt[j] = k[t0 + j];
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 4 <= d; c += 4) {
      for (int u = 0; u < 4; ++u) {
        const __m256 qv = _mm256_loadu_ps(qpack + 8 * (c + u));
        for (int j = 0; j < 8; ++j) {
          acc[j] = _mm256_fmadd_ps(qv, _mm256_broadcast_ss(kt[j] + c + u), acc[j]);
        }
      }
    }
    for (; c < d; ++c) {
      const __m256 qv = _mm256_loadu_ps(qpack + 8 * c);
      for (int j = 0; j < 8; ++j) {
        acc[j] = _mm256_fmadd_ps(qv, _mm256_broadcast_ss(kt[j] + c), acc[j]);
      }
    }
    // 8 x 8 transpose: acc[j] lane g -> row g lane j
    __m256 u[8], v[8];
    for (int i = 0; i < 4; ++i) {
      u[2 * i] = _mm256_unpacklo_ps(acc[2 * i], acc[2 * i + 1]);
      u[2 * i + 1] = _mm256_unpackhi_ps(acc[2 * i], acc[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      v[4 * i + 0] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      v[4 * i + 1] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      v[4 * i + 2] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      v[4 * i + 3] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(out[i] + t0, _mm256_permute2f128_ps(v[i], v[4 + i], 0x20));
      _mm256_storeu_ps(out[4 + i] + t0, _mm256_permute2f128_ps(v[i], v[4 + i], 0x31));
    }
  }
}

// GQA 4 scores with the group's rows in pairs of lanes: lane 2g + j of qpack[8c .. 8c + 8) is
// element 2c + j of row g (pack_rows4; an odd head size ends with a zero), the key's elements
// 2c and 2c + 1 are broadcast to every pair, so one FMA advances four rows by two elements. A
// pairwise add and a transpose per eight keys put row g's scores in out[g][t0, t0 + 8). The
// key rows must hold an even number of elements (their zero padding covers an odd head size).
// qk_rows8 and qk_rows4 stay two functions: one template for both (the broadcast and the final
// reduction chosen by the pair width) is slower (benchmarks/paged_attention_cpu.py).
inline void pack_rows4(const float* const* rows, float* qpack, int64_t d) {
  for (int64_t c = 0; c < (d + 1) / 2; ++c) {
    for (int g = 0; g < 4; ++g) {
      qpack[8 * c + 2 * g] = rows[g][2 * c];
      qpack[8 * c + 2 * g + 1] = 2 * c + 1 < d ? rows[g][2 * c + 1] : 0.f;
    }
  }
}

inline void qk_rows4(const float* qpack, float* const* out, const float* const* k, int64_t n,
                     int64_t d) {
  const int64_t pairs = (d + 1) / 2;
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const double* kt[8];
    for (int j = 0; j < 8; ++j) kt[j] = reinterpret_cast<const double*>(k[t0 + j]);
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < pairs; ++c) {
      const __m256 qv = _mm256_loadu_ps(qpack + 8 * c);
      for (int j = 0; j < 8; ++j) {
        acc[j] = _mm256_fmadd_ps(qv, _mm256_castpd_ps(_mm256_broadcast_sd(kt[j] + c)), acc[j]);
      }
    }
    // hadd(acc[j], acc[j + 1]): rows 0, 1 of keys j, j + 1 | rows 2, 3 of keys j, j + 1
    const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]);
    const __m256 h23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]);
    const __m256 h67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 a = _mm256_shuffle_ps(h01, h23, _MM_SHUFFLE(2, 0, 2, 0));  // row 0 | row 2
    const __m256 b = _mm256_shuffle_ps(h01, h23, _MM_SHUFFLE(3, 1, 3, 1));  // row 1 | row 3
    const __m256 c = _mm256_shuffle_ps(h45, h67, _MM_SHUFFLE(2, 0, 2, 0));
    const __m256 e = _mm256_shuffle_ps(h45, h67, _MM_SHUFFLE(3, 1, 3, 1));
    _mm256_storeu_ps(out[0] + t0, _mm256_permute2f128_ps(a, c, 0x20));
    _mm256_storeu_ps(out[1] + t0, _mm256_permute2f128_ps(b, e, 0x20));
    _mm256_storeu_ps(out[2] + t0, _mm256_permute2f128_ps(a, c, 0x31));
    _mm256_storeu_ps(out[3] + t0, _mm256_permute2f128_ps(b, e, 0x31));
  }
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

#if defined(CPU_CAPABILITY_AVX512)
// GQA-group scores with the rows in vector lanes (decode with 4 or 8 query heads per kv head).
// R = 16 / P rows of one kv head share each key: a 32-bit lane holds one fp32 element or one
// bf16 pair, and lane P * r + j of qpack[c] holds lane-word P * c + j of row r (pack_group,
// once per item); the key's words [P * c, P * c + P) are broadcast to every row, so one FMA
// (fp32) or pair dot product (bf16) advances all R rows and a key is loaded once for the whole
// group instead of once per four rows. Only the P partial sums of each (row, key) are left to
// add (one or two shuffle levels), then a transpose puts row r's 16 scores contiguously in
// out[r][0, n), times `scale`. k has 16 valid row pointers; d counts elements of T.
template <int P>
inline void pack_group(const uint32_t* const* rows, uint32_t* qpack, int64_t words) {
  constexpr int R = 16 / P;
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < words / P; ++c) {
      for (int j = 0; j < P; ++j) qpack[c * 16 + P * r + j] = rows[r][P * c + j];
    }
  }
}

template <int P, typename T>
inline void qk_group(const uint32_t* qpack, float* const* out, const T* const* k, int64_t n,
                     int64_t d, __m512 scale) {
  static_assert(P == 2 || P == 4, "4 or 8 rows per group");
  constexpr int64_t E = std::is_same_v<T, float> ? 1 : 2;  // elements per 32-bit lane
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d / (E * P); ++c) {
    const __m512i qv = _mm512_loadu_si512(qpack + c * 16);
    for (int t = 0; t < 16; ++t) {
      __m512i kb;
      if constexpr (P == 2) {
        int64_t words2;
        std::memcpy(&words2, k[t] + E * P * c, sizeof(words2));
        kb = _mm512_set1_epi64(words2);
      } else {
        kb = _mm512_broadcast_i32x4(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(k[t] + E * P * c)));
      }
      if constexpr (std::is_same_v<T, float>) {
        acc[t] = _mm512_fmadd_ps(_mm512_castsi512_ps(qv), _mm512_castsi512_ps(kb), acc[t]);
      } else {
#if defined(__AVX512BF16__)
        acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)qv, (__m512bh)kb);
#endif
      }
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
  if constexpr (P == 2) {
    // lanes 4i..4i+3 of acc[t]: (row 2i, j 0), (2i, 1), (2i + 1, 0), (2i + 1, 1). Per key pair
    // (a, b): add the j halves and order the lanes as 64-bit cells (row m, keys a and b) ...
    __m512d w[8];
    for (int p = 0; p < 8; ++p) {
      const __m512 a = acc[2 * p];
      const __m512 b = acc[2 * p + 1];
      const __m512 sum = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
      w[p] = _mm512_castps_pd(_mm512_permute_ps(sum, _MM_SHUFFLE(3, 1, 2, 0)));
    }
    // ... then an 8 x 8 transpose of the cells: row m gets cells (m, 0..7) = keys 0..15
    __m512d u[8], v[8];
    for (int p = 0; p < 4; ++p) {
      u[2 * p] = _mm512_unpacklo_pd(w[2 * p], w[2 * p + 1]);
      u[2 * p + 1] = _mm512_unpackhi_pd(w[2 * p], w[2 * p + 1]);
    }
    for (int h = 0; h < 2; ++h) {  // u[4h..4h+3]: key pairs 4h..4h+3
      v[4 * h + 0] = _mm512_shuffle_f64x2(u[4 * h], u[4 * h + 2], _MM_SHUFFLE(2, 0, 2, 0));
      v[4 * h + 1] = _mm512_shuffle_f64x2(u[4 * h], u[4 * h + 2], _MM_SHUFFLE(3, 1, 3, 1));
      v[4 * h + 2] = _mm512_shuffle_f64x2(u[4 * h + 1], u[4 * h + 3], _MM_SHUFFLE(2, 0, 2, 0));
      v[4 * h + 3] = _mm512_shuffle_f64x2(u[4 * h + 1], u[4 * h + 3], _MM_SHUFFLE(3, 1, 3, 1));
    }
    // v[0]: rows 0, 4 (lo), v[1]: rows 2, 6, v[2]: rows 1, 5, v[3]: rows 3, 7 (keys 0-7);
    // v[4..7] the same rows for keys 8-15
    constexpr int kRow[4][2] = {{0, 4}, {2, 6}, {1, 5}, {3, 7}};
    for (int i = 0; i < 4; ++i) {
      const __m512d lo = _mm512_shuffle_f64x2(v[i], v[4 + i], _MM_SHUFFLE(2, 0, 2, 0));
      const __m512d hi = _mm512_shuffle_f64x2(v[i], v[4 + i], _MM_SHUFFLE(3, 1, 3, 1));
      _mm512_mask_storeu_ps(out[kRow[i][0]], keep, _mm512_mul_ps(_mm512_castpd_ps(lo), scale));
      _mm512_mask_storeu_ps(out[kRow[i][1]], keep, _mm512_mul_ps(_mm512_castpd_ps(hi), scale));
    }
  } else {
    // 128-bit lane r of acc[t]: the four partial sums of (row r, key t); reduce16's first two
    // levels give x[j] with lane r = row r's keys 4j..4j+3, then a 4 x 4 transpose of lanes
    __m512 x[4];
    for (int j = 0; j < 4; ++j) {
      __m512 w2[2];
      for (int i = 0; i < 2; ++i) {
        const __m512 a = acc[4 * j + 2 * i];
        const __m512 b = acc[4 * j + 2 * i + 1];
        w2[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
      }
      const __m512d a = _mm512_castps_pd(w2[0]);
      const __m512d b = _mm512_castps_pd(w2[1]);
      x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 y0 = _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 y1 = _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 y2 = _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 y3 = _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 rows4[4] = {_mm512_shuffle_f32x4(y0, y2, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(y0, y2, _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(y1, y3, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(y1, y3, _MM_SHUFFLE(3, 1, 3, 1))};
    for (int r = 0; r < 4; ++r) _mm512_mask_storeu_ps(out[r], keep, _mm512_mul_ps(rows4[r], scale));
  }
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
#elif defined(CPU_CAPABILITY_AVX2)
  // up to three rows at a time, each tile against four keys (out rows take whole groups of
  // four: the caller's rows hold the chunk rounded up to 16); four rows go as two and two,
  // not three and a lone row (a one-row tile loads four keys per four FMAs)
  auto tiles = [&](auto rows_c) {
    constexpr int R = decltype(rows_c)::value;
    for (int64_t t0 = 0; t0 < n; t0 += 4) {
      float* o[R];
      for (int i = 0; i < R; ++i) o[i] = out[r + i] + t0;
      qk_tile_r4<R>(q + r, o, k + t0, padded);
    }
    r += R;
  };
  while (r < nr) {
    const int64_t rest = nr - r;
    if (rest == 1) {
      tiles(std::integral_constant<int, 1>{});
    } else if (rest == 2 || rest == 4) {
      tiles(std::integral_constant<int, 2>{});
    } else {
      tiles(std::integral_constant<int, 3>{});
    }
  }
#endif
  for (; r < nr; ++r) qk_row(q[r], k, n, padded, out[r]);
}

}  // namespace
}  // namespace opmux_cpu

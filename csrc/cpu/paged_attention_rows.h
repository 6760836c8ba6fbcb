// paged_attention, per-row kernels: the work-item description and the score (q·k) and
// value (p·v) micro-kernels of the decode path, over rows of the fp32 scratch; included
// by paged_attention.cpp only (its anonymous namespace keeps them private to that file).
#pragma once

#include "vec_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace opmux_cpu {
namespace {


constexpr int64_t kTokenChunk = 128;  // keys scored per step (a 64-key chunk measured 8% slower
                                      // on bf16 GQA 8 decode: per-chunk softmax work)
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
  // Inside a block: NHD ([bs, Hkv, D] rows, the canonical cache) has tok_stride Hkv * D and
  // head_stride D; HND ([Hkv, bs, D], the 'hnd' KV-cache format) tok_stride D and head_stride
  // bs * D. The AMX and tile paths read NHD only (nhd below); run_item reads both.
  int64_t tok_stride, head_stride;
  bool nhd() const { return head_stride == head_size; }
};

// Per-item constants of the work item's sequence, shared by both item paths.
struct ItemGeom {
  int64_t G, D, Dp;     // query heads per kv head, head size, head size padded to kF
  int64_t q0, q_len;    // first query row of the sequence and its query rows
  int64_t kv_len;       // keys of the sequence
  int64_t tok_stride;   // cache elements from one token to the next (Params::tok_stride)
  int64_t hs;           // cache elements from one kv head to the next (Params::head_stride)
  const int32_t* bt;    // the sequence's block table row
  ItemGeom(const WorkItem& w, const Params& p)
      : G(p.num_heads / p.num_kv_heads), D(p.head_size), Dp(p.padded),
        q0(p.query_start_loc[w.seq]), q_len(p.query_start_loc[w.seq + 1] - q0),
        kv_len(p.seq_lens[w.seq]), tok_stride(p.tok_stride), hs(p.head_stride),
        bt(p.block_tables + static_cast<int64_t>(w.seq) * p.max_blocks) {}
  // elements from a cache's start to token t of this sequence (kv head 0); blocks lie
  // p.block_stride apart, dense inside (NHD or HND rows)
  int64_t token_offset(const Params& p, int64_t t) const {
    return static_cast<int64_t>(bt[t / p.block_size]) * p.block_stride +
           (t % p.block_size) * tok_stride;
  }
};

// The end of an item over rows numbered as run_item numbers them: a split-KV item writes its
// unnormalised partials (accumulator, running max and sum) for the merge, any other item each
// row's accumulator divided by its sum into out. Accumulator rows lie `stride` floats apart.
template <typename T>
void finish_rows(const WorkItem& w, const Params& p, const ItemGeom& ig, int64_t rows,
                 const float* acc, int64_t stride, const float* m, const float* l, T* out) {
  const int64_t D = ig.D;
  if (w.part >= 0) {
    const Partials& pt = p.partials;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t slot = w.part * pt.rows + r;
      std::copy_n(acc + r * stride, D, pt.acc + slot * D);
      pt.m[slot] = m[r];
      pt.l[slot] = l[r];
    }
    return;
  }
  const int64_t per_pos = (w.kv_end - w.kv_begin) * ig.G;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t j = w.q_begin + r / per_pos;
    const int64_t h = w.kv_begin * ig.G + r % per_pos;
    T* orow = out + ((ig.q0 + j) * p.num_heads + h) * D;
    const fVec inv(1.f / l[r]);
    const float* ar = acc + r * stride;
    for_each_vec(D, [&](int64_t c, int64_t cnt) {
      store_n(orow + c, fVec::loadu(ar + c) * inv, cnt);
    });
  }
}

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

// tanh as a rational function of x (odd 13th over even 6th degree, the Eigen fast_tanh_float
// coefficients), x clamped to +-7.905: within 4e-7 of tanh in a dozen FMAs, where Sleef's tanh
// cost a quarter of the whole capped prefill. The soft cap of the row-tile and AMX paths.
// NaN stays NaN: VMAXPS / VMINPS return their second operand when either is NaN, so x goes
// second in the clamp (with x first, a NaN score became -1, and a NaN key gave a finite
// capped softmax where native gives NaN).
inline __m512 fast_tanh(__m512 x) {
  const __m512 lim = _mm512_set1_ps(7.90531110763549805f);
  x = _mm512_min_ps(lim, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim), x));
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-2.76076847742355e-16f);
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.00018790482477e-13f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-8.60467152213735e-11f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(5.12229709037114e-08f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(1.48572235717979e-05f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(6.37261928875436e-04f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(4.89352455891786e-03f));
  p = _mm512_mul_ps(p, x);
  __m512 q = _mm512_set1_ps(1.19825839466702e-06f);
  q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(1.18534705686654e-04f));
  q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(2.26843463243900e-03f));
  q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(4.89352518554385e-03f));
  // p / q with a reciprocal estimate and one Newton step (a full-width division is ~10 cycles)
  const __m512 r0 = _mm512_rcp14_ps(q);
  const __m512 r = _mm512_mul_ps(r0, _mm512_fnmadd_ps(q, r0, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(p, r);
}
#endif

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
// of two rows (all in registers, 6 loads per 8 FMAs) measured the same within this machine's
// noise. Row i's four scores go to out[i][0, 4).
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
// element otherwise): 4-6% faster on GQA 8 decodes here.
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
// reduction chosen by the pair width) measured 5-7% slower on bf16 GQA 4/8 decodes here.
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
// then four, then one (AVX2: four, two, one, sized to its 16 registers). Needs d % kF == 0.
template <typename T>
inline void pv_rows_t(float* const* acc, const float* const* p, int64_t nr, const T* const* v,
                      int64_t n, int64_t d) {
  int64_t r = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; r + 8 <= nr; r += 8) pv_tile_t_row<8, 2>(acc + r, p + r, v, n, d);
  for (; r + 4 <= nr; r += 4) pv_tile_t_row<4, 4>(acc + r, p + r, v, n, d);
#else
  // 16 vector registers: 12 accumulators, the widened value vectors and a probability
  for (; r + 4 <= nr; r += 4) pv_tile_t_row<4, 3>(acc + r, p + r, v, n, d);
  for (; r + 2 <= nr; r += 2) pv_tile_t_row<2, 6>(acc + r, p + r, v, n, d);
#endif
  for (; r < nr; ++r) pv_tile_t_row<1, 8>(acc + r, p + r, v, n, d);
}

// Copies a cache row of `d` elements into `buf` as fp32, zero-padded up to `padded`.
template <typename T>
inline const float* widen_row(const T* src, float* buf, int64_t d, int64_t padded) {
  if (d == padded) {  // whole vectors: a branch-free loop, two at a time
    int64_t j = 0;
    for (; j + 2 * kF <= d; j += 2 * kF) {
      load_f(src + j).store(buf + j);
      load_f(src + j + kF).store(buf + j + kF);
    }
    if (j < d) load_f(src + j).store(buf + j);
    return buf;
  }
  for_each_vec(padded, [&](int64_t j, int64_t n) {
    const int64_t valid = std::max<int64_t>(0, std::min(n, d - j));
    (valid == kF ? load_f(src + j) : load_f(src + j, valid)).store(buf + j);
  });
  return buf;
}

// Returns an fp32 view of a cache row of `d` elements, converting into `buf` (see widen_row)
// unless the row can be read in place.
template <typename T>
inline const float* as_float_row(const T* src, float* buf, int64_t d, int64_t padded) {
  if constexpr (std::is_same_v<T, float>) {
    if (d == padded) return src;
  }
  return widen_row(src, buf, d, padded);
}

}  // namespace
}  // namespace opmux_cpu

// paged_attention, per-row kernels: the work-item description and the value (p·v)
// micro-kernels of the decode path, over rows of the fp32 scratch (the score kernels are in
// paged_attention_qk.h); included by paged_attention.cpp only (its anonymous namespace keeps
// them private to that file).
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


constexpr int64_t kTokenChunk = 128;  // keys scored per step (shorter chunks add per-chunk
                                      // softmax work; benchmarks/paged_attention_cpu.py)
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
// coefficients), x clamped to +-7.905: within 4e-7 of tanh in a dozen FMAs, far cheaper than
// Sleef's tanh on a capped prefill (benchmarks/paged_attention_cpu.py). The soft cap of the
// row-tile and AMX paths. NaN stays NaN: VMAXPS / VMINPS return their second operand when
// either is NaN, so x goes second in the clamp (with x first, a NaN score would become -1,
// and a NaN key would give a finite capped softmax where native gives NaN).
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
  // p / q with a reciprocal estimate and one Newton step (cheaper than a full-width division)
  const __m512 r0 = _mm512_rcp14_ps(q);
  const __m512 r = _mm512_mul_ps(r0, _mm512_fnmadd_ps(q, r0, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(p, r);
}
#endif

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

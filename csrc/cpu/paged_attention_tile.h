// paged_attention, row-tile path: query rows in vector lanes (AVX-512 only).
//
// For a work item whose query rows all read one kv head (prefill positions x GQA group, 9 to
// 32 rows), the rows go in the lanes of one or two vectors instead of one row at a time. The
// query block is stored transposed once per item (qT[d][row], 16 x 16 blocks transposed in
// registers, as the output rows are at the end); then, per chunk of keys:
//   scores  sT[t][row] = sum_d qT[d][row] * k[t][d]    (broadcast-FMA, no horizontal sums)
//   mask, soft cap, running max and sum: vertical over t, one vector op per (key, 16 rows)
//   values  accT[d][row] = accT[d][row] * alpha[row] + sum_t sT[t][row] * v[t][d]
// so every score and every output element is one FMA lane, keys and values are broadcast
// straight out of the cache (fp32 with a 16-multiple head size and few kv heads) or out of one
// fp32 copy of the chunk (bf16/fp16, converted once for all the item's rows), and the
// accumulator rescale rides on the value step's register loads. Lanes past a sub-tile's rows
// repeat its last row (finite values, never written out).
//
// An item holds up to kMaxSub sub-tiles of 16 * NV rows (prefill positions x GQA group), each
// with its own qT/accT and softmax state; every chunk of keys is read (and widened) once and
// then taken by each sub-tile in turn, which halves to quarters the cache reads of a long
// prefill. With many kv heads one head's piece of a token row is a few cache lines every
// several KiB, which the hardware prefetcher follows poorly, so the next chunk's pieces are
// prefetched into L2 while the current one is computed (benchmarks/paged_attention_cpu.py).
#pragma once

#include "paged_attention_rows.h"
#include "vec_common.h"

#include <algorithm>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

namespace opmux_cpu {
namespace pa_tile {

constexpr int kLanes = 16;
constexpr int kStride = 2 * kLanes;  // floats per d in qT/accT and per key in sT
constexpr int64_t kChunk = 64;  // keys per step (at most)
constexpr int64_t kMaxSub = 4;  // sub-tiles of one item: at most 4 * 32 query rows

struct TileScratch {
  std::vector<float> qT, accT, sT;
  std::vector<float> kbuf, vbuf, zero;
  explicit TileScratch(int64_t padded)
      : qT(kMaxSub * padded * kStride), accT(kMaxSub * padded * kStride),
        sT((kChunk + kLanes) * kStride),
        kbuf(kChunk * padded), vbuf(kChunk * padded), zero(padded, 0.f) {}
};

// rows[i] = fp32 view of the cache row base + i * stride (i < n): the row itself when
// in_place (fp32, unpadded), else its zero-padded copy in buf.
template <typename T>
inline void fp32_rows(const T* base, int64_t n, int64_t stride, bool in_place, int64_t d,
                      int64_t padded, float* buf, const float** rows) {
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      if (in_place) {
        rows[i] = base + i * stride;
        continue;
      }
    }
    rows[i] = widen_row(base + i * stride, buf + i * padded, d, padded);
  }
}

// sT[t][lanes] = qT^T k[t] for TB keys; k[t] has at least d floats.
template <int NV, int TB>
inline void score_tile(const float* qT, const float* const* k, int64_t d, float* sT) {
  __m512 acc[TB][NV];
  for (int t = 0; t < TB; ++t) {
    for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_setzero_ps();
  }
  const float* kr[TB];
  for (int t = 0; t < TB; ++t) kr[t] = k[t];
  for (int64_t c = 0; c < d; ++c) {
    __m512 q[NV];
    for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_ps(qT + c * kStride + v * kLanes);
    for (int t = 0; t < TB; ++t) {
      const __m512 b = _mm512_set1_ps(kr[t][c]);
      for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_fmadd_ps(q[v], b, acc[t][v]);
    }
  }
  for (int t = 0; t < TB; ++t) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(sT + t * kStride + v * kLanes, acc[t][v]);
  }
}

// accT[d0, d0 + DB) = accT * alpha + sum_t sT[t] * v[t][d]: DB x NV accumulators.
template <int NV, int DB>
inline void value_tile(float* accT, const float* sT, const float* const* vr, int64_t n,
                       int64_t d0, const __m512* alpha) {
  __m512 acc[DB][NV];
  for (int e = 0; e < DB; ++e) {
    for (int v = 0; v < NV; ++v) {
      acc[e][v] = _mm512_mul_ps(_mm512_loadu_ps(accT + (d0 + e) * kStride + v * kLanes), alpha[v]);
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    __m512 p[NV];
    for (int v = 0; v < NV; ++v) p[v] = _mm512_loadu_ps(sT + t * kStride + v * kLanes);
    const float* row = vr[t] + d0;
    for (int e = 0; e < DB; ++e) {
      const __m512 b = _mm512_set1_ps(row[e]);
      for (int v = 0; v < NV; ++v) acc[e][v] = _mm512_fmadd_ps(p[v], b, acc[e][v]);
    }
  }
  for (int e = 0; e < DB; ++e) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(accT + (d0 + e) * kStride + v * kLanes, acc[e][v]);
  }
}

// Rows of one sub-tile (16 * NV lanes) and their per-row state between chunks.
template <int NV>
struct SubTile {
  alignas(64) int32_t pos[kStride];
  alignas(64) int32_t lo[kStride];
  __m512 m[NV], l[NV];
  int64_t lo_first, hi_last;  // keys some row of the sub-tile sees: [lo_first, hi_last]
  int64_t lo_max, pos_min;    // keys every row sees: [lo_max, pos_min]
};

// One item: `rows` (<= 16 * NV * kMaxSub) query rows of kv head `kv`, query positions
// [pos0, ...) with G rows per position, in sub-tiles of 16 * NV rows that take each chunk of
// keys in turn, so the chunk is read from the cache (and widened) once for all of them; see
// the file comment. Arguments mirror run_item in paged_attention.cpp.
template <int NV, typename T>
void run_tile_item(const WorkItem& w, const Params& p, const T* query, const T* kc, const T* vc,
                   T* out, TileScratch& s) {
  const ItemGeom ig(w, p);
  const int64_t G = ig.G, D = ig.D, Dp = ig.Dp;
  constexpr int TB = NV == 2 ? 8 : 16;  // keys per score tile
  constexpr int DB = NV == 2 ? 8 : 16;  // head dims per value tile
  constexpr int64_t kSubRows = NV * kLanes;
  const int64_t rows = (w.q_end - w.q_begin) * G;
  const int64_t n_sub = (rows + kSubRows - 1) / kSubRows;
  const int64_t kv = w.kv_begin;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

  SubTile<NV> sub[kMaxSub];
  for (int64_t u = 0; u < n_sub; ++u) {
    SubTile<NV>& st = sub[u];
    const int64_t last = std::min(rows, (u + 1) * kSubRows) - 1;  // lanes past it repeat it
    float* qT = s.qT.data() + u * Dp * kStride;
    const T* qrows[kSubRows];
    for (int64_t i = 0; i < kSubRows; ++i) {
      const int64_t rr = std::min(u * kSubRows + i, last);
      qrows[i] = query + (ig.q0 + w.q_begin + rr / G) * p.q_stride0 +
                 (kv * G + rr % G) * p.q_stride1;
    }
    // qT = (q * scale)^T: 16 x 16 blocks transposed in registers, the last D % 16 elements
    // one by one
    const int64_t d16 = D / kLanes * kLanes;
    const __m512 scale_v = _mm512_set1_ps(p.scale);
    for (int v = 0; v < NV; ++v) {
      for (int64_t c0 = 0; c0 < d16; c0 += kLanes) {
        __m512 x[kLanes];
        for (int i = 0; i < kLanes; ++i) {
          x[i] = _mm512_mul_ps(load_f(qrows[v * kLanes + i] + c0), scale_v);
        }
        transpose16(x);
        for (int e = 0; e < kLanes; ++e) {
          _mm512_storeu_ps(qT + (c0 + e) * kStride + v * kLanes, x[e]);
        }
      }
    }
    for (int64_t i = 0; i < kSubRows; ++i) {
      const int64_t rr = std::min(u * kSubRows + i, last);
      const int64_t j = w.q_begin + rr / G;
      for (int64_t c = d16; c < D; ++c) {
        qT[c * kStride + i] = static_cast<float>(qrows[i][c]) * p.scale;
      }
      for (int64_t c = D; c < Dp; ++c) qT[c * kStride + i] = 0.f;
      st.pos[i] = static_cast<int32_t>(ig.kv_len - ig.q_len + j);
      st.lo[i] = p.window > 0 ? std::max<int32_t>(0, st.pos[i] - static_cast<int32_t>(p.window) + 1)
                              : 0;
    }
    st.lo_first = st.lo[0];
    st.hi_last = st.pos[kSubRows - 1];
    st.lo_max = st.lo[kSubRows - 1];
    st.pos_min = st.pos[0];
    for (int v = 0; v < NV; ++v) {
      st.m[v] = neg_inf;
      st.l[v] = _mm512_setzero_ps();
    }
  }
  std::fill_n(s.accT.data(), n_sub * Dp * kStride, 0.f);
  const int64_t lo_all = sub[0].lo_first;        // earliest visible key of any row
  const int64_t hi = sub[n_sub - 1].hi_last;     // last visible key of any row
  const bool capped = p.soft_cap > 0.f;
  const __m512 cap = _mm512_set1_ps(p.soft_cap);
  const __m512 inv_cap = _mm512_set1_ps(capped ? 1.f / p.soft_cap : 0.f);
  constexpr bool kInPlace = std::is_same_v<T, float>;
  const bool in_place = kInPlace && D == Dp;
  // Cache rows 4 KiB or more apart (many kv heads) fall into a few L1 sets; the value step
  // walks all the chunk's rows once per block of dims, so their values go through the
  // contiguous copy from 4 KiB apart; keys, read 8 rows at a time, only from 8 KiB
  // (benchmarks/paged_attention_cpu.py).
  const int64_t row_bytes = ig.tok_stride * static_cast<int64_t>(sizeof(T));
  const bool k_in_place = row_bytes < 8192;
  const bool v_in_place = row_bytes < 4096;
  auto chunk_end = [&](int64_t t0) {
    return std::min({hi + 1, (t0 / p.block_size + 1) * p.block_size, t0 + kChunk});
  };

  const float* krow[kChunk + kLanes];
  const float* vrow[kChunk];
  float* sT = s.sT.data();
  for (int64_t t0 = lo_all; t0 <= hi;) {
    const int64_t t1 = chunk_end(t0);
    const int64_t n = t1 - t0;
    const int64_t offset = ig.token_offset(p, t0) + kv * D;
    const T* kbase = kc + offset;
    const T* vbase = vc + offset;
    if (t1 <= hi) {  // the next chunk's rows into L2: one head's piece of each token row
      const int64_t offset2 = ig.token_offset(p, t1) + kv * D;
      const char* k2 = reinterpret_cast<const char*>(kc + offset2);
      const char* v2 = reinterpret_cast<const char*>(vc + offset2);
      const int64_t piece = D * static_cast<int64_t>(sizeof(T));
      for (int64_t i = 0; i < chunk_end(t1) - t1; ++i) {
        for (int64_t b = 0; b < piece; b += 64) {
          _mm_prefetch(k2 + i * row_bytes + b, _MM_HINT_T1);
          _mm_prefetch(v2 + i * row_bytes + b, _MM_HINT_T1);
        }
      }
    }
    fp32_rows(kbase, n, ig.tok_stride, in_place && k_in_place, D, Dp, s.kbuf.data(), krow);
    fp32_rows(vbase, n, ig.tok_stride, in_place && v_in_place, D, Dp, s.vbuf.data(), vrow);
    const int64_t n_pad = (n + TB - 1) / TB * TB;
    for (int64_t i = n; i < n_pad; ++i) krow[i] = s.zero.data();
    for (int64_t u = 0; u < n_sub; ++u) {
      SubTile<NV>& st = sub[u];
      if (t0 > st.hi_last || t1 - 1 < st.lo_first) continue;  // nothing visible to these rows
      const float* qT = s.qT.data() + u * Dp * kStride;
      for (int64_t t = 0; t < n_pad; t += TB) score_tile<NV, TB>(qT, krow + t, D, sT + t * kStride);

      // soft cap, mask, running max
      const bool full = t0 >= st.lo_max && t1 - 1 <= st.pos_min;
      __m512i pos_v[NV], lo_v[NV];
      __m512 mx[NV];
      for (int v = 0; v < NV; ++v) {
        pos_v[v] = _mm512_load_si512(st.pos + v * kLanes);
        lo_v[v] = _mm512_load_si512(st.lo + v * kLanes);
        mx[v] = neg_inf;
      }
      for (int64_t t = 0; t < n; ++t) {
        const __m512i tt = _mm512_set1_epi32(static_cast<int32_t>(t0 + t));
        for (int v = 0; v < NV; ++v) {
          float* sp = sT + t * kStride + v * kLanes;
          __m512 x = _mm512_loadu_ps(sp);
          if (capped) x = _mm512_mul_ps(cap, fast_tanh(_mm512_mul_ps(x, inv_cap)));
          if (!full) {
            const __mmask16 vis = _mm512_cmple_epi32_mask(tt, pos_v[v]) &
                                  _mm512_cmpge_epi32_mask(tt, lo_v[v]);
            x = _mm512_mask_mov_ps(neg_inf, vis, x);
          }
          _mm512_storeu_ps(sp, x);
          mx[v] = _mm512_max_ps(mx[v], x);
        }
      }
      __m512 alpha[NV], m_use[NV];
      for (int v = 0; v < NV; ++v) {
        const __m512 m_new = _mm512_max_ps(st.m[v], mx[v]);
        // rows with nothing visible yet keep -inf; subtract 0 there so no inf - inf appears
        m_use[v] = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ),
                                      _mm512_setzero_ps());
        alpha[v] = exp512(_mm512_sub_ps(st.m[v], m_use[v]));
        st.m[v] = m_new;
      }
      __m512 sum[NV];
      for (int v = 0; v < NV; ++v) sum[v] = _mm512_setzero_ps();
      for (int64_t t = 0; t < n; ++t) {
        for (int v = 0; v < NV; ++v) {
          float* sp = sT + t * kStride + v * kLanes;
          const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sp), m_use[v]));
          _mm512_storeu_ps(sp, e);
          sum[v] = _mm512_add_ps(sum[v], e);
        }
      }
      for (int v = 0; v < NV; ++v) st.l[v] = _mm512_fmadd_ps(st.l[v], alpha[v], sum[v]);
      float* accT = s.accT.data() + u * Dp * kStride;
      for (int64_t d0 = 0; d0 < Dp; d0 += DB) value_tile<NV, DB>(accT, sT, vrow, n, d0, alpha);
    }
    t0 = t1;
  }

  for (int64_t u = 0; u < n_sub; ++u) {
    alignas(64) float inv[kStride];
    for (int v = 0; v < NV; ++v) {
      _mm512_store_ps(inv + v * kLanes, _mm512_div_ps(_mm512_set1_ps(1.f), sub[u].l[v]));
    }
    const float* accT = s.accT.data() + u * Dp * kStride;
    const int64_t n_rows = std::min(kSubRows, rows - u * kSubRows);
    T* orows[kSubRows];
    for (int64_t i = 0; i < n_rows; ++i) {
      const int64_t r = u * kSubRows + i;
      orows[i] = out + ((ig.q0 + w.q_begin + r / G) * p.num_heads + kv * G + r % G) * D;
    }
    // out rows = (accT / l)^T, in 16 x 16 blocks as qT was made
    const int64_t d16 = D / kLanes * kLanes;
    for (int v = 0; v < NV && v * kLanes < n_rows; ++v) {
      const int64_t nv = std::min<int64_t>(kLanes, n_rows - v * kLanes);
      const __m512 inv_v = _mm512_load_ps(inv + v * kLanes);
      for (int64_t c0 = 0; c0 < d16; c0 += kLanes) {
        __m512 x[kLanes];
        for (int e = 0; e < kLanes; ++e) {
          x[e] = _mm512_mul_ps(_mm512_loadu_ps(accT + (c0 + e) * kStride + v * kLanes), inv_v);
        }
        transpose16(x);
        for (int64_t i = 0; i < nv; ++i) store_n(orows[v * kLanes + i] + c0, fVec(x[i]), kLanes);
      }
    }
    for (int64_t i = 0; i < n_rows; ++i) {
      for (int64_t c = d16; c < D; ++c) {
        orows[i][c] = static_cast<T>(accT[c * kStride + i] * inv[i]);
      }
    }
  }
}

}  // namespace pa_tile
}  // namespace opmux_cpu
#endif  // CPU_CAPABILITY_AVX512

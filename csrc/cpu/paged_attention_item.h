// paged_attention, one work item: its fp32 scratch and run_item, which walks the item's
// keys chunk by chunk with the score and value kernels; included by paged_attention.cpp
// only (its anonymous namespace keeps them private to that file).
#pragma once

#include "paged_attention_qk.h"
#include "paged_attention_rows.h"
#include "vec_common.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace opmux_cpu {
namespace {

// most kv heads of a work item with 4 or more query heads per kv head
constexpr int64_t kGroupHeads = kMaxRows / 4;

struct Scratch {
  std::vector<float> q, acc, scores, m, l, kbuf, vbuf, zero;
  bool visible[kMaxRows];
  const float* krow[kTokenChunk + 16];  // fp32 views of the chunk's key rows (+ zero padding)
  const float* vrow[kTokenChunk];
  const float* qp[kMaxRows];  // rows of one kv head: query, scores, accumulator, probabilities
  float* sp[kMaxRows];
  float* ap[kMaxRows];
  const float* pp[kMaxRows];
  std::vector<uint32_t> qpack;  // GQA groups with rows in lanes (qk_group)
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  std::vector<float> qpack8;  // groups of 8 (4) rows in lanes (pairs): qk_rows8, qk_rows4
  std::vector<float> kgroup;  // 16 tokens' widened key rows of each kv head: [head][token][Dp]
#endif
  explicit Scratch(int64_t padded)
      : q(kMaxRows * padded), acc(kMaxRows * padded), scores(kMaxRows * kTokenChunk),
        m(kMaxRows), l(kMaxRows), kbuf(kTokenChunk * padded), vbuf(kTokenChunk * padded),
        zero(padded, 0.f), qpack(kMaxRows * padded) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
    qpack8.resize(kMaxRows * padded);
    kgroup.resize(kGroupHeads * 16 * padded);
#endif
  }
};

template <typename T>
void run_item(const WorkItem& w, const Params& p, const T* query, const T* kc, const T* vc,
              T* out, Scratch& s) {
  const ItemGeom ig(w, p);
  const int64_t G = ig.G, D = ig.D, Dp = ig.Dp;
  const int64_t nkh = w.kv_end - w.kv_begin;
  const int64_t per_pos = nkh * G;  // rows per query position
  const int64_t rows = (w.q_end - w.q_begin) * per_pos;

  // row r <-> (query position j, kv head kh, group member g):
  //   r = (j - q_begin) * per_pos + (kh - kv_begin) * G + g,  query head = kh * G + g
  int64_t row_pos[kMaxRows];
  int64_t row_lo[kMaxRows];
  [[maybe_unused]] const T* q_raw[kMaxRows];  // the query rows as given (unscaled), for the
                                              // AVX-512 bf16 score paths
  // bf16 with a head size that is a multiple of 32: scores by pair dot products. The value
  // step widens the values in registers instead, which is faster than pair dot products with
  // bf16-rounded probabilities (benchmarks/paged_attention_cpu.py).
  [[maybe_unused]] const bool pairs =
      std::is_same_v<T, at::BFloat16> && D % 32 == 0 && kHasBf16Pairs;
  const fVec sc(p.scale);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t j = w.q_begin + r / per_pos;
    const int64_t h = w.kv_begin * G + r % per_pos;
    const T* qrow = query + (ig.q0 + j) * p.q_stride0 + h * p.q_stride1;
    q_raw[r] = qrow;
    float* qf = s.q.data() + r * Dp;
    for_each_vec(Dp, [&](int64_t c, int64_t) {
      const int64_t valid = std::max<int64_t>(0, std::min(kF, D - c));
      ((valid == kF ? load_f(qrow + c) : load_f(qrow + c, valid)) * sc).store(qf + c);
    });
    row_pos[r] = ig.kv_len - ig.q_len + j;
    row_lo[r] = p.window > 0 ? std::max<int64_t>(0, row_pos[r] - p.window + 1) : 0;
    s.m[r] = -std::numeric_limits<float>::infinity();
    s.l[r] = 0.f;
    std::fill_n(s.acc.data() + r * Dp, Dp, 0.f);
  }
#if defined(CPU_CAPABILITY_AVX512)
  // 4 or 8 query heads per kv head (fp32, or bf16 pairs): each group's rows go in vector
  // lanes for the scores (qk_group), packed here from the scaled fp32 rows or the raw bf16
  constexpr bool kF32 = std::is_same_v<T, float>;
  const bool grouped = (G == 4 || G == 8) && (kF32 ? D == Dp : pairs);
  const int64_t words = kF32 ? D : D / 2;  // 32-bit lanes per row
  for (int64_t r = 0; grouped && r < rows; r += G) {
    const uint32_t* wr[8];
    for (int64_t g = 0; g < G; ++g) {
      wr[g] = kF32 ? reinterpret_cast<const uint32_t*>(s.q.data() + (r + g) * Dp)
                   : reinterpret_cast<const uint32_t*>(q_raw[r + g]);
    }
    if (G == 8) {
      pack_group<2>(wr, s.qpack.data() + r * words, words);
    } else {
      pack_group<4>(wr, s.qpack.data() + r * words, words);
    }
  }
  // the scores of one group's rows against 16 keys
  auto group_scores = [&](int64_t r, int64_t tg, const auto* const* kr, int64_t m,
                          float scale) {
    for (int64_t g = 0; g < G; ++g) s.sp[g] = s.scores.data() + (r + g) * kTokenChunk + tg;
    const __m512 sc16 = _mm512_set1_ps(scale);
    if (G == 8) {
      qk_group<2>(s.qpack.data() + r * words, s.sp, kr, m, D, sc16);
    } else {
      qk_group<4>(s.qpack.data() + r * words, s.sp, kr, m, D, sc16);
    }
  };
#endif
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  // 8 or 4 query heads per kv head (any dtype and head size): each group's scaled fp32 rows
  // go in the 8 lanes (qk_rows8) or in pairs of lanes (qk_rows4) for the scores, against the
  // fp32 key rows of the chunk
  const bool grouped8 = G == 8;
  float* qpack8 = s.qpack8.data();
  for (int64_t r = 0; grouped8 && r < rows; r += 8) {
    const float* gr[8];
    for (int64_t g = 0; g < 8; ++g) gr[g] = s.q.data() + (r + g) * Dp;
    pack_rows8(gr, qpack8 + r * D, D);
  }
  const bool grouped4 = G == 4;
  const int64_t D2 = (D + 1) / 2 * 2;  // elements per packed row (even)
  // Narrow keys of a GQA 4/8 item are widened for 16 tokens at a time in address order (each
  // token's [heads, D] row as one stream), not head by head: the head-by-head widening reads
  // D elements every Hkv * D and waits on memory there. fp32 keys stay in place: a copy in
  // address order is slower for them (benchmarks/paged_attention_cpu.py).
  const bool keys_first = !std::is_same_v<T, float> && (grouped8 || grouped4) &&
                          nkh <= kGroupHeads;
  for (int64_t r = 0; grouped4 && r < rows; r += 4) {
    const float* gr[4];
    for (int64_t g = 0; g < 4; ++g) gr[g] = s.q.data() + (r + g) * Dp;
    pack_rows4(gr, qpack8 + r * D2, D);
  }
#endif
  int64_t lo = row_lo[0];
  int64_t hi = row_pos[rows - 1];
  if (w.part >= 0) {  // split-KV: this item's share of the keys
    lo = std::max<int64_t>(lo, w.t_begin);
    hi = std::min<int64_t>(hi, w.t_end - 1);
  }
  const fVec cap(p.soft_cap);
  const fVec inv_cap(p.soft_cap > 0.f ? 1.f / p.soft_cap : 0.f);
  const fVec neg_inf(-std::numeric_limits<float>::infinity());

  auto chunk_end = [&](int64_t t0) {
    return std::min({hi + 1, (t0 / p.block_size + 1) * p.block_size, t0 + kTokenChunk});
  };
  auto chunk_ptr = [&](const T* cache, int64_t t0) {
    return cache + ig.token_offset(p, t0) + static_cast<int64_t>(w.kv_begin) * ig.hs;
  };

  for (int64_t t0 = lo; t0 <= hi;) {
    const int64_t t1 = chunk_end(t0);
    const int64_t n = t1 - t0;
    const T* kbase = chunk_ptr(kc, t0);
    const T* vbase = chunk_ptr(vc, t0);
    // scores = (q * scale) . k. Tokens go in groups of 16 (outer) and kv heads inner, so the
    // cache is read in address order: 16 tokens x the item's heads, then the next 16.
    for (int64_t tg = 0; tg < n; tg += 16) {
      const int64_t m = std::min<int64_t>(16, n - tg);
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
      for (int64_t i = 0; keys_first && i < m; ++i) {
        const T* src = kbase + (tg + i) * ig.tok_stride;
        for (int64_t kh = 0; kh < nkh; ++kh) {
          widen_row(src + kh * ig.hs, s.kgroup.data() + (kh * 16 + i) * Dp, D, Dp);
        }
      }
#endif
      for (int64_t kh = 0; kh < nkh; ++kh) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          if (pairs) {
            const at::BFloat16* kr[16];
            for (int64_t i = 0; i < 16; ++i) {
              kr[i] = i < m ? kbase + (tg + i) * ig.tok_stride + kh * ig.hs
                            : reinterpret_cast<const at::BFloat16*>(s.zero.data());
            }
            if (grouped) {
              for (int64_t r = kh * G; r < rows; r += per_pos) group_scores(r, tg, kr, m, p.scale);
              continue;
            }
            const at::BFloat16* qr[kMaxRows];
            int64_t nr = 0;
            for (int64_t r = kh * G; r < rows; r += per_pos) {
              for (int64_t g = 0; g < G; ++g, ++nr) {
                qr[nr] = q_raw[r + g];
                s.sp[nr] = s.scores.data() + (r + g) * kTokenChunk + tg;
              }
            }
            qk_rows_bf16(qr, s.sp, nr, kr, m, D, p.scale);
            continue;
          }
        }
#endif
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
        if (keys_first) {
          for (int64_t i = 0; i < m; ++i) s.krow[i] = s.kgroup.data() + (kh * 16 + i) * Dp;
        } else
#endif
        for (int64_t i = 0; i < m; ++i) {
          s.krow[i] = as_float_row(kbase + (tg + i) * ig.tok_stride + kh * ig.hs,
                                   s.kbuf.data() + (tg + i) * Dp, D, Dp);
        }
        for (int64_t i = m; i < 16; ++i) s.krow[i] = s.zero.data();
#if defined(CPU_CAPABILITY_AVX512)
        if (grouped) {  // fp32: the packed rows are already scaled
          for (int64_t r = kh * G; r < rows; r += per_pos) group_scores(r, tg, s.krow, m, 1.f);
          continue;
        }
#endif
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
        if (grouped8) {
          for (int64_t r = kh * G; r < rows; r += per_pos) {
            for (int64_t g = 0; g < 8; ++g) s.sp[g] = s.scores.data() + (r + g) * kTokenChunk + tg;
            qk_rows8(qpack8 + r * D, s.sp, s.krow, m, D);
          }
          continue;
        }
        if (grouped4) {
          for (int64_t r = kh * G; r < rows; r += per_pos) {
            for (int64_t g = 0; g < 4; ++g) s.sp[g] = s.scores.data() + (r + g) * kTokenChunk + tg;
            qk_rows4(qpack8 + r * D2, s.sp, s.krow, m, D);
          }
          continue;
        }
#endif
        int64_t nr = 0;
        for (int64_t r = kh * G; r < rows; r += per_pos) {
          for (int64_t g = 0; g < G; ++g, ++nr) {
            s.qp[nr] = s.q.data() + (r + g) * Dp;
            s.sp[nr] = s.scores.data() + (r + g) * kTokenChunk + tg;
          }
        }
        qk_rows(s.qp, s.sp, nr, s.krow, m, Dp);
      }
    }
    // soft cap, mask, online softmax; scores become probabilities (0 where masked)
    bool any_visible = false;
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s.scores.data() + r * kTokenChunk;
      const int64_t a = std::max(t0, row_lo[r]) - t0;      // first visible index
      const int64_t b = std::min(t1 - 1, row_pos[r]) - t0;  // last visible index
      s.visible[r] = a <= b;
      if (a > b) continue;
      any_visible = true;
      fVec mx_v = neg_inf;
      for_each_vec(n, [&](int64_t c, int64_t cnt) {
        fVec v = fVec::loadu(sr + c, cnt);
        const bool whole = c >= a && c + cnt - 1 <= b && cnt == kF;
        if (whole && p.soft_cap <= 0.f) {  // every key seen, nothing to change: the max only
          mx_v = at::vec::maximum(mx_v, v);
          return;
        }
        if (p.soft_cap > 0.f) v = cap * (v * inv_cap).tanh();
        if (!whole) {
          float tmp[kF];
          v.store(tmp);
          for (int64_t e = 0; e < kF; ++e) {
            if (c + e < a || c + e > b || e >= cnt) {
              tmp[e] = -std::numeric_limits<float>::infinity();
            }
          }
          v = fVec::loadu(tmp);
        }
        v.store(sr + c, cnt);
        mx_v = at::vec::maximum(mx_v, v);
      });
      const float m_new = std::max(s.m[r], hmax(mx_v));
      const float alpha = std::exp(s.m[r] - m_new);  // 0 on the first visible chunk
      const fVec mv(m_new);
      fVec sum_v(0.f);
      for_each_vec(n, [&](int64_t c, int64_t cnt) {
#if defined(CPU_CAPABILITY_AVX512)
        fVec e(exp512(fVec::loadu(sr + c, cnt) - mv));
#else
        fVec e = (fVec::loadu(sr + c, cnt) - mv).exp_u20();
#endif
        if (cnt < kF) {
          float tmp[kF] = {};
          e.store(tmp, cnt);
          e = fVec::loadu(tmp);
        }
        e.store(sr + c, cnt);
        sum_v = sum_v + e;
      });
      s.l[r] = s.l[r] * alpha + hsum(sum_v);
      if (alpha != 1.f) {
        float* ar = s.acc.data() + r * Dp;
        const fVec al(alpha);
        for (int64_t c = 0; c < Dp; c += kF) (fVec::loadu(ar + c) * al).store(ar + c);
      }
      s.m[r] = m_new;
    }
    if (any_visible) {
      for (int64_t tg = 0; tg < n; tg += 16) {
        const int64_t m = std::min<int64_t>(16, n - tg);
        for (int64_t kh = 0; kh < nkh; ++kh) {
          int64_t nr = 0;
          for (int64_t r = kh * G; r < rows; r += per_pos) {
            for (int64_t g = 0; g < G; ++g) {
              if (s.visible[r + g]) {
                s.ap[nr] = s.acc.data() + (r + g) * Dp;
                s.pp[nr++] = s.scores.data() + (r + g) * kTokenChunk + tg;
              }
            }
          }
          if (D == Dp) {  // value rows widened in registers
            const T* vr[16];
            for (int64_t i = 0; i < m; ++i) vr[i] = vbase + (tg + i) * ig.tok_stride + kh * ig.hs;
            pv_rows_t(s.ap, s.pp, nr, vr, m, D);
          } else {  // through a zero-padded fp32 copy
            for (int64_t i = 0; i < m; ++i) {
              s.vrow[i] = as_float_row(vbase + (tg + i) * ig.tok_stride + kh * ig.hs,
                                       s.vbuf.data() + (tg + i) * Dp, D, Dp);
            }
            pv_rows_t(s.ap, s.pp, nr, s.vrow, m, Dp);
          }
        }
      }
    }
    t0 = t1;
  }
  finish_rows(w, p, ig, rows, s.acc.data(), Dp, s.m.data(), s.l.data(), out);
}

}  // namespace
}  // namespace opmux_cpu

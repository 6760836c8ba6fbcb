// paged_attention, AMX path: bf16 caches with a head size that is a multiple of 32, on CPUs
// with AMX tiles (built with -march=native where the compiler defines __AMX_TILE__ and
// __AMX_BF16__), once Linux has granted this process the tile state. Included by
// paged_attention.cpp only.
//
// An item's rows (query rows; the same numbering as run_item) go in lane tiles of 16. A row
// group is the rows of one kv head that one tile product serves: for a decode item with
// several kv heads, one head's G rows (16 / G groups share a lane tile); for an item of one kv
// head, its rows rounded up to 1, 2, 4 or 8, or groups of 16 (prefill positions x G, the last
// padded). Per chunk of kChunk keys at most:
//   scores  S^T = K . Q^T  per group and 16 tokens: K rows straight from the cache as the A
//           tile (no copy, no widening), the group's query rows packed once per item in the
//           pair-interleaved B layout; the 16 x R result lands in the group's lanes of a
//           [token][16 lanes] buffer.
//   softmax vectorised across the 16 lanes (one vector per token): scale, soft cap, mask,
//           running max and sum per lane (a chunk every row of the lane tile sees whole, with
//           no cap: the raw scores' max, the scale applied in the exp's FMA), the accumulators
//           rescaled; the probabilities are transposed to rows and rounded to bf16 (the A
//           tile of the next step).
//   values  O += P . V  per group, in one of two forms, with up to four 16-column
//           accumulator tiles at a time, loaded from and stored back to fp32 accumulators:
//     parity (groups of 8 rows at most): the B tile is 16 value rows x 32 columns straight
//           from the cache, which the product reads as 16 tokens x 16 pairs of adjacent
//           columns. The A tile holds each row's probabilities twice, 2 R rows: rows
//           [0, R) with every probability in the low half of a 32-bit cell (the even column
//           of each pair), rows [R, 2 R) in the high half (the odd column), the other half
//           zero. The accumulators hold even and odd columns apart, [2 R][D / 2] per group,
//           and are interleaved back into rows once, at the end of the item.
//     pairs (16-row groups): the chunk's value rows of the head interleaved in pairs of
//           tokens (the B layout) in one pass in address order, 32 tokens per product.
//   The parity form costs no copy of the values; its products serve 16 keys instead of 32,
//   which groups of 8 rows or fewer leave room for in the A tile's 16 rows.
// The accumulators, running max and sum stay fp32; probabilities are rounded to bf16 for the
// value products only (their sum is taken in fp32).
#pragma once

#include "amx_common.h"
#include "paged_attention_rows.h"

#if defined(OPMUX_AMX)
#define OPMUX_PA_AMX 1

#include <cstdint>
#include <limits>
#include <vector>

namespace opmux_cpu {
namespace {
namespace pa_amx {

using amx::TileConfig;
using amx::tiles_granted;

constexpr int64_t kLanes = 16;
// most keys per chunk (across blocks where every 16-key step lies inside one block): fewer
// accumulator loads, stores and rescales than one 128-key block; longer chunks gain nothing
// more (benchmarks/paged_attention_cpu.py).
constexpr int64_t kChunk = 256;
constexpr int64_t kItemRows = 128;  // most rows of an item (the row-tile path's 4 x 32)

// The AMX path's switch: paged_attention_amx(mode) in paged_attention.cpp.
inline amx::PathSwitch& path() {
  static amx::PathSwitch s;
  return s;
}

// Tiles: 1 packed query rows (B, 16 pairs x R), 2 scores (C, 16 x R), 3 probabilities (A,
// R or 2 R rows of 32 bf16), 4 keys (A, 16 x 32 bf16), then value rows or pairs (B, 16 x 32
// bf16); 5, 6, 7 and 0 accumulators (C, R or 2 R rows of 16 fp32).
inline void configure(int64_t R, bool parity) {
  const int64_t pr = parity ? 2 * R : R;  // rows of the probability and accumulator tiles
  TileConfig c;
  c.set(0, pr, 64);
  c.set(1, 16, R * 4);
  c.set(2, 16, R * 4);
  c.set(3, pr, 64);
  c.set(4, 16, 64);
  for (int t = 5; t < 8; ++t) c.set(t, pr, 64);
  c.load();
}

// The value products accumulate in k (1 to 4) tiles of 16 fp32 columns: 5, 6, 7 and 0 (the
// last free once the scores are done) hold columns [16 j, 16 j + 16) of a0 for j < k.
inline void load_acc(const float* a0, int64_t stride, int64_t k) {
  _tile_loadd(5, a0, stride);
  if (k > 1) _tile_loadd(6, a0 + 16, stride);
  if (k > 2) _tile_loadd(7, a0 + 32, stride);
  if (k > 3) _tile_loadd(0, a0 + 48, stride);
}
inline void store_acc(float* a0, int64_t stride, int64_t k) {
  _tile_stored(5, a0, stride);
  if (k > 1) _tile_stored(6, a0 + 16, stride);
  if (k > 2) _tile_stored(7, a0 + 32, stride);
  if (k > 3) _tile_stored(0, a0 + 48, stride);
}
// accumulator j += tile 3 (A) . the B tile of 16 rows at b + 32 j bf16 (rows `stride` bytes apart)
inline void acc_products(const uint16_t* b, int64_t stride, int64_t k) {
  _tile_loadd(4, b, stride);
  _tile_dpbf16ps(5, 3, 4);
  if (k > 1) {
    _tile_loadd(4, b + 32, stride);
    _tile_dpbf16ps(6, 3, 4);
  }
  if (k > 2) {
    _tile_loadd(4, b + 64, stride);
    _tile_dpbf16ps(7, 3, 4);
  }
  if (k > 3) {
    _tile_loadd(4, b + 96, stride);
    _tile_dpbf16ps(0, 3, 4);
  }
}

// The scratch buffers live in one allocation, each starting on a different 64-byte line of a
// 4 KiB page: as separate vectors the large ones would each be page-aligned (and 16 bytes on),
// so their rows would meet in the same L1 sets (benchmarks/paged_attention_cpu.py).
struct AmxScratch {
  int64_t D;
  uint32_t* qT;    // per group and 32-wide slice of D: [16 pairs][R] 32-bit cells
  // [keys]: kChunk
  float* sT;       // per lane tile: [keys][16 lanes]
  uint16_t* p;     // [rows][keys] bf16 probabilities
  uint32_t* pp;    // parity form: per group [2 R][keys] probability cells
  uint16_t* vpack; // per kv head: [keys / 2][2 D] value rows in pairs
  uint16_t* kpad;  // [16][D] the key or value rows of a short group, zero-padded
  float* acc;      // [rows][D]; parity form: per group [2 R][D / 2]
  float* acc2;     // parity form: the accumulators back in [rows][D]
  alignas(64) float m[kItemRows];
  alignas(64) float l[kItemRows];
  alignas(64) int32_t lo[kItemRows];   // first visible key of each row
  alignas(64) int32_t pos[kItemRows];  // last visible key of each row

  explicit AmxScratch(int64_t d) : D(d) {
    const size_t n = static_cast<size_t>(d);
    const size_t bytes[8] = {kItemRows * n / 2 * 4,        kItemRows * kChunk * 4,
                             kItemRows * kChunk * 2,       2 * kItemRows * kChunk * 4,
                             kMaxRows / 4 * kChunk * n * 2, 16 * n * 2,
                             kItemRows * n * 4,            kItemRows * n * 4};
    size_t at[8];
    size_t end = 0;
    for (int i = 0; i < 8; ++i) {
      at[i] = (end + 4095) / 4096 * 4096 + 64 * ((5 * i) % 64);
      end = at[i] + bytes[i];
    }
    store_.assign(end + 64, 0);
    char* base = store_.data() + (64 - reinterpret_cast<uintptr_t>(store_.data()) % 64) % 64;
    qT = reinterpret_cast<uint32_t*>(base + at[0]);
    sT = reinterpret_cast<float*>(base + at[1]);
    p = reinterpret_cast<uint16_t*>(base + at[2]);
    pp = reinterpret_cast<uint32_t*>(base + at[3]);
    vpack = reinterpret_cast<uint16_t*>(base + at[4]);
    kpad = reinterpret_cast<uint16_t*>(base + at[5]);
    acc = reinterpret_cast<float*>(base + at[6]);
    acc2 = reinterpret_cast<float*>(base + at[7]);
  }
  AmxScratch(const AmxScratch&) = delete;
  AmxScratch& operator=(const AmxScratch&) = delete;

 private:
  std::vector<char> store_;
};

// true when run_amx_item takes the item (T = bf16, D % 32 == 0 checked by the caller)
inline bool takes(const WorkItem& w, int64_t G) {
  const int64_t nkh = w.kv_end - w.kv_begin;
  const int64_t rows = static_cast<int64_t>(w.q_end - w.q_begin) * nkh * G;
  if (rows > kItemRows) return false;
  // one kv head: prefill positions x G rows, or a decode group; several: decode rows only, 1,
  // 2, 4, 8 or 16 per head (each head's group inside one lane tile). Groups of 8 rows at most
  // take the parity form of the value products, which reads the value rows from the cache
  // as they are: GQA 1/2 decodes, where the interleaving form is slower than the vector path
  // and the parity form faster (benchmarks/paged_attention_cpu.py).
  if (nkh == 1) return true;
  return w.q_end - w.q_begin == 1 && kLanes % G == 0;
}

inline void run_amx_item(const WorkItem& w, const Params& p, const at::BFloat16* query,
                         const at::BFloat16* kc, const at::BFloat16* vc, at::BFloat16* out,
                         AmxScratch& s) {
  const ItemGeom ig(w, p);
  const int64_t G = ig.G, D = ig.D;
  const int64_t nkh = w.kv_end - w.kv_begin;
  const int64_t per_pos = nkh * G;
  const int64_t rows = (w.q_end - w.q_begin) * per_pos;
  const bool one_head = nkh == 1;
  // rows per group: a decode item's G, or one kv head's rows rounded up to 1, 2, 4 or 8, or 16
  int64_t R = one_head ? kLanes : G;
  if (one_head && rows <= 8) {
    R = 1;
    while (R < rows) R *= 2;
  }
  const bool parity = R <= 8;  // the parity form of the value products (top of this file)
  const int64_t n_groups = one_head ? (rows + R - 1) / R : nkh;
  const int64_t n_tiles = (rows + kLanes - 1) / kLanes;
  const int64_t lane_rows = n_tiles * kLanes;
  const int64_t S32 = D / 32;
  const int64_t words = D / 2;  // 32-bit cells of a row

  // rows: visible key range, state, and the packed query rows of each group
  for (int64_t r = 0; r < lane_rows; ++r) {
    s.m[r] = -std::numeric_limits<float>::infinity();
    s.l[r] = 0.f;
    if (r < rows) {
      const int64_t j = w.q_begin + r / per_pos;
      const int64_t at_pos = ig.kv_len - ig.q_len + j;
      s.pos[r] = static_cast<int32_t>(at_pos);
      s.lo[r] = static_cast<int32_t>(
          p.window > 0 ? std::max<int64_t>(0, at_pos - p.window + 1) : 0);
    } else {  // padding lanes see no key
      s.pos[r] = -1;
      s.lo[r] = std::numeric_limits<int32_t>::max();
    }
  }
  std::fill_n(s.acc, lane_rows * D, 0.f);
  auto q_words = [&](int64_t r) {  // row r of the query as 32-bit cells (pairs of bf16)
    const int64_t j = w.q_begin + r / per_pos;
    const int64_t h = w.kv_begin * G + r % per_pos;
    return reinterpret_cast<const uint32_t*>(query + (ig.q0 + j) * p.q_stride0 + h * p.q_stride1);
  };
  for (int64_t gi = 0; gi < n_groups; ++gi) {
    const int64_t r0 = gi * R;
    uint32_t* dst = s.qT + gi * S32 * 16 * R;
    if (R == kLanes) {  // 16 x 16 blocks of cells, transposed in registers
      for (int64_t b = 0; b < words; b += 16) {
        __m512 v[16];
        for (int64_t c = 0; c < 16; ++c) {
          v[c] = r0 + c < rows ? _mm512_castsi512_ps(_mm512_loadu_si512(q_words(r0 + c) + b))
                               : _mm512_setzero_ps();
        }
        transpose16(v);
        for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(dst + (b + i) * 16, v[i]);
      }
      continue;
    }
    for (int64_t c = 0; c < R; ++c) {
      const int64_t r = r0 + c;
      if (r >= rows) {
        for (int64_t i = 0; i < words; ++i) dst[i * R + c] = 0;
        continue;
      }
      const uint32_t* q = q_words(r);
      // cell (slice s, pair i, column c) at ((s * 16 + i) * R + c) = (word * R + c)
      for (int64_t i = 0; i < words; ++i) dst[i * R + c] = q[i];
    }
  }

  int64_t lo = s.lo[0];
  int64_t hi = s.pos[rows - 1];
  if (w.part >= 0) {  // split-KV: this item's share of the keys
    lo = std::max<int64_t>(lo, w.t_begin);
    hi = std::min<int64_t>(hi, w.t_end - 1);
  }
  const __m512 scale = _mm512_set1_ps(p.scale);
  const bool capped = p.soft_cap > 0.f;
  const bool plain = !capped && p.scale > 0.f;  // raw scores order as the scaled ones do
  const __m512 cap = _mm512_set1_ps(p.soft_cap);
  const __m512 inv_cap = _mm512_set1_ps(capped ? 1.f / p.soft_cap : 0.f);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t kstride = ig.tok_stride * 2;  // bytes from one token's key row to the next
  // permutation indices interleaving two rows of 32 bf16: pairs (a[i], b[i]) for i < 16 / >= 16
  alignas(64) int16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = static_cast<int16_t>(i);
    lo_idx[2 * i + 1] = static_cast<int16_t>(32 + i);
    hi_idx[2 * i] = static_cast<int16_t>(16 + i);
    hi_idx[2 * i + 1] = static_cast<int16_t>(48 + i);
  }
  const __m512i ilo = _mm512_load_si512(lo_idx);
  const __m512i ihi = _mm512_load_si512(hi_idx);

  configure(R, parity);
  // A chunk may span blocks when each of its 16-key steps lies inside one block (block size
  // and first key multiples of 16); otherwise it ends with its block, which aligns the next.
  const bool spans = p.block_size % 16 == 0;
  auto chunk_end = [&](int64_t t) {
    const int64_t end = std::min(hi + 1, t + kChunk);
    return spans && t % 16 == 0 ? end : std::min(end, (t / p.block_size + 1) * p.block_size);
  };
  int64_t step_at[kChunk / 16];  // elements from a cache's start to each step's first key
  for (int64_t t0 = lo; t0 <= hi;) {
    const int64_t t1 = chunk_end(t0);
    const int64_t n = t1 - t0;
    const int64_t n32 = (n + 31) / 32 * 32;
    for (int64_t tg = 0; tg < n; tg += 16) {
      step_at[tg / 16] = ig.token_offset(p, t0 + tg) + static_cast<int64_t>(w.kv_begin) * D;
    }
    // elements from a cache's start to key t0 + i of the chunk (kv head kv_begin)
    auto row_at = [&](int64_t i) { return step_at[i / 16] + (i % 16) * ig.tok_stride; };
    // scores, 16 tokens at a time with the groups inner (the cache read in address order)
    for (int64_t tg = 0; tg < n; tg += 16) {
      const int64_t m = std::min<int64_t>(16, n - tg);
      int64_t padded_head = -1;  // the head whose short group kpad holds (one per head)
      for (int64_t gi = 0; gi < n_groups; ++gi) {
        const int64_t kh = one_head ? 0 : gi;
        const at::BFloat16* krows = kc + step_at[tg / 16] + kh * D;
        int64_t stride = kstride;
        if (m < 16) {  // rows past the chunk may lie outside the cache: a padded copy
          auto* pad = reinterpret_cast<at::BFloat16*>(s.kpad);
          for (int64_t i = 0; kh != padded_head && i < 16; ++i) {
            if (i < m) {
              std::memcpy(pad + i * D, krows + i * ig.tok_stride, D * 2);
            } else {
              std::memset(pad + i * D, 0, D * 2);
            }
          }
          padded_head = kh;
          krows = pad;
          stride = D * 2;
        }
        const uint32_t* qg = s.qT + gi * S32 * 16 * R;
        _tile_zero(2);
        for (int64_t sl = 0; sl < S32; ++sl) {
          _tile_loadd(4, krows + sl * 32, stride);
          _tile_loadd(1, qg + sl * 16 * R, R * 4);
          _tile_dpbf16ps(2, 4, 1);
        }
        const int64_t r0 = gi * R;
        _tile_stored(2, s.sT + ((r0 / kLanes) * kChunk + tg) * kLanes + r0 % kLanes,
                     kLanes * 4);
      }
    }
    // softmax across the lanes of each tile; probabilities to bf16 rows
    for (int64_t lt = 0; lt < n_tiles; ++lt) {
      float* st = s.sT + lt * kChunk * kLanes;
      const __m512i lo_v = _mm512_load_si512(s.lo + lt * kLanes);
      const __m512i pos_v = _mm512_load_si512(s.pos + lt * kLanes);
      __m512 mx = neg_inf;
      // every real lane of the tile sees every key of the chunk, no cap: the raw scores stay
      // as they are, their max is scaled once and the exp loop scales each score in its FMA.
      // Rows go by query position, so the tile's first row has the earliest last key and its
      // last real row the latest first key.
      const int64_t last = std::min(rows, (lt + 1) * kLanes) - 1;
      const bool raw = plain && t0 >= s.lo[last] && t1 - 1 <= s.pos[lt * kLanes];
      if (raw) {
        for (int64_t t = 0; t < n; ++t) mx = _mm512_max_ps(mx, _mm512_loadu_ps(st + t * kLanes));
        mx = _mm512_mul_ps(mx, scale);
      }
      for (int64_t t = 0; !raw && t < n; ++t) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(st + t * kLanes), scale);
        if (capped) v = _mm512_mul_ps(cap, fast_tanh(_mm512_mul_ps(v, inv_cap)));
        const __m512i tt = _mm512_set1_epi32(static_cast<int32_t>(t0 + t));
        const __mmask16 vis =
            _mm512_cmpge_epi32_mask(tt, lo_v) & _mm512_cmple_epi32_mask(tt, pos_v);
        const __m512 x = _mm512_mask_mov_ps(neg_inf, vis, v);
        _mm512_storeu_ps(st + t * kLanes, x);
        mx = _mm512_max_ps(mx, x);
      }
      for (int64_t t = n; t < n32; ++t) _mm512_storeu_ps(st + t * kLanes, neg_inf);
      const __m512 m_old = _mm512_load_ps(s.m + lt * kLanes);
      const __m512 m_new = _mm512_max_ps(m_old, mx);
      // lanes that have seen no key yet subtract 0 (their scores are -inf: probabilities 0)
      const __m512 m_sub =
          _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ),
                             _mm512_setzero_ps());
      const __m512 alpha = exp512(_mm512_sub_ps(m_old, m_sub));
      __m512 sum = _mm512_setzero_ps();
      uint16_t* prow = s.p + lt * kLanes * kChunk;
      for (int64_t tg = 0; tg < n32; tg += 16) {
        __m512 e[16];
#pragma GCC unroll 16
        for (int64_t i = 0; i < 16; ++i) {
          const __m512 sc = _mm512_loadu_ps(st + (tg + i) * kLanes);
          e[i] = exp512(raw ? _mm512_fmsub_ps(sc, scale, m_sub) : _mm512_sub_ps(sc, m_sub));
          sum = _mm512_add_ps(sum, e[i]);
        }
        transpose16(e);
        if (parity) {
          for (int64_t r = 0; r < kLanes; ++r) {
            const int64_t gr = lt * kLanes + r;
            uint32_t* pe = s.pp + ((gr / R) * 2 * R + gr % R) * kChunk + tg;
            const __m512i lo16 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e[r]));
            _mm512_storeu_si512(pe, lo16);
            _mm512_storeu_si512(pe + R * kChunk, _mm512_slli_epi32(lo16, 16));
          }
          continue;
        }
        for (int64_t r = 0; r < kLanes; ++r) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + r * kChunk + tg),
                              (__m256i)_mm512_cvtneps_pbh(e[r]));
        }
      }
      _mm512_store_ps(s.l + lt * kLanes,
                      _mm512_fmadd_ps(_mm512_load_ps(s.l + lt * kLanes), alpha, sum));
      _mm512_store_ps(s.m + lt * kLanes, m_new);
      const __mmask16 rescale = _mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ);
      if (rescale) {
        alignas(64) float al[kLanes];
        _mm512_store_ps(al, alpha);
        for (int64_t i = 0; i < kLanes; ++i) {
          if (!((rescale >> i) & 1)) continue;
          const __m512 a = _mm512_set1_ps(al[i]);
          const int64_t gr = lt * kLanes + i;
          if (parity) {
            float* ae = s.acc + (gr / R) * R * D + (gr % R) * (D / 2);
            float* ao = ae + R * (D / 2);
            for (int64_t c = 0; c < D / 2; c += 16) {
              _mm512_storeu_ps(ae + c, _mm512_mul_ps(_mm512_loadu_ps(ae + c), a));
              _mm512_storeu_ps(ao + c, _mm512_mul_ps(_mm512_loadu_ps(ao + c), a));
            }
            continue;
          }
          float* ar = s.acc + gr * D;
          for (int64_t c = 0; c < D; c += 16) {
            _mm512_storeu_ps(ar + c, _mm512_mul_ps(_mm512_loadu_ps(ar + c), a));
          }
        }
      }
    }
    if (parity) {
      // values: per group, 16 tokens x 32 columns of the head's value rows as the B tile,
      // straight from the cache (a zero-padded copy for the chunk's last short step)
      const int64_t half = D / 2;
      for (int64_t gi = 0; gi < n_groups; ++gi) {
        const int64_t kh = one_head ? 0 : gi;
        const auto* vhead_c = reinterpret_cast<const uint16_t*>(vc + kh * D);
        const uint32_t* pg = s.pp + gi * 2 * R * kChunk;
        float* ag = s.acc + gi * R * D;
        const int64_t full = n / 16 * 16;
        if (full < n) {
          uint16_t* pad = s.kpad;
          for (int64_t i = 0; i < 16; ++i) {
            if (full + i < n) {
              std::memcpy(pad + i * D, vhead_c + row_at(full + i), D * 2);
            } else {
              std::memset(pad + i * D, 0, D * 2);
            }
          }
        }
        for (int64_t ds = 0; ds < D / 32; ds += 4) {
          const int64_t k = std::min<int64_t>(4, D / 32 - ds);
          load_acc(ag + ds * 16, half * 4, k);
          for (int64_t tg = 0; tg < n; tg += 16) {
            _tile_loadd(3, pg + tg, kChunk * 4);
            if (tg == full) {
              acc_products(s.kpad + ds * 32, D * 2, k);
            } else {
              acc_products(vhead_c + step_at[tg / 16] + ds * 32, kstride, k);
            }
          }
          store_acc(ag + ds * 16, half * 4, k);
        }
      }
      t0 = t1;
      continue;
    }
    // values: every head's rows of the chunk interleaved in token pairs, in address order
    const int64_t vhead = (kChunk / 2) * 2 * D;  // elements of one head's packed chunk
    for (int64_t i = 0; i < n32 / 2; ++i) {
      const int64_t ta = 2 * i;
      const int64_t tb = 2 * i + 1;
      const at::BFloat16* va = ta < n ? vc + row_at(ta) : nullptr;
      const at::BFloat16* vb = tb < n ? vc + row_at(tb) : nullptr;
      for (int64_t kh = 0; kh < nkh; ++kh) {
        uint16_t* dst = s.vpack + kh * vhead + i * 2 * D;
        for (int64_t c = 0; c < D; c += 32) {
          const __m512i a = ta < n ? _mm512_loadu_si512(va + kh * D + c) : _mm512_setzero_si512();
          const __m512i b = tb < n ? _mm512_loadu_si512(vb + kh * D + c) : _mm512_setzero_si512();
          _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(a, ilo, b));
          _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(a, ihi, b));
        }
      }
    }
    for (int64_t gi = 0; gi < n_groups; ++gi) {
      const int64_t kh = one_head ? 0 : gi;
      const uint16_t* vhead_p = s.vpack + kh * vhead;
      const int64_t r0 = gi * R;
      const uint16_t* pg = s.p + r0 * kChunk;
      float* ag = s.acc + r0 * D;
      for (int64_t ds = 0; ds < D / 16; ds += 4) {
        const int64_t k = std::min<int64_t>(4, D / 16 - ds);
        load_acc(ag + ds * 16, D * 4, k);
        for (int64_t sub = 0; sub < n32; sub += 32) {
          _tile_loadd(3, pg + sub, kChunk * 2);
          acc_products(vhead_p + (sub / 2) * 2 * D + ds * 32, D * 4, k);
        }
        store_acc(ag + ds * 16, D * 4, k);
      }
    }
    t0 = t1;
  }
  _tile_release();
  if (!parity) {
    finish_rows(w, p, ig, rows, s.acc, D, s.m, s.l, out);
    return;
  }
  // parity form back to rows: column 2j + b of a row is cell j of its half b
  alignas(64) int32_t lo_cols[16], hi_cols[16];
  for (int i = 0; i < 8; ++i) {
    lo_cols[2 * i] = i;
    lo_cols[2 * i + 1] = 16 + i;
    hi_cols[2 * i] = 8 + i;
    hi_cols[2 * i + 1] = 24 + i;
  }
  const __m512i clo = _mm512_load_si512(lo_cols);
  const __m512i chi = _mm512_load_si512(hi_cols);
  const int64_t half = D / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* ae = s.acc + (r / R) * R * D + (r % R) * half;
    const float* ao = ae + R * half;
    float* dst = s.acc2 + r * D;
    for (int64_t c = 0; c < half; c += 16) {
      const __m512 e = _mm512_loadu_ps(ae + c);
      const __m512 o = _mm512_loadu_ps(ao + c);
      _mm512_storeu_ps(dst + 2 * c, _mm512_permutex2var_ps(e, clo, o));
      _mm512_storeu_ps(dst + 2 * c + 16, _mm512_permutex2var_ps(e, chi, o));
    }
  }
  // (a value cell that is inf or NaN reaches its pair's other column too, 0 x inf in the cell
  // that holds the other half's zero: such rows come out non-finite, and paged_attention_out
  // computes them again the way native does)
  finish_rows(w, p, ig, rows, s.acc2, D, s.m, s.l, out);
}

}  // namespace pa_amx
}  // namespace
}  // namespace opmux_cpu

#endif

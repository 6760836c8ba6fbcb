// paged_attention: ragged prefill + decode attention over a paged KV cache.
//
// Work is split into items (sequence, range of kv heads, chunk of query rows). Each item keeps
// the query rows of every query head that shares its kv heads (GQA reuse) in fp32 scratch,
// walks the visible keys chunk by chunk straight out of the cache through the block table (no
// gather of the cache), and runs an online softmax: per chunk, scores for all rows, a running
// max and sum per row, and the value accumulation. Decode items take many kv heads at once so
// that each token's [Hkv, D] row is read as one contiguous stream; prefill items take one kv
// head and several query positions so that each key is reused by as many rows as possible.
// Items are handed to threads dynamically because ragged batches make them uneven. Within a
// chunk, tokens go in groups of 16 with the item's kv heads inner, so the cache is read in
// address order. Scores use a 16-token transpose-reduce (AVX-512); the query rows that share a
// kv head (GQA group, prefill positions) go four at a time against four keys, so each key
// vector load feeds four rows, and the value accumulation takes up to eight rows per value
// load. (No software prefetch on this path: its token rows are contiguous, which the hardware
// prefetcher follows; benchmarks/paged_attention_cpu.py.) Value rows with a
// head size that is a multiple of the vector width are widened in registers, others go
// through a zero-padded fp32 copy; bf16 scores use AVX512-BF16 pair dot products when the build has them. Items with one
// kv head and more than 8 rows (prefill) take the row-tile path of paged_attention_tile.h, in
// sub-tiles of up to 32 rows that share each chunk of keys. Decode with 4 or 8 query heads
// per kv head (fp32 with a head size that is a multiple of 16, bf16 with pairs) puts the
// group's rows in vector lanes for the scores (qk_group). With AVX2 (16 registers of 8 lanes)
// scores take up to three query rows against four keys per tile (qk_tile_r4: 12 accumulators,
// one 8-vector transpose-reduce per two rows) and the value step four rows by three vectors;
// with 8 query heads per kv head the group's rows go in the 8 lanes for the scores instead
// (qk_rows8: one key element broadcast per FMA of the whole group, no reductions), with 4 in
// pairs of lanes (qk_rows4: two key elements broadcast, one pairwise add per key); their bf16
// keys are widened 16 tokens at a time in address order, all of the item's heads together.
// On CPUs with AMX tiles, bf16 items with a head size that is a multiple of 32 (decode groups
// of 1, 2, 4, 8 or 16 rows per kv head, items of one kv head) take the tile path of
// paged_attention_amx.h instead.
#include "kernels.h"
#include "op_library.h"
#include "paged_attention_amx.h"
#include "paged_attention_item.h"
#include "paged_attention_rows.h"
#include "paged_attention_tile.h"
#include "vec_common.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace opmux_cpu {
namespace {

// Combines the split-KV partials of one (sequence, kv head range): per row, the partial
// accumulators rescaled to the largest running max, divided by the rescaled sum.
template <typename T>
void merge_group(const SplitGroup& g, const Params& p, T* out) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t D = p.head_size;
  const int64_t rows = (g.kv_end - g.kv_begin) * G;
  const Partials& pt = p.partials;
  const int64_t q0 = p.query_start_loc[g.seq];
  for (int64_t r = 0; r < rows; ++r) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < g.n_parts; ++i) mx = std::max(mx, pt.m[(g.part0 + i) * pt.rows + r]);
    float w[kMaxSplits];
    float sum = 0.f;
    for (int64_t i = 0; i < g.n_parts; ++i) {
      const int64_t slot = (g.part0 + i) * pt.rows + r;
      w[i] = pt.l[slot] > 0.f ? std::exp(pt.m[slot] - mx) : 0.f;
      sum += w[i] * pt.l[slot];
    }
    const float inv = 1.f / sum;
    T* orow = out + (q0 * p.num_heads + g.kv_begin * G + r) * D;
    for_each_vec(D, [&](int64_t c, int64_t cnt) {
      fVec a(0.f);
      for (int64_t i = 0; i < g.n_parts; ++i) {
        const float* src = pt.acc + ((g.part0 + i) * pt.rows + r) * D + c;
        a = at::vec::fmadd(fVec(w[i] * inv), fVec::loadu(src, cnt), a);
      }
      store_n(orow + c, a, cnt);
    });
  }
}

// Whether n values hold an inf or NaN (all exponent bits set), read as integers: a max
// reduction the compiler vectorises, since the check runs over every output row of a call.
template <typename T>
bool nonfinite_row(const T* row, int64_t n) {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;
  constexpr Bits kExp = sizeof(T) == 4                       ? Bits(0x7F800000u)
                        : std::is_same_v<T, at::BFloat16> ? Bits(0x7F80u)
                                                            : Bits(0x7C00u);
  const Bits* w = reinterpret_cast<const Bits*>(row);
  Bits most = 0;  // the largest exponent field: kExp exactly when one is all ones
  for (int64_t i = 0; i < n; ++i) most = std::max<Bits>(most, w[i] & kExp);
  return most == kExp;
}

// Whether a finished item's (not split-KV) or a merged group's output rows hold inf or NaN.
template <typename T>
bool item_nonfinite(const WorkItem& w, const Params& p, const T* out) {
  const int64_t G = p.num_heads / p.num_kv_heads, D = p.head_size;
  const int64_t per_pos = (w.kv_end - w.kv_begin) * G;
  const int64_t q0 = p.query_start_loc[w.seq];
  for (int64_t j = w.q_begin; j < w.q_end; ++j) {
    const T* rows = out + ((q0 + j) * p.num_heads + w.kv_begin * G) * D;
    if (nonfinite_row(rows, per_pos * D)) return true;
  }
  return false;
}
template <typename T>
bool group_nonfinite(const SplitGroup& g, const Params& p, const T* out) {
  const int64_t G = p.num_heads / p.num_kv_heads, D = p.head_size;
  const int64_t q0 = p.query_start_loc[g.seq];
  return nonfinite_row(out + (q0 * p.num_heads + g.kv_begin * G) * D,
                       (g.kv_end - g.kv_begin) * G * D);
}

// The item kernels give every row of an item the same keys, with zero probabilities for the
// keys a row does not see; an inf or NaN value cell at such a key reaches the row anyway
// (0 x inf) when another row of the item sees it. Native's rows take the keys they see only,
// so a row that comes out non-finite is computed again here, in fp32 over exactly its keys,
// the way native computes it (only caches with non-finite cells get here).
template <typename T>
void redo_nonfinite_rows(const Params& p, int64_t S, const T* query, const T* kc, const T* vc,
                         T* out) {
  const int64_t H = p.num_heads, D = p.head_size, G = H / p.num_kv_heads;
  std::vector<float> e;
  std::vector<float> acc;
  for (int64_t i = 0; i < S; ++i) {
    WorkItem w{};
    w.seq = static_cast<int32_t>(i);
    const ItemGeom ig(w, p);
    for (int64_t j = 0; j < ig.q_len; ++j) {
      for (int64_t h = 0; h < H; ++h) {
        T* orow = out + ((ig.q0 + j) * H + h) * D;
        if (!nonfinite_row(orow, D)) continue;
        const int64_t pos = ig.kv_len - ig.q_len + j;
        const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
        const T* q = query + (ig.q0 + j) * p.q_stride0 + h * p.q_stride1;
        const int64_t kv = (h / G) * ig.hs;
        e.assign(static_cast<size_t>(pos - lo + 1), 0.f);
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = lo; t <= pos; ++t) {
          const T* k = kc + ig.token_offset(p, t) + kv;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) {
            dot += static_cast<float>(q[d]) * static_cast<float>(k[d]);
          }
          dot *= p.scale;
          if (p.soft_cap > 0.f) dot = p.soft_cap * std::tanh(dot / p.soft_cap);
          e[t - lo] = dot;
          if (std::isnan(dot) || dot > mx) mx = dot;  // a NaN stays (dot > NaN is false)
        }
        float l = 0.f;
        for (float& x : e) l += (x = std::exp(x - mx));
        acc.assign(static_cast<size_t>(D), 0.f);
        for (int64_t t = lo; t <= pos; ++t) {
          const T* v = vc + ig.token_offset(p, t) + kv;
          for (int64_t d = 0; d < D; ++d) acc[d] += e[t - lo] * static_cast<float>(v[d]);
        }
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[d] / l);
      }
    }
  }
}

}  // namespace

void paged_attention_out(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                         double scale, int64_t sliding_window, double soft_cap) {
#define PA_CHECK(cond, ...) OPMUX_CHECK("paged_attention", cond, __VA_ARGS__)
  PA_CHECK(query.dim() == 3 && query.stride(2) == 1,
           "query must be [T, H, D] with a contiguous head dim, got ", query.sizes(), " strides ",
           query.strides());
  // Blocks may lie any distance apart (a block stride, e.g. keys and values of one block
  // next to each other); inside a block the rows are dense: [bs, Hkv, D] (NHD, canonical)
  // or [Hkv, bs, D] (HND, the 'hnd' format read through its permuted view).
  const bool dense_nhd = key_cache.dim() == 4 && key_cache.stride(2) == key_cache.size(3) &&
                         key_cache.stride(1) == key_cache.size(2) * key_cache.size(3);
  const bool dense_hnd = key_cache.dim() == 4 && key_cache.stride(1) == key_cache.size(3) &&
                         key_cache.stride(2) == key_cache.size(1) * key_cache.size(3);
  PA_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
               value_cache.strides() == key_cache.strides() && key_cache.stride(3) == 1 &&
               (dense_nhd || dense_hnd),
           "key_cache and value_cache must be [B, bs, Hkv, D] with dense NHD or HND blocks "
           "and equal strides, got ", key_cache.sizes(), " strides ", key_cache.strides(),
           " and ", value_cache.sizes(), " strides ", value_cache.strides());
  const auto dtype = query.scalar_type();
  PA_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
           "query, key_cache and value_cache must share a dtype, got ", dtype, ", ",
           key_cache.scalar_type(), ", ", value_cache.scalar_type());
  const int64_t T = query.size(0);
  const int64_t H = query.size(1);
  const int64_t D = query.size(2);
  const int64_t B = key_cache.size(0);
  const int64_t bs = key_cache.size(1);
  const int64_t Hkv = key_cache.size(2);
  PA_CHECK(key_cache.size(3) == D, "cache head size ", key_cache.size(3), " != query head size ",
           D);
  PA_CHECK(Hkv > 0 && H % Hkv == 0, "num_heads ", H, " must be a multiple of num_kv_heads ", Hkv);
  PA_CHECK(bs > 0, "block size must be positive");
  PA_CHECK(out.is_contiguous() && out.sizes() == query.sizes() && out.scalar_type() == dtype,
           "out must be contiguous ", query.sizes(), " ", dtype);
  for (const auto* t : {&block_tables, &seq_lens, &query_start_loc}) {
    PA_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
             "block_tables, seq_lens and query_start_loc must be contiguous int32, got ",
             t->scalar_type());
  }
  PA_CHECK(block_tables.dim() == 2 && seq_lens.dim() == 1 && query_start_loc.dim() == 1,
           "block_tables must be 2-d, seq_lens and query_start_loc 1-d");
  const int64_t S = seq_lens.size(0);
  PA_CHECK(block_tables.size(0) == S && query_start_loc.size(0) == S + 1,
           "expected block_tables [", S, ", M] and query_start_loc [", S + 1, "], got ",
           block_tables.sizes(), " and ", query_start_loc.sizes());
  const int64_t M = block_tables.size(1);
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* bt = block_tables.const_data_ptr<int32_t>();
  // Value checks: the same conditions as the shared check_paged_attention, so that the
  // provider can skip reading these tensors in Python.
  PA_CHECK(S == 0 || (qsl[0] == 0 && qsl[S] <= T), "query_start_loc must run from 0 to at most ",
           T, ", got first ", S ? qsl[0] : 0, " last ", S ? qsl[S] : 0);
  for (int64_t i = 0; i < S; ++i) {
    const int64_t kv_len = lens[i];
    PA_CHECK(kv_len >= 0 && kv_len <= M * bs, "seq_lens[", i, "] = ", kv_len,
             " is outside [0, ", M * bs, "] (max_blocks*block_size)");
    for (int64_t b = 0; b < (kv_len + bs - 1) / bs; ++b) {
      PA_CHECK(bt[i * M + b] >= 0 && bt[i * M + b] < B, "block_tables[", i, ", ", b, "] = ",
               bt[i * M + b], " is outside [0, ", B, ")");
    }
  }
  const int64_t G = H / Hkv;
  PA_CHECK(G <= kMaxRows, "at most ", kMaxRows, " query heads per kv head, got ", G);
  // Decode rows (q_len 1) take as many kv heads as fit, fewer when that leaves too few items
  // for the threads; prefill rows take one kv head and up to kMaxRows / G query positions.
  int64_t n_decode = 0;
  for (int64_t i = 0; i < S; ++i) n_decode += (qsl[i + 1] - qsl[i] == 1);
  int64_t decode_heads = std::min<int64_t>(Hkv, kMaxRows / G);
  const int64_t want_items = 2 * static_cast<int64_t>(at::get_num_threads());
  // Split-KV: when the decode items at full head width are fewer than want_items, long
  // decode sequences are cut into key ranges (multiples of kTokenChunk, at least
  // kSplitTokens each) that run as separate items and are merged afterwards; the kv heads of
  // an item stay wide, so each token's [Hkv, D] row is still read as one stream. Short
  // sequences that cannot be split fall back to narrower head ranges.
  const int64_t decode_items_full = n_decode * ((Hkv + decode_heads - 1) / decode_heads);
  const int64_t split_want =
      decode_items_full > 0 && decode_items_full < want_items
          ? std::min(kMaxSplits, (want_items + decode_items_full - 1) / decode_items_full)
          : 1;
  auto visible_from = [&](int64_t kv_len, int64_t q_len) {
    return sliding_window > 0 ? std::max<int64_t>(0, kv_len - q_len - sliding_window + 1) : 0;
  };
  auto n_splits = [&](int64_t i) -> int64_t {
    const int64_t q_len = qsl[i + 1] - qsl[i];
    if (q_len != 1 || split_want <= 1) return 1;
    const int64_t vis = lens[i] - visible_from(lens[i], q_len);
    return std::max<int64_t>(1, std::min(split_want, vis / kSplitTokens));
  };
  int64_t decode_units = 0;  // decode items per head range, splits counted
  for (int64_t i = 0; i < S; ++i) {
    if (qsl[i + 1] - qsl[i] == 1 && lens[i] >= 1) decode_units += n_splits(i);
  }
  while (decode_heads > 1 && decode_units * ((Hkv + decode_heads - 1) / decode_heads) < want_items) {
    decode_heads = (decode_heads + 1) / 2;
  }
  // With one kv head the head stride is never used, so an HND cache is an NHD one.
  const int64_t head_stride = Hkv == 1 ? D : key_cache.stride(2);
  int64_t q_chunk = std::max<int64_t>(1, kMaxRows / G);
#if defined(CPU_CAPABILITY_AVX512)
  // Prefill items of more than 8 rows take the row-tile path, which runs up to kMaxSub
  // sub-tiles of kMaxRows rows over each chunk of keys (one read of the chunk for all of
  // them): as many positions per item as leave want_items items in all. The tile path
  // reads NHD blocks only; items of HND blocks keep at most kMaxRows rows (run_item).
  const int64_t other_items = decode_units * ((Hkv + decode_heads - 1) / decode_heads);
  for (int64_t sub = pa_tile::kMaxSub; sub > 1 && head_stride == D; sub /= 2) {
    const int64_t qc = std::max<int64_t>(1, sub * kMaxRows / G);
    int64_t n = other_items;
    for (int64_t i = 0; i < S; ++i) {
      const int64_t q_len = qsl[i + 1] - qsl[i];
      if (q_len > 1) n += Hkv * ((q_len + qc - 1) / qc);
    }
    if (n >= want_items) {
      q_chunk = qc;
      break;
    }
  }
#endif
  std::vector<WorkItem> items;
  std::vector<SplitGroup> groups;
  int64_t n_parts = 0;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t q_len = qsl[i + 1] - qsl[i];
    const int64_t kv_len = lens[i];
    PA_CHECK(q_len >= 0, "query_start_loc must be non-decreasing, got ", qsl[i], " then ",
             qsl[i + 1], " at sequence ", i);
    if (q_len == 0) continue;
    PA_CHECK(kv_len >= q_len, "sequence ", i, " has ", q_len, " query rows but seq_lens[", i,
             "] = ", kv_len, " (need seq_lens >= q_len)");
    const int64_t heads_per_item = q_len == 1 ? decode_heads : 1;
    const int64_t splits = n_splits(i);
    if (splits > 1) {
      const int64_t t_lo = visible_from(kv_len, q_len);
      const int64_t span = kv_len - t_lo;
      for (int64_t kh = 0; kh < Hkv; kh += heads_per_item) {
        groups.push_back({static_cast<int32_t>(i), static_cast<int32_t>(kh),
                          static_cast<int32_t>(std::min(Hkv, kh + heads_per_item)),
                          static_cast<int32_t>(n_parts), static_cast<int32_t>(splits)});
        for (int64_t sp = 0; sp < splits; ++sp) {
          // boundaries on multiples of kTokenChunk from t_lo; the last range takes the rest
          const int64_t b = t_lo + (span * sp / splits) / kTokenChunk * kTokenChunk;
          const int64_t e = sp + 1 == splits
                                ? kv_len
                                : t_lo + (span * (sp + 1) / splits) / kTokenChunk * kTokenChunk;
          items.push_back({static_cast<int32_t>(i), static_cast<int32_t>(kh),
                           static_cast<int32_t>(std::min(Hkv, kh + heads_per_item)), 0, 1,
                           static_cast<int32_t>(b), static_cast<int32_t>(e),
                           static_cast<int32_t>(n_parts++)});
        }
      }
      continue;
    }
    for (int64_t kh = 0; kh < Hkv; kh += heads_per_item) {
      for (int64_t j = 0; j < q_len; j += q_chunk) {
        items.push_back({static_cast<int32_t>(i), static_cast<int32_t>(kh),
                         static_cast<int32_t>(std::min(Hkv, kh + heads_per_item)),
                         static_cast<int32_t>(j), static_cast<int32_t>(std::min(q_len, j + q_chunk))});
      }
    }
  }
#undef PA_CHECK
  // Rows no sequence owns (before query_start_loc[0] or after query_start_loc[S]) are zero.
  if (S == 0) {
    out.zero_();
  } else {
    if (qsl[0] > 0) out.narrow(0, 0, qsl[0]).zero_();
    if (qsl[S] < T) out.narrow(0, qsl[S], T - qsl[S]).zero_();
  }
  if (items.empty()) return;
  // Longest sequences first so that the dynamic schedule ends evenly.
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) {
    return lens[a.seq] > lens[b.seq];
  });
  std::vector<float> part_buf(static_cast<size_t>(n_parts * kMaxRows * (D + 2)));
  const Partials partials{part_buf.data(), part_buf.data() + n_parts * kMaxRows * D,
                          part_buf.data() + n_parts * kMaxRows * (D + 1), kMaxRows};
  const Params params{H, Hkv, D, (D + kF - 1) / kF * kF, bs, M, query.stride(0), query.stride(1),
                      static_cast<float>(scale), static_cast<float>(soft_cap > 0 ? soft_cap : 0),
                      sliding_window, bt, lens, qsl, partials, key_cache.stride(0),
                      key_cache.stride(1), head_stride};
#if defined(OPMUX_PA_AMX)
  const bool use_amx = dtype == at::kBFloat16 && D % 32 == 0 && params.nhd() &&
                       pa_amx::path().on();
#endif
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t n_workers = std::min<int64_t>(at::get_num_threads(), n_items);
  std::atomic<int64_t> next{0};
  std::atomic<bool> any_nonfinite{false};  // an output row holds inf or NaN (see below)
  OPMUX_DISPATCH_FLOATS(dtype, "paged_attention", [&] {
    const scalar_t* q = query.const_data_ptr<scalar_t>();
    const scalar_t* kc = key_cache.const_data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n_workers, 1, [&](int64_t begin, int64_t end) {
      // one scratch per thread, kept between calls (no allocation on the hot path)
      thread_local std::unique_ptr<Scratch> cached;
      if (!cached || cached->zero.size() != static_cast<size_t>(params.padded)) {
        cached = std::make_unique<Scratch>(params.padded);
      }
      Scratch& scratch = *cached;
#if defined(CPU_CAPABILITY_AVX512)
      thread_local std::unique_ptr<pa_tile::TileScratch> tile_cached;
      if (!tile_cached || tile_cached->zero.size() != static_cast<size_t>(params.padded)) {
        tile_cached = std::make_unique<pa_tile::TileScratch>(params.padded);
      }
#endif
#if defined(OPMUX_PA_AMX)
      thread_local std::unique_ptr<pa_amx::AmxScratch> amx_cached;
      if (use_amx && (!amx_cached || amx_cached->D != D)) {
        amx_cached = std::make_unique<pa_amx::AmxScratch>(D);
      }
#endif
      for (int64_t wk = begin; wk < end; ++wk) {
        auto run = [&](const WorkItem& w) {
#if defined(OPMUX_PA_AMX)
          if (use_amx && pa_amx::takes(w, G)) {  // use_amx: bf16 only (the casts are no-ops)
            using bf16 = at::BFloat16;
            pa_amx::run_amx_item(w, params, reinterpret_cast<const bf16*>(q),
                                 reinterpret_cast<const bf16*>(kc),
                                 reinterpret_cast<const bf16*>(vc), reinterpret_cast<bf16*>(o),
                                 *amx_cached);
            return;
          }
#endif
#if defined(CPU_CAPABILITY_AVX512)
          // one kv head and more than 8 rows: rows in vector lanes (paged_attention_tile.h);
          // split-KV items (a GQA group over 8 decode rows) stay on run_item, which writes
          // the partials the merge reads
          const int64_t rows = static_cast<int64_t>(w.q_end - w.q_begin) * G;
          if (w.kv_end - w.kv_begin == 1 && rows > 8 && w.part < 0 && params.nhd()) {
            if (rows > 16) {
              pa_tile::run_tile_item<2>(w, params, q, kc, vc, o, *tile_cached);
            } else {
              pa_tile::run_tile_item<1>(w, params, q, kc, vc, o, *tile_cached);
            }
            return;
          }
#endif
          run_item<scalar_t>(w, params, q, kc, vc, o, scratch);
        };
        for (int64_t it = next.fetch_add(1); it < n_items; it = next.fetch_add(1)) {
          const WorkItem& w = items[it];
          run(w);
          // the item's rows, still in cache (split-KV items: after their merge)
          if (w.part < 0 && !any_nonfinite.load(std::memory_order_relaxed) &&
              item_nonfinite(w, params, o)) {
            any_nonfinite.store(true, std::memory_order_relaxed);
          }
        }
      }
    });
    if (!groups.empty()) {
      at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t b, int64_t e) {
        for (int64_t g = b; g < e; ++g) {
          merge_group(groups[g], params, o);
          if (group_nonfinite(groups[g], params, o)) {
            any_nonfinite.store(true, std::memory_order_relaxed);
          }
        }
      });
    }
    if (any_nonfinite.load()) redo_nonfinite_rows(params, S, q, kc, vc, o);
  });
}

// Whether bf16 paged attention takes the AMX path (paged_attention_amx.h): mode 1 allows it,
// 0 turns it off (tests of the other paths on an AMX machine), -1 only asks. Returns whether
// it is in use now: allowed, built for this CPU, and the tile state granted.
bool paged_attention_amx(int64_t mode) {
#if defined(OPMUX_PA_AMX)
  return pa_amx::path().set(mode);
#else
  (void)mode;
  return false;
#endif
}

// This file's ops in torch.ops.opmux_cpu (op_library.h).
TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def("paged_attention_amx(int mode) -> bool", &paged_attention_amx);
  // sliding_window <= 0 and soft_cap <= 0 mean "none".
  m.def(
      "paged_attention_out(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
      "int sliding_window, float soft_cap) -> ()",
      cpu_kernel(&paged_attention_out));
}

}  // namespace opmux_cpu

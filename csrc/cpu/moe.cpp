// fused_moe: SiLU-and-mul expert MLPs over tokens grouped by expert, weighted sum per token.
//
// The (token, slot) pairs are bucketed by expert (a counting sort, stable). Each expert's rows
// are stored in fp32 in two forms: whole vectors of kF rows go into token panels, laid out
// [k][kP] (kP = 2 * kF token lanes per element of the hidden row), and the expert's last
// rows % kF rows stay row-major ("leftover" rows), unless they fill most of a last panel,
// which then takes them with zero lanes (panel_rows). A tile of six weight rows then runs over
// both: against a panel, each weight element is broadcast and multiplied into two vectors of
// token lanes (6 x 2 accumulators, so each panel element feeds six FMAs and no horizontal sum
// is needed); against the leftover rows, the weight rows are dotted with up to kR rows at a
// time (with AVX-512 all rows are leftover rows: kPanels below). The tile's weight rows are read once per tile from memory, however many tokens the
// expert received (small batches are bandwidth-bound on the weights), and the next tile's rows
// are prefetched while the first panel runs. fp32 weight rows are read in place; bf16/fp16
// rows are widened to fp32 once per tile. The gate and up rows of the same intermediate units
// share a tile, so the SiLU-and-mul is applied on the results directly; the activations are
// written in the same panel / leftover layout, which the down projection reads. It writes one
// fp32 row per pair, and each token's weighted sum over its k rows is formed last, in fp32, in
// slot order.
//
// On CPUs with AMX tiles, bf16 calls whose hidden and intermediate widths are multiples of 32
// take the tile path instead (moe_amx below).
//
// Work is handed out dynamically (an atomic counter over (expert, block) tasks), so experts
// with uneven token counts still keep every thread busy. Python (plugins/cpu/cpp_moe.py) runs
// the shared native checks first; the checks here guard the memory accesses.
#include "amx_common.h"
#include "moe_tiles.h"
#include "op_library.h"
#include "vec_common.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace opmux_cpu {
namespace {

struct NoHook {
  void operator()() const {}
};

// Runs body(task) for task in [0, n) over the thread pool, handed out one at a time; each
// thread calls enter() before its first task and leave() after its last.
template <typename Body, typename Enter = NoHook, typename Leave = NoHook>
void for_tasks(int64_t n, const Body& body, const Enter& enter = {}, const Leave& leave = {}) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    enter();
    for (int64_t wk = begin; wk < end; ++wk) {
      for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) body(t);
    }
    leave();
  });
}

struct Plan {
  std::vector<int64_t> start;      // [E + 1] first sorted row of each expert
  std::vector<int64_t> panel0;     // [E + 1] first token panel of each expert
  std::vector<int64_t> left0;      // [E + 1] first leftover row of each expert
  std::vector<int64_t> row_of;     // [T * k] sorted row of each (token, slot) pair
  std::vector<int64_t> token_of;   // [T * k] token of each sorted row
  std::vector<int64_t> active;     // experts with rows
};

Plan make_plan(const int64_t* ids, int64_t pairs, int64_t top_k, int64_t experts) {
  Plan p;
  p.start.assign(experts + 1, 0);
  p.panel0.assign(experts + 1, 0);
  p.left0.assign(experts + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) ++p.start[ids[i] + 1];
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = p.start[e + 1];
    if (n) p.active.push_back(e);
    p.panel0[e + 1] = p.panel0[e] + (panel_rows(n) + kP - 1) / kP;
    p.left0[e + 1] = p.left0[e] + n - panel_rows(n);
    p.start[e + 1] += p.start[e];
  }
  std::vector<int64_t> fill(p.start.begin(), p.start.end() - 1);
  p.row_of.resize(pairs);
  p.token_of.resize(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t row = fill[ids[i]]++;
    p.row_of[i] = row;
    p.token_of[row] = i / top_k;
  }
  return p;
}

// out[t] = sum over slots s of topk_w[t, s] * y[row_of[t, s]], in fp32, in slot order.
template <typename T>
void weighted_sum(T* out, const float* y, const Plan& plan, const float* topk_w, int64_t tokens,
                  int64_t top_k, int64_t d) {
  at::parallel_for(0, tokens, std::max<int64_t>(1, 8192 / std::max<int64_t>(d, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for_each_vec(d, [&](int64_t j, int64_t c) {
        fVec acc(0.f);
        for (int64_t s = 0; s < top_k; ++s) {
          const float* yr = y + plan.row_of[t * top_k + s] * d;
          acc = at::vec::fmadd(fVec(topk_w[t * top_k + s]), fVec::loadu(yr + j, c), acc);
        }
        store_n(out + t * d + j, acc, c);
      });
    }
  });
}

// Runs a task's weight tiles (tile t's rows are src[t * kW .. t * kW + kW), n elements each)
// over one expert's `rows` rows: its token panels (n * kP floats each), calling
// emit(tile, panel, lanes, acc) per pair, then its leftover rows (left, ldl apart), calling
// emit_rows(tile, row, res, count) per group of up to kR rows.
template <typename T, typename Emit, typename EmitRows>
void run_task(const T* const* src, int64_t tiles, int64_t n, const float* panels, int64_t rows,
              const float* left, int64_t ldl, float* buf, const Emit& emit,
              const EmitRows& emit_rows) {
  const int64_t ld = padded(n);
  const int64_t lanes_all = panel_rows(rows), nleft = rows - lanes_all;
  for (int64_t t = 0; t < tiles; ++t) {
    const float* rp[kW];
    if constexpr (std::is_same_v<T, float>) {
      for (int w = 0; w < kW; ++w) rp[w] = src[t * kW + w];
    } else {
      widen_rows(src + t * kW, n, buf, ld);
      for (int w = 0; w < kW; ++w) rp[w] = buf + w * ld;
    }
    const char* next[kW];
    const bool pf = t + 1 < tiles;
    if (pf) {
      for (int w = 0; w < kW; ++w) next[w] = reinterpret_cast<const char*>(src[(t + 1) * kW + w]);
    }
    for (int64_t p = 0; p * kP < lanes_all; ++p) {
      const int64_t lanes = std::min(kP, lanes_all - p * kP);
      fVec acc[kW][2];
      const char* const* nx = pf && p == 0 ? next : nullptr;
      if (lanes > kF) {
        tile_kernel<2>(rp, panels + p * n * kP, n, nx, 16 * sizeof(T), acc);
      } else {
        tile_kernel<1>(rp, panels + p * n * kP, n, nx, 16 * sizeof(T), acc);
        for (int w = 0; w < kW; ++w) acc[w][1] = fVec(0.f);
      }
      emit(t, p, lanes, acc);
    }
    float res[kW][kR] = {};  // rows past a group's count stay 0 (read by emit_rows' vectors)
    for (int64_t i = 0; i < nleft; i += kR) {
      const int64_t count = std::min<int64_t>(kR, nleft - i);
      dot_rows(rp, left + i * ldl, ldl, count, n, res);
      emit_rows(t, i, res, count);
    }
  }
}

// A projection's tasks: (active expert, kTiles tiles of `unit` output units out of `total`).
struct TaskSpan {
  int64_t e, lo, hi, tiles;  // the expert, its units [lo, hi), and the tiles they fill
};
inline int64_t tasks_per_expert(int64_t total, int64_t unit) {
  return (total + kTiles * unit - 1) / (kTiles * unit);
}
inline TaskSpan task_span(const Plan& plan, int64_t task, int64_t total, int64_t unit) {
  const int64_t per_expert = tasks_per_expert(total, unit);
  const int64_t lo = (task % per_expert) * kTiles * unit;
  const int64_t hi = std::min(total, lo + kTiles * unit);
  return {plan.active[task / per_expert], lo, hi, (hi - lo + unit - 1) / unit};
}

// The calling thread's fp32 scratch of at least n floats (kept for its next tasks).
inline float* thread_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

template <typename T>
void moe_kernel(T* out, const T* x, const T* w1, const T* w2, const float* topk_w,
                const int64_t* ids, int64_t tokens, int64_t top_k, int64_t experts, int64_t d,
                int64_t inter) {
  const int64_t pairs = tokens * top_k;
  const Plan plan = make_plan(ids, pairs, top_k, experts);
  const int64_t panels = plan.panel0[experts];
  // token panels [panel][k][kP] and leftover rows, of the hidden rows (xp, xl) and of the
  // activations (ap, al); y: the down projection's row per pair. Every element read is written
  // first (an expert's last panel may hold only kF rows: its other lanes are never read), so
  // none is initialized.
  const int64_t lefts = plan.left0[experts];
  const int64_t ldx = padded(d), lda = padded(inter);
  const auto alloc = [](int64_t n) { return std::unique_ptr<float[]>(new float[n]); };
  const auto xp = alloc(panels * d * kP), ap = alloc(panels * inter * kP), y = alloc(pairs * d);
  const auto xl = alloc(lefts * ldx), al = alloc(lefts * lda);

  // hidden rows in expert order, fp32
  at::parallel_for(0, experts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      for (int64_t r = plan.start[e]; r < plan.start[e + 1]; ++r) {
        const int64_t local = r - plan.start[e];
        const int64_t lanes = panel_rows(plan.start[e + 1] - plan.start[e]);
        const T* src = x + plan.token_of[r] * d;
        if (local < lanes) {
          float* dst = xp.get() + (plan.panel0[e] + local / kP) * d * kP + local % kP;
          for (int64_t k = 0; k < d; ++k) dst[k * kP] = static_cast<float>(src[k]);
        } else {
          float* dst = xl.get() + (plan.left0[e] + local - lanes) * ldx;
          for_each_vec(d, [&](int64_t j, int64_t c) { load_n(src + j, c).store(dst + j, c); });
        }
      }
      // zero lanes of a padded last panel, up to the vector the panel kernel reads
      const int64_t lanes = panel_rows(plan.start[e + 1] - plan.start[e]);
      const int64_t used = lanes % kP, end = used > kF ? kP : kF;
      if (used % kF) {
        float* p = xp.get() + (plan.panel0[e] + lanes / kP) * d * kP;
        for (int64_t k = 0; k < d; ++k) std::fill(p + k * kP + used, p + k * kP + end, 0.f);
      }
    }
  });

  const int64_t buf_size = kW * padded(std::max(d, inter));
  // gate and up: task = (expert, kTiles tiles); a tile holds the gate and up rows of kUnits
  // intermediate units (a tail shorter than kUnits repeats its last unit)
  const int64_t active = static_cast<int64_t>(plan.active.size());
  for_tasks(active * tasks_per_expert(inter, kUnits), [&](int64_t task) {
    const TaskSpan span = task_span(plan, task, inter, kUnits);
    const int64_t e = span.e, j0 = span.lo, j1 = span.hi, tiles = span.tiles;
    const int64_t rows = plan.start[e + 1] - plan.start[e];
    const T* we = w1 + e * 2 * inter * d;
    const T* src[kTiles * kW];
    for (int64_t t = 0; t < tiles; ++t) {
      for (int64_t u = 0; u < kUnits; ++u) {
        const int64_t j = std::min(j0 + t * kUnits + u, j1 - 1);
        src[t * kW + u] = we + j * d;
        src[t * kW + kUnits + u] = we + (inter + j) * d;
      }
    }
    run_task(src, tiles, d, xp.get() + plan.panel0[e] * d * kP, rows,
             xl.get() + plan.left0[e] * ldx, ldx, thread_scratch(buf_size),
             [&](int64_t t, int64_t p, int64_t, fVec (&acc)[kW][2]) {
      const int64_t panel = plan.panel0[e] + p;
      for (int64_t q = 0; q < kUnits; ++q) {
        const int64_t j = std::min(j0 + t * kUnits + q, j1 - 1);
        float* a = ap.get() + (panel * inter + j) * kP;
        for (int v = 0; v < 2; ++v) silu_mul(acc[q][v], acc[kUnits + q][v]).store(a + v * kF);
      }
    }, [&](int64_t t, int64_t i0, float (&res)[kW][kR], int64_t count) {
      // res[0..kUnits) are the gate results, res[kUnits..kW) the up results, kR apart
      static_assert(kUnits * kR <= kF, "one vector holds a tile's gate results");
      float act[kF];
      silu_mul(fVec::loadu(res[0], kUnits * kR), fVec::loadu(res[kUnits], kUnits * kR))
          .store(act, kUnits * kR);
      for (int64_t i = 0; i < count; ++i) {
        float* a = al.get() + (plan.left0[e] + i0 + i) * lda;
        for (int64_t q = 0; q < kUnits; ++q) {
          a[std::min(j0 + t * kUnits + q, j1 - 1)] = act[q * kR + i];
        }
      }
    });
  });

  // down: task = (expert, kTiles tiles of kW hidden units; a tail repeats its last unit)
  for_tasks(active * tasks_per_expert(d, kW), [&](int64_t task) {
    const TaskSpan span = task_span(plan, task, d, kW);
    const int64_t e = span.e, h0 = span.lo, h1 = span.hi, tiles = span.tiles;
    const int64_t r0 = plan.start[e], rows = plan.start[e + 1] - r0;
    const T* we = w2 + e * d * inter;
    const T* src[kTiles * kW];
    for (int64_t i = 0; i < tiles * kW; ++i) src[i] = we + std::min(h0 + i, h1 - 1) * inter;
    run_task(src, tiles, inter, ap.get() + plan.panel0[e] * inter * kP, rows,
             al.get() + plan.left0[e] * lda, lda, thread_scratch(buf_size),
             [&](int64_t t, int64_t p, int64_t lanes, fVec (&acc)[kW][2]) {
      const int64_t h = h0 + t * kW, used = std::min<int64_t>(kW, h1 - h);
      float tmp[kP];
      for (int64_t w = 0; w < used; ++w) {
        acc[w][0].store(tmp);
        acc[w][1].store(tmp + kF);
        for (int64_t l = 0; l < lanes; ++l) y[(r0 + p * kP + l) * d + h + w] = tmp[l];
      }
    }, [&](int64_t t, int64_t i0, float (&res)[kW][kR], int64_t count) {
      const int64_t h = h0 + t * kW, used = std::min<int64_t>(kW, h1 - h);
      const int64_t base = r0 + panel_rows(rows) + i0;
      for (int64_t i = 0; i < count; ++i) {
        for (int64_t w = 0; w < used; ++w) y[(base + i) * d + h + w] = res[w][i];
      }
    });
  });

  weighted_sum(out, y.get(), plan, topk_w, tokens, top_k, d);
}

#if defined(OPMUX_AMX)
// bf16 on AMX tiles: where the CPU has them, the process is granted the tile state and both
// reductions are whole tile steps (d and I multiples of 32). Both projections are computed
// transposed, weight rows x token columns, so the weights go into the A tiles straight from
// their [out, in] rows (no copy, no widening, no prepacked layout), and the tokens are the B
// operand, in the pair-interleaved layout the tile product reads:
//   pack   each expert's rows go in chunks of 16 (the last zero-padded); per chunk and step of
//          32 hidden elements, one 16 x 16 block of 32-bit cells (two bf16 of a row) is
//          transposed in registers, so B row p holds element pair p of the 16 tokens;
//   gate   task = (expert, 16 intermediate units): the gate and up rows of the units are two
//          A tiles, run against two chunks at a time (four accumulator tiles, 2 x 2); the
//          SiLU-and-mul of the fp32 results is rounded to bf16 and written in the same B
//          layout for the down projection (16 units fill half a step of 32);
//   down   task = (expert, 32 hidden units): two A tiles of down rows against two chunks at a
//          time; the 32 x 16 results are transposed back into the fp32 row of each pair.
// The weighted sum per token is formed as on the vector path. Accumulation is fp32 throughout;
// the activations are rounded to bf16 once, for the down projection's tile products (the bf16
// reference rounds after every step).
namespace moe_amx {

constexpr int64_t kChunk = 16;      // token columns per B tile
constexpr int64_t kCells = 256;     // 32-bit cells of one B tile (16 pairs x 16 columns)

// The tile path's switch: fused_moe_amx(mode) below.
inline amx::PathSwitch& path() {
  static amx::PathSwitch s;
  return s;
}

// Tiles: 0-3 accumulators (C, 16 x 16 fp32), 4-5 weight rows (A, 16 x 32 bf16), 6-7 token
// chunks (B, 16 pairs x 16 columns): all 16 rows of 64 bytes.
inline void configure() {
  amx::TileConfig c;
  for (int t = 0; t < 8; ++t) c.set(t, 16, 64);
  c.load();
}

// for_tasks with the tiles configured on each thread for the tasks it runs, released after.
template <typename Body>
void for_tile_tasks(int64_t n, const Body& body) {
  for_tasks(n, body, configure, [] { _tile_release(); });
}

// a0 and a1: 16 weight rows each (lda bytes apart), `steps` steps of 32 elements; b: the B
// tiles of chunk c at b + (c * steps + s) * kCells. For each chunk c in [c0, c1), calls
// emit(c, r0, r1) with the fp32 results of a0 and a1 against it ([16 rows][16 columns]).
template <typename Emit>
inline void tile_pairs(const at::BFloat16* a0, const at::BFloat16* a1, int64_t lda,
                       const uint32_t* b, int64_t steps, int64_t c0, int64_t c1,
                       const Emit& emit) {
  alignas(64) float res[4][kCells];
  for (int64_t c = c0; c < c1; c += 2) {
    const bool two = c + 1 < c1;  // a second chunk (accumulators 2 and 3)
    const uint32_t* b0 = b + c * steps * kCells;
    const uint32_t* b1 = b0 + steps * kCells;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t s = 0; s < steps; ++s) {
      _tile_loadd(4, a0 + s * 32, lda);
      _tile_loadd(6, b0 + s * kCells, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, a1 + s * 32, lda);
      _tile_dpbf16ps(1, 5, 6);
      if (two) {
        _tile_loadd(7, b1 + s * kCells, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, res[0], 64);
    _tile_stored(1, res[1], 64);
    emit(c, res[0], res[1]);
    if (two) {
      _tile_stored(2, res[2], 64);
      _tile_stored(3, res[3], 64);
      emit(c + 1, res[2], res[3]);
    }
  }
}

// Two rows of 16 fp32 as 16 cells of a B tile row: cell j = (bf16(lo[j]), bf16(hi[j])).
inline __m512i pair_cells(__m512 lo, __m512 hi) {
  alignas(64) static const int16_t kIdx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                               21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                               11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo in 0..15, hi in 16..31
  return _mm512_permutexvar_epi16(_mm512_load_si512(kIdx), both);
}

void moe_kernel(at::BFloat16* out, const at::BFloat16* x, const at::BFloat16* w1,
                const at::BFloat16* w2, const float* topk_w, const int64_t* ids, int64_t tokens,
                int64_t top_k, int64_t experts, int64_t d, int64_t inter) {
  const int64_t pairs = tokens * top_k;
  const Plan plan = make_plan(ids, pairs, top_k, experts);
  std::vector<int64_t> chunk0(experts + 1, 0);  // first chunk of each expert
  for (int64_t e = 0; e < experts; ++e) {
    chunk0[e + 1] = chunk0[e] + (plan.start[e + 1] - plan.start[e] + kChunk - 1) / kChunk;
  }
  const int64_t chunks = chunk0[experts];
  const int64_t s1 = d / 32, s2 = inter / 32;  // steps of the two projections
  // B tiles of the hidden rows (xb) and of the activations (ab), per chunk and step; y: the
  // down projection's fp32 row per pair. Every element read is written first.
  const auto xb = std::unique_ptr<uint32_t[]>(new uint32_t[chunks * s1 * kCells]);
  const auto ab = std::unique_ptr<uint32_t[]>(new uint32_t[chunks * s2 * kCells]);
  const auto y = std::unique_ptr<float[]>(new float[pairs * d]);
  std::vector<int64_t> expert_of(chunks);
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t c = chunk0[e]; c < chunk0[e + 1]; ++c) expert_of[c] = e;
  }

  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t e = expert_of[c];
      const int64_t r0 = plan.start[e] + (c - chunk0[e]) * kChunk;
      const int64_t n = std::min(kChunk, plan.start[e + 1] - r0);
      const at::BFloat16* src[kChunk];
      for (int64_t m = 0; m < n; ++m) src[m] = x + plan.token_of[r0 + m] * d;
      for (int64_t s = 0; s < s1; ++s) {
        __m512 v[kChunk];
        for (int64_t m = 0; m < kChunk; ++m) {
          v[m] = m < n ? _mm512_loadu_ps(reinterpret_cast<const float*>(src[m] + s * 32))
                        : _mm512_setzero_ps();
        }
        transpose16(v);
        uint32_t* dst = xb.get() + (c * s1 + s) * kCells;
        for (int64_t p = 0; p < 16; ++p) _mm512_storeu_ps(dst + p * 16, v[p]);
      }
    }
  });

  const int64_t blocks1 = inter / 16;
  for_tile_tasks(static_cast<int64_t>(plan.active.size()) * blocks1, [&](int64_t task) {
    const int64_t e = plan.active[task / blocks1], ub = task % blocks1;
    const at::BFloat16* gate = w1 + (e * 2 * inter + ub * 16) * d;
    const at::BFloat16* up = gate + inter * d;
    tile_pairs(gate, up, d * 2, xb.get(), s1, chunk0[e], chunk0[e + 1],
               [&](int64_t c, const float* g, const float* u) {
      // rows of g and u: units ub * 16 + i; cell row (ub % 2) * 8 + i / 2 of step ub / 2
      uint32_t* dst = ab.get() + (c * s2 + ub / 2) * kCells + (ub % 2) * 8 * 16;
      const fVec one(1.f);
      for (int64_t i = 0; i < 16; i += 2) {
        __m512 act[2];
        for (int h = 0; h < 2; ++h) {
          const fVec gv = fVec::loadu(g + (i + h) * 16);
          act[h] = gv / (one + gv.neg().exp_u20()) * fVec::loadu(u + (i + h) * 16);
        }
        _mm512_storeu_si512(dst + (i / 2) * 16, pair_cells(act[0], act[1]));
      }
    });
  });

  const int64_t blocks2 = d / 32;
  for_tile_tasks(static_cast<int64_t>(plan.active.size()) * blocks2, [&](int64_t task) {
    const int64_t e = plan.active[task / blocks2], ob = task % blocks2;
    const at::BFloat16* down = w2 + (e * d + ob * 32) * inter;
    tile_pairs(down, down + 16 * inter, inter * 2, ab.get(), s2, chunk0[e], chunk0[e + 1],
               [&](int64_t c, const float* lo, const float* hi) {
      const int64_t r0 = plan.start[e] + (c - chunk0[e]) * kChunk;
      const int64_t n = std::min(kChunk, plan.start[e + 1] - r0);
      for (int h = 0; h < 2; ++h) {
        const float* res = h ? hi : lo;
        __m512 v[16];
        for (int i = 0; i < 16; ++i) v[i] = _mm512_load_ps(res + i * 16);
        transpose16(v);  // v[m]: hidden units ob * 32 + h * 16 + 0..15 of column m
        for (int64_t m = 0; m < n; ++m) {
          _mm512_storeu_ps(y.get() + (r0 + m) * d + ob * 32 + h * 16, v[m]);
        }
      }
    });
  });

  weighted_sum(out, y.get(), plan, topk_w, tokens, top_k, d);
}

}  // namespace moe_amx
#endif

}  // namespace

void fused_moe_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& w1,
                   const at::Tensor& w2, const at::Tensor& topk_weights,
                   const at::Tensor& topk_ids) {
  OPMUX_CHECK("fused_moe", x.dim() == 2 && w1.dim() == 3 && w2.dim() == 3,
              "expected hidden_states [T, d], w1 [E, 2I, d] and w2 [E, d, I]");
  const int64_t tokens = x.size(0), d = x.size(1), experts = w1.size(0);
  const int64_t inter = w1.size(1) / 2;
  OPMUX_CHECK("fused_moe", w1.size(1) == 2 * inter && w1.size(2) == d && w2.size(0) == experts &&
                               w2.size(1) == d && w2.size(2) == inter,
              "w1 and w2 do not match hidden_states");
  OPMUX_CHECK("fused_moe", topk_ids.dim() == 2 && topk_ids.size(0) == tokens &&
                               topk_weights.sizes() == topk_ids.sizes(),
              "expected topk_ids and topk_weights [", tokens, ", k]");
  OPMUX_CHECK("fused_moe", topk_ids.scalar_type() == at::kLong &&
                               topk_weights.scalar_type() == at::kFloat,
              "expected int64 topk_ids and float32 topk_weights");
  OPMUX_CHECK("fused_moe", out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "expected out like hidden_states");
  for (const at::Tensor* t : {&std::as_const(out), &x, &w1, &w2, &topk_weights, &topk_ids}) {
    OPMUX_CHECK("fused_moe", t->is_cpu() && t->is_contiguous(), "expected contiguous CPU tensors");
  }
  OPMUX_CHECK("fused_moe", w1.scalar_type() == x.scalar_type() &&
                               w2.scalar_type() == x.scalar_type(),
              "expected w1 and w2 in the dtype of hidden_states");
  const int64_t top_k = topk_ids.size(1);
  const int64_t* ids = topk_ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    OPMUX_CHECK("fused_moe", ids[i] >= 0 && ids[i] < experts, "expected expert ids in [0, ",
                experts, "), got id ", ids[i]);
  }
  if (tokens == 0 || top_k == 0 || d == 0) {
    out.zero_();
    return;
  }
#if defined(OPMUX_AMX)
  if (x.scalar_type() == at::kBFloat16 && d % 32 == 0 && inter % 32 == 0 && inter > 0 &&
      moe_amx::path().on()) {
    moe_amx::moe_kernel(out.data_ptr<at::BFloat16>(), x.const_data_ptr<at::BFloat16>(),
                        w1.const_data_ptr<at::BFloat16>(), w2.const_data_ptr<at::BFloat16>(),
                        topk_weights.const_data_ptr<float>(), ids, tokens, top_k, experts, d,
                        inter);
    return;
  }
#endif
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "fused_moe", [&] {
    moe_kernel<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                         w1.const_data_ptr<scalar_t>(), w2.const_data_ptr<scalar_t>(),
                         topk_weights.const_data_ptr<float>(), ids, tokens, top_k, experts, d,
                         inter);
  });
}

// Whether bf16 fused_moe takes the AMX path (moe_amx above): mode 1 allows it, 0 turns it off
// (tests of the vector path on an AMX machine), -1 only asks. Returns whether it is in use
// now: allowed, built for this CPU, and the tile state granted.
bool fused_moe_amx(int64_t mode) {
#if defined(OPMUX_AMX)
  return moe_amx::path().set(mode);
#else
  (void)mode;
  return false;
#endif
}

// This file's ops in torch.ops.opmux_cpu (op_library.h).
TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def("fused_moe_amx(int mode) -> bool", &fused_moe_amx);
  m.def(
      "fused_moe_out(Tensor(a!) out, Tensor hidden_states, Tensor w1, Tensor w2, "
      "Tensor topk_weights, Tensor topk_ids) -> ()",
      cpu_kernel(&fused_moe_out));
}

}  // namespace opmux_cpu

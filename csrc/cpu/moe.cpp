// fused_moe: SiLU-and-mul expert MLPs over tokens grouped by expert, weighted sum per token.
//
// The (token, slot) pairs are bucketed by expert (a counting sort, stable). Each expert's rows
// are stored in fp32 in two forms: whole vectors of kF rows go into token panels, laid out
// [k][kP] (kP = 2 * kF token lanes per element of the hidden row), and the expert's last
// rows % kF rows stay row-major ("leftover" rows). A tile of six weight rows then runs over
// both: against a panel, each weight element is broadcast and multiplied into two vectors of
// token lanes (6 x 2 accumulators, so each panel element feeds six FMAs and no horizontal sum
// is needed); against the leftover rows, the weight rows are dotted with up to kR rows at a
// time. The tile's weight rows are read once per tile from memory, however many tokens the
// expert received (small batches are bandwidth-bound on the weights), and the next tile's rows
// are prefetched while the first panel runs. fp32 weight rows are read in place; bf16/fp16
// rows are widened to fp32 once per tile. The gate and up rows of the same intermediate units
// share a tile, so the SiLU-and-mul is applied on the results directly; the activations are
// written in the same panel / leftover layout, which the down projection reads. It writes one
// fp32 row per pair, and each token's weighted sum over its k rows is formed last, in fp32, in
// slot order.
//
// Work is handed out dynamically (an atomic counter over (expert, block) tasks), so experts
// with uneven token counts still keep every thread busy. Python (plugins/cpu/cpp_moe.py) runs
// the shared native checks first; the checks here guard the memory accesses.
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

// A tile is kW weight rows. Against a panel it holds kW x 2 vector accumulators (12 of the 16
// AVX2 registers: twelve independent FMA chains per step, where one vector of lanes per row
// would give six, too few to cover the FMA latency); against leftover rows, kW x kR dot
// products (kR = 2 on AVX2: each token vector feeds six FMAs; AVX-512 has registers for a third
// row).
constexpr int kW = 6;
constexpr int64_t kUnits = kW / 2;  // intermediate units per gate/up tile
constexpr int64_t kP = 2 * kF;      // token lanes per panel
constexpr int64_t kTiles = 8;       // tiles per task
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kR = 3;
#else
constexpr int kR = 2;
#endif

// Row stride of the fp32 work rows of n floats: a whole number of vectors plus one cache line,
// so that rows are never a multiple of 4 KiB apart (rows that are share L1 sets and evict each
// other while a tile reads them side by side).
inline int64_t padded(int64_t n) { return (n + 15) / 16 * 16 + 16; }

// acc[w][v] = sum over k < n of rows[w][k] * panel[k * kP + v * kF + lane], for NV vectors of
// lanes. When next is given, its rows are prefetched alongside: one line of each per 16 k
// (pf bytes per 16 elements of its dtype).
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
  for (int64_t k0 = 0; k0 < n; k0 += 16) {
    if (next) {
      for (int w = 0; w < kW; ++w) __builtin_prefetch(next[w] + (k0 / 16) * pf, 0, 2);
    }
    const int64_t k1 = std::min(n, k0 + 16);
    for (int64_t k = k0; k < k1; ++k) {
      fVec xv[NV];
      for (int v = 0; v < NV; ++v) xv[v] = fVec::loadu(xp + k * kP + v * kF);
      const float wk[kW] = {r0[k], r1[k], r2[k], r3[k], r4[k], r5[k]};
      for (int w = 0; w < kW; ++w) {
        const fVec wb(wk[w]);
        for (int v = 0; v < NV; ++v) a[w][v] = at::vec::fmadd(wb, xv[v], a[w][v]);
      }
    }
  }
  for (int w = 0; w < kW; ++w) {
    for (int v = 0; v < NV; ++v) acc[w][v] = a[w][v];
  }
}

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
  if (count == kR) {
    dot_tile<kR>(wr, x, x_stride, n, res);
  } else if (count == 2) {
    dot_tile<(kR > 2 ? 2 : kR)>(wr, x, x_stride, n, res);
  } else {
    dot_tile<1>(wr, x, x_stride, n, res);
  }
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

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// Runs body(task) for task in [0, n) over the thread pool, handed out one at a time.
template <typename Body>
void for_tasks(int64_t n, const Body& body) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t wk = begin; wk < end; ++wk) {
      for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) body(t);
    }
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
    p.panel0[e + 1] = p.panel0[e] + (n / kF * kF + kP - 1) / kP;
    p.left0[e + 1] = p.left0[e] + n % kF;
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

// Runs a task's weight tiles (tile t's rows are src[t * kW .. t * kW + kW), n elements each)
// over one expert's `rows` rows: its token panels (n * kP floats each), calling
// emit(tile, panel, lanes, acc) per pair, then its leftover rows (left, ldl apart), calling
// emit_rows(tile, row, res, count) per group of up to kR rows.
template <typename T, typename Emit, typename EmitRows>
void run_task(const T* const* src, int64_t tiles, int64_t n, const float* panels, int64_t rows,
              const float* left, int64_t ldl, float* buf, const Emit& emit,
              const EmitRows& emit_rows) {
  const int64_t ld = padded(n);
  const int64_t lanes_all = rows / kF * kF, nleft = rows - lanes_all;
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
    float res[kW][kR];
    for (int64_t i = 0; i < nleft; i += kR) {
      const int64_t count = std::min<int64_t>(kR, nleft - i);
      dot_rows(rp, left + i * ldl, ldl, count, n, res);
      emit_rows(t, i, res, count);
    }
  }
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
        const int64_t lanes = (plan.start[e + 1] - plan.start[e]) / kF * kF;
        const T* src = x + plan.token_of[r] * d;
        if (local < lanes) {
          float* dst = xp.get() + (plan.panel0[e] + local / kP) * d * kP + local % kP;
          for (int64_t k = 0; k < d; ++k) dst[k * kP] = static_cast<float>(src[k]);
        } else {
          float* dst = xl.get() + (plan.left0[e] + local - lanes) * ldx;
          for_each_vec(d, [&](int64_t j, int64_t c) { load_n(src + j, c).store(dst + j, c); });
        }
      }
    }
  });

  const int64_t buf_size = kW * padded(std::max(d, inter));
  // gate and up: task = (expert, kTiles tiles); a tile holds the gate and up rows of kUnits
  // intermediate units (a tail shorter than kUnits repeats its last unit)
  const int64_t gate_tasks = (inter + kTiles * kUnits - 1) / (kTiles * kUnits);
  for_tasks(static_cast<int64_t>(plan.active.size()) * gate_tasks, [&](int64_t task) {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < buf_size) buf.resize(buf_size);
    const int64_t e = plan.active[task / gate_tasks];
    const int64_t j0 = (task % gate_tasks) * kTiles * kUnits;
    const int64_t j1 = std::min(inter, j0 + kTiles * kUnits);
    const int64_t tiles = (j1 - j0 + kUnits - 1) / kUnits;
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
             xl.get() + plan.left0[e] * ldx, ldx, buf.data(),
             [&](int64_t t, int64_t p, int64_t, fVec (&acc)[kW][2]) {
      float g[kF], u[kF];
      const int64_t panel = plan.panel0[e] + p;
      for (int64_t q = 0; q < kUnits; ++q) {
        const int64_t j = std::min(j0 + t * kUnits + q, j1 - 1);
        float* a = ap.get() + (panel * inter + j) * kP;
        for (int v = 0; v < 2; ++v) {
          acc[q][v].store(g);
          acc[kUnits + q][v].store(u);
          for (int64_t l = 0; l < kF; ++l) a[v * kF + l] = silu(g[l]) * u[l];
        }
      }
    }, [&](int64_t t, int64_t i0, float (&res)[kW][kR], int64_t count) {
      for (int64_t i = 0; i < count; ++i) {
        float* a = al.get() + (plan.left0[e] + i0 + i) * lda;
        for (int64_t q = 0; q < kUnits; ++q) {
          const int64_t j = std::min(j0 + t * kUnits + q, j1 - 1);
          a[j] = silu(res[q][i]) * res[kUnits + q][i];
        }
      }
    });
  });

  // down: task = (expert, kTiles tiles of kW hidden units; a tail repeats its last unit)
  const int64_t down_tasks = (d + kTiles * kW - 1) / (kTiles * kW);
  for_tasks(static_cast<int64_t>(plan.active.size()) * down_tasks, [&](int64_t task) {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < buf_size) buf.resize(buf_size);
    const int64_t e = plan.active[task / down_tasks];
    const int64_t h0 = (task % down_tasks) * kTiles * kW;
    const int64_t h1 = std::min(d, h0 + kTiles * kW);
    const int64_t tiles = (h1 - h0 + kW - 1) / kW;
    const int64_t r0 = plan.start[e], rows = plan.start[e + 1] - r0;
    const T* we = w2 + e * d * inter;
    const T* src[kTiles * kW];
    for (int64_t i = 0; i < tiles * kW; ++i) src[i] = we + std::min(h0 + i, h1 - 1) * inter;
    run_task(src, tiles, inter, ap.get() + plan.panel0[e] * inter * kP, rows,
             al.get() + plan.left0[e] * lda, lda, buf.data(),
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
      const int64_t base = r0 + rows / kF * kF + i0;
      for (int64_t i = 0; i < count; ++i) {
        for (int64_t w = 0; w < used; ++w) y[(base + i) * d + h + w] = res[w][i];
      }
    });
  });

  at::parallel_for(0, tokens, std::max<int64_t>(1, 8192 / std::max<int64_t>(d, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for_each_vec(d, [&](int64_t j, int64_t c) {
        fVec acc(0.f);
        for (int64_t s = 0; s < top_k; ++s) {
          const float* yr = y.get() + plan.row_of[t * top_k + s] * d;
          acc = at::vec::fmadd(fVec(topk_w[t * top_k + s]), fVec::loadu(yr + j, c), acc);
        }
        store_n(out + t * d + j, acc, c);
      });
    }
  });
}

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
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "fused_moe", [&] {
    moe_kernel<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                         w1.const_data_ptr<scalar_t>(), w2.const_data_ptr<scalar_t>(),
                         topk_weights.const_data_ptr<float>(), ids, tokens, top_k, experts, d,
                         inter);
  });
}

// This file's ops in torch.ops.opmux_cpu (op_library.h).
TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def(
      "fused_moe_out(Tensor(a!) out, Tensor hidden_states, Tensor w1, Tensor w2, "
      "Tensor topk_weights, Tensor topk_ids) -> ()",
      cpu_kernel(&fused_moe_out));
}

}  // namespace opmux_cpu

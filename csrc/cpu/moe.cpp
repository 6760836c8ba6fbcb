// fused_moe: SiLU-and-mul expert MLPs over tokens grouped by expert, weighted sum per token.
//
// The (token, slot) pairs are bucketed by expert (a counting sort, stable), and each pair's
// hidden row is gathered in fp32 into that order. Each expert's two projections then run as
// tiles of four weight rows against up to three token rows at a time: the weight rows stay in
// L1 while every token row of the expert passes over them, so the expert weights stream from
// memory exactly once per call however many tokens an expert received (small batches are
// bandwidth-bound on those weights). bf16/fp16 weight rows are widened to fp32 once per tile.
// The gate and up rows of the same intermediate units share a tile, so the SiLU-and-mul is
// applied on the dot products directly. The down projection writes one fp32 row per pair, and
// each token's weighted sum over its k rows is formed last, in fp32, in slot order.
//
// Work is handed out dynamically (an atomic counter over (expert, block) tasks), so experts
// with uneven token counts still keep every thread busy. Python (plugins/cpu/cpp_moe.py) runs
// the shared native checks first; the checks here guard the memory accesses.
#include "op_library.h"
#include "vec_common.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <utility>
#include <vector>

namespace opmux_cpu {
namespace {

// A tile is kW weight rows against kR token rows: kW * kR vector accumulators. Measured on an
// AVX2 core (16 vector registers) 6 x 2 runs fastest: each token vector feeds six FMAs, and
// the token rows, which come from L2, are read a third as often as the weight rows, which
// stay in L1. AVX-512 has 32 registers for a third token row.
constexpr int kW = 6;
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kR = 3;
#else
constexpr int kR = 2;
#endif
constexpr int64_t kUnits = kW / 2;  // intermediate units per gate/up tile
constexpr int64_t kTiles = 8;       // tiles per task

// Row stride of the fp32 work buffers for rows of n floats: a whole number of vectors plus
// one cache line, so that rows are never a multiple of 4 KiB apart (rows that are share L1
// sets and evict each other while a tile reads them side by side).
inline int64_t padded(int64_t n) { return (n + 15) / 16 * 16 + 16; }

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

// Runs a task's `tiles` weight tiles (tile t's rows are src[t * kW .. t * kW + kW), n
// elements each) against its `rows` token rows (x, x_stride apart), calling
// emit(tile, row, res, count) for each group of up to kR rows.
//
// Token rows go in blocks of kRowBlock, which stay in L2 while every tile passes over them.
// Each tile is widened to fp32 into buf once, padded(n) apart: float rows are copied too,
// because weight rows are usually a multiple of 4 KiB apart and, read in place, kW of them
// share L1 sets (measured: the copy makes the fp32 tile about twice as fast). While the first
// row block runs over tile t, the rows of tile t + 1 are prefetched a slice per row group, so
// that streaming the weights from memory overlaps the arithmetic.
template <typename T, typename Emit>
void run_tiles(const T* const* src, int64_t tiles, int64_t n, const float* x, int64_t x_stride,
               int64_t rows, float* buf, const Emit& emit) {
  constexpr int64_t kRowBlock = 32;
  const int64_t ld = padded(n);
  const int64_t row_lines = (n * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  float res[kW][kR];
  for (int64_t rb = 0; rb < rows; rb += kRowBlock) {
    const int64_t block = std::min(kRowBlock, rows - rb);
    const int64_t groups = (block + kR - 1) / kR;
    for (int64_t t = 0; t < tiles; ++t) {
      float* tile = buf + t * kW * ld;
      const float* wr[kW];
      for (int w = 0; w < kW; ++w) {
        wr[w] = tile + w * ld;
        if (rb == 0) {
          const T* from = src[t * kW + w];
          float* to = tile + w * ld;
          for_each_vec(n, [&](int64_t j, int64_t c) { load_n(from + j, c).store(to + j, c); });
        }
      }
      const T* const* next = rb == 0 && t + 1 < tiles ? src + (t + 1) * kW : nullptr;
      const int64_t lines = kW * row_lines, slice = (lines + groups - 1) / groups;
      int64_t line = 0;
      for (int64_t r = 0; r < block; r += kR) {
        for (const int64_t end = next ? std::min(lines, line + slice) : 0; line < end; ++line) {
          __builtin_prefetch(reinterpret_cast<const char*>(next[line / row_lines]) +
                             (line % row_lines) * 64, 0, 2);
        }
        const int64_t count = std::min<int64_t>(kR, block - r);
        dot_rows(wr, x + (rb + r) * x_stride, x_stride, count, n, res);
        emit(t, rb + r, res, count);
      }
    }
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
  std::vector<int64_t> row_of;     // [T * k] sorted row of each (token, slot) pair
  std::vector<int64_t> token_of;   // [T * k] token of each sorted row
  std::vector<int64_t> active;     // experts with rows
};

Plan make_plan(const int64_t* ids, int64_t pairs, int64_t top_k, int64_t experts) {
  Plan p;
  p.start.assign(experts + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) ++p.start[ids[i] + 1];
  for (int64_t e = 0; e < experts; ++e) {
    if (p.start[e + 1]) p.active.push_back(e);
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

template <typename T>
void moe_kernel(T* out, const T* x, const T* w1, const T* w2, const float* topk_w,
                const int64_t* ids, int64_t tokens, int64_t top_k, int64_t experts, int64_t d,
                int64_t inter) {
  const int64_t pairs = tokens * top_k;
  const Plan plan = make_plan(ids, pairs, top_k, experts);
  const int64_t ldx = padded(d), lda = padded(inter);
  std::vector<float> xg(static_cast<size_t>(pairs * ldx));
  std::vector<float> act(static_cast<size_t>(pairs * lda));
  std::vector<float> y(static_cast<size_t>(pairs * d));

  // hidden rows in expert order, fp32
  at::parallel_for(0, pairs, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* src = x + plan.token_of[row] * d;
      float* dst = xg.data() + row * ldx;
      for_each_vec(d, [&](int64_t j, int64_t c) { load_n(src + j, c).store(dst + j, c); });
    }
  });

  const int64_t n_active = static_cast<int64_t>(plan.active.size());
  const int64_t buf_size = kTiles * kW * padded(std::max(d, inter));
  // gate and up: task = (expert, kTiles tiles); a tile holds the gate and up rows of kUnits
  // intermediate units (a tail shorter than kUnits repeats its last unit)
  const int64_t gate_tasks = (inter + kTiles * kUnits - 1) / (kTiles * kUnits);
  for_tasks(n_active * gate_tasks, [&](int64_t task) {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < buf_size) buf.resize(buf_size);
    const int64_t e = plan.active[task / gate_tasks];
    const int64_t j0 = (task % gate_tasks) * kTiles * kUnits;
    const int64_t j1 = std::min(inter, j0 + kTiles * kUnits);
    const int64_t tiles = (j1 - j0 + kUnits - 1) / kUnits;
    const int64_t r0 = plan.start[e], rows = plan.start[e + 1] - r0;
    const T* we = w1 + e * 2 * inter * d;
    const T* src[kTiles * kW];
    for (int64_t t = 0; t < tiles; ++t) {
      for (int64_t u = 0; u < kUnits; ++u) {
        const int64_t j = std::min(j0 + t * kUnits + u, j1 - 1);
        src[t * kW + u] = we + j * d;
        src[t * kW + kUnits + u] = we + (inter + j) * d;
      }
    }
    run_tiles(src, tiles, d, xg.data() + r0 * ldx, ldx, rows, buf.data(),
              [&](int64_t t, int64_t r, float (&res)[kW][kR], int64_t count) {
      for (int64_t i = 0; i < count; ++i) {
        float* a = act.data() + (r0 + r + i) * lda;
        for (int64_t u = 0; u < kUnits; ++u) {
          const int64_t j = std::min(j0 + t * kUnits + u, j1 - 1);
          a[j] = silu(res[u][i]) * res[kUnits + u][i];
        }
      }
    });
  });

  // down: task = (expert, kTiles tiles of kW hidden units; a tail repeats its last unit)
  const int64_t down_tasks = (d + kTiles * kW - 1) / (kTiles * kW);
  for_tasks(n_active * down_tasks, [&](int64_t task) {
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
    run_tiles(src, tiles, inter, act.data() + r0 * lda, lda, rows, buf.data(),
              [&](int64_t t, int64_t r, float (&res)[kW][kR], int64_t count) {
      const int64_t h = h0 + t * kW, used = std::min<int64_t>(kW, h1 - h);
      for (int64_t i = 0; i < count; ++i) {
        float* yr = y.data() + (r0 + r + i) * d + h;
        for (int64_t w = 0; w < used; ++w) yr[w] = res[w][i];
      }
    });
  });

  // each token's weighted sum over its k rows, in slot order
  at::parallel_for(0, tokens, std::max<int64_t>(1, 8192 / std::max<int64_t>(d, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for_each_vec(d, [&](int64_t j, int64_t c) {
        fVec acc(0.f);
        for (int64_t s = 0; s < top_k; ++s) {
          const float* yr = y.data() + plan.row_of[t * top_k + s] * d;
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

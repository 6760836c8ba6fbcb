// Shared by the gated activations of activation.cpp: x [..., 2d] holds
// the first half (a) and the second half (b) of each row; out is [..., d].
#pragma once

#include "vec_common.h"

#include <algorithm>

namespace opmux_cpu {

// x: even last dim, contiguous; out: contiguous x.shape[:-1] + [d] of x's dtype.
inline void check_gated_args(const char* op, const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) % 2 == 0, "opmux::", op,
                    " (provider 'cpp'): argument 'x' expected an even last dimension, got ",
                    x.sizes());
  TORCH_CHECK_VALUE(x.is_contiguous(), "opmux::", op,
                    " (provider 'cpp'): argument 'x' expected a contiguous tensor, got strides ",
                    x.strides());
  auto expected = x.sizes().vec();
  expected.back() /= 2;
  TORCH_CHECK_VALUE(out.sizes() == at::IntArrayRef(expected) &&
                        out.scalar_type() == x.scalar_type() && out.is_contiguous(),
                    "opmux::", op, " (provider 'cpp'): out expected contiguous ",
                    at::IntArrayRef(expected), " ", x.scalar_type(), ", got ", out.sizes(), " ",
                    out.scalar_type());
}

// Rows of a gated input (0 when d is 0).
inline int64_t gated_row_count(const at::Tensor& x) {
  const int64_t d = x.size(-1) / 2;
  return d == 0 ? 0 : x.numel() / (2 * d);
}

// row(a, b, o) for every row in parallel, with a = x[r, :d], b = x[r, d:], o = out[r];
// each task takes at least `grain_elems` elements of a. Streaming stores are fenced.
template <typename T, typename Row>
void for_gated_rows(T* out, const T* x, int64_t rows, int64_t d, int64_t grain_elems,
                    const Row& row) {
  if (rows == 0 || d == 0) return;
  const int64_t grain = std::max<int64_t>(1, grain_elems / d);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* a = x + r * 2 * d;
      row(a, a + d, out + r * d);
    }
    stream_fence();
  });
}

// out[r, j] = fn(x[r, j], x[r, d + j]) for every row r, in fp32 registers.
template <typename T, typename Fn>
void split_rows(T* out, const T* x, int64_t rows, int64_t d, const Fn& fn) {
  // 32768 elements a task, as aten's GRAIN_SIZE: a decode batch (a few rows) runs on the
  // calling thread, never paying a thread hand-off for microseconds of work
  for_gated_rows(out, x, rows, d, 32768, [&](const T* a, const T* b, T* o) {
    for_each_vec(d, [&](int64_t j, int64_t n) {
      store_nt(o + j, fn(load_n(a + j, n), load_n(b + j, n)), n);
    });
  });
}

}  // namespace opmux_cpu

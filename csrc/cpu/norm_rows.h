// Shared by the RMS norms of layernorm.cpp (plain, fused-add, Gemma, gated): the argument
// check, the row grain, the fp32 sum of squares of a row, and the row loop of the plain and the
// Gemma norm.
#pragma once

#include "vec_common.h"

#include <algorithm>
#include <cmath>

namespace opmux_cpu {

// x: contiguous with at least 1 dim; weight: contiguous [d] of x's dtype (or float32 when
// `fp32_weight`); out: contiguous, x's shape and dtype.
inline void check_norm_args(const char* op, const at::Tensor& out, const at::Tensor& x,
                            const at::Tensor& weight, bool fp32_weight) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.is_contiguous(), "opmux::", op,
                    " (provider 'cpp'): x must be contiguous with at least 1 dim, got strides ",
                    x.strides());
  const int64_t d = x.size(-1);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == d && weight.is_contiguous(), "opmux::",
                    op, " (provider 'cpp'): weight must be a contiguous [", d, "] tensor, got ",
                    weight.sizes());
  if (fp32_weight) {
    TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type() ||
                          weight.scalar_type() == at::kFloat,
                      "opmux::", op, " (provider 'cpp'): weight dtype must be x's (",
                      x.scalar_type(), ") or float32, got ", weight.scalar_type());
  } else {
    TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "opmux::", op,
                      " (provider 'cpp'): weight dtype must equal x dtype ", x.scalar_type(),
                      ", got ", weight.scalar_type());
  }
  TORCH_CHECK_VALUE(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() &&
                        out.is_contiguous(),
                    "opmux::", op, " (provider 'cpp'): out must be contiguous ", x.sizes(), " ",
                    x.scalar_type(), ", got ", out.sizes(), " ", out.scalar_type());
}

// Rows per parallel task: about 16K elements.
inline int64_t row_grain(int64_t d) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1));
}

inline float inv_rms(float sum_sq, int64_t n, float eps) {
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
}

// Sum of squares of p[0..n) in fp32 (two accumulators).
template <typename T>
float sum_sq(const T* p, int64_t n) {
  fVec acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + 2 * kF <= n; i += 2 * kF) {
    fVec a = load_f(p + i);
    fVec b = load_f(p + i + kF);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
  }
  for (; i < n; i += kF) {
    fVec a = load_n(p + i, std::min(kF, n - i));
    acc0 = at::vec::fmadd(a, a, acc0);
  }
  return hsum(acc0 + acc1);
}

// (1 + w) for Gemma, w otherwise, as fp32 lanes.
template <bool kGemma, typename W>
inline fVec load_w(const W* w, int64_t j, int64_t n) {
  fVec v = load_n(w + j, n);
  if constexpr (kGemma) v = v + fVec(1.0f);
  return v;
}

// out = x * inv_rms(x) * w per row (w + 1 for Gemma), rows split across threads.
template <bool kGemma, typename T, typename W>
void norm_rows(T* out, const T* x, const W* w, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      T* orow = out + r * d;
      const fVec inv(inv_rms(sum_sq(xr, d), d, eps));
      for_each_vec(d, [&](int64_t j, int64_t n) {
        store_nt(orow + j, load_n(xr + j, n) * inv * load_w<kGemma>(w, j, n), n);
      });
    }
    stream_fence();
  });
}

}  // namespace opmux_cpu

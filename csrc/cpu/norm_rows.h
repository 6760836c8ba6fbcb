// Shared by the RMS norms (layernorm.cpp, norm_more.cpp): the argument check, the row grain
// and the fp32 sum of squares of a row.
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

}  // namespace opmux_cpu

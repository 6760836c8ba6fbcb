// silu_and_mul and gelu_and_mul: out[..., i] = act(x[..., i]) * x[..., d + i] in fp32 registers.
#include "ops.h"
#include "vec_common.h"

#include <cmath>

namespace opmux_cpu {
namespace {

void check_act_args(const char* op, const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) % 2 == 0, "opmux::", op,
                    " (provider 'cpp'): x must have an even last dim, got ", x.sizes());
  TORCH_CHECK_VALUE(x.is_contiguous(), "opmux::", op,
                    " (provider 'cpp'): x must be contiguous, got strides ", x.strides());
  auto expected = x.sizes().vec();
  expected.back() /= 2;
  TORCH_CHECK_VALUE(out.sizes() == at::IntArrayRef(expected) &&
                        out.scalar_type() == x.scalar_type() && out.is_contiguous(),
                    "opmux::", op, " (provider 'cpp'): out must be contiguous ",
                    at::IntArrayRef(expected), " ", x.scalar_type(), ", got ", out.sizes(), " ",
                    out.scalar_type());
}

template <typename T, typename Act>
void gated_rows(T* out, const T* x, int64_t rows, int64_t d, const Act& act) {
  if (rows == 0 || d == 0) return;
  const int64_t grain = std::max<int64_t>(1, 8192 / d);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* a = x + r * 2 * d;
      const T* b = a + d;
      T* o = out + r * d;
      for_each_vec(d, [&](int64_t j, int64_t n) {
        store_nt(o + j, act(load_n(a + j, n)) * load_n(b + j, n), n);
      });
    }
    stream_fence();
  });
}

}  // namespace

void silu_and_mul_out(at::Tensor& out, const at::Tensor& x) {
  check_act_args("silu_and_mul", out, x);
  advise_huge_pages(out);
  const int64_t d = x.size(-1) / 2;
  const int64_t rows = d == 0 ? 0 : x.numel() / (2 * d);
  const fVec one(1.f);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "silu_and_mul", [&] {
    gated_rows<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), rows, d,
                         [&](const fVec& v) { return v / (one + v.neg().exp_u20()); });
  });
}

void gelu_and_mul_out(at::Tensor& out, const at::Tensor& x, const std::string& approximate) {
  TORCH_CHECK_VALUE(approximate == "none" || approximate == "tanh",
                    "opmux::gelu_and_mul (provider 'cpp'): approximate must be one of "
                    "['none', 'tanh'], got '",
                    approximate, "'");
  check_act_args("gelu_and_mul", out, x);
  advise_huge_pages(out);
  const int64_t d = x.size(-1) / 2;
  const int64_t rows = d == 0 ? 0 : x.numel() / (2 * d);
  const fVec half(0.5f);
  const fVec one(1.f);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "gelu_and_mul", [&] {
    if (approximate == "tanh") {
      const fVec k0(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5));  // sqrt(2/pi)
      const fVec k1(0.044715f);
      gated_rows<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), rows, d,
                           [&](const fVec& v) {
                             fVec inner = k0 * (v + k1 * v * v * v);
                             return half * v * (one + inner.tanh());
                           });
    } else {
      const fVec rsqrt2(static_cast<float>(M_SQRT1_2));
      gated_rows<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), rows, d,
                           [&](const fVec& v) { return half * v * (one + (v * rsqrt2).erf()); });
    }
  });
}

}  // namespace opmux_cpu

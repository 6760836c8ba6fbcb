// silu_and_mul and gelu_and_mul: out[..., i] = act(x[..., i]) * x[..., d + i] in fp32 registers.
#include "gated.h"
#include "op_library.h"

#include <cmath>

namespace opmux_cpu {

void silu_and_mul_out(at::Tensor& out, const at::Tensor& x) {
  check_gated_args("silu_and_mul", out, x);
  advise_huge_pages(out);
  const int64_t d = x.size(-1) / 2;
  const int64_t rows = gated_row_count(x);
  const fVec one(1.f);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "silu_and_mul", [&] {
    split_rows<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), rows, d,
                         [&](const fVec& a, const fVec& b) {
                           return a / (one + a.neg().exp_u20()) * b;
                         });
  });
}

void gelu_and_mul_out(at::Tensor& out, const at::Tensor& x, const std::string& approximate) {
  TORCH_CHECK_VALUE(approximate == "none" || approximate == "tanh",
                    "opmux::gelu_and_mul (provider 'cpp'): approximate must be one of "
                    "['none', 'tanh'], got '",
                    approximate, "'");
  check_gated_args("gelu_and_mul", out, x);
  advise_huge_pages(out);
  const int64_t d = x.size(-1) / 2;
  const int64_t rows = gated_row_count(x);
  const fVec half(0.5f);
  const fVec one(1.f);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "gelu_and_mul", [&] {
    if (approximate == "tanh") {
      const fVec k0(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5));  // sqrt(2/pi)
      const fVec k1(0.044715f);
      split_rows<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), rows, d,
                           [&](const fVec& v, const fVec& b) {
                             fVec inner = k0 * (v + k1 * v * v * v);
                             return half * v * (one + inner.tanh()) * b;
                           });
    } else {
      const fVec rsqrt2(static_cast<float>(M_SQRT1_2));
      split_rows<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), rows, d,
                           [&](const fVec& v, const fVec& b) {
                             return half * v * (one + (v * rsqrt2).erf()) * b;
                           });
    }
  });
}

// This file's ops in torch.ops.opmux_cpu (op_library.h).
TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def("silu_and_mul_out(Tensor(a!) out, Tensor x) -> ()", cpu_kernel(&silu_and_mul_out));
  m.def(
      "gelu_and_mul_out(Tensor(a!) out, Tensor x, str approximate) -> ()",
      cpu_kernel(&gelu_and_mul_out));
}

}  // namespace opmux_cpu

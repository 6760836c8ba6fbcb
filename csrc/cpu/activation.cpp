// silu_and_mul and gelu_and_mul: out[..., i] = act(x[..., i]) * x[..., d + i] in fp32 registers.
// vLLM's other activation rows: gated (fatrelu_and_mul, mul_and_silu, swigluoai_and_mul,
// gelu_and_mul_sparse) and elementwise (gelu_new, gelu_fast, quick_gelu, relu2, xielu).
// Math in fp32 registers, one rounding at the store; gelu_and_mul_sparse rounds its row
// statistics to the input dtype where the PyTorch reference does.
#include "gated.h"
#include "kernels.h"
#include "op_library.h"

#include <cmath>
#include <tuple>

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

namespace {

void check_unary_args(const char* op, const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.is_contiguous(), "opmux::", op,
                    " (provider 'cpp'): argument 'x' expected a contiguous tensor, got strides ",
                    x.strides());
  TORCH_CHECK_VALUE(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() &&
                        out.is_contiguous(),
                    "opmux::", op, " (provider 'cpp'): out expected contiguous ", x.sizes(),
                    " ", x.scalar_type(), ", got ", out.sizes(), " ", out.scalar_type());
}

// out[i] = fn(x[i]) over the flat tensor.
template <typename T, typename Fn>
void unary(T* out, const T* x, int64_t n, const Fn& fn) {
  if (n == 0) return;
  constexpr int64_t kChunk = 16 * 1024;
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
    const int64_t lo = begin * kChunk;
    const int64_t hi = std::min(n, end * kChunk);
    for_each_vec(hi - lo, [&](int64_t j, int64_t m) {
      store_nt(out + lo + j, fn(load_n(x + lo + j, m)), m);
    });
    stream_fence();
  });
}

// Rounds fp32 lanes to T and back (identity for float): the dtype boundary of a PyTorch op.
template <typename T>
inline fVec round_vec(const fVec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    auto r = at::vec::convert_from_float<T>(v, v);
    fVec a, b;
    std::tie(a, b) = at::vec::convert_to_float<T>(r);
    return a;
  }
}

template <typename T>
inline float round_scalar(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// 0.5 v (1 + tanh(u)) == v * sigmoid(2u) == v / (1 + exp(-2u)): one exp instead of a tanh,
// no cancellation, and exp(-2u) -> inf gives -0 / 0 as the tanh form does.
inline fVec tanh_form(const fVec& v, const fVec& u) {
  const fVec one(1.f), m2(-2.f);
  return v / (one + (m2 * u).exp_u20());
}

inline fVec tanh_gelu(const fVec& v) {
  const fVec k0(0.7978845608028654f), k1(0.044715f);
  return tanh_form(v, k0 * (v + k1 * v * v * v));
}

inline fVec erf_gelu(const fVec& v) {
  const fVec rsqrt2(static_cast<float>(M_SQRT1_2)), half(0.5f), one(1.f);
  return half * v * (one + (v * rsqrt2).erf());
}

// expm1 from the fast exp: exp(v) - 1 for |v| >= 0.5, a degree-8 Taylor polynomial below
// (remainder < 6e-9 there, where exp(v) - 1 would cancel).
inline fVec expm1_fast(const fVec& v) {
  const fVec one(1.f), half(0.5f);
  fVec p(1.f / 40320.f);
  for (float c : {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f}) {
    p = at::vec::fmadd(p, v, fVec(c));
  }
  p = p * v;
  return fVec::blendv(v.exp_u20() - one, p, v.abs() < half);
}

inline float softplus(float v) {  // torch's default beta=1, threshold=20
  return v > 20.f ? v : std::log1p(std::exp(v));
}

template <typename T>
float scalar_value(const at::Tensor& t) {
  return static_cast<float>(t.const_data_ptr<T>()[0]);
}

}  // namespace

void fatrelu_and_mul_out(at::Tensor& out, const at::Tensor& x, double threshold) {
  check_gated_args("fatrelu_and_mul", out, x);
  const int64_t d = x.size(-1) / 2;
  const fVec th(static_cast<float>(threshold)), zero(0.f);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "fatrelu_and_mul", [&] {
    // torch.threshold keeps x unless x <= threshold (NaN passes through)
    split_rows<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                         gated_row_count(x), d, [&](const fVec& a, const fVec& b) {
                           return fVec::blendv(a, zero, a <= th) * b;
                         });
  });
}

void mul_and_silu_out(at::Tensor& out, const at::Tensor& x) {
  check_gated_args("mul_and_silu", out, x);
  const int64_t d = x.size(-1) / 2;
  const fVec one(1.f);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "mul_and_silu", [&] {
    split_rows<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                         gated_row_count(x), d, [&](const fVec& a, const fVec& b) {
                           return a * (b / (one + b.neg().exp_u20()));
                         });
  });
}

void swigluoai_and_mul_out(at::Tensor& out, const at::Tensor& x, double alpha, double limit) {
  check_gated_args("swigluoai_and_mul", out, x);
  const int64_t d = x.size(-1) / 2;
  const int64_t rows = gated_row_count(x);
  const float al = static_cast<float>(alpha), lim = static_cast<float>(limit);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "swigluoai_and_mul", [&] {
    const fVec alv(al), hi(lim), lo(-lim), one(1.f);
    // the row holds its halves interleaved (gate, up, gate, up, ...): it is read from its start
    for_gated_rows(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), rows, d, 8192,
                   [&](const scalar_t* xr, const scalar_t*, scalar_t* o) {
      float pair[2 * kF];
      for_each_vec(d, [&](int64_t j, int64_t n) {
        // 2n interleaved values -> two fp32 vectors
        fVec v0 = load_n(xr + 2 * j, std::min<int64_t>(2 * n, kF));
        fVec v1 = 2 * n > kF ? load_n(xr + 2 * j + kF, 2 * n - kF) : fVec(0.f);
        v0.store(pair);
        v1.store(pair + kF);
        fVec gate, up;
        std::tie(gate, up) = at::vec::deinterleave2(fVec::loadu(pair), fVec::loadu(pair + kF));
        gate = at::vec::minimum(gate, hi);
        up = at::vec::clamp(up, lo, hi);
        const fVec glu = gate / (one + (gate * alv).neg().exp_u20());
        store_nt(o + j, (up + one) * glu, n);
      });
    });
  });
}

void gelu_and_mul_sparse_out(at::Tensor& out, const at::Tensor& x, double std_multiplier,
                             const std::string& approximate) {
  TORCH_CHECK_VALUE(approximate == "none" || approximate == "tanh",
                    "opmux::gelu_and_mul_sparse (provider 'cpp'): argument 'approximate' "
                    "expected one of ['none', 'tanh'], got '",
                    approximate, "'");
  check_gated_args("gelu_and_mul_sparse", out, x);
  const int64_t d = x.size(-1) / 2;
  const int64_t rows = gated_row_count(x);
  const bool tanh = approximate == "tanh";
  const float mult = static_cast<float>(std_multiplier);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "gelu_and_mul_sparse", [&] {
    using T = scalar_t;
    for_gated_rows(out.data_ptr<T>(), x.const_data_ptr<T>(), rows, d, 4096,
                   [&](const T* g, const T* u, T* o) {
      fVec acc(0.f);
      for_each_vec(d, [&](int64_t j, int64_t n) { acc = acc + load_n(g + j, n); });
      const float mean = hsum(acc) / static_cast<float>(d);
      const fVec mv(mean);
      fVec acc2(0.f);
      for_each_vec(d, [&](int64_t j, int64_t n) {
        fVec c = load_n(g + j, n) - mv;
        if (n < kF) c = fVec::set(fVec(0.f), c, n);
        acc2 = acc2 + c * c;
      });
      const float stdv = std::sqrt(hsum(acc2) / static_cast<float>(d));
      // the reference rounds mean, std, std*m and the cutoff to x.dtype
      const float scaled = round_scalar<T>(round_scalar<T>(stdv) * mult);
      const fVec cutoff(round_scalar<T>(round_scalar<T>(mean) + scaled));
      const fVec zero(0.f);
      for_each_vec(d, [&](int64_t j, int64_t n) {
        fVec s = at::vec::maximum(round_vec<T>(load_n(g + j, n) - cutoff), zero);
        fVec act = round_vec<T>(tanh ? tanh_gelu(s) : erf_gelu(s));
        store_nt(o + j, act * load_n(u + j, n), n);
      });
    });
  });
}

void gelu_new_out(at::Tensor& out, const at::Tensor& x) {
  check_unary_args("gelu_new", out, x);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "gelu_new", [&] {
    unary<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), x.numel(),
                    [](const fVec& v) { return tanh_gelu(v); });
  });
}

void gelu_fast_out(at::Tensor& out, const at::Tensor& x) {
  check_unary_args("gelu_fast", out, x);
  const fVec k0(0.7978845608f), k1(0.044715f), one(1.f);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "gelu_fast", [&] {
    unary<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), x.numel(),
                    [&](const fVec& v) { return tanh_form(v, v * k0 * (one + k1 * v * v)); });
  });
}

void quick_gelu_out(at::Tensor& out, const at::Tensor& x) {
  check_unary_args("quick_gelu", out, x);
  const fVec k(-1.702f), one(1.f);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "quick_gelu", [&] {
    unary<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), x.numel(),
                    [&](const fVec& v) { return v / (one + (k * v).exp_u20()); });
  });
}

void relu2_out(at::Tensor& out, const at::Tensor& x) {
  check_unary_args("relu2", out, x);
  const fVec zero(0.f);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "relu2", [&] {
    unary<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), x.numel(),
                    [&](const fVec& v) {
                      const fVec r = at::vec::maximum(v, zero);
                      return r * r;
                    });
  });
}

void xielu_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& alpha_p,
               const at::Tensor& alpha_n, double beta, double eps) {
  check_unary_args("xielu", out, x);
  TORCH_CHECK_VALUE(alpha_p.numel() == 1 && alpha_n.numel() == 1 &&
                        alpha_p.scalar_type() == alpha_n.scalar_type() && alpha_p.is_cpu() &&
                        alpha_n.is_cpu(),
                    "opmux::xielu (provider 'cpp'): arguments 'alpha_p'/'alpha_n' expected one "
                    "CPU value each of one dtype, got ",
                    alpha_p.sizes(), " ", alpha_p.scalar_type(), " and ", alpha_n.sizes(), " ",
                    alpha_n.scalar_type());
  // softplus and beta + softplus happen in the parameters' dtype, as in the reference
  float ap = 0.f, an = 0.f;
  OPMUX_DISPATCH_FLOATS(alpha_p.scalar_type(), "xielu", [&] {
    ap = round_scalar<scalar_t>(softplus(scalar_value<scalar_t>(alpha_p)));
    an = round_scalar<scalar_t>(static_cast<float>(beta) +
                                round_scalar<scalar_t>(softplus(scalar_value<scalar_t>(alpha_n))));
  });
  const fVec apv(ap), anv(an), bv(static_cast<float>(beta)), ev(static_cast<float>(eps)),
      zero(0.f);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "xielu", [&] {
    unary<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), x.numel(),
                    [&](const fVec& v) {
                      const fVec pos = apv * v * v + bv * v;
                      const fVec neg = (expm1_fast(at::vec::minimum(v, ev)) - v) * anv + bv * v;
                      return fVec::blendv(neg, pos, v > zero);
                    });
  });
}

// This file's ops in torch.ops.opmux_cpu (op_library.h).
TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def("silu_and_mul_out(Tensor(a!) out, Tensor x) -> ()", cpu_kernel(&silu_and_mul_out));
  m.def(
      "gelu_and_mul_out(Tensor(a!) out, Tensor x, str approximate) -> ()",
      cpu_kernel(&gelu_and_mul_out));
  m.def(
      "fatrelu_and_mul_out(Tensor(a!) out, Tensor x, float threshold) -> ()",
      cpu_kernel(&fatrelu_and_mul_out));
  m.def("mul_and_silu_out(Tensor(a!) out, Tensor x) -> ()", cpu_kernel(&mul_and_silu_out));
  m.def(
      "swigluoai_and_mul_out(Tensor(a!) out, Tensor x, float alpha, float limit) -> ()",
      cpu_kernel(&swigluoai_and_mul_out));
  m.def(
      "gelu_and_mul_sparse_out(Tensor(a!) out, Tensor x, float std_multiplier, "
      "str approximate) -> ()",
      cpu_kernel(&gelu_and_mul_sparse_out));
  m.def("gelu_new_out(Tensor(a!) out, Tensor x) -> ()", cpu_kernel(&gelu_new_out));
  m.def("gelu_fast_out(Tensor(a!) out, Tensor x) -> ()", cpu_kernel(&gelu_fast_out));
  m.def("quick_gelu_out(Tensor(a!) out, Tensor x) -> ()", cpu_kernel(&quick_gelu_out));
  m.def("relu2_out(Tensor(a!) out, Tensor x) -> ()", cpu_kernel(&relu2_out));
  m.def(
      "xielu_out(Tensor(a!) out, Tensor x, Tensor alpha_p, Tensor alpha_n, float beta, "
      "float eps) -> ()",
      cpu_kernel(&xielu_out));
}

}  // namespace opmux_cpu

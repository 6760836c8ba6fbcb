// rms_norm and fused_add_rms_norm: one pass for the sum of squares, one for the scaled output,
// both in fp32 registers; rows split across threads.
// gemma_rms_norm, gemma_fused_add_rms_norm and rms_norm_gated: fp32 math in registers, one
// rounding to the input dtype, rows split across threads. The weight may be the input dtype
// or fp32 (Gemma checkpoints keep either).
#include "kernels.h"
#include "norm_rows.h"
#include "op_library.h"

#include <cmath>
#include <optional>
#include <vector>

namespace opmux_cpu {
namespace {

template <typename T>
void fused_add_rms_norm_rows(T* out, T* res_out, const T* x, const T* res, const T* w,
                             int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
    // the new residual row, in fp32, stays in L1/L2 for the second pass; both outputs are
    // written with non-temporal stores
    thread_local std::vector<float> row;
    if (static_cast<int64_t>(row.size()) < d + kF) row.resize(d + kF);
    float* buf = row.data();
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      const T* rr = res + r * d;
      T* ro = res_out + r * d;
      T* orow = out + r * d;
      fVec acc(0.f);
      for_each_vec(d, [&](int64_t j, int64_t n) {
        fVec s = load_n(xr + j, n) + load_n(rr + j, n);
        if constexpr (!std::is_same_v<T, float>) {
          // the new residual is stored in T: normalise exactly the stored (rounded) values
          T tmp[kF];
          store_f(tmp, s);
          s = load_f(tmp, n);
        }
        s.store(buf + j, n);
        store_nt(ro + j, s, n);
        acc = at::vec::fmadd(s, s, acc);
      });
      const fVec inv(inv_rms(hsum(acc), d, eps));
      for_each_vec(d, [&](int64_t j, int64_t n) {
        store_nt(orow + j, fVec::loadu(buf + j, n) * inv * load_n(w + j, n), n);
      });
    }
    stream_fence();
  });
}

}  // namespace

void rms_norm_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args("rms_norm", out, x, weight, false);
  const int64_t d = x.size(-1);
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  advise_huge_pages(out);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "rms_norm", [&] {
    norm_rows<false>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                     weight.const_data_ptr<scalar_t>(), rows, d, static_cast<float>(eps));
  });
}

void fused_add_rms_norm_out(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x,
                            const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_norm_args("fused_add_rms_norm", out, x, weight, false);
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                        residual.is_contiguous(),
                    "opmux::fused_add_rms_norm (provider 'cpp'): residual must be contiguous ",
                    x.sizes(), " ", x.scalar_type(), ", got ", residual.sizes(), " ",
                    residual.scalar_type());
  TORCH_CHECK_VALUE(residual_out.sizes() == x.sizes() &&
                        residual_out.scalar_type() == x.scalar_type() &&
                        residual_out.is_contiguous(),
                    "opmux::fused_add_rms_norm (provider 'cpp'): residual_out must be contiguous ",
                    x.sizes(), " ", x.scalar_type());
  const int64_t d = x.size(-1);
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  advise_huge_pages(out);
  advise_huge_pages(residual_out);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "fused_add_rms_norm", [&] {
    fused_add_rms_norm_rows<scalar_t>(
        out.data_ptr<scalar_t>(), residual_out.data_ptr<scalar_t>(),
        x.const_data_ptr<scalar_t>(), residual.const_data_ptr<scalar_t>(),
        weight.const_data_ptr<scalar_t>(), rows, d, static_cast<float>(eps));
  });
}

namespace {

void check_like(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK_VALUE(t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type() &&
                        t.is_contiguous(),
                    "opmux::", op, " (provider 'cpp'): ", name, " must be contiguous ", x.sizes(),
                    " ", x.scalar_type(), ", got ", t.sizes(), " ", t.scalar_type());
}

template <typename T, typename W>
void gemma_add_rows(T* out, T* res_out, const T* x, const T* res, const W* w, int64_t rows,
                    int64_t d, float eps) {
  at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
    // the fp32 sum (not its rounding: the output normalises the exact sum) stays in cache
    thread_local std::vector<float> row;
    if (static_cast<int64_t>(row.size()) < d + kF) row.resize(d + kF);
    float* buf = row.data();
    for (int64_t r = begin; r < end; ++r) {
      fVec acc(0.f);
      for_each_vec(d, [&](int64_t j, int64_t n) {
        const fVec s = load_n(x + r * d + j, n) + load_n(res + r * d + j, n);
        s.store(buf + j, n);
        store_nt(res_out + r * d + j, s, n);
        acc = at::vec::fmadd(s, s, acc);
      });
      const fVec inv(inv_rms(hsum(acc), d, eps));
      for_each_vec(d, [&](int64_t j, int64_t n) {
        store_nt(out + r * d + j, fVec::loadu(buf + j, n) * inv * load_w<true>(w, j, n), n);
      });
    }
    stream_fence();
  });
}

inline fVec gate_act(const fVec& z, bool sigmoid) {
  // as torch's vectorised CPU kernels: silu(z) = z / (1 + exp(-z)), sigmoid = 1 / (1 + exp(-z))
  const fVec den = fVec(1.0f) + z.neg().exp();
  return sigmoid ? fVec(1.0f) / den : z / den;
}

template <typename T, typename W>
void gated_rows(T* out, const T* x, const W* w, const T* z, int64_t rows, int64_t d,
                int64_t group, bool norm_before_gate, bool sigmoid, float eps) {
  at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> rowbuf, gatebuf;
    if (static_cast<int64_t>(rowbuf.size()) < d + kF) {
      rowbuf.resize(d + kF);
      gatebuf.resize(d + kF);
    }
    float* xs = rowbuf.data();
    float* gs = gatebuf.data();
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      // xs = x (times the gate when gating first), gs = act(z)
      for_each_vec(d, [&](int64_t j, int64_t n) {
        fVec v = load_n(xr + j, n);
        if (z != nullptr) {
          const fVec g = gate_act(load_n(z + r * d + j, n), sigmoid);
          g.store(gs + j, n);
          if (!norm_before_gate) v = v * g;
        }
        v.store(xs + j, n);
      });
      T* orow = out + r * d;
      for (int64_t g0 = 0; g0 < d; g0 += group) {
        const fVec inv(inv_rms(sum_sq(xs + g0, group), group, eps));
        for_each_vec(group, [&](int64_t j, int64_t n) {
          fVec v = fVec::loadu(xs + g0 + j, n) * inv * load_n(w + g0 + j, n);
          if (z != nullptr && norm_before_gate) v = v * fVec::loadu(gs + g0 + j, n);
          store_nt(orow + g0 + j, v, n);
        });
      }
    }
    stream_fence();
  });
}

template <typename Fn>
void with_weight_type(const at::Tensor& x, const at::Tensor& weight, const char* op,
                      const Fn& fn) {
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "norm", [&] {
    if (weight.scalar_type() == at::kFloat) {
      fn(scalar_t{}, float{});
    } else {
      fn(scalar_t{}, scalar_t{});
    }
  });
  (void)op;
}

int64_t rows_of(const at::Tensor& x) {
  const int64_t d = x.size(-1);
  return d == 0 ? 0 : x.numel() / d;
}

}  // namespace

void gemma_rms_norm_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                        double eps) {
  check_norm_args("gemma_rms_norm", out, x, weight, true);
  const int64_t d = x.size(-1);
  advise_huge_pages(out);
  with_weight_type(x, weight, "gemma_rms_norm", [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    norm_rows<true, T, W>(out.data_ptr<T>(), x.const_data_ptr<T>(), weight.const_data_ptr<W>(),
                     rows_of(x), d, static_cast<float>(eps));
  });
}

void gemma_fused_add_rms_norm_out(at::Tensor& out, at::Tensor& residual_out,
                                  const at::Tensor& x, const at::Tensor& residual,
                                  const at::Tensor& weight, double eps) {
  const char* op = "gemma_fused_add_rms_norm";
  check_norm_args(op, out, x, weight, true);
  check_like(op, "residual", residual, x);
  check_like(op, "residual_out", residual_out, x);
  const int64_t d = x.size(-1);
  advise_huge_pages(out);
  advise_huge_pages(residual_out);
  with_weight_type(x, weight, op, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    gemma_add_rows<T, W>(out.data_ptr<T>(), residual_out.data_ptr<T>(), x.const_data_ptr<T>(),
                         residual.const_data_ptr<T>(), weight.const_data_ptr<W>(), rows_of(x),
                         d, static_cast<float>(eps));
  });
}

void rms_norm_gated_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& z, double eps, int64_t group_size,
                        bool norm_before_gate, bool sigmoid) {
  const char* op = "rms_norm_gated";
  check_norm_args(op, out, x, weight, true);
  if (z.has_value()) check_like(op, "z", *z, x);
  const int64_t d = x.size(-1);
  const int64_t group = group_size <= 0 ? d : group_size;
  TORCH_CHECK_VALUE(d == 0 || (group > 0 && d % group == 0), "opmux::rms_norm_gated (provider "
                    "'cpp'): group_size must divide x's last dimension ", d, ", got ", group_size);
  advise_huge_pages(out);
  with_weight_type(x, weight, op, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    gated_rows<T, W>(out.data_ptr<T>(), x.const_data_ptr<T>(), weight.const_data_ptr<W>(),
                     z.has_value() ? z->const_data_ptr<T>() : nullptr, rows_of(x), d, group,
                     norm_before_gate, sigmoid, static_cast<float>(eps));
  });
}

// This file's ops in torch.ops.opmux_cpu (op_library.h).
TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def(
      "rms_norm_out(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()",
      cpu_kernel(&rms_norm_out));
  m.def(
      "fused_add_rms_norm_out(Tensor(a!) out, Tensor(b!) residual_out, Tensor x, "
      "Tensor residual, Tensor weight, float eps) -> ()",
      cpu_kernel(&fused_add_rms_norm_out));
  m.def(
      "gemma_rms_norm_out(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()",
      cpu_kernel(&gemma_rms_norm_out));
  m.def(
      "gemma_fused_add_rms_norm_out(Tensor(a!) out, Tensor(b!) residual_out, Tensor x, "
      "Tensor residual, Tensor weight, float eps) -> ()",
      cpu_kernel(&gemma_fused_add_rms_norm_out));
  // group_size <= 0: one group per row; sigmoid selects the gate (else SiLU).
  m.def(
      "rms_norm_gated_out(Tensor(a!) out, Tensor x, Tensor weight, Tensor? z, float eps, "
      "int group_size, bool norm_before_gate, bool sigmoid) -> ()",
      cpu_kernel(&rms_norm_gated_out));
}

}  // namespace opmux_cpu

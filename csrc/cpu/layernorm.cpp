// rms_norm and fused_add_rms_norm: one pass for the sum of squares, one for the scaled output,
// both in fp32 registers; rows split across threads.
#include "norm_rows.h"
#include "op_library.h"

#include <cmath>
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

// This file's ops in torch.ops.opmux_cpu (op_library.h).
TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def(
      "rms_norm_out(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()",
      cpu_kernel(&rms_norm_out));
  m.def(
      "fused_add_rms_norm_out(Tensor(a!) out, Tensor(b!) residual_out, Tensor x, "
      "Tensor residual, Tensor weight, float eps) -> ()",
      cpu_kernel(&fused_add_rms_norm_out));
}

}  // namespace opmux_cpu

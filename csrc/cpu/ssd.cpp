// Mamba-2 SSD scan (ssd_chunk_scan prefill and ssd_state_update decode): the per-token
// recurrence, one (sequence, head) pair per task, the [head_dim, state_size] state kept in
// fp32 in a local buffer (L1/L2-resident) while the sequence's tokens stream through it.
// Per token and head channel p: s = exp(dt*A) * s + (dt*x_p) * B; y_p = <s, C> + D_p*x_p,
// gated by silu(z_p). States are read from and written back to the cache slot of the sequence.
#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "op_library.h"
#include "vec_common.h"

namespace opmux_cpu {
namespace {

struct ScanArgs {
  int64_t heads, head_dim, state_size, rep, batch;
  bool softplus;
  double dt_min, dt_max;  // dt_max < 0: no upper clamp
};

inline float process_dt(float d, const ScanArgs& a) {
  if (a.softplus) d = d > 20.f ? d : std::log1p(std::exp(d));
  // as vLLM: clamped (below at dt_min) only when a limit is set
  if (a.dt_min > 0.0 || a.dt_max >= 0.0) d = std::max(d, static_cast<float>(a.dt_min));
  if (a.dt_max >= 0.0) d = std::min(d, static_cast<float>(a.dt_max));
  return d;
}

template <typename T, typename S>
void ssd_scan_impl(at::Tensor& out, at::Tensor& ssm_state, const at::Tensor& x,
                   const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                   const at::Tensor& C, const float* D, const std::optional<at::Tensor>& z,
                   const float* dt_bias, const int64_t* slots, const int64_t* bounds,
                   const bool* has_init, const ScanArgs& a) {
  const int64_t P = a.head_dim, N = a.state_size;
  const T* xp = x.const_data_ptr<T>();
  const T* dtp = dt.const_data_ptr<T>();
  const float* Ap = A.const_data_ptr<float>();
  const T* Bp = B.const_data_ptr<T>();
  const T* Cp = C.const_data_ptr<T>();
  const T* zp = z ? z->const_data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  S* sp = ssm_state.data_ptr<S>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t ds0 = dt.stride(0), ds1 = dt.stride(1);
  const int64_t bs0 = B.stride(0), bs1 = B.stride(1), cs0 = C.stride(0), cs1 = C.stride(1);
  const int64_t zs0 = z ? z->stride(0) : 0, zs1 = z ? z->stride(1) : 0,
                zs2 = z ? z->stride(2) : 0;
  const int64_t ss0 = ssm_state.stride(0), ss1 = ssm_state.stride(1);
  at::parallel_for(0, a.batch * a.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> state(P * N), brow(N), crow(N);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / a.heads, h = item % a.heads, g = h / a.rep;
      const int64_t lo = bounds ? bounds[i] : i, hi = bounds ? bounds[i + 1] : i + 1;
      S* slot = sp + slots[i] * ss0 + h * ss1;
      if (has_init == nullptr || has_init[i]) {
        for (int64_t k = 0; k < P * N; ++k) state[k] = static_cast<float>(slot[k]);
      } else {
        std::fill(state.begin(), state.end(), 0.f);
      }
      const float Ah = Ap[h];
      const float bias = dt_bias ? dt_bias[h] : 0.f;
      for (int64_t t = lo; t < hi; ++t) {
        const float d = process_dt(static_cast<float>(dtp[t * ds0 + h * ds1]) + bias, a);
        const float decay_s = std::exp(d * Ah);
        const fVec decay(decay_s);
        const T* bsrc = Bp + t * bs0 + g * bs1;
        const T* csrc = Cp + t * cs0 + g * cs1;
        for (int64_t n = 0; n < N; ++n) {
          brow[n] = static_cast<float>(bsrc[n]);
          crow[n] = static_cast<float>(csrc[n]);
        }
        for (int64_t p = 0; p < P; ++p) {
          const float xv = static_cast<float>(xp[t * xs0 + h * xs1 + p * xs2]);
          const float dx_s = d * xv;
          const fVec dx(dx_s);
          float* s = state.data() + p * N;
          fVec acc(0.f);
          int64_t n = 0;
          for (; n + kF <= N; n += kF) {
            const fVec sv = at::vec::fmadd(dx, fVec::loadu(brow.data() + n),
                                        decay * fVec::loadu(s + n));
            sv.store(s + n);
            acc = at::vec::fmadd(sv, fVec::loadu(crow.data() + n), acc);
          }
          float y = hsum(acc);
          for (; n < N; ++n) {
            s[n] = s[n] * decay_s + dx_s * brow[n];
            y += s[n] * crow[n];
          }
          if (D) y += D[h * P + p] * xv;
          if (zp) {
            const float zv = static_cast<float>(zp[t * zs0 + h * zs1 + p * zs2]);
            y *= zv / (1.f + std::exp(-zv));
          }
          op[(t * a.heads + h) * P + p] = static_cast<T>(y);
        }
      }
      for (int64_t k = 0; k < P * N; ++k) slot[k] = static_cast<S>(state[k]);
    }
  });
}

}  // namespace

void ssd_scan_out(at::Tensor& out, at::Tensor& ssm_state, const at::Tensor& x,
                  const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                  const at::Tensor& C, const std::optional<at::Tensor>& D,
                  const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& dt_bias,
                  const at::Tensor& state_indices,
                  const std::optional<at::Tensor>& query_start_loc,
                  const std::optional<at::Tensor>& has_initial_state, bool dt_softplus,
                  double dt_min, double dt_max) {
#define SSD_CHECK(cond, ...) OPMUX_CHECK("ssd_chunk_scan", cond, __VA_ARGS__)
  SSD_CHECK(x.dim() == 3, "x must be [tokens, heads, head_dim], got ", x.sizes());
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2);
  SSD_CHECK(B.dim() == 3 && B.size(0) == T && C.sizes() == B.sizes() && B.stride(2) == 1 &&
                C.stride(2) == 1 && B.size(1) > 0 && H % B.size(1) == 0,
            "B and C must be [", T, ", groups, state_size] with unit-stride rows, got ",
            B.sizes(), " and ", C.sizes());
  const int64_t N = B.size(2);
  const auto st = x.scalar_type();
  SSD_CHECK(dt.scalar_type() == st && B.scalar_type() == st && C.scalar_type() == st &&
                (!z || z->scalar_type() == st),
            "dt, B, C and z must share x's dtype ", st);
  SSD_CHECK(dt.dim() == 2 && dt.size(0) == T && dt.size(1) == H, "dt must be [", T, ", ", H,
            "], got ", dt.sizes());
  SSD_CHECK(!z || z->sizes() == x.sizes(), "z must be shaped like x");
  SSD_CHECK(A.scalar_type() == at::kFloat && A.is_contiguous() && A.numel() == H,
            "A must be a contiguous float32 [", H, "] tensor");
  SSD_CHECK(!D || (D->scalar_type() == at::kFloat && D->is_contiguous() && D->numel() == H * P),
            "D must be a contiguous float32 [", H, ", ", P, "] tensor");
  SSD_CHECK(!dt_bias || (dt_bias->scalar_type() == at::kFloat && dt_bias->is_contiguous() &&
                         dt_bias->numel() == H),
            "dt_bias must be a contiguous float32 [", H, "] tensor");
  SSD_CHECK(ssm_state.dim() == 4 && ssm_state.size(1) == H && ssm_state.size(2) == P &&
                ssm_state.size(3) == N && ssm_state.stride(3) == 1 && ssm_state.stride(2) == N,
            "ssm_state must be [slots, ", H, ", ", P, ", ", N,
            "] with contiguous [head_dim, state_size] blocks, got ", ssm_state.sizes(),
            " strides ", ssm_state.strides());
  SSD_CHECK(ssm_state.scalar_type() == at::kFloat || ssm_state.scalar_type() == st,
            "ssm_state must be float32 or x's dtype, got ", ssm_state.scalar_type());
  SSD_CHECK(state_indices.scalar_type() == at::kLong && state_indices.is_contiguous() &&
                state_indices.dim() == 1,
            "state_indices must be a contiguous int64 vector");
  const int64_t batch = state_indices.size(0);
  if (query_start_loc) {
    SSD_CHECK(query_start_loc->scalar_type() == at::kLong && query_start_loc->is_contiguous() &&
                  query_start_loc->numel() == batch + 1,
              "query_start_loc must be a contiguous int64 [", batch + 1, "] tensor");
  } else {
    SSD_CHECK(batch == T, "state_indices must have one slot per token in decode, got ", batch);
  }
  SSD_CHECK(!has_initial_state || (has_initial_state->scalar_type() == at::kBool &&
                                   has_initial_state->is_contiguous() &&
                                   has_initial_state->numel() == batch),
            "has_initial_state must be a contiguous bool [", batch, "] tensor");
  SSD_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == st,
            "out must be contiguous like x");
  const int64_t* slots = state_indices.const_data_ptr<int64_t>();
  const int64_t* bounds = query_start_loc ? query_start_loc->const_data_ptr<int64_t>() : nullptr;
  const int64_t slot_count = ssm_state.size(0);
  for (int64_t i = 0; i < batch; ++i) {
    SSD_CHECK(slots[i] >= 0 && slots[i] < slot_count, "state_indices must lie in [0, ",
              slot_count, "), got ", slots[i]);
    if (bounds) {
      SSD_CHECK(bounds[i] <= bounds[i + 1] && bounds[0] == 0 && bounds[batch] == T,
                "query_start_loc must rise from 0 to ", T);
    }
  }
#undef SSD_CHECK
  const ScanArgs args{H, P, N, H / B.size(1), batch, dt_softplus, dt_min, dt_max};
  const float* Dp = D ? D->const_data_ptr<float>() : nullptr;
  const float* bp = dt_bias ? dt_bias->const_data_ptr<float>() : nullptr;
  const bool* hp = has_initial_state ? has_initial_state->const_data_ptr<bool>() : nullptr;
  const bool f32_state = ssm_state.scalar_type() == at::kFloat;
  OPMUX_DISPATCH_FLOATS(st, "ssd_chunk_scan", [&] {
    if (f32_state) {
      ssd_scan_impl<scalar_t, float>(out, ssm_state, x, dt, A, B, C, Dp, z, bp, slots, bounds,
                                     hp, args);
    } else {
      ssd_scan_impl<scalar_t, scalar_t>(out, ssm_state, x, dt, A, B, C, Dp, z, bp, slots,
                                        bounds, hp, args);
    }
  });
}

// This file's ops in torch.ops.opmux_cpu (op_library.h).
TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  // query_start_loc None: decode, one token per slot. dt_max < 0: no upper clamp.
  m.def(
      "ssd_scan_out(Tensor(a!) out, Tensor(b!) ssm_state, Tensor x, Tensor dt, Tensor A, "
      "Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, Tensor state_indices, "
      "Tensor? query_start_loc, Tensor? has_initial_state, bool dt_softplus, float dt_min, "
      "float dt_max) -> ()",
      cpu_kernel(&ssd_scan_out));
}

}  // namespace opmux_cpu

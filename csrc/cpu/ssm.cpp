// State-space kernels: the causal depthwise convolution (prefill and decode) and the Mamba-1
// selective scan (prefill and decode), over packed sequences with per-sequence state slots.
//
// Both kernels vectorize across channels: activations are token-major [T, dim], so one
// token row of kF channels is a single vector load, and each (sequence, channel block) is an
// independent task whose recurrence runs in fp32 registers (the conv window, or the
// [dstate] x kF scan state). Python (plugins/cpu/cpp_ssm.py) validates every argument with
// the native checks first; the checks here guard the memory accesses.
//
// Sequences: with query_start_loc, sequence i is rows [qsl[i], qsl[i+1]); without it every
// row is its own sequence (decode). Slot -1 is padding: output rows zero, state untouched.
#include "op_library.h"
#include "vec_common.h"

#include <algorithm>

namespace opmux_cpu {
namespace {

constexpr int64_t kMaxWidth = 8;     // conv taps kept in registers
constexpr int64_t kMaxState = 256;   // scan state size kept in registers

// Reads an int32 or int64 index tensor (or yields a default when it is absent).
struct Index {
  const int32_t* p32 = nullptr;
  const int64_t* p64 = nullptr;
  explicit Index(const std::optional<at::Tensor>& t) {
    if (!t.has_value()) return;
    if (t->scalar_type() == at::kInt) {
      p32 = t->const_data_ptr<int32_t>();
    } else {
      p64 = t->const_data_ptr<int64_t>();
    }
  }
  bool present() const { return p32 != nullptr || p64 != nullptr; }
  int64_t at(int64_t i, int64_t fallback) const {
    return p32 ? p32[i] : (p64 ? p64[i] : fallback);
  }
};

struct Segments {
  Index qsl, slots;
  const bool* init;
  bool init_default;
  int64_t count;
  int64_t begin(int64_t s) const { return qsl.at(s, s); }
  int64_t end(int64_t s) const { return qsl.present() ? qsl.at(s + 1, 0) : s + 1; }
  int64_t slot(int64_t s) const { return slots.at(s, s); }
  bool has_init(int64_t s) const { return init ? init[s] : init_default; }
};

Segments make_segments(int64_t rows, const std::optional<at::Tensor>& qsl,
                       const std::optional<at::Tensor>& slots,
                       const std::optional<at::Tensor>& init, bool init_default) {
  Segments seg{Index(qsl), Index(slots),
               init.has_value() ? init->const_data_ptr<bool>() : nullptr, init_default,
               qsl.has_value() ? qsl->numel() - 1 : rows};
  return seg;
}

template <typename T>
inline fVec gather(const T* p, int64_t stride, int64_t n) {
  float tmp[kF] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i * stride]);
  return fVec::loadu(tmp);
}

template <typename T>
inline void scatter(T* p, int64_t stride, const fVec& v, int64_t n) {
  float tmp[kF];
  v.store(tmp);
  for (int64_t i = 0; i < n; ++i) p[i * stride] = static_cast<T>(tmp[i]);
}

inline fVec silu(const fVec& v) { return v / (fVec(1.f) + v.neg().exp_u20()); }

// body(s, c0, n, t0, t1, slot) for every task (segment s, columns c0..c0+n of a kF block)
// whose segment has a state slot, in parallel; a padding segment's (slot < 0) rows t0..t1
// of out [*, dim] become zero there.
template <typename T, typename Body>
void for_segment_blocks(T* out, int64_t dim, const Segments& seg, const Body& body) {
  const int64_t blocks = (dim + kF - 1) / kF;
  at::parallel_for(0, seg.count * blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t s = task / blocks, c0 = (task % blocks) * kF;
      const int64_t n = std::min(kF, dim - c0);
      const int64_t t0 = seg.begin(s), t1 = seg.end(s), slot = seg.slot(s);
      if (slot < 0) {
        for (int64_t t = t0; t < t1; ++t) store_n(out + t * dim + c0, fVec(0.f), n);
        continue;
      }
      body(s, c0, n, t0, t1, slot);
    }
  });
}

template <typename T, typename S>
void conv_kernel(T* out, const T* x, const T* weight, const T* bias, S* states, int64_t dim,
                 int64_t width, const Segments& seg, bool act) {
  const int64_t hist = width - 1;
  for_segment_blocks(out, dim, seg, [&](int64_t s, int64_t c0, int64_t n, int64_t t0, int64_t t1,
                                        int64_t slot) {
    fVec w[kMaxWidth], win[kMaxWidth];
    for (int64_t k = 0; k < width; ++k) w[k] = gather(weight + c0 * width + k, width, n);
    const fVec b = bias ? load_n(bias + c0, n) : fVec(0.f);
    S* st = states + (slot * dim + c0) * hist;
    const bool init = seg.has_init(s);
    for (int64_t k = 0; k < hist; ++k) win[k] = init ? gather(st + k, hist, n) : fVec(0.f);
    for (int64_t t = t0; t < t1; ++t) {
      const fVec xv = load_n(x + t * dim + c0, n);
      fVec acc = at::vec::fmadd(w[hist], xv, b);
      for (int64_t k = 0; k < hist; ++k) acc = at::vec::fmadd(w[k], win[k], acc);
      for (int64_t k = 0; k + 1 < hist; ++k) win[k] = win[k + 1];
      win[hist - 1] = xv;
      store_n(out + t * dim + c0, act ? silu(acc) : acc, n);
    }
    for (int64_t k = 0; k < hist; ++k) scatter(st + k, hist, win[k], n);
  });
}

struct ScanArgs {
  int64_t dim, dstate;
  const float *A, *D, *dt_bias;
  bool softplus;
};

template <typename T, typename S>
void scan_kernel(T* out, const T* u, const T* delta, const T* B, const T* C, const T* z,
                 S* states, const ScanArgs& a, const Segments& seg) {
  const int64_t dim = a.dim, ns = a.dstate;
  const fVec twenty(20.f);
  for_segment_blocks(out, dim, seg, [&](int64_t s, int64_t c0, int64_t n, int64_t t0, int64_t t1,
                                        int64_t slot) {
    fVec h[kMaxState], At[kMaxState];
    S* st = states + (slot * dim + c0) * ns;
    const bool init = seg.has_init(s);
    for (int64_t j = 0; j < ns; ++j) {
      At[j] = gather(a.A + c0 * ns + j, ns, n);
      h[j] = init ? gather(st + j, ns, n) : fVec(0.f);
    }
    const fVec Dv = a.D ? load_n(a.D + c0, n) : fVec(0.f);
    const fVec bias = a.dt_bias ? load_n(a.dt_bias + c0, n) : fVec(0.f);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t row = t * dim + c0;
      fVec dt = load_n(delta + row, n) + bias;
      if (a.softplus) dt = fVec::blendv(dt.exp_u20().log1p(), dt, dt > twenty);
      const fVec uv = load_n(u + row, n);
      const fVec dtu = dt * uv;
      const T* Bt = B + t * ns;
      const T* Ct = C + t * ns;
      fVec y(0.f);
      for (int64_t j = 0; j < ns; ++j) {
        const fVec decay = (dt * At[j]).exp_u20();
        h[j] = at::vec::fmadd(decay, h[j], dtu * fVec(static_cast<float>(Bt[j])));
        y = at::vec::fmadd(h[j], fVec(static_cast<float>(Ct[j])), y);
      }
      y = at::vec::fmadd(Dv, uv, y);
      if (z) y = y * silu(load_n(z + row, n));
      store_n(out + row, y, n);
    }
    for (int64_t j = 0; j < ns; ++j) scatter(st + j, ns, h[j], n);
  });
}

void check_common(const char* what, const at::Tensor& out, const at::Tensor& x,
                  const at::Tensor& states) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous() && out.sizes() == x.sizes() &&
                        out.is_contiguous() && out.scalar_type() == x.scalar_type() &&
                        states.is_contiguous() && states.dim() == 3 &&
                        states.size(1) == x.size(1),
                    "opmux::", what, " (provider 'cpp'): expected contiguous x [T, dim], out "
                    "like x and contiguous states [slots, dim, k]; got x ", x.sizes(), ", out ",
                    out.sizes(), ", states ", states.sizes());
}

// Runs body with state_t bound to float or to scalar_t (the two state dtypes served).
template <typename scalar_t, typename Body>
void with_state_type(const char* what, at::ScalarType st, const Body& body) {
  if (st == at::kFloat) {
    body(static_cast<float*>(nullptr));
  } else {
    TORCH_CHECK_VALUE(st == c10::CppTypeToScalarType<scalar_t>::value, "opmux::", what,
                      " (provider 'cpp'): states must be float32 or the input's dtype, got ",
                      st);
    body(static_cast<scalar_t*>(nullptr));
  }
}

void conv_out(const char* what, at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
              const std::optional<at::Tensor>& bias, at::Tensor& states, const Segments& seg,
              bool silu_act) {
  check_common(what, out, x, states);
  const int64_t dim = x.size(1), width = weight.size(1);
  TORCH_CHECK_VALUE(weight.is_contiguous() && weight.size(0) == dim && width >= 2 &&
                        width <= kMaxWidth && states.size(2) == width - 1 &&
                        weight.scalar_type() == x.scalar_type() &&
                        (!bias || (bias->is_contiguous() && bias->numel() == dim &&
                                   bias->scalar_type() == x.scalar_type())),
                    "opmux::", what, " (provider 'cpp'): weight must be contiguous [", dim,
                    ", 2..", kMaxWidth, "] in x's dtype; got ", weight.sizes());
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "causal_conv1d", [&] {
    with_state_type<scalar_t>(what, states.scalar_type(), [&](auto* tag) {
      using state_t = std::remove_pointer_t<decltype(tag)>;
      conv_kernel<scalar_t, state_t>(
          out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
          weight.const_data_ptr<scalar_t>(), bias ? bias->const_data_ptr<scalar_t>() : nullptr,
          states.data_ptr<state_t>(), dim, width, seg, silu_act);
    });
  });
}

void scan_out(const char* what, at::Tensor& out, const at::Tensor& u, at::Tensor& states,
              const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
              const at::Tensor& C, const std::optional<at::Tensor>& D,
              const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& dt_bias,
              bool softplus, const Segments& seg) {
  check_common(what, out, u, states);
  const int64_t rows = u.size(0), dim = u.size(1), ns = A.size(1);
  auto f32_vec = [&](const std::optional<at::Tensor>& t) {
    return !t || (t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == dim);
  };
  TORCH_CHECK_VALUE(
      A.scalar_type() == at::kFloat && A.is_contiguous() && A.size(0) == dim && ns <= kMaxState &&
          states.size(2) == ns && delta.sizes() == u.sizes() && delta.is_contiguous() &&
          B.is_contiguous() && C.is_contiguous() && B.size(0) == rows && B.size(1) == ns &&
          C.sizes() == B.sizes() && delta.scalar_type() == u.scalar_type() &&
          B.scalar_type() == u.scalar_type() && C.scalar_type() == u.scalar_type() &&
          (!z || (z->sizes() == u.sizes() && z->is_contiguous() &&
                  z->scalar_type() == u.scalar_type())) &&
          f32_vec(D) && f32_vec(dt_bias),
      "opmux::", what, " (provider 'cpp'): expected contiguous delta/z like u, B/C [", rows,
      ", dstate <= ", kMaxState, "] in u's dtype, fp32 A [dim, dstate], D and bias; got A ",
      A.sizes(), " ", A.scalar_type(), ", B ", B.sizes());
  const ScanArgs args{dim, ns, A.const_data_ptr<float>(),
                      D ? D->const_data_ptr<float>() : nullptr,
                      dt_bias ? dt_bias->const_data_ptr<float>() : nullptr, softplus};
  OPMUX_DISPATCH_FLOATS(u.scalar_type(), "selective_scan", [&] {
    with_state_type<scalar_t>(what, states.scalar_type(), [&](auto* tag) {
      using state_t = std::remove_pointer_t<decltype(tag)>;
      scan_kernel<scalar_t, state_t>(
          out.data_ptr<scalar_t>(), u.const_data_ptr<scalar_t>(),
          delta.const_data_ptr<scalar_t>(), B.const_data_ptr<scalar_t>(),
          C.const_data_ptr<scalar_t>(), z ? z->const_data_ptr<scalar_t>() : nullptr,
          states.data_ptr<state_t>(), args, seg);
    });
  });
}

}  // namespace

void causal_conv1d_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, at::Tensor& conv_states,
                       const std::optional<at::Tensor>& query_start_loc,
                       const std::optional<at::Tensor>& cache_indices,
                       const std::optional<at::Tensor>& has_initial_state, bool silu) {
  const auto seg = make_segments(x.size(0), query_start_loc, cache_indices, has_initial_state,
                                 !query_start_loc.has_value());
  conv_out(query_start_loc ? "causal_conv1d" : "causal_conv1d_update", out, x, weight, bias,
           conv_states, seg, silu);
}

void selective_scan_out(at::Tensor& out, const at::Tensor& u, at::Tensor& ssm_states,
                        const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                        const at::Tensor& C, const std::optional<at::Tensor>& D,
                        const std::optional<at::Tensor>& z,
                        const std::optional<at::Tensor>& delta_bias, bool delta_softplus,
                        const std::optional<at::Tensor>& query_start_loc,
                        const std::optional<at::Tensor>& cache_indices,
                        const std::optional<at::Tensor>& has_initial_state) {
  const auto seg = make_segments(u.size(0), query_start_loc, cache_indices, has_initial_state,
                                 !query_start_loc.has_value());
  scan_out(query_start_loc ? "selective_scan" : "selective_state_update", out, u, ssm_states,
           delta, A, B, C, D, z, delta_bias, delta_softplus, seg);
}

// This file's ops in torch.ops.opmux_cpu (op_library.h).
TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def(
      "causal_conv1d_out(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, "
      "Tensor(b!) conv_states, Tensor? query_start_loc, Tensor? cache_indices, "
      "Tensor? has_initial_state, bool silu) -> ()",
      cpu_kernel(&causal_conv1d_out));
  m.def(
      "selective_scan_out(Tensor(a!) out, Tensor u, Tensor(b!) ssm_states, Tensor delta, "
      "Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? delta_bias, "
      "bool delta_softplus, Tensor? query_start_loc, Tensor? cache_indices, "
      "Tensor? has_initial_state) -> ()",
      cpu_kernel(&selective_scan_out));
}

}  // namespace opmux_cpu

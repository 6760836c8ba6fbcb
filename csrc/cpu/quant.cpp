// quant_fp8: fp32 -> float8_e4m3fn with static or dynamic (per-tensor, per-token, per-group)
// scales, bit for bit as the native reference: per-tensor/per-token values are x * (1/scale),
// per-group values x / scale, clamped to +-448, rounded to nearest even.
#include "op_library.h"
#include "vec_common.h"

#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace opmux_cpu {
namespace {

constexpr float kFp8Max = 448.0f;
const float kMinScale = static_cast<float>(1.0 / (448.0 * 512.0));

using Fp8 = c10::Float8_e4m3fn;

// Clamps n lanes of v to [-448, 448] and stores them as e4m3fn. NaN stays NaN, always as
// 0x7f: torch's conversion drops the sign of NaN, the bit-level conversions keep it.
inline void store_fp8(Fp8* p, const fVec& v, int64_t n) {
  const fVec c = at::vec::clamp(v, fVec(-kFp8Max), fVec(kFp8Max));
#if defined(CPU_CAPABILITY_AVX512)
  if (n == kF) {
    const __m128i b = at::vec::cvtfp32_fp8e4m3(c);
    const __m128i neg_nan = _mm_cmpeq_epi8(b, _mm_set1_epi8(static_cast<char>(0xff)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_blendv_epi8(b, _mm_set1_epi8(0x7f), neg_nan));
    return;
  }
#endif
  float tmp[kF];
  c.store(tmp);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = std::isnan(tmp[i]) ? Fp8(0x7f, Fp8::from_bits()) : Fp8(tmp[i]);
  }
}

template <typename T>
float abs_max(const T* p, int64_t n) {
  fVec m(0.f);
  for_each_vec(n, [&](int64_t j, int64_t k) { m = at::vec::maximum(m, load_n(p + j, k).abs()); });
  return hmax(m);
}

// Smallest power of two >= v (v >= 0), exactly: exp2(ceil(log2(v))) without rounding error.
inline float pow2_ceil(float v) {
  if (!(v > 0.0f) || std::isinf(v)) return v == 0.0f ? 0.0f : v;
  int e = 0;
  const float m = std::frexp(v, &e);  // v = m * 2^e, m in [0.5, 1)
  return std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
}

inline float dynamic_scale(float amax) { return std::max(amax / kFp8Max, kMinScale); }

template <typename T>
void quant_row_mul(Fp8* q, const T* x, int64_t n, const fVec& inv) {
  for_each_vec(n, [&](int64_t j, int64_t k) { store_fp8(q + j, load_n(x + j, k) * inv, k); });
}

void check_q(const char* op, const at::Tensor& q, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.is_contiguous(), "opmux::", op,
                    " (provider 'cpp'): x must be contiguous with at least 1 dim, got strides ",
                    x.strides());
  TORCH_CHECK_VALUE(q.sizes() == x.sizes() && q.scalar_type() == at::kFloat8_e4m3fn &&
                        q.is_contiguous(),
                    "opmux::", op, " (provider 'cpp'): q must be a contiguous float8_e4m3fn ",
                    x.sizes(), " tensor, got ", q.sizes(), " ", q.scalar_type());
}

void check_f32(const char* op, const char* name, const at::Tensor& t, int64_t numel) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
                    "opmux::", op, " (provider 'cpp'): ", name, " must be a contiguous float32 "
                    "tensor of ", numel, " elements, got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

void quant_fp8_static_out(at::Tensor& q, const at::Tensor& x, const at::Tensor& scale) {
  const char* op = "quant_fp8";
  check_q(op, q, x);
  TORCH_CHECK_VALUE(scale.dim() == 2 && scale.scalar_type() == at::kFloat &&
                        scale.is_contiguous(),
                    "opmux::quant_fp8 (provider 'cpp'): scale must be a contiguous float32 "
                    "[a, b] tensor, got ", scale.scalar_type(), " ", scale.sizes());
  const int64_t n = x.size(-1);
  const int64_t m = x.dim() >= 2 ? x.size(-2) : 1;
  const int64_t a = scale.size(0), b = scale.size(1);
  TORCH_CHECK_VALUE(a > 0 && b > 0 && m % a == 0 && n % b == 0,
                    "opmux::quant_fp8 (provider 'cpp'): scale [", a, ", ", b,
                    "] must tile x's last two dims [", m, ", ", n, "]");
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const int64_t row_tile = m / a, col_tile = n / b;
  const float* s = scale.const_data_ptr<float>();
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "quant_fp8", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    Fp8* qp = q.data_ptr<Fp8>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)),
                     [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> inv_row;
      int64_t cached = -1;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t sr = (r % m) / row_tile;
        if (b == 1) {
          quant_row_mul(qp + r * n, xp + r * n, n, fVec(1.0f / s[sr]));
          continue;
        }
        if (sr != cached) {  // 1/scale expanded over the row, rebuilt when the scale row changes
          if (static_cast<int64_t>(inv_row.size()) < n) inv_row.resize(n);
          for (int64_t c = 0; c < b; ++c) {
            const float inv = 1.0f / s[sr * b + c];
            std::fill_n(inv_row.data() + c * col_tile, col_tile, inv);
          }
          cached = sr;
        }
        const float* iv = inv_row.data();
        for_each_vec(n, [&](int64_t j, int64_t k) {
          store_fp8(qp + r * n + j, load_n(xp + r * n + j, k) * fVec::loadu(iv + j, k), k);
        });
      }
    });
  });
}

void quant_fp8_dynamic_out(at::Tensor& q, at::Tensor& scale_out, const at::Tensor& x,
                           bool per_token, const std::optional<at::Tensor>& scale_ub) {
  const char* op = "quant_fp8";
  check_q(op, q, x);
  const int64_t n = x.size(-1);
  TORCH_CHECK_VALUE(per_token ? n > 0 : x.numel() > 0,
                    "opmux::quant_fp8 (provider 'cpp'): a dynamic scale needs a non-empty x, "
                    "got ", x.sizes());
  const int64_t rows = x.numel() / n;
  check_f32(op, "scale_out", scale_out, per_token ? rows : 1);
  float ub = std::numeric_limits<float>::infinity();
  if (scale_ub.has_value()) {
    check_f32(op, "scale_ub", *scale_ub, 1);
    ub = scale_ub->const_data_ptr<float>()[0];
  }
  float* sp = scale_out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16384 / n);
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "quant_fp8", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    Fp8* qp = q.data_ptr<Fp8>();
    if (per_token) {
      at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          float amax = abs_max(xp + r * n, n);
          if (!(amax <= ub) && !std::isnan(amax)) amax = ub;
          const float s = dynamic_scale(amax);
          sp[r] = s;
          quant_row_mul(qp + r * n, xp + r * n, n, fVec(1.0f / s));
        }
      });
      return;
    }
    const int64_t total = x.numel();
    const int64_t chunk = 1 << 16;
    const int64_t chunks = (total + chunk - 1) / chunk;
    std::vector<float> partial(chunks, 0.0f);
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        partial[c] = abs_max(xp + c * chunk, std::min(chunk, total - c * chunk));
      }
    });
    float amax = 0.0f;
    for (float v : partial) amax = std::isnan(v) || std::isnan(amax) ? NAN : std::max(amax, v);
    const float s = dynamic_scale(amax);
    sp[0] = s;
    const fVec inv(1.0f / s);
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        quant_row_mul(qp + c * chunk, xp + c * chunk, std::min(chunk, total - c * chunk), inv);
      }
    });
  });
}

void quant_fp8_group_out(at::Tensor& q, at::Tensor& scale_out, const at::Tensor& x,
                         int64_t group_size, bool use_ue8m0) {
  const char* op = "quant_fp8";
  check_q(op, q, x);
  const int64_t n = x.size(-1);
  TORCH_CHECK_VALUE(n > 0 && group_size > 0, "opmux::quant_fp8 (provider 'cpp'): group_size "
                    "must be positive and x's last dimension non-empty, got ", group_size, " and ",
                    x.sizes());
  const int64_t rows = x.numel() / n;
  const int64_t groups = (n + group_size - 1) / group_size;
  check_f32(op, "scale_out", scale_out, rows * groups);
  float* sp = scale_out.data_ptr<float>();
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "quant_fp8", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    Fp8* qp = q.data_ptr<Fp8>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t off = r * n + g * group_size;
          const int64_t len = std::min(group_size, n - g * group_size);
          float raw = abs_max(xp + off, len) / kFp8Max;
          if (use_ue8m0) raw = pow2_ceil(raw);
          const float s = std::max(raw, kMinScale);
          sp[r * groups + g] = s;
          const fVec sv(s);
          for_each_vec(len, [&](int64_t j, int64_t k) {
            store_fp8(qp + off + j, load_n(xp + off + j, k) / sv, k);
          });
        }
      }
    });
  });
}

// This file's ops in torch.ops.opmux_cpu (op_library.h).
TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  // scale: float32 [a, b] tiling x's last two dims.
  m.def(
      "quant_fp8_static_out(Tensor(a!) q, Tensor x, Tensor scale) -> ()",
      cpu_kernel(&quant_fp8_static_out));
  m.def(
      "quant_fp8_dynamic_out(Tensor(a!) q, Tensor(b!) scale_out, Tensor x, bool per_token, "
      "Tensor? scale_ub) -> ()",
      cpu_kernel(&quant_fp8_dynamic_out));
  m.def(
      "quant_fp8_group_out(Tensor(a!) q, Tensor(b!) scale_out, Tensor x, int group_size, "
      "bool use_ue8m0) -> ()",
      cpu_kernel(&quant_fp8_group_out));
}

}  // namespace opmux_cpu

// out[m, n] = x[m, :] . w[n, :] (+ bias[n]) over a few rows of x: the shape of a decode step's
// linears, which are bound by how fast the weight streams from memory
// (benchmarks/llamacpp_cpu.py). The kernel reads the weight as it lies, [N, K] with unit inner
// stride, gives each thread whole rows, keeps x in L1, multiplies bfloat16 with VDPBF16PS where
// the CPU has it (else widens to float32), accumulates every product in float32 and rounds
// once. It serves the catalog op `linear` (the `cpp` provider) and the Engine's packed weights.
//
// Two ways to stream the weight, each where it is the faster (benchmarks/linear_cpu.py --op and
// --huge-pages; the A/B is in benchmarks/RESULTS.md):
// - one row at a time, start to end, for every row of x: one stream per thread; float32
//   prefetches 4 KiB ahead into L2 (the hardware prefetchers stop at page boundaries),
//   bfloat16 prefetches nothing. bfloat16 always; float32 for a single row of x when the
//   caller says the weight lies on 2 MiB pages (`huge_pages`: the Engine's packed weights).
// - float32 otherwise: 8 weight rows side by side, prefetching the same columns of the next
//   group of 8 rows.
#include "kernels.h"
#include "op_library.h"
#include "vec_common.h"

namespace opmux_cpu {
namespace {

constexpr int64_t kBlock = 8;        // float32 weight rows read side by side
constexpr int64_t kRowAhead = 4096;  // bytes a float32 row stream prefetches ahead

#if defined(CPU_CAPABILITY_AVX512)
inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// Prefetches `ahead` elements on from p into L2. Past the weight's end it fetches nothing
// useful and never faults.
template <typename T>
inline void prefetch_ahead(const T* p, int64_t ahead) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const uintptr_t at = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(ahead) * sizeof(T);
  _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1);
#else
  (void)p;
  (void)ahead;
#endif
}

// rows_dot: sum over k < K of x[k] * w[r][k] for the 8 rows r (row pointers), into
// acc_out[r]; `ahead` is the distance in elements from a group's rows to the next group's.
// row_dot: sum over k < K of x[k] * w[k] for one weight row, prefetching `ahead` elements on
// (0: nothing).
#if defined(CPU_CAPABILITY_AVX512)
// How kC elements of a row are loaded (all, or under a mask of the first ones with zeros
// elsewhere) and multiplied into the accumulator: float32; bfloat16 pairs by VDPBF16PS, or
// widened to float32 where the CPU lacks it.
struct Float32Lanes {
  using V = __m512;
  using M = __mmask16;
  static constexpr int64_t kC = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const float* p, M m) { return _mm512_maskz_loadu_ps(m, p); }
  static __m512 mac(__m512 acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
};

#if defined(__AVX512BF16__)
struct Bfloat16Lanes {
  using V = __m512bh;
  using M = __mmask32;
  static constexpr int64_t kC = 32;
  static V load(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static V load(const at::BFloat16* p, M m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }
  static __m512 mac(__m512 acc, V w, V x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#else
struct Bfloat16Lanes {
  using V = __m512;
  using M = __mmask16;
  static constexpr int64_t kC = 16;
  static V load(const at::BFloat16* p) {
    return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load(const at::BFloat16* p, M m) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }
  static __m512 mac(__m512 acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
};
#endif

template <typename L, typename T>
inline void rows_dot_lanes(const T* const* w, const T* x, int64_t K, int64_t ahead,
                           float* acc_out) {
  __m512 acc[kBlock];
  for (auto& a : acc) a = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + L::kC <= K; k += L::kC) {
    const typename L::V xv = L::load(x + k);
    for (int64_t r = 0; r < kBlock; ++r) {
      prefetch_ahead(w[r] + k, ahead);
      acc[r] = L::mac(acc[r], L::load(w[r] + k), xv);
    }
  }
  if (k < K) {  // the masked-off lanes add 0 * 0
    const auto m = static_cast<typename L::M>((uint64_t{1} << (K - k)) - 1);
    const typename L::V xv = L::load(x + k, m);
    for (int64_t r = 0; r < kBlock; ++r) acc[r] = L::mac(acc[r], L::load(w[r] + k, m), xv);
  }
  for (int64_t r = 0; r < kBlock; ++r) acc_out[r] = _mm512_reduce_add_ps(acc[r]);
}

inline void rows_dot(const float* const* w, const float* x, int64_t K, int64_t ahead,
                     float* acc_out) {
  rows_dot_lanes<Float32Lanes>(w, x, K, ahead, acc_out);
}

template <typename L, typename T>
inline float row_dot_lanes(const T* w, const T* x, int64_t K, int64_t ahead) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + L::kC <= K; k += L::kC) {
    if (ahead) prefetch_ahead(w + k, ahead);
    acc = L::mac(acc, L::load(w + k), L::load(x + k));
  }
  if (k < K) {  // the masked-off lanes add 0 * 0
    const auto m = static_cast<typename L::M>((uint64_t{1} << (K - k)) - 1);
    acc = L::mac(acc, L::load(w + k, m), L::load(x + k, m));
  }
  return _mm512_reduce_add_ps(acc);
}

inline float row_dot(const float* w, const float* x, int64_t K, int64_t ahead) {
  return row_dot_lanes<Float32Lanes>(w, x, K, ahead);
}

inline float row_dot(const at::BFloat16* w, const at::BFloat16* x, int64_t K, int64_t ahead) {
  return row_dot_lanes<Bfloat16Lanes>(w, x, K, ahead);
}
#else
// at::vec: 8 float lanes on AVX2, the scalar fallback elsewhere.
template <typename T>
inline void rows_dot(const T* const* w, const T* x, int64_t K, int64_t ahead, float* acc_out) {
  fVec acc[kBlock];
  for (auto& a : acc) a = fVec(0.f);
  int64_t k = 0;
  for (; k + kF <= K; k += kF) {
    const fVec xv = load_f(x + k);
    for (int64_t r = 0; r < kBlock; ++r) prefetch_ahead(w[r] + k, ahead);
    for (int64_t r = 0; r < kBlock; ++r) acc[r] = at::vec::fmadd(load_f(w[r] + k), xv, acc[r]);
  }
  if (k < K) {
    const fVec xv = load_f(x + k, K - k);
    for (int64_t r = 0; r < kBlock; ++r)
      acc[r] = at::vec::fmadd(load_f(w[r] + k, K - k), xv, acc[r]);
  }
  for (int64_t r = 0; r < kBlock; ++r) acc_out[r] = hsum(acc[r]);
}

template <typename T>
inline float row_dot(const T* w, const T* x, int64_t K, int64_t ahead) {
  fVec acc(0.f);
  int64_t k = 0;
  for (; k + kF <= K; k += kF) {
    if (ahead) prefetch_ahead(w + k, ahead);
    acc = at::vec::fmadd(load_f(w + k), load_f(x + k), acc);
  }
  if (k < K) acc = at::vec::fmadd(load_f(w + k, K - k), load_f(x + k, K - k), acc);
  return hsum(acc);
}
#endif

// The operands of out = x wᵀ + bias as the loops read them.
template <typename T>
struct Operands {
  int64_t M, K, N, sx, sw, so;
  const T* x;
  const T* w;
  const T* bias;  // nullptr: none
  T* out;

  Operands(at::Tensor& out_, const at::Tensor& x_, const at::Tensor& w_,
           const c10::optional<at::Tensor>& bias_)
      : M(x_.size(0)), K(x_.size(1)), N(w_.size(0)), sx(x_.stride(0)), sw(w_.stride(0)),
        so(out_.stride(0)), x(x_.const_data_ptr<T>()), w(w_.const_data_ptr<T>()),
        bias(bias_.has_value() ? bias_->const_data_ptr<T>() : nullptr),
        out(out_.data_ptr<T>()) {}

  // out[m, n] from its float32 sum: the bias added, rounded once
  void store(int64_t m, int64_t n, float acc) const {
    out[m * so + n] = static_cast<T>(bias ? acc + static_cast<float>(bias[n]) : acc);
  }

  // the rows a task takes: at least 256 KiB of weight, fewer forks for small layers
  int64_t grain(int64_t rows_per_item) const {
    const int64_t bytes = std::max<int64_t>(1, rows_per_item * K * int64_t{sizeof(T)});
    return std::max<int64_t>(1, (int64_t{256} << 10) / bytes);
  }
};

// groups of 8 weight rows, read side by side (float32).
template <typename T>
void linear_groups(const Operands<T>& a) {
  const int64_t groups = (a.N + kBlock - 1) / kBlock;
  at::parallel_for(0, groups, a.grain(kBlock), [&](int64_t g0, int64_t g1) {
    float acc[kBlock];
    const T* rows[kBlock];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kBlock, count = std::min(kBlock, a.N - n0);
      // a last group of fewer than 8 rows repeats its last row; those sums are not stored
      for (int64_t r = 0; r < kBlock; ++r) rows[r] = a.w + (n0 + std::min(r, count - 1)) * a.sw;
      for (int64_t m = 0; m < a.M; ++m) {
        rows_dot(rows, a.x + m * a.sx, a.K, kBlock * a.sw, acc);
        for (int64_t r = 0; r < count; ++r) a.store(m, n0 + r, acc[r]);
      }
    }
  });
}

// one weight row at a time, start to end, for every row of x (the later rows of x find it in
// L1), prefetching `ahead` elements on (0: nothing).
template <typename T>
void linear_rows(const Operands<T>& a, int64_t ahead) {
  at::parallel_for(0, a.N, a.grain(1), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t m = 0; m < a.M; ++m) {
        a.store(m, n, row_dot(a.w + n * a.sw, a.x + m * a.sx, a.K, ahead));
      }
    }
  });
}

// bias: none, or a contiguous [n] of dtype dt
void check_bias(const c10::optional<at::Tensor>& bias, at::ScalarType dt, int64_t n) {
  OPMUX_CHECK("linear", !bias.has_value() || (bias->scalar_type() == dt &&
                                              bias->is_contiguous() && bias->dim() == 1 &&
                                              bias->numel() == n),
              "expected bias [N] of x's dtype");
}

}  // namespace

void linear_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias, bool huge_pages) {
  const auto dt = x.scalar_type();
  OPMUX_CHECK("linear", dt == at::kFloat || dt == at::kBFloat16,
              "expected x float32 or bfloat16, got ", dt);
  OPMUX_CHECK("linear", x.dim() == 2 && weight.dim() == 2 && out.dim() == 2 &&
                            weight.size(1) == x.size(1) && out.size(0) == x.size(0) &&
                            out.size(1) == weight.size(0),
              "expected x [M, K], weight [N, K] and out [M, N]");
  const bool unit = x.size(1) <= 1 || (x.stride(1) == 1 && weight.stride(1) == 1);
  OPMUX_CHECK("linear", unit && (out.size(1) <= 1 || out.stride(1) == 1),
              "expected x, weight and out with unit inner strides");
  OPMUX_CHECK("linear", weight.scalar_type() == dt && out.scalar_type() == dt,
              "expected weight and out of x's dtype");
  check_bias(bias, dt, out.size(1));
  if (dt == at::kFloat && (x.size(0) > 1 || !huge_pages)) {
    linear_groups(Operands<float>(out, x, weight, bias));
  } else if (dt == at::kFloat) {
    linear_rows(Operands<float>(out, x, weight, bias), kRowAhead / int64_t{sizeof(float)});
  } else {
    linear_rows(Operands<at::BFloat16>(out, x, weight, bias), 0);
  }
}

TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def("linear_out(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, "
        "bool huge_pages=False) -> ()",
        cpu_kernel(&linear_out));
}

}  // namespace opmux_cpu

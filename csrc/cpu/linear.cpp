// Two kernels for out[m, n] = x[m, :] . w[n, :] (+ bias[n]) over a few rows of x: the shape of a
// decode step's linears, which are bound by how fast the weight streams from memory
// (benchmarks/llamacpp_cpu.py). Both give a thread whole groups of 8 weight rows, keep x in L1,
// prefetch the weight into L2 (the hardware prefetchers stop at page boundaries), multiply
// bfloat16 with VDPBF16PS where the CPU has it (else widen to float32), accumulate every
// product in float32 and round once.
//
// linear_out reads the weight as it lies, [N, K] with unit inner stride: the 8 rows of a group
// are 8 streams side by side. It serves the catalog op `linear` (the `cpp` provider).
//
// linear_blocked_out reads a copy laid out once in blocks (opmux/models/_packed.py packs it):
//
//   packed[N8, KC, 8, C]: block b, chunk c, row r, lane j = w[8 b + r, C c + j]
//
// where C is one 64-byte cache line of the dtype (16 float32, 32 bfloat16) and N and K are
// zero-padded up to whole blocks, so a group of 8 rows is one contiguous stream. The engine's
// bfloat16 decode step uses it (faster than the plain weight there on one thread).
#include "op_library.h"
#include "vec_common.h"

#include <vector>

namespace opmux_cpu {
namespace {

constexpr int64_t kBlock = 8;   // weight rows per block
constexpr int64_t kLine = 64;   // bytes of one chunk of a row
// software prefetch distance, into L2: the hardware prefetchers stop at page boundaries
// (benchmarks/llamacpp_cpu.py)
constexpr int64_t kAhead = 4096;

template <typename T>
constexpr int64_t chunk_elems() {
  return kLine / static_cast<int64_t>(sizeof(T));
}

inline void prefetch_block(const void* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const char* c = static_cast<const char*>(p) + kAhead;
  for (int64_t r = 0; r < kBlock; ++r) _mm_prefetch(c + r * kLine, _MM_HINT_T1);
#else
  (void)p;
#endif
}

// sum over k of x[k] * w[8 b + r, k] for the 8 rows r of block `w` (KC chunks), into acc[r].
// `x` holds KC * C elements (zero-padded): float for the widening paths, bfloat16 for the dot
// product instruction.
#if defined(CPU_CAPABILITY_AVX512)
inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void block_dot(const float* w, const float* x, int64_t chunks, float* acc_out) {
  __m512 acc[kBlock];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c, w += kBlock * 16) {
    prefetch_block(w);
    const __m512 xv = _mm512_loadu_ps(x + 16 * c);
    for (int64_t r = 0; r < kBlock; ++r) acc[r] = _mm512_fmadd_ps(_mm512_load_ps(w + 16 * r), xv, acc[r]);
  }
  for (int64_t r = 0; r < kBlock; ++r) acc_out[r] = _mm512_reduce_add_ps(acc[r]);
}

inline void block_dot(const at::BFloat16* w, const float* x, int64_t chunks, float* acc_out) {
  __m512 acc[kBlock];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c, w += kBlock * 32) {
    prefetch_block(w);
    const __m512 x0 = _mm512_loadu_ps(x + 32 * c), x1 = _mm512_loadu_ps(x + 32 * c + 16);
    for (int64_t r = 0; r < kBlock; ++r) {
      const __m256i* p = reinterpret_cast<const __m256i*>(w + 32 * r);
      acc[r] = _mm512_fmadd_ps(widen_bf16(_mm256_load_si256(p)), x0, acc[r]);
      acc[r] = _mm512_fmadd_ps(widen_bf16(_mm256_load_si256(p + 1)), x1, acc[r]);
    }
  }
  for (int64_t r = 0; r < kBlock; ++r) acc_out[r] = _mm512_reduce_add_ps(acc[r]);
}

#if defined(__AVX512BF16__)
inline void block_dot(const at::BFloat16* w, const at::BFloat16* x, int64_t chunks,
                      float* acc_out) {
  __m512 acc[kBlock];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c, w += kBlock * 32) {
    prefetch_block(w);
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + 32 * c);
    for (int64_t r = 0; r < kBlock; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_load_si512(w + 32 * r), xv);
  }
  for (int64_t r = 0; r < kBlock; ++r) acc_out[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif
#else
// at::vec: 8 float lanes on AVX2, the scalar fallback elsewhere.
template <typename T>
inline void block_dot(const T* w, const float* x, int64_t chunks, float* acc_out) {
  constexpr int64_t C = chunk_elems<T>();
  fVec acc[kBlock];
  for (int64_t c = 0; c < chunks; ++c, w += kBlock * C) {
    prefetch_block(w);
    for (int64_t j = 0; j < C; j += kF) {
      const fVec xv = fVec::loadu(x + C * c + j);
      for (int64_t r = 0; r < kBlock; ++r) acc[r] = at::vec::fmadd(load_f(w + C * r + j), xv, acc[r]);
    }
  }
  for (int64_t r = 0; r < kBlock; ++r) acc_out[r] = hsum(acc[r]);
}
#endif

// The type x is multiplied in: bfloat16 where the dot-product instruction takes it.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool kDotBf16 = true;
#else
constexpr bool kDotBf16 = false;
#endif
template <typename T>
using x_t = std::conditional_t<kDotBf16 && std::is_same_v<T, at::BFloat16>, at::BFloat16, float>;

template <typename T>
void linear_blocked(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                    const c10::optional<at::Tensor>& bias) {
  using X = x_t<T>;
  constexpr int64_t C = chunk_elems<T>();
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const int64_t blocks = packed.size(0), chunks = packed.size(1);
  // x once, zero-padded to whole chunks, in the type the block product reads
  std::vector<X> xs(static_cast<size_t>(M * chunks * C), X(0));
  const T* xp = x.const_data_ptr<T>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xs[m * chunks * C + k] = static_cast<X>(xp[m * x.stride(0) + k]);
  const T* wp = packed.const_data_ptr<T>();
  const T* bp = bias.has_value() ? bias->const_data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const int64_t so = out.stride(0);
  // a task reads at least 256 KiB of weight: fewer forks for small layers
  const int64_t grain = std::max<int64_t>(1, (int64_t{256} << 10) / (kBlock * chunks * kLine));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    float acc[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min(kBlock, N - b * kBlock);
      for (int64_t m = 0; m < M; ++m) {
        block_dot(wp + b * kBlock * chunks * C, xs.data() + m * chunks * C, chunks, acc);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t n = b * kBlock + r;
          op[m * so + n] = static_cast<T>(bp ? acc[r] + static_cast<float>(bp[n]) : acc[r]);
        }
      }
    }
  });
}

// ---------------------------------------------------------------------- the plain weight
// Prefetches the same columns of the next group of 8 rows, `ahead` elements on, into L2: a
// distance that follows the rows' length (benchmarks/linear_cpu.py --op). Past the weight's end
// it fetches nothing useful and never faults.
template <typename T>
inline void prefetch_next_group(const T* p, int64_t ahead) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const uintptr_t at = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(ahead) * sizeof(T);
  _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1);
#else
  (void)p;
  (void)ahead;
#endif
}

// rows_dot: sum over k < K of x[k] * w[r][k] for the 8 rows r (row pointers), into acc_out[r];
// `ahead` is the distance in elements from a group's rows to the next group's.
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
      prefetch_next_group(w[r] + k, ahead);
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

inline void rows_dot(const at::BFloat16* const* w, const at::BFloat16* x, int64_t K,
                     int64_t ahead, float* acc_out) {
  rows_dot_lanes<Bfloat16Lanes>(w, x, K, ahead, acc_out);
}
#else
// at::vec: 8 float lanes on AVX2, the scalar fallback elsewhere.
template <typename T>
inline void rows_dot(const T* const* w, const T* x, int64_t K, int64_t ahead, float* acc_out) {
  fVec acc[kBlock];
  int64_t k = 0;
  for (; k + kF <= K; k += kF) {
    const fVec xv = load_f(x + k);
    for (int64_t r = 0; r < kBlock; ++r) prefetch_next_group(w[r] + k, ahead);
    for (int64_t r = 0; r < kBlock; ++r) acc[r] = at::vec::fmadd(load_f(w[r] + k), xv, acc[r]);
  }
  if (k < K) {
    const fVec xv = load_f(x + k, K - k);
    for (int64_t r = 0; r < kBlock; ++r)
      acc[r] = at::vec::fmadd(load_f(w[r] + k, K - k), xv, acc[r]);
  }
  for (int64_t r = 0; r < kBlock; ++r) acc_out[r] = hsum(acc[r]);
}
#endif

template <typename T>
void linear_plain(at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                  const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t sx = x.stride(0), sw = w.stride(0), so = out.stride(0);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  const T* bp = bias.has_value() ? bias->const_data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const int64_t groups = (N + kBlock - 1) / kBlock;
  // a task reads at least 256 KiB of weight: fewer forks for small layers
  const int64_t group_bytes = std::max<int64_t>(1, kBlock * K * w.element_size());
  const int64_t grain = std::max<int64_t>(1, (int64_t{256} << 10) / group_bytes);
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    float acc[kBlock];
    const T* rows[kBlock];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kBlock, count = std::min(kBlock, N - n0);
      // a last group of fewer than 8 rows repeats its last row; those sums are not stored
      for (int64_t r = 0; r < kBlock; ++r) rows[r] = wp + (n0 + std::min(r, count - 1)) * sw;
      for (int64_t m = 0; m < M; ++m) {
        rows_dot(rows, xp + m * sx, K, kBlock * sw, acc);
        for (int64_t r = 0; r < count; ++r) {
          const int64_t n = n0 + r;
          op[m * so + n] = static_cast<T>(bp ? acc[r] + static_cast<float>(bp[n]) : acc[r]);
        }
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

void linear_blocked_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                        const c10::optional<at::Tensor>& bias) {
  const auto dt = x.scalar_type();
  OPMUX_CHECK("linear", dt == at::kFloat || dt == at::kBFloat16,
              "expected x float32 or bfloat16, got ", dt);
  OPMUX_CHECK("linear", x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 &&
                            out.stride(1) == 1 && out.size(0) == x.size(0),
              "expected x [M, K] and out [M, N] with unit inner strides");
  OPMUX_CHECK("linear", packed.scalar_type() == dt && out.scalar_type() == dt &&
                            packed.is_contiguous() && packed.dim() == 4 &&
                            packed.size(2) == kBlock &&
                            packed.size(3) * packed.element_size() == kLine &&
                            packed.size(0) * kBlock >= out.size(1) &&
                            packed.size(1) * packed.size(3) >= x.size(1),
              "expected a packed weight [N/8, K/C, 8, C] of x's dtype covering out and x");
  check_bias(bias, dt, out.size(1));
  if (dt == at::kFloat) {
    linear_blocked<float>(out, x, packed, bias);
  } else {
    linear_blocked<at::BFloat16>(out, x, packed, bias);
  }
}

void linear_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias) {
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
  if (dt == at::kFloat) {
    linear_plain<float>(out, x, weight, bias);
  } else {
    linear_plain<at::BFloat16>(out, x, weight, bias);
  }
}

TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def("linear_out(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()",
        cpu_kernel(&linear_out));
  m.def("linear_blocked_out(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()",
        cpu_kernel(&linear_blocked_out));
}

}  // namespace opmux_cpu

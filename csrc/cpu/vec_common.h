// Shared helpers for the opmux CPU kernels: ISA selection for at::vec, fp32 load/store of
// fp32/bf16/fp16 rows, and the dtype dispatch used by every kernel.
#pragma once

// at::vec picks its implementation from CPU_CAPABILITY_* macros that ATen's own build sets per
// kernel file. An extension compiled with -march=native gets the matching vector width here.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#ifndef CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY_AVX512
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#ifndef CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY_AVX2
#endif
#endif

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace opmux_cpu {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kF = fVec::size();

// Loads kF elements of T as fp32.
template <typename T>
inline fVec load_f(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return fVec::loadu(p);
  } else {
    fVec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// Loads n < kF elements of T as fp32, the rest zero.
template <typename T>
inline fVec load_f(const T* p, int64_t n) {
  float tmp[kF];
  for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
  return fVec::loadu(tmp, n);
}

// Stores kF fp32 lanes as T (round to nearest even for bf16/fp16).
template <typename T>
inline void store_f(T* p, const fVec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, kF);
  }
}

// Stores the first n < kF lanes.
template <typename T>
inline void store_f(T* p, const fVec& v, int64_t n) {
  float tmp[kF];
  v.store(tmp);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(tmp[i]);
}

// Applies fn(index, count) over [0, n) in kF-wide steps, the last one partial.
template <typename Fn>
inline void for_each_vec(int64_t n, const Fn& fn) {
  int64_t i = 0;
  for (; i + kF <= n; i += kF) fn(i, kF);
  if (i < n) fn(i, n - i);
}

template <typename T>
inline fVec load_n(const T* p, int64_t n) {
  return n == kF ? load_f(p) : load_f(p, n);
}

template <typename T>
inline void store_n(T* p, const fVec& v, int64_t n) {
  if (n == kF) {
    store_f(p, v);
  } else {
    store_f(p, v, n);
  }
}

// Like store_n, but a full, aligned vector is written with a non-temporal store: large outputs
// then skip the read-for-ownership of every line they overwrite. Call stream_fence() before
// the data is read by another thread (at the end of each parallel chunk).
template <typename T>
inline void store_nt(T* p, const fVec& v, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  if (n == kF) {
    if constexpr (std::is_same_v<T, float>) {
      if ((reinterpret_cast<uintptr_t>(p) & 63) == 0) {
        _mm512_stream_ps(p, v);
        return;
      }
    } else {
      if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) {
        alignas(64) T tmp[2 * kF];
        at::vec::convert_from_float<T>(v, v).store(tmp);
        _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                            _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp)));
        return;
      }
    }
  }
#endif
  store_n(p, v, n);
}

#if defined(CPU_CAPABILITY_AVX512)
// e^x to 3.5e-7 relative error (ATen's exp_u20: 20 ulp) in 11 operations instead of its 17:
// n = round(x log2(e)), r = x - n ln 2 in two steps (n times ln 2's 15-bit high part is
// exact), e^r by a degree-5 polynomial fitted on [-ln 2 / 2, ln 2 / 2], then VSCALEFPS
// multiplies by 2^n. Below x = -87 (e^x under 1.7e-38) the result is 0, so no denormal ever
// comes out (an operation on one costs a microcode assist, which slows windowed batches;
// benchmarks/paged_attention_cpu.py); inf above 88.7; NaN for a NaN x and for x = +inf
// (the softmax loops pass x - max <= 0).
inline __m512 exp512(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_NLT_UQ);  // NaN too
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(0.00807215180248022f), r,
                             _mm512_set1_ps(0.041885022073984146f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.16670504212379456f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.4999919831752777f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.9999989867210388f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(keep, q, n);
}

// 16 x 16 transpose of 32-bit cells in registers: lane j of v[i] goes to lane i of v[j].
inline void transpose16(__m512* v) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 2; ++j) {
      const __m512d x = _mm512_castps_pd(a[4 * i + j]);
      const __m512d y = _mm512_castps_pd(a[4 * i + 2 + j]);
      b[4 * i + j] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
      b[4 * i + 2 + j] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
    }
  }
  // b[4i + k]: in 128-bit lane L, rows 4i..4i+3 of column 4L + kCol[k]
  constexpr int kCol[4] = {0, 2, 1, 3};
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 4; ++k) {
      // columns kCol[k] and 8 + kCol[k] (then 4 + and 12 + kCol[k]) of rows 8i..8i+7
      a[8 * i + k] = _mm512_shuffle_f32x4(b[8 * i + k], b[8 * i + 4 + k], _MM_SHUFFLE(2, 0, 2, 0));
      a[8 * i + 4 + k] =
          _mm512_shuffle_f32x4(b[8 * i + k], b[8 * i + 4 + k], _MM_SHUFFLE(3, 1, 3, 1));
    }
  }
  for (int k = 0; k < 4; ++k) {
    for (int h = 0; h < 2; ++h) {
      const __m512 x = a[4 * h + k];      // rows 0..7
      const __m512 y = a[8 + 4 * h + k];  // rows 8..15
      v[kCol[k] + 4 * h] = _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0));
      v[kCol[k] + 4 * h + 8] = _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1));
    }
  }
}
#endif

inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

inline float hsum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}

inline float hmax(const fVec& v) {
  return at::vec::vec_reduce_all<float>(
      [](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, v);
}

// Asks Linux for transparent huge pages on a large output before its first write. A fresh
// multi-MiB output is otherwise faulted in 4 KiB at a time, which costs more than the kernel
// itself (benchmarks/ops_cpu.py --full); with THP in "madvise" mode this makes it 2 MiB faults.
// Only the 2 MiB-aligned interior is advised; failure is harmless and ignored.
inline void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const size_t bytes = t.nbytes();
  // below 32 MiB glibc may hand back recycled heap memory (no faults to save)
  if (bytes < (size_t{32} << 20)) return;
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t lo = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (begin + bytes) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

// Error prefix shared by every check: names the op and the provider.
#define OPMUX_CHECK(op, cond, ...) \
  TORCH_CHECK_VALUE(cond, "opmux::" op " (provider 'cpp'): ", __VA_ARGS__)

// Runs body with scalar_t bound to float, at::BFloat16 or at::Half.
#define OPMUX_DISPATCH_FLOATS(dtype, op, ...)                                              \
  [&] {                                                                                    \
    switch (dtype) {                                                                       \
      case at::kFloat: {                                                                   \
        using scalar_t = float;                                                            \
        return __VA_ARGS__();                                                              \
      }                                                                                    \
      case at::kBFloat16: {                                                                \
        using scalar_t = at::BFloat16;                                                     \
        return __VA_ARGS__();                                                              \
      }                                                                                    \
      case at::kHalf: {                                                                    \
        using scalar_t = at::Half;                                                         \
        return __VA_ARGS__();                                                              \
      }                                                                                    \
      default:                                                                             \
        TORCH_CHECK_VALUE(false, "opmux::" op " (provider 'cpp'): expected dtype float32, " \
                          "bfloat16 or float16, got ", dtype);                              \
    }                                                                                      \
  }()

}  // namespace opmux_cpu

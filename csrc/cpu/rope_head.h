// The rotation of a head and of a token's heads, shared by the rotary kernels of rotary.cpp.
#pragma once

#include "vec_common.h"

#include <cstring>

namespace opmux_cpu {

// Rotates the first `rot` entries of one head (`in`, unit stride) into `out` by cos/sin
// (`rot / 2` entries each); entries rot..head_size are copied through. Full vectors go out
// with non-temporal stores: call stream_fence() at the end of each parallel chunk.
template <typename T, typename C>
inline void rope_head(T* out, const T* in, const C* cos, const C* sin, int64_t rot,
                      int64_t head_size, bool is_neox) {
  const int64_t half = rot / 2;
  if (is_neox) {
    for_each_vec(half, [&](int64_t j, int64_t n) {
      const fVec x1 = load_n(in + j, n);
      const fVec x2 = load_n(in + half + j, n);
      const fVec c = load_n(cos + j, n);
      const fVec s = load_n(sin + j, n);
      store_nt(out + j, x1 * c - x2 * s, n);
      store_nt(out + half + j, x2 * c + x1 * s, n);
    });
  } else {
    int64_t j = 0;
    for (; j + kF <= half; j += kF) {  // kF pairs: deinterleave, rotate, interleave back
      auto [even, odd] = at::vec::deinterleave2(load_f(in + 2 * j), load_f(in + 2 * j + kF));
      const fVec c = load_f(cos + j);
      const fVec s = load_f(sin + j);
      auto [lo, hi] = at::vec::interleave2(even * c - odd * s, odd * c + even * s);
      store_nt(out + 2 * j, lo, kF);
      store_nt(out + 2 * j + kF, hi, kF);
    }
    for (; j < half; ++j) {
      const float x0 = static_cast<float>(in[2 * j]);
      const float x1 = static_cast<float>(in[2 * j + 1]);
      const float c = static_cast<float>(cos[j]);
      const float s = static_cast<float>(sin[j]);
      out[2 * j] = static_cast<T>(x0 * c - x1 * s);
      out[2 * j + 1] = static_cast<T>(x1 * c + x0 * s);
    }
  }
  if (rot < head_size) std::memcpy(out + rot, in + rot, (head_size - rot) * sizeof(T));
}

// rope_head over the `heads` consecutive heads of one token's row, all rotated by the same
// cos/sin.
template <typename T, typename C>
inline void rope_heads(T* out, const T* in, int64_t heads, const C* cos, const C* sin,
                       int64_t rot, int64_t head_size, bool is_neox) {
  for (int64_t h = 0; h < heads; ++h) {
    rope_head(out + h * head_size, in + h * head_size, cos, sin, rot, head_size, is_neox);
  }
}

}  // namespace opmux_cpu

// AMX tile helpers shared by the kernels with a tile path (paged_attention_amx.h, moe.cpp):
// OPMUX_AMX where this build can emit tile instructions (built with -march=native on a CPU
// whose compiler target defines __AMX_TILE__ and __AMX_BF16__, with AVX512-BF16 for the
// conversions, on Linux), whether the process may run them, the tile configuration, and a
// 16 x 16 transpose of 32-bit cells in registers.
#pragma once

#include "vec_common.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__) && defined(__linux__)
#define OPMUX_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace opmux_cpu {
namespace {
namespace amx {

// Linux hands a process the AMX tile state only when it asks for it (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); without the grant the first tile instruction faults.
inline bool tiles_granted() {
  static const bool ok = [] {
    constexpr int kReqPerm = 0x1023;
    constexpr int kGetPerm = 0x1022;
    constexpr int kXtileData = 18;
    if (syscall(SYS_arch_prctl, kReqPerm, kXtileData) != 0) return false;
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, kGetPerm, &mask) != 0) return false;
    return (mask & (1UL << kXtileData)) != 0;
  }();
  return ok;
}

// A kernel's tile path: on where the tiles are granted, unless turned off (tests of the other
// paths on an AMX machine).
class PathSwitch {
 public:
  bool on() const { return wanted_.load(std::memory_order_relaxed) && tiles_granted(); }
  // mode 1 allows the path, 0 turns it off, -1 only asks; returns on()
  bool set(int64_t mode) {
    if (mode >= 0) wanted_.store(mode != 0);
    return on();
  }

 private:
  std::atomic<bool> wanted_{true};
};

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  // tile t: `rows` rows of `bytes` bytes each
  void set(int t, int64_t nrows, int64_t bytes) {
    rows[t] = static_cast<uint8_t>(nrows);
    colsb[t] = static_cast<uint16_t>(bytes);
  }
  void load() const {
    // GCC's _tile_loadconfig declares a read of 8 bytes only, so stores to the other 56 may be
    // dropped as dead: a compiler barrier makes all of them reach memory first
    asm volatile("" : : "r"(this) : "memory");
    _tile_loadconfig(this);
  }
};

// v[i] (16 tokens, lane = row) -> v[r] (16 rows, lane = token)
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

}  // namespace amx
}  // namespace
}  // namespace opmux_cpu

#endif

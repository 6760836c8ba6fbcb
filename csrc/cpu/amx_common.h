// AMX tile helpers shared by the kernels with a tile path (paged_attention_amx.h, moe.cpp):
// OPMUX_AMX where this build can emit tile instructions (built with -march=native on a CPU
// whose compiler target defines __AMX_TILE__ and __AMX_BF16__, with AVX512-BF16 for the
// conversions, on Linux), whether the process may run them, and the tile configuration.
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

}  // namespace amx
}  // namespace
}  // namespace opmux_cpu

#endif

// The CPU's tile unit (AMX), shared by its kernels (amx_linear.cpp, decode_tiles.h): asking Linux for the tile state
// and describing tile shapes.
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace tile_state {

// Linux grants a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); the first
// tile instruction of a process that did not ask is killed by SIGILL. Asked once, for the whole process.
inline bool granted() {
  static const bool ok = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}

// ldtilecfg's 64 bytes: palette 1, then each tile's bytes a row and rows. A thread's tiles are its own state, and
// oneDNN's products on the same threads load configurations of their own: each kernel loads its own per call.
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  Config& tile(int t, int64_t rows_, int64_t bytes) {
    rows[t] = static_cast<uint8_t>(rows_);
    colsb[t] = static_cast<uint16_t>(bytes);
    return *this;
  }
  // ldtilecfg reads all 64 bytes; GCC 12's _tile_loadconfig tells the compiler it reads 8 (its asm operand is a
  // pointer-sized object), and a configuration built just before was then stored only in part: ldtilecfg got garbage
  // shapes and faulted (SIGSEGV). The operand here is the whole struct.
  void load() const { __asm__ volatile("ldtilecfg %0" : : "m"(*this)); }
};

}  // namespace tile_state
#endif

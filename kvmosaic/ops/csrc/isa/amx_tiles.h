// What the AMX kernels share (amx_gemm.cpp, amx_attention.cpp): whether this build has them, and
// the one tile configuration they all use, every tile 16 rows x 64 bytes.
//
// The compiler does not know that tile loads read memory or that tile stores write it (gcc's tile
// intrinsics are bare asm statements), so a compiler barrier (amx_fence) follows every buffer a tile
// reads after the code wrote it, and every tile store the code then reads.
#pragma once

#include "isa/vec.h"

#include <cstdint>

#if defined(__x86_64__) && defined(KVM_VEC_AVX512) && defined(__AVX512BF16__) && \
    (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define KVM_AMX 1
#define KVM_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

namespace kvops::amx {

inline void amx_fence() { asm volatile("" ::: "memory"); }

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the configuration on this thread for its lifetime and releases the tiles after: a thread's
// tile state is its own, and other code (oneDNN) may have loaded another configuration.
class TileScope {
 public:
  KVM_AMX_TARGET TileScope() {
    for (int t = 0; t < 8; ++t) {
      config_.colsb[t] = 64;
      config_.rows[t] = 16;
    }
    amx_fence();
    _tile_loadconfig(&config_);
  }
  KVM_AMX_TARGET ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  TileConfig config_;
};

}  // namespace kvops::amx

#endif  // KVM_AMX

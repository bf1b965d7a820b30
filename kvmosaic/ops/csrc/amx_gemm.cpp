// bfloat16 packed products on AMX tiles (amx.h).
//
// Eight tile registers, one configuration: tmm0-3 hold a 32 x 32 block of float sums (two row
// halves x two weight blocks), tmm4-5 two 16-row slices of activations (16 rows x 32 k), tmm6-7
// two packed weight blocks at the same 32 k (16 pair rows x 16 columns x 2). A k step of 32 is four
// loads and four TDPBF16PS. Sums go through one of two 4 KiB float buffers to the same epilogue as
// the AVX-512 micro-kernel's (bias, or SwiGLU with the unfused path's bf16 roundings), which runs
// for one block while the tiles compute the next.
#include "amx.h"
#include "amx_tiles.h"

#include "gemm_kernel.h"

#include <ATen/cpu/Utils.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(KVM_AMX)
#include <cpuid.h>
#endif

namespace kvops::amx {

namespace {

namespace vec = kvmosaic_vec;
using gemm::kBlock;
using vec::bf16;
using vec::F16;

constexpr int64_t kTileK = 32;          // k values per tile step (64 bytes of bf16 a row)
constexpr int64_t kGroupRows = 32;      // rows of one sum block (two 16-row tiles)
constexpr int64_t kChunkBytes = 1 << 20;  // weights a chunk of block pairs keeps in L2 (2 MiB on the AMX hosts)
constexpr int64_t kStepElems = kTileK * kBlock;  // packed weight elements of one k step of a block

bool detect() {
#if defined(KVM_AMX)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1u, bf16_dots = (d >> 22) & 1u;
  return tile && bf16_dots && at::cpu::init_amx();  // init_amx asks the kernel for the tile state
#else
  return false;
#endif
}

bool env_allows() {
  const char* value = std::getenv("KVMOSAIC_AMX");
  return value == nullptr || std::strcmp(value, "0") != 0;
}

std::atomic<bool>& switch_state() {
  static std::atomic<bool> on{supported() && env_allows()};
  return on;
}

// The output of the sum block before the current one: bias or SwiGLU (with the unfused path's bf16
// roundings) on its float sums c[32][32] (columns 0-15 of the first weight block, 16-31 of the
// second), written a few rows at a time from inside the next block's k loop, so that this vector
// work runs while the tiles multiply instead of leaving them idle (gate/up with SwiGLU ran 1.2-1.5x
// faster for it, the plain products 1.1-1.2x, on the Intel AMX host).
struct Epilogue {
  const float* c = nullptr;
  int64_t rows = 0, done = 0, blocks = 0;
  bf16* out = nullptr;
  int64_t ldo = 0;
  const float* bias = nullptr;
  bool swiglu = false;

  void row(int64_t r) const {
    const float* cr = c + r * kGroupRows;
    bf16* o = out + r * ldo;
    if (swiglu) {
      gemm::swiglu_rounded<bf16>(F16::load(cr), F16::load(cr + kBlock)).store(o);
      return;
    }
    for (int64_t j = 0; j < blocks; ++j) {
      const F16 b = bias != nullptr ? F16::load(bias + j * kBlock) : F16::zero();
      (F16::load(cr + j * kBlock) + b).store(o + j * kBlock);
    }
  }
  void write_to(int64_t upto) {
    for (upto = std::min(upto, rows); done < upto; ++done) row(done);
  }
};

#if defined(KVM_AMX)

// RT 16-row activation tiles x BT weight blocks over all k: sums into c[32][32], while `prev`
// writes its rows.
template <int RT, int BT>
KVM_AMX_TARGET void tile_block(const bf16* x, int64_t ldx, const bf16* w0, const bf16* w1, int64_t steps, float* c,
                               Epilogue& prev) {
  const int64_t stride = ldx * static_cast<int64_t>(sizeof(bf16));
  const bf16* x1 = x + 16 * ldx;
  const int64_t rows_per_step = (prev.rows + steps - 1) / steps;
  _tile_zero(0);
  if constexpr (BT > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && BT > 1) _tile_zero(3);
  // Each load sits right before the first product that reads it, so the loads of a step overlap
  // the products already issued, and the next step's first load (tmm4) only waits for the products
  // that read it, the first ones issued. Four loads first, then four products, ran 1-9% slower (2048 and
  // 512 rows, in-process alternation on the Intel AMX host); every sum gets the same products in
  // the same order either way.
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, x + s * kTileK, stride);
    _tile_loadd(6, w0 + s * kStepElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (BT > 1) {
      _tile_loadd(7, w1 + s * kStepElems, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RT > 1) {
      _tile_loadd(5, x1 + s * kTileK, stride);
      _tile_dpbf16ps(2, 5, 6);
    }
    if constexpr (RT > 1 && BT > 1) _tile_dpbf16ps(3, 5, 7);
    prev.write_to(prev.done + rows_per_step);
  }
  prev.write_to(prev.rows);
  constexpr int64_t ldc = kGroupRows * sizeof(float);
  _tile_stored(0, c, ldc);
  if constexpr (BT > 1) _tile_stored(1, c + kBlock, ldc);
  if constexpr (RT > 1) _tile_stored(2, c + 16 * kGroupRows, ldc);
  if constexpr (RT > 1 && BT > 1) _tile_stored(3, c + 16 * kGroupRows + kBlock, ldc);
  amx_fence();
}

// One thread's share: pairs of weight blocks (a gate block and its up block for SwiGLU) against the
// rows. The pairs go in chunks of about kChunkBytes of weights; a chunk stays in L2 while each
// 32-row group of activations (in L1 while k is small) runs against all of its pairs. (A 128-row
// slab per pair instead, which kept the pair in L1 and streamed the whole share of weights once per
// slab, ran 1.1-1.5x slower at 2048 rows.) Rows past the last multiple of 16 run from a zero-padded
// copy.
KVM_AMX_TARGET void run(const PackedWeight& w, const bf16* x, int64_t m, bf16* out, int64_t p0, int64_t p1) {
  const TileScope tiles;
  const int64_t k = w.k, steps = k / kTileK, block_stride = k * kBlock, n = w.width();
  const bf16* wp = static_cast<const bf16*>(w.data);
  const int64_t per_panel = w.blocks_per_panel();
  const int64_t full = m - m % 16;
  thread_local std::vector<bf16> tail;
  if (full < m) {
    tail.assign(16 * k, bf16());
    std::memcpy(tail.data(), x + full * k, (m - full) * k * sizeof(bf16));
    amx_fence();
  }
  // a unit: (first block, second block or -1, output column); SwiGLU groups give two units each
  struct Unit {
    int64_t b0, b1, col;
  };
  std::vector<Unit> units;
  if (w.swiglu) {
    for (int64_t g = p0; g < p1; ++g)
      for (int64_t i = 0; i < 2; ++i) units.push_back({4 * g + i, 4 * g + 2 + i, 2 * kBlock * g + kBlock * i});
  } else {
    const int64_t b_end = std::min(p1 * per_panel, w.blocks);
    for (int64_t b = p0 * per_panel; b < b_end; b += 2)
      units.push_back({b, b + 1 < b_end ? b + 1 : -1, b * kBlock});
  }
  const int64_t n_units = static_cast<int64_t>(units.size());
  const int64_t per_chunk = std::max<int64_t>(1, kChunkBytes / (2 * block_stride * int64_t{sizeof(bf16)}));
  alignas(64) float c[2][kGroupRows * kGroupRows];  // the current block's sums and the previous one's
  int cur = 0;
  Epilogue prev;
  for (int64_t u0 = 0; u0 < n_units; u0 += per_chunk) {
    const int64_t u1 = std::min(n_units, u0 + per_chunk);
    for (int64_t r = 0; r < m;) {  // r stays a multiple of 16
      const bool in_tail = r >= full;  // fewer than 16 rows left: the padded copy
      const int64_t rows = in_tail ? m - r : (full - r >= kGroupRows ? kGroupRows : 16);
      const bf16* xr = in_tail ? tail.data() : x + r * k;
      const bool two_tiles = !in_tail && rows > 16;
      for (int64_t i = u0; i < u1; ++i) {
        const Unit& u = units[i];
        const bf16* w0 = wp + u.b0 * block_stride;
        const bf16* w1 = u.b1 >= 0 ? wp + u.b1 * block_stride : nullptr;
        if (w1 != nullptr) {
          if (two_tiles) tile_block<2, 2>(xr, k, w0, w1, steps, c[cur], prev);
          else tile_block<1, 2>(xr, k, w0, w1, steps, c[cur], prev);
        } else {
          if (two_tiles) tile_block<2, 1>(xr, k, w0, w1, steps, c[cur], prev);
          else tile_block<1, 1>(xr, k, w0, w1, steps, c[cur], prev);
        }
        prev = Epilogue{c[cur], rows, 0, w1 != nullptr ? 2 : 1, out + r * n + u.col, n,
                        w.bias != nullptr ? w.bias + u.col : nullptr, w.swiglu};
        cur ^= 1;
      }
      r += rows;
    }
  }
  prev.write_to(prev.rows);
}

#endif  // KVM_AMX

}  // namespace

bool supported() {
  static const bool yes = detect();
  return yes;
}

bool enabled() { return switch_state().load(std::memory_order_relaxed); }

bool set_enabled(bool on) {
  switch_state().store(on && supported(), std::memory_order_relaxed);
  return enabled();
}

bool takes(const PackedWeight& w, int64_t m) { return m >= kMinRows && w.k % kTileK == 0 && enabled(); }

void bf16_panels(const PackedWeight& w, const bf16* x, int64_t m, bf16* out, int64_t p0, int64_t p1) {
#if defined(KVM_AMX)
  run(w, x, m, out, p0, p1);
#else
  (void)w, (void)x, (void)m, (void)out, (void)p0, (void)p1;
  TORCH_CHECK(false, "AMX tiles are not compiled into the ", vec::kLevelName, " kernels");
#endif
}

}  // namespace kvops::amx

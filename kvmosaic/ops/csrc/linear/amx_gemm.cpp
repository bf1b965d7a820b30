// bfloat16 packed products on AMX tiles (amx.h).
//
// Eight tile registers, one configuration: tmm0-3 hold a 32 x 32 block of float sums (two row
// halves x two weight blocks), tmm4-5 two 16-row slices of activations (16 rows x 32 k), tmm6-7
// two packed weight blocks at the same 32 k (16 pair rows x 16 columns x 2). A k step of 32 is four
// loads and four TDPBF16PS. Sums go through one of two 4 KiB float buffers to the same epilogue as
// the AVX-512 micro-kernel's (bias, or SwiGLU with the unfused path's bf16 roundings), which runs
// for one block while the tiles compute the next.
#include "common/batch_invariance.h"
#include "common/check.h"
#include "isa/amx.h"
#include "isa/amx_tiles.h"
#include "linear/gemm_kernel.h"


#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(KVM_AMX)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
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
constexpr int64_t kQuantBlock = 32;  // weights of a column under one scale (and min) of a q8 / q4 weight

#if defined(KVM_AMX)
// Linux hands a process the AMX tile data state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); the answer is then read back, as PyTorch's at::cpu::init_amx does.
bool tile_state_granted() {
#if defined(__linux__)
  constexpr long kReqXcompPerm = 0x1023, kGetXcompPerm = 0x1022;  // ARCH_REQ_XCOMP_PERM, ARCH_GET_XCOMP_PERM
  constexpr unsigned long kXtileCfg = 17, kXtileData = 18;        // XFEATURE_XTILECFG, XFEATURE_XTILEDATA
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) return false;
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kGetXcompPerm, &granted) != 0) return false;
  return (granted & ((1ul << kXtileCfg) | (1ul << kXtileData))) != 0;
#else
  return true;
#endif
}
#endif

bool detect() {
#if defined(KVM_AMX)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1u, bf16_dots = (d >> 22) & 1u;
  return tile && bf16_dots && tile_state_granted();
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
template <typename Out>
struct Epilogue {
  const float* c = nullptr;
  int64_t rows = 0, done = 0, blocks = 0;
  Out* out = nullptr;
  int64_t ldo = 0;
  const float* bias = nullptr;
  bool swiglu = false;

  void row(int64_t r) const {
    const float* cr = c + r * kGroupRows;
    Out* o = out + r * ldo;
    if constexpr (std::is_same_v<Out, bf16>) {  // SwiGLU products are bf16 throughout
      if (swiglu) {
        gemm::swiglu_rounded<bf16>(F16::load(cr), F16::load(cr + kBlock)).store(o);
        return;
      }
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
template <int RT, int BT, typename Out>
KVM_AMX_TARGET void tile_block(const bf16* x, int64_t ldx, const bf16* w0, const bf16* w1, int64_t steps, float* c,
                               Epilogue<Out>& prev) {
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

// A unit of a thread's share: one or two 16-column weight blocks (b1 = -1: one) and the output
// column of b0's first sum. SwiGLU groups give two units each: (gate, up) of 16 columns.
struct Unit {
  int64_t b0, b1, col;
};

// Where the blocks come from. A packed bf16 weight is read as it is.
struct PackedBlocks {
  const bf16* w;
  int64_t stride;  // elements of one block
  void load(const Unit*, const Unit*) {}
  const bf16* block(int64_t b) const { return w + b * stride; }
};

// A q8 or q4 weight: a chunk's groups dequantized into this thread's buffer first, in the packed
// layout ([K / 2][16][2] a block; the interleaved codes and scales already go 16 columns at a time).
template <typename S>
struct DequantizedBlocks {
  const QuantizedWeight& w;
  int64_t stride;
  std::vector<bf16>& buffer;
  int64_t first = 0;
  void load(const Unit* u0, const Unit* u1);  // the units of one chunk, blocks in increasing order
  const bf16* block(int64_t b) const { return buffer.data() + (b - first) * stride; }
};

// The rows against the units, chunk by chunk: a chunk of about kChunkBytes of weights stays in L2
// while each 32-row group of activations (in L1 while k is small) runs against all of its units.
// (A 128-row slab per unit instead, which kept the unit in L1 and streamed the whole share of
// weights once per slab, ran 1.1-1.5x slower at 2048 rows.) Rows past the last multiple of 16 run
// from a zero-padded copy.
template <typename Blocks, typename Out>
KVM_AMX_TARGET void run(Blocks& blocks, const std::vector<Unit>& units, int64_t k, const bf16* x, int64_t m,
                        Out* out, int64_t n, const float* bias, bool swiglu) {
  const TileScope tiles;
  const int64_t steps = k / kTileK;
  const int64_t full = m - m % 16;
  thread_local std::vector<bf16> tail;
  if (full < m) {
    tail.assign(16 * k, bf16());
    std::memcpy(tail.data(), x + full * k, (m - full) * k * sizeof(bf16));
    amx_fence();
  }
  const int64_t n_units = static_cast<int64_t>(units.size());
  const int64_t per_chunk = std::max<int64_t>(1, kChunkBytes / (2 * k * kBlock * int64_t{sizeof(bf16)}));
  alignas(64) float c[2][kGroupRows * kGroupRows];  // the current block's sums and the previous one's
  int cur = 0;
  Epilogue<Out> prev;
  for (int64_t u0 = 0; u0 < n_units; u0 += per_chunk) {
    const int64_t u1 = std::min(n_units, u0 + per_chunk);
    blocks.load(units.data() + u0, units.data() + u1);
    for (int64_t r = 0; r < m;) {  // r stays a multiple of 16
      const bool in_tail = r >= full;  // fewer than 16 rows left: the padded copy
      const int64_t rows = in_tail ? m - r : (full - r >= kGroupRows ? kGroupRows : 16);
      const bf16* xr = in_tail ? tail.data() : x + r * k;
      const bool two_tiles = !in_tail && rows > 16;
      for (int64_t i = u0; i < u1; ++i) {
        const Unit& u = units[i];
        const bf16* w0 = blocks.block(u.b0);
        const bf16* w1 = u.b1 >= 0 ? blocks.block(u.b1) : nullptr;
        if (w1 != nullptr) {
          if (two_tiles) tile_block<2, 2>(xr, k, w0, w1, steps, c[cur], prev);
          else tile_block<1, 2>(xr, k, w0, w1, steps, c[cur], prev);
        } else {
          if (two_tiles) tile_block<2, 1>(xr, k, w0, w1, steps, c[cur], prev);
          else tile_block<1, 1>(xr, k, w0, w1, steps, c[cur], prev);
        }
        prev = Epilogue<Out>{c[cur], rows, 0, w1 != nullptr ? 2 : 1, out + r * n + u.col, n,
                             bias != nullptr ? bias + u.col : nullptr, swiglu};
        cur ^= 1;
      }
      r += rows;
    }
  }
  prev.write_to(prev.rows);
}

// Consecutive blocks [b_begin, b_end) two by two.
std::vector<Unit> block_pairs(int64_t b_begin, int64_t b_end) {
  std::vector<Unit> units;
  for (int64_t b = b_begin; b < b_end; b += 2) units.push_back({b, b + 1 < b_end ? b + 1 : -1, b * kBlock});
  return units;
}

// One thread's share of a packed weight: panels [p0, p1).
void packed_share(const PackedWeight& w, const bf16* x, int64_t m, bf16* out, int64_t p0, int64_t p1) {
  std::vector<Unit> units;
  if (w.swiglu) {
    for (int64_t g = p0; g < p1; ++g)
      for (int64_t i = 0; i < 2; ++i) units.push_back({4 * g + i, 4 * g + 2 + i, 2 * kBlock * g + kBlock * i});
  } else {
    const int64_t per_panel = w.blocks_per_panel();
    units = block_pairs(p0 * per_panel, std::min(p1 * per_panel, w.blocks));
  }
  PackedBlocks blocks{static_cast<const bf16*>(w.data), w.k * kBlock};
  run(blocks, units, w.k, x, m, out, w.width(), w.bias, w.swiglu);
}

// Where the 32 bf16 of cvtne2ps_pbh(at_k1, at_k) go in a row of the packed layout: column c's
// 32-bit word holds at_k[c] (lane c of the pair) in its low half and at_k1[c] (lane 16 + c) above.
alignas(64) constexpr uint16_t kPairOrder[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// Sixteen columns' weights at k (even) and k + 1 as one row of the packed layout.
inline void store_pair_row(bf16* dst, __m512 at_k, __m512 at_k1) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(at_k1, at_k);
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(_mm512_load_si512(kPairOrder), both));
}

inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const vec::half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Byte t (0-3) of every 32-bit lane as a float: signed (q8 codes), or unsigned (q4 nibbles, one
// byte shuffle: byte t of each lane to its bottom, zeros above).
template <int T, bool Signed>
inline __m512 byte_of(__m512i v) {
  if constexpr (Signed) return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * T), 24));
  constexpr uint32_t pick = 0x80808000u | T;  // byte T of a lane, then zeros (plus the lane's offset below)
  const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(pick)),
                                         _mm512_set_epi32(12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0));
  return _mm512_cvtepi32_ps(_mm512_shuffle_epi8(v, index));
}

// Four consecutive k of 16 columns (byte t of each lane holds k + t) as w = code * scale (+ min),
// rounded as dequantize_rows rounds: a float product, then a float sum, then bf16.
template <bool Signed, bool Mins>
inline void four_k(bf16* dst, __m512i v, __m512 scale, __m512 mins) {  // mins: q4 only
  __m512 w[4] = {_mm512_mul_ps(byte_of<0, Signed>(v), scale), _mm512_mul_ps(byte_of<1, Signed>(v), scale),
                 _mm512_mul_ps(byte_of<2, Signed>(v), scale), _mm512_mul_ps(byte_of<3, Signed>(v), scale)};
  if constexpr (Mins)
    for (__m512& x : w) x = _mm512_add_ps(x, mins);
  store_pair_row(dst, w[0], w[1]);
  store_pair_row(dst + 2 * kBlock, w[2], w[3]);
}

// One group of 16 columns into dst [K / 2][16][2]. q8 codes: [K / 4][16][4] signed bytes; q4:
// [K / 8][16][4] bytes holding k % 8 < 4 in the low nibble, the others in the high one.
template <typename S>
void dequantize_group(const QuantizedWeight& w, int64_t g, bf16* dst) {
  const int64_t blocks = w.k / kQuantBlock;
  const uint8_t* codes = w.codes + g * w.group_code_bytes();
  const S* scales = static_cast<const S*>(w.scale) + g * blocks * kBlock;
  const S* mins = w.mins != nullptr ? static_cast<const S*>(w.mins) + g * blocks * kBlock : nullptr;
  for (int64_t b = 0; b < blocks; ++b, dst += kQuantBlock * kBlock) {
    const __m512 scale = load_scales(scales + b * kBlock);
    if (mins == nullptr) {
      for (int64_t q = 0; q < kQuantBlock / 4; ++q, codes += 64)
        four_k<true, false>(dst + q * 4 * kBlock, _mm512_loadu_si512(codes), scale, _mm512_setzero_ps());
      continue;
    }
    const __m512 offset = load_scales(mins + b * kBlock);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t q = 0; q < kQuantBlock / 8; ++q, codes += 64) {
      const __m512i v = _mm512_loadu_si512(codes);
      four_k<false, true>(dst + q * 8 * kBlock, _mm512_and_si512(v, nibble), scale, offset);
      four_k<false, true>(dst + (q * 8 + 4) * kBlock, _mm512_and_si512(_mm512_srli_epi32(v, 4), nibble), scale,
                          offset);
    }
  }
}

template <typename S>
void DequantizedBlocks<S>::load(const Unit* u0, const Unit* u1) {
  first = u0->b0;
  const int64_t last = std::max(u1[-1].b0, u1[-1].b1);
  const size_t size = (last + 1 - first) * stride;
  if (buffer.size() < size) buffer.resize(size);  // never shrunk: growing again would zero it
  for (int64_t b = first; b <= last; ++b) dequantize_group<S>(w, b, buffer.data() + (b - first) * stride);
  amx_fence();
}

template <typename S, typename Out>
void quantized_share(const QuantizedWeight& w, const bf16* x, int64_t m, Out* out, int64_t g0, int64_t g1) {
  thread_local std::vector<bf16> buffer;
  DequantizedBlocks<S> blocks{w, w.k * kBlock, buffer};
  run(blocks, block_pairs(g0, g1), w.k, x, m, out, w.groups * kBlock, w.bias, false);
}

#endif  // KVM_AMX

}  // namespace

bool supported() {
  static const bool yes = detect();
  return yes;
}

// the tiles take a product from kMinRows rows only, so a row's arithmetic would depend on the batch:
// they stay off while the kernels keep batch invariance (common/batch_invariance.h)
bool enabled() { return switch_state().load(std::memory_order_relaxed) && !batch_invariant(); }

bool set_enabled(bool on) {
  switch_state().store(on && supported(), std::memory_order_relaxed);
  return switch_state().load(std::memory_order_relaxed);
}

bool takes(const PackedWeight& w, int64_t m) { return m >= kMinRows && w.k % kTileK == 0 && enabled(); }

void bf16_panels(const PackedWeight& w, const bf16* x, int64_t m, bf16* out, int64_t p0, int64_t p1) {
#if defined(KVM_AMX)
  packed_share(w, x, m, out, p0, p1);
#else
  (void)w, (void)x, (void)m, (void)out, (void)p0, (void)p1;
  KV_CHECK(false, "AMX tiles are not compiled into the ", vec::kLevelName, " kernels");
#endif
}

// q6, q4k and composite weights never take the tiles: their products stay on the int8 path (qlinear.cpp)
bool quantized_takes(const QuantizedWeight& w, int64_t m, bool on) {
  return m >= kMinRows && !w.composite() && w.super_scale == nullptr && w.q4k_supers == nullptr &&
         w.k % kTileK == 0 && on;
}

template <typename Out>
void quantized_bf16_groups(const QuantizedWeight& w, const bf16* x, int64_t m, Out* out, int64_t g0, int64_t g1) {
#if defined(KVM_AMX)
  if (w.half_scales) quantized_share<vec::half>(w, x, m, out, g0, g1);
  else quantized_share<float>(w, x, m, out, g0, g1);
#else
  (void)w, (void)x, (void)m, (void)out, (void)g0, (void)g1;
  KV_CHECK(false, "AMX tiles are not compiled into the ", vec::kLevelName, " kernels");
#endif
}

template void quantized_bf16_groups<bf16>(const QuantizedWeight&, const bf16*, int64_t, bf16*, int64_t, int64_t);
template void quantized_bf16_groups<float>(const QuantizedWeight&, const bf16*, int64_t, float*, int64_t, int64_t);

}  // namespace kvops::amx

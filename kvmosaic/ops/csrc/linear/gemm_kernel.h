// The register-tiled micro-kernel of the packed linear layers, written once over vec.h's F16 and
// shared by every product that runs on packed float weights (gemm.cpp; quantized weights dequantize
// panels into the same layout and call it too).
//
// A packed weight holds 16 output columns per block, k-major inside the block: float32 blocks are
// [K][16], bfloat16 blocks [K/2][16][2] (pairs of consecutive k, the AVX512-BF16 dot product's
// operand), so one 64-byte load gives all 16 columns of one k step. The micro-kernel keeps an
// MR x (NB * 16) tile of float sums in registers and broadcasts one activation (float32) or one
// pair (bfloat16) per row and k step. Without native bf16 dot products the pairs widen to float in
// registers (two FMAs per pair). Tile shapes follow the register count of the level.
#pragma once

#include "isa/vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kvops::gemm {

namespace vec = kvmosaic_vec;
using vec::bf16;
using vec::F16;

constexpr int64_t kBlock = 16;  // output columns per packed block

// Decode rows prefetch the weight stream ahead in software on AVX-512 only. On an AVX2 host (Zen 3)
// the prefetches slowed the stream: a standalone decode product over the default model's 540 MB
// float32 weights read 22-24 GB/s with the hardware prefetcher alone, 19-21 GB/s with prefetcht0
// 2-8 KiB ahead, against 24 GB/s for a plain streaming sum; the default model's float32 decode went
// from 30-32 to 35-37 tok/s (interleaved runs).
#if defined(KVM_VEC_AVX512)
constexpr bool kDecodePrefetch = true;
#else
constexpr bool kDecodePrefetch = false;
#endif

#if defined(KVM_VEC_AVX512) && defined(__AVX512BF16__)
constexpr bool kNativeBF16 = true;
#else
constexpr bool kNativeBF16 = false;
#endif

// One k step of the micro-kernel for an element type: how many k values a step covers, the weight
// operand of a block at that step, the broadcast activation, and the multiply-add.
template <typename T>
struct Step;

template <>
struct Step<float> {
  static constexpr int64_t kPack = 1;
  using W = F16;
  using A = F16;
  static W weight(const float* w) { return F16::load(w); }
  static A act(const float* x) { return F16::set1(*x); }
  static F16 fma(F16 acc, A a, W w) { return vec::fma(a, w, acc); }
};

#if defined(KVM_VEC_AVX512) && defined(__AVX512BF16__)
template <>
struct Step<bf16> {
  static constexpr int64_t kPack = 2;
  using W = __m512bh;
  using A = __m512bh;
  static W weight(const bf16* w) { return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w)); }
  static A act(const bf16* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static F16 fma(F16 acc, A a, W w) { return {_mm512_dpbf16_ps(acc.v, a, w)}; }
};
#else
template <>
struct Step<bf16> {
  static constexpr int64_t kPack = 2;
  using W = vec::BF16Pairs;
  using A = vec::BF16Pairs;
  static W weight(const bf16* w) { return vec::load_bf16_pairs(w); }
  static A act(const bf16* x) { return vec::broadcast_bf16_pair(x); }
  static F16 fma(F16 acc, A a, W w) { return vec::fma(a.odd, w.odd, vec::fma(a.even, w.even, acc)); }
};
#endif

// Tile shapes: MR rows x NB blocks of float sums, plus the NB weight operands (two vectors each when
// bf16 widens) and a broadcast, within the level's registers. A SwiGLU tile pairs NB / 2 gate blocks
// with the matching up blocks.
template <typename T, bool kSwiGLU>
struct Tiles {
  static constexpr bool kWide = std::is_same_v<T, bf16> && !kNativeBF16;
#if defined(KVM_VEC_AVX512)
  static constexpr int kRows = kSwiGLU ? (kWide ? 4 : 6) : (kWide ? 6 : 8);
  static constexpr int kPanel = kSwiGLU ? 4 : 3;
#else
  static constexpr int kRows = kSwiGLU ? (kWide ? 2 : 3) : (kWide ? 4 : 6);
  static constexpr int kPanel = kSwiGLU ? 2 : 1;
#endif
};

// MR rows x NB blocks. w points at the first block's k = 0; blocks are block_stride elements apart.
// steps = K / kPack. With few rows (decode: the weight stream is the bottleneck) each block is
// prefetched 2 KiB ahead where kDecodePrefetch says so; with more rows, the first rows of a slab
// prefetch the same part of the next panel (next) while this panel computes.
// SwiGLU of float gate and up sums: silu(gate) * up, each value rounded to T where the unfused path
// (projection output, then silu_and_mul) rounds it, so the fused products equal it bit for bit.
template <typename T>
inline F16 swiglu_rounded(F16 gate, F16 up) {
  const F16 g = vec::round_to<T>(gate);
  return vec::round_to<T>(g / (F16::set1(1.f) + vec::exp(F16::zero() - g))) * vec::round_to<T>(up);
}

template <typename T, int MR, int NB, bool kSwiGLU>
inline void micro_kernel(const T* x, int64_t ldx, const T* w, int64_t block_stride, int64_t steps, T* out,
                         int64_t ldo, const float* bias, const T* next) {
  using S = Step<T>;
  constexpr int64_t kStepElems = kBlock * S::kPack;
  constexpr int64_t kAhead = 2048 / sizeof(T);
  F16 acc[MR][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[m][j] = F16::zero();
  for (int64_t s = 0; s < steps; ++s) {
    typename S::W wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const int64_t at = j * block_stride + s * kStepElems;
      if constexpr (MR <= 4) {
        if constexpr (kDecodePrefetch) vec::prefetch_l1(w + at + kAhead);
      } else {
        if (next != nullptr) vec::prefetch_l1(next + at);
      }
      wv[j] = S::weight(w + at);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const typename S::A a = S::act(x + m * ldx + s * S::kPack);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[m][j] = S::fma(acc[m][j], a, wv[j]);
    }
  }
  if constexpr (kSwiGLU) {
    // blocks [0, NB/2) are gate columns, [NB/2, NB) the matching up columns
    static_assert(NB % 2 == 0, "a SwiGLU tile pairs gate and up blocks");
#pragma GCC unroll 2
    for (int j = 0; j < NB / 2; ++j)
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) swiglu_rounded<T>(acc[m][j], acc[m][j + NB / 2]).store(out + m * ldo + j * kBlock);
  } else {
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const F16 b = bias != nullptr ? F16::load(bias + j * kBlock) : F16::zero();
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) (acc[m][j] + b).store(out + m * ldo + j * kBlock);
    }
  }
}

// mr (1..MR) rows: the micro-kernel instantiated for exactly that many.
template <typename T, int NB, bool kSwiGLU, int MR>
inline void rows_kernel(int64_t mr, const T* x, int64_t ldx, const T* w, int64_t block_stride, int64_t steps,
                        T* out, int64_t ldo, const float* bias, const T* next) {
  if constexpr (MR > 1) {
    if (mr < MR) return rows_kernel<T, NB, kSwiGLU, MR - 1>(mr, x, ldx, w, block_stride, steps, out, ldo, bias, next);
  }
  micro_kernel<T, MR, NB, kSwiGLU>(x, ldx, w, block_stride, steps, out, ldo, bias, next);
}

// nb (1..NB) blocks of a plain product, mr (1..kRows) rows.
template <typename T, int NB>
inline void plain_tile(int64_t nb, int64_t mr, const T* x, int64_t ldx, const T* w, int64_t block_stride,
                       int64_t steps, T* out, int64_t ldo, const float* bias, const T* next) {
  if constexpr (NB > 1) {
    if (nb < NB) return plain_tile<T, NB - 1>(nb, mr, x, ldx, w, block_stride, steps, out, ldo, bias, next);
  }
  rows_kernel<T, NB, false, Tiles<T, false>::kRows>(mr, x, ldx, w, block_stride, steps, out, ldo, bias, next);
}

// One packed SwiGLU group of 4 blocks (32 gate columns, then the same 32 up columns) for mr rows,
// as 4 / kPanel tiles: a 2-block tile takes gate block i and up block i (2 blocks apart).
template <typename T>
inline void swiglu_group(int64_t mr, const T* x, int64_t ldx, const T* w, int64_t block_stride, int64_t steps,
                         T* out, int64_t ldo, const T* next) {
  constexpr int NB = Tiles<T, true>::kPanel;
  constexpr int kRows = Tiles<T, true>::kRows;
  if constexpr (NB == 4) {
    rows_kernel<T, 4, true, kRows>(mr, x, ldx, w, block_stride, steps, out, ldo, nullptr, next);
  } else {
    static_assert(NB == 2, "SwiGLU tiles hold 2 or 4 blocks");
    for (int i = 0; i < 2; ++i)
      rows_kernel<T, 2, true, kRows>(mr, x, ldx, w + i * block_stride, 2 * block_stride, steps, out + i * kBlock, ldo,
                                     nullptr, next == nullptr ? nullptr : next + i * block_stride);
  }
}

}  // namespace kvops::gemm

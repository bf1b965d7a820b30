// Integer dot products for the quantized linears, one source per ISA level (as vec.h is for floats).
//
// I16 holds sixteen int32 sums, one per output column of the interleaved weight layout
// (kvmosaic/quant/weights.py): 64 weight bytes are 16 columns x 4 consecutive k, so one u8 x s8 dot
// of those bytes with four broadcast activation bytes adds four products to each column's sum.
// AVX512-VNNI and AVX-VNNI do that in one instruction; AVX-512 and AVX2 without VNNI use
// maddubs (u8 x s8 pairs to int16) + madd (pairs to int32), which cannot overflow here: weights are
// 0..15 (q4) or |w| <= 128 (q8, by the sign trick) and activations |x| <= 127. Portable: plain loops.
#pragma once

#include "vec.h"

#include <c10/util/Half.h>

namespace kvmosaic_qdot {

using kvmosaic_vec::F16;

#if defined(KVM_VEC_AVX512)
struct V64 {  // 64 bytes
  __m512i v;
  static V64 load(const void* p) { return {_mm512_loadu_si512(p)}; }
  static V64 broadcast4(int32_t x) { return {_mm512_set1_epi32(x)}; }
  V64 low_nibbles() const { return {_mm512_and_si512(v, _mm512_set1_epi8(0x0F))}; }
  V64 high_nibbles() const { return {_mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F))}; }
  V64 abs_s8() const { return {_mm512_abs_epi8(v)}; }
  // x with the sign of this (signed bytes): x negated where this is negative
  V64 sign_of(V64 x) const {
    return {_mm512_mask_sub_epi8(x.v, _mm512_movepi8_mask(v), _mm512_setzero_si512(), x.v)};
  }
};
struct I16 {
  __m512i v;
  static I16 zero() { return {_mm512_setzero_si512()}; }
  F16 to_float() const { return {_mm512_cvtepi32_ps(v)}; }
};
// acc + per column the sum of four u8 x s8 products
inline I16 dot_u8s8(I16 acc, V64 u, V64 s) {
#if defined(__AVX512VNNI__)
  return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)};
#else
  const __m512i pairs = _mm512_maddubs_epi16(u.v, s.v);
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
#endif
}
inline F16 load_half16(const c10::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}

#elif defined(KVM_VEC_AVX2)
struct V64 {
  __m256i lo, hi;
  static V64 load(const void* p) {
    const __m256i* q = reinterpret_cast<const __m256i*>(p);
    return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
  }
  static V64 broadcast4(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
  V64 low_nibbles() const {
    const __m256i m = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(lo, m), _mm256_and_si256(hi, m)};
  }
  V64 high_nibbles() const {
    const __m256i m = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(_mm256_srli_epi16(lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(hi, 4), m)};
  }
  V64 abs_s8() const { return {_mm256_abs_epi8(lo), _mm256_abs_epi8(hi)}; }
  V64 sign_of(V64 x) const { return {_mm256_sign_epi8(x.lo, lo), _mm256_sign_epi8(x.hi, hi)}; }
};
struct I16 {
  __m256i lo, hi;
  static I16 zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  F16 to_float() const { return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)}; }
};
inline __m256i dot8_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline I16 dot_u8s8(I16 acc, V64 u, V64 s) { return {dot8_u8s8(acc.lo, u.lo, s.lo), dot8_u8s8(acc.hi, u.hi, s.hi)}; }
inline F16 load_half16(const c10::Half* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}

#else
struct V64 {
  uint8_t b[64];
  static V64 load(const void* p) {
    V64 r;
    std::memcpy(r.b, p, 64);
    return r;
  }
  static V64 broadcast4(int32_t x) {
    V64 r;
    for (int j = 0; j < 16; ++j) std::memcpy(r.b + 4 * j, &x, 4);
    return r;
  }
  template <typename Op>
  V64 map(Op op) const {
    V64 r;
    for (int j = 0; j < 64; ++j) r.b[j] = op(b[j]);
    return r;
  }
  V64 low_nibbles() const { return map([](uint8_t x) { return static_cast<uint8_t>(x & 0x0F); }); }
  V64 high_nibbles() const { return map([](uint8_t x) { return static_cast<uint8_t>(x >> 4); }); }
  V64 abs_s8() const {
    return map([](uint8_t x) { return static_cast<uint8_t>(std::abs(static_cast<int>(static_cast<int8_t>(x)))); });
  }
  V64 sign_of(V64 x) const {
    V64 r;
    for (int j = 0; j < 64; ++j) {
      const int s = static_cast<int8_t>(b[j]), v = static_cast<int8_t>(x.b[j]);
      r.b[j] = static_cast<uint8_t>(static_cast<int8_t>(s < 0 ? -v : (s == 0 ? 0 : v)));
    }
    return r;
  }
};
struct I16 {
  int32_t v[16];
  static I16 zero() { return {}; }
  F16 to_float() const {
    F16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = static_cast<float>(v[j]);
    return r;
  }
};
inline I16 dot_u8s8(I16 acc, V64 u, V64 s) {
  for (int j = 0; j < 16; ++j)
    for (int t = 0; t < 4; ++t)
      acc.v[j] += static_cast<int32_t>(u.b[4 * j + t]) * static_cast<int8_t>(s.b[4 * j + t]);
  return acc;
}
inline F16 load_half16(const c10::Half* p) {
  F16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = static_cast<float>(p[j]);
  return r;
}
#endif

#if defined(KVM_VEC_AVX512)
inline I16 add(I16 a, I16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
#elif defined(KVM_VEC_AVX2)
inline I16 add(I16 a, I16 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
#else
inline I16 add(I16 a, I16 b) {
  for (int j = 0; j < 16; ++j) a.v[j] += b.v[j];
  return a;
}
#endif

// Sums of q4 dots over one block: u8 x s8 dots as add() takes them, widened to int32 by total().
// Without VNNI the pair sums of maddubs stay int16 until the block's end (one madd a block instead of
// one a dot): a block adds at most 8 of them to one sum, and 8 * 2 * 15 * 127 = 30480 fits int16 as
// q4 codes are 0..15 and activations |x| <= 127. Not for q8 codes, whose one pair can reach 32512.
#if (defined(KVM_VEC_AVX512) && !defined(__AVX512VNNI__)) || (defined(KVM_VEC_AVX2) && !defined(__AVXVNNI__))
#if defined(KVM_VEC_AVX512)
struct Q4Sum {
  __m512i v;
  static Q4Sum zero() { return {_mm512_setzero_si512()}; }
  Q4Sum add(V64 u, V64 s) const { return {_mm512_add_epi16(v, _mm512_maddubs_epi16(u.v, s.v))}; }
  I16 total() const { return {_mm512_madd_epi16(v, _mm512_set1_epi16(1))}; }
};
#else
struct Q4Sum {
  __m256i lo, hi;
  static Q4Sum zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  Q4Sum add(V64 u, V64 s) const {
    return {_mm256_add_epi16(lo, _mm256_maddubs_epi16(u.lo, s.lo)), _mm256_add_epi16(hi, _mm256_maddubs_epi16(u.hi, s.hi))};
  }
  I16 total() const {
    const __m256i one = _mm256_set1_epi16(1);
    return {_mm256_madd_epi16(lo, one), _mm256_madd_epi16(hi, one)};
  }
};
#endif
#else
struct Q4Sum {  // VNNI's dot instruction, or the portable loops: int32 sums throughout
  I16 v;
  static Q4Sum zero() { return {I16::zero()}; }
  Q4Sum add(V64 u, V64 s) const { return {dot_u8s8(v, u, s)}; }
  I16 total() const { return v; }
};
#endif

// Signed q8 weights times signed activations: |w| times x carrying w's sign (u8 x s8 needs one unsigned side).
inline I16 dot_s8s8(I16 acc, V64 w, V64 x) { return dot_u8s8(acc, w.abs_s8(), w.sign_of(x)); }

inline F16 load_scale16(const float* p) { return F16::load(p); }
inline F16 load_scale16(const c10::Half* p) { return load_half16(p); }

}  // namespace kvmosaic_qdot

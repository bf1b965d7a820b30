// Integer dot products for the quantized linears, one source per ISA level (as vec.h is for floats).
//
// I16 holds sixteen int32 sums, one per output column of the interleaved weight layout
// (kvmosaic/quant/weights.py): 64 weight bytes are 16 columns x 4 consecutive k, so one u8 x s8 dot
// of those bytes with four broadcast activation bytes adds four products to each column's sum.
// AVX512-VNNI and AVX-VNNI do that in one instruction; AVX-512 and AVX2 without VNNI use
// maddubs (u8 x s8 pairs to int16) + madd (pairs to int32), which cannot overflow here: weights are
// 0..15 (q4) or |w| <= 128 (q8, by the sign trick) and activations |x| <= 127. Portable: plain loops.
#pragma once

#include "isa/vec.h"

namespace kvmosaic_qdot {

using kvmosaic_vec::F16;
using kvmosaic_vec::half;

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
  V64 operator|(V64 o) const { return {_mm512_or_si512(v, o.v)}; }
  V64 minus32() const { return {_mm512_sub_epi8(v, _mm512_set1_epi8(32))}; }
  template <int S>  // bits 2S and 2S + 1 of each byte, moved to bits 4 and 5
  V64 pair_bits() const {
    constexpr int kLeft = 4 - 2 * S;
    __m512i t = v;
    if constexpr (kLeft > 0) t = _mm512_slli_epi16(v, kLeft);
    if constexpr (kLeft < 0) t = _mm512_srli_epi16(v, -kLeft);
    return {_mm512_and_si512(t, _mm512_set1_epi8(0x30))};
  }
};
struct I16 {
  __m512i v;
  static I16 zero() { return {_mm512_setzero_si512()}; }
  static I16 load_s8(const int8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  static I16 set1(int32_t x) { return {_mm512_set1_epi32(x)}; }
  F16 to_float() const { return {_mm512_cvtepi32_ps(v)}; }
  I16 operator*(I16 o) const { return {_mm512_mullo_epi32(v, o.v)}; }
  // each int32 lane's low 16 bits in both of its int16 halves (a multiplier for madd)
  __m512i twice16() const { return _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(v, 16)); }
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
inline F16 load_half16(const half* p) {
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
  V64 operator|(V64 o) const { return {_mm256_or_si256(lo, o.lo), _mm256_or_si256(hi, o.hi)}; }
  V64 minus32() const {
    const __m256i c = _mm256_set1_epi8(32);
    return {_mm256_sub_epi8(lo, c), _mm256_sub_epi8(hi, c)};
  }
  template <int S>  // bits 2S and 2S + 1 of each byte, moved to bits 4 and 5
  V64 pair_bits() const {
    constexpr int kLeft = 4 - 2 * S;
    __m256i a = lo, b = hi;
    if constexpr (kLeft > 0) {
      a = _mm256_slli_epi16(lo, kLeft);
      b = _mm256_slli_epi16(hi, kLeft);
    }
    if constexpr (kLeft < 0) {
      a = _mm256_srli_epi16(lo, -kLeft);
      b = _mm256_srli_epi16(hi, -kLeft);
    }
    const __m256i m = _mm256_set1_epi8(0x30);
    return {_mm256_and_si256(a, m), _mm256_and_si256(b, m)};
  }
};
struct I16 {
  __m256i lo, hi;
  static I16 zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static I16 set1(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
  static I16 load_s8(const int8_t* p) {
    const __m128i* q = reinterpret_cast<const __m128i*>(p);
    return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(q)), _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  F16 to_float() const { return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)}; }
  I16 operator*(I16 o) const { return {_mm256_mullo_epi32(lo, o.lo), _mm256_mullo_epi32(hi, o.hi)}; }
};
// each int32 lane's low 16 bits in both of its int16 halves (a multiplier for madd)
inline __m256i twice16(__m256i x) {
  return _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(x, 16));
}
inline __m256i dot8_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline I16 dot_u8s8(I16 acc, V64 u, V64 s) { return {dot8_u8s8(acc.lo, u.lo, s.lo), dot8_u8s8(acc.hi, u.hi, s.hi)}; }
inline F16 load_half16(const half* p) {
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
  V64 operator|(V64 o) const {
    V64 r;
    for (int j = 0; j < 64; ++j) r.b[j] = b[j] | o.b[j];
    return r;
  }
  V64 minus32() const { return map([](uint8_t x) { return static_cast<uint8_t>(x - 32); }); }
  template <int S>  // bits 2S and 2S + 1 of each byte, moved to bits 4 and 5
  V64 pair_bits() const { return map([](uint8_t x) { return static_cast<uint8_t>(((x >> (2 * S)) & 3) << 4); }); }
};
struct I16 {
  int32_t v[16];
  static I16 zero() { return {}; }
  static I16 set1(int32_t x) {
    I16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = x;
    return r;
  }
  static I16 load_s8(const int8_t* p) {
    I16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = p[j];
    return r;
  }
  I16 operator*(I16 o) const {
    I16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = v[j] * o.v[j];
    return r;
  }
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
inline F16 load_half16(const half* p) {
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
// q6 sub-blocks use it too: 4 dots of |q| <= 32 by sign, 4 * 2 * 32 * 127 = 32512, and scaled(sc)
// widens with the sub-block's int8 scale as madd's multiplier (|sum| * 128 * 2 fits int32).
#if (defined(KVM_VEC_AVX512) && !defined(__AVX512VNNI__)) || (defined(KVM_VEC_AVX2) && !defined(__AVXVNNI__))
constexpr bool kInt32Q4Sums = false;
#if defined(KVM_VEC_AVX512)
struct Q4Sum {
  __m512i v;
  static Q4Sum zero() { return {_mm512_setzero_si512()}; }
  Q4Sum add(V64 u, V64 s) const { return {_mm512_add_epi16(v, _mm512_maddubs_epi16(u.v, s.v))}; }
  I16 total() const { return {_mm512_madd_epi16(v, _mm512_set1_epi16(1))}; }
  I16 scaled(I16 sc) const { return {_mm512_madd_epi16(v, sc.twice16())}; }  // total() * sc
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
  I16 scaled(I16 sc) const { return {_mm256_madd_epi16(lo, twice16(sc.lo)), _mm256_madd_epi16(hi, twice16(sc.hi))}; }
};
#endif
#else
constexpr bool kInt32Q4Sums = true;
struct Q4Sum {  // VNNI's dot instruction, or the portable loops: int32 sums throughout
  I16 v;
  static Q4Sum zero() { return {I16::zero()}; }
  Q4Sum add(V64 u, V64 s) const { return {dot_u8s8(v, u, s)}; }
  I16 total() const { return v; }
  I16 scaled(I16 sc) const { return v * sc; }  // total() * sc
};
#endif

// Signed q8 weights times signed activations: |w| times x carrying w's sign (u8 x s8 needs one unsigned side).
inline I16 dot_s8s8(I16 acc, V64 w, V64 x) { return dot_u8s8(acc, w.abs_s8(), w.sign_of(x)); }

inline F16 load_scale16(const float* p) { return F16::load(p); }
inline F16 load_scale16(const half* p) { return load_half16(p); }

}  // namespace kvmosaic_qdot

// The thin vector type every kvmosaic kernel is written over: F16 holds sixteen float lanes.
//
// One source, compiled once per ISA level (kvmosaic/ops/levels.py): with AVX-512 an F16 is one
// __m512, with AVX2+FMA it is two __m256, and anywhere else a plain array the compiler vectorizes as
// it can (so the build never fails on ARM or an old x86). Kernels keep thinking in 16-lane tiles;
// only the tile shapes that depend on the register count (kVecRegisters) differ between levels.
// A lane mask is the low 16 bits of a uint32_t (bit j = lane j).
#pragma once

#include "isa/scalar_types.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define KVM_VEC_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVM_VEC_AVX2 1
#include <immintrin.h>
#else
#define KVM_VEC_PORTABLE 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace kvmosaic_vec {

using Mask = uint32_t;

#if defined(KVM_VEC_AVX512)
constexpr const char* kLevelName = "avx512";
constexpr int kVecRegisters = 32;
#elif defined(KVM_VEC_AVX2)
constexpr const char* kLevelName = "avx2";
constexpr int kVecRegisters = 8;  // 16 ymm registers, two per F16
#else
constexpr const char* kLevelName = "portable";
constexpr int kVecRegisters = 8;
#endif

inline Mask first_lanes(int n) { return n >= 16 ? 0xFFFFu : (1u << std::max(n, 0)) - 1u; }

// exp(x) for x <= 0 (softmax after subtracting the max): Cody-Waite range reduction and a degree-5
// minimax polynomial, about 1 ulp; the vector exp below is the same polynomial.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// float -> bf16 bit pattern (round to nearest even, NaN kept quiet), as c10::BFloat16 does.
inline uint16_t bf16_bits(float x) { return bf16(x).x; }

#if defined(KVM_VEC_AVX512)
struct F16 {
  __m512 v;
  static F16 zero() { return {_mm512_setzero_ps()}; }
  static F16 set1(float x) { return {_mm512_set1_ps(x)}; }
  static F16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static F16 load(const bf16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
  }
  static F16 load(const float* p, Mask m) { return {_mm512_maskz_loadu_ps(static_cast<__mmask16>(m), p)}; }
  static F16 load(const bf16* p, Mask m) {
    const __m256i raw = _mm256_maskz_loadu_epi16(static_cast<__mmask16>(m), p);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(float* p, Mask m) const { _mm512_mask_storeu_ps(p, static_cast<__mmask16>(m), v); }
  void store(bf16* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_halves()); }
  void store(bf16* p, Mask m) const { _mm256_mask_storeu_epi16(p, static_cast<__mmask16>(m), bf16_halves()); }
  // The sixteen values rounded to bf16, as 16-bit lanes.
  __m256i bf16_halves() const {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
#endif
  }
  friend F16 operator+(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend F16 operator-(F16 a, F16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend F16 operator*(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend F16 operator/(F16 a, F16 b) { return {_mm512_div_ps(a.v, b.v)}; }
  float reduce_add() const { return _mm512_reduce_add_ps(v); }
  float reduce_max() const { return _mm512_reduce_max_ps(v); }
};
inline F16 fma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline F16 fnma(F16 a, F16 b, F16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a * b
inline F16 max(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F16 min(F16 a, F16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline F16 select(Mask m, F16 a, F16 b) { return {_mm512_mask_blend_ps(static_cast<__mmask16>(m), b.v, a.v)}; }
inline F16 round_nearest(F16 a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline F16 abs(F16 a) { return {_mm512_abs_ps(a.v)}; }
// a * 2^n for integral n (overflowing to inf as expf does).
inline F16 scale_pow2(F16 a, F16 n) { return {_mm512_scalef_ps(a.v, n.v)}; }
inline Mask greater(F16 a, F16 b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
inline Mask is_nan(F16 a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }

#elif defined(KVM_VEC_AVX2)
struct F16 {
  __m256 lo, hi;
  static F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static F16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static F16 load(const bf16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {widen(_mm256_castsi256_si128(raw)), widen(_mm256_extracti128_si256(raw, 1))};
  }
  template <typename T>
  static F16 load(const T* p, Mask m) {
    alignas(32) T tmp[16] = {};
    for (int j = 0; j < 16; ++j)
      if (m >> j & 1u) tmp[j] = p[j];
    return load(tmp);
  }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
  void store(bf16* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_halves()); }
  template <typename T>
  void store(T* p, Mask m) const {
    alignas(32) T tmp[16];
    store(tmp);
    for (int j = 0; j < 16; ++j)
      if (m >> j & 1u) p[j] = tmp[j];
  }
  __m256i bf16_halves() const {
    const __m256i packed = _mm256_packus_epi32(round_bf16(lo), round_bf16(hi));
    return _mm256_permute4x64_epi64(packed, 0xD8);  // packus interleaves the 128-bit halves
  }
  static __m256 widen(__m128i halves) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
  }
  // Eight floats to bf16 bits in the low 16 bits of each 32-bit lane.
  static __m256i round_bf16(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  }
  friend F16 operator+(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  friend F16 operator-(F16 a, F16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  friend F16 operator*(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  friend F16 operator/(F16 a, F16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
  float reduce_add() const {
    const __m256 s = _mm256_add_ps(lo, hi);
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  float reduce_max() const {
    const __m256 s = _mm256_max_ps(lo, hi);
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
};
inline F16 fma(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 fnma(F16 a, F16 b, F16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 max(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F16 min(F16 a, F16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
// Lane j of the result: all ones where bit j of m is set.
inline __m256 lane_mask8(Mask m) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i sel = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(m & 0xFFu)), bits);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(sel, bits));
}
inline F16 select(Mask m, F16 a, F16 b) {
  return {_mm256_blendv_ps(b.lo, a.lo, lane_mask8(m)), _mm256_blendv_ps(b.hi, a.hi, lane_mask8(m >> 8))};
}
inline F16 round_nearest(F16 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
inline F16 abs(F16 a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
}
inline __m256 pow2_8(__m256 n) {  // 2^n for integral n in [-127, 128] (128: inf)
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline F16 scale_pow2(F16 a, F16 n) {  // any n: clamped to pow2_8's range
  const __m256 low = _mm256_set1_ps(-127.f), high = _mm256_set1_ps(128.f);
  const __m256 lo_n = _mm256_min_ps(_mm256_max_ps(n.lo, low), high), hi_n = _mm256_min_ps(_mm256_max_ps(n.hi, low), high);
  return {_mm256_mul_ps(a.lo, pow2_8(lo_n)), _mm256_mul_ps(a.hi, pow2_8(hi_n))};
}
inline Mask is_nan(F16 a) {
  return static_cast<Mask>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q))) |
         static_cast<Mask>(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q))) << 8;
}
inline Mask greater(F16 a, F16 b) {
  return static_cast<Mask>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ))) |
         static_cast<Mask>(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ))) << 8;
}

#else
struct F16 {
  float v[16];
  static F16 zero() { return set1(0.f); }
  static F16 set1(float x) {
    F16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = x;
    return r;
  }
  template <typename T>
  static F16 load(const T* p) {
    F16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = static_cast<float>(p[j]);
    return r;
  }
  template <typename T>
  static F16 load(const T* p, Mask m) {
    F16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = (m >> j & 1u) ? static_cast<float>(p[j]) : 0.f;
    return r;
  }
  template <typename T>
  void store(T* p) const {
    for (int j = 0; j < 16; ++j) p[j] = static_cast<T>(v[j]);
  }
  template <typename T>
  void store(T* p, Mask m) const {
    for (int j = 0; j < 16; ++j)
      if (m >> j & 1u) p[j] = static_cast<T>(v[j]);
  }
  template <typename Op>
  friend F16 zip(F16 a, F16 b, Op op) {
    F16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = op(a.v[j], b.v[j]);
    return r;
  }
  friend F16 operator+(F16 a, F16 b) { return zip(a, b, [](float x, float y) { return x + y; }); }
  friend F16 operator-(F16 a, F16 b) { return zip(a, b, [](float x, float y) { return x - y; }); }
  friend F16 operator*(F16 a, F16 b) { return zip(a, b, [](float x, float y) { return x * y; }); }
  friend F16 operator/(F16 a, F16 b) { return zip(a, b, [](float x, float y) { return x / y; }); }
  float reduce_add() const {
    float s = 0.f;
    for (int j = 0; j < 16; ++j) s += v[j];
    return s;
  }
  float reduce_max() const {
    float s = v[0];
    for (int j = 1; j < 16; ++j) s = std::max(s, v[j]);
    return s;
  }
};
inline F16 fma(F16 a, F16 b, F16 c) {
  F16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = std::fma(a.v[j], b.v[j], c.v[j]);
  return r;
}
inline F16 fnma(F16 a, F16 b, F16 c) {
  F16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = std::fma(-a.v[j], b.v[j], c.v[j]);
  return r;
}
inline F16 max(F16 a, F16 b) { return zip(a, b, [](float x, float y) { return std::max(x, y); }); }
inline F16 min(F16 a, F16 b) { return zip(a, b, [](float x, float y) { return std::min(x, y); }); }
inline F16 select(Mask m, F16 a, F16 b) {
  F16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = (m >> j & 1u) ? a.v[j] : b.v[j];
  return r;
}
inline F16 round_nearest(F16 a) {
  F16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = std::nearbyint(a.v[j]);
  return r;
}
inline F16 abs(F16 a) {
  F16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = std::fabs(a.v[j]);
  return r;
}
inline F16 scale_pow2(F16 a, F16 n) {  // any n: ldexp takes it as an int in range (NaN: a stays)
  F16 r;
  for (int j = 0; j < 16; ++j) {
    const float e = std::isnan(n.v[j]) ? 0.f : std::clamp(n.v[j], -300.f, 300.f);
    r.v[j] = std::ldexp(a.v[j], static_cast<int>(e));
  }
  return r;
}
inline Mask greater(F16 a, F16 b) {
  Mask m = 0;
  for (int j = 0; j < 16; ++j) m |= static_cast<Mask>(a.v[j] > b.v[j]) << j;
  return m;
}
inline Mask is_nan(F16 a) {
  Mask m = 0;
  for (int j = 0; j < 16; ++j) m |= static_cast<Mask>(std::isnan(a.v[j])) << j;
  return m;
}
#endif

// Lanes of a masked out; the rest of a.
inline F16 maskz(Mask m, F16 a) { return select(m, a, F16::zero()); }
inline float reduce_max(Mask m, F16 a) {
  return select(m, a, F16::set1(-std::numeric_limits<float>::infinity())).reduce_max();
}

// Rounds each lane to the precision of T (a no-op for float), as a store to T and load back would.
template <typename T>
inline F16 round_to(F16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
#if defined(KVM_VEC_AVX512)
  } else if constexpr (std::is_same_v<T, bf16>) {  // the same bits, without the trip through memory
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v.bf16_halves()), 16))};
#endif
  } else {
    alignas(64) T tmp[16];
    v.store(tmp);
    return F16::load(tmp);
  }
}

// exp on 16 lanes: the polynomial of exp_nonpositive scaled by 2^n. Overflows to inf past the float
// range; below -87 gives exp(-87) ~ 1.6e-38, not 0.
inline F16 exp(F16 x) {
  x = max(x, F16::set1(-87.0f));
  x = min(x, F16::set1(89.0f));
  const F16 n = round_nearest(x * F16::set1(1.44269504088896341f));
  F16 r = fnma(n, F16::set1(0.693359375f), x);
  r = fma(n, F16::set1(2.12194440e-4f), r);
  F16 p = F16::set1(1.9875691500e-4f);
  p = fma(p, r, F16::set1(1.3981999507e-3f));
  p = fma(p, r, F16::set1(8.3334519073e-3f));
  p = fma(p, r, F16::set1(4.1665795894e-2f));
  p = fma(p, r, F16::set1(1.6666665459e-1f));
  p = fma(p, r, F16::set1(5.0000001201e-1f));
  const F16 y = fma(p, r * r, r + F16::set1(1.0f));
  return scale_pow2(y, n);
}

// 2^x on 16 lanes, for softmax scores kept in log2 units: n = round(x) and a degree-5 fit of 2^f on
// [-1/2, 1/2] (relative error under 2e-7 in float), 8 operations against exp's 15. Underflows to 0
// (AVX2: below 2^-126) and overflows to inf.
inline F16 exp2(F16 x) {
  const F16 n = round_nearest(x);
  const F16 f = x - n;
  F16 p = F16::set1(1.32647238e-3f);
  p = fma(p, f, F16::set1(9.67151299e-3f));
  p = fma(p, f, F16::set1(5.55073358e-2f));
  p = fma(p, f, F16::set1(2.40222424e-1f));
  p = fma(p, f, F16::set1(6.93147004e-1f));
  p = fma(p, f, F16::set1(1.0f));
  return scale_pow2(p, n);
}

// Horizontal sums of sixteen vectors at once: lane j of the result is the sum of v[j]'s lanes
// (a transpose-and-add tree instead of sixteen separate reductions).
inline F16 sum_lanes16(const F16* v) {
#if defined(KVM_VEC_AVX512)
  // the shuffle tree leaves the sum of input i in lane kOut[i]; feed it inputs in that order
  constexpr int kSlot[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
  __m512 w[16], r[8], s[4], u[2];
  for (int j = 0; j < 16; ++j) w[kSlot[j]] = v[j].v;
  for (int i = 0; i < 8; ++i)
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  return {_mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                        _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)))};
#elif defined(KVM_VEC_AVX2)
  auto eight = [](const F16* x) {  // lane j: the sum of x[j] (j < 8)
    __m256 s[8];
    for (int j = 0; j < 8; ++j) s[j] = _mm256_add_ps(x[j].lo, x[j].hi);
    const __m256 t0 = _mm256_hadd_ps(s[0], s[1]), t1 = _mm256_hadd_ps(s[2], s[3]);
    const __m256 t2 = _mm256_hadd_ps(s[4], s[5]), t3 = _mm256_hadd_ps(s[6], s[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  };
  return {eight(v), eight(v + 8)};
#else
  F16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = v[j].reduce_add();
  return r;
#endif
}

// Online softmax of one query row, sixteen scores at a time. Scores are exponentiated against a
// reference that moves (rescaling the running sum, and the caller's output by *corr) only when a
// score exceeds it by more than kSlack: meanwhile exp(s - ref) <= e^8, far from float overflow, and
// most tiles skip the rescale. The normalized result is the same either way.
struct OnlineSoftmax {
  static constexpr float kSlack = 8.f;
  float ref = -std::numeric_limits<float>::infinity();
  F16 sum = F16::zero();

  // Probabilities of the valid lanes (0 elsewhere); *corr != 1 when the output must be rescaled.
  F16 update(F16 scores, Mask valid, float* corr) {
    const float tile_max = reduce_max(valid, scores);
    *corr = 1.f;
    if (tile_max > ref + kSlack) {
      *corr = ref == -std::numeric_limits<float>::infinity() ? 0.f : exp_nonpositive(ref - tile_max);
      sum = sum * F16::set1(*corr);
      ref = tile_max;
    }
    const F16 p = maskz(valid, exp(scores - F16::set1(ref)));
    sum = sum + p;
    return p;
  }
  float total() const { return sum.reduce_add(); }
};

// Sixteen output columns times one pair of bf16 activations (a0 at k, a1 at k + 1) against a weight
// block laid out [16 columns][2] (k and k + 1 of a column next to each other): acc + a0 w_k + a1 w_k1.
// AVX512-BF16 does it in one instruction; elsewhere the bf16 pairs widen to float in registers.
inline F16 dot_bf16_pair(F16 acc, const bf16* activation_pair, const bf16* weight_pairs) {
#if defined(KVM_VEC_AVX512) && defined(__AVX512BF16__)
  int32_t pair;
  std::memcpy(&pair, activation_pair, sizeof(pair));
  const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
  const __m512bh w = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(weight_pairs));
  return {_mm512_dpbf16_ps(acc.v, a, w)};
#elif defined(KVM_VEC_AVX512)
  const __m512i w = _mm512_loadu_si512(reinterpret_cast<const void*>(weight_pairs));
  const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  const __m512 a0 = _mm512_set1_ps(static_cast<float>(activation_pair[0]));
  const __m512 a1 = _mm512_set1_ps(static_cast<float>(activation_pair[1]));
  return {_mm512_fmadd_ps(a1, odd, _mm512_fmadd_ps(a0, even, acc.v))};
#elif defined(KVM_VEC_AVX2)
  const __m256i w_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weight_pairs));
  const __m256i w_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weight_pairs + 16));
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256 a0 = _mm256_set1_ps(static_cast<float>(activation_pair[0]));
  const __m256 a1 = _mm256_set1_ps(static_cast<float>(activation_pair[1]));
  __m256 lo = _mm256_fmadd_ps(a0, _mm256_castsi256_ps(_mm256_slli_epi32(w_lo, 16)), acc.lo);
  __m256 hi = _mm256_fmadd_ps(a0, _mm256_castsi256_ps(_mm256_slli_epi32(w_hi, 16)), acc.hi);
  lo = _mm256_fmadd_ps(a1, _mm256_castsi256_ps(_mm256_and_si256(w_lo, high)), lo);
  hi = _mm256_fmadd_ps(a1, _mm256_castsi256_ps(_mm256_and_si256(w_hi, high)), hi);
  return {lo, hi};
#else
  F16 r = acc;
  const float a0 = static_cast<float>(activation_pair[0]), a1 = static_cast<float>(activation_pair[1]);
  for (int j = 0; j < 16; ++j)
    r.v[j] = std::fma(a1, static_cast<float>(weight_pairs[2 * j + 1]),
                      std::fma(a0, static_cast<float>(weight_pairs[2 * j]), r.v[j]));
  return r;
#endif
}

// Software prefetch into L1 / L2 (__builtin_prefetch: prefetcht0 / prefetcht1 on x86, the nearest
// equivalent or nothing elsewhere, so the portable level still compiles on any architecture).
inline void prefetch_l1(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Sixteen columns' bf16 weights at k and k + 1, stored as pairs [16 columns][2], widened to float:
// even holds the k values, odd the k + 1 values (for levels without native bf16 dot products).
struct BF16Pairs {
  F16 even, odd;
};
inline BF16Pairs load_bf16_pairs(const bf16* pairs) {
#if defined(KVM_VEC_AVX512)
  const __m512i w = _mm512_loadu_si512(reinterpret_cast<const void*>(pairs));
  return {{_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))},
          {_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))}};
#elif defined(KVM_VEC_AVX2)
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 16));
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  return {{_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))},
          {_mm256_castsi256_ps(_mm256_and_si256(lo, high)), _mm256_castsi256_ps(_mm256_and_si256(hi, high))}};
#else
  BF16Pairs r;
  for (int j = 0; j < 16; ++j) {
    r.even.v[j] = static_cast<float>(pairs[2 * j]);
    r.odd.v[j] = static_cast<float>(pairs[2 * j + 1]);
  }
  return r;
#endif
}

// One pair of bf16 values (x[0], x[1]) broadcast to all lanes and widened: even = x[0], odd = x[1]
// (one 32-bit broadcast and two integer ops, not two scalar conversions and broadcasts).
inline BF16Pairs broadcast_bf16_pair(const bf16* pair) {
  int32_t bits;
  std::memcpy(&bits, pair, sizeof(bits));
#if defined(KVM_VEC_AVX512)
  const __m512i w = _mm512_set1_epi32(bits);
  return {{_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))},
          {_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))}};
#elif defined(KVM_VEC_AVX2)
  const __m256i w = _mm256_set1_epi32(bits);
  const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return {{even, even}, {odd, odd}};
#else
  return {F16::set1(static_cast<float>(pair[0])), F16::set1(static_cast<float>(pair[1]))};
#endif
}

}  // namespace kvmosaic_vec

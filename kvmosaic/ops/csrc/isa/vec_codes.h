// Small integer codes (bytes, nibbles) widened to F16 lanes, per ISA level: the unpacking the
// quantized-KV kernels do on every row, kept next to vec.h so the kernels themselves stay one source.
#pragma once

#include "isa/vec.h"

namespace kvmosaic_vec {

// Sixteen unsigned bytes as floats.
inline F16 bytes_to_f16(const uint8_t* p) {
#if defined(KVM_VEC_AVX512)
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
#elif defined(KVM_VEC_AVX2)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8)))};
#else
  F16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = static_cast<float>(p[j]);
  return r;
#endif
}

#if defined(KVM_VEC_AVX512) || defined(KVM_VEC_AVX2)
// 16 bytes of nibble pairs as 32 bytes of codes 0..15 in element order (element 2i: the low nibble of byte i).
inline void split_nibbles(const uint8_t* p, __m128i* lo, __m128i* hi) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i low = _mm_and_si128(raw, mask), high = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  *lo = _mm_unpacklo_epi8(low, high);
  *hi = _mm_unpackhi_epi8(low, high);
}
#endif

// 32 four-bit codes (16 bytes, element 2i in the low nibble of byte i) as two vectors of floats.
inline void nibbles_to_f16(const uint8_t* p, F16* r) {
#if defined(KVM_VEC_AVX512) || defined(KVM_VEC_AVX2)
  __m128i lo, hi;
  split_nibbles(p, &lo, &hi);
  r[0] = bytes_to_f16(reinterpret_cast<const uint8_t*>(&lo));
  r[1] = bytes_to_f16(reinterpret_cast<const uint8_t*>(&hi));
#else
  for (int j = 0; j < 16; ++j) {
    r[j / 8].v[2 * (j % 8)] = static_cast<float>(p[j] & 15);
    r[j / 8].v[2 * (j % 8) + 1] = static_cast<float>(p[j] >> 4);
  }
#endif
}

// table[code] for 32 four-bit codes laid out as nibbles_to_f16 reads them (a 16-entry lookup).
inline void lookup_nibbles(const float* table, const uint8_t* p, F16* r) {
#if defined(KVM_VEC_AVX512)
  __m128i lo, hi;
  split_nibbles(p, &lo, &hi);
  const __m512 t = _mm512_loadu_ps(table);
  r[0] = {_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(lo), t)};
  r[1] = {_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(hi), t)};
#elif defined(KVM_VEC_AVX2)
  __m128i codes[2];
  split_nibbles(p, codes, codes + 1);
  const __m256 t_lo = _mm256_loadu_ps(table), t_hi = _mm256_loadu_ps(table + 8);
  auto eight = [&](__m128i bytes) {  // permutevar reads the low three bits; bit 3 picks the half
    const __m256i idx = _mm256_cvtepu8_epi32(bytes);
    const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t_lo, idx), _mm256_permutevar8x32_ps(t_hi, idx), upper);
  };
  for (int h = 0; h < 2; ++h) r[h] = {eight(codes[h]), eight(_mm_srli_si128(codes[h], 8))};
#else
  for (int j = 0; j < 16; ++j) {
    r[j / 8].v[2 * (j % 8)] = table[p[j] & 15];
    r[j / 8].v[2 * (j % 8) + 1] = table[p[j] >> 4];
  }
#endif
}

// The lanes set in m replaced, in lane order, by values[0], values[1], ... (the rest of a kept).
inline F16 expand(F16 a, Mask m, const float* values) {
#if defined(KVM_VEC_AVX512)
  return {_mm512_mask_expand_ps(a.v, static_cast<__mmask16>(m), _mm512_loadu_ps(values))};
#else
  if (m == 0) return a;
  alignas(64) float lanes[16];
  a.store(lanes);
  for (int k = 0; m != 0; m &= m - 1) lanes[__builtin_ctz(m)] = values[k++];
  return F16::load(lanes);
#endif
}

}  // namespace kvmosaic_vec

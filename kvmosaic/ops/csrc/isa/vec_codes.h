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

}  // namespace kvmosaic_vec

// SIMD helpers shared by the kvmosaic kernels (kvmosaic_ops.cpp, kvquant_ops.cpp): float/bf16
// widening, exp, 16-way lane sums and the online softmax of the attention kernels.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace kvmosaic_simd {

// exp(x) for x <= 0 (softmax after subtracting the max): Cody-Waite range reduction and a
// degree-5 minimax polynomial, about 1 ulp, written so that loops over it vectorize.
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

#if defined(__AVX512F__)
// Sixteen values widened to float, and back (bf16 rounds to nearest even like c10::BFloat16).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int i = 0; i < 16; ++i) p[i] = static_cast<c10::BFloat16>(tmp[i]);
#endif
}
#endif

#if defined(__AVX512F__)
// Sums the lanes of 16 vectors at once (a transpose-and-add tree, ~45 instructions instead of 16
// horizontal reductions). Lane j of the result is the sum of v[kSumSlot[j]]: put row j there.
constexpr int kSumSlot[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
inline __m512 sum_lanes16(const __m512* v) {
  __m512 r[8], s[4], u[2];
  for (int i = 0; i < 8; ++i)
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
}

// exp(x) on 16 lanes: the polynomial of exp_nonpositive, scaled by 2^n with scalef (which gives
// inf past the float range, as expf does; below -87 the result is exp(-87) ~ 1.6e-38, not 0).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// Online softmax of one query row, sixteen scores at a time. Scores are exponentiated against a
// reference that moves (rescaling the running sum, and the caller's output by *corr) only when a
// score exceeds it by more than kSlack: meanwhile exp(s - ref) <= e^8, far from float overflow,
// and most tiles skip the rescale. The normalized result is the same either way.
struct OnlineSoftmax {
  static constexpr float kSlack = 8.f;
  float ref = -std::numeric_limits<float>::infinity();
  __m512 sum = _mm512_setzero_ps();

  // Probabilities of the valid lanes (0 elsewhere); *corr != 1 when the output must be rescaled.
  __m512 update(__m512 scores, __mmask16 valid, float* corr) {
    const float tile_max = _mm512_mask_reduce_max_ps(valid, scores);
    *corr = 1.f;
    if (tile_max > ref + kSlack) {
      *corr = ref == -std::numeric_limits<float>::infinity() ? 0.f : exp_nonpositive(ref - tile_max);
      sum = _mm512_mul_ps(sum, _mm512_set1_ps(*corr));
      ref = tile_max;
    }
    const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(ref))));
    sum = _mm512_add_ps(sum, p);
    return p;
  }
  float total() const { return _mm512_reduce_add_ps(sum); }
};
#endif

}  // namespace kvmosaic_simd

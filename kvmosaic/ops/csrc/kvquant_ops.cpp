// Kernels for the quantized KV cache (int8, int4, Oaken): quantize-and-write of new K/V rows,
// dequantization of whole blocks (prefill), and decode attention that reads the blocks in place
// (AVX-512: 16-token tiles, codes widened in registers, for head_dim 64 / 128; else a scalar
// kernel that dequantizes each head vector into a small buffer). The byte layout is the one documented in
// kvmosaic/quant/format.py and kvmosaic/quant/oaken.py; encoding matches the PyTorch reference bit
// for bit (same float32 operation order, fp16 rounding to nearest even, ties-to-even codes).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace kvmosaic_simd;

enum Mode : int64_t { kInt8 = 0, kInt4 = 1, kOaken = 2 };
constexpr int64_t kIntHeader = 4;
constexpr int64_t kOakenHeader = 8;
constexpr float kMinScale = 6.103515625e-05f;    // 2^-14
constexpr float kMargin = 1.001953125f;          // 1 + 2^-9
constexpr float kNegFloor = -6.103515625e-05f;   // -2^-14

struct Format {
  int64_t mode, hk, d, capacity, record;
  int64_t code_bytes, index_bits, entry_bytes, sparse_bytes, sparse_offset;
};

Format make_format(int64_t mode, int64_t hk, int64_t d, int64_t capacity, int64_t record) {
  TORCH_CHECK(mode >= kInt8 && mode <= kOaken, "unknown KV quantization mode ", mode);
  TORCH_CHECK(d >= 2 && d % 2 == 0, "head_dim must be even");
  Format f{mode, hk, d, capacity, record, 0, 0, 0, 0, 0};
  f.code_bytes = mode == kInt8 ? d : d / 2;
  int64_t bits = 1;
  while ((int64_t{1} << bits) < d) ++bits;
  f.index_bits = bits;
  f.entry_bytes = bits + 2 <= 8 ? 1 : 2;
  f.sparse_bytes = 1 + capacity * f.entry_bytes;
  f.sparse_offset = kOakenHeader * hk + hk * f.code_bytes;
  int64_t expected = hk * (kIntHeader + f.code_bytes);
  if (mode == kOaken) expected = f.sparse_offset + hk * f.sparse_bytes, expected += expected % 2;
  TORCH_CHECK(record == expected, "record size ", record, " does not match the format (", expected, ")");
  return f;
}

struct Thresholds {
  float outer_lo = 0.f, inner_lo = 0.f, inner_hi = 0.f, outer_hi = 0.f;
};

Thresholds read_thresholds(const at::Tensor& t) {
  Thresholds r;
  if (t.numel() == 4) {
    auto c = t.to(at::kFloat).contiguous();
    const float* p = c.data_ptr<float>();
    r = {p[0], p[1], p[2], p[3]};
  }
  return r;
}

inline float half_round(float x) { return static_cast<float>(c10::Half(x)); }
inline float read_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}
inline void write_half(uint8_t* p, float x) {
  const c10::Half h(x);
  std::memcpy(p, &h.x, 2);
}
inline float scale_for(float span, int levels) {
  return half_round(std::max(span, levels * kMinScale) / static_cast<float>(levels) * kMargin);
}
inline float quantize_code(float x, float divisor, float levels) {
  return std::min(std::max(std::nearbyint(x / divisor), 0.f), levels);
}

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// ---------------------------------------------------------------- encoding

void encode_int_head(const float* x, const Format& f, uint8_t* out) {
  const int levels = f.mode == kInt8 ? 255 : 15;
  float lo = x[0], hi = x[0];
  for (int64_t i = 1; i < f.d; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
  const float lo16 = half_round(lo);
  const float s16 = scale_for(hi - lo16, levels);
  const float div = s16 > 0.f ? s16 : 1.f;
  write_half(out, lo16);
  write_half(out + 2, s16);
  uint8_t* codes = out + kIntHeader;
  if (f.mode == kInt8) {
    for (int64_t i = 0; i < f.d; ++i) codes[i] = static_cast<uint8_t>(quantize_code(x[i] - lo16, div, 255.f));
  } else {
    for (int64_t i = 0; i < f.d; i += 2) {
      const auto a = static_cast<uint8_t>(quantize_code(x[i] - lo16, div, 15.f));
      const auto b = static_cast<uint8_t>(quantize_code(x[i + 1] - lo16, div, 15.f));
      codes[i / 2] = static_cast<uint8_t>(a | (b << 4));
    }
  }
}

// Groups: 0 middle, 1 kept outer, 2 kept inner. Returns the outliers folded into the middle.
int64_t oaken_groups(const float* x, const Format& f, const Thresholds& t, uint8_t* group) {
  int64_t folded = 0;
  for (int64_t h = 0; h < f.hk; ++h) {
    const float* xh = x + h * f.d;
    uint8_t* gh = group + h * f.d;
    int64_t n_outer = 0;
    for (int64_t i = 0; i < f.d; ++i) n_outer += (xh[i] > t.outer_hi || xh[i] < t.outer_lo);
    int64_t outer_rank = 0, inner_rank = n_outer;
    for (int64_t i = 0; i < f.d; ++i) {
      gh[i] = 0;
      if (xh[i] > t.outer_hi || xh[i] < t.outer_lo) {
        if (++outer_rank <= f.capacity) gh[i] = 1;
      } else if (xh[i] >= t.inner_lo && xh[i] <= t.inner_hi) {
        if (++inner_rank <= f.capacity) gh[i] = 2;
      } else {
        continue;
      }
      folded += gh[i] == 0;
    }
  }
  return folded;
}

// One head vector: its four fp16 scales into header, its 4-bit codes into code[0, d).
void encode_oaken_head(const float* x, const uint8_t* group, const Format& f, const Thresholds& t, uint8_t* header,
                       float* code) {
  float mid_lo = 0.f, mid_hi = 0.f, out_max = 0.f, in_max = 0.f;
  for (int64_t i = 0; i < f.d; ++i) {
    const bool neg = x[i] < 0.f;
    if (group[i] == 0) {
      const float v = x[i] - (neg ? t.inner_lo : t.inner_hi);
      mid_lo = std::min(mid_lo, v), mid_hi = std::max(mid_hi, v);
    } else if (group[i] == 1) {
      out_max = std::max(out_max, neg ? t.outer_lo - x[i] : x[i] - t.outer_hi);
    } else {
      in_max = std::max(in_max, std::fabs(x[i]));
    }
  }
  const float lo16 = half_round(std::min(mid_lo, kNegFloor));
  const float mid_s = scale_for(mid_hi - lo16, 15);
  const float out_s = scale_for(out_max, 15);
  const float in_s = scale_for(in_max, 15);
  float first_nonneg = 0.f;
  for (int c = 0; c < 16; ++c) first_nonneg += (lo16 + static_cast<float>(c) * mid_s < 0.f);
  for (int64_t i = 0; i < f.d; ++i) {
    const bool neg = x[i] < 0.f;
    if (group[i] == 0) {
      const float c = quantize_code(x[i] - (neg ? t.inner_lo : t.inner_hi) - lo16, mid_s > 0.f ? mid_s : 1.f, 15.f);
      code[i] = neg ? std::min(c, first_nonneg - 1.f) : std::max(c, first_nonneg);
    } else if (group[i] == 1) {
      code[i] = quantize_code(neg ? t.outer_lo - x[i] : x[i] - t.outer_hi, out_s, 15.f);
    } else {
      code[i] = quantize_code(std::fabs(x[i]), in_s, 15.f);
    }
  }
  write_half(header, lo16), write_half(header + 2, mid_s), write_half(header + 4, out_s), write_half(header + 6, in_s);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI2__) && defined(__BMI2__)
// One head vector of 64 values, the scalar path's operations lane by lane (bit-exact): groups as
// 64-bit masks (the first `capacity` outer values kept, then the first inner ones, by pdep),
// min/max scales by masked reductions, codes by round-to-nearest-even, the dense nibbles packed
// pairwise, the sparse entries compressed into index order. Returns the outliers folded.
inline uint64_t low_bits(int64_t k) { return k >= 64 ? ~uint64_t{0} : (uint64_t{1} << k) - 1; }

int64_t encode_oaken_head64(const float* x, const Format& f, const Thresholds& t, uint8_t* header, uint8_t* dense,
                            uint8_t* list) {
  __m512 v[4];
  uint64_t outer = 0, inner = 0, neg = 0;
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm512_loadu_ps(x + 16 * c);
    const __mmask16 o = _mm512_cmp_ps_mask(v[c], _mm512_set1_ps(t.outer_hi), _CMP_GT_OQ) |
                        _mm512_cmp_ps_mask(v[c], _mm512_set1_ps(t.outer_lo), _CMP_LT_OQ);
    const __mmask16 i = _mm512_cmp_ps_mask(v[c], _mm512_set1_ps(t.inner_lo), _CMP_GE_OQ) &
                        _mm512_cmp_ps_mask(v[c], _mm512_set1_ps(t.inner_hi), _CMP_LE_OQ) & ~o;
    outer |= uint64_t{o} << (16 * c), inner |= uint64_t{i} << (16 * c);
    neg |= uint64_t{_mm512_cmp_ps_mask(v[c], _mm512_setzero_ps(), _CMP_LT_OQ)} << (16 * c);
  }
  const int64_t n_outer = __builtin_popcountll(outer), n_inner = __builtin_popcountll(inner);
  const uint64_t keep_outer = _pdep_u64(low_bits(std::min(f.capacity, n_outer)), outer);
  const uint64_t keep_inner = _pdep_u64(low_bits(std::max<int64_t>(0, f.capacity - n_outer)), inner);
  const uint64_t kept = keep_outer | keep_inner;
  const int64_t folded = n_outer + n_inner - __builtin_popcountll(kept);
  __m512 w[4], m[4];
  __m512 mid_lo = _mm512_setzero_ps(), mid_hi = _mm512_setzero_ps(), out_max = _mm512_setzero_ps(), in_max = _mm512_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    const auto nc = static_cast<__mmask16>(neg >> (16 * c));
    const auto mid = static_cast<__mmask16>(~kept >> (16 * c));
    w[c] = _mm512_sub_ps(v[c], _mm512_mask_blend_ps(nc, _mm512_set1_ps(t.inner_hi), _mm512_set1_ps(t.inner_lo)));
    mid_lo = _mm512_mask_min_ps(mid_lo, mid, mid_lo, w[c]), mid_hi = _mm512_mask_max_ps(mid_hi, mid, mid_hi, w[c]);
    m[c] = _mm512_mask_blend_ps(nc, _mm512_sub_ps(v[c], _mm512_set1_ps(t.outer_hi)), _mm512_sub_ps(_mm512_set1_ps(t.outer_lo), v[c]));
    out_max = _mm512_mask_max_ps(out_max, static_cast<__mmask16>(keep_outer >> (16 * c)), out_max, m[c]);
    in_max = _mm512_mask_max_ps(in_max, static_cast<__mmask16>(keep_inner >> (16 * c)), in_max, _mm512_abs_ps(v[c]));
  }
  const float lo16 = half_round(std::min(_mm512_reduce_min_ps(mid_lo), kNegFloor));
  const float mid_s = scale_for(_mm512_reduce_max_ps(mid_hi) - lo16, 15);
  const float out_s = scale_for(_mm512_reduce_max_ps(out_max), 15);
  const float in_s = scale_for(_mm512_reduce_max_ps(in_max), 15);
  const __m512 level = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __mmask16 below = _mm512_cmp_ps_mask(
      _mm512_add_ps(_mm512_set1_ps(lo16), _mm512_mul_ps(level, _mm512_set1_ps(mid_s))), _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 first = _mm512_set1_ps(static_cast<float>(__builtin_popcount(below)));
  const __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps(15.f);
  auto quantize = [&](__m512 y, float divisor) {
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(y, _mm512_set1_ps(divisor)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_min_ps(_mm512_max_ps(r, zero), top);
  };
  for (int c = 0; c < 4; ++c) {
    const auto nc = static_cast<__mmask16>(neg >> (16 * c));
    __m512 code = quantize(_mm512_sub_ps(w[c], _mm512_set1_ps(lo16)), mid_s > 0.f ? mid_s : 1.f);
    code = _mm512_mask_blend_ps(nc, _mm512_max_ps(code, first), _mm512_min_ps(code, _mm512_sub_ps(first, _mm512_set1_ps(1.f))));
    code = _mm512_mask_mov_ps(code, static_cast<__mmask16>(keep_outer >> (16 * c)), quantize(m[c], out_s));
    code = _mm512_mask_mov_ps(code, static_cast<__mmask16>(keep_inner >> (16 * c)), quantize(_mm512_abs_ps(v[c]), in_s));
    // 16 codes -> 16 bytes -> 8 bytes of nibble pairs (element 2i low, 2i+1 high)
    const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(code));
    const __m128i pairs = _mm_or_si128(_mm_and_si128(bytes, _mm_set1_epi16(0x000F)),
                                       _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi16(0x00F0)));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dense + 8 * c), _mm_cvtepi16_epi8(pairs));
  }
  __m512i entry = _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42,
                                  41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20,
                                  19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  entry = _mm512_mask_add_epi8(entry, keep_outer, entry, _mm512_set1_epi8(0x40));
  entry = _mm512_mask_add_epi8(entry, neg & kept, entry, _mm512_set1_epi8(static_cast<char>(0x80)));
  list[0] = static_cast<uint8_t>(__builtin_popcountll(kept));
  _mm512_mask_storeu_epi8(list + 1, low_bits(f.capacity), _mm512_maskz_compress_epi8(kept, entry));
  write_half(header, lo16), write_half(header + 2, mid_s), write_half(header + 4, out_s), write_half(header + 6, in_s);
  return folded;
}
#endif

int64_t encode_oaken_token(const float* x, const Format& f, const Thresholds& t, uint8_t* out,
                           std::vector<uint8_t>& group, std::vector<float>& code) {
  std::memset(out, 0, f.record);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI2__) && defined(__BMI2__)
  if (f.d == 64) {
    int64_t folded = 0;
    for (int64_t h = 0; h < f.hk; ++h)
      folded += encode_oaken_head64(x + h * 64, f, t, out + h * kOakenHeader, out + kOakenHeader * f.hk + h * 32,
                                    out + f.sparse_offset + h * f.sparse_bytes);
    return folded;
  }
#endif
  const int64_t n = f.hk * f.d;
  const int64_t folded = oaken_groups(x, f, t, group.data());
  for (int64_t h = 0; h < f.hk; ++h)
    encode_oaken_head(x + h * f.d, group.data() + h * f.d, f, t, out + h * kOakenHeader, code.data() + h * f.d);
  uint8_t* dense = out + kOakenHeader * f.hk;
  for (int64_t i = 0; i < n; i += 2)
    dense[i / 2] = static_cast<uint8_t>(static_cast<int>(code[i]) | (static_cast<int>(code[i + 1]) << 4));
  for (int64_t h = 0; h < f.hk; ++h) {
    uint8_t* list = out + f.sparse_offset + h * f.sparse_bytes;
    int64_t count = 0;
    for (int64_t i = 0; i < f.d; ++i) {
      const uint8_t g = group[h * f.d + i];
      if (!g) continue;
      const int64_t entry = i | (int64_t{g == 1} << f.index_bits) | (int64_t{x[h * f.d + i] < 0.f} << (f.index_bits + 1));
      uint8_t* e = list + 1 + count * f.entry_bytes;
      e[0] = static_cast<uint8_t>(entry & 255);
      if (f.entry_bytes == 2) e[1] = static_cast<uint8_t>(entry >> 8);
      ++count;
    }
    list[0] = static_cast<uint8_t>(count);
  }
  return folded;
}

int64_t encode_token(const float* x, const Format& f, const Thresholds& t, uint8_t* out,
                     std::vector<uint8_t>& group, std::vector<float>& code) {
  if (f.mode == kOaken) return encode_oaken_token(x, f, t, out, group, code);
  for (int64_t h = 0; h < f.hk; ++h) encode_int_head(x + h * f.d, f, out + h * (kIntHeader + f.code_bytes));
  return 0;
}

// ---------------------------------------------------------------- decoding

// Oaken scales of one head vector.
struct OakenScales {
  float mid_lo, mid_s, out_s, in_s;
};

inline OakenScales read_scales(const uint8_t* rec) {
  return {read_half(rec), read_half(rec + 2), read_half(rec + 4), read_half(rec + 6)};
}

// Oaken's sparse entries of head h written over its dense values in dst[0, d).
inline void patch_sparse(const uint8_t* rec, int64_t h, const Format& f, const Thresholds& t, const OakenScales& sc,
                         const uint8_t* dense, float* dst) {
  const uint8_t* list = rec + f.sparse_offset + h * f.sparse_bytes;
  const int64_t count = list[0];
  const int64_t index_mask = (int64_t{1} << f.index_bits) - 1;
  // Branch-free patch, by (group, sign): value = base + code * (+-scale), the same float result as
  // outer_hi + m, outer_lo - m, m and -m with m = code * scale.
  const float base[4] = {0.f, t.outer_hi, 0.f, t.outer_lo};
  const float step[4] = {sc.in_s, sc.out_s, -sc.in_s, -sc.out_s};
  for (int64_t e = 0; e < count; ++e) {
    const uint8_t* p = list + 1 + e * f.entry_bytes;
    const int64_t entry = f.entry_bytes == 1 ? p[0] : (p[0] | (p[1] << 8));
    const int64_t i = entry & index_mask, kind = entry >> f.index_bits;
    dst[i] = base[kind] + static_cast<float>((dense[i >> 1] >> ((i & 1) * 4)) & 15) * step[kind];
  }
}

// One head vector of a record into dst[0, d).
template <int64_t D = 0>  // D > 0: the head dimension as a compile-time constant (loops unroll)
inline void decode_head(const uint8_t* rec, int64_t h, const Format& f, const Thresholds& t, float* __restrict dst) {
  const int64_t half = (D > 0 ? D : f.d) / 2;
  if (f.mode == kInt8 || f.mode == kInt4) {
    const uint8_t* p = rec + h * (kIntHeader + f.code_bytes);
    const float lo = read_half(p), s = read_half(p + 2);
    const uint8_t* __restrict codes = p + kIntHeader;
    if (f.mode == kInt8) {
#pragma omp simd
      for (int64_t i = 0; i < 2 * half; ++i) dst[i] = lo + static_cast<float>(codes[i]) * s;
    } else {
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        dst[2 * j] = lo + static_cast<float>(codes[j] & 15) * s;
        dst[2 * j + 1] = lo + static_cast<float>(codes[j] >> 4) * s;
      }
    }
    return;
  }
  const OakenScales sc = read_scales(rec + h * kOakenHeader);
  const float inner_hi = t.inner_hi, inner_lo = t.inner_lo;
  const uint8_t* __restrict dense = rec + kOakenHeader * f.hk + h * f.code_bytes;
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    const float y0 = sc.mid_lo + static_cast<float>(dense[j] & 15) * sc.mid_s;
    const float y1 = sc.mid_lo + static_cast<float>(dense[j] >> 4) * sc.mid_s;
    dst[2 * j] = y0 + (y0 >= 0.f ? inner_hi : inner_lo);
    dst[2 * j + 1] = y1 + (y1 >= 0.f ? inner_hi : inner_lo);
  }
  patch_sparse(rec, h, f, t, sc, dense, dst);
}

constexpr int64_t kTile = 16;

// Online-softmax decode attention of one (sequence, KV head): tiles of 16 keys are dequantized
// into a small float buffer and scored against the group's query rows; the softmax runs over the
// tile's 16 scores at once; then the tile's values are dequantized and each query row's
// accumulator (D floats, kept in registers when D is a compile-time constant) takes them in.
template <typename T, int64_t D>
void decode_one(const T* q, const uint8_t* kp, const uint8_t* vp, const int64_t* table, int64_t ctx,
                int64_t block_size, int64_t h, int64_t group, const Format& f, const Thresholds& kt,
                const Thresholds& vt, float scale, T* out, std::vector<float>& work) {
  const int64_t d = D > 0 ? D : f.d;
  float* qf = work.data();                 // [group, d]
  float* acc = qf + group * d;             // [group, d]
  float* tile = acc + group * d;           // [kTile, d]
  float* probs = tile + kTile * d;         // [group, kTile]
  float* run = probs + group * kTile;      // [2, group]: max, sum
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < d; ++i) qf[g * d + i] = to_float(q[g * d + i]) * scale;
    run[g] = -std::numeric_limits<float>::infinity(), run[group + g] = 0.f;
  }
  std::fill(acc, acc + group * d, 0.f);
  int64_t offsets[kTile];
  for (int64_t t0 = 0; t0 < ctx; t0 += kTile) {
    const int64_t n = std::min(kTile, ctx - t0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = t0 + j;
      offsets[j] = (table[t / block_size] * block_size + t % block_size) * f.record;
      decode_head<D>(kp + offsets[j], h, f, kt, tile + j * d);
    }
    for (int64_t g = 0; g < group; ++g) {
      float sc[kTile];
      const float* qv = qf + g * d;
      for (int64_t j = 0; j < kTile; ++j) {
        float dot = 0.f;
        const float* kv = tile + j * d;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += qv[i] * kv[i];
        sc[j] = j < n ? dot : -std::numeric_limits<float>::infinity();
      }
      float tile_max = sc[0];
      for (int64_t j = 1; j < n; ++j) tile_max = std::max(tile_max, sc[j]);
      const float new_max = std::max(run[g], tile_max);
      const float corr = exp_nonpositive(run[g] - new_max);
      float* pr = probs + g * kTile;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < kTile; ++j) {
        pr[j] = exp_nonpositive(sc[j] - new_max);
        sum += pr[j];
      }
      for (int64_t j = n; j < kTile; ++j) sum -= pr[j], pr[j] = 0.f;  // exp(-inf) clamps to tiny, not 0
      run[g] = new_max, run[group + g] = run[group + g] * corr + sum;
      float* a = acc + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] *= corr;
    }
    for (int64_t j = 0; j < n; ++j) decode_head<D>(vp + offsets[j], h, f, vt, tile + j * d);
    for (int64_t g = 0; g < group; ++g) {
      float a[D > 0 ? D : 1];
      float* ag = D > 0 ? a : acc + g * d;
      if (D > 0) std::memcpy(a, acc + g * d, sizeof(float) * d);
      const float* pr = probs + g * kTile;
      for (int64_t j = 0; j < n; ++j) {
        const float p = pr[j];
        const float* vrow = tile + j * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ag[i] += p * vrow[i];
      }
      if (D > 0) std::memcpy(acc + g * d, a, sizeof(float) * d);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / run[group + g];
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = static_cast<T>(acc[g * d + i] * inv);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// ------------------------------------------------ decode attention, AVX-512 (head_dim 64 or 128)
//
// One work item is one sequence; each tile of 16 tokens is read once for all KV heads (a record
// holds every head of a slot). int8 / int4 are affine per token, so they are not dequantized:
// q . (lo + s c) = lo * sum(q) + s * (q . c) and sum_j p_j (lo_j + s_j c_j) = sum_j p_j lo_j +
// sum_j (p_j s_j) c_j, with the codes c widened to float in registers. Oaken rows of head_dim 64 take
// the same affine form (load_oaken64); other Oaken rows are dequantized through a one-row L1 buffer
// and use lo = 0, s = 1.


inline __m512 bytes_to_float(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }

// 32 four-bit codes (16 bytes, element 2i in the low nibble of byte i) as two vectors of floats.
inline void nibbles32(const uint8_t* p, __m512* r) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  r[0] = bytes_to_float(_mm_unpacklo_epi8(lo, hi));
  r[1] = bytes_to_float(_mm_unpackhi_epi8(lo, hi));
}

// Oaken rows of head_dim 64 (one-byte sparse entries) as affine codes, value_i = lo + s * r_i, like
// int4, so the scores and value weights take the same per-token (lo, s) path. With y = mid_lo + c *
// mid_s the middle value is y + inner_lo or y + inner_hi by the sign of y; y grows with the code c,
// so with lo = mid_lo + inner_lo and s = mid_s a middle slot is r = c, plus (inner_hi - inner_lo) / s
// from the first code whose level is >= 0 (a 16-entry table the nibbles index). Outlier slots get
// r = (value - lo) / s. A tile's outliers are decoded first, one row's (at most 16) entries in one
// vector, with no branch on their count (oaken_outliers64); the rows are then built and patched
// (load_oaken64): the values, lined up from each 16-lane chunk's first entry, expand into the lanes
// the sorted indices name. Two passes keep the long decode chain of one row off the dot products.
struct OakenRow {
  alignas(64) float table[16];  // affine code of each middle nibble
  alignas(64) float value[16];  // affine codes of the outliers, in index order
  uint64_t lanes;               // bit i: lane i holds an outlier
  float lo, s;
};

inline void oaken_row64(const uint8_t* rec, int64_t h, const Format& f, const Thresholds& t, OakenRow* out) {
  const __m128 scales = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + h * kOakenHeader)));
  const float mid_lo = _mm_cvtss_f32(scales), mid_s = _mm_cvtss_f32(_mm_movehdup_ps(scales));
  const float lo = mid_lo + t.inner_lo, inv_s = 1.f / mid_s;
  out->lo = lo, out->s = mid_s;
  const __m512 level = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 y = _mm512_add_ps(_mm512_set1_ps(mid_lo), _mm512_mul_ps(level, _mm512_set1_ps(mid_s)));
  _mm512_store_ps(out->table, _mm512_mask_add_ps(level, _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GE_OQ), level,
                                                 _mm512_set1_ps((t.inner_hi - t.inner_lo) * inv_s)));
  const uint8_t* list = rec + f.sparse_offset + h * f.sparse_bytes;
  const __mmask16 valid = static_cast<__mmask16>((1u << list[0]) - 1u);  // count <= 16 (the caller checks)
  const __m512i entry = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(valid, list + 1));
  const __m512i idx = _mm512_and_si512(entry, _mm512_set1_epi32(63));
  // the 4-bit code in the dense slot: nibble idx of the head's 32 bytes (8 dwords)
  const __m512i dense = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kOakenHeader * f.hk + h * 32)));
  const __m512i word = _mm512_permutexvar_epi32(_mm512_srli_epi32(idx, 3), dense);
  const __m512i nib = _mm512_and_si512(_mm512_srlv_epi32(word, _mm512_slli_epi32(_mm512_and_si512(idx, _mm512_set1_epi32(7)), 2)),
                                       _mm512_set1_epi32(15));
  // kind = group | sign << 1; value = base[kind] + code * step[kind]: the reference's outer_hi + m,
  // outer_lo - m, m, -m with m = code * scale (negation is exact)
  const __m512i kind = _mm512_srli_epi32(entry, 6);
  const __m128 step4 = _mm_xor_ps(_mm_permutevar_ps(scales, _mm_setr_epi32(3, 2, 3, 2)), _mm_setr_ps(0.f, 0.f, -0.f, -0.f));
  const __m512 step = _mm512_permutexvar_ps(kind, _mm512_castps128_ps512(step4));
  const __m512 base = _mm512_permutexvar_ps(kind, _mm512_castps128_ps512(_mm_setr_ps(0.f, t.outer_hi, 0.f, t.outer_lo)));
  const __m512 value = _mm512_add_ps(base, _mm512_mul_ps(_mm512_cvtepi32_ps(nib), step));
  _mm512_store_ps(out->value, _mm512_mul_ps(_mm512_sub_ps(value, _mm512_set1_ps(lo)), _mm512_set1_ps(inv_s)));
  const __m512i one = _mm512_set1_epi64(1);
  const __m512i bits = _mm512_or_si512(
      _mm512_maskz_sllv_epi64(static_cast<__mmask8>(valid), one, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(idx))),
      _mm512_maskz_sllv_epi64(static_cast<__mmask8>(valid >> 8), one, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(idx, 1))));
  out->lanes = static_cast<uint64_t>(_mm512_reduce_or_epi64(bits));
}

inline void load_oaken64(const uint8_t* rec, int64_t h, const Format& f, const OakenRow& o, __m512* r, float* lo, float* s) {
  const uint8_t* dense = rec + kOakenHeader * f.hk + h * 32;
  *lo = o.lo, *s = o.s;
  const __m512 table = _mm512_load_ps(o.table);
  const __m128i raw0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(dense));
  const __m128i raw1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(dense + 16));
  const __m128i high0 = _mm_srli_epi16(raw0, 4), high1 = _mm_srli_epi16(raw1, 4);
  const __m128i nib[4] = {_mm_unpacklo_epi8(raw0, high0), _mm_unpackhi_epi8(raw0, high0),
                          _mm_unpacklo_epi8(raw1, high1), _mm_unpackhi_epi8(raw1, high1)};
  int start = 0;
  for (int c = 0; c < 4; ++c) {
    const auto mask = static_cast<__mmask16>(o.lanes >> (16 * c));
    r[c] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nib[c]), table);  // permutes read the low four bits only
    r[c] = _mm512_mask_expandloadu_ps(r[c], mask, o.value + start);
    start += __builtin_popcount(mask);
  }
}

// One head vector into r[NC]: int8 / int4 codes as floats with their (lo, scale), or Oaken's
// dequantized values (lo = 0, scale = 1 are then not used).
template <int NC, int64_t MODE>
inline void load_row(const uint8_t* rec, int64_t h, const Format& f, const Thresholds& t, __m512* r, float* lo,
                     float* s, float* buf, const OakenRow* outliers) {
  if constexpr (MODE == kInt8) {
    const uint8_t* p = rec + h * (kIntHeader + NC * 16);
    *lo = read_half(p), *s = read_half(p + 2);
    for (int c = 0; c < NC; ++c) r[c] = bytes_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kIntHeader + 16 * c)));
  } else if constexpr (MODE == kInt4) {
    const uint8_t* p = rec + h * (kIntHeader + NC * 8);
    *lo = read_half(p), *s = read_half(p + 2);
    for (int c = 0; c < NC; c += 2) nibbles32(p + kIntHeader + 8 * c, r + c);
  } else if constexpr (NC == 4) {
    load_oaken64(rec, h, f, *outliers, r, lo, s);
  } else {
    *lo = 0.f, *s = 1.f;
    const OakenScales sc = read_scales(rec + h * kOakenHeader);
    const uint8_t* dense = rec + kOakenHeader * f.hk + h * (NC * 8);
    const __m512 mid_lo = _mm512_set1_ps(sc.mid_lo), mid_s = _mm512_set1_ps(sc.mid_s);
    const __m512 inner_lo = _mm512_set1_ps(t.inner_lo), inner_hi = _mm512_set1_ps(t.inner_hi);
    for (int c = 0; c < NC; c += 2) nibbles32(dense + 8 * c, r + c);
    for (int c = 0; c < NC; ++c) {
      const __m512 y = _mm512_add_ps(mid_lo, _mm512_mul_ps(r[c], mid_s));  // multiply, then add: as encoded
      const __mmask16 nonneg = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GE_OQ);
      _mm512_storeu_ps(buf + 16 * c, _mm512_add_ps(y, _mm512_mask_blend_ps(nonneg, inner_lo, inner_hi)));
    }
    patch_sparse(rec, h, f, t, sc, dense, buf);
    for (int c = 0; c < NC; ++c) r[c] = _mm512_loadu_ps(buf + 16 * c);
  }
}




// Per-sequence state: the scaled queries (and their sums) in registers, and per query head the
// value accumulator, the sum_j p_j lo_j lanes (int modes) and the running softmax.
template <int NC>
struct SequenceState {
  std::vector<__m512> q, acc, bias;
  std::vector<float> q_sum, probs;
  std::vector<OnlineSoftmax> softmax;
  explicit SequenceState(int64_t hq) : q(hq * NC), acc(hq * NC), bias(hq), q_sum(hq), probs(hq * 16), softmax(hq) {}

  template <typename T>
  void reset(const T* qp, int64_t hq, float scale) {
    for (int64_t h = 0; h < hq; ++h) {
      __m512 s = _mm512_setzero_ps();
      for (int c = 0; c < NC; ++c) {
        q[h * NC + c] = _mm512_mul_ps(load16(qp + h * NC * 16 + c * 16), _mm512_set1_ps(scale));
        s = _mm512_add_ps(s, q[h * NC + c]), acc[h * NC + c] = _mm512_setzero_ps();
      }
      q_sum[h] = _mm512_reduce_add_ps(s), bias[h] = _mm512_setzero_ps(), softmax[h] = OnlineSoftmax();
    }
  }
};

// One KV head over one tile of n <= 16 tokens (records at offsets): scores, softmax, values.
template <int NC, int64_t MODE>
inline void tile_head(SequenceState<NC>& st, const uint8_t* kp, const uint8_t* vp, const int64_t* offsets, int64_t n,
                      int64_t kh, int64_t group, const Format& f, const Thresholds& kt, const Thresholds& vt,
                      __m512* part, float* buf, OakenRow* outliers) {
  constexpr bool kTwoPass = MODE == kOaken && NC == 4;
  alignas(64) float lo[16] = {}, s[16] = {};
  __m512 row[NC];
  if constexpr (kTwoPass)
    for (int64_t j = 0; j < n; ++j) oaken_row64(kp + offsets[j], kh, f, kt, outliers + j);
  for (int64_t j = 0; j < 16; ++j) {
    if (j >= n) {
      for (int64_t g = 0; g < group; ++g) part[g * 16 + kSumSlot[j]] = _mm512_setzero_ps();
      continue;
    }
    load_row<NC, MODE>(kp + offsets[j], kh, f, kt, row, lo + j, s + j, buf, outliers + j);
    for (int64_t g = 0; g < group; ++g) {
      const __m512* q = st.q.data() + (kh * group + g) * NC;
      __m512 d = _mm512_mul_ps(q[0], row[0]);
      for (int c = 1; c < NC; ++c) d = _mm512_fmadd_ps(q[c], row[c], d);
      part[g * 16 + kSumSlot[j]] = d;
    }
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kh * group + g;
    __m512 scores = sum_lanes16(part + g * 16);
    scores = _mm512_fmadd_ps(_mm512_load_ps(lo), _mm512_set1_ps(st.q_sum[h]), _mm512_mul_ps(_mm512_load_ps(s), scores));
    float corr;
    const __m512 p = st.softmax[h].update(scores, valid, &corr);
    if (corr != 1.f) {
      for (int c = 0; c < NC; ++c) st.acc[h * NC + c] = _mm512_mul_ps(st.acc[h * NC + c], _mm512_set1_ps(corr));
      st.bias[h] = _mm512_mul_ps(st.bias[h], _mm512_set1_ps(corr));
    }
    _mm512_storeu_ps(st.probs.data() + h * 16, p);
  }
  // values: acc[h] += w_j * row_j with w = p * s and bias[h] += p * lo,
  // a few heads at a time with their accumulators in registers
  constexpr int64_t HB = NC <= 4 ? 4 : 2;
  if constexpr (kTwoPass)
    for (int64_t j = 0; j < n; ++j) oaken_row64(vp + offsets[j], kh, f, vt, outliers + j);
  for (int64_t j = 0; j < n; ++j) {
    load_row<NC, MODE>(vp + offsets[j], kh, f, vt, row, lo + j, s + j, buf, outliers + j);
    std::memcpy(buf + (1 + j) * NC * 16, row, sizeof(row));
  }
  for (int64_t g0 = 0; g0 < group; g0 += HB) {
    const int64_t h0 = kh * group + g0, hn = std::min(HB, group - g0);
    __m512 a[HB][NC];
    alignas(64) float w[HB][16];
    for (int64_t i = 0; i < hn; ++i) {
      const __m512 p = _mm512_loadu_ps(st.probs.data() + (h0 + i) * 16);
      _mm512_store_ps(w[i], _mm512_mul_ps(p, _mm512_load_ps(s)));
      st.bias[h0 + i] = _mm512_fmadd_ps(p, _mm512_load_ps(lo), st.bias[h0 + i]);
      for (int c = 0; c < NC; ++c) a[i][c] = st.acc[(h0 + i) * NC + c];
    }
    for (int64_t j = 0; j < n; ++j) {
      const float* v = buf + (1 + j) * NC * 16;
      __m512 vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
      for (int64_t i = 0; i < HB; ++i) {
        if (i >= hn) break;
        const __m512 wj = _mm512_set1_ps(w[i][j]);
        for (int c = 0; c < NC; ++c) a[i][c] = _mm512_fmadd_ps(wj, vv[c], a[i][c]);
      }
    }
    for (int64_t i = 0; i < hn; ++i)
      for (int c = 0; c < NC; ++c) st.acc[(h0 + i) * NC + c] = a[i][c];
  }
}

template <typename T, int NC, int64_t MODE>
void decode_attention_avx512(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                             const at::Tensor& tables, const at::Tensor& lens, const Format& f, const Thresholds& kt,
                             const Thresholds& vt, double scale, at::Tensor& out) {
  constexpr int64_t D = NC * 16;
  const int64_t batch = q.size(0), hq = q.size(1), group = hq / f.hk, width = tables.size(1);
  const int64_t bs = k_pool.size(1);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const uint8_t* kp = k_pool.data_ptr<uint8_t>();
  const uint8_t* vp = v_pool.data_ptr<uint8_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  // A work item is a sequence, or one KV head of a sequence when there are too few sequences to
  // keep every thread busy (a record holds all heads, so per-head items read each tile once per head).
  const int64_t heads_per_item = batch >= 2 * at::get_num_threads() ? f.hk : 1;
  const int64_t items_per_seq = f.hk / heads_per_item;
  at::parallel_for(0, batch * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    SequenceState<NC> st(hq);
    std::vector<__m512> part(group * 16);
    std::vector<float> buf(17 * D);  // row 0: the Oaken row being decoded; rows 1..16: the tile's values
    std::vector<OakenRow> outliers(16);
    int64_t offsets[16];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items_per_seq, kh0 = (item % items_per_seq) * heads_per_item;
      const int64_t ctx = ln[b];
      const int64_t* table = tb + b * width;
      auto offset_of = [&](int64_t t) { return (table[t / bs] * bs + t % bs) * f.record; };
      st.reset(qp + b * hq * D, hq, static_cast<float>(scale));
      for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, ctx - t0);
        for (int64_t j = 0; j < n; ++j) offsets[j] = offset_of(t0 + j);
        for (int64_t t = t0 + 16; t < std::min(ctx, t0 + 32); ++t) {  // the next tile's records
          const int64_t o = offset_of(t);
          for (int64_t off = 0; off < f.record; off += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(kp + o + off), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(vp + o + off), _MM_HINT_T0);
          }
        }
        for (int64_t kh = kh0; kh < kh0 + heads_per_item; ++kh)
          tile_head<NC, MODE>(st, kp, vp, offsets, n, kh, group, f, kt, vt, part.data(), buf.data(), outliers.data());
      }
      for (int64_t h = kh0 * group; h < (kh0 + heads_per_item) * group; ++h) {
        const float inv = 1.f / _mm512_reduce_add_ps(st.softmax[h].sum);
        const __m512 bias = _mm512_set1_ps(_mm512_reduce_add_ps(st.bias[h]));
        alignas(64) float o[D];
        for (int c = 0; c < NC; ++c) _mm512_store_ps(o + 16 * c, _mm512_mul_ps(_mm512_add_ps(st.acc[h * NC + c], bias), _mm512_set1_ps(inv)));
        for (int64_t i = 0; i < D; ++i) op[(b * hq + h) * D + i] = static_cast<T>(o[i]);
      }
    }
  });
}

// The AVX-512 kernel for head_dim 64 / 128; false when it does not apply.
template <typename T>
bool decode_attention_fast(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& tables, const at::Tensor& lens, const Format& f, const Thresholds& kt,
                           const Thresholds& vt, double scale, at::Tensor& out) {
  auto run = [&](auto nc) {
    constexpr int NC = decltype(nc)::value;
    if (f.mode == kInt8) decode_attention_avx512<T, NC, kInt8>(q, k_pool, v_pool, tables, lens, f, kt, vt, scale, out);
    if (f.mode == kInt4) decode_attention_avx512<T, NC, kInt4>(q, k_pool, v_pool, tables, lens, f, kt, vt, scale, out);
    if (f.mode == kOaken) decode_attention_avx512<T, NC, kOaken>(q, k_pool, v_pool, tables, lens, f, kt, vt, scale, out);
    return true;
  };
  if (f.d == 64 && (f.mode != kOaken || f.capacity <= 16)) return run(std::integral_constant<int, 4>());
  if (f.d == 128) return run(std::integral_constant<int, 8>());
  return false;
}
#else
template <typename T>
bool decode_attention_fast(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const Format&, const Thresholds&, const Thresholds&, double,
                           at::Tensor&) {
  return false;
}
#endif

void check_pool(const at::Tensor& pool, const Format& f) {
  TORCH_CHECK(pool.scalar_type() == at::kByte && pool.is_contiguous() && pool.dim() == 3,
              "quantized KV pool must be contiguous uint8 [num_blocks, block_size, record_bytes]");
  TORCH_CHECK(pool.size(2) == f.record, "pool record size does not match the format");
}

template <typename T>
void write_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_pool, at::Tensor& v_pool,
                const at::Tensor& slots, const Format& f, const Thresholds& kt, const Thresholds& vt,
                std::vector<int64_t>& folded) {
  const int64_t n = k.size(0), width = f.hk * f.d;
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  uint8_t* kout = k_pool.data_ptr<uint8_t>();
  uint8_t* vout = v_pool.data_ptr<uint8_t>();
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width), code(width);
    std::vector<uint8_t> group(width);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < width; ++i) row[i] = to_float(kp[t * width + i]);
      folded[t] = encode_token(row.data(), f, kt, kout + sl[t] * f.record, group, code);
      for (int64_t i = 0; i < width; ++i) row[i] = to_float(vp[t * width + i]);
      folded[t] += encode_token(row.data(), f, vt, vout + sl[t] * f.record, group, code);
    }
  });
}

template <typename T>
void dequant_impl(const at::Tensor& pool, const at::Tensor& ids, const Format& f, const Thresholds& t,
                  at::Tensor& out) {
  const int64_t nb = ids.size(0), bs = pool.size(1), rows = nb * bs;
  const uint8_t* src = pool.data_ptr<uint8_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(f.d);
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* rec = src + (id[r / bs] * bs + r % bs) * f.record;
      for (int64_t h = 0; h < f.hk; ++h) {
        decode_head(rec, h, f, t, buf.data());
        T* o = dst + (r * f.hk + h) * f.d;
        for (int64_t i = 0; i < f.d; ++i) o[i] = static_cast<T>(buf[i]);
      }
    }
  });
}

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& tables, const at::Tensor& lens, const Format& f,
                           const Thresholds& kt, const Thresholds& vt, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), hq = q.size(1), group = hq / f.hk, width = tables.size(1);
  const int64_t bs = k_pool.size(1);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const uint8_t* kp = k_pool.data_ptr<uint8_t>();
  const uint8_t* vp = v_pool.data_ptr<uint8_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  if (decode_attention_fast<T>(q, k_pool, v_pool, tables, lens, f, kt, vt, scale, out)) return;
  at::parallel_for(0, batch * f.hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work(2 * group * f.d + kTile * f.d + group * kTile + 2 * group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / f.hk, h = item % f.hk;
      const int64_t offset = (b * hq + h * group) * f.d;
      const float sc = static_cast<float>(scale);
      if (f.d == 64) {
        decode_one<T, 64>(qp + offset, kp, vp, tb + b * width, ln[b], bs, h, group, f, kt, vt, sc, op + offset, work);
      } else if (f.d == 128) {
        decode_one<T, 128>(qp + offset, kp, vp, tb + b * width, ln[b], bs, h, group, f, kt, vt, sc, op + offset, work);
      } else {
        decode_one<T, 0>(qp + offset, kp, vp, tb + b * width, ln[b], bs, h, group, f, kt, vt, sc, op + offset, work);
      }
    }
  });
}

}  // namespace

// Quantize K/V rows [N, hk, d] and write their records into the pools' slots. Returns the number of
// Oaken outliers folded into the middle group (0 for int8/int4).
int64_t quant_write(const at::Tensor& k, const at::Tensor& v, at::Tensor k_pool, at::Tensor v_pool,
                    const at::Tensor& slot_mapping, int64_t mode, int64_t hk, int64_t d, int64_t capacity,
                    const at::Tensor& k_thresholds, const at::Tensor& v_thresholds) {
  const Format f = make_format(mode, hk, d, capacity, k_pool.size(-1));
  check_pool(k_pool, f);
  check_pool(v_pool, f);
  auto kc = k.contiguous(), vc = v.contiguous();
  TORCH_CHECK(kc.numel() == kc.size(0) * hk * d && vc.sizes() == kc.sizes(), "K/V rows must be [N, hk, d]");
  auto slots = slot_mapping.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == kc.size(0), "slot_mapping must be int64 [N]");
  std::vector<int64_t> folded(kc.size(0), 0);
  const Thresholds kt = read_thresholds(k_thresholds), vt = read_thresholds(v_thresholds);
  if (kc.scalar_type() == at::kFloat) {
    write_impl<float>(kc, vc, k_pool, v_pool, slots, f, kt, vt, folded);
  } else if (kc.scalar_type() == at::kBFloat16) {
    write_impl<c10::BFloat16>(kc, vc, k_pool, v_pool, slots, f, kt, vt, folded);
  } else {
    TORCH_CHECK(false, "quant_write supports float32 and bfloat16");
  }
  int64_t total = 0;
  for (int64_t x : folded) total += x;
  return total;
}

// Dequantize whole blocks: pool [NB, bs, R] -> [len(block_ids), bs, hk, d] in `dtype`.
at::Tensor dequantize_blocks(const at::Tensor& pool, const at::Tensor& block_ids, int64_t mode, int64_t hk,
                             int64_t d, int64_t capacity, const at::Tensor& thresholds, at::ScalarType dtype) {
  const Format f = make_format(mode, hk, d, capacity, pool.size(-1));
  check_pool(pool, f);
  auto ids = block_ids.contiguous();
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "block ids must be int64 [n]");
  auto out = at::empty({ids.size(0), pool.size(1), hk, d}, pool.options().dtype(dtype));
  const Thresholds t = read_thresholds(thresholds);
  if (dtype == at::kFloat) {
    dequant_impl<float>(pool, ids, f, t, out);
  } else if (dtype == at::kBFloat16) {
    dequant_impl<c10::BFloat16>(pool, ids, f, t, out);
  } else {
    TORCH_CHECK(false, "dequantize_blocks supports float32 and bfloat16");
  }
  return out;
}

// One query token per sequence over quantized paged K/V, read in place.
at::Tensor quant_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t mode,
                                  int64_t hk, int64_t capacity, const at::Tensor& k_thresholds,
                                  const at::Tensor& v_thresholds, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(1) % hk == 0, "q must be contiguous [B, hq, d]");
  const Format f = make_format(mode, hk, q.size(2), capacity, k_pool.size(-1));
  check_pool(k_pool, f);
  check_pool(v_pool, f);
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "tables and lengths: int64");
  auto out = at::empty_like(q);
  const Thresholds kt = read_thresholds(k_thresholds), vt = read_thresholds(v_thresholds);
  if (q.scalar_type() == at::kFloat) {
    decode_attention_impl<float>(q, k_pool, v_pool, tables, lens, f, kt, vt, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_attention_impl<c10::BFloat16>(q, k_pool, v_pool, tables, lens, f, kt, vt, scale, out);
  } else {
    TORCH_CHECK(false, "quant_decode_attention supports float32 and bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_write", &quant_write, "quantize K/V rows into their cache slots");
  m.def("dequantize_blocks", &dequantize_blocks, "dequantize whole KV blocks");
  m.def("quant_decode_attention", &quant_decode_attention, "decode attention over quantized paged KV");
}

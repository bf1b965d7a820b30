// Decode attention over quantized paged K/V with AVX-512, head_dim 64 or 128.
#include "kvquant_format.h"

namespace kvquant {

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
// r = (value - lo) / s. A tile's outliers (and middle tables) are decoded first, one row's (at most
// 16) entries in one vector, with no branch on their count (oaken_row64); the rows are then built and
// patched (load_oaken64): the values, lined up from each 16-lane chunk's first entry, expand into the lanes
// the sorted indices name. Two passes keep the long decode chain of one row off the dot products.
struct OakenRow {
  alignas(64) float table[16];  // affine code of each middle nibble
  alignas(64) float value[32];  // affine codes of the outliers, in index order (16 slack: full-width loads)
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
    r[c] = _mm512_mask_expand_ps(r[c], mask, _mm512_loadu_ps(o.value + start));  // register form: cheaper than expandloadu
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
  const auto [batch, hq, group, width, bs, qp, op, kp, vp, tb, ln] =
      decode_batch<T>(q, k_pool, v_pool, tables, lens, f, out);
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

template bool decode_attention_fast<float>(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const Format&, const Thresholds&, const Thresholds&,
                                           double, at::Tensor&);
template bool decode_attention_fast<c10::BFloat16>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, const at::Tensor&, const Format&,
                                                   const Thresholds&, const Thresholds&, double, at::Tensor&);

}  // namespace kvquant

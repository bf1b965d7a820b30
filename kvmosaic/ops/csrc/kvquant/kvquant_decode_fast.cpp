// Decode attention over quantized paged K/V, head_dim 64 or 128, over the vector type of vec.h.
#include "kvquant/kvquant_format.h"
#include "isa/vec_codes.h"

namespace kvquant {

// ------------------------------------------------ decode attention (head_dim 64 or 128)
//
// One work item is one sequence; each tile of 16 tokens is read once for all KV heads (a record
// holds every head of a slot). int8 / int4 are affine per token, so they are not dequantized:
// q . (lo + s c) = lo * sum(q) + s * (q . c) and sum_j p_j (lo_j + s_j c_j) = sum_j p_j lo_j +
// sum_j (p_j s_j) c_j, with the codes c widened to float in registers. Oaken rows of head_dim 64 take
// the same affine form (load_oaken64); other Oaken rows are dequantized through a one-row L1 buffer
// and use lo = 0, s = 1.

// Oaken rows of head_dim 64 (one-byte sparse entries) as affine codes, value_i = lo + s * r_i, like
// int4, so the scores and value weights take the same per-token (lo, s) path. With y = mid_lo + c *
// mid_s the middle value is y + inner_lo or y + inner_hi by the sign of y; y grows with the code c,
// so with lo = mid_lo + inner_lo and s = mid_s a middle slot is r = c, plus (inner_hi - inner_lo) / s
// from the first code whose level is >= 0 (a 16-entry table the nibbles index). Outlier slots get
// r = (value - lo) / s. A tile's outliers (and middle tables) are decoded first (oaken_row64); the
// rows are then built and patched (load_oaken64): the values, lined up from each 16-lane chunk's
// first entry, expand into the lanes the sorted indices name. Two passes keep the long decode chain
// of one row off the dot products.
struct OakenRow {
  alignas(64) float table[16];  // affine code of each middle nibble
  alignas(64) float value[32];  // affine codes of the outliers, in index order (16 slack: full-width loads)
  uint64_t lanes;               // bit i: lane i holds an outlier
  float lo, s;
};

// The middle codes' table of one row (all levels).
inline void oaken_table(float mid_lo, float mid_s, float inv_s, const Thresholds& t, float* table) {
  alignas(64) static constexpr float kLevel[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vec::F16 level = vec::F16::load(kLevel);
  const vec::F16 y = vec::F16::set1(mid_lo) + level * vec::F16::set1(mid_s);
  const vec::Mask nonneg = ~vec::greater(vec::F16::zero(), y) & 0xFFFFu;  // y >= 0
  vec::select(nonneg, level + vec::F16::set1((t.inner_hi - t.inner_lo) * inv_s), level).store(table);
}

#if defined(KVM_VEC_AVX512)
// The outliers of one row in one vector, with no branch on their count (count <= 16: the caller checks).
inline void oaken_outliers64(const uint8_t* rec, int64_t h, const Format& f, const Thresholds& t,
                             const OakenScales& sc, float lo, float inv_s, OakenRow* out) {
  const uint8_t* list = rec + f.sparse_offset + h * f.sparse_bytes;
  const __mmask16 valid = static_cast<__mmask16>((1u << list[0]) - 1u);
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
  const __m512 step = _mm512_permutexvar_ps(kind, _mm512_castps128_ps512(_mm_setr_ps(sc.in_s, sc.out_s, -sc.in_s, -sc.out_s)));
  const __m512 base = _mm512_permutexvar_ps(kind, _mm512_castps128_ps512(_mm_setr_ps(0.f, t.outer_hi, 0.f, t.outer_lo)));
  const __m512 value = _mm512_add_ps(base, _mm512_mul_ps(_mm512_cvtepi32_ps(nib), step));
  _mm512_store_ps(out->value, _mm512_mul_ps(_mm512_sub_ps(value, _mm512_set1_ps(lo)), _mm512_set1_ps(inv_s)));
  const __m512i one = _mm512_set1_epi64(1);
  const __m512i bits = _mm512_or_si512(
      _mm512_maskz_sllv_epi64(static_cast<__mmask8>(valid), one, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(idx))),
      _mm512_maskz_sllv_epi64(static_cast<__mmask8>(valid >> 8), one, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(idx, 1))));
  out->lanes = static_cast<uint64_t>(_mm512_reduce_or_epi64(bits));
}
#else
// The outliers of one row, entry by entry (the same float operations as the vector form).
inline void oaken_outliers64(const uint8_t* rec, int64_t h, const Format& f, const Thresholds& t,
                             const OakenScales& sc, float lo, float inv_s, OakenRow* out) {
  const uint8_t* list = rec + f.sparse_offset + h * f.sparse_bytes;
  const uint8_t* dense = rec + kOakenHeader * f.hk + h * 32;
  const float base[4] = {0.f, t.outer_hi, 0.f, t.outer_lo};
  const float step[4] = {sc.in_s, sc.out_s, -sc.in_s, -sc.out_s};
  uint64_t lanes = 0;
  for (int e = 0; e < list[0]; ++e) {
    const int entry = list[1 + e], i = entry & 63, kind = entry >> 6;
    const float value = base[kind] + static_cast<float>((dense[i >> 1] >> ((i & 1) * 4)) & 15) * step[kind];
    out->value[e] = (value - lo) * inv_s;
    lanes |= uint64_t{1} << i;
  }
  out->lanes = lanes;
}
#endif

// The affine Oaken rows pay off with AVX-512's permutes and expands; elsewhere head_dim 64 rows are
// dequantized through the L1 buffer like head_dim 128 (1.5x faster than the affine rows on AVX2, measured).
#if defined(KVM_VEC_AVX512)
constexpr bool kOakenAffine64 = true;
#else
constexpr bool kOakenAffine64 = false;
#endif

inline void oaken_row64(const uint8_t* rec, int64_t h, const Format& f, const Thresholds& t, OakenRow* out) {
  const OakenScales sc = read_scales(rec + h * kOakenHeader);
  const float lo = sc.mid_lo + t.inner_lo, inv_s = 1.f / sc.mid_s;
  out->lo = lo, out->s = sc.mid_s;
  oaken_table(sc.mid_lo, sc.mid_s, inv_s, t, out->table);
  oaken_outliers64(rec, h, f, t, sc, lo, inv_s, out);
}

inline void load_oaken64(const uint8_t* rec, int64_t h, const Format& f, const OakenRow& o, vec::F16* r, float* lo,
                         float* s) {
  const uint8_t* dense = rec + kOakenHeader * f.hk + h * 32;
  *lo = o.lo, *s = o.s;
  vec::lookup_nibbles(o.table, dense, r);
  vec::lookup_nibbles(o.table, dense + 16, r + 2);
  int start = 0;
  for (int c = 0; c < 4; ++c) {
    const auto mask = static_cast<vec::Mask>(o.lanes >> (16 * c)) & 0xFFFFu;
    r[c] = vec::expand(r[c], mask, o.value + start);
    start += __builtin_popcount(mask);
  }
}

// One head vector into r[NC]: int8 / int4 codes as floats with their (lo, scale), or Oaken's
// dequantized values (lo = 0, scale = 1 are then not used).
template <int NC, int64_t MODE>
inline void load_row(const uint8_t* rec, int64_t h, const Format& f, const Thresholds& t, vec::F16* r, float* lo,
                     float* s, float* buf, const OakenRow* outliers) {
  if constexpr (MODE == kInt8) {
    const uint8_t* p = rec + h * (kIntHeader + NC * 16);
    *lo = read_half(p), *s = read_half(p + 2);
    for (int c = 0; c < NC; ++c) r[c] = vec::bytes_to_f16(p + kIntHeader + 16 * c);
  } else if constexpr (MODE == kInt4) {
    const uint8_t* p = rec + h * (kIntHeader + NC * 8);
    *lo = read_half(p), *s = read_half(p + 2);
    for (int c = 0; c < NC; c += 2) vec::nibbles_to_f16(p + kIntHeader + 8 * c, r + c);
  } else if constexpr (NC == 4 && kOakenAffine64) {
    load_oaken64(rec, h, f, *outliers, r, lo, s);
  } else {
    *lo = 0.f, *s = 1.f;
    const OakenScales sc = read_scales(rec + h * kOakenHeader);
    const uint8_t* dense = rec + kOakenHeader * f.hk + h * (NC * 8);
    const vec::F16 mid_lo = vec::F16::set1(sc.mid_lo), mid_s = vec::F16::set1(sc.mid_s);
    const vec::F16 inner_lo = vec::F16::set1(t.inner_lo), inner_hi = vec::F16::set1(t.inner_hi);
    for (int c = 0; c < NC; c += 2) vec::nibbles_to_f16(dense + 8 * c, r + c);
    for (int c = 0; c < NC; ++c) {
      const vec::F16 y = mid_lo + r[c] * mid_s;  // multiply, then add: as encoded
      const vec::Mask nonneg = ~vec::greater(vec::F16::zero(), y) & 0xFFFFu;
      (y + vec::select(nonneg, inner_hi, inner_lo)).store(buf + 16 * c);
    }
    patch_sparse(rec, h, f, t, sc, dense, buf);
    for (int c = 0; c < NC; ++c) r[c] = vec::F16::load(buf + 16 * c);
  }
}

// Per-sequence state: the scaled queries (and their sums) in registers, and per query head the
// value accumulator, the sum_j p_j lo_j lanes (int modes) and the running softmax.
template <int NC>
struct SequenceState {
  std::vector<vec::F16> q, acc, bias;
  std::vector<float> q_sum, probs;
  std::vector<vec::OnlineSoftmax> softmax;
  explicit SequenceState(int64_t hq) : q(hq * NC), acc(hq * NC), bias(hq), q_sum(hq), probs(hq * 16), softmax(hq) {}

  template <typename T>
  void reset(const T* qp, int64_t hq, float scale) {
    for (int64_t h = 0; h < hq; ++h) {
      vec::F16 s = vec::F16::zero();
      for (int c = 0; c < NC; ++c) {
        q[h * NC + c] = vec::F16::load(qp + h * NC * 16 + c * 16) * vec::F16::set1(scale);
        s = s + q[h * NC + c], acc[h * NC + c] = vec::F16::zero();
      }
      q_sum[h] = s.reduce_add(), bias[h] = vec::F16::zero(), softmax[h] = vec::OnlineSoftmax();
    }
  }
};

// Register blocking of the value sums: HN heads x CB vectors of the head dimension.
template <int NC>
struct ValueBlock {
  static constexpr int CB = vec::kVecRegisters >= 32 ? NC : 2;
  static constexpr int HN = vec::kVecRegisters >= 32 ? (NC <= 4 ? 4 : 2) : 3;
};

// acc[i] += sum_j w[i][j] * row_j for hn <= HN heads, rows 1..n of buf.
template <int NC>
inline void value_heads(const float* buf, int64_t n, const float (*w)[16], int64_t hn, vec::F16* acc) {
  constexpr int CB = ValueBlock<NC>::CB, HN = ValueBlock<NC>::HN;
  for (int c0 = 0; c0 < NC; c0 += CB) {
    vec::F16 a[HN][CB];
    for (int64_t i = 0; i < hn; ++i)
      for (int c = 0; c < CB; ++c) a[i][c] = acc[i * NC + c0 + c];
    for (int64_t j = 0; j < n; ++j) {
      const float* v = buf + (1 + j) * NC * 16 + c0 * 16;
      for (int c = 0; c < CB; ++c) {
        const vec::F16 vv = vec::F16::load(v + 16 * c);
        for (int64_t i = 0; i < HN; ++i) {
          if (i >= hn) break;
          a[i][c] = vec::fma(vec::F16::set1(w[i][j]), vv, a[i][c]);
        }
      }
    }
    for (int64_t i = 0; i < hn; ++i)
      for (int c = 0; c < CB; ++c) acc[i * NC + c0 + c] = a[i][c];
  }
}

// One KV head over one tile of n <= 16 tokens (records at offsets): scores, softmax, values.
template <int NC, int64_t MODE>
inline void tile_head(SequenceState<NC>& st, const uint8_t* kp, const uint8_t* vp, const int64_t* offsets, int64_t n,
                      int64_t kh, int64_t group, const Format& f, const Thresholds& kt, const Thresholds& vt,
                      vec::F16* part, float* buf, OakenRow* outliers) {
  constexpr bool kTwoPass = MODE == kOaken && NC == 4 && kOakenAffine64;
  alignas(64) float lo[16] = {}, s[16] = {};
  vec::F16 row[NC];
  if constexpr (kTwoPass)
    for (int64_t j = 0; j < n; ++j) oaken_row64(kp + offsets[j], kh, f, kt, outliers + j);
  for (int64_t j = 0; j < 16; ++j) {
    if (j >= n) {
      for (int64_t g = 0; g < group; ++g) part[g * 16 + j] = vec::F16::zero();
      continue;
    }
    load_row<NC, MODE>(kp + offsets[j], kh, f, kt, row, lo + j, s + j, buf, outliers + j);
    for (int64_t g = 0; g < group; ++g) {
      const vec::F16* q = st.q.data() + (kh * group + g) * NC;
      vec::F16 d = q[0] * row[0];
      for (int c = 1; c < NC; ++c) d = vec::fma(q[c], row[c], d);
      part[g * 16 + j] = d;
    }
  }
  const vec::Mask valid = vec::first_lanes(static_cast<int>(n));
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kh * group + g;
    const vec::F16 scores = vec::fma(vec::F16::load(lo), vec::F16::set1(st.q_sum[h]),
                                     vec::F16::load(s) * vec::sum_lanes16(part + g * 16));
    float corr;
    const vec::F16 p = st.softmax[h].update(scores, valid, &corr);
    if (corr != 1.f) {
      for (int c = 0; c < NC; ++c) st.acc[h * NC + c] = st.acc[h * NC + c] * vec::F16::set1(corr);
      st.bias[h] = st.bias[h] * vec::F16::set1(corr);
    }
    p.store(st.probs.data() + h * 16);
  }
  // values: acc[h] += w_j * row_j with w = p * s and bias[h] += p * lo,
  // a few heads at a time with their accumulators in registers
  constexpr int64_t HB = ValueBlock<NC>::HN;
  if constexpr (kTwoPass)
    for (int64_t j = 0; j < n; ++j) oaken_row64(vp + offsets[j], kh, f, vt, outliers + j);
  for (int64_t j = 0; j < n; ++j) {
    load_row<NC, MODE>(vp + offsets[j], kh, f, vt, row, lo + j, s + j, buf, outliers + j);
    for (int c = 0; c < NC; ++c) row[c].store(buf + (1 + j) * NC * 16 + 16 * c);
  }
  for (int64_t g0 = 0; g0 < group; g0 += HB) {
    const int64_t h0 = kh * group + g0, hn = std::min(HB, group - g0);
    alignas(64) float w[HB][16];
    for (int64_t i = 0; i < hn; ++i) {
      const vec::F16 p = vec::F16::load(st.probs.data() + (h0 + i) * 16);
      (p * vec::F16::load(s)).store(w[i]);
      st.bias[h0 + i] = vec::fma(p, vec::F16::load(lo), st.bias[h0 + i]);
    }
    value_heads<NC>(buf, n, w, hn, st.acc.data() + h0 * NC);
  }
}

template <typename T, int NC, int64_t MODE>
void decode_attention_vec(const DecodeBatch<T>& call, const Format& f, const Thresholds& kt, const Thresholds& vt,
                          double scale, const PartialOut* partial) {
  constexpr int64_t D = NC * 16;
  const auto [batch, hq, group, width, bs, qp, op, kp, vp, tb, ln] = call;
  // A work item is a sequence, or one KV head of a sequence when there are too few sequences to
  // keep every thread busy (a record holds all heads, so per-head items read each tile once per head).
  const int64_t heads_per_item = batch >= 2 * kvops::num_threads() ? f.hk : 1;
  const int64_t items_per_seq = f.hk / heads_per_item;
  kvops::parallel_for(0, batch * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    SequenceState<NC> st(hq);
    std::vector<vec::F16> part(group * 16);
    std::vector<float> buf(17 * D);  // row 0: the Oaken row being decoded; rows 1..16: the tile's values
    std::vector<OakenRow> outliers(16);
    int64_t offsets[16];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items_per_seq, kh0 = (item % items_per_seq) * heads_per_item;
      const int64_t ctx = ln[b];
      const int64_t* table = tb + b * width;
      auto offset_of = [&](int64_t t) { return kvops::slot_of(table, t, bs) * f.record; };
      st.reset(qp + b * hq * D, hq, static_cast<float>(scale));
      for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, ctx - t0);
        for (int64_t j = 0; j < n; ++j) offsets[j] = offset_of(t0 + j);
        for (int64_t t = t0 + 16; t < std::min(ctx, t0 + 32); ++t) {  // the next tile's records
          const int64_t o = offset_of(t);
          for (int64_t off = 0; off < f.record; off += 64) {
            vec::prefetch_l1(kp + o + off);
            vec::prefetch_l1(vp + o + off);
          }
        }
        for (int64_t kh = kh0; kh < kh0 + heads_per_item; ++kh)
          tile_head<NC, MODE>(st, kp, vp, offsets, n, kh, group, f, kt, vt, part.data(), buf.data(), outliers.data());
      }
      for (int64_t h = kh0 * group; h < (kh0 + heads_per_item) * group; ++h) {
        const float total = st.softmax[h].total();
        const vec::F16 bias = vec::F16::set1(st.bias[h].reduce_add());
        const int64_t row = b * hq + h;
        if (partial != nullptr) {
          partial->ref[row] = st.softmax[h].ref, partial->sum[row] = total;
          const vec::F16 inv = vec::F16::set1(total > 0.f ? 1.f / total : 0.f);
          for (int c = 0; c < NC; ++c) ((st.acc[h * NC + c] + bias) * inv).store(partial->out + row * D + 16 * c);
          continue;
        }
        const vec::F16 inv = vec::F16::set1(1.f / total);
        for (int c = 0; c < NC; ++c) ((st.acc[h * NC + c] + bias) * inv).store(op + row * D + 16 * c);
      }
    }
  });
}

// The vector kernel for head_dim 64 / 128; false when it does not apply.
template <typename T>
bool decode_attention_fast(const DecodeBatch<T>& batch, const Format& f, const Thresholds& kt, const Thresholds& vt,
                           double scale, const PartialOut* partial) {
  auto run = [&](auto nc) {
    constexpr int NC = decltype(nc)::value;
    if (f.mode == kInt8) decode_attention_vec<T, NC, kInt8>(batch, f, kt, vt, scale, partial);
    if (f.mode == kInt4) decode_attention_vec<T, NC, kInt4>(batch, f, kt, vt, scale, partial);
    if (f.mode == kOaken) decode_attention_vec<T, NC, kOaken>(batch, f, kt, vt, scale, partial);
    return true;
  };
  if (f.d == 64 && (f.mode != kOaken || f.capacity <= 16)) return run(std::integral_constant<int, 4>());
  if (f.d == 128) return run(std::integral_constant<int, 8>());
  return false;
}

template bool decode_attention_fast<float>(const DecodeBatch<float>&, const Format&, const Thresholds&,
                                           const Thresholds&, double, const PartialOut*);
template bool decode_attention_fast<vec::bf16>(const DecodeBatch<vec::bf16>&, const Format&, const Thresholds&,
                                               const Thresholds&, double, const PartialOut*);

}  // namespace kvquant

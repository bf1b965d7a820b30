// Quantize-and-write of new K/V rows into their records (int8, int4, Oaken), bit for bit the
// PyTorch reference's encoding (same float32 operation order, fp16 rounding to nearest even,
// ties-to-even codes).
#include "kvquant/kvquant_format.h"
#if defined(__BMI2__)
#include <immintrin.h>
#endif

namespace kvquant {
namespace {


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

inline bool is_outer(float x, const Thresholds& t) { return x > t.outer_hi || x < t.outer_lo; }
// How far an outer value lies past its threshold.
inline float outer_magnitude(float x, const Thresholds& t) { return x < 0.f ? t.outer_lo - x : x - t.outer_hi; }

// Whether outer value i of a head vector is among the `capacity` farthest past their threshold (ties:
// lower index first); quadratic, but it runs only for a vector with more outer values than slots.
inline bool among_farthest(const float* m, const uint8_t* outer, int64_t d, int64_t i, int64_t capacity) {
  int64_t ahead = 0;
  for (int64_t j = 0; j < d && ahead < capacity; ++j)
    ahead += outer[j] && (m[j] > m[i] || (m[j] == m[i] && j < i));
  return ahead < capacity;
}

// Groups: 0 middle, 1 kept outer, 2 kept inner. The sparse slots go to the outer values farthest
// past their threshold, then to inner values in index order. Returns the outliers folded into the middle.
int64_t oaken_groups(const float* x, const Format& f, const Thresholds& t, uint8_t* group, float* m) {
  int64_t folded = 0;
  for (int64_t h = 0; h < f.hk; ++h) {
    const float* xh = x + h * f.d;
    uint8_t* gh = group + h * f.d;
    int64_t n_outer = 0;
    for (int64_t i = 0; i < f.d; ++i) {
      gh[i] = is_outer(xh[i], t);
      m[i] = outer_magnitude(xh[i], t);
      n_outer += gh[i];
    }
    if (n_outer > f.capacity) {
      std::vector<uint8_t> outer(gh, gh + f.d);
      for (int64_t i = 0; i < f.d; ++i)
        if (outer[i] && !among_farthest(m, outer.data(), f.d, i, f.capacity)) gh[i] = 0, ++folded;
    }
    int64_t inner_rank = std::min(n_outer, f.capacity);
    for (int64_t i = 0; i < f.d; ++i) {
      if (is_outer(xh[i], t) || !(xh[i] >= t.inner_lo && xh[i] <= t.inner_hi)) continue;
      if (++inner_rank <= f.capacity) gh[i] = 2;
      else ++folded;
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

// One head vector of 64 values, the scalar path's operations lane by lane (bit-exact): groups as
// 64-bit masks (the first `capacity` outer values kept, then the first inner ones), min/max scales
// by masked reductions, codes by round-to-nearest-even, the dense nibbles packed pairwise, the
// sparse entries in index order. Returns the outliers folded.
inline uint64_t low_bits(int64_t k) { return k >= 64 ? ~uint64_t{0} : (uint64_t{1} << k) - 1; }

// The `capacity` outer values farthest past their threshold (ties: lower index first), as a mask.
inline uint64_t farthest_outer(uint64_t outer, const float* m, int64_t capacity) {
  if (__builtin_popcountll(outer) <= capacity) return outer;
  uint64_t kept = 0;
  for (uint64_t rest = outer; rest != 0; rest &= rest - 1) {
    const int i = __builtin_ctzll(rest);
    int64_t ahead = 0;
    for (uint64_t other = outer; other != 0 && ahead < capacity; other &= other - 1) {
      const int j = __builtin_ctzll(other);
      ahead += m[j] > m[i] || (m[j] == m[i] && j < i);
    }
    if (ahead < capacity) kept |= uint64_t{1} << i;
  }
  return kept;
}

// The k lowest set bits of mask.
inline uint64_t first_set_bits(uint64_t mask, int64_t k) {
#if defined(__BMI2__)
  return _pdep_u64(low_bits(k), mask);
#else
  uint64_t kept = 0;
  for (; k > 0 && mask != 0; --k, mask &= mask - 1) kept |= mask & (~mask + 1);
  return kept;
#endif
}

inline vec::Mask chunk(uint64_t mask, int c) { return static_cast<vec::Mask>(mask >> (16 * c)) & 0xFFFFu; }

int64_t encode_oaken_head64(const float* x, const Format& f, const Thresholds& t, uint8_t* header, uint8_t* dense,
                            uint8_t* list) {
  using vec::F16;
  const F16 zero = F16::zero(), outer_hi = F16::set1(t.outer_hi), outer_lo = F16::set1(t.outer_lo);
  const F16 inner_lo = F16::set1(t.inner_lo), inner_hi = F16::set1(t.inner_hi);
  const F16 neg_inf = F16::set1(-std::numeric_limits<float>::infinity());
  const F16 pos_inf = F16::set1(std::numeric_limits<float>::infinity());
  F16 v[4], m[4];
  alignas(64) float past[64];  // how far each value lies past its outer threshold
  uint64_t outer = 0, inner = 0, neg = 0;
  for (int c = 0; c < 4; ++c) {
    v[c] = F16::load(x + 16 * c);
    const vec::Mask ordered = vec::greater(v[c], neg_inf) | vec::greater(pos_inf, v[c]);  // not NaN
    const vec::Mask o = vec::greater(v[c], outer_hi) | vec::greater(outer_lo, v[c]);
    const vec::Mask i = ordered & ~vec::greater(inner_lo, v[c]) & ~vec::greater(v[c], inner_hi) & ~o & 0xFFFFu;
    outer |= uint64_t{o} << (16 * c), inner |= uint64_t{i} << (16 * c);
    const vec::Mask nc = vec::greater(zero, v[c]);
    neg |= uint64_t{nc} << (16 * c);
    m[c] = vec::select(nc, outer_lo - v[c], v[c] - outer_hi);
    m[c].store(past + 16 * c);
  }
  const int64_t n_outer = __builtin_popcountll(outer), n_inner = __builtin_popcountll(inner);
  const uint64_t keep_outer = farthest_outer(outer, past, f.capacity);
  const uint64_t keep_inner = first_set_bits(inner, std::max<int64_t>(0, f.capacity - n_outer));
  const uint64_t kept = keep_outer | keep_inner;
  const int64_t folded = n_outer + n_inner - __builtin_popcountll(kept);
  F16 w[4];
  F16 mid_lo = zero, mid_hi = zero, out_max = zero, in_max = zero;
  for (int c = 0; c < 4; ++c) {
    const vec::Mask nc = chunk(neg, c), mid = chunk(~kept, c);
    w[c] = v[c] - vec::select(nc, inner_lo, inner_hi);
    mid_lo = vec::select(mid, vec::min(mid_lo, w[c]), mid_lo);
    mid_hi = vec::select(mid, vec::max(mid_hi, w[c]), mid_hi);
    out_max = vec::select(chunk(keep_outer, c), vec::max(out_max, m[c]), out_max);
    in_max = vec::select(chunk(keep_inner, c), vec::max(in_max, vec::abs(v[c])), in_max);
  }
  const float lo16 = half_round(std::min(-(zero - mid_lo).reduce_max(), kNegFloor));
  const float mid_s = scale_for(mid_hi.reduce_max() - lo16, 15);
  const float out_s = scale_for(out_max.reduce_max(), 15);
  const float in_s = scale_for(in_max.reduce_max(), 15);
  alignas(64) static constexpr float kLevel[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vec::Mask below = vec::greater(zero, F16::set1(lo16) + F16::load(kLevel) * F16::set1(mid_s));
  const F16 first = F16::set1(static_cast<float>(__builtin_popcount(below)));
  const F16 top = F16::set1(15.f);
  auto quantize = [&](F16 y, float divisor) {
    return vec::min(vec::max(vec::round_nearest(y / F16::set1(divisor)), zero), top);
  };
  for (int c = 0; c < 4; ++c) {
    const vec::Mask nc = chunk(neg, c);
    F16 code = quantize(w[c] - F16::set1(lo16), mid_s > 0.f ? mid_s : 1.f);
    code = vec::select(nc, vec::min(code, first - F16::set1(1.f)), vec::max(code, first));
    code = vec::select(chunk(keep_outer, c), quantize(m[c], out_s), code);
    code = vec::select(chunk(keep_inner, c), quantize(vec::abs(v[c]), in_s), code);
    alignas(64) float codes[16];
    code.store(codes);
    for (int i = 0; i < 8; ++i)  // element 2i in the low nibble
      dense[8 * c + i] = static_cast<uint8_t>(static_cast<int>(codes[2 * i]) | (static_cast<int>(codes[2 * i + 1]) << 4));
  }
  list[0] = static_cast<uint8_t>(__builtin_popcountll(kept));
  uint8_t* entry = list + 1;
  for (uint64_t rest = kept; rest != 0; rest &= rest - 1) {
    const int i = __builtin_ctzll(rest);
    *entry++ = static_cast<uint8_t>(i | (keep_outer >> i & 1) << 6 | (neg >> i & 1) << 7);
  }
  write_half(header, lo16), write_half(header + 2, mid_s), write_half(header + 4, out_s), write_half(header + 6, in_s);
  return folded;
}

int64_t encode_oaken_token(const float* x, const Format& f, const Thresholds& t, uint8_t* out,
                           std::vector<uint8_t>& group, std::vector<float>& code) {
  std::memset(out, 0, f.body);  // a row-0 tail after the body belongs to the block, not this row
  if (f.d == 64) {
    int64_t folded = 0;
    for (int64_t h = 0; h < f.hk; ++h)
      folded += encode_oaken_head64(x + h * 64, f, t, out + h * kOakenHeader, out + kOakenHeader * f.hk + h * 32,
                                    out + f.sparse_offset + h * f.sparse_bytes);
    return folded;
  }
  const int64_t n = f.hk * f.d;
  const int64_t folded = oaken_groups(x, f, t, group.data(), code.data());  // code: scratch until encoded
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
  if (f.mode == kBf16) {
    for (int64_t i = 0; i < f.hk * f.d; ++i) {
      const uint16_t bits = vec::bf16(x[i]).x;
      std::memcpy(out + 2 * i, &bits, 2);
    }
    return 0;
  }
  for (int64_t h = 0; h < f.hk; ++h) encode_int_head(x + h * f.d, f, out + h * (kIntHeader + f.code_bytes));
  return 0;
}

template <typename T>
void write_impl(const NewRows& rows, uint8_t* kout, uint8_t* vout, const Format& f, const Thresholds& kt,
                const Thresholds& vt, const float* k_center, std::vector<int64_t>& folded) {
  const int64_t width = f.hk * f.d;
  const T* kp = static_cast<const T*>(rows.k);
  const T* vp = static_cast<const T*>(rows.v);
  const int64_t* sl = rows.slots;
  const Format f8 = row0_format(f);
  kvops::parallel_for(0, rows.rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width), code(width);
    std::vector<uint8_t> group(width), row0(f.tail * f.block_size);
    // A block's first slot also goes, as an int8 record, into the tails of the block's records.
    auto write_row0 = [&](uint8_t* pool, int64_t slot) {
      if (f.tail == 0 || slot % f.block_size != 0) return;
      std::fill(row0.begin(), row0.end(), uint8_t{0});
      encode_token(row.data(), f8, Thresholds{}, row0.data(), group, code);
      scatter_row0(pool, slot / f.block_size, f, row0.data());
    };
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < width; ++i) row[i] = to_float(kp[t * width + i]);
      if (k_center != nullptr)
        for (int64_t i = 0; i < width; ++i) row[i] -= k_center[i];
      folded[t] = encode_token(row.data(), f, kt, kout + sl[t] * f.record, group, code);
      write_row0(kout, sl[t]);
      for (int64_t i = 0; i < width; ++i) row[i] = to_float(vp[t * width + i]);
      folded[t] += encode_token(row.data(), f, vt, vout + sl[t] * f.record, group, code);
      write_row0(vout, sl[t]);
    }
  });
}

}  // namespace

int64_t write_rows(const NewRows& rows, uint8_t* k_pool, uint8_t* v_pool, const Format& f, const Thresholds& kt,
                   const Thresholds& vt, const float* k_center) {
  std::vector<int64_t> folded(rows.rows, 0);
  if (rows.type == Rows::kFloat32)
    write_impl<float>(rows, k_pool, v_pool, f, kt, vt, k_center, folded);
  else
    write_impl<vec::bf16>(rows, k_pool, v_pool, f, kt, vt, k_center, folded);
  int64_t total = 0;
  for (int64_t x : folded) total += x;
  return total;
}

}  // namespace kvquant

// One head vector of a record (head_dim 64 or 128) dequantized over vec.h into rows of the queries'
// type. Both readers of the records call it: dequantize() (prefill chunks attend over its blocks with
// the float kernel) and the decode kernel (kvquant_decode_fast.cpp, a 16-token tile at a time), so a
// key or value reaches row_attention.h's arithmetic with the same bits on either path. The values are
// the reference's: lo + code * s (multiply, then add), Oaken's middle level plus its inner threshold
// by sign, then its sparse outliers (patch_sparse); a bf16 row rounds them to nearest even.
#pragma once

#include "isa/vec_codes.h"
#include "kvquant/kvquant_format.h"

namespace kvquant {

// Head h of the record at rec into dst[0, NC * 16); scratch: NC * 16 floats (Oaken's patch).
template <int NC, int64_t MODE, typename T>
inline void dequantize_head(const uint8_t* rec, int64_t h, const Format& f, const Thresholds& t, T* dst,
                            float* scratch) {
  vec::F16 r[NC];
  if constexpr (MODE == kBf16) {
    const auto* p = reinterpret_cast<const vec::bf16*>(rec) + h * (NC * 16);
    for (int c = 0; c < NC; ++c) vec::F16::load(p + 16 * c).store(dst + 16 * c);
  } else if constexpr (MODE == kInt8 || MODE == kInt4) {
    constexpr int64_t kCodeBytes = MODE == kInt8 ? NC * 16 : NC * 8;
    const uint8_t* p = rec + h * (kIntHeader + kCodeBytes);
    const vec::F16 lo = vec::F16::set1(read_half(p)), s = vec::F16::set1(read_half(p + 2));
    if constexpr (MODE == kInt8)
      for (int c = 0; c < NC; ++c) r[c] = vec::bytes_to_f16(p + kIntHeader + 16 * c);
    else
      for (int c = 0; c < NC; c += 2) vec::nibbles_to_f16(p + kIntHeader + 8 * c, r + c);
    for (int c = 0; c < NC; ++c) (lo + r[c] * s).store(dst + 16 * c);
  } else {
    const OakenScales sc = read_scales(rec + h * kOakenHeader);
    const uint8_t* dense = rec + kOakenHeader * f.hk + h * (NC * 8);
    const vec::F16 mid_lo = vec::F16::set1(sc.mid_lo), mid_s = vec::F16::set1(sc.mid_s);
    const vec::F16 inner_lo = vec::F16::set1(t.inner_lo), inner_hi = vec::F16::set1(t.inner_hi);
    for (int c = 0; c < NC; c += 2) vec::nibbles_to_f16(dense + 8 * c, r + c);
    for (int c = 0; c < NC; ++c) {
      const vec::F16 y = mid_lo + r[c] * mid_s;
      const vec::Mask nonneg = ~vec::greater(vec::F16::zero(), y) & 0xFFFFu;  // y >= 0
      (y + vec::select(nonneg, inner_hi, inner_lo)).store(scratch + 16 * c);
    }
    patch_sparse(rec, h, f, t, sc, dense, scratch);
    if constexpr (std::is_same_v<T, float>)
      std::memcpy(dst, scratch, sizeof(float) * NC * 16);
    else
      for (int c = 0; c < NC; ++c) vec::F16::load(scratch + 16 * c).store(dst + 16 * c);
  }
}

// dequantize_head for the format's mode
template <int NC, typename T>
inline void dequantize_head_any(const uint8_t* rec, int64_t h, const Format& f, const Thresholds& t, T* dst,
                                float* scratch) {
  if (f.mode == kBf16) dequantize_head<NC, kBf16>(rec, h, f, t, dst, scratch);
  else if (f.mode == kInt8) dequantize_head<NC, kInt8>(rec, h, f, t, dst, scratch);
  else if (f.mode == kInt4) dequantize_head<NC, kInt4>(rec, h, f, t, dst, scratch);
  else dequantize_head<NC, kOaken>(rec, h, f, t, dst, scratch);
}

}  // namespace kvquant

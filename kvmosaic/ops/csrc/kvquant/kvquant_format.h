// The quantized KV cache's record format as the kernels see it: the per-record layout
// (kvmosaic/quant/format.py and kvmosaic/quant/oaken.py), fp16 helpers with the PyTorch reference's
// rounding, and the pieces the kernel files share. Used by kvquant_encode.cpp (quantize-and-write),
// kvquant_decode.cpp (dequantization, scalar decode attention), kvquant_rows.h (vector dequantization)
// and kvquant_decode_fast.cpp (row decode attention); the entry points and the format's parameters are
// in kvquant.h.
#pragma once

#include "common/paged.h"
#include "common/parallel.h"
#include "isa/scalar_types.h"
#include "isa/vec.h"
#include "kvquant/kvquant.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace kvquant {

namespace vec = kvmosaic_vec;
using kvmosaic_vec::exp_nonpositive;

constexpr float kMinScale = 6.103515625e-05f;    // 2^-14
constexpr float kMargin = 1.001953125f;          // 1 + 2^-9
constexpr float kNegFloor = -6.103515625e-05f;   // -2^-14

inline float half_round(float x) { return static_cast<float>(vec::half(x)); }
inline float read_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  vec::half h;
  h.x = bits;
  return static_cast<float>(h);
#endif
}
inline void write_half(uint8_t* p, float x) {
  const vec::half h(x);
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

// A block's row-0 int8 record, read from (gather) or written into (scatter) the tails of its records;
// buf holds block_size * tail bytes (the record, then zeros).
inline void gather_row0(const uint8_t* pool, int64_t block, const Format& f, uint8_t* buf) {
  const uint8_t* rec = pool + block * f.block_size * f.record + f.body;
  for (int64_t s = 0; s < f.block_size; ++s) std::memcpy(buf + s * f.tail, rec + s * f.record, f.tail);
}
inline void scatter_row0(uint8_t* pool, int64_t block, const Format& f, const uint8_t* buf) {
  uint8_t* rec = pool + block * f.block_size * f.record + f.body;
  for (int64_t s = 0; s < f.block_size; ++s) std::memcpy(rec + s * f.record, buf + s * f.tail, f.tail);
}

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

// One decode-attention call's tensors as sizes and raw pointers (both decode kernels unpack it).
template <typename T>
struct DecodeBatch {
  int64_t batch, hq, group, width, block_size;
  const T* q;
  T* out;
  const uint8_t* k;
  const uint8_t* v;
  const int64_t* tables;
  const int64_t* lens;
};

template <typename T>
DecodeBatch<T> decode_batch(const DecodeCall& call, const Format& f, void* out) {
  return {call.batch,        call.hq,     call.hq / f.hk,   call.width,  call.block_size,
          static_cast<const T*>(call.q), static_cast<T*>(out), call.k_pool, call.v_pool, call.tables, call.lens};
}

// The row decode kernel (kvquant_decode_fast.cpp); false when it does not apply (a head_dim other
// than 64 / 128).
template <typename T>
bool decode_attention_fast(const DecodeBatch<T>& batch, const Format& f, const Thresholds& kt, const Thresholds& vt,
                           double scale, const PartialOut* partial);

}  // namespace kvquant

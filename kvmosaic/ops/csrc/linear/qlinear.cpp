// Linear layers on quantized weights (q8: w = scale * q; q4: w = scale * q + min; one scale and min per
// 32 weights of a column; q6: w = d * sc * q, an int8 sc per 16 weights and a float d per 256; q4k: q4
// whose scale d * sc and min (-dmin) * m are made per block from a uint8 sc and m per 32 weights and a
// float16 d and -dmin per 256), in the interleaved layout of kvmosaic/quant/interleaved.py: 16 output
// columns side by side, codes [N/16, K/4 (q8) or K/8 (q4, q4k), 16, 4] bytes or [N/16, K/32, 6, 16, 4]
// (q6), scales and mins [N/16, K/32, 16], q6 scales [N/16, K/16, 16] and super-block scales
// [N/16, K/256, 16], q4k scales (sc, m) [N/16, K/16, 16] and super-block pairs (d, -dmin) [N/16, K/128, 16].
//
// The activations are quantized to int8 per 32 values (d = max|x| / 127, codes rounded half to even)
// and every weight block is an integer dot product per column:
//   out[r, n] += scale[n, b] * d[r, b] * sum_k q[n, k] x[r, k] + min[n, b] * d[r, b] * sum_k x[r, k]
// (q6: scale is the super-block's d, and the integer sum weighs each 16 codes by their sc)
// Each thread takes a contiguous range of 16-column groups and runs every row over a group (4 rows per
// pass) while its codes sit in L1, so the weights stream from memory once per call at any row count.
// Written once over vec.h / qdot.h. A composite weight (parts of different kinds stacked along the
// columns: a Q4_K_M file's Q4_K q and k beside its Q6_K v) runs each part's own product into its
// columns over the same quantized rows, so a column computes what its part alone computes.
//
// Measured against the alternatives (2 threads, the default model's 120 layer products, float32 rows):
// - widening the codes to float in registers and multiplying float activations: 2-5x slower at 1-4
//   rows (a decode step's linears 1.0 ms vs 4.4 ms for Q4_1, 1.5 ms vs 4.2 ms for Q8_0, AVX-512 VNNI);
// - dequantizing panels of the weight into the packed float GEMM, the path many rows took before:
//   slower at every row count measured, 5 to 1024, on both levels (AVX-512 VNNI: 12.3 vs 6.9 ms at
//   5 rows, 143 vs 63 ms at 128, 1071 vs 512 ms at 1024; AVX2: 14.5 vs 7.9, 161 vs 158, 1062 vs 793;
//   bfloat16 rows: 258 vs 232 ms at 512 on AVX-512 BF16, 770 vs 405 ms on AVX2), so it was removed.
// On AMX tiles (Intel) that trade turns: from amx::kMinRows rows a q8 / q4 product
// dequantizes its weights to bf16 chunk by chunk into the tiles' product (amx_gemm.cpp), with the
// rows in bf16 (float32 rows rounded to it: closer to the float product than int8 rows are).
#include "isa/amx.h"
#include "common/parallel.h"
#include "linear/linear.h"
#include "linear/qdot.h"

#include <memory>
#include <type_traits>
#include <vector>

namespace {

using kvops::QuantizedRows;
using kvops::QuantizedWeight;
using kvmosaic_vec::bf16;
using kvmosaic_vec::F16;
using kvmosaic_qdot::I16;
using kvmosaic_qdot::Q4Sum;
using kvmosaic_qdot::V64;

constexpr int64_t kCols = kvops::kQuantCols;
constexpr int64_t kQBlock = kvops::kQuantBlock;
constexpr int64_t kQ6Vectors = 6;  // 64-byte code vectors per 32-k block of a q6 group
constexpr int64_t kQ6Sub = kvops::kQ6Sub;
constexpr int64_t kQ6Super = kvops::kQ6Super;
constexpr int kMaxRows = 4;  // activation rows sharing one pass over a group's codes

// Bytes of codes a product asks for ahead of the block it multiplies. Only the first rows of a group
// ask: later rows find its codes in L1. On an AVX2 host (Zen 3) the integer dots are heavy enough
// that the hardware prefetcher alone falls behind: the default model's Q4_1 decode went from ~87 to
// ~100 tok/s (medians of 3 x 6 interleaved runs; 1 and 2 KiB alike). On a Zen 5 AVX-512 host (AVX512-BF16,
// VNNI, VP2INTERSECT), Q4_1, one stream, in-process interleaved rounds against none: 1 KiB 1.07x,
// 2 KiB 1.16x, 4 KiB 1.21x, 8 KiB 1.38x, 16 KiB 1.31x when the host's read probe gave ~92 GB/s, and
// 8 KiB 1.13x at ~55 GB/s; Q8_0 the same with or without (0.98-1.00x; 12-24 KiB 0.96-0.99x of 8).
// (A Zen 4 AVX-512 host had gained nothing from 1-4 KiB.)
#if defined(KVM_VEC_AVX512)
constexpr int64_t kStreamAhead = 8192;
#else
constexpr int64_t kStreamAhead = 1024;
#endif

// One row's activations quantized per 32 values.
struct QuantRow {
  const int8_t* codes;     // [K]
  const float* scale;      // [K / 32]: d
  const float* sum;        // [K / 32]: d * sum of the block's codes
  const float* half_sum;   // [K / 16]: sum of each 16 codes
};

template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* codes, float* scale, float* sum, float* half_sum) {
  for (int64_t b = 0; b < k / kQBlock; ++b) {
    const T* xb = x + b * kQBlock;
    const F16 v0 = F16::load(xb), v1 = F16::load(xb + 16);
    const float amax = kvmosaic_vec::max(kvmosaic_vec::abs(v0), kvmosaic_vec::abs(v1)).reduce_max();
    const float d = amax / 127.f;
    const float id = d == 0.f ? 0.f : 1.f / d;
    alignas(64) float rounded[kQBlock];
    kvmosaic_vec::round_nearest(v0 * F16::set1(id)).store(rounded);
    kvmosaic_vec::round_nearest(v1 * F16::set1(id)).store(rounded + 16);
    int32_t halves[2] = {0, 0};
    for (int64_t j = 0; j < kQBlock; ++j) {
      const int32_t q = static_cast<int32_t>(rounded[j]);
      codes[b * kQBlock + j] = static_cast<int8_t>(q);
      halves[j / kQ6Sub] += q;
    }
    scale[b] = d;
    sum[b] = d * static_cast<float>(halves[0] + halves[1]);
    half_sum[2 * b] = static_cast<float>(halves[0]);
    half_sum[2 * b + 1] = static_cast<float>(halves[1]);
  }
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

enum class Kind { kQ8, kQ4, kQ4K, kQ6 };

// A q4k block's float32 scale d * sc and min (-dmin) * m of 16 columns: exact products (11 + 6 bits),
// so the very values a q4 weight with float32 scales holds. scale: the block's sc then m bytes (0..63);
// pair: the super-block's d then -dmin.
inline void q4k_block(const uint8_t* scale, const kvmosaic_vec::half* pair, F16& sc, F16& mn) {
  const auto sub = [](const uint8_t* p) { return I16::load_s8(reinterpret_cast<const int8_t*>(p)).to_float(); };
  sc = kvmosaic_qdot::load_half16(pair) * sub(scale);
  mn = kvmosaic_qdot::load_half16(pair + kCols) * sub(scale + kCols);
}

// R rows x one group of 16 columns of a q8, q4 or q4k weight. codes: the group's bytes; S: the scale
// dtype (uint8 for q4k); extra: q4's mins (S), q4k's super-block pairs (half).
// A block's integer dots go to kChains independent accumulators per row, summed at the block's end: one
// chain would serialize the block's 8 dot instructions on their latency, which bounds a decode row
// (one accumulator in flight) below the memory bandwidth.
template <typename T, typename S, Kind kKind, int R>
void group_rows(const QuantRow* rows, int64_t k, const uint8_t* codes, const S* scale, const void* extra,
                const float* bias, T* out, int64_t ldo, bool stream) {
  constexpr bool kQ4 = kKind != Kind::kQ8;  // nibbles
  constexpr int64_t kScaleRows = kKind == Kind::kQ4K ? 2 : 1;  // q4k: sc and m
  const S* mins = static_cast<const S*>(extra);
  constexpr int64_t kGroups = kQ4 ? 4 : 8;  // 64-byte vectors per 32-k block
  constexpr int kChains = R == 1 ? 4 : (R == 2 ? 2 : 1);
  F16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = F16::zero();
  const int64_t blocks = k / kQBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    I16 dots[R][kChains];
    Q4Sum q4sums[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) {
        dots[r][c] = I16::zero();
        q4sums[r][c] = Q4Sum::zero();
      }
    const uint8_t* wb = codes + b * kGroups * 64;
    if (kStreamAhead > 0 && stream) {
      constexpr int64_t kBlocksAhead = kStreamAhead / (kGroups * 64);
      for (int64_t q = 0; q < kGroups * 64; q += 64) kvmosaic_vec::prefetch_l1(wb + kStreamAhead + q);
      kvmosaic_vec::prefetch_l1(scale + (b + kBlocksAhead) * kScaleRows * kCols);
      if constexpr (kKind == Kind::kQ4) kvmosaic_vec::prefetch_l1(mins + (b + kBlocksAhead) * kCols);
    }
#pragma GCC unroll 8
    for (int64_t g = 0; g < kGroups; ++g) {
      const V64 w = V64::load(wb + g * 64);
      if constexpr (kQ4) {
        const V64 lo = w.low_nibbles(), hi = w.high_nibbles();
        const int c0 = static_cast<int>((2 * g) % kChains), c1 = static_cast<int>((2 * g + 1) % kChains);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = rows[r].codes + b * kQBlock + g * 8;
          q4sums[r][c0] = q4sums[r][c0].add(lo, V64::broadcast4(load4(x)));
          q4sums[r][c1] = q4sums[r][c1].add(hi, V64::broadcast4(load4(x + 4)));
        }
      } else {
        const int c = static_cast<int>(g % kChains);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = rows[r].codes + b * kQBlock + g * 4;
          dots[r][c] = kvmosaic_qdot::dot_s8s8(dots[r][c], w, V64::broadcast4(load4(x)));
        }
      }
    }
    F16 sc, mn;
    if constexpr (kKind == Kind::kQ4K) {
      q4k_block(scale + 2 * b * kCols, static_cast<const kvmosaic_vec::half*>(extra) + (b / 8) * 2 * kCols, sc, mn);
    } else {
      sc = kvmosaic_qdot::load_scale16(scale + b * kCols);
      if constexpr (kQ4) mn = kvmosaic_qdot::load_scale16(mins + b * kCols);
    }
    for (int r = 0; r < R; ++r) {
      if constexpr (kQ4)
        for (int c = 0; c < kChains; ++c) dots[r][c] = q4sums[r][c].total();
      I16 total = dots[r][0];
      for (int c = 1; c < kChains; ++c) total = kvmosaic_qdot::add(total, dots[r][c]);
      acc[r] = kvmosaic_vec::fma(total.to_float(), sc * F16::set1(rows[r].scale[b]), acc[r]);
    }
    if constexpr (kQ4)
      for (int r = 0; r < R; ++r) acc[r] = kvmosaic_vec::fma(mn, F16::set1(rows[r].sum[b]), acc[r]);
  }
  const F16 bv = bias != nullptr ? F16::load(bias) : F16::zero();
  for (int r = 0; r < R; ++r) (acc[r] + bv).store(out + r * ldo);
}

// Four code bytes of q6 sub-vector kS (k = 4 kS .. 4 kS + 3 of the block) of each column dotted with
// R rows' activations into sums: the low nibble comes from vector kS / 2, the high bit pair from vector
// 4 + kS / 4. Where the sums are int32 (qdot.h's kInt32Q4Sums) the stored codes q + 32 (0..63) go into
// the dot as they are and the sub-block's total subtracts 32 x its activation sum afterwards, the same
// integer as the signed dot and half the instructions; int16 sums (maddubs) would overflow on 0..63,
// so they take the signed codes by the sign trick.
template <int kS, int R>
inline void q6_dots(V64 nibbles, V64 pairs, const QuantRow* rows, int64_t b, Q4Sum* sums) {
  const V64 low = kS % 2 == 0 ? nibbles.low_nibbles() : nibbles.high_nibbles();
  const V64 biased = low | pairs.template pair_bits<kS % 4>();
  if constexpr (kvmosaic_qdot::kInt32Q4Sums) {
    for (int r = 0; r < R; ++r)
      sums[r] = sums[r].add(biased, V64::broadcast4(load4(rows[r].codes + b * kQBlock + 4 * kS)));
  } else {
    const V64 w = biased.minus32();
    const V64 magnitude = w.abs_s8();
    for (int r = 0; r < R; ++r) {
      const V64 x = V64::broadcast4(load4(rows[r].codes + b * kQBlock + 4 * kS));
      sums[r] = sums[r].add(magnitude, w.sign_of(x));
    }
  }
}

// A q6 sub-block's signed sum from q6_dots' sums: the unsigned codes' bias of 32 removed (int32 sums).
inline I16 q6_signed(Q4Sum sum, const QuantRow& row, int64_t sub) {
  if constexpr (kvmosaic_qdot::kInt32Q4Sums)
    return kvmosaic_qdot::add(sum.total(), I16::set1(-32 * static_cast<int32_t>(row.half_sum[sub])));
  else
    return sum.total();
}

// R rows x one group of 16 columns of a q6 weight: per 32-k block two sub-blocks of 16, each an int16
// sum of four dots (qdot.h's Q4Sum) widened with its int8 scale, then the block's one float multiply-add.
template <typename T, int R>
void group_rows_q6(const QuantRow* rows, int64_t k, const uint8_t* codes, const int8_t* scale, const float* supers,
                   const float* bias, T* out, int64_t ldo, bool stream) {
  F16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = F16::zero();
  const int64_t blocks = k / kQBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = codes + b * kQ6Vectors * 64;
    if (kStreamAhead > 0 && stream) {
      for (int64_t q = 0; q < kQ6Vectors * 64; q += 64) kvmosaic_vec::prefetch_l1(wb + kStreamAhead + q);
      kvmosaic_vec::prefetch_l1(scale + (2 * b) * kCols + kStreamAhead / 12);  // 32 scale bytes per 384 code bytes
    }
    const V64 n0 = V64::load(wb), n1 = V64::load(wb + 64), n2 = V64::load(wb + 128), n3 = V64::load(wb + 192);
    const V64 p0 = V64::load(wb + 256), p1 = V64::load(wb + 320);
    Q4Sum first[R], second[R];
    for (int r = 0; r < R; ++r) first[r] = second[r] = Q4Sum::zero();
    q6_dots<0, R>(n0, p0, rows, b, first);
    q6_dots<4, R>(n2, p1, rows, b, second);
    q6_dots<1, R>(n0, p0, rows, b, first);
    q6_dots<5, R>(n2, p1, rows, b, second);
    q6_dots<2, R>(n1, p0, rows, b, first);
    q6_dots<6, R>(n3, p1, rows, b, second);
    q6_dots<3, R>(n1, p0, rows, b, first);
    q6_dots<7, R>(n3, p1, rows, b, second);
    const I16 sc0 = I16::load_s8(scale + (2 * b) * kCols), sc1 = I16::load_s8(scale + (2 * b + 1) * kCols);
    const F16 d = F16::load(supers + (b * kQBlock / kQ6Super) * kCols);
    for (int r = 0; r < R; ++r) {
      I16 total;
      if constexpr (kvmosaic_qdot::kInt32Q4Sums)
        total = kvmosaic_qdot::add(q6_signed(first[r], rows[r], 2 * b) * sc0, q6_signed(second[r], rows[r], 2 * b + 1) * sc1);
      else
        total = kvmosaic_qdot::add(first[r].scaled(sc0), second[r].scaled(sc1));
      acc[r] = kvmosaic_vec::fma(total.to_float(), d * F16::set1(rows[r].scale[b]), acc[r]);
    }
  }
  const F16 bv = bias != nullptr ? F16::load(bias) : F16::zero();
  for (int r = 0; r < R; ++r) (acc[r] + bv).store(out + r * ldo);
}

// S: the scale dtype (int8 for q6, uint8 for q4k); extra: q4's mins (S), q6's super-block scales (float)
// or q4k's super-block pairs (half)
template <typename T, typename S, Kind kKind, int R>
void group_rows_of(const QuantRow* q, int64_t k, const uint8_t* codes, const S* scale, const void* extra,
                   const float* bias, T* out, int64_t ldo, bool stream) {
  if constexpr (kKind == Kind::kQ6)
    group_rows_q6<T, R>(q, k, codes, scale, static_cast<const float*>(extra), bias, out, ldo, stream);
  else
    group_rows<T, S, kKind, R>(q, k, codes, scale, extra, bias, out, ldo, stream);
}

template <typename T, typename S, Kind kKind>
void rows_dispatch(int rows, const QuantRow* q, int64_t k, const uint8_t* codes, const S* scale, const void* extra,
                   const float* bias, T* out, int64_t ldo, bool stream) {
  switch (rows) {
    case 4: return group_rows_of<T, S, kKind, 4>(q, k, codes, scale, extra, bias, out, ldo, stream);
    case 3: return group_rows_of<T, S, kKind, 3>(q, k, codes, scale, extra, bias, out, ldo, stream);
    case 2: return group_rows_of<T, S, kKind, 2>(q, k, codes, scale, extra, bias, out, ldo, stream);
    default: return group_rows_of<T, S, kKind, 1>(q, k, codes, scale, extra, bias, out, ldo, stream);
  }
}

template <typename T, typename S, Kind kKind>
void groups_of(const QuantizedWeight& w, const QuantizedRows& x, int64_t m, T* out, int64_t ldo, int64_t g0,
               int64_t g1) {
  const int64_t k = w.k, blocks = k / kQBlock;
  const int64_t group_bytes = w.group_code_bytes();
  const int64_t group_scales = (kKind == Kind::kQ6 || kKind == Kind::kQ4K ? k / kQ6Sub : blocks) * kCols;
  const S* scale = static_cast<const S*>(w.scale);
  for (int64_t g = g0; g < g1; ++g) {
    const void* extra = nullptr;
    if constexpr (kKind == Kind::kQ4) extra = static_cast<const S*>(w.mins) + g * group_scales;
    if constexpr (kKind == Kind::kQ6) extra = w.super_scale + g * (k / kQ6Super) * kCols;
    if constexpr (kKind == Kind::kQ4K) extra = w.q4k_supers + g * (2 * k / kQ6Super) * kCols;
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
      QuantRow q[kMaxRows];
      for (int r = 0; r < rows; ++r)
        q[r] = {x.codes + (r0 + r) * k, x.scale + (r0 + r) * blocks, x.sum + (r0 + r) * blocks,
                x.half_sum + (r0 + r) * 2 * blocks};
      rows_dispatch<T, S, kKind>(rows, q, k, w.codes + g * group_bytes, scale + g * group_scales, extra,
                                 w.bias != nullptr ? w.bias + g * kCols : nullptr, out + r0 * ldo + g * kCols, ldo,
                                 r0 == 0);
    }
  }
}

}  // namespace

namespace kvops {

QuantizedRows QuantizedRows::over(int8_t* codes, float* floats, int64_t m, int64_t k) {
  const int64_t blocks = k / kQBlock;
  return {codes, floats, floats + m * blocks, floats + 2 * m * blocks};
}

int64_t QuantizedRows::floats_per_row(int64_t k) { return 4 * (k / kQBlock); }

template <typename T>
void quantize_rows(const T* x, int64_t k, const QuantizedRows& out, int64_t r0, int64_t r1) {
  const int64_t blocks = k / kQBlock;
  for (int64_t r = r0; r < r1; ++r)
    quantize_row(x + r * k, k, out.codes + r * k, out.scale + r * blocks, out.sum + r * blocks,
                 out.half_sum + r * 2 * blocks);
}

void bf16_rows(const float* x, int64_t k, bf16* out, int64_t r0, int64_t r1) {
  for (int64_t i = r0 * k; i < r1 * k; i += kCols) F16::load(x + i).store(out + i);
}

template <typename T>
void quantized_groups(const QuantizedWeight& w, const QuantizedRows& x, int64_t m, T* out, int64_t ldo, int64_t g0,
                      int64_t g1) {
  if (w.composite()) {  // each part's own product into its columns: the same rows, the same output stride
    for_parts(w, g0, g1, [&](const QuantizedWeight& part, int64_t first, int64_t lo, int64_t hi) {
      quantized_groups(part, x, m, out + first * kCols, ldo, lo, hi);
    });
    return;
  }
  if (w.super_scale != nullptr) {
    groups_of<T, int8_t, Kind::kQ6>(w, x, m, out, ldo, g0, g1);
  } else if (w.q4k_supers != nullptr) {
    groups_of<T, uint8_t, Kind::kQ4K>(w, x, m, out, ldo, g0, g1);
  } else if (w.half_scales) {
    if (w.mins != nullptr) groups_of<T, kvmosaic_vec::half, Kind::kQ4>(w, x, m, out, ldo, g0, g1);
    else groups_of<T, kvmosaic_vec::half, Kind::kQ8>(w, x, m, out, ldo, g0, g1);
  } else {
    if (w.mins != nullptr) groups_of<T, float, Kind::kQ4>(w, x, m, out, ldo, g0, g1);
    else groups_of<T, float, Kind::kQ8>(w, x, m, out, ldo, g0, g1);
  }
}

template void quantize_rows<float>(const float*, int64_t, const QuantizedRows&, int64_t, int64_t);
template void quantize_rows<bf16>(const bf16*, int64_t, const QuantizedRows&, int64_t, int64_t);
template void quantized_groups<float>(const QuantizedWeight&, const QuantizedRows&, int64_t, float*, int64_t,
                                      int64_t, int64_t);
template void quantized_groups<bf16>(const QuantizedWeight&, const QuantizedRows&, int64_t,
                                              bf16*, int64_t, int64_t, int64_t);

int64_t QuantizedWeight::group_code_bytes() const {
  if (super_scale != nullptr) return k * kCols * 3 / 4;
  return k * kCols / (nibbles() ? 2 : 1);
}

int64_t QuantizedWeight::group_scale_bytes() const {
  if (super_scale != nullptr || q4k_supers != nullptr) return (k / kQ6Sub) * kCols;  // q4k: sc and m bytes
  return (k / kQBlock) * kCols * (half_scales ? 2 : 4);
}

}  // namespace kvops

namespace kvops {

template <typename T>
void quantized_product(const QuantizedWeight& w, const T* x, int64_t m, T* out) {
  const int64_t k = w.k;
  if (amx::quantized_takes(w, m)) {  // float32 rows go to the tiles rounded to bf16
    const bf16* xb;
    std::unique_ptr<bf16[]> rounded;
    if constexpr (std::is_same_v<T, float>) {
      rounded.reset(new bf16[m * k]);
      parallel_for(0, m, 16, [&](int64_t begin, int64_t end) { bf16_rows(x, k, rounded.get(), begin, end); });
      xb = rounded.get();
    } else {
      xb = x;
    }
    parallel_for(0, w.groups, 1, [&](int64_t begin, int64_t end) {
      amx::quantized_bf16_groups(w, xb, m, out, begin, end);
    });
    return;
  }
  std::vector<int8_t> codes(m * k);
  std::vector<float> scales(m * QuantizedRows::floats_per_row(k));
  const QuantizedRows rows = QuantizedRows::over(codes.data(), scales.data(), m, k);
  parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {  // inline below 16 rows
    quantize_rows(x, k, rows, begin, end);
  });
  parallel_for(0, w.groups, 1, [&](int64_t begin, int64_t end) {
    quantized_groups(w, rows, m, out, w.groups * kCols, begin, end);
  });
}

template void quantized_product<float>(const QuantizedWeight&, const float*, int64_t, float*);
template void quantized_product<bf16>(const QuantizedWeight&, const bf16*, int64_t, bf16*);

}  // namespace kvops

namespace {

// Weight k of a column (lane) of a group's codes, as its integer code (q4: 0..15; q8, q6: signed).
inline int code_at(const QuantizedWeight& w, const uint8_t* group, int64_t lane, int64_t kk) {
  if (w.super_scale != nullptr) {  // q6: vector kS / 2 holds the low nibble, vector 4 + kS / 4 the high pair
    const int64_t block = kk / kQBlock, sub = (kk % kQBlock) / 4, t = kk % 4;
    const uint8_t* vectors = group + block * kQ6Vectors * 64;
    const uint8_t nibbles = vectors[((sub / 2) * kCols + lane) * 4 + t];
    const uint8_t pairs = vectors[((4 + sub / 4) * kCols + lane) * 4 + t];
    const int low = sub % 2 == 0 ? nibbles & 0x0F : nibbles >> 4;
    return (low | (((pairs >> (2 * (sub % 4))) & 3) << 4)) - 32;
  }
  if (w.nibbles()) {  // byte [k / 8, lane, k % 4] holds k % 8 < 4 in its low nibble, the rest in its high one
    const uint8_t byte = group[((kk / 8) * kCols + lane) * 4 + kk % 4];
    return kk % 8 < 4 ? byte & 0x0F : byte >> 4;
  }
  return static_cast<int8_t>(group[((kk / 4) * kCols + lane) * 4 + kk % 4]);
}

// Rows of the float weight from the interleaved layout: w[n, k] = code * scale (+ min), rounded as
// the reference dequantization rounds (a float product, then a float sum; q6's scale d * sc is exact).
template <typename T, typename S>
void rows_of(const QuantizedWeight& w, const int64_t* index, int64_t count, T* out) {
  const int64_t k = w.k, group_bytes = w.group_code_bytes();
  const bool q6 = w.super_scale != nullptr;
  const int64_t per_group = (q6 || w.q4k_supers != nullptr ? k / kQ6Sub : k / kQBlock) * kCols;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t group = index[r] / kCols, lane = index[r] % kCols;
    const uint8_t* gc = w.codes + group * group_bytes;
    T* row = out + r * k;
    for (int64_t kk = 0; kk < k; ++kk) {
      const float code = static_cast<float>(code_at(w, gc, lane, kk));
      float v;
      if (w.q4k_supers != nullptr) {  // (d * sc) * q + (-dmin) * m, as the product's exact scale and min
        const int64_t block = kk / kQBlock, super = kk / kQ6Super;
        const uint8_t* sc = static_cast<const uint8_t*>(w.scale) + group * per_group + 2 * block * kCols + lane;
        const kvmosaic_vec::half* pair = w.q4k_supers + (group * (2 * k / kQ6Super) + 2 * super) * kCols + lane;
        v = code * (static_cast<float>(pair[0]) * static_cast<float>(sc[0]));
        v += static_cast<float>(pair[kCols]) * static_cast<float>(sc[kCols]);
      } else if (q6) {
        const float d = w.super_scale[(group * (k / kQ6Super) + kk / kQ6Super) * kCols + lane];
        v = code * (d * static_cast<float>(static_cast<const int8_t*>(w.scale)[group * per_group + (kk / kQ6Sub) * kCols + lane]));
      } else {
        const int64_t at = group * per_group + (kk / kQBlock) * kCols + lane;
        v = code * static_cast<float>(static_cast<const S*>(w.scale)[at]);
        if (w.mins != nullptr) v += static_cast<float>(static_cast<const S*>(w.mins)[at]);
      }
      row[kk] = static_cast<T>(v);
    }
  }
}

}  // namespace

namespace kvops {

template <typename T>
void dequantize_rows(const QuantizedWeight& w, const int64_t* index, int64_t count, T* out) {
  if (w.composite()) {  // each row from the part that holds it
    for (int64_t r = 0; r < count; ++r)
      for_parts(w, index[r] / kCols, index[r] / kCols + 1,
                [&](const QuantizedWeight& part, int64_t first, int64_t, int64_t) {
                  const int64_t local = index[r] - first * kCols;
                  dequantize_rows(part, &local, 1, out + r * w.k);
                });
    return;
  }
  if (w.half_scales) rows_of<T, kvmosaic_vec::half>(w, index, count, out);
  else rows_of<T, float>(w, index, count, out);
}

template void dequantize_rows<float>(const QuantizedWeight&, const int64_t*, int64_t, float*);
template void dequantize_rows<bf16>(const QuantizedWeight&, const int64_t*, int64_t, bf16*);

}  // namespace kvops

// Linear layers on quantized weights (q8: w = scale * q; q4: w = scale * q + min; one scale and min per
// 32 weights of a column), in the interleaved layout of kvmosaic/quant/weights.py: 16 output columns
// side by side, codes [N/16, K/4 (q8) or K/8 (q4), 16, 4] bytes, scales and mins [N/16, K/32, 16].
//
// The activations are quantized to int8 per 32 values (d = max|x| / 127, codes rounded half to even)
// and every weight block is an integer dot product per column:
//   out[r, n] += scale[n, b] * d[r, b] * sum_k q[n, k] x[r, k] + min[n, b] * d[r, b] * sum_k x[r, k]
// Each thread takes a contiguous range of 16-column groups and runs every row over a group (4 rows per
// pass) while its codes sit in L1, so the weights stream from memory once per call at any row count.
// Written once over vec.h / qdot.h.
//
// Measured against the alternatives (2 threads, the default model's 120 layer products, float32 rows):
// - widening the codes to float in registers and multiplying float activations: 2-5x slower at 1-4
//   rows (a decode step's linears 1.0 ms vs 4.4 ms for Q4_1, 1.5 ms vs 4.2 ms for Q8_0, AVX-512 VNNI);
// - dequantizing panels of the weight into the packed float GEMM, the path many rows took before:
//   slower at every row count measured, 5 to 1024, on both levels (AVX-512 VNNI: 12.3 vs 6.9 ms at
//   5 rows, 143 vs 63 ms at 128, 1071 vs 512 ms at 1024; AVX2: 14.5 vs 7.9, 161 vs 158, 1062 vs 793;
//   bfloat16 rows: 258 vs 232 ms at 512 on AVX-512 BF16, 770 vs 405 ms on AVX2), so it was removed.
#include "ops_common.h"
#include "qdot.h"
#include "stack_kernels.h"

namespace {

using kvops::QuantizedRows;
using kvops::QuantizedWeight;
using kvmosaic_vec::F16;
using kvmosaic_qdot::I16;
using kvmosaic_qdot::Q4Sum;
using kvmosaic_qdot::V64;

constexpr int64_t kCols = 16;
constexpr int64_t kQBlock = 32;
constexpr int kMaxRows = 4;  // activation rows sharing one pass over a group's codes

// Bytes of codes a product asks for ahead of the block it multiplies. On an AVX2 host (Zen 3) the
// integer dots are heavy enough that the hardware prefetcher alone falls behind: the default model's
// Q4_1 decode went from ~87 to ~100 tok/s (medians of 3 x 6 interleaved runs; 1 and 2 KiB alike). On
// AVX-512 (Zen 4) prefetching inside a product gave nothing (decode_team.cpp), so it stays off there.
#if defined(KVM_VEC_AVX512)
constexpr int64_t kStreamAhead = 0;
#else
constexpr int64_t kStreamAhead = 1024;
#endif

// One row's activations quantized per 32 values.
struct QuantRow {
  const int8_t* codes;   // [K]
  const float* scale;    // [K / 32]: d
  const float* sum;      // [K / 32]: d * sum of the block's codes
};

template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* codes, float* scale, float* sum) {
  for (int64_t b = 0; b < k / kQBlock; ++b) {
    const T* xb = x + b * kQBlock;
    const F16 v0 = F16::load(xb), v1 = F16::load(xb + 16);
    const float amax = kvmosaic_vec::max(kvmosaic_vec::abs(v0), kvmosaic_vec::abs(v1)).reduce_max();
    const float d = amax / 127.f;
    const float id = d == 0.f ? 0.f : 1.f / d;
    alignas(64) float rounded[kQBlock];
    kvmosaic_vec::round_nearest(v0 * F16::set1(id)).store(rounded);
    kvmosaic_vec::round_nearest(v1 * F16::set1(id)).store(rounded + 16);
    int32_t total = 0;
    for (int64_t j = 0; j < kQBlock; ++j) {
      const int32_t q = static_cast<int32_t>(rounded[j]);
      codes[b * kQBlock + j] = static_cast<int8_t>(q);
      total += q;
    }
    scale[b] = d;
    sum[b] = d * static_cast<float>(total);
  }
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// R rows x one group of 16 columns. codes: the group's bytes; S: the scale dtype; kQ4: nibbles.
// A block's integer dots go to kChains independent accumulators per row, summed at the block's end: one
// chain would serialize the block's 8 dot instructions on their latency, which bounds a decode row
// (one accumulator in flight) below the memory bandwidth.
template <typename T, typename S, bool kQ4, int R>
void group_rows(const QuantRow* rows, int64_t k, const uint8_t* codes, const S* scale, const S* mins,
                const float* bias, T* out, int64_t ldo) {
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
    if constexpr (kStreamAhead > 0) {
      constexpr int64_t kBlocksAhead = kStreamAhead / (kGroups * 64);
      for (int64_t q = 0; q < kGroups * 64; q += 64) kvmosaic_vec::prefetch_l1(wb + kStreamAhead + q);
      kvmosaic_vec::prefetch_l1(scale + (b + kBlocksAhead) * kCols);
      if constexpr (kQ4) kvmosaic_vec::prefetch_l1(mins + (b + kBlocksAhead) * kCols);
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
    const F16 sc = kvmosaic_qdot::load_scale16(scale + b * kCols);
    for (int r = 0; r < R; ++r) {
      if constexpr (kQ4)
        for (int c = 0; c < kChains; ++c) dots[r][c] = q4sums[r][c].total();
      I16 total = dots[r][0];
      for (int c = 1; c < kChains; ++c) total = kvmosaic_qdot::add(total, dots[r][c]);
      acc[r] = kvmosaic_vec::fma(total.to_float(), sc * F16::set1(rows[r].scale[b]), acc[r]);
    }
    if constexpr (kQ4) {
      const F16 mn = kvmosaic_qdot::load_scale16(mins + b * kCols);
      for (int r = 0; r < R; ++r) acc[r] = kvmosaic_vec::fma(mn, F16::set1(rows[r].sum[b]), acc[r]);
    }
  }
  const F16 bv = bias != nullptr ? F16::load(bias) : F16::zero();
  for (int r = 0; r < R; ++r) (acc[r] + bv).store(out + r * ldo);
}

template <typename T, typename S, bool kQ4>
void rows_dispatch(int rows, const QuantRow* q, int64_t k, const uint8_t* codes, const S* scale, const S* mins,
                   const float* bias, T* out, int64_t ldo) {
  switch (rows) {
    case 4: return group_rows<T, S, kQ4, 4>(q, k, codes, scale, mins, bias, out, ldo);
    case 3: return group_rows<T, S, kQ4, 3>(q, k, codes, scale, mins, bias, out, ldo);
    case 2: return group_rows<T, S, kQ4, 2>(q, k, codes, scale, mins, bias, out, ldo);
    default: return group_rows<T, S, kQ4, 1>(q, k, codes, scale, mins, bias, out, ldo);
  }
}

template <typename T, typename S, bool kQ4>
void groups_of(const QuantizedWeight& w, const QuantizedRows& x, int64_t m, T* out, int64_t ldo, int64_t g0,
               int64_t g1) {
  const int64_t k = w.k, blocks = k / kQBlock;
  const int64_t group_bytes = k * kCols / (kQ4 ? 2 : 1), group_scales = blocks * kCols;
  const S* scale = static_cast<const S*>(w.scale);
  const S* mins = static_cast<const S*>(w.mins);
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
      QuantRow q[kMaxRows];
      for (int r = 0; r < rows; ++r)
        q[r] = {x.codes + (r0 + r) * k, x.scale + (r0 + r) * blocks, x.sum + (r0 + r) * blocks};
      rows_dispatch<T, S, kQ4>(rows, q, k, w.codes + g * group_bytes, scale + g * group_scales,
                               kQ4 ? mins + g * group_scales : nullptr,
                               w.bias != nullptr ? w.bias + g * kCols : nullptr, out + r0 * ldo + g * kCols, ldo);
    }
  }
}

}  // namespace

namespace kvops {

QuantizedRows QuantizedRows::over(int8_t* codes, float* floats, int64_t m, int64_t k) {
  return {codes, floats, floats + m * (k / kQBlock)};
}

int64_t QuantizedRows::floats_per_row(int64_t k) { return 2 * (k / kQBlock); }

template <typename T>
void quantize_rows(const T* x, int64_t k, const QuantizedRows& out, int64_t r0, int64_t r1) {
  const int64_t blocks = k / kQBlock;
  for (int64_t r = r0; r < r1; ++r)
    quantize_row(x + r * k, k, out.codes + r * k, out.scale + r * blocks, out.sum + r * blocks);
}

template <typename T>
void quantized_groups(const QuantizedWeight& w, const QuantizedRows& x, int64_t m, T* out, int64_t ldo, int64_t g0,
                      int64_t g1) {
  if (w.half_scales) {
    if (w.mins != nullptr) groups_of<T, c10::Half, true>(w, x, m, out, ldo, g0, g1);
    else groups_of<T, c10::Half, false>(w, x, m, out, ldo, g0, g1);
  } else {
    if (w.mins != nullptr) groups_of<T, float, true>(w, x, m, out, ldo, g0, g1);
    else groups_of<T, float, false>(w, x, m, out, ldo, g0, g1);
  }
}

template void quantize_rows<float>(const float*, int64_t, const QuantizedRows&, int64_t, int64_t);
template void quantize_rows<c10::BFloat16>(const c10::BFloat16*, int64_t, const QuantizedRows&, int64_t, int64_t);
template void quantized_groups<float>(const QuantizedWeight&, const QuantizedRows&, int64_t, float*, int64_t,
                                      int64_t, int64_t);
template void quantized_groups<c10::BFloat16>(const QuantizedWeight&, const QuantizedRows&, int64_t,
                                              c10::BFloat16*, int64_t, int64_t, int64_t);

QuantizedWeight QuantizedWeight::of(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor* mins,
                                    const float* bias) {
  return {reinterpret_cast<const uint8_t*>(codes.data_ptr()), scale.data_ptr(),
          mins != nullptr ? mins->data_ptr() : nullptr, scale.scalar_type() == at::kHalf,
          scale.size(1) * kQBlock, scale.size(0), bias};
}

}  // namespace kvops

namespace {

template <typename T>
void product(const at::Tensor& x, const QuantizedWeight& w, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<int8_t> codes(m * k);
  std::vector<float> scales(m * QuantizedRows::floats_per_row(k));
  const QuantizedRows rows = QuantizedRows::over(codes.data(), scales.data(), m, k);
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {  // inline below 16 rows
    quantize_rows(xp, k, rows, begin, end);
  });
  T* op = out.data_ptr<T>();
  at::parallel_for(0, w.groups, 1, [&](int64_t begin, int64_t end) {
    quantized_groups(w, rows, m, op, out.size(1), begin, end);
  });
}

}  // namespace

// x [M, K] (float32 or bfloat16) times a quantized weight: q8 when codes are int8, q4 (with mins) when uint8.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "quantized_linear needs x [M, K]");
  const bool q4 = codes.scalar_type() == at::kByte;
  TORCH_CHECK(q4 == mins.has_value(), "quantized_linear: q4 (uint8) codes come with mins, q8 (int8) without");
  TORCH_CHECK(q4 || codes.scalar_type() == at::kChar, "quantized_linear: codes must be int8 or uint8");
  TORCH_CHECK(scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kFloat, "scales: float16 or float32");
  TORCH_CHECK(codes.is_contiguous() && scale.is_contiguous() && scale.dim() == 3 && scale.size(2) == kCols,
              "quantized_linear: weight is not in the interleaved layout");
  const int64_t k = x.size(1), n = scale.size(0) * kCols;
  TORCH_CHECK(scale.size(1) * kQBlock == k, "quantized_linear: x has ", k, " features, the weight ",
              scale.size(1) * kQBlock);
  TORCH_CHECK(codes.numel() == n * k / (q4 ? 2 : 1), "quantized_linear: codes do not match the scales");
  if (q4) TORCH_CHECK(mins->sizes() == scale.sizes() && mins->scalar_type() == scale.scalar_type(), "mins mismatch");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == n, "quantized_linear: bias must be [N]");
  }
  auto xc = x.contiguous();
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  const at::Tensor* mp = mins.has_value() ? &*mins : nullptr;
  const QuantizedWeight w = QuantizedWeight::of(codes, scale, mp, bias.has_value() ? b.data_ptr<float>() : nullptr);
  if (x.scalar_type() == at::kFloat) product<float>(xc, w, out);
  else if (x.scalar_type() == at::kBFloat16) product<c10::BFloat16>(xc, w, out);
  else TORCH_CHECK(false, "quantized_linear: activations must be float32 or bfloat16");
  return out;
}

namespace {

// Rows of the float weight from the interleaved layout: w[n, k] = code * scale (+ min), rounded as
// the reference dequantization rounds (a float product, then a float sum).
template <typename T, typename S>
void rows_of(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor* mins, const int64_t* index,
             int64_t count, int64_t k, T* out) {
  const int64_t blocks = k / kQBlock;
  const bool q4 = mins != nullptr;
  const int64_t group_bytes = k * kCols / (q4 ? 2 : 1);
  const auto* code_p = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const S* scale_p = static_cast<const S*>(scale.data_ptr());
  const S* min_p = q4 ? static_cast<const S*>(mins->data_ptr()) : nullptr;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t group = index[r] / kCols, lane = index[r] % kCols;
    const uint8_t* gc = code_p + group * group_bytes;
    T* row = out + r * k;
    for (int64_t kk = 0; kk < k; ++kk) {
      const int64_t b = kk / kQBlock;
      const float sc = static_cast<float>(scale_p[(group * blocks + b) * kCols + lane]);
      float v;
      if (q4) {  // byte [k / 8, lane, k % 4] holds k % 8 < 4 in its low nibble, the rest in its high one
        const uint8_t byte = gc[((kk / 8) * kCols + lane) * 4 + kk % 4];
        const float code = static_cast<float>(kk % 8 < 4 ? byte & 0x0F : byte >> 4);
        v = code * sc + static_cast<float>(min_p[(group * blocks + b) * kCols + lane]);
      } else {
        v = static_cast<float>(static_cast<int8_t>(gc[((kk / 4) * kCols + lane) * 4 + kk % 4])) * sc;
      }
      row[kk] = static_cast<T>(v);
    }
  }
}

}  // namespace

// Rows `index` of a q8 / q4 weight in the interleaved layout, dequantized: an embedding lookup
// through a tied quantized LM head, without a float copy of the table.
at::Tensor quantized_rows(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                          const at::Tensor& index, at::ScalarType dtype) {
  const bool q4 = codes.scalar_type() == at::kByte;
  TORCH_CHECK(q4 == mins.has_value() && (q4 || codes.scalar_type() == at::kChar),
              "quantized_rows: q4 (uint8) codes come with mins, q8 (int8) without");
  TORCH_CHECK(codes.is_contiguous() && scale.is_contiguous() && scale.dim() == 3 && scale.size(2) == kCols &&
                  (scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kFloat),
              "quantized_rows: weight is not in the interleaved layout");
  const int64_t n = scale.size(0) * kCols, k = scale.size(1) * kQBlock;
  TORCH_CHECK(codes.numel() == n * k / (q4 ? 2 : 1), "quantized_rows: codes do not match the scales");
  if (q4)
    TORCH_CHECK(mins->sizes() == scale.sizes() && mins->scalar_type() == scale.scalar_type() && mins->is_contiguous(),
                "quantized_rows: mins mismatch");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quantized_rows: rows are float32 or bfloat16");
  const at::Tensor idx = index.to(at::kLong).contiguous().view({-1});
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < idx.numel(); ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < n, "quantized_rows: index ", ip[r], " out of range for ", n, " rows");
  at::Tensor out = at::empty({idx.numel(), k}, scale.options().dtype(dtype));
  const at::Tensor* mp = q4 ? &*mins : nullptr;
  const bool half = scale.scalar_type() == at::kHalf;
  if (dtype == at::kFloat) {
    if (half) rows_of<float, c10::Half>(codes, scale, mp, ip, idx.numel(), k, out.data_ptr<float>());
    else rows_of<float, float>(codes, scale, mp, ip, idx.numel(), k, out.data_ptr<float>());
  } else {
    auto* op = out.data_ptr<c10::BFloat16>();
    if (half) rows_of<c10::BFloat16, c10::Half>(codes, scale, mp, ip, idx.numel(), k, op);
    else rows_of<c10::BFloat16, float>(codes, scale, mp, ip, idx.numel(), k, op);
  }
  return out;
}

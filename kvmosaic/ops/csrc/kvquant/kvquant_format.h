// The quantized KV cache's record format as the kernels see it: modes, the per-record layout
// (kvmosaic/quant/format.py and kvmosaic/quant/oaken.py), the layer's Oaken thresholds, fp16
// helpers with the PyTorch reference's rounding, and the extension's entry points. Shared by
// kvquant_encode.cpp (quantize-and-write), kvquant_decode.cpp (dequantization, scalar decode
// attention) and kvquant_decode_fast.cpp (vector decode attention).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common/paged.h"
#include "isa/vec.h"
#include <c10/util/Half.h>
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

inline Format make_format(int64_t mode, int64_t hk, int64_t d, int64_t capacity, int64_t record) {
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

inline Thresholds read_thresholds(const at::Tensor& t) {
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

inline void check_pool(const at::Tensor& pool, const Format& f) {
  TORCH_CHECK(pool.scalar_type() == at::kByte && pool.is_contiguous() && pool.dim() == 3,
              "quantized KV pool must be contiguous uint8 [num_blocks, block_size, record_bytes]");
  TORCH_CHECK(pool.size(2) == f.record, "pool record size does not match the format");
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

// Where a partial attention goes instead of the output (DistAttention, one holder's keys): per query
// row (sequence * hq + head) the float32 output normalised over these keys, the softmax reference and
// the sum of exp(score - reference); a row with no keys gets 0, -inf and 0.
struct PartialOut {
  float* out;
  float* ref;
  float* sum;
};

template <typename T>
DecodeBatch<T> decode_batch(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& tables, const at::Tensor& lens, const Format& f, at::Tensor& out) {
  return {q.size(0), q.size(1), q.size(1) / f.hk, tables.size(1), k_pool.size(1), q.data_ptr<T>(), out.data_ptr<T>(),
          k_pool.data_ptr<uint8_t>(), v_pool.data_ptr<uint8_t>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>()};
}

// Vector decode attention (kvquant_decode_fast.cpp); false when it does not apply (a head_dim
// other than 64 / 128, or Oaken head_dim 64 lists longer than 16 entries).
template <typename T>
bool decode_attention_fast(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& tables, const at::Tensor& lens, const Format& f, const Thresholds& kt,
                           const Thresholds& vt, double scale, at::Tensor& out, const PartialOut* partial);

}  // namespace kvquant

// The extension's entry points (kvquant_ops.cpp binds them).
int64_t quant_write(const at::Tensor& k, const at::Tensor& v, at::Tensor k_pool, at::Tensor v_pool,
                    const at::Tensor& slot_mapping, int64_t mode, int64_t hk, int64_t d, int64_t capacity,
                    const at::Tensor& k_thresholds, const at::Tensor& v_thresholds, const at::Tensor& k_center);
at::Tensor dequantize_blocks(const at::Tensor& pool, const at::Tensor& block_ids, int64_t mode, int64_t hk,
                             int64_t d, int64_t capacity, const at::Tensor& thresholds, at::ScalarType dtype);
at::Tensor quant_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t mode,
                                  int64_t hk, int64_t capacity, const at::Tensor& k_thresholds,
                                  const at::Tensor& v_thresholds, double scale);
std::vector<at::Tensor> quant_decode_attention_partial(const at::Tensor& q, const at::Tensor& k_pool,
                                                       const at::Tensor& v_pool, const at::Tensor& block_tables,
                                                       const at::Tensor& context_lens, int64_t mode, int64_t hk,
                                                       int64_t capacity, const at::Tensor& k_thresholds,
                                                       const at::Tensor& v_thresholds, double scale);

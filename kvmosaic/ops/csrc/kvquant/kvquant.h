// The quantized-KV kernels' entry points, without the PyTorch headers: the record format's
// parameters, the layer's Oaken thresholds and one call's rows as plain pointers and sizes. The
// binding file (bind/kvquant_ops.cpp) checks and allocates the tensors and calls these; so does the
// decode lane's quantized pool (distributed/native/kvquant_lane.cpp).
#pragma once

#include <cstdint>

#include "common/check.h"

namespace kvquant {

enum Mode : int64_t { kInt8 = 0, kInt4 = 1, kOaken = 2, kBf16 = 3 };  // kBf16: the values as bfloat16
constexpr int64_t kIntHeader = 4;
constexpr int64_t kOakenHeader = 8;

// The element type of the rows a call reads or writes (K/V rows, queries, dequantized blocks).
enum class Rows : int32_t { kFloat32 = 0, kBFloat16 = 1 };

// Row-0 tails (Oaken, head_dim 64 / 128): every record of a block carries `tail` bytes after its own
// `body`, and the block's tails together hold an int8 record (the int8 format's codec) of the block's
// row 0, which readers take instead of that row's Oaken record. A block stays block_size records, so
// whatever moves blocks moves the tails with them (kvmosaic/quant/format.py).
struct Format {
  int64_t mode, hk, d, capacity, record;
  int64_t code_bytes, index_bits, entry_bytes, sparse_bytes, sparse_offset;
  int64_t block_size = 0, body = 0, tail = 0;  // tail 0: no row-0 tails (body == record)
};

// Bytes of an int8 record of hk heads of d values, and the tail each of a block's records carries to
// hold one.
inline int64_t int8_record_bytes(int64_t hk, int64_t d) { return hk * (kIntHeader + d); }
inline int64_t row0_tail_bytes(int64_t hk, int64_t d, int64_t block_size) {
  return (int8_record_bytes(hk, d) + block_size - 1) / block_size;
}

// The layout of a record of hk heads of d values in `mode`; record is the pools' last dimension,
// checked against it: an Oaken record with head_dim 64 / 128 is either plain or carries row-0 tails
// for the pools' block_size.
inline Format make_format(int64_t mode, int64_t hk, int64_t d, int64_t capacity, int64_t record,
                          int64_t block_size) {
  KV_CHECK(mode >= kInt8 && mode <= kBf16, "unknown KV quantization mode ", mode);
  KV_CHECK(d >= 2 && d % 2 == 0, "head_dim must be even");
  Format f{mode, hk, d, capacity, record, 0, 0, 0, 0, 0};
  f.code_bytes = mode == kBf16 ? 2 * d : mode == kInt8 ? d : d / 2;
  int64_t bits = 1;
  while ((int64_t{1} << bits) < d) ++bits;
  f.index_bits = bits;
  f.entry_bytes = bits + 2 <= 8 ? 1 : 2;
  f.sparse_bytes = 1 + capacity * f.entry_bytes;
  f.sparse_offset = kOakenHeader * hk + hk * f.code_bytes;
  f.block_size = block_size;
  int64_t expected = hk * ((mode == kBf16 ? 0 : kIntHeader) + f.code_bytes);
  if (mode == kOaken) {
    const int64_t body = f.sparse_offset + hk * f.sparse_bytes;
    expected = body + body % 2;
    if (record != expected && (d == 64 || d == 128) && block_size > 0) {
      const int64_t tail = row0_tail_bytes(hk, d, block_size);
      if (record == body + tail + (body + tail) % 2) f.body = body, f.tail = tail, expected = record;
    }
  }
  KV_CHECK(record == expected, "record size ", record, " does not match the format (", expected, ")");
  if (f.tail == 0) f.body = record;
  return f;
}

// The int8 format of a block's row-0 record.
inline Format row0_format(const Format& f) {
  return make_format(kInt8, f.hk, f.d, 0, int8_record_bytes(f.hk, f.d), 0);
}

// A layer's Oaken thresholds (all zero for int8 / int4).
struct Thresholds {
  float outer_lo = 0.f, inner_lo = 0.f, inner_hi = 0.f, outer_hi = 0.f;
};

// (outer_lo, inner_lo, inner_hi, outer_hi) from four floats; none (nullptr): zeros.
inline Thresholds thresholds_of(const float* four) {
  return four == nullptr ? Thresholds{} : Thresholds{four[0], four[1], four[2], four[3]};
}

// New K/V rows [rows, hk, d] (contiguous, in `type`) and the pool slots [rows] their records go to.
struct NewRows {
  const void* k;
  const void* v;
  Rows type;
  int64_t rows;
  const int64_t* slots;
};

// One decode-attention call: queries [batch, hq, d] (contiguous, in `type`), each over the records
// its block table [batch, width] names, up to its context length; pools [*, block_size, record].
struct DecodeCall {
  const void* q;
  Rows type;
  int64_t batch, hq, width, block_size;
  const uint8_t* k_pool;
  const uint8_t* v_pool;
  const int64_t* tables;
  const int64_t* lens;
  double scale;
};

// Where a partial attention goes instead of the output (DistAttention, one holder's keys): per query
// row (sequence * hq + head) the float32 output normalised over these keys, the softmax reference and
// the sum of exp(score - reference); a row with no keys gets 0, -inf and 0.
struct PartialOut {
  float* out;
  float* ref;
  float* sum;
};

// Quantizes the rows and writes their records; K rows are encoded with k_center [hk, d] subtracted
// (nullptr: none). Returns the Oaken outliers folded into the middle group (0 for int8 / int4).
int64_t write_rows(const NewRows& rows, uint8_t* k_pool, uint8_t* v_pool, const Format& f, const Thresholds& kt,
                   const Thresholds& vt, const float* k_center);

// The records of whole blocks: pool [*, block_size, record], block_ids [n] -> out [n, block_size, hk, d] in `type`.
void dequantize(const uint8_t* pool, int64_t block_size, const int64_t* block_ids, int64_t n, const Format& f,
                const Thresholds& t, void* out, Rows type);

// Decode attention over the records in place: into out [batch, hq, d] in the queries' type, or, when
// partial is given, into it (out is then not written and may be null).
void decode_attention(const DecodeCall& call, const Format& f, const Thresholds& kt, const Thresholds& vt, void* out,
                      const PartialOut* partial);

// Oaken's key rotation of rows [rows, heads, d] (d a power of two): head h belongs to group
// h / (heads / groups), whose weight [d] (and center [d], when not null) it takes; see
// kvquant_rotate.cpp.
struct RotateCall {
  int64_t rows, heads, d, groups;
  const float* weight;
  const float* center;
};
void rotate_heads(const RotateCall& call, const void* x, Rows in_type, void* out, Rows out_type);
// n values in `type` to float32 (exact).
void widen_rows(const void* x, Rows type, int64_t n, float* out);

}  // namespace kvquant

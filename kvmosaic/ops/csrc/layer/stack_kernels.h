// The kernels of a decoder layer in their range form: each computes items [begin, end) of its work
// from raw pointers, with no allocation of tensors and nothing that throws. The whole-call entry points
// (linear/linear.h, attention/attention.h, layer/layer.h) run them under kvops::parallel_for; the layer
// stack runs them in one team of threads (team.h). Sizes and dtypes are checked by the callers (the
// binding side builds PackedWeight and QuantizedWeight from checked tensors: bind/float_ops.h).
#pragma once

#include "common/ops_common.h"

#include <algorithm>
#include <vector>

namespace kvops {

// ---- linears on packed float weights (gemm.cpp): a work item is a panel of output columns
struct PackedWeight {
  const void* data;   // [blocks, K * 16] in the packed layout, float32 or bfloat16 (as the activations)
  int64_t blocks, k;  // 16-column blocks, input features
  bool swiglu;        // a packed gate/up pair: silu(gate) * up leaves the product
  const float* bias;  // [width] or null
  int64_t panels() const;
  int64_t blocks_per_panel() const;
  int64_t width() const;  // output columns
};

template <typename T>
void packed_panels(const PackedWeight& w, const T* x, int64_t m, T* out, int64_t p0, int64_t p1);

// ---- linears on quantized weights (qlinear.cpp): a work item is a group of 16 output columns
struct QuantizedRows {  // m activation rows quantized to int8 per 32 values
  int8_t* codes;        // [m, K]
  float* scale;         // [m, K / 32]
  float* sum;           // [m, K / 32]: scale * sum of the block's codes
  float* half_sum;      // [m, K / 16]: sum of each 16 codes (an exact integer; q6's unsigned dots subtract it)
  // the rows' scales and sums in one buffer of m * floats_per_row(k) floats
  static QuantizedRows over(int8_t* codes, float* floats, int64_t m, int64_t k);
  static int64_t floats_per_row(int64_t k);
};

struct QuantizedWeight {
  const uint8_t* codes;
  const void* scale;         // float16 or float32 [groups, K / 32, 16]; q6: int8 [groups, K / 16, 16];
                             // q4k: uint8 [groups, K / 16, 16], per 32 k the columns' sc, then their m
  const void* mins;          // like scale, q4 only (null for q8, q6 and q4k)
  const float* super_scale;  // q6 only: [groups, K / 256, 16]
  bool half_scales;
  int64_t k, groups;
  const float* bias;  // [groups * 16] or null
  // q4k only: [groups, K / 128, 16], per 256 k the columns' d, then their -dmin (w = d sc q + (-dmin) m)
  const kvmosaic_vec::half* q4k_supers = nullptr;
  // a composite (a fused product whose parts differ in kind): part_count weights stacked along the
  // output columns, each of its own kind and with its own bias pointer (into this one's); of this one
  // only k, groups (the parts' total) and bias are read
  const QuantizedWeight* parts = nullptr;
  int64_t part_count = 0;
  bool composite() const { return part_count > 0; }
  bool nibbles() const { return mins != nullptr || q4k_supers != nullptr; }  // q4 or q4k codes
  int64_t group_code_bytes() const;   // codes of one group of 16 columns
  int64_t group_scale_bytes() const;  // scales (and as many mins) of one group
};

// f(part, first, lo, hi) for each part of w holding some of groups [g0, g1): first is the part's first
// group in w, [lo, hi) the part's own groups of the range. A plain weight is its own one part.
template <typename F>
void for_parts(const QuantizedWeight& w, int64_t g0, int64_t g1, F&& f) {
  if (!w.composite()) {
    if (g0 < g1) f(w, int64_t{0}, g0, g1);
    return;
  }
  int64_t first = 0;
  for (int64_t i = 0; i < w.part_count && first < g1; ++i) {
    const QuantizedWeight& part = w.parts[i];
    const int64_t lo = std::max<int64_t>(g0 - first, 0), hi = std::min<int64_t>(g1 - first, part.groups);
    if (lo < hi) f(part, first, lo, hi);
    first += part.groups;
  }
}

template <typename T>
void quantize_rows(const T* x, int64_t k, const QuantizedRows& out, int64_t r0, int64_t r1);

// rows [r0, r1) of float32 x [., k] rounded to bf16 into out (k % 16 == 0): the rows of a product on
// the AMX tiles (amx.h)
void bf16_rows(const float* x, int64_t k, kvmosaic_vec::bf16* out, int64_t r0, int64_t r1);

template <typename T>
void quantized_groups(const QuantizedWeight& w, const QuantizedRows& x, int64_t m, T* out, int64_t ldo, int64_t g0,
                      int64_t g1);

// rows `index` of a quantized weight dequantized into out [count, K] (the values quantized_rows gives)
template <typename T>
void dequantize_rows(const QuantizedWeight& w, const int64_t* index, int64_t count, T* out);

// ---- greedy sampling (sample_ops.cpp): a row's argmax from the argmax of consecutive column ranges
struct ArgmaxPart {
  int64_t index;  // -1 for an empty range
  float value;
  bool nan;       // index is the range's first NaN (which torch.argmax counts as the largest)
};
template <typename T>
ArgmaxPart argmax_part(const T* x, int64_t begin, int64_t end);
// the row's argmax from the parts of its consecutive column ranges, lowest first: parts[0],
// parts[stride], ... parts[(count - 1) * stride]
int64_t merged_argmax(const ArgmaxPart* parts, int64_t count, int64_t stride);

// ---- per-layer kernels around attention (layer_ops.cpp)
template <typename T>
struct RopeStep {  // rotary of q and k of a fused qkv projection, k and v written to their cache slots
  const T* qkv;
  int64_t row_stride;
  const int64_t* positions;
  const int64_t* slots;
  const float* cos;
  const float* sin;
  T* k_cache;
  T* v_cache;
  T* q_out;  // [N, hq, head_dim]
  int64_t hq, hk, head_dim;
  // a work item is one head of one row, in the order v (copied to its slot), q (rotated), k (rotated
  // into its slot): a contiguous split gives each thread its part of the cache writes
  int64_t items(int64_t rows) const { return rows * (hq + 2 * hk); }
  // the cache line of item i's write that holds byte `offset` of its head, or null for a q head
  const char* slot_line(int64_t item, int64_t offset) const;
};

template <typename T>
void rope_items(const RopeStep<T>& step, int64_t i0, int64_t i1);

// rows [r0, r1): residual += delta (when not null), out = rms_norm(residual) * weight
template <typename T>
void norm_rows(T* residual, const T* delta, const T* weight, T* out, int64_t h, float eps, int64_t r0, int64_t r1);

// silu(gate) * up of [rows, 2F] into [rows, F]; silu_work(rows, F) items of up to 256 columns of a row
int64_t silu_work(int64_t rows, int64_t f);
template <typename T>
void silu_items(const T* gate_up, int64_t f, T* out, int64_t i0, int64_t i1);
// the same for columns [c0, c1) of every one of `rows` rows
template <typename T>
void silu_columns(const T* gate_up, int64_t f, T* out, int64_t rows, int64_t c0, int64_t c1);

// ---- decode attention (decode_attention.cpp)
// The register kernel's unit of work is one segment (attention/row_attention.h: kSegment tokens) of a
// sequence's context; a work item is a unit's KV heads, all of them, or one each when there are fewer
// units than threads (the arithmetic of a head is the same either way). The generic loop's item (other
// head sizes) is one KV head of a sequence. The segments are fixed by the context lengths alone, so a
// row's result does not depend on how the items are cut or shared. When some sequence has more than
// one segment, every item leaves its partial sums in `partials` (partial_floats() floats) and
// merge_items(), after a barrier, writes the output: batch * hq items.
struct AttentionWork {
  int64_t items = 0;
  bool per_head = false;       // an item is one KV head of a sequence (the generic loop), not a segment
  bool partial = false;        // items leave partial sums, merged after
  int64_t head_groups = 1;     // items per unit: its KV heads in groups of heads_per_item
  int64_t heads_per_item = 0;
  std::vector<int64_t> first;  // register kernel: sequence b's units are [first[b], first[b + 1])
  int64_t batch() const { return static_cast<int64_t>(first.size()) - 1; }
  int64_t units() const { return first.back(); }
  int64_t segments_of(int64_t b) const { return first[b + 1] - first[b]; }
  int64_t partial_floats(int64_t hq, int64_t head_dim) const {
    return partial ? units() * hq * (head_dim + 2) : 0;
  }
  int64_t merge_items(int64_t batch, int64_t hq) const { return partial ? batch * hq : 0; }
  // the sequence an item belongs to
  int64_t row_of(int64_t item, int64_t hk) const {
    if (per_head) return item / hk;
    const int64_t unit = item / head_groups;
    return static_cast<int64_t>(std::upper_bound(first.begin(), first.end(), unit) - first.begin()) - 1;
  }
  // the item that reads the newest token (the last of lens[b]) of sequence b's KV head kh
  int64_t newest_item(const int64_t* lens, int64_t b, int64_t hk, int64_t kh) const;
};
// The items of a call over `batch` sequences of context lengths lens for `threads` threads;
// force_partial: partial sums even when every context is one segment.
AttentionWork decode_attention_work(const int64_t* lens, int64_t batch, int64_t hk, int64_t head_dim, int threads,
                                    bool force_partial = false);
// The most floats partial_floats() can ask of a call whose contexts hold at most max_context tokens
int64_t max_partial_floats(int64_t batch, int64_t hq, int64_t head_dim, int64_t max_context);
template <typename T>
void decode_attention_items(const DecodeBatch<T>& batch, double scale, const AttentionWork& work, float* partials,
                            int64_t i0, int64_t i1);
template <typename T>
void merge_attention_splits(const DecodeBatch<T>& batch, const AttentionWork& work, const float* partials,
                            int64_t i0, int64_t i1);

}  // namespace kvops

// The attention kernels' whole-call entry points over the paged float KV cache, without the PyTorch
// headers. T: float or kvmosaic_vec::bf16. Shapes and dtypes are checked by the caller (the binding
// side); the caches are contiguous [blocks, block_size, kv_heads, head_dim].
#pragma once

#include "common/ops_common.h"

#include <cstdint>

namespace kvops {

// One query token per sequence of the batch, over its context read from the blocks in place; the
// result goes to batch.out.
template <typename T>
void decode_attention(const DecodeBatch<T>& batch, double scale);

// The same attention as a float32 partial to merge with other holders' (batch.out unused):
// out [batch, hq, head_dim] normalised over these keys, row_max [batch, hq] a reference at or below
// the scaled scores' max, sum_exp [batch, hq] the sum of exp(score - reference). A row without keys
// gives 0, -inf and 0. head_dim 64 or 128.
template <typename T>
void decode_attention_partial(const DecodeBatch<T>& batch, double scale, float* out, float* row_max,
                              float* sum_exp);

// Partials of the same `rows` query rows of `head_dim` (a multiple of 16) over disjoint keys,
// combined exactly into merged [rows, head_dim]: outs[p], refs[p] and sums[p] are holder p's.
void merge_attention_partials(const float* const* outs, const float* const* refs, const float* const* sums,
                              int64_t parts, int64_t rows, int64_t head_dim, float* merged);

// Causal attention of a prefill chunk: n query tokens q [n, hq, head_dim] at positions
// [context_len - n, context_len) over a context of context_len tokens in the blocks of `table`;
// out [n, hq, head_dim]. head_dim 64 or 128; hq a multiple of hk.
template <typename T>
struct PrefillChunk {
  const T* q;
  int64_t n, hq;
  const T* k_cache;
  const T* v_cache;
  int64_t block_size, hk, head_dim;
  const int64_t* table;
  int64_t context_len;
  T* out;
};

template <typename T>
void prefill_attention(const PrefillChunk<T>& chunk, double scale);

}  // namespace kvops

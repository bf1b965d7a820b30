// Shared by the float KV-cache kernels: dtype helpers, the cache layout check, and the extension's
// entry points (kvmosaic_ops.cpp binds them; layer_ops.cpp, gemm.cpp, decode_attention.cpp and
// prefill_attention.cpp define them).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common/paged.h"
#include "isa/vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace kvops {

inline float to_float(float x) { return x; }
inline float to_float(kvmosaic_vec::bf16 x) { return static_cast<float>(x); }

template <typename T>
inline void store(T* dst, float x) { *dst = static_cast<T>(x); }

inline void check_cache(const at::Tensor& cache, const at::Tensor& like) {
  TORCH_CHECK(cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(cache.scalar_type() == like.scalar_type(), "KV cache dtype must match activations");
  TORCH_CHECK(cache.dim() == 4, "KV cache must be [num_blocks, block_size, kv_heads, head_dim]");
}

// Prefill attention work item -> (KV head, block of query rows). A causal row block costs in
// proportion to its position and parallel_for gives each thread one contiguous range of items, so
// consecutive items alternate between the cheapest and the dearest remaining row blocks: every range
// gets a fair share (in head-major order the thread holding the last rows did ~1.4x the other's work).
inline void balanced_item(int64_t item, int64_t hk, int64_t row_blocks, int64_t* h, int64_t* rb) {
  const int64_t i = item / hk;
  *h = item % hk;
  *rb = i % 2 == 0 ? i / 2 : row_blocks - 1 - i / 2;
}

// One decode-attention call's tensors as sizes and raw pointers (both decode kernels unpack it).
template <typename T>
struct DecodeBatch {
  int64_t batch, hq, hk, group, width, block_size;
  const T* q;
  const T* k;
  const T* v;
  const int64_t* tables;
  const int64_t* lens;
  T* out;
  int64_t head_dim;
};

// A tensor's data as T*; bfloat16 tensors as kvmosaic_vec::bf16 (the same bits as c10::BFloat16).
template <typename T>
T* data_of(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, kvmosaic_vec::bf16>) return reinterpret_cast<T*>(t.data_ptr<c10::BFloat16>());
  else return t.data_ptr<T>();
}

template <typename T>
DecodeBatch<T> decode_batch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out) {
  return {q.size(0), q.size(1), k_cache.size(2), q.size(1) / k_cache.size(2), block_tables.size(1), k_cache.size(1),
          data_of<T>(q), data_of<T>(k_cache), data_of<T>(v_cache), block_tables.data_ptr<int64_t>(),
          context_lens.data_ptr<int64_t>(), data_of<T>(out), q.size(2)};
}

}  // namespace kvops

at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_table,
                          const at::Tensor& sin_table, at::Tensor k_cache, at::Tensor v_cache,
                          const at::Tensor& slot_mapping, int64_t hq, int64_t hk);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);
std::vector<at::Tensor> paged_decode_attention_partial(const at::Tensor& q, const at::Tensor& k_cache,
                                                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                       const at::Tensor& context_lens, double scale);
at::Tensor merge_attention_partials(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& refs,
                                    const std::vector<at::Tensor>& sums);
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, int64_t context_len, double scale,
                                   const c10::optional<at::Tensor>& out);
at::Tensor argmax_rows(const at::Tensor& logits);
at::Tensor add_rms_norm(at::Tensor residual, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps);
bool packed_linear_supports(at::ScalarType dtype, int64_t out_features, int64_t in_features);
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
bool packed_swiglu_supports(at::ScalarType dtype, int64_t intermediate, int64_t in_features);
at::Tensor pack_swiglu_weight(const at::Tensor& gate_up);
at::Tensor packed_swiglu(const at::Tensor& x, const at::Tensor& packed);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
// qlinear.cpp: linears on quantized (q8 / q4 / q6) weights in the interleaved layout of kvmosaic/quant/weights.py;
// extra: q4's mins, q6's super-block scales.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& extra, const c10::optional<at::Tensor>& bias);
at::Tensor quantized_rows(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& extra,
                          const at::Tensor& index, at::ScalarType dtype);

// The float extension's tensor-facing side: the tensor checks and views its wrappers share, and the
// entry points Python calls (defined in bind/linear_bind.h, bind/attention_bind.h, bind/layer_bind.h).
// Binding code only: included by bind/kvmosaic_ops.cpp and the headers it includes.
#pragma once

#include "bind/bindings.h"
#include "common/ops_common.h"
#include "layer/stack_kernels.h"

#include <type_traits>
#include <vector>

namespace kvops {

// A tensor's data as T*; bfloat16 tensors as kvmosaic_vec::bf16 (the same bits as c10::BFloat16).
template <typename T>
T* data_of(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, kvmosaic_vec::bf16>) return reinterpret_cast<T*>(t.data_ptr<c10::BFloat16>());
  else return t.data_ptr<T>();
}

inline void check_cache(const at::Tensor& cache, const at::Tensor& like) {
  TORCH_CHECK(cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(cache.scalar_type() == like.scalar_type(), "KV cache dtype must match activations");
  TORCH_CHECK(cache.dim() == 4, "KV cache must be [num_blocks, block_size, kv_heads, head_dim]");
}

template <typename T>
DecodeBatch<T> decode_batch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out) {
  return {q.size(0), q.size(1), k_cache.size(2), q.size(1) / k_cache.size(2), block_tables.size(1), k_cache.size(1),
          data_of<T>(q), data_of<T>(k_cache), data_of<T>(v_cache), block_tables.data_ptr<int64_t>(),
          context_lens.data_ptr<int64_t>(), data_of<T>(out), q.size(2)};
}

// A packed float weight ([blocks, K * 16], pack_linear_weight / pack_swiglu_weight) as the kernels take it.
PackedWeight packed_weight(const at::Tensor& packed, bool swiglu, const float* bias);

// A quantized weight in the interleaved layout, checked: the kind follows the dtypes (q6: int8 scales;
// q4k: uint8 scales; q4: uint8 codes; q8: int8 codes); extra is q4's mins or q6's / q4k's super-block
// scales, null for q8; `who` names the caller in errors.
QuantizedWeight quantized_weight(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor* extra,
                                 const float* bias, const char* who);

// A composite weight from its parts' (codes, scales, extra) back to back, extra empty for q8 (bind/linear_bind.h)
QuantizedWeight composite_weight(const std::vector<at::Tensor>& tensors, const float* bias, const char* who,
                                 std::vector<QuantizedWeight>& parts);

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
// linears on quantized (q8 / q4 / q6) weights in the interleaved layout of kvmosaic/quant/weights.py;
// extra: q4's mins, q6's and q4k's super-block scales.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& extra, const c10::optional<at::Tensor>& bias);
at::Tensor quantized_linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& parts,
                                  const c10::optional<at::Tensor>& bias);
at::Tensor quantized_rows(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& extra,
                          const at::Tensor& index, at::ScalarType dtype);

// A decode step through the whole stack of decoder layers in one call. Each layer is the same kernel
// sequence the Python model runs (residual add + RMSNorm, qkv, rotary + cache write, paged decode
// attention, o_proj, add + RMSNorm, gate/up SwiGLU, down_proj; each linear on packed float or
// quantized weights), with the same roundings, so the result is bit-identical; what goes away is the interpreter and dispatch
// work between the ~10 kernels of each layer, a visible share of a single-stream step of a small
// model (its weights stream from memory in a few milliseconds).
#include "ops_common.h"

namespace {
// input norm, qkv (3), qkv bias, o (3), post norm, gate/up (3), down (3); a linear is (weight, scales, mins)
constexpr size_t kPerLayer = 15;

// A packed float weight (empty scales) or a quantized one (int8 / uint8 codes) times x.
at::Tensor linear(const at::Tensor& x, const at::Tensor* w, const c10::optional<at::Tensor>& bias) {
  if (w[1].numel() == 0) return packed_linear(x, w[0], bias);
  return quantized_linear(x, w[0], w[1], w[2].numel() > 0 ? c10::optional<at::Tensor>(w[2]) : c10::nullopt, bias);
}

// The gate/up projection and SwiGLU: fused into the packed float product, after the quantized one.
at::Tensor gated(const at::Tensor& x, const at::Tensor* w) {
  if (w[1].numel() == 0) return packed_swiglu(x, w[0]);
  return silu_and_mul(linear(x, w, c10::nullopt));
}
}  // namespace

// residual [N, hidden] (the embeddings) is updated in place.
// weights: kPerLayer tensors per layer in the order above (an empty tensor for no qkv bias; a packed
// float linear has empty scales and mins, a q8 one empty mins);
// kv_caches: one [2, num_blocks, block_size, hk, head_dim] tensor per layer.
// Returns (residual, delta): the last layer's MLP output is left for the final norm to add.
std::vector<at::Tensor> decode_layers(at::Tensor residual, const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& kv_caches,
                                      const at::Tensor& positions, const at::Tensor& cos_table,
                                      const at::Tensor& sin_table, const at::Tensor& slot_mapping,
                                      const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t hq,
                                      int64_t hk, double eps, double scale) {
  const size_t layers = kv_caches.size();
  TORCH_CHECK(weights.size() == kPerLayer * layers, "decode_layers: ", kPerLayer, " weights per layer, got ",
              weights.size(), " for ", layers, " layers");
  TORCH_CHECK(residual.dim() == 2 && residual.size(0) == block_tables.size(0),
              "decode_layers: one residual row per decode sequence");
  const int64_t n = residual.size(0);
  c10::optional<at::Tensor> carry;  // the previous layer's MLP output, added by the next norm
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + kPerLayer * i;
    const c10::optional<at::Tensor> qkv_bias = w[4].numel() > 0 ? c10::optional<at::Tensor>(w[4]) : c10::nullopt;
    const at::Tensor qkv = linear(add_rms_norm(residual, carry, w[0], eps), w + 1, qkv_bias);
    at::Tensor k_cache = kv_caches[i].select(0, 0), v_cache = kv_caches[i].select(0, 1);
    const at::Tensor q = rope_and_cache(qkv, positions, cos_table, sin_table, k_cache, v_cache, slot_mapping, hq, hk);
    const at::Tensor attn = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale);
    const at::Tensor hidden = add_rms_norm(residual, linear(attn.view({n, -1}), w + 5, c10::nullopt), w[8], eps);
    carry = linear(gated(hidden, w + 9), w + 12, c10::nullopt);
  }
  TORCH_CHECK(carry.has_value(), "decode_layers needs at least one layer");
  return {residual, *carry};
}

// A step through the whole stack of decoder layers in one call. Each layer is the same kernel sequence
// the Python model runs (residual add + RMSNorm, qkv, rotary + cache write, paged attention, o_proj,
// add + RMSNorm, gate/up SwiGLU, down_proj; each linear on packed float or quantized weights), with the
// same roundings, so the result is bit-identical; what goes away is the interpreter and dispatch work
// between the ~10 kernels of each layer, a visible share of a small model's step (its weights stream
// from memory in a few milliseconds). The rows are a batch's single-token decodes first, then spans of
// several tokens of one sequence each (prefill chunks, or a decode verifying speculated tokens).
#include "team/layer_stack.h"

namespace {

using kvops::kPerLayer;

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

// The step's rows' attention: decode rows [0, nd) in one call, then each span over its own table.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, const int64_t* spans,
                  const std::vector<at::Tensor>& span_tables, double scale) {
  const int64_t nd = block_tables.size(0);
  if (span_tables.empty()) return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale);
  at::Tensor out = at::empty_like(q);
  if (nd > 0)
    out.narrow(0, 0, nd).copy_(paged_decode_attention(q.narrow(0, 0, nd), k_cache, v_cache, block_tables,
                                                      context_lens, scale));
  for (size_t s = 0; s < span_tables.size(); ++s) {
    const int64_t start = spans[3 * s], n = spans[3 * s + 1], context = spans[3 * s + 2];
    paged_prefill_attention(q.narrow(0, start, n), k_cache, v_cache, span_tables[s], context, scale,
                            out.narrow(0, start, n));
  }
  return out;
}

}  // namespace

// residual [N, hidden] (the embeddings) is updated in place.
// weights, caches: the decoder layers' (layer_stack.h);
// block_tables / context_lens: the decode rows' ([nd, width] / [nd]; nd may be 0);
// spans: [S, 3] int64 (first row, rows, context length) with span_tables[s] each span's block table.
// keep_rows: the rows that go on past the last layer's attention (the others' K/V are cached and
// nothing reads their output, so their o_proj and MLP are skipped); all rows when not given.
// Returns (residual, delta) of the kept rows: the last layer's MLP output is left for the final norm;
// or, when the weights have a head, [the kept rows' float32 logits] (the final norm and LM head run here).
// A step of decode rows only runs in one team of threads (decode_team.cpp), with the same results.
std::vector<at::Tensor> layer_stack(at::Tensor residual, const kvops::StackWeights& stack_weights,
                                    const kvops::StackCaches& caches, const at::Tensor& positions,
                                    const at::Tensor& cos_table, const at::Tensor& sin_table,
                                    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                    const at::Tensor& context_lens, const at::Tensor& spans,
                                    const std::vector<at::Tensor>& span_tables,
                                    const c10::optional<at::Tensor>& keep_rows, int64_t hq, int64_t hk, double eps,
                                    double scale) {
  const size_t layers = caches.layers();
  TORCH_CHECK(stack_weights.layers() == layers, "layer_stack: weights of ", stack_weights.layers(),
              " layers, KV caches of ", layers);
  TORCH_CHECK(spans.scalar_type() == at::kLong && spans.dim() == 2 && spans.size(1) == 3 && spans.is_contiguous() &&
                  static_cast<size_t>(spans.size(0)) == span_tables.size(),
              "layer_stack: spans must be int64 [S, 3] with one block table each");
  const int64_t n = residual.size(0), nd = block_tables.size(0);
  const int64_t* span_rows = spans.data_ptr<int64_t>();
  int64_t covered = nd;
  for (size_t s = 0; s < span_tables.size(); ++s) {
    TORCH_CHECK(span_rows[3 * s] == covered && span_rows[3 * s + 1] > 0,
                "layer_stack: spans must follow the decode rows back to back");
    covered += span_rows[3 * s + 1];
  }
  TORCH_CHECK(residual.dim() == 2 && covered == n, "layer_stack: the decode rows and spans must cover every row");
  if (span_tables.empty() && n > 0)
    return kvops::decode_team(residual, stack_weights, caches, positions, cos_table, sin_table, slot_mapping,
                              block_tables, context_lens, keep_rows, hq, hk, eps, scale);
  const std::vector<at::Tensor>& weights = stack_weights.tensors();
  const std::vector<at::Tensor>& kv_caches = caches.tensors();
  c10::optional<at::Tensor> carry;  // the previous layer's MLP output, added by the next norm
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + kPerLayer * i;
    const c10::optional<at::Tensor> qkv_bias = w[4].numel() > 0 ? c10::optional<at::Tensor>(w[4]) : c10::nullopt;
    const at::Tensor qkv = linear(add_rms_norm(residual, carry, w[0], eps), w + 1, qkv_bias);
    at::Tensor k_cache = kv_caches[i].select(0, 0), v_cache = kv_caches[i].select(0, 1);
    const at::Tensor q = rope_and_cache(qkv, positions, cos_table, sin_table, k_cache, v_cache, slot_mapping, hq, hk);
    at::Tensor attn = attend(q, k_cache, v_cache, block_tables, context_lens, span_rows, span_tables, scale);
    attn = attn.view({n, -1});
    if (i + 1 == layers && keep_rows.has_value()) {
      attn = attn.index_select(0, *keep_rows);
      residual = residual.index_select(0, *keep_rows);
    }
    const at::Tensor hidden = add_rms_norm(residual, linear(attn, w + 5, c10::nullopt), w[8], eps);
    carry = linear(gated(hidden, w + 9), w + 12, c10::nullopt);
  }
  if (stack_weights.head() == nullptr) return {residual, *carry};
  if (residual.size(0) == 0) return {kvops::empty_logits(stack_weights, residual)};
  const at::Tensor* head = stack_weights.head_tensors().data();
  return {linear(add_rms_norm(residual, carry, head[0], eps), head + 1, c10::nullopt).to(at::kFloat)};
}

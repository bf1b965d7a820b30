// The tensor side of the decode team (team/): StackWeights and StackCaches (the layers' tensors,
// checked once and kept alive, planned into team/layer_stack.h's raw pointers), ops.layer_stack and
// ops.decode_passes (argument checks, the tensors a step returns, the dtype dispatch), and bind_team,
// which registers them. Included by the float extension's binding file only.
//
// ops.layer_stack is a step through the whole stack of decoder layers in one call. Each layer is the
// same kernel sequence the Python model runs (residual add + RMSNorm, qkv, rotary + cache write, paged
// attention, o_proj, add + RMSNorm, gate/up SwiGLU, down_proj; each linear on packed float or
// quantized weights), with the same roundings, so the result is bit-identical; what goes away is the
// interpreter and dispatch work between the ~10 kernels of each layer, a visible share of a small
// model's step (its weights stream from memory in a few milliseconds). The rows are a batch's
// single-token decodes first, then spans of several tokens of one sequence each (prefill chunks, or a
// decode verifying speculated tokens). A step of decode rows only runs in one team of threads
// (team/decode_team.cpp); a step with spans chains the per-kernel tensor entry points.
#pragma once

#include <deque>
#include <memory>
#include <vector>

#include "bind/bindings.h"
#include "bind/parallel_impl.h"  // defines common/parallel.h (run_team's num_threads) in this binding file
#include "bind/float_ops.h"  // the tensor entry points of the other kernels (packed_linear, ...)
#include "team/layer_stack.h"

namespace kvops {

namespace team_ops {

inline StackLinear stack_linear(const at::Tensor* w, const float* bias, bool swiglu) {
  if (w[1].numel() == 0) {
    const PackedWeight p = packed_weight(w[0], swiglu, bias);
    return {false, p, {}, p.k, p.width()};
  }
  const QuantizedWeight q = quantized_weight(w[0], w[1], w[2].numel() > 0 ? &w[2] : nullptr, bias, "layer_stack");
  return {true, {}, q, q.k, q.groups * 16};
}

// A composite quantized product of parts (codes, scales, extra) back to back; `held` keeps its parts.
inline StackLinear composite_linear(const std::vector<at::Tensor>& parts, const float* bias,
                                    std::vector<QuantizedWeight>& held) {
  const QuantizedWeight q = composite_weight(parts, bias, "layer_stack", held);
  return {true, {}, q, q.k, q.groups * 16};
}

inline void check_linear(const at::Tensor* w, at::ScalarType dtype) {
  if (w[1].numel() == 0) {
    TORCH_CHECK(w[0].scalar_type() == dtype && w[0].is_contiguous() && w[0].dim() == 2 && w[0].size(1) % 16 == 0,
                "layer_stack: packed float weights must be in the norms' dtype");
    return;
  }
  quantized_weight(w[0], w[1], w[2].numel() > 0 ? &w[2] : nullptr, nullptr, "layer_stack");
}

}  // namespace team_ops

// What ops.layer_stack takes as weights (Python: ops.StackWeights): the tensors, kept alive, and their plan.
class StackWeights {
 public:
  // kPerLayer tensors per layer in the order of team/layer_stack.h: an empty tensor for no qkv bias; a
  // packed float linear has empty scales and extra, a q8 one an empty extra (q4: its mins, q6: its
  // super-block scales); a float gate/up pair is packed with SwiGLU. head: empty, or the final norm's
  // weight and the LM head as a linear (weight, scales, extra); with it a step returns the kept rows'
  // logits. qkv_parts: empty, or one list per layer: a composite qkv's parts (codes, scales, extra)
  // back to back (its three tensors in the layer's are then not read), or empty for the layer's own.
  explicit StackWeights(std::vector<at::Tensor> tensors, std::vector<at::Tensor> head = {},
                        std::vector<std::vector<at::Tensor>> qkv_parts = {})
      : tensors_(std::move(tensors)), head_tensors_(std::move(head)), qkv_parts_(std::move(qkv_parts)) {
    TORCH_CHECK(!tensors_.empty() && tensors_.size() % kPerLayer == 0, "layer_stack: ", kPerLayer,
                " weights per layer, got ", tensors_.size());
    TORCH_CHECK(qkv_parts_.empty() || qkv_parts_.size() == tensors_.size() / kPerLayer,
                "layer_stack: qkv parts must be one list per layer (or none)");
    if (qkv_parts_.empty()) qkv_parts_.resize(tensors_.size() / kPerLayer);
    dtype_ = tensors_[0].scalar_type();
    TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16, "layer_stack: norms must be float32 or bfloat16");
    const int64_t h = tensors_[0].numel();
    for (size_t i = 0; i < tensors_.size(); i += kPerLayer) {
      const at::Tensor* w = tensors_.data() + i;
      for (int j : {0, 8})
        TORCH_CHECK(w[j].scalar_type() == dtype_ && w[j].is_contiguous() && w[j].numel() == h,
                    "layer_stack: every norm weight must be contiguous, of one dtype and size");
      const std::vector<at::Tensor>& parts = qkv_parts_[i / kPerLayer];
      for (int j : {1, 5, 9, 12})
        if (j != 1 || parts.empty()) team_ops::check_linear(w + j, dtype_);
      const float* qkv_bias = nullptr;
      if (w[4].numel() > 0) qkv_bias = biases_.emplace_back(w[4].to(at::kFloat).contiguous()).data_ptr<float>();
      const bool fused = w[10].numel() == 0;  // a float gate/up pair is packed with SwiGLU
      const StackLayer layer{parts.empty() ? team_ops::stack_linear(w + 1, qkv_bias, false)
                                           : team_ops::composite_linear(parts, qkv_bias, part_plans_.emplace_back()),
                             team_ops::stack_linear(w + 5, nullptr, false),
                             team_ops::stack_linear(w + 9, nullptr, fused),
                             team_ops::stack_linear(w + 12, nullptr, false), w[0].data_ptr(), w[8].data_ptr()};
      if (qkv_bias != nullptr)
        TORCH_CHECK(w[4].numel() == layer.qkv.out, "layer_stack: the qkv bias does not match the projection");
      plan_.add_layer(layer, h);
    }
    if (head_tensors_.empty()) return;
    const at::Tensor* w = head_tensors_.data();
    TORCH_CHECK(head_tensors_.size() == 4 && w[0].scalar_type() == dtype_ && w[0].is_contiguous() && w[0].numel() == h,
                "layer_stack: the head is the final norm's weight (like the layers' norms) and a linear (3 tensors)");
    team_ops::check_linear(w + 1, dtype_);
    plan_.set_head({team_ops::stack_linear(w + 1, nullptr, false), w[0].data_ptr()}, h);
  }
  const std::vector<at::Tensor>& tensors() const { return tensors_; }
  const std::vector<at::Tensor>& head_tensors() const { return head_tensors_; }
  const std::vector<at::Tensor>& qkv_parts(size_t layer) const { return qkv_parts_[layer]; }
  const StackPlan& plan() const { return plan_; }
  const StackHead* head() const { return plan_.head(); }
  size_t layers() const { return plan_.layers(); }
  at::ScalarType dtype() const { return dtype_; }  // of the norms and packed float weights

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<at::Tensor> biases_;  // float32 copies of the qkv biases
  std::vector<at::Tensor> head_tensors_;
  std::vector<std::vector<at::Tensor>> qkv_parts_;
  std::deque<std::vector<QuantizedWeight>> part_plans_;  // the composite qkvs' parts (a deque: never moved)
  StackPlan plan_;
  at::ScalarType dtype_;
};

// What ops.layer_stack takes as KV caches (Python: ops.StackCaches): the tensors, kept alive, and their halves.
class StackCaches {
 public:
  // One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer.
  explicit StackCaches(std::vector<at::Tensor> caches) : caches_(std::move(caches)) {
    TORCH_CHECK(!caches_.empty(), "layer_stack needs at least one layer's KV cache");
    for (at::Tensor& cache : caches_) {
      TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() &&
                      cache.sizes() == caches_[0].sizes() && cache.scalar_type() == caches_[0].scalar_type() &&
                      (cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16),
                  "layer_stack: KV caches must be contiguous float32 / bfloat16 [2, blocks, block_size, kv_heads, "
                  "head_dim], all alike");
      kv_.k.push_back(cache.select(0, 0).data_ptr());
      kv_.v.push_back(cache.select(0, 1).data_ptr());
    }
    kv_.block_size = caches_[0].size(2);
    kv_.kv_heads = caches_[0].size(3);
    kv_.head_dim = caches_[0].size(4);
  }
  const std::vector<at::Tensor>& tensors() const { return caches_; }
  const StackKv& kv() const { return kv_; }
  size_t layers() const { return caches_.size(); }
  at::ScalarType dtype() const { return caches_[0].scalar_type(); }

 private:
  std::vector<at::Tensor> caches_;
  StackKv kv_;
};

namespace team_ops {

// [0, vocab] float32 logits: a step that keeps no row past the last attention.
inline at::Tensor empty_logits(const StackWeights& weights, const at::Tensor& like) {
  return at::empty({0, weights.head()->linear.out}, like.options().dtype(at::kFloat));
}

// What a step of decode rows needs of its inputs (the checks that can fail; the caller's checks aside).
inline void check_decode_rows(const at::Tensor& residual, const StackWeights& weights, const StackCaches& caches,
                              const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
                              const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                              const at::Tensor& context_lens, int64_t hq, int64_t hk) {
  const int64_t n = residual.size(0), d = caches.kv().head_dim;
  TORCH_CHECK(residual.scalar_type() == weights.dtype() && caches.dtype() == weights.dtype() &&
                  residual.is_contiguous() && residual.size(1) == weights.plan().hidden(),
              "layer_stack: residual, norms and KV caches must share a dtype and the hidden size");
  TORCH_CHECK(caches.kv().kv_heads == hk && hk > 0 && hq % hk == 0, "layer_stack: head counts do not match the caches");
  for (const StackLayer& layer : weights.plan().plan())
    TORCH_CHECK(layer.qkv.out == (hq + 2 * hk) * d && layer.o.in == hq * d,
                "layer_stack: the attention projections do not match the head counts");
  for (const at::Tensor* t : {&positions, &slot_mapping, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == n,
                "layer_stack: positions, slots and context lengths must be int64, one per row");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == n,
              "layer_stack: block tables must be contiguous int64 [rows, width]");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.is_contiguous() && sin_table.is_contiguous() && cos_table.size(1) * 2 == d,
              "layer_stack: rotary tables must be contiguous float32 [positions, head_dim / 2]");
}

// A step of decode rows only, in one team of threads: [float32 logits] when the weights hold the
// head, else (residual, delta) of the kept rows.
inline std::vector<at::Tensor> decode_rows(at::Tensor residual, const StackWeights& weights, const StackCaches& caches,
                                           const at::Tensor& positions, const at::Tensor& cos_table,
                                           const at::Tensor& sin_table, const at::Tensor& slot_mapping,
                                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                                           const c10::optional<at::Tensor>& keep_rows, int64_t hq, int64_t hk,
                                           double eps, double scale) {
  check_decode_rows(residual, weights, caches, positions, cos_table, sin_table, slot_mapping, block_tables,
                    context_lens, hq, hk);
  const int64_t n = residual.size(0), h = residual.size(1);
  KeptRows kept = all_rows(n);
  if (keep_rows.has_value()) {
    const at::Tensor keep = keep_rows->to(at::kLong).contiguous();
    kept = kept_rows(keep.data_ptr<int64_t>(), keep.numel(), n);
  }
  const int64_t m = kept.count;
  const bool compact = kept.compact;
  const DecodeRows rows{residual.data_ptr(), n, positions.data_ptr<int64_t>(), slot_mapping.data_ptr<int64_t>(),
                        block_tables.data_ptr<int64_t>(), block_tables.size(1), context_lens.data_ptr<int64_t>(),
                        cos_table.data_ptr<float>(), sin_table.data_ptr<float>(), std::move(kept), hq, hk, eps,
                        scale};
  const at::Tensor carry = at::empty({n, h}, residual.options());
  const at::Tensor kept_residual = compact ? at::empty({m, h}, residual.options()) : residual;
  const StackHead* head = m > 0 ? weights.head() : nullptr;
  const at::Tensor logits = head != nullptr ? at::empty({m, head->linear.out}, residual.options()) : at::Tensor();
  const DecodeOut out{carry.data_ptr(), kept_residual.data_ptr(), head != nullptr ? logits.data_ptr() : nullptr};
  if (residual.scalar_type() == at::kFloat) kvops::decode_team<float>(rows, weights.plan(), caches.kv(), out);
  else kvops::decode_team<kvmosaic_vec::bf16>(rows, weights.plan(), caches.kv(), out);
  if (weights.head() != nullptr) return {head != nullptr ? logits.to(at::kFloat) : empty_logits(weights, residual)};
  return {kept_residual, carry.narrow(0, 0, m)};
}

// A packed float weight (empty scales) or a quantized one (int8 / uint8 codes) times x.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor* w, const c10::optional<at::Tensor>& bias) {
  if (w[1].numel() == 0) return packed_linear(x, w[0], bias);
  return quantized_linear(x, w[0], w[1], w[2].numel() > 0 ? c10::optional<at::Tensor>(w[2]) : c10::nullopt, bias);
}

// The gate/up projection and SwiGLU: fused into the packed float product, after the quantized one.
inline at::Tensor gated(const at::Tensor& x, const at::Tensor* w) {
  if (w[1].numel() == 0) return packed_swiglu(x, w[0]);
  return silu_and_mul(linear(x, w, c10::nullopt));
}

// The step's rows' attention: decode rows [0, nd) in one call, then each span over its own table.
inline at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
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

// ops.layer_stack. residual [N, hidden] (the embeddings) is updated in place.
// block_tables / context_lens: the decode rows' ([nd, width] / [nd]; nd may be 0);
// spans: [S, 3] int64 (first row, rows, context length) with span_tables[s] each span's block table.
// keep_rows: the rows that go on past the last layer's attention (the others' K/V are cached and
// nothing reads their output, so their o_proj and MLP are skipped); all rows when not given.
// Returns (residual, delta) of the kept rows: the last layer's MLP output is left for the final norm;
// or, when the weights have a head, [the kept rows' float32 logits] (the final norm and LM head run here).
inline std::vector<at::Tensor> layer_stack(at::Tensor residual, const StackWeights& stack_weights,
                                           const StackCaches& caches, const at::Tensor& positions,
                                           const at::Tensor& cos_table, const at::Tensor& sin_table,
                                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                           const at::Tensor& context_lens, const at::Tensor& spans,
                                           const std::vector<at::Tensor>& span_tables,
                                           const c10::optional<at::Tensor>& keep_rows, int64_t hq, int64_t hk,
                                           double eps, double scale) {
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
    return decode_rows(residual, stack_weights, caches, positions, cos_table, sin_table, slot_mapping, block_tables,
                       context_lens, keep_rows, hq, hk, eps, scale);
  const std::vector<at::Tensor>& weights = stack_weights.tensors();
  const std::vector<at::Tensor>& kv_caches = caches.tensors();
  c10::optional<at::Tensor> carry;  // the previous layer's MLP output, added by the next norm
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + kPerLayer * i;
    const c10::optional<at::Tensor> qkv_bias = w[4].numel() > 0 ? c10::optional<at::Tensor>(w[4]) : c10::nullopt;
    const at::Tensor normed = add_rms_norm(residual, carry, w[0], eps);
    const std::vector<at::Tensor>& qkv_parts = stack_weights.qkv_parts(i);
    const at::Tensor qkv = qkv_parts.empty() ? linear(normed, w + 1, qkv_bias)
                                             : quantized_linear_parts(normed, qkv_parts, qkv_bias);
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
  if (residual.size(0) == 0) return {empty_logits(stack_weights, residual)};
  const at::Tensor* head = stack_weights.head_tensors().data();
  return {linear(add_rms_norm(residual, carry, head[0], eps), head + 1, c10::nullopt).to(at::kFloat)};
}

// The token embedding of ops.decode_passes: a float table in the activations' dtype, or a packed
// quantized LM head's (codes, scales, extra) when the embedding is tied to it.
inline TokenEmbedding token_embedding(const std::vector<at::Tensor>& parts, at::ScalarType dtype) {
  TORCH_CHECK(parts.size() == 1 || parts.size() == 3,
              "decode_passes: the embedding is a float table or a quantized head's (codes, scales, extra)");
  TokenEmbedding e;
  if (parts.size() == 1) {
    const at::Tensor& t = parts[0];
    TORCH_CHECK(t.dim() == 2 && t.scalar_type() == dtype && t.is_contiguous(),
                "decode_passes: a float embedding table must be contiguous [vocab, hidden] in the rows' dtype");
    e.table = t.data_ptr();
    e.rows = t.size(0);
    e.width = t.size(1);
    return e;
  }
  e.quant = quantized_weight(parts[0], parts[1], parts[2].numel() > 0 ? &parts[2] : nullptr, nullptr,
                                "decode_passes");
  e.quantized = true;
  e.rows = e.quant.groups * 16;
  e.width = e.quant.k;
  return e;
}

// ops.decode_passes: greedy passes of decode rows, from each row's token id, with rows of `dtype`:
// [passes run, rows] tokens.
inline at::Tensor decode_passes(const at::Tensor& input_ids, at::ScalarType dtype, const StackWeights& weights,
                                const StackCaches& caches, const at::Tensor& positions, const at::Tensor& cos_table,
                                const at::Tensor& sin_table, const at::Tensor& block_tables,
                                const std::vector<at::Tensor>& embedding, const std::vector<int64_t>& stop_ids,
                                int64_t passes, int64_t hq, int64_t hk, double eps, double scale) {
  const int64_t n = input_ids.numel(), bs = caches.kv().block_size, width = block_tables.size(1);
  TORCH_CHECK(weights.head() != nullptr, "decode_passes: the stack's weights must hold the LM head");
  TORCH_CHECK(weights.layers() == caches.layers(), "decode_passes: weights and KV caches differ in layers");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decode_passes: rows are float32 or bfloat16");
  TORCH_CHECK(passes >= 1 && n > 0, "decode_passes: at least one pass over at least one row");
  TORCH_CHECK(input_ids.scalar_type() == at::kLong && input_ids.dim() == 1 && positions.scalar_type() == at::kLong &&
                  positions.numel() == n && block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                  block_tables.size(0) == n && block_tables.is_contiguous(),
              "decode_passes: int64 token ids [rows], int64 positions, one per row, and int64 block tables "
              "[rows, width]");
  const TokenEmbedding table = token_embedding(embedding, dtype);
  const int64_t vocab = weights.head()->linear.out;
  TORCH_CHECK(table.rows >= vocab, "decode_passes: the embedding has fewer rows than the vocab");
  TORCH_CHECK(table.width == weights.plan().hidden(), "decode_passes: the embedding's rows are ", table.width,
              " wide, not the hidden size ", weights.plan().hidden());
  const at::Tensor ids = input_ids.contiguous();
  const int64_t* first = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(first[r] >= 0 && first[r] < vocab, "decode_passes: token id ", first[r], " of row ", r,
                " is outside the vocab of ", vocab);
  at::Tensor pos = positions.clone().contiguous();
  int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)  // every pass's slot must be in the row's blocks
    TORCH_CHECK(p[r] >= 0 && (p[r] + passes - 1) / bs < width, "decode_passes: position ", p[r] + passes - 1,
                " is past row ", r, "'s blocks");
  at::Tensor residual = at::empty({n, table.width}, at::TensorOptions().dtype(dtype));
  check_decode_rows(residual, weights, caches, pos, cos_table, sin_table, pos, block_tables, pos, hq, hk);
  at::Tensor tokens = at::empty({passes, n}, pos.options());
  const PassRows rows{first, residual.data_ptr(), n, p, block_tables.data_ptr<int64_t>(), width,
                      cos_table.data_ptr<float>(), sin_table.data_ptr<float>(), hq, hk, eps, scale};
  const int64_t done =
      dtype == at::kFloat
          ? kvops::decode_passes<float>(rows, weights.plan(), caches.kv(), table, stop_ids, passes,
                                        tokens.data_ptr<int64_t>())
          : kvops::decode_passes<kvmosaic_vec::bf16>(rows, weights.plan(), caches.kv(), table, stop_ids, passes,
                                                     tokens.data_ptr<int64_t>());
  return tokens.narrow(0, 0, done);
}

}  // namespace team_ops

// Registers StackWeights, StackCaches, layer_stack and decode_passes on the float extension's module.
inline void bind_team(py::module& m) {
  py::class_<StackWeights, std::shared_ptr<StackWeights>>(
      m, "StackWeights", "the decoder layers' weights for layer_stack, checked once",
      py::module_local())  // each ISA level's module has its own
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<std::vector<at::Tensor>>>(),
           py::arg("layers"), py::arg("head") = std::vector<at::Tensor>(),
           py::arg("qkv_parts") = std::vector<std::vector<at::Tensor>>())
      .def_property_readonly("layers", &StackWeights::layers)
      .def_property_readonly("has_head", [](const StackWeights& w) { return w.head() != nullptr; });
  py::class_<StackCaches, std::shared_ptr<StackCaches>>(
      m, "StackCaches", "the decoder layers' KV caches for layer_stack, checked once", py::module_local())
      .def(py::init<std::vector<at::Tensor>>())
      .def_property_readonly("layers", &StackCaches::layers);
  m.def("layer_stack", &team_ops::layer_stack, no_gil,
        "a step (decode rows, then spans) through all decoder layers (packed weights)");
  m.def("decode_passes", &team_ops::decode_passes, no_gil,
        "greedy decode passes of one row per sequence, each feeding its argmax back (multi-step decoding)");
}

}  // namespace kvops

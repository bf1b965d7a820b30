// A step through the whole stack of decoder layers in one call. Each layer is the same kernel sequence
// the Python model runs (residual add + RMSNorm, qkv, rotary + cache write, paged attention, o_proj,
// add + RMSNorm, gate/up SwiGLU, down_proj; each linear on packed float or quantized weights), with the
// same roundings, so the result is bit-identical; what goes away is the interpreter and dispatch work
// between the ~10 kernels of each layer, a visible share of a small model's step (its weights stream
// from memory in a few milliseconds). The rows are a batch's single-token decodes first, then spans of
// several tokens of one sequence each (prefill chunks, or a decode verifying speculated tokens).
#include "ops_common.h"
#include "stack_kernels.h"
#include "team.h"

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

// ---------------------------------------------------------------------------------------------
// Steps of decode rows only run in one team of threads (team.h): the same kernels in their range
// form, a barrier between them, buffers allocated once per step. Every item computes what the
// ATen path computes, so the results are bit for bit the same.

using namespace kvops;

constexpr int64_t kPrivateRows = 4;  // up to this many rows, each thread quantizes a linear's input itself

struct StackLinear {  // one product of the stack on packed float or quantized weights
  bool quantized;
  PackedWeight packed;
  QuantizedWeight quant;
  int64_t in, out;  // features; a packed gate/up pair's out is the SwiGLU width
};

StackLinear stack_linear(const at::Tensor* w, const float* bias, bool swiglu) {
  if (w[1].numel() == 0) {
    const PackedWeight p = PackedWeight::of(w[0], swiglu, bias);
    return {false, p, {}, p.k, p.width()};
  }
  const QuantizedWeight q = QuantizedWeight::of(w[0], w[1], w[2].numel() > 0 ? &w[2] : nullptr, bias);
  return {true, {}, q, q.k, q.groups * 16};
}

template <typename T>
struct LayerPlan {
  StackLinear qkv, o, gate_up, down;
  const T* input_norm;
  const T* post_norm;
  T* k_cache;
  T* v_cache;
};

// The int8 activations of a quantized linear: one copy per thread when every thread quantizes the
// (few) rows itself, else one shared copy that the threads fill row by row.
struct QuantScratch {
  std::vector<int8_t> codes;
  std::vector<float> floats;
  int64_t rows, width;  // per copy
  QuantizedRows rows_for(const Team& team, int64_t m, int64_t k, bool private_copy) {
    const int64_t copy = private_copy ? team.id() : 0;
    return QuantizedRows::over(codes.data() + copy * rows * width,
                               floats.data() + copy * rows * QuantizedRows::floats_per_row(width), m, k);
  }
};

// x [m, in] times the linear into out [m, out]; the caller syncs before reading out.
template <typename T>
void team_linear(const Team& team, const StackLinear& l, const T* x, int64_t m, T* out, QuantScratch& scratch) {
  if (!l.quantized) {
    const Share s = team.share(l.packed.panels());
    packed_panels(l.packed, x, m, out, s.begin, s.end);
    return;
  }
  const bool private_copy = m <= kPrivateRows;
  const QuantizedRows rows = scratch.rows_for(team, m, l.in, private_copy);
  if (private_copy) {
    quantize_rows(x, l.in, rows, 0, m);
  } else {
    const Share s = team.share(m);
    quantize_rows(x, l.in, rows, s.begin, s.end);
    team.sync();
  }
  const Share s = team.share(l.quant.groups);
  quantized_groups(l.quant, rows, m, out, l.out, s.begin, s.end);
}

at::Tensor buffer(int64_t rows, int64_t cols, const at::Tensor& like) { return at::empty({rows, cols}, like.options()); }

// What the team path reads through raw pointers, checked before the threads start.
void check_team_inputs(const at::Tensor& residual, const std::vector<at::Tensor>& weights,
                       const std::vector<at::Tensor>& kv_caches, const at::Tensor& positions,
                       const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& slot_mapping,
                       const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t hq, int64_t hk) {
  const int64_t n = residual.size(0);
  const auto dtype = residual.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "layer_stack: activations must be float32 or bfloat16");
  TORCH_CHECK(residual.is_contiguous(), "layer_stack: residual must be contiguous");
  TORCH_CHECK(hk > 0 && hq % hk == 0, "layer_stack: query heads must be a multiple of KV heads");
  for (const at::Tensor& cache : kv_caches)
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() && cache.scalar_type() == dtype &&
                    cache.size(3) == hk && cache.sizes() == kv_caches[0].sizes(),
                "layer_stack: KV caches must be contiguous [2, blocks, block_size, kv_heads, head_dim] of the "
                "activation dtype");
  for (const at::Tensor* t : {&positions, &slot_mapping, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == n,
                "layer_stack: positions, slots and context lengths must be int64, one per row");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2,
              "layer_stack: block tables must be contiguous int64 [rows, width]");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.is_contiguous() && sin_table.is_contiguous() &&
                  cos_table.size(1) * 2 == kv_caches[0].size(4),
              "layer_stack: rotary tables must be contiguous float32 [positions, head_dim / 2]");
  for (size_t i = 0; i < weights.size(); i += kPerLayer) {
    const at::Tensor* w = weights.data() + i;
    for (int j : {0, 8})
      TORCH_CHECK(w[j].scalar_type() == dtype && w[j].is_contiguous(), "layer_stack: norm weights must be "
                  "contiguous in the activation dtype");
    for (int j : {1, 5, 9, 12}) {
      if (w[j + 1].numel() == 0) {
        TORCH_CHECK(w[j].scalar_type() == dtype && w[j].is_contiguous() && w[j].dim() == 2,
                    "layer_stack: packed float weights must be in the activation dtype");
      } else {
        const bool q4 = w[j].scalar_type() == at::kByte;
        TORCH_CHECK((q4 || w[j].scalar_type() == at::kChar) && w[j].is_contiguous() && w[j + 1].dim() == 3 &&
                        w[j + 1].is_contiguous() &&
                        (w[j + 1].scalar_type() == at::kHalf || w[j + 1].scalar_type() == at::kFloat) &&
                        q4 == (w[j + 2].numel() > 0) &&
                        (!q4 || (w[j + 2].sizes() == w[j + 1].sizes() &&
                                 w[j + 2].scalar_type() == w[j + 1].scalar_type() && w[j + 2].is_contiguous())),
                    "layer_stack: a quantized weight is not in the interleaved layout");
      }
    }
  }
}

template <typename T>
std::vector<at::Tensor> decode_team(at::Tensor residual, const std::vector<at::Tensor>& weights,
                                    const std::vector<at::Tensor>& kv_caches, const at::Tensor& positions,
                                    const at::Tensor& cos_table, const at::Tensor& sin_table,
                                    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                    const at::Tensor& context_lens, const c10::optional<at::Tensor>& keep_rows,
                                    int64_t hq, int64_t hk, double eps, double scale) {
  const int64_t n = residual.size(0), h = residual.size(1), layers = static_cast<int64_t>(kv_caches.size());
  const int64_t d = kv_caches[0].size(4), block_size = kv_caches[0].size(2);
  std::vector<at::Tensor> biases;  // float32 copies, alive through the step
  std::vector<LayerPlan<T>> plan;
  int64_t widest = 0;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + kPerLayer * i;
    const float* qkv_bias = nullptr;
    if (w[4].numel() > 0) qkv_bias = biases.emplace_back(w[4].to(at::kFloat).contiguous()).data_ptr<float>();
    const bool fused = w[10].numel() == 0;  // a float gate/up pair is packed with SwiGLU
    plan.push_back({stack_linear(w + 1, qkv_bias, false), stack_linear(w + 5, nullptr, false),
                    stack_linear(w + 9, nullptr, fused), stack_linear(w + 12, nullptr, false), w[0].data_ptr<T>(),
                    w[8].data_ptr<T>(), kv_caches[i].select(0, 0).data_ptr<T>(),
                    kv_caches[i].select(0, 1).data_ptr<T>()});
    const LayerPlan<T>& p = plan.back();
    const int64_t f_layer = fused ? p.gate_up.out : p.gate_up.out / 2;
    TORCH_CHECK(p.qkv.in == h && p.qkv.out == (hq + 2 * hk) * d && p.o.in == hq * d && p.o.out == h &&
                    p.gate_up.in == h && p.down.in == f_layer && p.down.out == h,
                "layer_stack: layer ", i, " has products of the wrong shapes");
    for (const StackLinear* l : {&p.qkv, &p.o, &p.gate_up, &p.down}) widest = std::max(widest, l->in);
  }
  const bool fused = !plan[0].gate_up.quantized;
  const int64_t f = fused ? plan[0].gate_up.out : plan[0].gate_up.out / 2;
  for (const LayerPlan<T>& p : plan)
    TORCH_CHECK(p.gate_up.quantized != fused && (fused ? p.gate_up.out : p.gate_up.out / 2) == f,
                "layer_stack: the layers' MLPs differ in kind or width");
  // the rows that go on past the last attention; none to pick when they are all rows in order
  std::vector<int64_t> keep;
  bool compact = false;
  if (keep_rows.has_value()) {
    const at::Tensor kr = keep_rows->to(at::kLong).contiguous();
    keep.assign(kr.data_ptr<int64_t>(), kr.data_ptr<int64_t>() + kr.numel());
    for (size_t j = 0; j < keep.size(); ++j) {
      TORCH_CHECK(keep[j] >= 0 && keep[j] < n, "layer_stack: keep_rows out of range");
      compact = compact || keep[j] != static_cast<int64_t>(j);
    }
    compact = compact || static_cast<int64_t>(keep.size()) != n;
  }
  const int64_t kept = compact ? static_cast<int64_t>(keep.size()) : n;

  at::Tensor normed = buffer(n, h, residual), qkv = buffer(n, (hq + 2 * hk) * d, residual);
  at::Tensor q = at::empty({n, hq, d}, residual.options()), attn = buffer(n, hq * d, residual);
  at::Tensor o = buffer(n, h, residual), act = buffer(n, f, residual), carry = buffer(n, h, residual);
  at::Tensor gate_up = fused ? at::Tensor() : buffer(n, 2 * f, residual);
  at::Tensor kept_residual = compact ? buffer(kept, h, residual) : residual;
  at::Tensor kept_attn = compact ? buffer(kept, hq * d, residual) : attn;
  const int threads = at::get_num_threads();
  QuantScratch scratch;
  scratch.rows = n;
  scratch.width = widest;
  const int64_t copies = n <= kPrivateRows ? threads : 1;
  scratch.codes.resize(copies * n * widest);
  scratch.floats.resize(copies * n * QuantizedRows::floats_per_row(widest));

  T* res = residual.data_ptr<T>();
  T* normed_p = normed.data_ptr<T>();
  T* qkv_p = qkv.data_ptr<T>();
  T* q_p = q.data_ptr<T>();
  T* attn_p = attn.data_ptr<T>();
  T* o_p = o.data_ptr<T>();
  T* act_p = act.data_ptr<T>();
  T* carry_p = carry.data_ptr<T>();
  T* gate_up_p = fused ? nullptr : gate_up.data_ptr<T>();
  T* kept_res_p = kept_residual.data_ptr<T>();
  T* kept_attn_p = kept_attn.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  RopeStep<T> rope{qkv_p, qkv.stride(0), positions.data_ptr<int64_t>(), slot_mapping.data_ptr<int64_t>(),
                   cos_table.data_ptr<float>(), sin_table.data_ptr<float>(), nullptr, nullptr, q_p, hq, hk, d};
  const DecodeBatch<T> batch_base{n, hq, hk, hq / hk, block_tables.size(1), block_size, q_p, nullptr, nullptr,
                                  block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), attn_p, d};

  run_team([&](const Team& team) {
    const AttentionWork work = decode_attention_work(n, hk, d, team.size());
    for (int64_t i = 0; i < layers; ++i) {
      const LayerPlan<T>& layer = plan[i];
      Share s = team.share(n);
      norm_rows(res, i == 0 ? nullptr : carry_p, layer.input_norm, normed_p, h, feps, s.begin, s.end);
      team.sync();
      team_linear(team, layer.qkv, normed_p, n, qkv_p, scratch);
      team.sync();
      RopeStep<T> r = rope;
      r.k_cache = layer.k_cache;
      r.v_cache = layer.v_cache;
      s = team.share(n * (hq + hk));
      rope_items(r, s.begin, s.end);
      team.sync();
      DecodeBatch<T> db = batch_base;
      db.k = layer.k_cache;
      db.v = layer.v_cache;
      s = team.share(work.items);
      decode_attention_items(db, scale, work, s.begin, s.end);
      team.sync();
      T* rows = res;
      const T* attn_rows = attn_p;
      int64_t m = n;
      if (i + 1 == layers && compact) {  // only the kept rows go on past the last attention
        if (team.leader()) {
          for (int64_t j = 0; j < kept; ++j) {
            std::memcpy(kept_res_p + j * h, res + keep[j] * h, sizeof(T) * h);
            std::memcpy(kept_attn_p + j * hq * d, attn_p + keep[j] * hq * d, sizeof(T) * hq * d);
          }
        }
        team.sync();
        rows = kept_res_p;
        attn_rows = kept_attn_p;
        m = kept;
      }
      team_linear(team, layer.o, attn_rows, m, o_p, scratch);
      team.sync();
      s = team.share(m);
      norm_rows(rows, o_p, layer.post_norm, normed_p, h, feps, s.begin, s.end);
      team.sync();
      if (fused) {
        team_linear(team, layer.gate_up, normed_p, m, act_p, scratch);
      } else {
        team_linear(team, layer.gate_up, normed_p, m, gate_up_p, scratch);
        team.sync();
        s = team.share(silu_work(m, f));
        silu_items(gate_up_p, f, act_p, s.begin, s.end);
      }
      team.sync();
      team_linear(team, layer.down, act_p, m, carry_p, scratch);
      team.sync();
    }
  });
  return {kept_residual, carry.narrow(0, 0, kept)};
}
}  // namespace

// residual [N, hidden] (the embeddings) is updated in place.
// weights: kPerLayer tensors per layer in the order above (an empty tensor for no qkv bias; a packed
// float linear has empty scales and mins, a q8 one empty mins);
// kv_caches: one [2, num_blocks, block_size, hk, head_dim] tensor per layer;
// block_tables / context_lens: the decode rows' ([nd, width] / [nd]; nd may be 0);
// spans: [S, 3] int64 (first row, rows, context length) with span_tables[s] each span's block table.
// keep_rows: the rows that go on past the last layer's attention (the others' K/V are cached and
// nothing reads their output, so their o_proj and MLP are skipped); all rows when not given.
// Returns (residual, delta) of the kept rows: the last layer's MLP output is left for the final norm.
std::vector<at::Tensor> layer_stack(at::Tensor residual, const std::vector<at::Tensor>& weights,
                                    const std::vector<at::Tensor>& kv_caches, const at::Tensor& positions,
                                    const at::Tensor& cos_table, const at::Tensor& sin_table,
                                    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                    const at::Tensor& context_lens, const at::Tensor& spans,
                                    const std::vector<at::Tensor>& span_tables,
                                    const c10::optional<at::Tensor>& keep_rows, int64_t hq, int64_t hk, double eps,
                                    double scale) {
  const size_t layers = kv_caches.size();
  TORCH_CHECK(layers > 0, "layer_stack needs at least one layer");
  TORCH_CHECK(weights.size() == kPerLayer * layers, "layer_stack: ", kPerLayer, " weights per layer, got ",
              weights.size(), " for ", layers, " layers");
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
  if (span_tables.empty() && n > 0) {
    check_team_inputs(residual, weights, kv_caches, positions, cos_table, sin_table, slot_mapping, block_tables,
                      context_lens, hq, hk);
    if (residual.scalar_type() == at::kFloat)
      return decode_team<float>(residual, weights, kv_caches, positions, cos_table, sin_table, slot_mapping,
                                block_tables, context_lens, keep_rows, hq, hk, eps, scale);
    return decode_team<c10::BFloat16>(residual, weights, kv_caches, positions, cos_table, sin_table, slot_mapping,
                                      block_tables, context_lens, keep_rows, hq, hk, eps, scale);
  }
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
  return {residual, *carry};
}

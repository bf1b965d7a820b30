// The attention kernels' entry points (attention/attention.h) on tensors: checks, allocation and dtype
// dispatch. Included by bind/kvmosaic_ops.cpp only.
#pragma once

#include "attention/attention.h"
#include "bind/float_ops.h"

#include <limits>

// One query token per sequence; K/V read from the sequence's blocks in place.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [B, hq, head_dim]");
  kvops::check_cache(k_cache, q);
  kvops::check_cache(v_cache, q);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  auto out = at::empty_like(q);
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  if (q.scalar_type() == at::kFloat) {
    kvops::decode_attention(kvops::decode_batch<float>(q, k_cache, v_cache, tables, lens, out), scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    kvops::decode_attention(kvops::decode_batch<kvmosaic_vec::bf16>(q, k_cache, v_cache, tables, lens, out), scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
  return out;
}

// The decode rows' attention over these keys only, as a partial to merge with other holders' partials
// (DistAttention's creditor side): float32 (out [B, hq, D] normalised over the keys, a reference [B, hq]
// at or below the scaled scores' max (the online softmax raises it lazily), sum of exp(score - reference)
// [B, hq]); a row without keys gives 0, -inf and 0. Head sizes 64 and 128 (the register kernel).
std::vector<at::Tensor> paged_decode_attention_partial(const at::Tensor& q, const at::Tensor& k_cache,
                                                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                       const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && (q.size(2) == 64 || q.size(2) == 128),
              "paged_decode_attention_partial: q must be contiguous [B, hq, 64 or 128]");
  kvops::check_cache(k_cache, q);
  kvops::check_cache(v_cache, q);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              "paged_decode_attention_partial: int64 block tables [B, width] and context lengths [B]");
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t bs = k_cache.size(1);
  for (int64_t b = 0; b < lens.numel(); ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= tables.size(1) * bs,
                "paged_decode_attention_partial: a context length exceeds its block table");
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[b * tables.size(1) + j] >= 0 && tp[b * tables.size(1) + j] < k_cache.size(0),
                  "paged_decode_attention_partial: block id out of range");
  }
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor out = at::empty(q.sizes(), f32), row_max = at::empty({q.size(0), q.size(1)}, f32);
  at::Tensor sum_exp = at::empty({q.size(0), q.size(1)}, f32);
  float* o = out.data_ptr<float>();
  float* mx = row_max.data_ptr<float>();
  float* se = sum_exp.data_ptr<float>();
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    at::Tensor like_q = q;
    kvops::DecodeBatch<T> batch = kvops::decode_batch<T>(q, k_cache, v_cache, tables, lens, like_q);
    batch.out = nullptr;  // a partial has no output of q's dtype
    kvops::decode_attention_partial(batch, scale, o, mx, se);
  };
  if (q.scalar_type() == at::kFloat) run(static_cast<float*>(nullptr));
  else if (q.scalar_type() == at::kBFloat16) run(static_cast<kvmosaic_vec::bf16*>(nullptr));
  else TORCH_CHECK(false, "paged_decode_attention_partial supports float32 and bfloat16");
  return {out, row_max, sum_exp};
}

// Partial attentions of the same queries over disjoint keys (out [N, hq, D] normalised over each holder's
// keys, reference [N, hq], sum of exp(score - reference) [N, hq], all float32), combined exactly: each
// holder's sums rescaled to the largest reference. A holder that saw no keys (-inf, 0) weighs nothing.
at::Tensor merge_attention_partials(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& refs,
                                    const std::vector<at::Tensor>& sums) {
  TORCH_CHECK(!outs.empty() && refs.size() == outs.size() && sums.size() == outs.size(),
              "merge_attention_partials: one reference and one sum per partial output");
  const at::Tensor& first = outs[0];
  TORCH_CHECK(first.dim() == 3 && first.size(2) % 16 == 0, "merge_attention_partials: outputs [N, hq, D % 16 == 0]");
  const int64_t rows = first.size(0) * first.size(1), d = first.size(2), parts = static_cast<int64_t>(outs.size());
  std::vector<at::Tensor> held;  // contiguous (copies only where they were not)
  std::vector<const float*> o(parts), r(parts), s(parts);
  for (int64_t p = 0; p < parts; ++p) {
    TORCH_CHECK(outs[p].sizes() == first.sizes() && refs[p].numel() == rows && sums[p].numel() == rows,
                "merge_attention_partials: partials of different shapes");
    for (const at::Tensor* t : {&outs[p], &refs[p], &sums[p]}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat, "merge_attention_partials: partials are float32");
      held.push_back(t->contiguous());
    }
    o[p] = held[3 * p].data_ptr<float>();
    r[p] = held[3 * p + 1].data_ptr<float>();
    s[p] = held[3 * p + 2].data_ptr<float>();
  }
  at::Tensor merged = at::empty(first.sizes(), first.options());
  kvops::merge_attention_partials(o.data(), r.data(), s.data(), parts, rows, d, merged.data_ptr<float>());
  return merged;
}

// Attention of one prefill chunk (n query tokens, the last n of context_len) over its paged context,
// written into `out` when given (a contiguous tensor shaped like q, e.g. the chunk's rows of a batch).
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, int64_t context_len, double scale,
                                   const c10::optional<at::Tensor>& out_opt) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [n, hq, head_dim]");
  kvops::check_cache(k_cache, q);
  kvops::check_cache(v_cache, q);
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1, "block table must be int64 [blocks]");
  TORCH_CHECK(context_len >= q.size(0) && block_table.size(0) * k_cache.size(1) >= context_len,
              "context longer than its block table");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  at::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous(),
                "out must be a contiguous tensor shaped like q");
  } else {
    out = at::empty_like(q);
  }
  auto table = block_table.contiguous();
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128, "paged_prefill_attention supports head_dim 64 and 128");
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || q.scalar_type() == at::kFloat, "paged_prefill_attention supports float32 and bfloat16");
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const kvops::PrefillChunk<T> chunk{kvops::data_of<T>(q), q.size(0), q.size(1), kvops::data_of<T>(k_cache),
                                       kvops::data_of<T>(v_cache), k_cache.size(1), k_cache.size(2), d,
                                       table.data_ptr<int64_t>(), context_len, kvops::data_of<T>(out)};
    kvops::prefill_attention(chunk, scale);
  };
  if (bf16) run(static_cast<kvmosaic_vec::bf16*>(nullptr));
  else run(static_cast<float*>(nullptr));
  return out;
}

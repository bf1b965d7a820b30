// Greedy decode passes in one call (multi-step decoding): each pass runs the layer stack and the LM
// head on one row per sequence, takes each row's argmax as its token, looks that token's embedding
// up and moves every row one slot on, so no Python runs between a step's passes.
#include "layer_stack.h"

namespace {

// The rows of `index` of the token embedding: a float table, or a packed quantized LM head's
// (codes, scales, extra) when the embedding is tied to it.
at::Tensor embedding_rows(const std::vector<at::Tensor>& table, const at::Tensor& index, at::ScalarType dtype) {
  if (table.size() == 1) return table[0].index_select(0, index);
  const c10::optional<at::Tensor> extra = table[2].numel() > 0 ? c10::optional<at::Tensor>(table[2]) : c10::nullopt;
  return quantized_rows(table[0], table[1], extra, index, dtype);
}

}  // namespace

at::Tensor decode_passes(at::Tensor residual, const kvops::StackWeights& weights, const kvops::StackCaches& caches,
                         const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
                         const at::Tensor& block_tables, const std::vector<at::Tensor>& embedding,
                         const at::Tensor& stop_ids, int64_t passes, int64_t hq, int64_t hk, double eps, double scale) {
  const int64_t n = residual.size(0), bs = caches.block_size(), width = block_tables.size(1);
  TORCH_CHECK(weights.head() != nullptr, "decode_passes: the stack's weights must hold the LM head");
  TORCH_CHECK(weights.layers() == caches.layers(), "decode_passes: weights and KV caches differ in layers");
  TORCH_CHECK(embedding.size() == 1 || embedding.size() == 3,
              "decode_passes: the embedding is a float table or a quantized head's (codes, scales, extra)");
  TORCH_CHECK(passes >= 1 && n > 0, "decode_passes: at least one pass over at least one row");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == n && block_tables.dim() == 2 &&
                  block_tables.scalar_type() == at::kLong && block_tables.size(0) == n && block_tables.is_contiguous(),
              "decode_passes: int64 positions, one per row, and int64 block tables [rows, width]");
  at::Tensor pos = positions.clone().contiguous();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const at::Tensor stops = stop_ids.to(at::kLong).contiguous();
  const int64_t* stop = stops.data_ptr<int64_t>();
  at::Tensor tokens = at::empty({passes, n}, pos.options());
  int64_t done = 0;
  while (done < passes) {
    at::Tensor slots = at::empty({n}, pos.options());
    int64_t* p = pos.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(p[r] >= 0 && p[r] / bs < width, "decode_passes: position ", p[r], " is past row ", r, "'s blocks");
      slots.data_ptr<int64_t>()[r] = tables[r * width + p[r] / bs] * bs + p[r] % bs;
    }
    const std::vector<at::Tensor> logits = kvops::decode_team(residual, weights, caches, pos, cos_table, sin_table,
                                                              slots, block_tables, pos + 1, c10::nullopt, hq, hk, eps,
                                                              scale);
    const at::Tensor next = argmax_rows(logits[0]);
    tokens[done++].copy_(next);
    const int64_t* t = next.data_ptr<int64_t>();
    bool stopped = false;  // a row's stop token ends the call: the caller decides what comes after
    for (int64_t r = 0; r < n && !stopped; ++r)
      for (int64_t s = 0; s < stops.numel() && !stopped; ++s) stopped = t[r] == stop[s];
    if (stopped || done == passes) break;
    residual = embedding_rows(embedding, next, residual.scalar_type()).to(residual.scalar_type()).contiguous();
    pos = pos + 1;
  }
  return tokens.narrow(0, 0, done);
}

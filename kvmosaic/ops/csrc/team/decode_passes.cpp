// Greedy decode passes in one call (a step of greedy decode rows, one pass or several with multi-step
// decoding): each pass looks each row's token's embedding up, runs the layer stack and the LM head on
// one row per sequence, takes each row's argmax as its next token and moves every row one slot on, so
// no Python runs between a step's passes, nor around the one pass of a plain step.
//
// All passes run in one team of threads (team.h) over one set of buffers (DecodeRun): the argmax is
// split over the vocab between the threads, and the leader records the tokens, writes the next
// embeddings into the residual rows and moves the positions, slots and context lengths on. One
// team and one DecodeRun a pass, with the argmax, the lookup and the tensor bookkeeping between
// them, cost 60-80 us a pass outside the layers (default model, Q4_1, one row, AVX-512 host, cycle
// counters in a throw-away build: ~30 us setting up and tearing down the team and its buffers, the
// rest the argmax on one thread, the token tensor and the lookup with its ATen calls).
#include "team/layer_stack.h"
#include "team/team.h"

namespace {

using kvops::DecodeRun;
using kvops::QuantizedWeight;
using kvops::Team;

// The token embedding as the passes read it: a float table in the activations' dtype, or a packed
// quantized LM head's (codes, scales, extra) when the embedding is tied to it.
struct Embedding {
  const void* table = nullptr;  // float table [rows, h]
  QuantizedWeight quant{};
  bool quantized = false;
  int64_t rows = 0;
  int64_t width = 0;  // the hidden size

  static Embedding of(const std::vector<at::Tensor>& parts, at::ScalarType dtype) {
    TORCH_CHECK(parts.size() == 1 || parts.size() == 3,
                "decode_passes: the embedding is a float table or a quantized head's (codes, scales, extra)");
    Embedding e;
    if (parts.size() == 1) {
      const at::Tensor& t = parts[0];
      TORCH_CHECK(t.dim() == 2 && t.scalar_type() == dtype && t.is_contiguous(),
                  "decode_passes: a float embedding table must be contiguous [vocab, hidden] in the rows' dtype");
      e.table = t.data_ptr();
      e.rows = t.size(0);
      e.width = t.size(1);
      return e;
    }
    const c10::optional<at::Tensor> extra = parts[2].numel() > 0 ? c10::optional<at::Tensor>(parts[2]) : c10::nullopt;
    e.quant = QuantizedWeight::of(parts[0], parts[1], extra.has_value() ? &*extra : nullptr, nullptr, "decode_passes");
    e.quantized = true;
    e.rows = e.quant.groups * 16;
    e.width = e.quant.k;
    return e;
  }

  template <typename T>
  void rows_into(const int64_t* tokens, int64_t count, T* out, int64_t h) const {
    if (quantized) {
      kvops::dequantize_rows(quant, tokens, count, out);
      return;
    }
    for (int64_t r = 0; r < count; ++r)
      std::memcpy(out + r * h, static_cast<const T*>(table) + tokens[r] * h, sizeof(T) * h);
  }
};

template <typename T>
int64_t run_passes(const int64_t* first, at::Tensor residual, const kvops::StackWeights& weights,
                   const kvops::StackCaches& caches, at::Tensor& pos, const at::Tensor& cos_table,
                   const at::Tensor& sin_table, const at::Tensor& block_tables, const Embedding& embedding,
                   const std::vector<int64_t>& stops, int64_t passes, int64_t hq, int64_t hk, double eps, double scale,
                   int64_t* tokens) {
  const int64_t n = residual.size(0), h = residual.size(1), bs = caches.block_size(), width = block_tables.size(1);
  T* res = residual.data_ptr<T>();
  embedding.rows_into(first, n, res, h);
  const int64_t vocab = weights.head()->linear.out;
  at::Tensor slots = at::empty({n}, pos.options()), lens = at::empty({n}, pos.options());
  int64_t* p = pos.data_ptr<int64_t>();
  int64_t* sp = slots.data_ptr<int64_t>();
  int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  auto place = [&] {  // each row's slot and context length at its position
    for (int64_t r = 0; r < n; ++r) {
      sp[r] = kvops::slot_of(tables + r * width, p[r], bs);
      lp[r] = p[r] + 1;
    }
  };
  place();
  DecodeRun<T> step(residual, weights, caches, pos, cos_table, sin_table, slots, block_tables, lens, c10::nullopt,
                    hq, hk, eps, scale);
  std::vector<kvops::ArgmaxPart> parts(static_cast<size_t>(at::get_num_threads() * n));
  int64_t done = 0;
  bool stopped = false;  // a row's stop token ends the call: the caller decides what comes after
  kvops::run_team([&](const Team& team) {
    while (true) {
      step.run(team);
      team.sync();
      const T* logits = step.logits();
      const kvops::Share cols = team.share(vocab);
      for (int64_t r = 0; r < n; ++r)
        parts[team.id() * n + r] = kvops::argmax_part(logits + r * vocab, cols.begin, cols.end);
      team.sync();
      if (team.leader()) {
        int64_t* next = tokens + done * n;
        for (int64_t r = 0; r < n; ++r) {
          next[r] = kvops::merged_argmax(parts.data() + r, team.size(), n);
          for (int64_t s : stops) stopped = stopped || next[r] == s;
        }
        ++done;
        if (!stopped && done < passes) {
          embedding.rows_into(next, n, res, h);
          for (int64_t r = 0; r < n; ++r) ++p[r];
          place();
        }
      }
      team.sync();
      if (stopped || done == passes) return;
    }
  });
  return done;
}

}  // namespace

at::Tensor decode_passes(const at::Tensor& input_ids, at::ScalarType dtype, const kvops::StackWeights& weights,
                         const kvops::StackCaches& caches, const at::Tensor& positions, const at::Tensor& cos_table,
                         const at::Tensor& sin_table, const at::Tensor& block_tables,
                         const std::vector<at::Tensor>& embedding, const std::vector<int64_t>& stop_ids, int64_t passes,
                         int64_t hq, int64_t hk, double eps, double scale) {
  const int64_t n = input_ids.numel(), bs = caches.block_size(), width = block_tables.size(1);
  TORCH_CHECK(weights.head() != nullptr, "decode_passes: the stack's weights must hold the LM head");
  TORCH_CHECK(weights.layers() == caches.layers(), "decode_passes: weights and KV caches differ in layers");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decode_passes: rows are float32 or bfloat16");
  TORCH_CHECK(passes >= 1 && n > 0, "decode_passes: at least one pass over at least one row");
  TORCH_CHECK(input_ids.scalar_type() == at::kLong && input_ids.dim() == 1 && positions.scalar_type() == at::kLong &&
                  positions.numel() == n && block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                  block_tables.size(0) == n && block_tables.is_contiguous(),
              "decode_passes: int64 token ids [rows], int64 positions, one per row, and int64 block tables [rows, width]");
  const Embedding table = Embedding::of(embedding, dtype);
  const int64_t vocab = weights.head()->linear.out;
  TORCH_CHECK(table.rows >= vocab, "decode_passes: the embedding has fewer rows than the vocab");
  TORCH_CHECK(table.width == weights.plan()[0].qkv.in, "decode_passes: the embedding's rows are ", table.width,
              " wide, not the hidden size ", weights.plan()[0].qkv.in);
  const at::Tensor ids = input_ids.contiguous();
  const int64_t* first = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(first[r] >= 0 && first[r] < vocab, "decode_passes: token id ", first[r], " of row ", r,
                " is outside the vocab of ", vocab);
  at::Tensor pos = positions.clone().contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)  // every pass's slot must be in the row's blocks
    TORCH_CHECK(p[r] >= 0 && (p[r] + passes - 1) / bs < width, "decode_passes: position ", p[r] + passes - 1,
                " is past row ", r, "'s blocks");
  at::Tensor residual = at::empty({n, table.width}, at::TensorOptions().dtype(dtype));
  kvops::check_decode_rows(residual, weights, caches, pos, cos_table, sin_table, pos, block_tables, pos, hq, hk);
  at::Tensor tokens = at::empty({passes, n}, pos.options());
  const int64_t done =
      dtype == at::kFloat
          ? run_passes<float>(first, residual, weights, caches, pos, cos_table, sin_table, block_tables, table, stop_ids,
                              passes, hq, hk, eps, scale, tokens.data_ptr<int64_t>())
          : run_passes<c10::BFloat16>(first, residual, weights, caches, pos, cos_table, sin_table, block_tables, table,
                                      stop_ids, passes, hq, hk, eps, scale, tokens.data_ptr<int64_t>());
  return tokens.narrow(0, 0, done);
}

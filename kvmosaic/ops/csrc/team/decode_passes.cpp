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
#include <cstring>

#include "common/parallel.h"
#include "team/layer_stack.h"
#include "team/team.h"

namespace kvops {

namespace {

// the embeddings of tokens [count] into out [count, h]
template <typename T>
void embed(const TokenEmbedding& e, const int64_t* tokens, int64_t count, T* out, int64_t h) {
  if (e.quantized) {
    dequantize_rows(e.quant, tokens, count, out);
    return;
  }
  for (int64_t r = 0; r < count; ++r)
    std::memcpy(out + r * h, static_cast<const T*>(e.table) + tokens[r] * h, sizeof(T) * h);
}

}  // namespace

template <typename T>
int64_t decode_passes(const PassRows& rows, const StackPlan& weights, const StackKv& caches,
                      const TokenEmbedding& embedding, const std::vector<int64_t>& stops, int64_t passes,
                      int64_t* tokens) {
  const int64_t n = rows.rows, h = weights.hidden(), bs = caches.block_size, width = rows.table_width;
  T* res = static_cast<T*>(rows.residual);
  embed(embedding, rows.first, n, res, h);
  const int64_t vocab = weights.head()->linear.out;
  std::vector<int64_t> slots(n), lens(n);
  int64_t* p = rows.positions;
  int64_t* sp = slots.data();
  int64_t* lp = lens.data();
  const int64_t* tables = rows.block_tables;
  auto place = [&] {  // each row's slot and context length at its position
    for (int64_t r = 0; r < n; ++r) {
      sp[r] = slot_of(tables + r * width, p[r], bs);
      lp[r] = p[r] + 1;
    }
  };
  place();
  const DecodeRows step_rows{res, n, p, sp, tables, width, lp, rows.cos, rows.sin, all_rows(n),
                             rows.hq, rows.hk, rows.eps, rows.scale};
  DecodeRun<T> step(step_rows, weights, caches);
  std::vector<ArgmaxPart> parts(static_cast<size_t>(num_threads() * n));
  int64_t done = 0;
  bool stopped = false;  // a row's stop token ends the call: the caller decides what comes after
  run_team([&](const Team& team) {
    while (true) {
      step.run(team);
      team.sync();
      const T* logits = step.logits();
      const Share cols = team.share(vocab);
      for (int64_t r = 0; r < n; ++r) parts[team.id() * n + r] = argmax_part(logits + r * vocab, cols.begin, cols.end);
      team.sync();
      if (team.leader()) {
        int64_t* next = tokens + done * n;
        for (int64_t r = 0; r < n; ++r) {
          next[r] = merged_argmax(parts.data() + r, team.size(), n);
          for (int64_t s : stops) stopped = stopped || next[r] == s;
        }
        ++done;
        if (!stopped && done < passes) {
          embed(embedding, next, n, res, h);
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

template int64_t decode_passes<float>(const PassRows&, const StackPlan&, const StackKv&, const TokenEmbedding&,
                                      const std::vector<int64_t>&, int64_t, int64_t*);
template int64_t decode_passes<kvmosaic_vec::bf16>(const PassRows&, const StackPlan&, const StackKv&,
                                                   const TokenEmbedding&, const std::vector<int64_t>&, int64_t,
                                                   int64_t*);

}  // namespace kvops

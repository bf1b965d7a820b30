// A step of decode rows only runs every layer in one team of threads (team.h): the kernels of a
// layer in their range form (stack_kernels.h) with barriers between them (five a layer for a few
// rows: DecodeRun in layer_stack.h), and buffers allocated once per step. Each work item computes
// what the per-kernel path computes, so the results are bit for bit those of the per-kernel calls.
// Also: the checks of StackPlan. No PyTorch header: bind/team_bind.h makes the plan and the rows from
// the tensors and allocates what a step returns.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#include "common/parallel.h"
#include "isa/amx.h"
#include "team/layer_stack.h"
#include "team/team.h"

namespace kvops {

QuantScratch::QuantScratch(int64_t rows, int64_t width, int copies)
    : rows_(rows), width_(width), codes_(copies * rows * width),
      floats_(copies * rows * QuantizedRows::floats_per_row(width)), tiles_(rows >= amx::kMinRows && amx::enabled()) {
  if (tiles_) tile_rows_ = aligned_buffer<kvmosaic_vec::bf16>(rows * width);
}

QuantizedRows QuantScratch::rows_for(const Team& team, int64_t m, int64_t k, bool private_copy) {
  const int64_t copy = private_copy ? team.id() : 0;
  return QuantizedRows::over(codes_.data() + copy * rows_ * width_,
                             floats_.data() + copy * rows_ * QuantizedRows::floats_per_row(width_), m, k);
}

namespace {

constexpr int64_t kPrivateRows = 4;  // up to this many rows, each thread quantizes a linear's input itself

// The rows of x [m, in] as a quantized linear's product takes them: bf16 rows for the AMX tiles
// (float32 ones rounded by the threads together, with a barrier), or int8 rows (each thread's own
// copy of a few rows, else one copy the threads fill together, with a barrier).
struct QuantizedInput {
  const kvmosaic_vec::bf16* tile_rows;  // not null: the product runs on the tiles
  QuantizedRows int8_rows;
};

template <typename T>
QuantizedInput team_input(const Team& team, const StackLinear& l, const T* x, int64_t m, QuantScratch& scratch) {
  if (amx::quantized_takes(l.quant, m, scratch.tiles())) {
    if constexpr (std::is_same_v<T, kvmosaic_vec::bf16>) {
      return {x, {}};
    } else {
      const Share s = team.share(m);
      bf16_rows(x, l.in, scratch.tile_rows(), s.begin, s.end);
      team.sync();
      return {scratch.tile_rows(), {}};
    }
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
  return {nullptr, rows};
}

// rows [0, m) of the input times groups [g0, g1) of a quantized linear into out [m, out]
template <typename T>
void input_groups(const StackLinear& l, const QuantizedInput& in, int64_t m, T* out, int64_t g0, int64_t g1) {
  if (in.tile_rows != nullptr) amx::quantized_bf16_groups(l.quant, in.tile_rows, m, out, g0, g1);
  else quantized_groups(l.quant, in.int8_rows, m, out, l.out, g0, g1);
}

// x [m, in] times the linear into out [m, out]; the caller syncs before reading out.
template <typename T>
void team_linear(const Team& team, const StackLinear& l, const T* x, int64_t m, T* out, QuantScratch& scratch) {
  if (!l.quantized) {
    const Share s = team.share(l.packed.panels());
    packed_panels(l.packed, x, m, out, s.begin, s.end);
    return;
  }
  const QuantizedInput in = team_input(team, l, x, m, scratch);
  const Share s = team.share(l.quant.groups);
  input_groups(l, in, m, out, s.begin, s.end);
}

// The groups of a quantized gate/up pair [gate; up] that a thread computes: the same share of the
// gate's groups and of the up's, so that it can take the SwiGLU of its columns with no barrier
// between. An odd number of groups (a width not a multiple of 16) cannot be split so: none.
bool paired_gate_up(const StackLinear& l) { return l.quantized && l.quant.groups % 2 == 0; }

// silu(gate) * up of x [m, in] times a quantized gate/up pair into act [m, f] (gate_up [m, 2f] in
// between); the caller syncs before reading act.
template <typename T>
void team_gate_up(const Team& team, const StackLinear& l, const T* x, int64_t m, T* gate_up, T* act, int64_t f,
                  QuantScratch& scratch) {
  const QuantizedInput in = team_input(team, l, x, m, scratch);
  if (paired_gate_up(l)) {
    const int64_t half = l.quant.groups / 2;
    const Share s = team.share(half);
    input_groups(l, in, m, gate_up, s.begin, s.end);
    input_groups(l, in, m, gate_up, half + s.begin, half + s.end);
    silu_columns(gate_up, f, act, m, 16 * s.begin, 16 * s.end);
    return;
  }
  Share s = team.share(l.quant.groups);
  input_groups(l, in, m, gate_up, s.begin, s.end);
  team.sync();
  s = team.share(silu_work(m, f));
  silu_items(gate_up, f, act, s.begin, s.end);
}

// The first bytes of this thread's share of a quantized linear's weights, asked for into L2 before the
// barrier in front of that linear: the faster thread waits there, and the short kernels between two
// products (norm, rotary, attention) leave the memory idle. Measured on the default model, Q4_1, one
// stream, AVX-512 host: 281 -> 297 tok/s (best of 3 runs each, 3 interleaved rounds); 8 to 128 KiB
// all gave about the same. (The products' own prefetch ahead: qlinear.cpp's kStreamAhead.)
constexpr int64_t kPrefetchBytes = 16 << 10;

// the first `bytes` of the codes of groups [g0, g1) of w and as many groups' scales (and mins); a
// composite's from its parts, in order, until the bytes are spent
void prefetch_groups(const QuantizedWeight& w, int64_t g0, int64_t g1, int64_t bytes) {
  if (w.composite()) {
    for_parts(w, g0, g1, [&](const QuantizedWeight& part, int64_t, int64_t lo, int64_t hi) {
      if (bytes <= 0) return;
      prefetch_groups(part, lo, hi, bytes);
      bytes -= (hi - lo) * part.group_code_bytes();
    });
    return;
  }
  const int64_t group_bytes = w.group_code_bytes(), scale_bytes = w.group_scale_bytes();
  const int64_t groups = std::min<int64_t>(g1 - g0, std::max<int64_t>(1, bytes / group_bytes));
  const char* codes = reinterpret_cast<const char*>(w.codes) + g0 * group_bytes;
  for (int64_t b = 0; b < groups * group_bytes; b += 64) __builtin_prefetch(codes + b, 0, 2);
  const char* sc = static_cast<const char*>(w.scale) + g0 * scale_bytes;
  const char* mn = w.mins != nullptr ? static_cast<const char*>(w.mins) + g0 * scale_bytes : nullptr;
  for (int64_t b = 0; b < groups * scale_bytes; b += 64) {
    __builtin_prefetch(sc + b, 0, 2);
    if (mn != nullptr) __builtin_prefetch(mn + b, 0, 2);
  }
}

// paired: the linear is a gate/up pair that team_gate_up runs (the start of both of this thread's runs)
void prefetch_share(const Team& team, const StackLinear& l, bool paired = false) {
  if (!l.quantized) return;
  const QuantizedWeight& w = l.quant;
  if (paired && paired_gate_up(l)) {
    const int64_t half = w.groups / 2;
    const Share s = team.share(half);
    prefetch_groups(w, s.begin, s.end, kPrefetchBytes / 2);
    prefetch_groups(w, half + s.begin, half + s.end, kPrefetchBytes / 2);
    return;
  }
  const Share s = team.share(w.groups);
  prefetch_groups(w, s.begin, s.end, kPrefetchBytes);
}

// Which thread writes the new K/V of a row's KV head to its slot: normally the one whose attention
// item reads that slot first (AttentionWork::newest_item), right before reading it, with no barrier
// between; when some row reads another row's new K/V (a sequence's verification rows, a prompt's
// tail run as decode rows), each thread an even share of them all, and a barrier follows.
struct KvWriters {
  const AttentionWork& work;
  const int64_t* lens;
  int64_t rows, hk;
  Share items;   // this thread's attention items
  Share shared;  // this thread's share of the rows' KV heads when !by_items
  bool by_items;
  bool writes(int64_t b, int64_t kh) const {
    const int64_t i = by_items ? work.newest_item(lens, b, hk, kh) : b * hk + kh;
    const Share& s = by_items ? items : shared;
    return i >= s.begin && i < s.end;
  }
  template <typename F>
  void each(const F& f) const {
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t kh = 0; kh < hk; ++kh)
        if (writes(b, kh)) f(b, kh);
  }
};

// The rotary phase of a thread: the queries of rows q_rows rotated into its q rows, and the new K/V it
// writes (KvWriters) rotated (K) or copied (V) to their slots.
template <typename T>
void rope_for_items(const RopeStep<T>& r, const KvWriters& writers, const Share& q_rows) {
  const int64_t heads = r.hq + 2 * r.hk;
  for (int64_t b = q_rows.begin; b < q_rows.end; ++b) rope_items(r, b * heads + r.hk, b * heads + r.hk + r.hq);
  writers.each([&](int64_t b, int64_t kh) {
    rope_items(r, b * heads + kh, b * heads + kh + 1);
    rope_items(r, b * heads + r.hk + r.hq + kh, b * heads + r.hk + r.hq + kh + 1);
  });
}

// The cache lines a thread's rotary phase writes, asked for (to write) before the qkv product: a
// store that misses waits for its line from memory at the rotary phase, the K/V writes of a decode
// row cost ~2 us a layer there (AVX2 host).
template <typename T>
void prefetch_slots(const RopeStep<T>& r, const KvWriters& writers) {
  const int64_t heads = r.hq + 2 * r.hk, head_bytes = r.head_dim * static_cast<int64_t>(sizeof(T));
  writers.each([&](int64_t b, int64_t kh) {
    for (int64_t item : {b * heads + kh, b * heads + r.hk + r.hq + kh})
      for (int64_t off = 0; off < head_bytes; off += 64) __builtin_prefetch(r.slot_line(item, off), 1, 3);
  });
}

// Whether some row's attention reads another row's new K/V: a row's new slot in the part of another
// row's block table that holds its context. Blocks of new slots sorted, each row's table looked up.
bool reads_others_new_kv(const int64_t* slots, const int64_t* tables, int64_t width, const int64_t* lens, int64_t n,
                         int64_t block_size) {
  if (n < 2) return false;
  std::vector<std::pair<int64_t, int64_t>> fresh(n);  // (block, row) of each row's new slot
  for (int64_t b = 0; b < n; ++b) fresh[b] = {slots[b] / block_size, b};
  std::sort(fresh.begin(), fresh.end());
  for (int64_t c = 0; c < n; ++c)
    for (int64_t j = 0; j * block_size < lens[c] && j < width; ++j) {
      const int64_t block = tables[c * width + j];
      for (auto it = std::lower_bound(fresh.begin(), fresh.end(), std::make_pair(block, int64_t{0}));
           it != fresh.end() && it->first == block; ++it)
        if (it->second != c && j * block_size + slots[it->second] % block_size < lens[c]) return true;
    }
  return false;
}

// The layer's K/V are not asked for ahead of the attention here. A walk that asked for each thread's
// first 160 KiB into L2 before the qkv product compiled to nothing at every level: GCC found the
// out-of-line walk, only prefetches, free of effects and dropped the call. Made real (AVX-512 host,
// Q4_1, one stream), it cost ~1 us a layer to issue and slowed the qkv
// product about as much as it shortened the attention, and reading every K/V line right after it
// still took as long as with no walk (~150 us a step): the burst did not stay in the cache.

}  // namespace

KeptRows kept_rows(const int64_t* keep, int64_t count, int64_t rows) {
  KeptRows kept{std::vector<int64_t>(keep, keep + count), false, rows};
  for (int64_t j = 0; j < count; ++j) {
    KV_CHECK(keep[j] >= 0 && keep[j] < rows, "layer_stack: keep_rows out of range");
    kept.compact = kept.compact || keep[j] != j;
  }
  kept.compact = kept.compact || count != rows;
  if (kept.compact) kept.count = count;
  return kept;
}

template <typename T>
DecodeRun<T>::DecodeRun(const DecodeRows& rows, const StackPlan& weights, const StackKv& caches, const DecodeOut& out)
    : weights_(weights), caches_(caches), residual_(static_cast<T*>(rows.residual)), n_(rows.rows),
      h_(weights.hidden()), hq_(rows.hq), d_(caches.head_dim), f_(weights.intermediate()),
      fused_(weights.fused_mlp()), eps_(static_cast<float>(rows.eps)), scale_(rows.scale),
      compact_(rows.kept.compact), keep_(rows.kept.keep), kept_(rows.kept.count),
      // a copy per thread when some linear quantizes its rows privately: the last layer's kept rows
      // may be few even when the step's rows are many
      scratch_(n_, weights.widest_input(), kept_ <= kPrivateRows ? num_threads() : 1),
      // room for the partial sums of every segment the rows' tables can hold (the passes of a call
      // move the context lengths on; the segments of a pass come from its lengths)
      partials_(aligned_buffer<float>(max_partial_floats(n_, rows.hq, d_, rows.table_width * caches.block_size))) {
  const int64_t hq = rows.hq, hk = rows.hk;
  normed_ = aligned_buffer<T>(n_ * h_);
  qkv_ = aligned_buffer<T>(n_ * (hq + 2 * hk) * d_);
  q_ = aligned_buffer<T>(n_ * hq * d_);
  attn_ = aligned_buffer<T>(n_ * hq * d_);
  o_ = aligned_buffer<T>(n_ * h_);
  act_ = aligned_buffer<T>(n_ * f_);
  // what the caller gives (to return it), else a buffer of the step's own
  auto given_or_owned = [](void* given, Buffer<T>& owned, int64_t count) {
    if (given != nullptr) return static_cast<T*>(given);
    owned = aligned_buffer<T>(count);
    return owned.get();
  };
  carry_ = given_or_owned(out.carry, owned_carry_, n_ * h_);
  if (!fused_) gate_up_ = aligned_buffer<T>(n_ * 2 * f_);
  kept_residual_ = compact_ ? given_or_owned(out.kept_residual, owned_kept_residual_, kept_ * h_) : residual_;
  kept_attn_ = compact_ ? given_or_owned(nullptr, owned_kept_attn_, kept_ * hq * d_) : attn_.get();
  head_ = kept_ > 0 ? weights.head() : nullptr;
  if (head_ != nullptr) logits_ = given_or_owned(out.logits, owned_logits_, kept_ * head_->linear.out);
  alike_ = n_ <= kPrivateRows;
  own_width_ = 2 * n_ * h_ + 2 * n_ * hq * d_ + kept_ * (h_ + hq * d_);
  if (alike_) own_ = aligned_buffer<T>((num_threads() - 1) * own_width_);
  kv_by_items_ = alike_ && !reads_others_new_kv(rows.slots, rows.block_tables, rows.table_width, rows.context_lens,
                                                n_, caches.block_size);
  rope_ = {qkv_.get(), (hq + 2 * hk) * d_, rows.positions, rows.slots, rows.cos, rows.sin, nullptr, nullptr,
           q_.get(), hq, hk, d_};
  batch_ = {n_, hq, hk, hq / hk, rows.table_width, caches.block_size, q_.get(), nullptr, nullptr, rows.block_tables,
            rows.context_lens, attn_.get(), d_};
}

template <typename T>
typename DecodeRun<T>::Own DecodeRun<T>::own(int id) {
  Own o{residual_, normed_.get(), q_.get(), attn_.get(), kept_residual_, kept_attn_};
  if (!alike_ || id == 0) return o;
  T* p = own_.get() + (id - 1) * own_width_;
  auto take = [&p](int64_t count) {
    T* at = p;
    p += count;
    return at;
  };
  o = {take(n_ * h_), take(n_ * h_), take(n_ * hq_ * d_), take(n_ * hq_ * d_), take(kept_ * h_),
       take(kept_ * hq_ * d_)};
  if (!compact_) o.kept_residual = o.residual;
  return o;
}

template <typename T>
void DecodeRun<T>::run(const Team& team) {
  const int64_t n = n_, h = h_, hq = hq_, d = d_, layers = static_cast<int64_t>(weights_.layers());
  const bool alike = alike_;
  const Own mine = own(team.id());
  if (mine.residual != residual_) std::memcpy(mine.residual, residual_, sizeof(T) * n * h);
  // after a phase of rows: with rows alike, every thread did every row; else its share, then a barrier
  const Share rows_share = alike ? Share{0, n} : team.share(n);
  auto rows_done = [&] {
    if (!alike) team.sync();
  };
  T* o_p = o_.get();
  T* act_p = act_.get();
  T* carry_p = carry_;
  T* qkv_p = qkv_.get();
  const AttentionWork work = decode_attention_work(batch_.lens, n, batch_.hk, d, team.size());
  const Share items = team.share(work.items);
  const bool kv_by_items = kv_by_items_;
  const KvWriters writers{work, batch_.lens, n, batch_.hk, items, team.share(n * batch_.hk), kv_by_items};
  // the rows whose queries this thread rotates: those its attention items read, or its share
  Share q_rows = rows_share;
  if (alike) q_rows = items.begin < items.end ? Share{work.row_of(items.begin, batch_.hk),
                                                      work.row_of(items.end - 1, batch_.hk) + 1}
                                              : Share{0, 0};
  for (int64_t i = 0; i < layers; ++i) {
    const StackLayer& layer = weights_.plan()[i];
    norm_rows(mine.residual, i == 0 ? nullptr : carry_p, static_cast<const T*>(layer.input_norm), mine.normed, h,
              eps_, rows_share.begin, rows_share.end);
    rows_done();
    RopeStep<T> r = rope_;
    r.k_cache = static_cast<T*>(caches_.k[i]);
    r.v_cache = static_cast<T*>(caches_.v[i]);
    r.q_out = mine.q;
    prefetch_slots(r, writers);
    DecodeBatch<T> db = batch_;
    db.k = r.k_cache;
    db.v = r.v_cache;
    db.q = mine.q;
    team_linear(team, layer.qkv, mine.normed, n, qkv_p, scratch_);
    prefetch_share(team, layer.o);
    team.sync();
    rope_for_items(r, writers, q_rows);
    if (!kv_by_items) team.sync();
    decode_attention_items(db, scale_, work, partials_.get(), items.begin, items.end);
    team.sync();
    const T* attn_rows = attn_.get();
    if (work.partial) {  // the segments of a row's context merged
      db.out = mine.attn;
      const int64_t heads = work.merge_items(n, hq);
      const Share s = alike ? Share{0, heads} : team.share(heads);
      merge_attention_splits(db, work, partials_.get(), s.begin, s.end);
      rows_done();
      attn_rows = mine.attn;
    }
    T* rows = mine.residual;
    int64_t m = n;
    if (i + 1 == layers && compact_) {  // only the kept rows go on past the last attention
      const Share s = alike ? Share{0, kept_} : team.share(kept_);
      for (int64_t j = s.begin; j < s.end; ++j) {
        std::memcpy(mine.kept_residual + j * h, mine.residual + keep_[j] * h, sizeof(T) * h);
        std::memcpy(mine.kept_attn + j * hq * d, attn_rows + keep_[j] * hq * d, sizeof(T) * hq * d);
      }
      rows_done();
      rows = mine.kept_residual;
      attn_rows = mine.kept_attn;
      m = kept_;
    }
    team_linear(team, layer.o, attn_rows, m, o_p, scratch_);
    prefetch_share(team, layer.gate_up, !fused_);
    team.sync();
    const Share post = alike ? Share{0, m} : team.share(m);
    norm_rows(rows, o_p, static_cast<const T*>(layer.post_norm), mine.normed, h, eps_, post.begin, post.end);
    rows_done();
    if (fused_) team_linear(team, layer.gate_up, mine.normed, m, act_p, scratch_);
    else team_gate_up(team, layer.gate_up, mine.normed, m, gate_up_.get(), act_p, f_, scratch_);
    prefetch_share(team, layer.down);
    team.sync();
    team_linear(team, layer.down, act_p, m, carry_p, scratch_);
    if (i + 1 < layers) prefetch_share(team, weights_.plan()[i + 1].qkv);
    else if (head_ != nullptr) prefetch_share(team, head_->linear);
    team.sync();
  }
  if (head_ == nullptr) return;
  // the final norm of the kept rows and the LM head, as the model's own norm and head compute them
  const Share s = alike ? Share{0, kept_} : team.share(kept_);
  norm_rows(mine.kept_residual, carry_p, static_cast<const T*>(head_->norm), mine.normed, h, eps_, s.begin, s.end);
  rows_done();
  team_linear(team, head_->linear, mine.normed, kept_, logits_, scratch_);
}

template class DecodeRun<float>;
template class DecodeRun<kvmosaic_vec::bf16>;

template <typename T>
void decode_team(const DecodeRows& rows, const StackPlan& weights, const StackKv& caches, const DecodeOut& out) {
  DecodeRun<T> step(rows, weights, caches, out);
  run_team([&](const Team& team) { step.run(team); });
}

template void decode_team<float>(const DecodeRows&, const StackPlan&, const StackKv&, const DecodeOut&);
template void decode_team<kvmosaic_vec::bf16>(const DecodeRows&, const StackPlan&, const StackKv&, const DecodeOut&);

void StackPlan::add_layer(const StackLayer& layer, int64_t hidden) {
  const int64_t f = layer.gate_up.quantized ? layer.gate_up.out / 2 : layer.gate_up.out;
  KV_CHECK(layer.qkv.in == hidden && layer.o.out == hidden && layer.gate_up.in == hidden && layer.down.in == f &&
               layer.down.out == hidden,
           "layer_stack: layer ", plan_.size(), " has products of the wrong shapes");
  if (!plan_.empty())
    KV_CHECK(layer.gate_up.quantized == plan_[0].gate_up.quantized && f == intermediate(),
             "layer_stack: the layers' MLPs differ in kind or width");
  plan_.push_back(layer);
  for (const StackLinear* l : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) widest_ = std::max(widest_, l->in);
}

void StackPlan::set_head(const StackHead& head, int64_t hidden) {
  KV_CHECK(head.linear.in == hidden, "layer_stack: the LM head takes ", head.linear.in, " features, the layers give ",
           hidden);
  head_ = head;
}

}  // namespace kvops

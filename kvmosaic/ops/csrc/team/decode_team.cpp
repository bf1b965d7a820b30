// A step of decode rows only runs every layer in one team of threads (team.h): the kernels of a
// layer in their range form (stack_kernels.h) with barriers between them (five a layer for a few
// rows: DecodeRun in layer_stack.h), and buffers allocated once per step. Each work item computes
// what the ATen path computes, so the results are bit for bit those of the per-kernel calls. Also:
// the checks and plans of StackWeights and StackCaches.
#include "isa/amx.h"
#include "team/layer_stack.h"
#include "team/team.h"

namespace kvops {

QuantScratch::QuantScratch(int64_t rows, int64_t width, int copies)
    : rows_(rows), width_(width), codes_(copies * rows * width),
      floats_(copies * rows * QuantizedRows::floats_per_row(width)), tiles_(rows >= amx::kMinRows && amx::enabled()) {
  if (tiles_) tile_rows_.reset(new c10::BFloat16[rows * width]);
}

QuantizedRows QuantScratch::rows_for(const Team& team, int64_t m, int64_t k, bool private_copy) {
  const int64_t copy = private_copy ? team.id() : 0;
  return QuantizedRows::over(codes_.data() + copy * rows_ * width_,
                             floats_.data() + copy * rows_ * QuantizedRows::floats_per_row(width_), m, k);
}

namespace {

constexpr int64_t kPrivateRows = 4;  // up to this many rows, each thread quantizes a linear's input itself

StackLinear stack_linear(const at::Tensor* w, const float* bias, bool swiglu) {
  if (w[1].numel() == 0) {
    const PackedWeight p = PackedWeight::of(w[0], swiglu, bias);
    return {false, p, {}, p.k, p.width()};
  }
  const QuantizedWeight q = QuantizedWeight::of(w[0], w[1], w[2].numel() > 0 ? &w[2] : nullptr, bias, "layer_stack");
  return {true, {}, q, q.k, q.groups * 16};
}

void check_linear(const at::Tensor* w, at::ScalarType dtype) {
  if (w[1].numel() == 0) {
    TORCH_CHECK(w[0].scalar_type() == dtype && w[0].is_contiguous() && w[0].dim() == 2 && w[0].size(1) % 16 == 0,
                "layer_stack: packed float weights must be in the norms' dtype");
    return;
  }
  QuantizedWeight::of(w[0], w[1], w[2].numel() > 0 ? &w[2] : nullptr, nullptr, "layer_stack");
}

// The rows of x [m, in] as a quantized linear's product takes them: bf16 rows for the AMX tiles
// (float32 ones rounded by the threads together, with a barrier), or int8 rows (each thread's own
// copy of a few rows, else one copy the threads fill together, with a barrier).
struct QuantizedInput {
  const c10::BFloat16* tile_rows;  // not null: the product runs on the tiles
  QuantizedRows int8_rows;
};

template <typename T>
QuantizedInput team_input(const Team& team, const StackLinear& l, const T* x, int64_t m, QuantScratch& scratch) {
  if (amx::quantized_takes(l.quant, m, scratch.tiles())) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
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

// the first `bytes` of the codes of groups [g0, g1) of w and as many groups' scales (and mins)
void prefetch_groups(const QuantizedWeight& w, int64_t g0, int64_t g1, int64_t bytes) {
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
// first 160 KiB into L2 before the qkv product (sessions 24-30) compiled to nothing at every level:
// GCC found the out-of-line walk, only prefetches, free of effects and dropped the call. Made real
// (session 31, AVX-512 host, Q4_1, one stream), it cost ~1 us a layer to issue and slowed the qkv
// product about as much as it shortened the attention, and reading every K/V line right after it
// still took as long as with no walk (~150 us a step): the burst did not stay in the cache.

at::Tensor buffer(int64_t rows, int64_t cols, const at::Tensor& like) { return at::empty({rows, cols}, like.options()); }

}  // namespace

at::Tensor empty_logits(const StackWeights& weights, const at::Tensor& like) {
  return at::empty({0, weights.head()->linear.out}, like.options().dtype(at::kFloat));
}

namespace {

// The rows that go on past the last attention, or none when they are all rows in order.
std::vector<int64_t> rows_to_keep(const c10::optional<at::Tensor>& keep_rows, int64_t n, bool* compact) {
  std::vector<int64_t> keep;
  *compact = false;
  if (!keep_rows.has_value()) return keep;
  const at::Tensor kr = keep_rows->to(at::kLong).contiguous();
  keep.assign(kr.data_ptr<int64_t>(), kr.data_ptr<int64_t>() + kr.numel());
  for (size_t j = 0; j < keep.size(); ++j) {
    TORCH_CHECK(keep[j] >= 0 && keep[j] < n, "layer_stack: keep_rows out of range");
    *compact = *compact || keep[j] != static_cast<int64_t>(j);
  }
  *compact = *compact || static_cast<int64_t>(keep.size()) != n;
  return keep;
}

}  // namespace

template <typename T>
DecodeRun<T>::DecodeRun(at::Tensor residual, const StackWeights& weights, const StackCaches& caches,
                        const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, const c10::optional<at::Tensor>& keep_rows, int64_t hq,
                        int64_t hk, double eps, double scale)
    : weights_(weights), caches_(caches), residual_(residual), n_(residual.size(0)), h_(residual.size(1)),
      hq_(hq), d_(caches.head_dim()), f_(weights.intermediate()), fused_(weights.fused_mlp()),
      eps_(static_cast<float>(eps)), scale_(scale), keep_(rows_to_keep(keep_rows, n_, &compact_)),
      kept_(compact_ ? static_cast<int64_t>(keep_.size()) : n_),
      // a copy per thread when some linear quantizes its rows privately: the last layer's kept rows
      // may be few even when the step's rows are many
      scratch_(n_, weights.widest_input(), kept_ <= kPrivateRows ? at::get_num_threads() : 1),
      work_(decode_attention_work(n_, hk, d_, at::get_num_threads())),
      partials_(work_.partial_floats(n_, hq, d_)) {
  normed_ = buffer(n_, h_, residual);
  qkv_ = buffer(n_, (hq + 2 * hk) * d_, residual);
  q_ = buffer(n_, hq * d_, residual);
  attn_ = buffer(n_, hq * d_, residual);
  o_ = buffer(n_, h_, residual);
  act_ = buffer(n_, f_, residual);
  carry_ = buffer(n_, h_, residual);
  if (!fused_) gate_up_ = buffer(n_, 2 * f_, residual);
  kept_residual_ = compact_ ? buffer(kept_, h_, residual) : residual;
  kept_attn_ = compact_ ? buffer(kept_, hq * d_, residual) : attn_;
  head_ = kept_ > 0 ? weights.head() : nullptr;
  if (head_ != nullptr) logits_ = buffer(kept_, head_->linear.out, residual);
  alike_ = n_ <= kPrivateRows;
  own_width_ = 2 * n_ * h_ + 2 * n_ * hq * d_ + kept_ * (h_ + hq * d_);
  if (alike_) own_ = at::empty({at::get_num_threads() - 1, own_width_}, residual.options());
  kv_by_items_ = alike_ && !reads_others_new_kv(slot_mapping.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(),
                                                block_tables.size(1), context_lens.data_ptr<int64_t>(), n_,
                                                caches.block_size());
  rope_ = {qkv_.data_ptr<T>(), qkv_.stride(0), positions.data_ptr<int64_t>(), slot_mapping.data_ptr<int64_t>(),
           cos_table.data_ptr<float>(), sin_table.data_ptr<float>(), nullptr, nullptr, q_.data_ptr<T>(), hq, hk, d_};
  batch_ = {n_, hq, hk, hq / hk, block_tables.size(1), caches.block_size(), q_.data_ptr<T>(), nullptr, nullptr,
            block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), attn_.data_ptr<T>(), d_};
}

template <typename T>
typename DecodeRun<T>::Own DecodeRun<T>::own(int id) {
  Own o{residual_.data_ptr<T>(), normed_.data_ptr<T>(), q_.data_ptr<T>(), attn_.data_ptr<T>(),
        kept_residual_.data_ptr<T>(), kept_attn_.data_ptr<T>()};
  if (!alike_ || id == 0) return o;
  T* p = own_.data_ptr<T>() + (id - 1) * own_width_;
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
  if (mine.residual != residual_.data_ptr<T>()) std::memcpy(mine.residual, residual_.data_ptr<T>(), sizeof(T) * n * h);
  // after a phase of rows: with rows alike, every thread did every row; else its share, then a barrier
  const Share rows_share = alike ? Share{0, n} : team.share(n);
  auto rows_done = [&] {
    if (!alike) team.sync();
  };
  T* o_p = o_.data_ptr<T>();
  T* act_p = act_.data_ptr<T>();
  T* carry_p = carry_.data_ptr<T>();
  T* qkv_p = qkv_.data_ptr<T>();
  const AttentionWork& work = work_;
  const Share items = team.share(work.items);
  const bool kv_by_items = kv_by_items_;
  const KvWriters writers{work, batch_.lens, n, batch_.hk, items, team.share(n * batch_.hk), kv_by_items};
  // the rows whose queries this thread rotates: those its attention items read, or its share
  Share q_rows = rows_share;
  if (alike) q_rows = items.begin < items.end ? Share{work.row_of(items.begin, batch_.hk),
                                                      work.row_of(items.end - 1, batch_.hk) + 1}
                                              : Share{0, 0};
  for (int64_t i = 0; i < layers; ++i) {
    const StackWeights::Layer& layer = weights_.plan()[i];
    norm_rows(mine.residual, i == 0 ? nullptr : carry_p, static_cast<const T*>(layer.input_norm), mine.normed, h,
              eps_, rows_share.begin, rows_share.end);
    rows_done();
    RopeStep<T> r = rope_;
    r.k_cache = static_cast<T*>(caches_.k(i));
    r.v_cache = static_cast<T*>(caches_.v(i));
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
    decode_attention_items(db, scale_, work, partials_.data(), items.begin, items.end);
    team.sync();
    const T* attn_rows = attn_.data_ptr<T>();
    if (work.splits > 1) {  // the pieces of a row's context merged
      db.out = mine.attn;
      const int64_t heads = work.merge_items(n, hq);
      const Share s = alike ? Share{0, heads} : team.share(heads);
      merge_attention_splits(db, work, partials_.data(), s.begin, s.end);
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
    else team_gate_up(team, layer.gate_up, mine.normed, m, gate_up_.data_ptr<T>(), act_p, f_, scratch_);
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
  team_linear(team, head_->linear, mine.normed, kept_, logits_.data_ptr<T>(), scratch_);
}

template <typename T>
std::vector<at::Tensor> DecodeRun<T>::result() const {
  if (weights_.head() != nullptr) return {head_ != nullptr ? logits_.to(at::kFloat) : empty_logits(weights_, residual_)};
  return {kept_residual_, carry_.narrow(0, 0, kept_)};
}

template class DecodeRun<float>;
template class DecodeRun<c10::BFloat16>;

namespace {

template <typename T>
std::vector<at::Tensor> run_decode_team(at::Tensor residual, const StackWeights& weights, const StackCaches& caches,
                                        const at::Tensor& positions, const at::Tensor& cos_table,
                                        const at::Tensor& sin_table, const at::Tensor& slot_mapping,
                                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                                        const c10::optional<at::Tensor>& keep_rows, int64_t hq, int64_t hk,
                                        double eps, double scale) {
  DecodeRun<T> step(residual, weights, caches, positions, cos_table, sin_table, slot_mapping, block_tables,
                    context_lens, keep_rows, hq, hk, eps, scale);
  run_team([&](const Team& team) { step.run(team); });
  return step.result();
}

}  // namespace

StackWeights::StackWeights(std::vector<at::Tensor> tensors, std::vector<at::Tensor> head)
    : tensors_(std::move(tensors)), head_tensors_(std::move(head)) {
  TORCH_CHECK(!tensors_.empty() && tensors_.size() % kPerLayer == 0, "layer_stack: ", kPerLayer,
              " weights per layer, got ", tensors_.size());
  dtype_ = tensors_[0].scalar_type();
  TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16, "layer_stack: norms must be float32 or bfloat16");
  const int64_t h = tensors_[0].numel();
  for (size_t i = 0; i < tensors_.size(); i += kPerLayer) {
    const at::Tensor* w = tensors_.data() + i;
    for (int j : {0, 8})
      TORCH_CHECK(w[j].scalar_type() == dtype_ && w[j].is_contiguous() && w[j].numel() == h,
                  "layer_stack: every norm weight must be contiguous, of one dtype and size");
    for (int j : {1, 5, 9, 12}) check_linear(w + j, dtype_);
    const float* qkv_bias = nullptr;
    if (w[4].numel() > 0) qkv_bias = biases_.emplace_back(w[4].to(at::kFloat).contiguous()).data_ptr<float>();
    const bool fused = w[10].numel() == 0;  // a float gate/up pair is packed with SwiGLU
    const Layer layer{stack_linear(w + 1, qkv_bias, false), stack_linear(w + 5, nullptr, false),
                      stack_linear(w + 9, nullptr, fused), stack_linear(w + 12, nullptr, false), w[0].data_ptr(),
                      w[8].data_ptr()};
    if (qkv_bias != nullptr)
      TORCH_CHECK(w[4].numel() == layer.qkv.out, "layer_stack: the qkv bias does not match the projection");
    const int64_t f = fused ? layer.gate_up.out : layer.gate_up.out / 2;
    TORCH_CHECK(layer.qkv.in == h && layer.o.out == h && layer.gate_up.in == h && layer.down.in == f &&
                    layer.down.out == h,
                "layer_stack: layer ", i / kPerLayer, " has products of the wrong shapes");
    if (!plan_.empty())
      TORCH_CHECK(layer.gate_up.quantized == plan_[0].gate_up.quantized && f == intermediate(),
                  "layer_stack: the layers' MLPs differ in kind or width");
    plan_.push_back(layer);
    for (const StackLinear* l : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) widest_ = std::max(widest_, l->in);
  }
  if (head_tensors_.empty()) return;
  const at::Tensor* w = head_tensors_.data();
  TORCH_CHECK(head_tensors_.size() == 4 && w[0].scalar_type() == dtype_ && w[0].is_contiguous() && w[0].numel() == h,
              "layer_stack: the head is the final norm's weight (like the layers' norms) and a linear (3 tensors)");
  check_linear(w + 1, dtype_);
  head_ = Head{stack_linear(w + 1, nullptr, false), w[0].data_ptr()};
  TORCH_CHECK(head_->linear.in == h, "layer_stack: the LM head takes ", head_->linear.in, " features, the layers give ",
              h);
}

StackCaches::StackCaches(std::vector<at::Tensor> caches) : caches_(std::move(caches)) {
  TORCH_CHECK(!caches_.empty(), "layer_stack needs at least one layer's KV cache");
  for (at::Tensor& cache : caches_) {
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() &&
                    cache.sizes() == caches_[0].sizes() && cache.scalar_type() == caches_[0].scalar_type() &&
                    (cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16),
                "layer_stack: KV caches must be contiguous float32 / bfloat16 [2, blocks, block_size, kv_heads, "
                "head_dim], all alike");
    k_.push_back(cache.select(0, 0).data_ptr());
    v_.push_back(cache.select(0, 1).data_ptr());
  }
}

void check_decode_rows(const at::Tensor& residual, const StackWeights& weights, const StackCaches& caches,
                       const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
                       const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                       const at::Tensor& context_lens, int64_t hq, int64_t hk) {
  const int64_t n = residual.size(0), d = caches.head_dim();
  TORCH_CHECK(residual.scalar_type() == weights.dtype() && caches.dtype() == weights.dtype() &&
                  residual.is_contiguous() && residual.size(1) == weights.plan()[0].qkv.in,
              "layer_stack: residual, norms and KV caches must share a dtype and the hidden size");
  TORCH_CHECK(caches.kv_heads() == hk && hk > 0 && hq % hk == 0, "layer_stack: head counts do not match the caches");
  for (const StackWeights::Layer& layer : weights.plan())
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

std::vector<at::Tensor> decode_team(at::Tensor residual, const StackWeights& weights, const StackCaches& caches,
                                    const at::Tensor& positions, const at::Tensor& cos_table,
                                    const at::Tensor& sin_table, const at::Tensor& slot_mapping,
                                    const at::Tensor& block_tables, const at::Tensor& context_lens,
                                    const c10::optional<at::Tensor>& keep_rows, int64_t hq, int64_t hk, double eps,
                                    double scale) {
  check_decode_rows(residual, weights, caches, positions, cos_table, sin_table, slot_mapping, block_tables,
                    context_lens, hq, hk);
  if (residual.scalar_type() == at::kFloat)
    return run_decode_team<float>(residual, weights, caches, positions, cos_table, sin_table, slot_mapping,
                                  block_tables, context_lens, keep_rows, hq, hk, eps, scale);
  return run_decode_team<c10::BFloat16>(residual, weights, caches, positions, cos_table, sin_table, slot_mapping,
                                        block_tables, context_lens, keep_rows, hq, hk, eps, scale);
}

}  // namespace kvops

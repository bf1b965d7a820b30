// A step of decode rows only runs every layer in one team of threads (team.h): the kernels of a
// layer in their range form (stack_kernels.h) with a barrier between them, and buffers allocated
// once per step. Each work item computes what the ATen path computes, so the results are bit for bit
// those of the per-kernel calls. Also: the checks and plans of StackWeights and StackCaches.
#include "layer_stack.h"
#include "team.h"

namespace kvops {

QuantScratch::QuantScratch(int64_t rows, int64_t width, int copies)
    : rows_(rows), width_(width), codes_(copies * rows * width),
      floats_(copies * rows * QuantizedRows::floats_per_row(width)) {}

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

// The first bytes of this thread's share of a quantized linear's weights, asked for into L2 before the
// barrier in front of that linear: the faster thread waits there, and the short kernels between two
// products (norm, rotary, attention) leave the memory idle. Measured on the default model, Q4_1, one
// stream, AVX-512 host: 281 -> 297 tok/s (best of 3 runs each, 3 interleaved rounds); 8 to 128 KiB
// all gave about the same. (The products' own prefetch ahead: qlinear.cpp's kStreamAhead.)
constexpr int64_t kPrefetchBytes = 16 << 10;

void prefetch_share(const Team& team, const StackLinear& l) {
  if (!l.quantized) return;
  const QuantizedWeight& w = l.quant;
  const int64_t group_bytes = w.group_code_bytes(), scale_bytes = w.group_scale_bytes();
  const Share s = team.share(w.groups);
  const int64_t groups = std::min<int64_t>(s.end - s.begin, std::max<int64_t>(1, kPrefetchBytes / group_bytes));
  const char* codes = reinterpret_cast<const char*>(w.codes) + s.begin * group_bytes;
  for (int64_t b = 0; b < groups * group_bytes; b += 64) __builtin_prefetch(codes + b, 0, 2);
  const char* sc = static_cast<const char*>(w.scale) + s.begin * scale_bytes;
  const char* mn = w.mins != nullptr ? static_cast<const char*>(w.mins) + s.begin * scale_bytes : nullptr;
  for (int64_t b = 0; b < groups * scale_bytes; b += 64) {
    __builtin_prefetch(sc + b, 0, 2);
    if (mn != nullptr) __builtin_prefetch(mn + b, 0, 2);
  }
}

// The cache lines this thread's share of the rotary phase writes, asked for (to write) before the qkv
// product: a store that misses waits for its line from memory at the rotary phase, the K/V writes
// of a decode row cost ~2 us a layer there (AVX2 host).
template <typename T>
void prefetch_slots(const Team& team, const RopeStep<T>& r, int64_t rows) {
  const Share s = team.share(r.items(rows));
  const int64_t head_bytes = r.head_dim * static_cast<int64_t>(sizeof(T));
  for (int64_t item = s.begin; item < s.end; ++item) {
    if (r.slot_line(item, 0) == nullptr) continue;  // a q head: written to this step's buffer
    for (int64_t b = 0; b < head_bytes; b += 64) __builtin_prefetch(r.slot_line(item, b), 1, 3);
  }
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
  rope_ = {qkv_.data_ptr<T>(), qkv_.stride(0), positions.data_ptr<int64_t>(), slot_mapping.data_ptr<int64_t>(),
           cos_table.data_ptr<float>(), sin_table.data_ptr<float>(), nullptr, nullptr, q_.data_ptr<T>(), hq, hk, d_};
  batch_ = {n_, hq, hk, hq / hk, block_tables.size(1), caches.block_size(), q_.data_ptr<T>(), nullptr, nullptr,
            block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), attn_.data_ptr<T>(), d_};
}

template <typename T>
void DecodeRun<T>::run(const Team& team) {
  const int64_t n = n_, h = h_, hq = hq_, d = d_, f = f_, layers = static_cast<int64_t>(weights_.layers());
  const bool fused = fused_;
  const float feps = eps_;
  T* res = residual_.data_ptr<T>();
  T* normed_p = normed_.data_ptr<T>();
  T* attn_p = attn_.data_ptr<T>();
  T* o_p = o_.data_ptr<T>();
  T* act_p = act_.data_ptr<T>();
  T* carry_p = carry_.data_ptr<T>();
  T* gate_up_p = fused ? nullptr : gate_up_.data_ptr<T>();
  T* kept_res_p = kept_residual_.data_ptr<T>();
  T* kept_attn_p = kept_attn_.data_ptr<T>();
  T* qkv_p = qkv_.data_ptr<T>();
  T* logits_p = head_ != nullptr ? logits_.data_ptr<T>() : nullptr;
  const AttentionWork& work = work_;
  QuantScratch& scratch = scratch_;
  for (int64_t i = 0; i < layers; ++i) {
    const StackWeights::Layer& layer = weights_.plan()[i];
    Share s = team.share(n);
    norm_rows(res, i == 0 ? nullptr : carry_p, static_cast<const T*>(layer.input_norm), normed_p, h, feps,
              s.begin, s.end);
    if (i == 0) prefetch_share(team, layer.qkv);
    RopeStep<T> r = rope_;
    r.k_cache = static_cast<T*>(caches_.k(i));
    r.v_cache = static_cast<T*>(caches_.v(i));
    prefetch_slots(team, r, n);
    DecodeBatch<T> db = batch_;
    db.k = r.k_cache;
    db.v = r.v_cache;
    team.sync();
    team_linear(team, layer.qkv, normed_p, n, qkv_p, scratch);
    prefetch_share(team, layer.o);
    team.sync();
    s = team.share(r.items(n));
    rope_items(r, s.begin, s.end);
    team.sync();
    s = team.share(work.items);
    decode_attention_items(db, scale_, work, partials_.data(), s.begin, s.end);
    team.sync();
    if (work.splits > 1) {
      s = team.share(work.merge_items(n, hq));
      merge_attention_splits(db, work, partials_.data(), s.begin, s.end);
      team.sync();
    }
    T* rows = res;
    const T* attn_rows = attn_p;
    int64_t m = n;
    if (i + 1 == layers && compact_) {  // only the kept rows go on past the last attention
      if (team.leader()) {
        for (int64_t j = 0; j < kept_; ++j) {
          std::memcpy(kept_res_p + j * h, res + keep_[j] * h, sizeof(T) * h);
          std::memcpy(kept_attn_p + j * hq * d, attn_p + keep_[j] * hq * d, sizeof(T) * hq * d);
        }
      }
      team.sync();
      rows = kept_res_p;
      attn_rows = kept_attn_p;
      m = kept_;
    }
    team_linear(team, layer.o, attn_rows, m, o_p, scratch);
    prefetch_share(team, layer.gate_up);
    team.sync();
    s = team.share(m);
    norm_rows(rows, o_p, static_cast<const T*>(layer.post_norm), normed_p, h, feps, s.begin, s.end);
    team.sync();
    if (fused) {
      team_linear(team, layer.gate_up, normed_p, m, act_p, scratch);
      prefetch_share(team, layer.down);
    } else {
      team_linear(team, layer.gate_up, normed_p, m, gate_up_p, scratch);
      team.sync();
      s = team.share(silu_work(m, f));
      silu_items(gate_up_p, f, act_p, s.begin, s.end);
    }
    team.sync();
    team_linear(team, layer.down, act_p, m, carry_p, scratch);
    if (i + 1 < layers) prefetch_share(team, weights_.plan()[i + 1].qkv);
    else if (head_ != nullptr) prefetch_share(team, head_->linear);
    team.sync();
  }
  if (head_ == nullptr) return;
  // the final norm of the kept rows and the LM head, as the model's own norm and head compute them
  const Share s = team.share(kept_);
  norm_rows(kept_res_p, carry_p, static_cast<const T*>(head_->norm), normed_p, h, feps, s.begin, s.end);
  team.sync();
  team_linear(team, head_->linear, normed_p, kept_, logits_p, scratch);
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

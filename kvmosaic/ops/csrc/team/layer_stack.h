// What ops.layer_stack takes besides a step's rows: the decoder layers' weights and the KV caches,
// each checked and planned once (when the model and the attention backend are built), so that a
// step pays neither the conversion of ~450 tensors from a Python list nor their checks.
#pragma once

#include <memory>
#include <optional>

#include "common/ops_common.h"
#include "layer/stack_kernels.h"

namespace kvops {

// input norm, qkv (3), qkv bias, o (3), post norm, gate/up (3), down (3); a linear is (weight, scales, extra)
constexpr size_t kPerLayer = 15;

struct StackLinear {  // one product of the stack on packed float or quantized weights
  bool quantized;
  PackedWeight packed;
  QuantizedWeight quant;
  int64_t in, out;  // features; a packed gate/up pair's out is the SwiGLU width
};

class StackWeights {
 public:
  struct Layer {
    StackLinear qkv, o, gate_up, down;
    const void* input_norm;
    const void* post_norm;
  };

  struct Head {  // the final norm and the LM head, run after the last layer when given
    StackLinear linear;
    const void* norm;
  };

  // kPerLayer tensors per layer in the order above: an empty tensor for no qkv bias; a packed float
  // linear has empty scales and extra, a q8 one an empty extra (q4: its mins, q6: its super-block
  // scales); a float gate/up pair is packed with SwiGLU. head: empty, or the final norm's weight and
  // the LM head as a linear (weight, scales, extra); with it a step returns the kept rows' logits.
  explicit StackWeights(std::vector<at::Tensor> tensors, std::vector<at::Tensor> head = {});
  const std::vector<at::Tensor>& tensors() const { return tensors_; }
  const std::vector<at::Tensor>& head_tensors() const { return head_tensors_; }
  const Head* head() const { return head_.has_value() ? &*head_ : nullptr; }
  const std::vector<Layer>& plan() const { return plan_; }
  size_t layers() const { return plan_.size(); }
  at::ScalarType dtype() const { return dtype_; }  // of the norms and packed float weights
  bool fused_mlp() const { return !plan_[0].gate_up.quantized; }
  int64_t intermediate() const { return fused_mlp() ? plan_[0].gate_up.out : plan_[0].gate_up.out / 2; }
  int64_t widest_input() const { return widest_; }

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<at::Tensor> biases_;  // float32 copies of the qkv biases
  std::vector<Layer> plan_;
  std::vector<at::Tensor> head_tensors_;
  std::optional<Head> head_;
  at::ScalarType dtype_;
  int64_t widest_ = 0;
};

class StackCaches {
 public:
  // One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer.
  explicit StackCaches(std::vector<at::Tensor> caches);
  const std::vector<at::Tensor>& tensors() const { return caches_; }
  size_t layers() const { return caches_.size(); }
  at::ScalarType dtype() const { return caches_[0].scalar_type(); }
  int64_t block_size() const { return caches_[0].size(2); }
  int64_t kv_heads() const { return caches_[0].size(3); }
  int64_t head_dim() const { return caches_[0].size(4); }
  void* k(size_t layer) const { return k_[layer]; }
  void* v(size_t layer) const { return v_[layer]; }

 private:
  std::vector<at::Tensor> caches_;
  std::vector<void*> k_, v_;
};

// [0, vocab] float32 logits: a step that keeps no row past the last attention.
at::Tensor empty_logits(const StackWeights& weights, const at::Tensor& like);

class Team;

// The activations of a quantized linear as its product takes them. For the int8 dot products: one
// copy per thread when every thread quantizes the (few) rows itself, else one shared copy that the
// threads fill row by row. For the AMX tiles (amx.h): bf16 rows, float32 ones rounded into one
// shared copy (made only for a step of enough rows on a CPU with tiles).
class QuantScratch {
 public:
  QuantScratch(int64_t rows, int64_t width, int copies);
  QuantizedRows rows_for(const Team& team, int64_t m, int64_t k, bool private_copy);
  // whether the tiles take this step's quantized products (amx::enabled() when the scratch was made:
  // one answer for every thread of the team)
  bool tiles() const { return tiles_; }
  c10::BFloat16* tile_rows() { return tile_rows_.get(); }

 private:
  int64_t rows_, width_;
  std::vector<int8_t> codes_;
  std::vector<float> floats_;
  bool tiles_;
  std::unique_ptr<c10::BFloat16[]> tile_rows_;  // [rows, width] when tiles_, not zeroed
};

// A step of decode rows (decode_team.cpp): its buffers and plans, built once, and run() (every
// layer, then the head when the weights hold one) by each thread of a team; the caller syncs after
// it. It reads its inputs from the tensors it was built with (the residual rows, positions, slots,
// context lengths), so rewriting them runs it again for the next token (ops.decode_passes).
//
// A layer has five barriers, one after each phase whose output every thread reads in full: the qkv
// product, the attention, the o product, the gate/up product (with its SwiGLU) and the down product.
// With a few rows (kPrivateRows), what lies between two of them and is small (the norms, the rotary
// of the queries, the merge of a lone row's attention pieces) every thread computes for itself,
// alike, into rows of its own, and a quantized gate/up pair is split so that each thread has the
// gate and up of the same columns. With more rows, a thread takes a share of those phases too,
// and a barrier follows each. Ten barriers a layer before (session 36, AVX-512 host, Q4_1, one
// stream, the two schedules alternated step by step in one process): op medians 3% lower.
template <typename T>
class DecodeRun {
 public:
  DecodeRun(at::Tensor residual, const StackWeights& weights, const StackCaches& caches, const at::Tensor& positions,
            const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& slot_mapping,
            const at::Tensor& block_tables, const at::Tensor& context_lens,
            const c10::optional<at::Tensor>& keep_rows, int64_t hq, int64_t hk, double eps, double scale);
  void run(const Team& team);
  // [float32 logits] when the weights hold the head, else (residual, delta) of the kept rows
  std::vector<at::Tensor> result() const;
  const T* logits() const { return head_ != nullptr ? logits_.data_ptr<T>() : nullptr; }  // [kept, vocab]

 private:
  const StackWeights& weights_;
  const StackCaches& caches_;
  at::Tensor residual_;
  int64_t n_, h_, hq_, d_, f_;
  bool fused_;
  float eps_;
  double scale_;
  bool compact_ = false;
  std::vector<int64_t> keep_;
  int64_t kept_;
  QuantScratch scratch_;
  AttentionWork work_;
  std::vector<float> partials_;
  at::Tensor normed_, qkv_, q_, attn_, o_, act_, carry_, gate_up_, kept_residual_, kept_attn_, logits_;
  const StackWeights::Head* head_ = nullptr;
  RopeStep<T> rope_;
  DecodeBatch<T> batch_;
  // a thread's own rows: the residual (thread 0's is the step's), its norm, the rotated queries of
  // the rows its attention reads, the merged attention of a lone row, the kept rows past the last layer
  struct Own {
    T* residual;
    T* normed;
    T* q;
    T* attn;
    T* kept_residual;
    T* kept_attn;
  };
  Own own(int id);
  at::Tensor own_;  // [threads, own_width_]
  int64_t own_width_;
  bool alike_;        // few rows: every thread computes the small phases for itself (above)
  bool kv_by_items_;  // rows alike and none reads another row's new K/V (KvWriters in decode_team.cpp)
};

// What decode_team needs of its inputs (the checks that can fail; the caller's checks aside).
void check_decode_rows(const at::Tensor& residual, const StackWeights& weights, const StackCaches& caches,
                       const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
                       const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                       const at::Tensor& context_lens, int64_t hq, int64_t hk);

// A step of decode rows only, in one team of threads (decode_team.cpp). Inputs checked by the caller.
std::vector<at::Tensor> decode_team(at::Tensor residual, const StackWeights& weights, const StackCaches& caches,
                                    const at::Tensor& positions, const at::Tensor& cos_table,
                                    const at::Tensor& sin_table, const at::Tensor& slot_mapping,
                                    const at::Tensor& block_tables, const at::Tensor& context_lens,
                                    const c10::optional<at::Tensor>& keep_rows, int64_t hq, int64_t hk, double eps,
                                    double scale);

}  // namespace kvops

std::vector<at::Tensor> layer_stack(at::Tensor residual, const kvops::StackWeights& weights,
                                    const kvops::StackCaches& caches, const at::Tensor& positions,
                                    const at::Tensor& cos_table, const at::Tensor& sin_table,
                                    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                    const at::Tensor& context_lens, const at::Tensor& spans,
                                    const std::vector<at::Tensor>& span_tables,
                                    const c10::optional<at::Tensor>& keep_rows, int64_t hq, int64_t hk, double eps,
                                    double scale);

// Greedy passes of decode rows (decode_passes.cpp), from each row's token id, with rows of `dtype`:
// [passes run, rows] tokens.
at::Tensor decode_passes(const at::Tensor& input_ids, at::ScalarType dtype, const kvops::StackWeights& weights,
                         const kvops::StackCaches& caches, const at::Tensor& positions, const at::Tensor& cos_table,
                         const at::Tensor& sin_table, const at::Tensor& block_tables,
                         const std::vector<at::Tensor>& embedding, const std::vector<int64_t>& stop_ids, int64_t passes,
                         int64_t hq, int64_t hk, double eps, double scale);

// What ops.layer_stack takes besides a step's rows, as the decode team reads it: the decoder layers'
// weights and the KV caches as raw pointers and sizes, checked and planned once (when the model and
// the attention backend are built; bind/team_bind.h makes them from the tensors, which it keeps
// alive), so that a step pays neither the conversion of ~450 tensors from a Python list nor their
// checks. Then a step of decode rows over them (DecodeRun) and the greedy passes (decode_passes).
// No PyTorch header: the binding side checks the tensors and hands over their pointers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <optional>
#include <vector>

#include "common/check.h"
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

struct StackLayer {
  StackLinear qkv, o, gate_up, down;
  const void* input_norm;  // [hidden] in the rows' dtype
  const void* post_norm;
};

struct StackHead {  // the final norm and the LM head, run after the last layer when given
  StackLinear linear;
  const void* norm;
};

// The layers' products, checked against each other as they are added (the tensors' own checks are
// the binding side's).
class StackPlan {
 public:
  // a layer of `hidden` features: its products must chain, and its MLP be of the first layer's kind and width
  void add_layer(const StackLayer& layer, int64_t hidden);
  // the final norm and LM head after the last layer
  void set_head(const StackHead& head, int64_t hidden);
  const StackHead* head() const { return head_.has_value() ? &*head_ : nullptr; }
  const std::vector<StackLayer>& plan() const { return plan_; }
  size_t layers() const { return plan_.size(); }
  int64_t hidden() const { return plan_[0].qkv.in; }
  bool fused_mlp() const { return !plan_[0].gate_up.quantized; }
  int64_t intermediate() const { return fused_mlp() ? plan_[0].gate_up.out : plan_[0].gate_up.out / 2; }
  int64_t widest_input() const { return widest_; }

 private:
  std::vector<StackLayer> plan_;
  std::optional<StackHead> head_;
  int64_t widest_ = 0;
};

// The layers' KV caches: per layer the K and V halves of a [2, blocks, block_size, kv_heads, head_dim]
// cache, all alike, in the rows' dtype.
struct StackKv {
  std::vector<void*> k, v;
  int64_t block_size = 0, kv_heads = 0, head_dim = 0;
  size_t layers() const { return k.size(); }
};

class Team;

// An uninitialised buffer of T, 64-byte aligned as PyTorch's CPU allocator aligns a tensor's data.
struct FreeAligned {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using Buffer = std::unique_ptr<T[], FreeAligned>;

template <typename T>
Buffer<T> aligned_buffer(int64_t count) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr) throw std::bad_alloc();
  return Buffer<T>(static_cast<T*>(p));
}

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
  kvmosaic_vec::bf16* tile_rows() { return tile_rows_.get(); }

 private:
  int64_t rows_, width_;
  std::vector<int8_t> codes_;
  std::vector<float> floats_;
  bool tiles_;
  Buffer<kvmosaic_vec::bf16> tile_rows_;  // [rows, width] when tiles_, not zeroed
};

// The rows that go on past the last attention: all of them in order (compact false), or keep's.
struct KeptRows {
  std::vector<int64_t> keep;
  bool compact = false;
  int64_t count = 0;
};
inline KeptRows all_rows(int64_t rows) { return {{}, false, rows}; }
// rows keep [count] of `rows` rows, each checked to be one of them
KeptRows kept_rows(const int64_t* keep, int64_t count, int64_t rows);

// A step's decode rows as DecodeRun reads them, checked by the caller against the plan and caches.
struct DecodeRows {
  void* residual;  // [rows, hidden] in the rows' dtype, updated in place
  int64_t rows;
  const int64_t* positions;     // [rows]
  const int64_t* slots;         // [rows]: each row's new K/V slot
  const int64_t* block_tables;  // [rows, table_width]
  int64_t table_width;
  const int64_t* context_lens;  // [rows]
  const float* cos;             // [positions, head_dim / 2]
  const float* sin;
  KeptRows kept;
  int64_t hq, hk;
  double eps, scale;
};

// Where a step leaves what outlives it, in the rows' dtype; a null one is a buffer of the step's own.
struct DecodeOut {
  void* carry = nullptr;          // [rows, hidden]: the last layer's MLP output in its first kept.count rows
  void* kept_residual = nullptr;  // [kept.count, hidden], when kept.compact (else the residual is)
  void* logits = nullptr;         // [kept.count, vocab], when the plan has a head
};

// A step of decode rows (decode_team.cpp): its buffers and plans, built once, and run() (every
// layer, then the head when the weights hold one) by each thread of a team; the caller syncs after
// it. It reads its inputs from the rows it was built with (the residual rows, positions, slots,
// context lengths), so rewriting them runs it again for the next token (decode_passes).
//
// A layer has five barriers, one after each phase whose output every thread reads in full: the qkv
// product, the attention, the o product, the gate/up product (with its SwiGLU) and the down product.
// With a few rows (kPrivateRows), what lies between two of them and is small (the norms, the rotary
// of the queries, the merge of a lone row's attention pieces) every thread computes for itself,
// alike, into rows of its own, and a quantized gate/up pair is split so that each thread has the
// gate and up of the same columns. With more rows, a thread takes a share of those phases too,
// and a barrier follows each. Against ten barriers a layer (AVX-512 host, Q4_1, one stream, the
// two schedules alternated step by step in one process): op medians 3% lower.
template <typename T>
class DecodeRun {
 public:
  DecodeRun(const DecodeRows& rows, const StackPlan& weights, const StackKv& caches, const DecodeOut& out = {});
  void run(const Team& team);
  const T* logits() const { return head_ != nullptr ? logits_ : nullptr; }  // [kept, vocab]

 private:
  const StackPlan& weights_;
  const StackKv& caches_;
  T* residual_;
  int64_t n_, h_, hq_, d_, f_;
  bool fused_;
  float eps_;
  double scale_;
  bool compact_;
  std::vector<int64_t> keep_;
  int64_t kept_;
  QuantScratch scratch_;
  Buffer<float> partials_;
  Buffer<T> normed_, qkv_, q_, attn_, o_, act_, gate_up_;
  Buffer<T> owned_carry_, owned_kept_residual_, owned_kept_attn_, owned_logits_;
  T* carry_;          // DecodeOut's or owned_carry_
  T* kept_residual_;  // the residual, DecodeOut's or owned_kept_residual_
  T* kept_attn_;      // attn_ or owned_kept_attn_
  T* logits_ = nullptr;
  const StackHead* head_ = nullptr;
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
  Buffer<T> own_;  // [threads - 1, own_width_] when alike_
  int64_t own_width_;
  bool alike_;        // few rows: every thread computes the small phases for itself (above)
  bool kv_by_items_;  // rows alike and none reads another row's new K/V (KvWriters in decode_team.cpp)
};

// A step of decode rows only, in one team of threads (decode_team.cpp); T is float or
// kvmosaic_vec::bf16. Inputs checked by the caller.
template <typename T>
void decode_team(const DecodeRows& rows, const StackPlan& weights, const StackKv& caches, const DecodeOut& out);

// The token embedding as decode_passes reads it: a float table in the rows' dtype, or a packed
// quantized LM head's when the embedding is tied to it.
struct TokenEmbedding {
  const void* table = nullptr;  // float table [rows, width]
  QuantizedWeight quant{};
  bool quantized = false;
  int64_t rows = 0;
  int64_t width = 0;  // the hidden size
};

// The rows of greedy decode passes (one row per sequence), checked by the caller.
struct PassRows {
  const int64_t* first;  // [rows] each row's token
  void* residual;        // [rows, hidden] in the rows' dtype, written
  int64_t rows;
  int64_t* positions;           // [rows] each row's first position, moved on pass by pass
  const int64_t* block_tables;  // [rows, table_width], with room for every pass's slot
  int64_t table_width;
  const float* cos;
  const float* sin;
  int64_t hq, hk;
  double eps, scale;
};

// Greedy passes of decode rows (decode_passes.cpp): up to `passes` passes, each row's argmax fed back
// as its next token, stopping after a pass where some row gives one of `stops`; tokens [passes, rows]
// gets each pass's tokens. Returns the passes run. The plan must hold the head.
template <typename T>
int64_t decode_passes(const PassRows& rows, const StackPlan& weights, const StackKv& caches,
                      const TokenEmbedding& embedding, const std::vector<int64_t>& stops, int64_t passes,
                      int64_t* tokens);

}  // namespace kvops

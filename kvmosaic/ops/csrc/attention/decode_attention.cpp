// Decode attention over the paged float KV cache, read in place (no gather copy): one query token
// per sequence, an online softmax in one pass over the context.
#include "attention/attention.h"
#include "attention/row_attention.h"
#include "common/ops_common.h"
#include "common/parallel.h"
#include "isa/vec.h"
#include "layer/stack_kernels.h"

#include <memory>

#include <unistd.h>

#include <numeric>
#include <utility>

namespace {

using namespace kvops;
namespace vec = kvmosaic_vec;
namespace rows = kvops::rows;

// Widen one row to float. The bf16 case is a plain shift so the compiler vectorizes it.
inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void load_row(const vec::bf16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}


// Work item = one KV head of one sequence, with its query heads.
template <typename T>
void generic_items(const DecodeBatch<T>& db, float fscale, int64_t begin, int64_t end) {
  const auto [batch, hq, hk, group, width, block_size, q_ptr, kc, vc, tables, lens, o_ptr, d] = db;
  const int64_t slot_stride = hk * d;
  int64_t max_ctx = 0;
  for (int64_t item = begin; item < end; ++item) max_ctx = std::max(max_ctx, lens[item / hk]);
  {
    std::vector<float> qf(group * d), acc(group * d), row(d), scores(group * max_ctx);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hk, h = item % hk;
      const int64_t ctx = lens[b];
      for (int64_t g = 0; g < group; ++g) {
        load_row(q_ptr + (b * hq + h * group + g) * d, qf.data() + g * d, d);
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] *= fscale;
      }
      // scores[g][t] = q_g . k_t, reading each K row from its block in place
      for (int64_t t = 0; t < ctx; ++t) {
        load_row(kc + slot_of(tables + b * width, t, block_size) * slot_stride + h * d, row.data(), d);
        for (int64_t g = 0; g < group; ++g) {
          const float* qv = qf.data() + g * d;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < d; ++i) dot += qv[i] * row[i];
          scores[g * ctx + t] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sc = scores.data() + g * ctx;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < ctx; ++t) mx = std::max(mx, sc[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < ctx; ++t) {
          sc[t] = vec::exp_nonpositive(sc[t] - mx);
          sum += sc[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < ctx; ++t) sc[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        load_row(vc + slot_of(tables + b * width, t, block_size) * slot_stride + h * d, row.data(), d);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * ctx + t];
          float* a = acc.data() + g * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) a[i] += p * row[i];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = o_ptr + (b * hq + h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) store(dst + i, acc[g * d + i]);
      }
    }
  }
}

// Whether the register kernel asks for its K/V rows into L1 rather than L2: where the L1 data cache
// holds 48 KiB or more. On a Zen 5 AVX-512 host (48 KiB L1D), Q4_1 weights, one stream,
// float32 KV, in-process interleaved rounds against L2: 1.08x at a 2048-token context (8 rounds,
// 1.02-1.14x each), 1.02x at 128 tokens; bfloat16 KV (half the bytes ahead) 1.00x. Hosts with a
// smaller L1D (32 KiB: Zen 3, Zen 4) keep L2, as before this rule: the two chunks ahead are 48 KiB
// of float32 K/V for the default model, more than their L1D.
bool kv_prefetch_to_l1() {
#if defined(_SC_LEVEL1_DCACHE_SIZE)
  static const bool to_l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE) >= (48 << 10);
  return to_l1;
#else
  return false;
#endif
}

// One line asked for into L1 or L2 (kv_prefetch_to_l1). On x86 an asm statement: GCC deleted the
// loop of __builtin_prefetch calls in vec_items (no prefetch instruction left in the object file,
// and a 2048-token context read from memory 1.3x slower), as it may delete any loop that only
// prefetches. Elsewhere vec.h's prefetches.
inline void prefetch_line(const char* line, bool to_l1) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (to_l1)
    asm volatile("prefetcht0 %0" : : "m"(*line));
  else
    asm volatile("prefetcht1 %0" : : "m"(*line));
#else
  if (to_l1)
    vec::prefetch_l1(line);
  else
    vec::prefetch_l2(line);
#endif
}

// The tokens [t_begin, t_end) of sequence b that a work item of the register kernel covers: segment
// `segment` of its context (rows::kSegment tokens from position segment * kSegment)
struct Piece {
  int64_t b, segment, t_begin, t_end;
  int64_t chunks() const { return (t_end - t_begin + 15) / 16; }
  static Piece of(const int64_t* lens, const AttentionWork& work, int64_t item) {
    const int64_t b = work.row_of(item, 0), segment = item / work.head_groups - work.first[b], ctx = lens[b];
    const int64_t t_begin = std::min(ctx, segment * rows::kSegment);
    return {b, segment, t_begin, std::min(ctx, t_begin + rows::kSegment)};
  }
};

// Decode attention with the head dimension in registers (NC vectors of 16 floats), in one pass over
// each segment of the context with an online softmax (row_attention.h's arithmetic). One work item is
// one segment of a sequence with its KV heads (all, or one): its K/V rows are read from their blocks in
// place, the item's KV heads of a slot together, sixteen tokens at a time, with the chunk after next
// prefetched. Items of a sequence with several segments leave partial sums, merged after.
template <typename T, int NC>
void vec_items(const DecodeBatch<T>& db, float scale, const AttentionWork& work, float* partials, int64_t begin,
               int64_t end) {
  constexpr int64_t D = NC * 16;
  const auto [batch, hq, hk, group, width, block_size, q_ptr, kc, vc, tables, lens, o_ptr, head_dim] = db;
  const int64_t slot_stride = hk * D;
  const vec::F16 vscale = vec::F16::set1(scale);
  const bool to_l1 = kv_prefetch_to_l1();
  {
    std::vector<rows::QueryDot<T, NC>> qd(hq);
    std::vector<const rows::QueryDot<T, NC>*> qp(hq);
    for (int64_t h = 0; h < hq; ++h) qp[h] = qd.data() + h;
    std::vector<vec::F16> part(group * 16), acc(hq * NC);
    std::vector<vec::OnlineSoftmax> softmax(hq);
    std::vector<float> probs(hq * 16);
    int64_t slots[16], ahead_slots[16];
    auto piece_of = [&](int64_t item) { return Piece::of(lens, work, item); };
    // the slots of chunk c of a piece into `out`; returns how many (none past its end)
    auto chunk_slots = [&](const Piece& p, int64_t c, int64_t* out) {
      const int64_t* tb = tables + p.b * width;
      const int64_t from = p.t_begin + 16 * c, to = std::min(p.t_end, from + 16);
      for (int64_t t = from; t < to; ++t) out[t - from] = slot_of(tb, t, block_size);
      return std::max<int64_t>(0, to - from);
    };
    for (int64_t item = begin; item < end; ++item) {
      const Piece piece = piece_of(item);
      const int64_t b = piece.b, t_begin = piece.t_begin, t_end = piece.t_end, unit = item / work.head_groups;
      const int64_t kh0 = item % work.head_groups * work.heads_per_item;
      const int64_t kh1 = std::min(hk, kh0 + work.heads_per_item), h0 = kh0 * group, h1 = kh1 * group;
      for (int64_t h = h0; h < h1; ++h) {
        qd[h].load(q_ptr + (b * hq + h) * D);
        softmax[h] = vec::OnlineSoftmax();
        for (int c = 0; c < NC; ++c) acc[h * NC + c] = vec::F16::zero();
      }
      for (int64_t t0 = t_begin; t0 < t_end; t0 += 16) {
        const int64_t n = chunk_slots(piece, (t0 - t_begin) / 16, slots);
        const vec::Mask valid = vec::first_lanes(static_cast<int>(n));
        // the rows two chunks ahead (past the item's end: the next item's first ones) are prefetched
        // (into L1 or L2: kv_prefetch_to_l1), spread evenly over the score loop below in address
        // order: its call c = kh * 16 + j asks for part c % hk (a head's bytes) of the K and V of
        // row c / hk. One chunk ahead, or in one burst, left the loads waiting on memory (1.5x slower
        // in bf16, measured). The slots come from the block table once a chunk; a list of every line
        // built ahead instead cost ~15% of the kernel's time with its K/V in cache.
        const int64_t ahead = (t0 - t_begin) / 16 + 2;
        int64_t n_ahead = 0;
        if (ahead < piece.chunks()) n_ahead = chunk_slots(piece, ahead, ahead_slots);
        else if (item + 1 < end) n_ahead = chunk_slots(piece_of(item + 1), ahead - piece.chunks(), ahead_slots);
        int64_t ahead_row = 0, ahead_part = kh0;  // what the next score call asks for: a row's part (KV head)
        auto prefetch_row = [&](int64_t) {
          if (ahead_row >= n_ahead) return;
          const int64_t at = ahead_slots[ahead_row] * slot_stride + ahead_part * D;
          if (++ahead_part == kh1) {
            ahead_part = kh0;
            ++ahead_row;
          }
          const char* k = reinterpret_cast<const char*>(kc + at);
          const char* v = reinterpret_cast<const char*>(vc + at);
          for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64) {
            prefetch_line(k + off, to_l1);
            prefetch_line(v + off, to_l1);
          }
        };
        // scores of the sixteen tokens for every head, folded into the running softmax
        for (int64_t kh = kh0; kh < kh1; ++kh) {
          rows::tile_scores<T, NC>(qp.data() + kh * group, group, kc + kh * D, slots, n, slot_stride, part.data(),
                                   prefetch_row);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kh * group + g;
            rows::fold_tile<NC>(part.data() + g * 16, vscale, valid, softmax[h], acc.data() + h * NC,
                                probs.data() + h * 16);
          }
        }
        // acc[h] += p[h][j] * v_j, a few heads at a time with their accumulators in registers
        for (int64_t kh = kh0; kh < kh1; ++kh)
          rows::pv_rows<T, NC>(vc + kh * D, slots, n, slot_stride, probs.data() + kh * group * 16,
                               acc.data() + kh * group * NC, group);
      }
      for (int64_t h = h0; h < h1; ++h) {
        if (work.partial)  // unscaled sums, the softmax reference and total, for merge_attention_splits
          rows::store_partial(acc.data() + h * NC, D, softmax[h], partials + (unit * hq + h) * (D + 2));
        else
          rows::store_normalised(acc.data() + h * NC, D, softmax[h], o_ptr + (b * hq + h) * D);
      }
    }
  }
}

}  // namespace

namespace kvops {

// The register-blocked kernel takes head_dim 64 / 128; other head sizes take the generic loop, one
// item per KV head. An item of the register kernel is a segment of a sequence's context with all its
// KV heads, or with fewer segments than threads (single-stream decode) one KV head each: a context is
// never cut by the thread count, so that its result does not depend on it. (Items of one KV head read
// 256 of every 768 bytes of a slot with the default model: 1.1-1.9x slower than whole slots at 1024
// tokens of context, AVX2 host, Q4_1, interleaved runs; so whole slots wherever the threads have
// enough items.)
AttentionWork decode_attention_work(const int64_t* lens, int64_t batch, int64_t hk, int64_t head_dim, int threads,
                                    bool force_partial) {
  AttentionWork work;
  if (head_dim != 64 && head_dim != 128) {
    work.items = batch * hk;
    work.per_head = true;
    return work;
  }
  work.first.resize(batch + 1);
  work.first[0] = 0;
  bool several = false;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t s = rows::segments(lens[b]);
    several = several || s > 1;
    work.first[b + 1] = work.first[b] + s;
  }
  const bool split_heads = work.first[batch] < threads;
  work.heads_per_item = split_heads ? 1 : hk;
  work.head_groups = split_heads ? hk : 1;
  work.items = work.first[batch] * work.head_groups;
  work.partial = several || force_partial;
  return work;
}

int64_t AttentionWork::newest_item(const int64_t* lens, int64_t b, int64_t hk, int64_t kh) const {
  if (per_head) return b * hk + kh;
  return (first[b] + std::max<int64_t>(0, lens[b] - 1) / rows::kSegment) * head_groups + kh / heads_per_item;
}

int64_t max_partial_floats(int64_t batch, int64_t hq, int64_t head_dim, int64_t max_context) {
  return batch * rows::segments(std::max<int64_t>(1, max_context)) * hq * (head_dim + 2);
}

template <typename T>
void decode_attention_items(const DecodeBatch<T>& db, double scale, const AttentionWork& work, float* partials,
                            int64_t i0, int64_t i1) {
  const float fscale = static_cast<float>(scale);
  if (db.head_dim == 64) return vec_items<T, 4>(db, fscale, work, partials, i0, i1);
  if (db.head_dim == 128) return vec_items<T, 8>(db, fscale, work, partials, i0, i1);
  generic_items<T>(db, fscale, i0, i1);
}

// Query heads [i0, i1) of the batch (item = sequence * hq + head): the segments' sums rescaled to
// their common reference and divided by the common total (row_attention.h's merge_segments).
template <typename T>
void merge_attention_splits(const DecodeBatch<T>& db, const AttentionWork& work, const float* partials, int64_t i0,
                            int64_t i1) {
  const int64_t d = db.head_dim, hq = db.hq;
  std::vector<float> weight;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / hq, h = i % hq, parts = work.segments_of(b);
    weight.resize(parts);
    rows::merge_segments(partials + (work.first[b] * hq + h) * (d + 2), d, parts, hq * (d + 2), weight.data(),
                         db.out + i * d);
  }
}

template void decode_attention_items<float>(const DecodeBatch<float>&, double, const AttentionWork&, float*, int64_t,
                                            int64_t);
template void decode_attention_items<vec::bf16>(const DecodeBatch<vec::bf16>&, double, const AttentionWork&,
                                                    float*, int64_t, int64_t);
template void merge_attention_splits<float>(const DecodeBatch<float>&, const AttentionWork&, const float*, int64_t,
                                            int64_t);
template void merge_attention_splits<vec::bf16>(const DecodeBatch<vec::bf16>&, const AttentionWork&,
                                                    const float*, int64_t, int64_t);

}  // namespace kvops

namespace {

// Every item of the work under parallel_for; the splits' partial sums (none when splits == 1).
template <typename T>
std::vector<float> run_items(const DecodeBatch<T>& db, double scale, const AttentionWork& work) {
  std::vector<float> partials(work.partial_floats(db.hq, db.head_dim));
  parallel_for(0, work.items, 1,
               [&](int64_t i0, int64_t i1) { decode_attention_items(db, scale, work, partials.data(), i0, i1); });
  return partials;
}

}  // namespace

namespace kvops {

template <typename T>
void decode_attention(const DecodeBatch<T>& db, double scale) {
  const AttentionWork work = decode_attention_work(db.lens, db.batch, db.hk, db.head_dim, num_threads());
  const std::vector<float> partials = run_items(db, scale, work);
  merge_attention_splits(db, work, partials.data(), 0, work.merge_items(db.batch, db.hq));  // a few heads' rows
}

template <typename T>
void decode_attention_partial(const DecodeBatch<T>& batch, double scale, float* o, float* mx, float* se) {
  // the items leave their sums in `partials`, not in an output of T
  const std::unique_ptr<T[]> unused(new T[batch.batch * batch.hq * batch.head_dim]);
  DecodeBatch<T> db = batch;
  db.out = unused.get();
  const AttentionWork work = decode_attention_work(db.lens, db.batch, db.hk, db.head_dim, num_threads(), true);
  const std::vector<float> partials = run_items(db, scale, work);
  const int64_t d = db.head_dim, hq = db.hq;
  std::vector<float> weight;
  for (int64_t i = 0; i < db.batch * hq; ++i) {
    const int64_t b = i / hq, parts = work.segments_of(b), stride = hq * (d + 2);
    const float* p = partials.data() + (work.first[b] * hq + i % hq) * (d + 2);
    weight.resize(parts);
    const auto [top, total] = rows::segment_weights(p, d, parts, stride, weight.data());
    mx[i] = top;
    se[i] = total;
    if (total > 0.f) rows::weighted_sums(p, d, parts, stride, weight.data(), 1.f / total, o + i * d);
    else std::fill(o + i * d, o + (i + 1) * d, 0.f);
  }
}

void merge_attention_partials(const float* const* o, const float* const* r, const float* const* s, int64_t parts,
                              int64_t rows, int64_t d, float* m) {
  std::vector<float> weight(parts);
  for (int64_t i = 0; i < rows; ++i) {
    float top = -std::numeric_limits<float>::infinity(), total = 0.f;
    for (int64_t p = 0; p < parts; ++p) top = std::max(top, r[p][i]);
    for (int64_t p = 0; p < parts; ++p) {
      weight[p] = r[p][i] == -std::numeric_limits<float>::infinity() ? 0.f : s[p][i] * std::exp(r[p][i] - top);
      total += weight[p];
    }
    const float inv = 1.f / std::max(total, 1e-30f);
    for (int64_t c = 0; c < d; c += 16) {
      vec::F16 acc = vec::F16::zero();
      for (int64_t p = 0; p < parts; ++p)
        acc = vec::fma(vec::F16::load(o[p] + i * d + c), vec::F16::set1(weight[p]), acc);
      (acc * vec::F16::set1(inv)).store(m + i * d + c);
    }
  }
}

template void decode_attention<float>(const DecodeBatch<float>&, double);
template void decode_attention<vec::bf16>(const DecodeBatch<vec::bf16>&, double);
template void decode_attention_partial<float>(const DecodeBatch<float>&, double, float*, float*, float*);
template void decode_attention_partial<vec::bf16>(const DecodeBatch<vec::bf16>&, double, float*, float*, float*);

}  // namespace kvops

// Decode attention over quantized paged K/V, head_dim 64 or 128, on every ISA level. Each 16-token
// tile's head vectors are dequantized into a small buffer of the queries' type exactly as
// dequantize() writes them (kvquant_rows.h), and the buffer goes through row_attention.h's arithmetic
// (segments of rows::kSegment tokens, 16-key tiles, the same scores, softmax, p . v order and segment
// merge) as the float prefill kernel runs over dequantize()'s blocks: a decode row is the prefill
// path's row bit for bit, alone or in any batch, at any thread count.
#include "attention/row_attention.h"
#include "kvquant/kvquant_format.h"
#include "kvquant/kvquant_rows.h"

namespace kvquant {
namespace {

namespace rows = kvops::rows;

// The items of one call: a unit is one segment of one sequence's context; an item is a unit with all
// its KV heads, or with fewer units than keep the threads busy, one KV head (a record holds every
// head of a slot, so whole records are read once where there are enough units).
struct Work {
  std::vector<int64_t> first;  // first[b]: the first unit of sequence b; first[batch]: all units
  std::vector<int64_t> seq;    // seq[u]: the sequence of unit u
  int64_t head_groups = 1, heads_per_item = 1, items = 0;

  Work(const int64_t* lens, int64_t batch, int64_t hk) : first(batch + 1, 0) {
    for (int64_t b = 0; b < batch; ++b) first[b + 1] = first[b] + rows::segments(lens[b]);
    seq.resize(first[batch]);
    for (int64_t b = 0; b < batch; ++b) std::fill(seq.begin() + first[b], seq.begin() + first[b + 1], b);
    const bool split = first[batch] < 2 * kvops::num_threads();
    heads_per_item = split ? 1 : hk;
    head_groups = split ? hk : 1;
    items = first[batch] * head_groups;
  }
  int64_t segments_of(int64_t b) const { return first[b + 1] - first[b]; }
};

// One thread's buffers: the queries, each row's sums, softmax and tile probabilities, and one tile of
// dequantized K or V rows (16 x D) with the slots 0..15 that address it.
template <typename T, int NC>
struct ItemState {
  static constexpr int64_t D = NC * 16;
  std::vector<rows::QueryDot<T, NC>> qd;
  std::vector<const rows::QueryDot<T, NC>*> qp;
  std::vector<vec::F16> part, acc;
  std::vector<vec::OnlineSoftmax> softmax;
  std::vector<float> probs, scratch;
  std::vector<T> tile;
  std::vector<uint8_t> row0;  // a block's row-0 int8 record, gathered from its tails
  Format f8;
  int64_t slots[16];
  ItemState(int64_t hq, int64_t group, const Format& f)
      : qd(hq), qp(hq), part(group * 16), acc(hq * NC), softmax(hq), probs(hq * 16), scratch(D), tile(16 * D),
        row0(f.tail * f.block_size), f8(row0_format(f)) {
    for (int64_t h = 0; h < hq; ++h) qp[h] = qd.data() + h;
    for (int64_t j = 0; j < 16; ++j) slots[j] = j;
  }
};

// Head kh of the n records at offsets into st.tile, as dequantize() writes it; a block's row 0
// (row0_block[j] >= 0) from the int8 record in its records' tails.
template <typename T, int NC, int64_t MODE>
inline void load_tile(ItemState<T, NC>& st, const uint8_t* pool, const int64_t* offsets, const int64_t* row0_block,
                      int64_t n, int64_t kh, const Format& f, const Thresholds& t) {
  T* tile = st.tile.data();
  for (int64_t j = 0; j < n; ++j) {
    if (MODE == kOaken && row0_block[j] >= 0) {
      gather_row0(pool, row0_block[j], f, st.row0.data());
      dequantize_head<NC, kInt8>(st.row0.data(), kh, st.f8, t, tile + j * ItemState<T, NC>::D, st.scratch.data());
      continue;
    }
    dequantize_head<NC, MODE>(pool + offsets[j], kh, f, t, tile + j * ItemState<T, NC>::D, st.scratch.data());
  }
}

// Tokens [t_begin, t_end) of a sequence, KV heads [kh0, kh1): every query row of those heads left
// with its segment's sums and softmax in st.
template <typename T, int NC, int64_t MODE>
void attend_segment(ItemState<T, NC>& st, const DecodeBatch<T>& call, const Format& f, const Thresholds& kt,
                    const Thresholds& vt, vec::F16 scale, int64_t b, int64_t t_begin, int64_t t_end, int64_t kh0,
                    int64_t kh1) {
  constexpr int64_t D = NC * 16;
  const int64_t group = call.group;
  const int64_t* table = call.tables + b * call.width;
  auto offset_of = [&](int64_t t) { return kvops::slot_of(table, t, call.block_size) * f.record; };
  auto none = [](int64_t) {};
  int64_t offsets[16], row0_block[16];
  for (int64_t t0 = t_begin; t0 < t_end; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, t_end - t0);
    for (int64_t j = 0; j < n; ++j) {
      offsets[j] = offset_of(t0 + j);
      row0_block[j] = f.tail != 0 && (t0 + j) % call.block_size == 0 ? table[(t0 + j) / call.block_size] : -1;
    }
    for (int64_t t = t0 + 16; t < std::min(t_end, t0 + 32); ++t) {  // the next tile's records
      const int64_t o = offset_of(t);
      for (int64_t off = 0; off < f.record; off += 64) {
        vec::prefetch_l1(call.k + o + off);
        vec::prefetch_l1(call.v + o + off);
      }
    }
    const vec::Mask valid = vec::first_lanes(static_cast<int>(n));
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      load_tile<T, NC, MODE>(st, call.k, offsets, row0_block, n, kh, f, kt);
      rows::tile_scores<T, NC>(st.qp.data() + kh * group, group, st.tile.data(), st.slots, n, D, st.part.data(),
                               none);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kh * group + g;
        rows::fold_tile<NC>(st.part.data() + g * 16, scale, valid, st.softmax[h], st.acc.data() + h * NC,
                            st.probs.data() + h * 16);
      }
      load_tile<T, NC, MODE>(st, call.v, offsets, row0_block, n, kh, f, vt);
      rows::pv_rows<T, NC>(st.tile.data(), st.slots, n, D, st.probs.data() + kh * group * 16,
                           st.acc.data() + kh * group * NC, group);
    }
  }
}

// Every item: a sequence of one segment writes its rows' outputs (unless a partial is asked for);
// otherwise the segment's sums go to partials [units, hq, D + 2] (store_partial's layout).
template <typename T, int NC, int64_t MODE>
void run_items(const DecodeBatch<T>& call, const Format& f, const Thresholds& kt, const Thresholds& vt, float scale,
               const Work& work, bool to_partials, float* partials) {
  constexpr int64_t D = NC * 16;
  const int64_t hq = call.hq, group = call.group;
  kvops::parallel_for(0, work.items, 1, [&](int64_t begin, int64_t end) {
    ItemState<T, NC> st(hq, group, f);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t unit = item / work.head_groups, b = work.seq[unit], ctx = call.lens[b];
      const int64_t segment = unit - work.first[b];
      const int64_t kh0 = item % work.head_groups * work.heads_per_item, kh1 = kh0 + work.heads_per_item;
      for (int64_t h = kh0 * group; h < kh1 * group; ++h) {
        st.qd[h].load(call.q + (b * hq + h) * D);
        st.softmax[h] = vec::OnlineSoftmax();
        for (int c = 0; c < NC; ++c) st.acc[h * NC + c] = vec::F16::zero();
      }
      const int64_t t_begin = std::min(ctx, segment * rows::kSegment);
      attend_segment<T, NC, MODE>(st, call, f, kt, vt, vec::F16::set1(scale), b, t_begin,
                                  std::min(ctx, t_begin + rows::kSegment), kh0, kh1);
      const bool whole = !to_partials && work.segments_of(b) == 1;
      for (int64_t h = kh0 * group; h < kh1 * group; ++h) {
        if (whole) rows::store_normalised(st.acc.data() + h * NC, D, st.softmax[h], call.out + (b * hq + h) * D);
        else rows::store_partial(st.acc.data() + h * NC, D, st.softmax[h], partials + (unit * hq + h) * (D + 2));
      }
    }
  });
}

// The rows of sequences with several segments merged into out (row_attention.h's merge_segments).
template <typename T>
void merge_rows(const DecodeBatch<T>& call, int64_t d, const Work& work, const float* partials) {
  std::vector<float> weight;
  for (int64_t i = 0; i < call.batch * call.hq; ++i) {
    const int64_t b = i / call.hq, parts = work.segments_of(b);
    if (parts == 1) continue;
    weight.resize(parts);
    rows::merge_segments(partials + (work.first[b] * call.hq + i % call.hq) * (d + 2), d, parts, call.hq * (d + 2),
                         weight.data(), call.out + i * d);
  }
}

// Every row's segments merged into a PartialOut: the output normalised over its keys, the reference
// and the total (a row with no keys: 0, -inf, 0).
void merge_partial_out(int64_t batch, int64_t hq, int64_t d, const Work& work, const float* partials,
                       const PartialOut& into) {
  std::vector<float> weight;
  for (int64_t i = 0; i < batch * hq; ++i) {
    const int64_t b = i / hq, parts = work.segments_of(b), stride = hq * (d + 2);
    const float* p = partials + (work.first[b] * hq + i % hq) * (d + 2);
    weight.resize(parts);
    const auto [top, total] = rows::segment_weights(p, d, parts, stride, weight.data());
    into.ref[i] = top;
    into.sum[i] = total;
    if (total > 0.f) rows::weighted_sums(p, d, parts, stride, weight.data(), 1.f / total, into.out + i * d);
    else std::fill(into.out + i * d, into.out + (i + 1) * d, 0.f);
  }
}

template <typename T, int NC, int64_t MODE>
void decode_attention_rows(const DecodeBatch<T>& call, const Format& f, const Thresholds& kt, const Thresholds& vt,
                           double scale, const PartialOut* partial) {
  constexpr int64_t D = NC * 16;
  const Work work(call.lens, call.batch, f.hk);
  bool several = false;
  for (int64_t b = 0; b < call.batch; ++b) several = several || work.segments_of(b) > 1;
  const bool to_partials = partial != nullptr;
  std::vector<float> partials(several || to_partials ? work.first[call.batch] * call.hq * (D + 2) : 0);
  run_items<T, NC, MODE>(call, f, kt, vt, static_cast<float>(scale), work, to_partials, partials.data());
  if (to_partials) merge_partial_out(call.batch, call.hq, D, work, partials.data(), *partial);
  else if (several) merge_rows(call, D, work, partials.data());
}

}  // namespace

// The row kernel for head_dim 64 / 128; false when it does not apply.
template <typename T>
bool decode_attention_fast(const DecodeBatch<T>& batch, const Format& f, const Thresholds& kt, const Thresholds& vt,
                           double scale, const PartialOut* partial) {
  auto run = [&](auto nc) {
    constexpr int NC = decltype(nc)::value;
    if (f.mode == kBf16) decode_attention_rows<T, NC, kBf16>(batch, f, kt, vt, scale, partial);
    if (f.mode == kInt8) decode_attention_rows<T, NC, kInt8>(batch, f, kt, vt, scale, partial);
    if (f.mode == kInt4) decode_attention_rows<T, NC, kInt4>(batch, f, kt, vt, scale, partial);
    if (f.mode == kOaken) decode_attention_rows<T, NC, kOaken>(batch, f, kt, vt, scale, partial);
    return true;
  };
  if (f.d == 64) return run(std::integral_constant<int, 4>());
  if (f.d == 128) return run(std::integral_constant<int, 8>());
  return false;
}

template bool decode_attention_fast<float>(const DecodeBatch<float>&, const Format&, const Thresholds&,
                                           const Thresholds&, double, const PartialOut*);
template bool decode_attention_fast<vec::bf16>(const DecodeBatch<vec::bf16>&, const Format&, const Thresholds&,
                                               const Thresholds&, double, const PartialOut*);

}  // namespace kvquant

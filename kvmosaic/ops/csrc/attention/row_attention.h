// The arithmetic of one query row's attention, shared by the decode and the prefill kernels so that a
// row's output does not depend on which kernel computed it, on how many rows shared the call, on the
// chunk a prefill was split into or on the number of threads (batch invariance). Every kernel follows:
//
// - the context is cut into segments of kSegment tokens from position 0, and each segment into
//   16-key tiles from its first token;
// - a tile's scores are QueryDot::dot's 16-lane partial products summed by sum_lanes16, times the
//   scale; the segment's online softmax (vec::OnlineSoftmax) folds them in, rescaling the output sums
//   when its reference moves, and the sums take p_j * v_j key after key (fold_tile, pv_heads);
// - a row whose context is one segment is its sums over its total; otherwise the segments' sums are
//   merged in order by merge_segments (one reference, one weight per segment).
// Which of these a thread computes, and for how many rows at once, is free: the operations on a
// row's values are the same.
#pragma once

#include "isa/vec.h"

#include <cstdint>
#include <limits>
#include <utility>

namespace kvops::rows {

namespace vec = kvmosaic_vec;

constexpr int64_t kSegment = 256;  // tokens of a context segment (a multiple of 16)

inline int64_t segments(int64_t context_len) { return context_len <= kSegment ? 1 : (context_len + kSegment - 1) / kSegment; }

// One query head held in registers; dot() returns the lane-wise partial products of q . k for one
// cached row (sum_lanes16 sums the lanes). bf16 uses AVX512-BF16 dot products (float accumulation)
// where the level has them, and otherwise widens K to float in registers.
template <typename T, int NC>
struct QueryDot {
  vec::F16 q[NC];
  void load(const T* p) {
    for (int c = 0; c < NC; ++c) q[c] = vec::F16::load(p + c * 16);
  }
  vec::F16 dot(const T* k) const {
    vec::F16 s = q[0] * vec::F16::load(k);
    for (int c = 1; c < NC; ++c) s = vec::fma(q[c], vec::F16::load(k + c * 16), s);
    return s;
  }
};

#if defined(KVM_VEC_AVX512) && defined(__AVX512BF16__)
template <int NC>
struct QueryDot<vec::bf16, NC> {
  __m512bh q[NC / 2];
  void load(const vec::bf16* p) {
    for (int c = 0; c < NC / 2; ++c) q[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p + c * 32));
  }
  vec::F16 dot(const vec::bf16* k) const {
    __m512 s = _mm512_setzero_ps();
    for (int c = 0; c < NC / 2; ++c)
      s = _mm512_dpbf16_ps(s, q[c], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(k + c * 32)));
    return {s};
  }
};
#endif

// part[g][j] = the 16-lane partial dot products of G query rows (sharing one KV head) with the
// tile's K rows j < n (zero past n); the G queries stay in registers. prefetch_row(j) runs before
// row j is read.
template <typename T, int NC, int G, typename Prefetch>
inline void head_scores(const QueryDot<T, NC>* const* qd, const T* krows, const int64_t* slots, int64_t n,
                        int64_t slot_stride, vec::F16* part, const Prefetch& prefetch_row) {
  QueryDot<T, NC> q[G];
  for (int g = 0; g < G; ++g) q[g] = *qd[g];
  for (int64_t j = 0; j < 16; ++j) {
    prefetch_row(j);
    const T* row = krows + slots[j] * slot_stride;
    for (int g = 0; g < G; ++g) part[g * 16 + j] = j < n ? q[g].dot(row) : vec::F16::zero();
  }
}

// part[g] for any count of rows, G at a time
template <typename T, int NC, typename Prefetch>
inline void tile_scores(const QueryDot<T, NC>* const* qd, int64_t count, const T* krows, const int64_t* slots,
                        int64_t n, int64_t slot_stride, vec::F16* part, const Prefetch& prefetch_row) {
  auto none = [](int64_t) {};
  for (int64_t g0 = 0; g0 < count; g0 += 4) {
    const QueryDot<T, NC>* const* q = qd + g0;
    vec::F16* p = part + g0 * 16;
    switch (std::min<int64_t>(4, count - g0)) {
      case 1: g0 == 0 ? head_scores<T, NC, 1>(q, krows, slots, n, slot_stride, p, prefetch_row)
                      : head_scores<T, NC, 1>(q, krows, slots, n, slot_stride, p, none); break;
      case 2: g0 == 0 ? head_scores<T, NC, 2>(q, krows, slots, n, slot_stride, p, prefetch_row)
                      : head_scores<T, NC, 2>(q, krows, slots, n, slot_stride, p, none); break;
      case 3: g0 == 0 ? head_scores<T, NC, 3>(q, krows, slots, n, slot_stride, p, prefetch_row)
                      : head_scores<T, NC, 3>(q, krows, slots, n, slot_stride, p, none); break;
      default: g0 == 0 ? head_scores<T, NC, 4>(q, krows, slots, n, slot_stride, p, prefetch_row)
                       : head_scores<T, NC, 4>(q, krows, slots, n, slot_stride, p, none); break;
    }
  }
}

// A row's tile of partial products folded into its segment's softmax: the probabilities of the valid
// keys (0 elsewhere) into probs[16], the row's output sums acc[NC] rescaled when the reference moves.
template <int NC>
inline void fold_tile(const vec::F16* part, vec::F16 scale, vec::Mask valid, vec::OnlineSoftmax& softmax,
                      vec::F16* acc, float* probs) {
  const vec::F16 sc = vec::sum_lanes16(part) * scale;
  float corr;
  softmax.update(sc, valid, &corr).store(probs);
  if (corr != 1.f)
    for (int c = 0; c < NC; ++c) acc[c] = acc[c] * vec::F16::set1(corr);
}

// Register blocking of the p . v sums: HN rows x CB vectors of the head dimension at a time, so the
// HN x CB sums, one V vector and the broadcast probabilities fit the level's registers.
template <int NC>
struct PvBlock {
  static constexpr int CB = vec::kVecRegisters >= 32 ? NC : 2;
  static constexpr int HN = vec::kVecRegisters >= 32 ? (NC <= 4 ? 4 : 2) : 3;
};

// acc[i] += sum over the tile's n keys j of probs[i][j] * v_j for HN rows sharing one KV head, CB
// vectors of the head dimension at a time (each sum takes the keys in order, whatever the blocking).
template <typename T, int NC, int HN>
inline void pv_block(const T* vrows, const int64_t* slots, int64_t n, int64_t slot_stride, const float* probs,
                     vec::F16* acc) {
  constexpr int CB = PvBlock<NC>::CB;
  for (int c0 = 0; c0 < NC; c0 += CB) {
    vec::F16 a[HN][CB];
    for (int i = 0; i < HN; ++i)
      for (int c = 0; c < CB; ++c) a[i][c] = acc[i * NC + c0 + c];
    for (int64_t j = 0; j < n; ++j) {
      const T* row = vrows + slots[j] * slot_stride + c0 * 16;
      vec::F16 p[HN];
      for (int i = 0; i < HN; ++i) p[i] = vec::F16::set1(probs[i * 16 + j]);
      for (int c = 0; c < CB; ++c) {
        const vec::F16 vv = vec::F16::load(row + c * 16);
        for (int i = 0; i < HN; ++i) a[i][c] = vec::fma(p[i], vv, a[i][c]);
      }
    }
    for (int i = 0; i < HN; ++i)
      for (int c = 0; c < CB; ++c) acc[i * NC + c0 + c] = a[i][c];
  }
}

// pv_block for `count` rows whose probabilities and sums follow each other (16 and NC apart)
template <typename T, int NC>
inline void pv_rows(const T* vrows, const int64_t* slots, int64_t n, int64_t slot_stride, const float* probs,
                    vec::F16* acc, int64_t count) {
  constexpr int64_t HB = PvBlock<NC>::HN;
  for (int64_t g0 = 0; g0 < count; g0 += HB) {
    const float* pr = probs + g0 * 16;
    vec::F16* ac = acc + g0 * NC;
    switch (std::min(HB, count - g0)) {
      case 1: pv_block<T, NC, 1>(vrows, slots, n, slot_stride, pr, ac); break;
      case 2: pv_block<T, NC, 2>(vrows, slots, n, slot_stride, pr, ac); break;
      case 3: pv_block<T, NC, 3>(vrows, slots, n, slot_stride, pr, ac); break;
      default: pv_block<T, NC, HB>(vrows, slots, n, slot_stride, pr, ac); break;
    }
  }
}

// A segment's result as merge_segments reads it: d unscaled sums, the softmax reference, its total.
inline void store_partial(const vec::F16* acc, int64_t d, const vec::OnlineSoftmax& softmax, float* p) {
  for (int64_t c = 0; c < d / 16; ++c) acc[c].store(p + c * 16);
  p[d] = softmax.ref;
  p[d + 1] = softmax.total();
}

// A row's output from its sums when its context is one segment
template <typename T>
inline void store_normalised(const vec::F16* acc, int64_t d, const vec::OnlineSoftmax& softmax, T* out) {
  const vec::F16 inv = vec::F16::set1(1.f / softmax.total());
  for (int64_t c = 0; c < d / 16; ++c) (acc[c] * inv).store(out + c * 16);
}

// One row's segments (store_partial's layout, `stride` floats apart) brought to their common reference:
// weight[s] rescales segment s; returns (reference, total). A segment with no tokens has reference
// -inf; with no tokens at all the reference is -inf and the total 0.
inline std::pair<float, float> segment_weights(const float* p, int64_t d, int64_t parts, int64_t stride,
                                               float* weight) {
  float top = -std::numeric_limits<float>::infinity(), total = 0.f;
  for (int64_t s = 0; s < parts; ++s) top = std::max(top, p[s * stride + d]);
  for (int64_t s = 0; s < parts; ++s) {
    const float ref = p[s * stride + d];
    weight[s] = ref == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(ref - top);
    total += weight[s] * p[s * stride + d + 1];
  }
  return {top, total};
}

// out[0, d) = the segments' sums rescaled by weight, times inv
template <typename T>
inline void weighted_sums(const float* p, int64_t d, int64_t parts, int64_t stride, const float* weight, float inv,
                          T* out) {
  for (int64_t c = 0; c < d; c += 16) {
    vec::F16 sum = vec::F16::zero();
    for (int64_t s = 0; s < parts; ++s) sum = vec::fma(vec::F16::load(p + s * stride + c), vec::F16::set1(weight[s]), sum);
    (sum * vec::F16::set1(inv)).store(out + c);
  }
}

// A row's output from its segments' partials; weight: room for `parts` floats
template <typename T>
inline void merge_segments(const float* p, int64_t d, int64_t parts, int64_t stride, float* weight, T* out) {
  const float total = segment_weights(p, d, parts, stride, weight).second;
  weighted_sums(p, d, parts, stride, weight, 1.f / total, out);
}

}  // namespace kvops::rows

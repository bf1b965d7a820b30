// Causal attention of a prefill chunk over its paged float KV context.
#include "attention/attention.h"
#include "attention/row_attention.h"
#include "common/batch_invariance.h"
#include "common/ops_common.h"
#include "common/parallel.h"
#include "isa/amx.h"
#include "isa/vec.h"

#include <type_traits>
#include <vector>

namespace {

using namespace kvops;
namespace vec = kvmosaic_vec;
namespace rows = kvops::rows;

constexpr float kLog2e = 1.44269504088896341f;  // scores in log2 units: a probability is exp2(score - ref)

// The gather both prefill kernels start with: pack(h, tile, j, k_row, v_row) for every context
// token t = 16 * tile + j and KV head h, the rows read in place from their paged slots, in
// parallel over 16-token tiles.
template <typename T, typename Pack>
void for_each_context_row(const T* kc, const T* vc, const int64_t* table, int64_t block_size, int64_t context_len,
                          int64_t hk, int64_t d, const Pack& pack) {
  const int64_t tiles = (context_len + 15) / 16;
  parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      for (int64_t j = 0; j < 16 && tile * 16 + j < context_len; ++j) {
        const int64_t t = tile * 16 + j;
        const int64_t slot = slot_of(table, t, block_size);
        for (int64_t h = 0; h < hk; ++h) pack(h, tile, j, kc + (slot * hk + h) * d, vc + (slot * hk + h) * d);
      }
    }
  });
}

// Register tiles of the register prefill kernels (float, and AVX512-BF16 dot products), from the
// level's vector registers: RB query rows x NT key tiles of scores (plus NT K vectors), and RB rows x
// CB vectors of the head dimension of output sums (plus one V vector); G register blocks of RB rows
// share each key block.
template <int kNC>
struct PrefillTiles {
  static constexpr int NC = kNC;
  static constexpr bool kWide = vec::kVecRegisters >= 32;
  static constexpr int RB = kWide ? 24 / NC : 3;  // AVX2: 3 x 2 score F16s = 12 of the 16 ymm (1.5x 2 x 2, measured)
  static constexpr int NT = kWide ? 4 : 2;
  static constexpr int CB = kWide ? NC : 2;
  static constexpr int G = kWide ? 2 : 3;
};

// scores[r][16 t + j] = q_r . k_j for RB query rows and `tiles` 16-key tiles: RB x NT scores stay in
// registers while the head dimension streams (NT K loads and RB broadcasts per NT * RB FMAs).
template <int NC, int RB, int NT>
inline void block_scores(const float* qf, const float* kp, int64_t tiles, float* sc) {
  constexpr int64_t D = NC * 16;
  for (int64_t t0 = 0; t0 < tiles; t0 += NT) {
    vec::F16 s[RB][NT];
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < NT; ++t) s[r][t] = vec::F16::zero();
    const float* kb = kp + t0 * D * 16;
    for (int64_t i = 0; i < D; ++i) {
      vec::F16 kv[NT];
      for (int t = 0; t < NT; ++t) kv[t] = vec::F16::load(kb + t * D * 16 + i * 16);
      for (int r = 0; r < RB; ++r) {
        const vec::F16 a = vec::F16::set1(qf[r * D + i]);
        for (int t = 0; t < NT; ++t) s[r][t] = vec::fma(a, kv[t], s[r][t]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < NT; ++t) s[r][t].store(sc + r * 64 + (t0 + t) * 16);
  }
}

// The scores of `tiles` key tiles: NT at a time, the rest with a narrower register tile.
template <int NC, int RB, int NT>
inline void block_scores_tiles(const float* qf, const float* kp, int64_t tiles, float* sc) {
  const int64_t full = tiles / NT * NT;
  if (full > 0) block_scores<NC, RB, NT>(qf, kp, full, sc);
  if constexpr (NT > 1)
    if (tiles > full) block_scores_tiles<NC, RB, NT - 1>(qf, kp + full * NC * 16 * 16, tiles - full, sc + full * 16);
}

template <int NC, int RB, int CB>
inline void block_pv(const float* probs, const float* vp, int64_t keys, float* oacc) {
  constexpr int64_t D = NC * 16;
  for (int c0 = 0; c0 < NC; c0 += CB) {
    vec::F16 acc[RB][CB];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < CB; ++c) acc[r][c] = vec::F16::load(oacc + r * D + (c0 + c) * 16);
    for (int64_t j = 0; j < keys; ++j) {
      vec::F16 vv[CB];
      for (int c = 0; c < CB; ++c) vv[c] = vec::F16::load(vp + j * D + (c0 + c) * 16);
      for (int r = 0; r < RB; ++r) {
        const vec::F16 p = vec::F16::set1(probs[r * 64 + j]);
        for (int c = 0; c < CB; ++c) acc[r][c] = vec::fma(p, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < CB; ++c) acc[r][c].store(oacc + r * D + (c0 + c) * 16);
  }
}

// One row's scores of a key block (nt tiles, `visible` keys causal; in log2 units: the query carries
// scale * log2(e)) turned into probabilities in place against the row's online-softmax reference;
// rescales the row's sums when it moves.
template <int NC>
inline void block_softmax(float* row, int64_t nt, int64_t visible, float* ref, vec::F16* sum, float* oacc) {
  constexpr int64_t D = NC * 16;
  if (visible <= 0) {
    for (int64_t t = 0; t < nt; ++t) vec::F16::zero().store(row + t * 16);
    return;
  }
  vec::Mask masks[4];
  vec::F16 vmax = vec::F16::set1(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < nt; ++t) {
    masks[t] = vec::first_lanes(static_cast<int>(std::min<int64_t>(16, visible - t * 16)));
    vmax = vec::select(masks[t], vec::max(vmax, vec::F16::load(row + t * 16)), vmax);
  }
  // the reference moves (and the sums are rescaled) only when a score passes it by kSlack
  if (vec::greater(vmax, vec::F16::set1(*ref + vec::OnlineSoftmax::kSlack))) {
    const float block_max = vmax.reduce_max();
    const float corr = *ref == -std::numeric_limits<float>::infinity() ? 0.f : std::exp2(*ref - block_max);
    *ref = block_max;
    const vec::F16 vcorr = vec::F16::set1(corr);
    *sum = *sum * vcorr;
    for (int c = 0; c < NC; ++c) (vec::F16::load(oacc + c * 16) * vcorr).store(oacc + c * 16);
  }
  const vec::F16 vref = vec::F16::set1(*ref);
  for (int64_t t = 0; t < nt; ++t) {
    const vec::F16 p = vec::maskz(masks[t], vec::exp2(vec::F16::load(row + t * 16) - vref));
    *sum = *sum + p;
    p.store(row + t * 16);
  }
}

// The float block products of prefill_attention_vec: K packed [tile][dim][16] floats and V
// [token][dim] floats; the query rows carry scale * log2(e), so the scores come out in log2 units.
template <typename T, int NC>
struct FloatBlocks {
  using Elem = float;  // packed K and V
  using Q = float;     // a query row as the score products read it
  using Tiles = PrefillTiles<NC>;
  float fscale;        // scale * log2(e)
  void load_q(const T* src, float* dst) const {
    for (int64_t i = 0; i < NC * 16; ++i) dst[i] = to_float(src[i]) * fscale;
  }
  template <int RB>
  void scores(const float* q, const float* kp, int64_t tiles, float* sc) const {
    block_scores_tiles<NC, RB, Tiles::NT>(q, kp, tiles, sc);
  }
  template <int RB>
  void pv(const float* probs, const float* vp, int64_t keys, float* oacc) const {
    block_pv<NC, RB, Tiles::CB>(probs, vp, keys, oacc);
  }
};

// The block loop of the register prefill kernels over packed K/V (B: the layout's block products;
// both layouts put a head's keys from k0 on at head + k0 * D, for K and for V). A work item is G
// register blocks of RB rows: each key block of up to 64 keys is read from L2 once and used by all
// G x RB rows from L1 (QK for each register block, the softmax of all rows, then PV for each).
template <typename B, typename T>
void register_prefill(const B& blocks, const T* q_ptr, int64_t n, int64_t hq, int64_t hk, int64_t start,
                      const typename B::Elem* kp, const typename B::Elem* vp, int64_t head_elems, T* o_ptr) {
  using Tiles = typename B::Tiles;
  constexpr int NC = Tiles::NC;
  constexpr int64_t D = NC * 16;
  constexpr int RB = Tiles::RB;
  constexpr int G = Tiles::G;
  constexpr int ROWS = G * RB;
  const int64_t group = hq / hk;
  const int64_t rows_per_head = n * group;
  const int64_t row_blocks = (rows_per_head + ROWS - 1) / ROWS;
  parallel_for(0, hk * row_blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) typename B::Q qf[ROWS * D];
    alignas(64) float sc[ROWS * 64];
    alignas(64) float oacc[ROWS * D];
    for (int64_t item = begin; item < end; ++item) {
      int64_t h, rb;
      balanced_item(item, hk, row_blocks, &h, &rb);
      const int64_t r0 = rb * ROWS, rn = std::min<int64_t>(ROWS, rows_per_head - r0);
      int64_t last[ROWS];
      float ref[ROWS];
      vec::F16 sum[ROWS];
      for (int r = 0; r < ROWS; ++r) {
        const int64_t row = r0 + std::min<int64_t>(r, rn - 1);  // idle rows repeat the last real one
        const int64_t tok = row / group, g = row % group;
        last[r] = start + tok;
        blocks.load_q(q_ptr + (tok * hq + h * group + g) * D, qf + r * D);
        ref[r] = -std::numeric_limits<float>::infinity();
        sum[r] = vec::F16::zero();
      }
      std::memset(oacc, 0, sizeof(oacc));
      int64_t sub_last[G];  // rows are in token order: a register block's last row sees the most keys
      for (int b = 0; b < G; ++b) sub_last[b] = last[b * RB + RB - 1];
      const typename B::Elem* khead = kp + h * head_elems;
      const typename B::Elem* vhead = vp + h * head_elems;
      for (int64_t k0 = 0; k0 <= sub_last[G - 1]; k0 += 64) {
        int64_t sub_keys[G];
        for (int b = 0; b < G; ++b) {
          sub_keys[b] = std::max<int64_t>(0, std::min<int64_t>(64, sub_last[b] - k0 + 1));
          if (sub_keys[b] > 0)
            blocks.template scores<RB>(qf + b * RB * D, khead + k0 * D, (sub_keys[b] + 15) / 16, sc + b * RB * 64);
        }
        for (int r = 0; r < ROWS; ++r) {
          const int64_t nt = (sub_keys[r / RB] + 15) / 16;
          if (nt == 0) continue;
          const int64_t visible = std::min<int64_t>(nt * 16, last[r] - k0 + 1);
          block_softmax<NC>(sc + r * 64, nt, visible, ref + r, sum + r, oacc + r * D);
        }
        for (int b = 0; b < G; ++b)
          if (sub_keys[b] > 0)
            blocks.template pv<RB>(sc + b * RB * 64, vhead + k0 * D, sub_keys[b], oacc + b * RB * D);
      }
      for (int r = 0; r < rn; ++r) {
        const int64_t row = r0 + r, tok = row / group, g = row % group;
        const vec::F16 inv = vec::F16::set1(1.f / sum[r].reduce_add());
        T* dst = o_ptr + (tok * hq + h * group + g) * D;
        for (int c = 0; c < NC; ++c) (vec::F16::load(oacc + r * D + c * 16) * inv).store(dst + c * 16);
      }
    }
  });
}

// Prefill attention for one sequence chunk in float arithmetic: n query tokens at positions
// [start, start + n) over a context of start + n tokens held in paged blocks. The context's K is
// first gathered per KV head into 16-key tiles transposed to [tile][dim][16] floats, and V into
// [token][dim] floats. Keys then go in blocks of up to 64 (4 tiles): RB query rows x NT key tiles
// of scores stay in registers while the head dimension streams (NT K loads and RB broadcasts per
// NT * RB FMAs), the online-softmax reference moves at most once per block, and the RB x D output
// sums live in L1 between blocks (their load/store is small next to the block's FMAs).
template <typename T, int NC>
void prefill_attention_vec(const PrefillChunk<T>& c, double scale) {
  constexpr int64_t D = NC * 16;
  const int64_t n = c.n, hq = c.hq, context_len = c.context_len;
  const int64_t block_size = c.block_size, hk = c.hk;
  const int64_t tiles = (context_len + 15) / 16;
  const T* kc = c.k_cache;
  const T* vc = c.v_cache;
  const int64_t* table = c.table;

  // K as [head][tile][dim][16], V as [head][token][dim]; zero past the context (masked keys must
  // still be finite: 0 * NaN is NaN)
  const int64_t head_elems = tiles * 16 * D;
  std::vector<float> kt(hk * head_elems, 0.f), vf(hk * head_elems, 0.f);
  for_each_context_row(kc, vc, table, block_size, context_len, hk, D,
                       [&](int64_t h, int64_t tile, int64_t j, const T* krow, const T* vrow) {
    float* kdst = kt.data() + h * head_elems + tile * D * 16 + j;
    float* vdst = vf.data() + h * head_elems + (tile * 16 + j) * D;
    for (int64_t i = 0; i < D; ++i) {
      kdst[i * 16] = to_float(krow[i]);
      vdst[i] = to_float(vrow[i]);
    }
  });
  const FloatBlocks<T, NC> blocks{static_cast<float>(scale) * kLog2e};
  register_prefill(blocks, c.q, n, hq, hk, context_len - n, kt.data(), vf.data(), head_elems, c.out);
}

#if defined(KVM_VEC_AVX512) && defined(__AVX512BF16__)
// The block products on AVX512-BF16 dot products. K tiles are packed as dimension pairs
// [tile][dim / 2][16 keys][2], so one instruction adds 2 dims x 16 keys of q . k; V as key pairs
// [tile][key / 2][dim][2], so one instruction adds 2 keys x 16 dims of p . v (the AMX tiles read the
// same layout). The query stays bfloat16 (its scale is applied to the float scores); probabilities
// are rounded to bfloat16 for the p . v products, as a bfloat16 matmul of softmax weights and V does.
template <int NC, int RB, int NT>
inline void bf16_block_scores(const uint16_t* q, const uint16_t* kp, float scale2, float* sc) {
  constexpr int64_t D = NC * 16;
  __m512 s[RB][NT];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < NT; ++t) s[r][t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    __m512bh kv[NT];
    for (int t = 0; t < NT; ++t)
      kv[t] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(kp + t * 16 * D + p * 32));
    for (int r = 0; r < RB; ++r) {
      int32_t pair;
      std::memcpy(&pair, q + r * D + 2 * p, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < NT; ++t) s[r][t] = _mm512_dpbf16_ps(s[r][t], kv[t], a);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale2);
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(sc + r * 64 + t * 16, _mm512_mul_ps(s[r][t], vscale));
}

template <int NC, int RB, int NT>
inline void bf16_block_scores_tiles(const uint16_t* q, const uint16_t* kp, int64_t tiles, float scale2, float* sc) {
  if constexpr (NT > 1)
    if (tiles < NT) return bf16_block_scores_tiles<NC, RB, NT - 1>(q, kp, tiles, scale2, sc);
  bf16_block_scores<NC, RB, NT>(q, kp, scale2, sc);
}

template <int NC, int RB, int CB>
inline void bf16_block_pv(const float* probs, const uint16_t* vp, int64_t keys, float* oacc) {
  constexpr int64_t D = NC * 16;
  alignas(64) uint16_t pb[RB][64];
  for (int r = 0; r < RB; ++r)
    for (int64_t j = 0; j < keys; j += 32)
      _mm512_store_si512(pb[r] + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(probs + r * 64 + j + 16),
                                                                 _mm512_loadu_ps(probs + r * 64 + j)));
  for (int c0 = 0; c0 < NC; c0 += CB) {
    __m512 acc[RB][CB];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_loadu_ps(oacc + r * D + (c0 + c) * 16);
    for (int64_t jp = 0; jp * 2 < keys; ++jp) {
      __m512bh vv[CB];
      for (int c = 0; c < CB; ++c)
        vv[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(vp + jp * D * 2 + (c0 + c) * 32));
      for (int r = 0; r < RB; ++r) {
        int32_t pair;
        std::memcpy(&pair, pb[r] + jp * 2, sizeof(pair));
        const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
        for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], p);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < CB; ++c) _mm512_storeu_ps(oacc + r * D + (c0 + c) * 16, acc[r][c]);
  }
}

template <int NC>
struct BF16Blocks {
  using Elem = uint16_t;
  using Q = uint16_t;
  using Tiles = PrefillTiles<NC>;
  float scale2;  // scale * log2(e), applied to the float scores
  void load_q(const vec::bf16* src, uint16_t* dst) const { std::memcpy(dst, src, NC * 16 * sizeof(uint16_t)); }
  template <int RB>
  void scores(const uint16_t* q, const uint16_t* kp, int64_t tiles, float* sc) const {
    bf16_block_scores_tiles<NC, RB, Tiles::NT>(q, kp, tiles, scale2, sc);
  }
  template <int RB>
  void pv(const float* probs, const uint16_t* vp, int64_t keys, float* oacc) const {
    bf16_block_pv<NC, RB, Tiles::CB>(probs, vp, keys, oacc);
  }
};

// bfloat16 prefill attention where the level has AVX512-BF16: K/V packed as above from the paged
// cache, then the AMX tiles (amx_attention.cpp) where the CPU has them, else the register kernel.
template <int NC>
void prefill_attention_bf16(const PrefillChunk<vec::bf16>& c, double scale) {
  constexpr int64_t D = NC * 16;
  const int64_t n = c.n, hq = c.hq, context_len = c.context_len;
  const int64_t block_size = c.block_size, hk = c.hk;
  const int64_t start = context_len - n;
  const bool on_tiles = amx::attention_takes(D);
  const int64_t tiles = (context_len + 15) / 16 + (on_tiles ? 1 : 0);  // the tiles read 32-key blocks
  const auto* kc = reinterpret_cast<const uint16_t*>(c.k_cache);
  const auto* vc = reinterpret_cast<const uint16_t*>(c.v_cache);
  const int64_t* table = c.table;
  vec::bf16* o_ptr = c.out;
  const int64_t tile_elems = 16 * D;  // bf16 values per packed tile of K or V
  std::vector<uint16_t> kp(hk * tiles * tile_elems, 0), vp(hk * tiles * tile_elems, 0);
  for_each_context_row(kc, vc, table, block_size, context_len, hk, D,
                       [&](int64_t h, int64_t tile, int64_t j, const uint16_t* krow, const uint16_t* vrow) {
    // K: the row's dimension pairs, one 32-bit word each, 16 words apart
    uint32_t* kt = reinterpret_cast<uint32_t*>(kp.data() + (h * tiles + tile) * tile_elems) + j;
    for (int64_t i = 0; i < D / 2; ++i) {
      uint32_t pair;
      std::memcpy(&pair, krow + 2 * i, sizeof(pair));
      kt[i * 16] = pair;
    }
    // V: the row widened to 32-bit lanes, its values in the low (even key) or high (odd key) half, and
    // stored into that half only: the pair's other key fills the other half
    uint16_t* vt = vp.data() + (h * tiles + tile) * tile_elems + (j / 2) * D * 2;
    const __mmask32 half = j % 2 == 0 ? 0x55555555u : 0xAAAAAAAAu;
    for (int64_t i = 0; i < D; i += 16) {
      __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow + i)));
      if (j % 2) wide = _mm512_slli_epi32(wide, 16);
      _mm512_mask_storeu_epi16(vt + 2 * i, half, wide);
    }
  });

  if (on_tiles) {
    const auto* q_bits = reinterpret_cast<const uint16_t*>(c.q);
    amx::prefill_attention(q_bits, n, hq, hk, start, kp.data(), vp.data(), tiles * tile_elems,
                           static_cast<float>(scale), o_ptr);
    return;
  }
  const BF16Blocks<NC> blocks{static_cast<float>(scale) * kLog2e};
  register_prefill(blocks, c.q, n, hq, hk, start, kp.data(), vp.data(), tiles * tile_elems,
                   o_ptr);
}
#endif


// Prefill attention with row_attention.h's arithmetic, so that each query row gets the bits the decode
// kernel gives it (batch invariance): a work item is up to kRowBlock query rows of one KV head (in
// token order), which walk their context together, segment by segment and tile by tile, reading each
// tile's K/V rows in place from their blocks once for all of them. A row joins a tile while the tile
// holds keys it sees (causal), with the keys past its own masked out of its softmax (probability 0).
template <typename T, int NC>
void prefill_rows(const PrefillChunk<T>& c, double scale) {
  constexpr int64_t D = NC * 16;
  constexpr int64_t kRowBlock = 8;
  const int64_t n = c.n, hq = c.hq, hk = c.hk, group = hq / hk, start = c.context_len - n;
  const int64_t slot_stride = hk * D, block_size = c.block_size;
  const int64_t rows_per_head = n * group, row_blocks = (rows_per_head + kRowBlock - 1) / kRowBlock;
  const vec::F16 vscale = vec::F16::set1(static_cast<float>(scale));
  const int64_t most_segments = rows::segments(c.context_len);
  parallel_for(0, hk * row_blocks, 1, [&](int64_t begin, int64_t end) {
    rows::QueryDot<T, NC> qd[kRowBlock];
    const rows::QueryDot<T, NC>* qp[kRowBlock];
    vec::F16 part[kRowBlock * 16], acc[kRowBlock * NC];
    vec::OnlineSoftmax softmax[kRowBlock];
    alignas(64) float probs[kRowBlock * 16];
    int64_t slots[16], limit[kRowBlock];
    T* out[kRowBlock];
    std::vector<float> partials(kRowBlock * most_segments * (D + 2)), weight(most_segments);
    auto none = [](int64_t) {};
    for (int64_t item = begin; item < end; ++item) {
      int64_t h, rb;
      balanced_item(item, hk, row_blocks, &h, &rb);
      const int64_t r0 = rb * kRowBlock, rn = std::min(kRowBlock, rows_per_head - r0);
      for (int64_t r = 0; r < rn; ++r) {
        const int64_t tok = (r0 + r) / group, g = (r0 + r) % group;
        qd[r].load(c.q + (tok * hq + h * group + g) * D);
        qp[r] = qd + r;
        limit[r] = start + tok + 1;  // the keys row r sees
        out[r] = c.out + (tok * hq + h * group + g) * D;
      }
      const int64_t last = limit[rn - 1];  // rows in token order: the last sees the most keys
      for (int64_t seg = 0; seg * rows::kSegment < last; ++seg) {
        const int64_t seg_begin = seg * rows::kSegment, seg_end = std::min(last, seg_begin + rows::kSegment);
        int64_t a0 = 0;  // rows [a0, rn) see keys of this segment
        while (limit[a0] <= seg_begin) ++a0;
        for (int64_t r = a0; r < rn; ++r) {
          softmax[r] = vec::OnlineSoftmax();
          for (int cc = 0; cc < NC; ++cc) acc[r * NC + cc] = vec::F16::zero();
        }
        int64_t b0 = a0;  // rows [b0, rn) see keys of the tile
        for (int64_t t0 = seg_begin; t0 < seg_end; t0 += 16) {
          const int64_t keys = std::min<int64_t>(16, seg_end - t0);
          for (int64_t j = 0; j < keys; ++j) slots[j] = slot_of(c.table, t0 + j, block_size);
          while (limit[b0] <= t0) ++b0;
          rows::tile_scores<T, NC>(qp + b0, rn - b0, c.k_cache + h * D, slots, keys, slot_stride, part + b0 * 16,
                                   none);
          for (int64_t r = b0; r < rn; ++r) {
            const vec::Mask valid = vec::first_lanes(static_cast<int>(std::min<int64_t>(16, limit[r] - t0)));
            rows::fold_tile<NC>(part + r * 16, vscale, valid, softmax[r], acc + r * NC, probs + r * 16);
          }
          rows::pv_rows<T, NC>(c.v_cache + h * D, slots, keys, slot_stride, probs + b0 * 16, acc + b0 * NC, rn - b0);
        }
        for (int64_t r = a0; r < rn; ++r) {
          if (rows::segments(limit[r]) == 1) rows::store_normalised(acc + r * NC, D, softmax[r], out[r]);
          else rows::store_partial(acc + r * NC, D, softmax[r], partials.data() + (r * most_segments + seg) * (D + 2));
        }
      }
      for (int64_t r = 0; r < rn; ++r) {
        const int64_t parts = rows::segments(limit[r]);
        if (parts > 1)
          rows::merge_segments(partials.data() + r * most_segments * (D + 2), D, parts, D + 2, weight.data(), out[r]);
      }
    }
  });
}

}  // namespace

namespace kvops {

template <typename T>
void prefill_attention(const PrefillChunk<T>& chunk, double scale) {
  const int64_t d = chunk.head_dim;
  if (batch_invariant()) {  // row_attention.h's arithmetic, the decode kernel's
    if (d == 64) prefill_rows<T, 4>(chunk, scale);
    if (d == 128) prefill_rows<T, 8>(chunk, scale);
    return;
  }
  if constexpr (std::is_same_v<T, vec::bf16>) {
#if defined(KVM_VEC_AVX512) && defined(__AVX512BF16__)
    if (d == 64) prefill_attention_bf16<4>(chunk, scale);
    else prefill_attention_bf16<8>(chunk, scale);
    return;
#endif
  }
  if (d == 64) prefill_attention_vec<T, 4>(chunk, scale);
  if (d == 128) prefill_attention_vec<T, 8>(chunk, scale);
}

template void prefill_attention<float>(const PrefillChunk<float>&, double);
template void prefill_attention<vec::bf16>(const PrefillChunk<vec::bf16>&, double);

}  // namespace kvops

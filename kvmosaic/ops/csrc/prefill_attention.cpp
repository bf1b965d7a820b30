// Causal attention of a prefill chunk over its paged float KV context.
#include "amx.h"
#include "ops_common.h"
#include "vec.h"

namespace {

using namespace kvops;
namespace vec = kvmosaic_vec;

// The gather both prefill kernels start with: pack(h, tile, j, k_row, v_row) for every context
// token t = 16 * tile + j and KV head h, the rows read in place from their paged slots, in
// parallel over 16-token tiles.
template <typename T, typename Pack>
void for_each_context_row(const T* kc, const T* vc, const int64_t* table, int64_t block_size, int64_t context_len,
                          int64_t hk, int64_t d, const Pack& pack) {
  const int64_t tiles = (context_len + 15) / 16;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      for (int64_t j = 0; j < 16 && tile * 16 + j < context_len; ++j) {
        const int64_t t = tile * 16 + j;
        const int64_t slot = slot_of(table, t, block_size);
        for (int64_t h = 0; h < hk; ++h) pack(h, tile, j, kc + (slot * hk + h) * d, vc + (slot * hk + h) * d);
      }
    }
  });
}

// Register tiles of prefill_attention_vec, from the level's vector registers: RB query rows x NT
// key tiles of scores (plus NT K vectors), and RB rows x CB vectors of the head dimension of output
// sums (plus one V vector); G register blocks of RB rows share each key block.
template <int NC>
struct PrefillTiles {
  static constexpr bool kWide = vec::kVecRegisters >= 32;
  static constexpr int RB = kWide ? 24 / NC : 3;  // AVX2: 3 x 2 score F16s = 12 of the 16 ymm (1.5x 2 x 2, measured)
  static constexpr int NT = kWide ? 4 : 2;
  static constexpr int CB = kWide ? NC : 2;
  static constexpr int G = kWide ? 2 : 3;
};

// Prefill attention for one sequence chunk in float arithmetic: n query tokens at positions
// [start, start + n) over a context of start + n tokens held in paged blocks. The context's K is
// first gathered per KV head into 16-key tiles transposed to [tile][dim][16] floats, and V into
// [token][dim] floats. Keys then go in blocks of up to 64 (4 tiles): RB query rows x NT tiles of
// scores stay in registers while the head dimension streams (NT K loads and RB broadcasts per
// NT * RB FMAs), the online-softmax reference moves at most once per block, and the RB x D
// output sums live in L1 between blocks (their load/store is small next to the block's FMAs).
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

template <typename T, int NC>
void prefill_attention_vec(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, int64_t context_len, at::Tensor& out, double scale) {
  constexpr int64_t D = NC * 16;
  using Tiles = PrefillTiles<NC>;
  constexpr int RB = Tiles::RB;
  const int64_t n = q.size(0), hq = q.size(1);
  const int64_t block_size = k_cache.size(1), hk = k_cache.size(2);
  const int64_t group = hq / hk;
  const int64_t start = context_len - n;
  const int64_t tiles = (context_len + 15) / 16;
  const T* q_ptr = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  T* o_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale) * 1.44269504088896341f;  // scores in log2 units: exp2

  // K as [head][tile][dim][16], V as [head][token][dim]; zero past the context (masked keys must
  // still be finite: 0 * NaN is NaN)
  const int64_t kt_head = tiles * D * 16, vf_head = tiles * 16 * D;
  std::vector<float> kt(hk * kt_head, 0.f), vf(hk * vf_head, 0.f);
  for_each_context_row(kc, vc, table, block_size, context_len, hk, D,
                       [&](int64_t h, int64_t tile, int64_t j, const T* krow, const T* vrow) {
    float* kdst = kt.data() + h * kt_head + tile * D * 16 + j;
    float* vdst = vf.data() + h * vf_head + (tile * 16 + j) * D;
    for (int64_t i = 0; i < D; ++i) {
      kdst[i * 16] = to_float(krow[i]);
      vdst[i] = to_float(vrow[i]);
    }
  });

  // A work item is G register blocks of RB rows: each key block is read from L2 once and used by all
  // G x RB rows from L1 (QK for each register block, the softmax of all rows, then PV for each).
  constexpr int G = Tiles::G;
  constexpr int ROWS = G * RB;
  const int64_t rows_per_head = n * group;
  const int64_t row_blocks = (rows_per_head + ROWS - 1) / ROWS;
  at::parallel_for(0, hk * row_blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float qf[ROWS * D];
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
        const T* src = q_ptr + (tok * hq + h * group + g) * D;
        for (int64_t i = 0; i < D; ++i) qf[r * D + i] = to_float(src[i]) * fscale;
        ref[r] = -std::numeric_limits<float>::infinity();
        sum[r] = vec::F16::zero();
      }
      std::memset(oacc, 0, sizeof(oacc));
      int64_t sub_last[G];  // rows are in token order: a register block's last row sees the most keys
      for (int b = 0; b < G; ++b) sub_last[b] = last[b * RB + RB - 1];
      const float* khead = kt.data() + h * kt_head;
      const float* vhead = vf.data() + h * vf_head;
      for (int64_t k0 = 0; k0 <= sub_last[G - 1]; k0 += 64) {
        const float* kp = khead + (k0 / 16) * D * 16;
        int64_t sub_keys[G];
        for (int b = 0; b < G; ++b) {
          sub_keys[b] = std::max<int64_t>(0, std::min<int64_t>(64, sub_last[b] - k0 + 1));
          if (sub_keys[b] == 0) continue;
          float* scb = sc + b * RB * 64;
          const float* qb = qf + b * RB * D;
          block_scores_tiles<NC, RB, Tiles::NT>(qb, kp, (sub_keys[b] + 15) / 16, scb);
        }
        for (int r = 0; r < ROWS; ++r) {
          const int64_t nt = (sub_keys[r / RB] + 15) / 16;
          if (nt == 0) continue;
          const int64_t visible = std::min<int64_t>(nt * 16, last[r] - k0 + 1);
          block_softmax<NC>(sc + r * 64, nt, visible, ref + r, sum + r, oacc + r * D);
        }
        for (int b = 0; b < G; ++b)
          if (sub_keys[b] > 0)
            block_pv<NC, RB, Tiles::CB>(sc + b * RB * 64, vhead + k0 * D, sub_keys[b], oacc + b * RB * D);
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

#if defined(KVM_VEC_AVX512) && defined(__AVX512BF16__)
// Prefill attention on AVX512-BF16 dot products, one 16-key tile at a time with RB query rows per
// register block (prefill_attention_vec's 64-key blocks are not ported here): K tiles are packed as
// dimension pairs [tile][dim / 2][16 keys][2] so one instruction adds 2 dims x 16 keys of q . k;
// V as key pairs [tile][key / 2][dim][2] so one instruction adds 2 keys x 16 dims of p . v.
// Probabilities are rounded to bfloat16 for the p . v products (as a bfloat16 matmul of softmax
// weights and V does); scores, softmax and accumulation stay in float.
template <int NC>
void prefill_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, int64_t context_len, at::Tensor& out, double scale) {
  constexpr int64_t D = NC * 16;
  constexpr int RB = NC <= 4 ? 6 : 2;  // 6 x NC float sums + NC V vectors fit the 32 registers
  const int64_t n = q.size(0), hq = q.size(1);
  const int64_t block_size = k_cache.size(1), hk = k_cache.size(2);
  const int64_t group = hq / hk;
  const int64_t start = context_len - n;
  const bool on_tiles = amx::attention_takes(D);
  const int64_t tiles = (context_len + 15) / 16 + (on_tiles ? 1 : 0);  // the tiles read 32-key blocks
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<c10::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>());
  const int64_t* table = block_table.data_ptr<int64_t>();
  auto* o_ptr = out.data_ptr<c10::BFloat16>();
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));
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

  const int64_t rows_per_head = n * group;
  if (on_tiles) {
    amx::prefill_attention(q_ptr, n, hq, hk, start, kp.data(), vp.data(), tiles * tile_elems,
                           static_cast<float>(scale), o_ptr);
    return;
  }
  const int64_t row_blocks = (rows_per_head + RB - 1) / RB;
  at::parallel_for(0, hk * row_blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t qpairs[RB][D / 2];
    alignas(64) uint16_t probs[RB][16];
    for (int64_t item = begin; item < end; ++item) {
      int64_t h, rb;
      balanced_item(item, hk, row_blocks, &h, &rb);
      const int64_t r0 = rb * RB, rn = std::min<int64_t>(RB, rows_per_head - r0);
      int64_t last[RB];
      __m512 acc[RB][NC];
      vec::OnlineSoftmax softmax[RB];
      for (int r = 0; r < RB; ++r) {
        const int64_t row = r0 + std::min<int64_t>(r, rn - 1);
        const int64_t tok = row / group, g = row % group;
        last[r] = start + tok;
        std::memcpy(qpairs[r], q_ptr + (tok * hq + h * group + g) * D, D * sizeof(uint16_t));
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
      }
      int64_t max_last = 0;
      for (int r = 0; r < RB; ++r) max_last = std::max(max_last, last[r]);
      const uint16_t* khead = kp.data() + h * tiles * tile_elems;
      const uint16_t* vhead = vp.data() + h * tiles * tile_elems;
      for (int64_t tile = 0; tile * 16 <= max_last; ++tile) {
        const uint16_t* kt = khead + tile * tile_elems;
        // two accumulators per row (even / odd pairs): twice the independent dot-product chains
        __m512 s[RB], s_odd[RB];
        for (int r = 0; r < RB; ++r) s[r] = s_odd[r] = _mm512_setzero_ps();
        for (int64_t p = 0; p < D / 2; p += 2) {
          const __m512bh k0 = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(kt + p * 32));
          const __m512bh k1 = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(kt + (p + 1) * 32));
          for (int r = 0; r < RB; ++r) {
            s[r] = _mm512_dpbf16_ps(s[r], k0, (__m512bh)_mm512_set1_epi32(static_cast<int>(qpairs[r][p])));
            s_odd[r] = _mm512_dpbf16_ps(s_odd[r], k1, (__m512bh)_mm512_set1_epi32(static_cast<int>(qpairs[r][p + 1])));
          }
        }
        for (int r = 0; r < RB; ++r) s[r] = _mm512_add_ps(s[r], s_odd[r]);
        int64_t tile_keys = 0;
        for (int r = 0; r < RB; ++r) {
          const int64_t visible = std::min<int64_t>(16, last[r] - tile * 16 + 1);
          tile_keys = std::max(tile_keys, visible);
          const vec::Mask valid = vec::first_lanes(static_cast<int>(visible));
          __m512 p = _mm512_setzero_ps();
          if (valid) {
            const __m512 sc = _mm512_mul_ps(s[r], vscale);
            float corr;
            p = softmax[r].update(vec::F16{sc}, valid, &corr).v;
            if (corr != 1.f)
              for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_set1_ps(corr));
          }
          _mm256_store_si256(reinterpret_cast<__m256i*>(probs[r]), (__m256i)_mm512_cvtneps_pbh(p));
        }
        const uint16_t* vt = vhead + tile * tile_elems;
        for (int64_t jp = 0; jp * 2 < tile_keys; ++jp) {
          __m512bh vv[NC];
          for (int c = 0; c < NC; ++c)
            vv[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(vt + jp * D * 2 + c * 32));
          for (int r = 0; r < RB; ++r) {
            uint32_t pair;
            std::memcpy(&pair, probs[r] + jp * 2, sizeof(pair));
            const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
            for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], pb);
          }
        }
      }
      for (int r = 0; r < rn; ++r) {
        const int64_t row = r0 + r, tok = row / group, g = row % group;
        const __m512 inv = _mm512_set1_ps(1.f / softmax[r].total());
        c10::BFloat16* dst = o_ptr + (tok * hq + h * group + g) * D;
        for (int c = 0; c < NC; ++c) vec::F16{_mm512_mul_ps(acc[r][c], inv)}.store(dst + c * 16);
      }
    }
  });
}
#endif

}  // namespace

using namespace kvops;

// Attention of one prefill chunk (n query tokens, the last n of context_len) over its paged context,
// written into `out` when given (a contiguous tensor shaped like q, e.g. the chunk's rows of a batch).
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, int64_t context_len, double scale,
                                   const c10::optional<at::Tensor>& out_opt) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [n, hq, head_dim]");
  check_cache(k_cache, q);
  check_cache(v_cache, q);
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1, "block table must be int64 [blocks]");
  TORCH_CHECK(context_len >= q.size(0) && block_table.size(0) * k_cache.size(1) >= context_len,
              "context longer than its block table");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  at::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous(),
                "out must be a contiguous tensor shaped like q");
  } else {
    out = at::empty_like(q);
  }
  auto table = block_table.contiguous();
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128, "paged_prefill_attention supports head_dim 64 and 128");
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || q.scalar_type() == at::kFloat, "paged_prefill_attention supports float32 and bfloat16");
#if defined(KVM_VEC_AVX512) && defined(__AVX512BF16__)
  if (bf16) {
    if (d == 64) prefill_attention_bf16<4>(q, k_cache, v_cache, table, context_len, out, scale);
    else prefill_attention_bf16<8>(q, k_cache, v_cache, table, context_len, out, scale);
    return out;
  }
#endif
  if (bf16 && d == 64) prefill_attention_vec<c10::BFloat16, 4>(q, k_cache, v_cache, table, context_len, out, scale);
  if (bf16 && d == 128) prefill_attention_vec<c10::BFloat16, 8>(q, k_cache, v_cache, table, context_len, out, scale);
  if (!bf16 && d == 64) prefill_attention_vec<float, 4>(q, k_cache, v_cache, table, context_len, out, scale);
  if (!bf16 && d == 128) prefill_attention_vec<float, 8>(q, k_cache, v_cache, table, context_len, out, scale);
  return out;
}

// Causal prefill attention on AMX tiles (amx.h), head_dim 64: work items of 16 query rows of one KV
// head, keys 32 at a time.
//
// The output sums stay in four tiles (tmm4-7, 16 rows x 64 dims) across key blocks. Per block of
// 32 keys: the scores (16 x 32: tmm0-1) are Q (tmm2) times the two K tiles (tmm3) over two 32-dim
// steps, computed one block ahead so that the tiles work while the vector units run the softmax of
// the block before (7% faster C prefill on the Intel AMX host). The online softmax runs in AVX-512
// registers on scores in log2 units (the scale folded with log2(e), so one FMA and exp2, 8
// operations, against a multiply, a subtraction and exp's 15: about 1.15x faster) and
// rounds the probabilities to bf16 (as the AVX512-BF16 kernel does); then P (tmm2) times four V tiles
// (tmm0, 1, 3) adds the block to the sums. When a row's softmax reference moves (rarely after the
// first blocks) the sums go through memory to be rescaled. A thread loads the tile configuration
// once for all its items.
#include "common/check.h"
#include "common/ops_common.h"
#include "common/parallel.h"
#include "isa/amx.h"
#include "isa/amx_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace kvops::amx {

namespace {

namespace vec = kvmosaic_vec;
using vec::bf16;
using vec::F16;

constexpr int64_t kDim = kAttentionDim;
constexpr int64_t kRows = 16;
constexpr int64_t kKeys = 32;  // keys per block: two 16-key tiles
constexpr int64_t kTileElems = 16 * kDim;  // bf16 values of one packed 16-key tile

#if defined(KVM_AMX)

// Scores of a block into sc [16][32]: two 32-dim steps of the Q tile against keys 0-15 and 16-31.
KVM_AMX_TARGET void block_scores(const bf16* q, const uint16_t* k_tile, float* sc) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t s = 0; s < kDim / 32; ++s) {
    _tile_loadd(2, q + s * 32, kDim * sizeof(bf16));
    _tile_loadd(3, k_tile + s * 16 * 32, 64);
    _tile_dpbf16ps(0, 2, 3);
    _tile_loadd(3, k_tile + kTileElems + s * 16 * 32, 64);
    _tile_dpbf16ps(1, 2, 3);
  }
  _tile_stored(0, sc, kKeys * sizeof(float));
  _tile_stored(1, sc + 16, kKeys * sizeof(float));
  amx_fence();
}

// sums (tmm4-7) += probs [16][32] (bf16) times the block's V (16 key pairs x 64 dims).
KVM_AMX_TARGET void block_values(const uint16_t* probs, const uint16_t* v_tile) {
  constexpr int64_t v_stride = 2 * kDim * sizeof(uint16_t);  // one key pair's row
  amx_fence();
  _tile_loadd(2, probs, kKeys * sizeof(uint16_t));
  _tile_loadd(0, v_tile, v_stride);
  _tile_loadd(1, v_tile + 32, v_stride);
  _tile_loadd(3, v_tile + 64, v_stride);
  _tile_dpbf16ps(4, 2, 0);
  _tile_dpbf16ps(5, 2, 1);
  _tile_dpbf16ps(6, 2, 3);
  _tile_loadd(0, v_tile + 96, v_stride);
  _tile_dpbf16ps(7, 2, 0);
}

KVM_AMX_TARGET void store_sums(float* out) {
  constexpr int64_t stride = kDim * sizeof(float);
  _tile_stored(4, out, stride);
  _tile_stored(5, out + 16, stride);
  _tile_stored(6, out + 32, stride);
  _tile_stored(7, out + 48, stride);
  amx_fence();
}

KVM_AMX_TARGET void load_sums(const float* out) {
  constexpr int64_t stride = kDim * sizeof(float);
  amx_fence();
  _tile_loadd(4, out, stride);
  _tile_loadd(5, out + 16, stride);
  _tile_loadd(6, out + 32, stride);
  _tile_loadd(7, out + 48, stride);
}

// One item: q [16][64], last[r] the last key row r sees, scale2 = scale * log2(e); out: [16][64]
// normalized floats. Runs inside a TileScope.
KVM_AMX_TARGET void attention(const bf16* q, const int64_t* last, const uint16_t* k_tiles, const uint16_t* v_tiles,
                              float scale2, float* out) {
  alignas(64) float scores[2][kRows * kKeys];  // this block's and the next one's
  alignas(64) uint16_t probs[kRows * kKeys];
  constexpr float kNoRef = -std::numeric_limits<float>::infinity();
  float ref[kRows], corr[kRows];
  F16 sum[kRows];
  int64_t max_last = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    ref[r] = kNoRef;
    sum[r] = F16::zero();
    max_last = std::max(max_last, last[r]);
  }
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const F16 vscale = F16::set1(scale2);
  const F16 none = F16::set1(kNoRef);
  block_scores(q, k_tiles, scores[0]);
  for (int64_t k0 = 0, cur = 0; k0 <= max_last; k0 += kKeys, cur ^= 1) {
    // the next block's scores first: the tiles compute them while the softmax below runs
    if (k0 + kKeys <= max_last) block_scores(q, k_tiles + ((k0 + kKeys) / 16) * kTileElems, scores[cur ^ 1]);
    const float* sc = scores[cur];
    bool moved = false;
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t visible = std::min<int64_t>(kKeys, last[r] - k0 + 1);
      uint16_t* prow = probs + r * kKeys;
      corr[r] = 1.f;
      if (visible <= 0) {
        std::memset(prow, 0, kKeys * sizeof(uint16_t));
        continue;
      }
      const vec::Mask m0 = vec::first_lanes(static_cast<int>(std::min<int64_t>(16, visible)));
      const vec::Mask m1 = visible > 16 ? vec::first_lanes(static_cast<int>(visible - 16)) : 0;
      const bool whole = visible == kKeys;
      const F16 s0 = F16::load(sc + r * kKeys);
      const F16 s1 = F16::load(sc + r * kKeys + 16);
      const F16 high =
          (whole ? vec::max(s0, s1) : vec::max(vec::select(m0, s0, none), vec::select(m1, s1, none))) * vscale;
      // the reference moves only when a score passes it by kSlack: most blocks skip the reduction
      if (vec::greater(high, F16::set1(ref[r] + vec::OnlineSoftmax::kSlack))) {
        const float block_max = high.reduce_max();
        corr[r] = ref[r] == kNoRef ? 0.f : std::exp2(ref[r] - block_max);
        ref[r] = block_max;
        sum[r] = sum[r] * F16::set1(corr[r]);
        moved = true;
      }
      const F16 neg_ref = F16::set1(-ref[r]);
      F16 p0 = vec::exp2(vec::fma(s0, vscale, neg_ref));
      F16 p1 = vec::exp2(vec::fma(s1, vscale, neg_ref));
      if (!whole) {
        p0 = vec::maskz(m0, p0);
        p1 = vec::maskz(m1, p1);
      }
      sum[r] = sum[r] + p0 + p1;
      _mm512_storeu_si512(prow, (__m512i)_mm512_cvtne2ps_pbh(p1.v, p0.v));
    }
    if (moved && k0 > 0) {  // before the first block the sums are zero
      store_sums(out);
      for (int64_t r = 0; r < kRows; ++r) {
        if (corr[r] == 1.f) continue;
        const F16 vcorr = F16::set1(corr[r]);
        for (int64_t c = 0; c < kDim; c += 16) (F16::load(out + r * kDim + c) * vcorr).store(out + r * kDim + c);
      }
      load_sums(out);
    }
    block_values(probs, v_tiles + (k0 / 16) * kTileElems);
  }
  store_sums(out);
  for (int64_t r = 0; r < kRows; ++r) {
    const F16 inv = F16::set1(1.f / sum[r].reduce_add());
    for (int64_t c = 0; c < kDim; c += 16) (F16::load(out + r * kDim + c) * inv).store(out + r * kDim + c);
  }
}

#endif  // KVM_AMX

}  // namespace

bool attention_takes(int64_t head_dim) { return head_dim == kAttentionDim && enabled(); }

void prefill_attention(const uint16_t* q, int64_t n, int64_t hq, int64_t hk, int64_t start, const uint16_t* k_tiles,
                       const uint16_t* v_tiles, int64_t head_elems, float scale, bf16* out) {
#if defined(KVM_AMX)
  constexpr int64_t D = kAttentionDim;
  const int64_t group = hq / hk, rows_per_head = n * group;
  const int64_t row_blocks = (rows_per_head + kRows - 1) / kRows;
  const float scale2 = scale * 1.44269504088896341f;  // scores in log2 units
  parallel_for(0, hk * row_blocks, 1, [&](int64_t begin, int64_t end) {
    const TileScope tiles;
    alignas(64) uint16_t qrows[kRows * D];
    alignas(64) float sums[kRows * D];
    int64_t last[kRows];
    for (int64_t item = begin; item < end; ++item) {
      int64_t h, rb;
      balanced_item(item, hk, row_blocks, &h, &rb);
      const int64_t r0 = rb * kRows, rn = std::min<int64_t>(kRows, rows_per_head - r0);
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t row = r0 + std::min<int64_t>(r, rn - 1);  // idle rows repeat the last real one
        const int64_t tok = row / group, g = row % group;
        last[r] = start + tok;
        std::memcpy(qrows + r * D, q + (tok * hq + h * group + g) * D, D * sizeof(uint16_t));
      }
      attention(reinterpret_cast<const bf16*>(qrows), last, k_tiles + h * head_elems, v_tiles + h * head_elems,
                scale2, sums);
      for (int64_t r = 0; r < rn; ++r) {
        const int64_t row = r0 + r, tok = row / group, g = row % group;
        bf16* dst = out + (tok * hq + h * group + g) * D;
        for (int64_t c = 0; c < D; c += 16) F16::load(sums + r * D + c).store(dst + c);
      }
    }
  });
#else
  (void)q, (void)n, (void)hq, (void)hk, (void)start, (void)k_tiles, (void)v_tiles, (void)head_elems, (void)scale,
      (void)out;
  KV_CHECK(false, "AMX tiles are not compiled into the ", vec::kLevelName, " kernels");
#endif
}

}  // namespace kvops::amx

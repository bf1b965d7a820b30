// Causal attention of a prefill chunk over its paged float KV context.
#include "ops_common.h"

namespace {

using namespace kvops;

// Work item -> (KV head, block of query rows). A causal row block costs in proportion to its
// position and parallel_for gives each thread one contiguous range of items, so consecutive items
// alternate between the cheapest and the dearest remaining row blocks: every range gets a fair
// share (in head-major order the thread holding the last rows did ~1.4x the other's work).
inline void balanced_item(int64_t item, int64_t hk, int64_t row_blocks, int64_t* h, int64_t* rb) {
  const int64_t i = item / hk;
  *h = item % hk;
  *rb = i % 2 == 0 ? i / 2 : row_blocks - 1 - i / 2;
}

#if defined(__AVX512F__)
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
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        for (int64_t h = 0; h < hk; ++h) pack(h, tile, j, kc + (slot * hk + h) * d, vc + (slot * hk + h) * d);
      }
    }
  });
}

// Prefill attention for one sequence chunk: n query tokens at positions [start, start + n) over a
// context of start + n tokens held in paged blocks. The context's K is first gathered per KV head
// into 16-key tiles transposed to [tile][dim][16] floats, and V into [token][dim] floats, so the
// inner loops are plain FMAs: a tile's 16 scores for one query row are dim broadcast-FMAs, and
// the probability-weighted V sum keeps the head dimension in registers. Online softmax per row;
// RB query rows share every K/V load. Float arithmetic throughout.
template <typename T, int NC>
void prefill_attention_vec(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, int64_t context_len, at::Tensor& out, double scale) {
  constexpr int64_t D = NC * 16;
  constexpr int RB = NC <= 4 ? 6 : 2;  // query rows per register block (6: 1.3x over 4 in f32, 1.15x in bf16)
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
  const float fscale = static_cast<float>(scale);

  std::vector<float> kt(hk * tiles * D * 16, 0.f), vf(hk * tiles * 16 * D, 0.f);
  for_each_context_row(kc, vc, table, block_size, context_len, hk, D,
                       [&](int64_t h, int64_t tile, int64_t j, const T* krow, const T* vrow) {
    float* kdst = kt.data() + (h * tiles + tile) * D * 16 + j;
    float* vdst = vf.data() + (h * tiles * 16 + tile * 16 + j) * D;
    for (int64_t i = 0; i < D; ++i) {
      kdst[i * 16] = to_float(krow[i]);
      vdst[i] = to_float(vrow[i]);
    }
  });

  // work items: (KV head, block of RB query rows); rows are (token, group member) pairs
  const int64_t rows_per_head = n * group;
  const int64_t row_blocks = (rows_per_head + RB - 1) / RB;
  at::parallel_for(0, hk * row_blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float qf[RB][D];
    alignas(64) float probs[RB][16];
    for (int64_t item = begin; item < end; ++item) {
      int64_t h, rb;
      balanced_item(item, hk, row_blocks, &h, &rb);
      const int64_t r0 = rb * RB, rn = std::min<int64_t>(RB, rows_per_head - r0);
      int64_t last[RB];  // the last key each row may see
      __m512 acc[RB][NC];
      OnlineSoftmax softmax[RB];
      for (int r = 0; r < RB; ++r) {
        const int64_t row = r0 + std::min<int64_t>(r, rn - 1);  // idle rows repeat the last real one
        const int64_t tok = row / group, g = row % group;
        last[r] = start + tok;
        const T* src = q_ptr + (tok * hq + h * group + g) * D;
        for (int64_t i = 0; i < D; ++i) qf[r][i] = to_float(src[i]) * fscale;
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
      }
      int64_t max_last = 0;
      for (int r = 0; r < RB; ++r) max_last = std::max(max_last, last[r]);
      const float* ktile = kt.data() + h * tiles * D * 16;
      const float* vhead = vf.data() + h * tiles * 16 * D;
      for (int64_t tile = 0; tile * 16 <= max_last; ++tile) {
        const float* kp = ktile + tile * D * 16;
        // two accumulators per row (even / odd dims): twice the independent FMA chains
        __m512 s[RB], s_odd[RB];
        for (int r = 0; r < RB; ++r) s[r] = s_odd[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 2) {
          const __m512 k0 = _mm512_loadu_ps(kp + i * 16), k1 = _mm512_loadu_ps(kp + (i + 1) * 16);
          for (int r = 0; r < RB; ++r) {
            s[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r][i]), k0, s[r]);
            s_odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r][i + 1]), k1, s_odd[r]);
          }
        }
        for (int r = 0; r < RB; ++r) s[r] = _mm512_add_ps(s[r], s_odd[r]);
        int64_t tile_keys = 0;
        for (int r = 0; r < RB; ++r) {
          const int64_t visible = std::min<int64_t>(16, last[r] - tile * 16 + 1);
          tile_keys = std::max(tile_keys, visible);
          const __mmask16 valid = visible <= 0 ? 0 : static_cast<__mmask16>((1u << visible) - 1u);
          if (!valid) {
            _mm512_store_ps(probs[r], _mm512_setzero_ps());
            continue;
          }
          float corr;
          _mm512_store_ps(probs[r], softmax[r].update(s[r], valid, &corr));
          if (corr != 1.f)
            for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_set1_ps(corr));
        }
        const float* vp = vhead + tile * 16 * D;
        for (int64_t j = 0; j < tile_keys; ++j) {
          __m512 vv[NC];
          for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(vp + j * D + c * 16);
          for (int r = 0; r < RB; ++r) {
            const __m512 p = _mm512_set1_ps(probs[r][j]);
            for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(p, vv[c], acc[r][c]);
          }
        }
      }
      for (int r = 0; r < rn; ++r) {
        const int64_t row = r0 + r, tok = row / group, g = row % group;
        const __m512 inv = _mm512_set1_ps(1.f / softmax[r].total());
        T* dst = o_ptr + (tok * hq + h * group + g) * D;
        for (int c = 0; c < NC; ++c) store16(dst + c * 16, _mm512_mul_ps(acc[r][c], inv));
      }
    }
  });
}
#endif

#if defined(__AVX512BF16__)
// The bfloat16 twin of prefill_attention_vec with AVX512-BF16 dot products: K tiles are packed as
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
  const int64_t tiles = (context_len + 15) / 16;
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
    uint16_t* kt = kp.data() + (h * tiles + tile) * tile_elems;
    uint16_t* vt = vp.data() + (h * tiles + tile) * tile_elems + (j / 2) * D * 2 + (j % 2);
    for (int64_t i = 0; i < D; ++i) {
      kt[((i / 2) * 16 + j) * 2 + (i % 2)] = krow[i];
      vt[i * 2] = vrow[i];
    }
  });

  const int64_t rows_per_head = n * group;
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
      OnlineSoftmax softmax[RB];
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
          const __mmask16 valid = visible <= 0 ? 0 : static_cast<__mmask16>((1u << visible) - 1u);
          __m512 p = _mm512_setzero_ps();
          if (valid) {
            const __m512 sc = _mm512_mul_ps(s[r], vscale);
            float corr;
            p = softmax[r].update(sc, valid, &corr);
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
        for (int c = 0; c < NC; ++c) store16(dst + c * 16, _mm512_mul_ps(acc[r][c], inv));
      }
    }
  });
}
#endif

}  // namespace

using namespace kvops;

// Attention of one prefill chunk (n query tokens, the last n of context_len) over its paged context.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, int64_t context_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [n, hq, head_dim]");
  check_cache(k_cache, q);
  check_cache(v_cache, q);
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1, "block table must be int64 [blocks]");
  TORCH_CHECK(context_len >= q.size(0) && block_table.size(0) * k_cache.size(1) >= context_len,
              "context longer than its block table");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  auto out = at::empty_like(q);
  auto table = block_table.contiguous();
  bool done = false;
#if defined(__AVX512F__)
  const int64_t d = q.size(2);
  if (q.scalar_type() == at::kFloat && d == 64) {
    prefill_attention_vec<float, 4>(q, k_cache, v_cache, table, context_len, out, scale); done = true;
  } else if (q.scalar_type() == at::kFloat && d == 128) {
    prefill_attention_vec<float, 8>(q, k_cache, v_cache, table, context_len, out, scale); done = true;
  } else if (q.scalar_type() == at::kBFloat16 && d == 64) {
#if defined(__AVX512BF16__)
    prefill_attention_bf16<4>(q, k_cache, v_cache, table, context_len, out, scale);
#else
    prefill_attention_vec<c10::BFloat16, 4>(q, k_cache, v_cache, table, context_len, out, scale);
#endif
    done = true;
  } else if (q.scalar_type() == at::kBFloat16 && d == 128) {
#if defined(__AVX512BF16__)
    prefill_attention_bf16<8>(q, k_cache, v_cache, table, context_len, out, scale);
#else
    prefill_attention_vec<c10::BFloat16, 8>(q, k_cache, v_cache, table, context_len, out, scale);
#endif
    done = true;
  }
#endif
  TORCH_CHECK(done, "paged_prefill_attention supports head_dim 64/128 in float32/bfloat16 on AVX-512 CPUs");
  return out;
}

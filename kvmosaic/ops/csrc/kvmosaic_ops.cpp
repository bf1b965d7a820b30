// CPU kernels for the decode path: rotary + KV-cache write, decode attention that
// reads K/V blocks in place (no gather copy), residual add + RMSNorm.
// Float32 and bfloat16; all arithmetic in float32.
#include <torch/extension.h>
#include <immintrin.h>
#include <ATen/Parallel.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace kvmosaic_simd;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline void store(T* dst, float x) { *dst = static_cast<T>(x); }

#if defined(__AVX512F__)
// Rounds float lanes to the precision of T (a no-op for float).
template <typename T>
inline __m512 round_to(__m512 v);
template <>
inline __m512 round_to<float>(__m512 v) { return v; }
template <>
inline __m512 round_to<c10::BFloat16>(__m512 v) {
#if defined(__AVX512BF16__)
  const __m256i bits = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#else
  alignas(64) c10::BFloat16 tmp[16];
  store16(tmp, v);
  return load16(tmp);
#endif
}

#endif

// Rotate one head vector (HF "rotate half" layout) into dst.
template <typename T>
inline void rotate_head(const T* src, T* dst, const float* cos, const float* sin, int64_t half) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= half; i += 16) {
    const __m512 x1 = load16(src + i), x2 = load16(src + i + half);
    const __m512 c = _mm512_loadu_ps(cos + i), s = _mm512_loadu_ps(sin + i);
    store16(dst + i, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)));
    store16(dst + i + half, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)));
  }
#endif
  for (; i < half; ++i) {
    const float x1 = to_float(src[i]);
    const float x2 = to_float(src[i + half]);
    store(dst + i, x1 * cos[i] - x2 * sin[i]);
    store(dst + i + half, x2 * cos[i] + x1 * sin[i]);
  }
}

template <typename T>
void rope_and_cache_impl(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_table,
                         const at::Tensor& sin_table, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, at::Tensor& q_out, int64_t hq, int64_t hk) {
  const int64_t n = qkv.size(0);
  const int64_t d = q_out.size(2);
  const int64_t half = d / 2;
  const int64_t row_stride = qkv.stride(0);
  const T* qkv_ptr = qkv.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* cos_ptr = cos_table.data_ptr<float>();
  const float* sin_ptr = sin_table.data_ptr<float>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  T* qo = q_out.data_ptr<T>();
  const int64_t slot_stride = hk * d;  // cache viewed as [slots, hk, d]
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv_ptr + t * row_stride;
      const float* c = cos_ptr + pos[t] * half;
      const float* s = sin_ptr + pos[t] * half;
      for (int64_t h = 0; h < hq; ++h) rotate_head(row + h * d, qo + (t * hq + h) * d, c, s, half);
      T* kdst = kc + slots[t] * slot_stride;
      T* vdst = vc + slots[t] * slot_stride;
      const T* ksrc = row + hq * d;
      const T* vsrc = ksrc + hk * d;
      for (int64_t h = 0; h < hk; ++h) rotate_head(ksrc + h * d, kdst + h * d, c, s, half);
      std::memcpy(vdst, vsrc, sizeof(T) * hk * d);
    }
  });
}

// Widen one row to float. The bf16 case is a plain shift so the compiler vectorizes it.
inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}


template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
                           double scale) {
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), hk = k_cache.size(2);
  const int64_t group = hq / hk;
  const int64_t width = block_tables.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t slot_stride = hk * d;
  const float fscale = static_cast<float>(scale);
  int64_t max_ctx = 0;
  for (int64_t b = 0; b < batch; ++b) max_ctx = std::max(max_ctx, lens[b]);

  at::parallel_for(0, batch * hk, 1, [&](int64_t begin, int64_t end) {
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
        const int64_t block = tables[b * width + t / block_size];
        load_row(kc + (block * block_size + t % block_size) * slot_stride + h * d, row.data(), d);
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
          sc[t] = exp_nonpositive(sc[t] - mx);
          sum += sc[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < ctx; ++t) sc[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t block = tables[b * width + t / block_size];
        load_row(vc + (block * block_size + t % block_size) * slot_stride + h * d, row.data(), d);
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
  });
}

#if defined(__AVX512F__)
// One query head held in registers; dot() returns the lane-wise partial products of q . k for one
// cached row (the caller sums the lanes). bf16 uses AVX512-BF16 dot products (float accumulation).
template <typename T, int NC>
struct QueryDot;

template <int NC>
struct QueryDot<float, NC> {
  __m512 q[NC];
  void load(const float* p) {
    for (int c = 0; c < NC; ++c) q[c] = _mm512_loadu_ps(p + c * 16);
  }
  __m512 dot(const float* k) const {
    __m512 s = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
    for (int c = 1; c < NC; ++c) s = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k + c * 16), s);
    return s;
  }
};

template <int NC>
struct QueryDot<c10::BFloat16, NC> {
#if defined(__AVX512BF16__)
  __m512bh q[NC / 2];
  void load(const c10::BFloat16* p) {
    for (int c = 0; c < NC / 2; ++c) q[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p + c * 32));
  }
  __m512 dot(const c10::BFloat16* k) const {
    __m512 s = _mm512_setzero_ps();
    for (int c = 0; c < NC / 2; ++c)
      s = _mm512_dpbf16_ps(s, q[c], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(k + c * 32)));
    return s;
  }
#else
  __m512 q[NC];
  void load(const c10::BFloat16* p) {
    for (int c = 0; c < NC; ++c) q[c] = load16(p + c * 16);
  }
  __m512 dot(const c10::BFloat16* k) const {
    __m512 s = _mm512_mul_ps(q[0], load16(k));
    for (int c = 1; c < NC; ++c) s = _mm512_fmadd_ps(q[c], load16(k + c * 16), s);
    return s;
  }
#endif
};




// Decode attention with the head dimension in registers (NC vectors of 16 floats), in one pass
// over the context with an online softmax. One work item is one sequence: its K/V rows are read
// from their blocks in place, all KV heads of a slot together (every cache line fetched is used),
// sixteen tokens at a time, with the next sixteen prefetched.
template <typename T, int NC>
void decode_attention_vec(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
                          double scale) {
  constexpr int64_t D = NC * 16;
  const int64_t batch = q.size(0), hq = q.size(1);
  const int64_t block_size = k_cache.size(1), hk = k_cache.size(2);
  const int64_t group = hq / hk;
  const int64_t width = block_tables.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t slot_stride = hk * D;
  const int64_t slot_bytes = slot_stride * static_cast<int64_t>(sizeof(T));
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));

  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<QueryDot<T, NC>> qd(hq);
    std::vector<__m512> part(group * 16), acc(hq * NC);
    std::vector<OnlineSoftmax> softmax(hq);
    std::vector<float> probs(hq * 16);
    int64_t slots[16], pf_slots[16];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ctx = lens[b];
      const int64_t* table = tables + b * width;
      auto slot_of = [&](int64_t t) { return table[t / block_size] * block_size + t % block_size; };
      for (int64_t h = 0; h < hq; ++h) qd[h].load(q_ptr + (b * hq + h) * D);
      std::fill(softmax.begin(), softmax.end(), OnlineSoftmax());
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, ctx - t0);
        const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
        for (int64_t j = 0; j < n; ++j) slots[j] = slot_of(t0 + j);
        // the next sixteen rows (on the last chunk: the next sequence's first ones), prefetched one
        // row per step of the first score loop below
        int64_t pf_count = 0;
        for (int64_t t = t0 + 16; t < std::min(ctx, t0 + 32); ++t) pf_slots[pf_count++] = slot_of(t);
        if (t0 + 16 >= ctx && b + 1 < end) {
          const int64_t* next_table = tables + (b + 1) * width;
          for (int64_t t = 0; t < std::min<int64_t>(16, lens[b + 1]); ++t)
            pf_slots[pf_count++] = next_table[t / block_size] * block_size + t % block_size;
        }
        // scores of the sixteen tokens for every head, folded into the running softmax
        for (int64_t kh = 0; kh < hk; ++kh) {
          for (int64_t j = 0; j < 16; ++j) {
            if (kh == 0 && j < pf_count) {
              for (int64_t off = 0; off < slot_bytes; off += 64) {
                _mm_prefetch(reinterpret_cast<const char*>(kc + pf_slots[j] * slot_stride) + off, _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(vc + pf_slots[j] * slot_stride) + off, _MM_HINT_T0);
              }
            }
            for (int64_t g = 0; g < group; ++g)
              part[g * 16 + kSumSlot[j]] = j < n ? qd[kh * group + g].dot(kc + slots[j] * slot_stride + kh * D)
                                                 : _mm512_setzero_ps();
          }
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kh * group + g;
            const __m512 sc = _mm512_mul_ps(sum_lanes16(part.data() + g * 16), vscale);
            float corr;
            _mm512_storeu_ps(probs.data() + h * 16, softmax[h].update(sc, valid, &corr));
            if (corr != 1.f)
              for (int c = 0; c < NC; ++c) acc[h * NC + c] = _mm512_mul_ps(acc[h * NC + c], _mm512_set1_ps(corr));
          }
        }
        // acc[h] += p[h][j] * v_j, a few heads at a time with their accumulators in registers
        constexpr int64_t HB = NC <= 4 ? 4 : 2;
        for (int64_t kh = 0; kh < hk; ++kh) {
          for (int64_t g0 = 0; g0 < group; g0 += HB) {
            const int64_t h0 = kh * group + g0, hn = std::min(HB, group - g0);
            __m512 a[HB][NC];
            for (int64_t i = 0; i < HB; ++i)
              for (int c = 0; c < NC; ++c) a[i][c] = i < hn ? acc[(h0 + i) * NC + c] : _mm512_setzero_ps();
            for (int64_t j = 0; j < n; ++j) {
              const T* row = vc + slots[j] * slot_stride + kh * D;
              __m512 vv[NC];
              for (int c = 0; c < NC; ++c) vv[c] = load16(row + c * 16);
              for (int64_t i = 0; i < HB; ++i) {
                if (i >= hn) break;
                const __m512 p = _mm512_set1_ps(probs[(h0 + i) * 16 + j]);
                for (int c = 0; c < NC; ++c) a[i][c] = _mm512_fmadd_ps(p, vv[c], a[i][c]);
              }
            }
            for (int64_t i = 0; i < hn; ++i)
              for (int c = 0; c < NC; ++c) acc[(h0 + i) * NC + c] = a[i][c];
          }
        }
      }
      for (int64_t h = 0; h < hq; ++h) {
        const __m512 inv = _mm512_set1_ps(1.f / softmax[h].total());
        for (int c = 0; c < NC; ++c) store16(o_ptr + (b * hq + h) * D + c * 16, _mm512_mul_ps(acc[h * NC + c], inv));
      }
    }
  });
}
#endif

#if defined(__AVX512F__)
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
  constexpr int RB = NC <= 4 ? 4 : 2;  // query rows per register block
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
  const int64_t slot_stride = hk * D;
  const float fscale = static_cast<float>(scale);

  std::vector<float> kt(hk * tiles * D * 16, 0.f), vf(hk * tiles * 16 * D, 0.f);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      for (int64_t j = 0; j < 16 && tile * 16 + j < context_len; ++j) {
        const int64_t t = tile * 16 + j;
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        for (int64_t h = 0; h < hk; ++h) {
          const T* krow = kc + slot * slot_stride + h * D;
          const T* vrow = vc + slot * slot_stride + h * D;
          float* kdst = kt.data() + (h * tiles + tile) * D * 16 + j;
          float* vdst = vf.data() + (h * tiles * 16 + t) * D;
          for (int64_t i = 0; i < D; ++i) {
            kdst[i * 16] = to_float(krow[i]);
            vdst[i] = to_float(vrow[i]);
          }
        }
      }
    }
  });

  // work items: (KV head, block of RB query rows); rows are (token, group member) pairs
  const int64_t rows_per_head = n * group;
  const int64_t row_blocks = (rows_per_head + RB - 1) / RB;
  at::parallel_for(0, hk * row_blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float qf[RB][D];
    alignas(64) float probs[RB][16];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / row_blocks, rb = item % row_blocks;
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
  constexpr int RB = NC <= 4 ? 4 : 2;
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
  const int64_t slot_stride = hk * D;
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));
  const int64_t tile_elems = 16 * D;  // bf16 values per packed tile of K or V

  std::vector<uint16_t> kp(hk * tiles * tile_elems, 0), vp(hk * tiles * tile_elems, 0);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      for (int64_t j = 0; j < 16 && tile * 16 + j < context_len; ++j) {
        const int64_t t = tile * 16 + j;
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        for (int64_t h = 0; h < hk; ++h) {
          const uint16_t* krow = kc + slot * slot_stride + h * D;
          const uint16_t* vrow = vc + slot * slot_stride + h * D;
          uint16_t* kt = kp.data() + (h * tiles + tile) * tile_elems;
          uint16_t* vt = vp.data() + (h * tiles + tile) * tile_elems + (j / 2) * D * 2 + (j % 2);
          for (int64_t i = 0; i < D; ++i) {
            kt[((i / 2) * 16 + j) * 2 + (i % 2)] = krow[i];
            vt[i * 2] = vrow[i];
          }
        }
      }
    }
  });

  const int64_t rows_per_head = n * group;
  const int64_t row_blocks = (rows_per_head + RB - 1) / RB;
  at::parallel_for(0, hk * row_blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t qpairs[RB][D / 2];
    alignas(64) uint16_t probs[RB][16];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / row_blocks, rb = item % row_blocks;
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

// Dispatch: the register-blocked kernel for head_dim 64 / 128, the generic loop otherwise.
template <typename T>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out, double scale) {
#if defined(__AVX512F__)
  const int64_t d = q.size(2);
  if (d == 64) return decode_attention_vec<T, 4>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
  if (d == 128) return decode_attention_vec<T, 8>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
#endif
  decode_attention_impl<T>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
}

template <typename T>
void add_rms_norm_impl(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, at::Tensor& out,
                       double eps, bool has_delta) {
  const int64_t n = residual.size(0), h = residual.size(1);
  T* res = residual.data_ptr<T>();
  const T* dl = has_delta ? delta.data_ptr<T>() : nullptr;
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(h);
    for (int64_t t = begin; t < end; ++t) {
      T* r = res + t * h;
#if defined(__AVX512F__)
      if (h % 16 == 0) {  // the same roundings as below, 16 lanes at a time
        __m512 sq16 = _mm512_setzero_ps();
        for (int64_t i = 0; i < h; i += 16) {
          __m512 x = load16(r + i);
          if (dl) {
            x = round_to<T>(_mm512_add_ps(x, load16(dl + t * h + i)));
            store16(r + i, x);
          }
          _mm512_storeu_ps(row.data() + i, x);
          sq16 = _mm512_fmadd_ps(x, x, sq16);
        }
        const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(sq16) / static_cast<float>(h) + static_cast<float>(eps));
        const __m512 vinv = _mm512_set1_ps(inv);
        for (int64_t i = 0; i < h; i += 16) {
          const __m512 normed = round_to<T>(_mm512_mul_ps(_mm512_loadu_ps(row.data() + i), vinv));
          store16(o + t * h + i, _mm512_mul_ps(load16(w + i), normed));
        }
        continue;
      }
#endif
      float sq = 0.f;
      for (int64_t i = 0; i < h; ++i) {
        float x = to_float(r[i]);
        if (dl) {
          // round the sum to the activation dtype first, as the unfused residual add would
          x = to_float(static_cast<T>(x + to_float(dl[t * h + i])));
          r[i] = static_cast<T>(x);
        }
        row[i] = x;
        sq += x * x;
      }
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(h) + static_cast<float>(eps));
      for (int64_t i = 0; i < h; ++i) {
        // normalize in float, round to the activation dtype, then scale (HF order)
        const float normed = to_float(static_cast<T>(row[i] * inv));
        store(o + t * h + i, to_float(w[i]) * normed);
      }
    }
  });
}


#if defined(__AVX512F__)
// Weight rows as vectors of 16 float lanes: float32 loads directly; bfloat16 multiplies pairs with
// AVX512-BF16 (32 values per instruction, float accumulation).
template <typename T>
struct GemvStep;

template <>
struct GemvStep<float> {
  static constexpr int64_t kWidth = 16;
  static __m512 fma(const float* w, const float* x, __m512 acc) {
    return _mm512_fmadd_ps(_mm512_loadu_ps(w), _mm512_loadu_ps(x), acc);
  }
};

#if defined(__AVX512BF16__)
template <>
struct GemvStep<c10::BFloat16> {
  static constexpr int64_t kWidth = 32;
  static __m512 fma(const c10::BFloat16* w, const c10::BFloat16* x, __m512 acc) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w)),
                            (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x)));
  }
};
#endif

// out[m, n] = x[m, :] . w[n, :] for M (<= 8) activation rows. The weight is read once, front to
// back (rows are contiguous, so each thread's share is one sequential stream), with U partial sums
// per output so that M * U multiply-add chains run side by side, and a software prefetch ahead.
template <typename T, int M, int U>
void gemv_rows(const T* xp, const T* wp, T* op, int64_t k, int64_t n) {
  constexpr int64_t W = GemvStep<T>::kWidth;
  constexpr int64_t kAhead = 4096 / sizeof(T);  // prefetch distance: 4 KiB (1, 2, 8 and 16 KiB measured slower)
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* wr = wp + row * k;
      __m512 acc[M][U];
      for (int m = 0; m < M; ++m)
        for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + U * W <= k; i += U * W) {
        _mm_prefetch(reinterpret_cast<const char*>(wr + i + kAhead), _MM_HINT_T0);
        for (int u = 0; u < U; ++u)
          for (int m = 0; m < M; ++m) acc[m][u] = GemvStep<T>::fma(wr + i + u * W, xp + m * k + i + u * W, acc[m][u]);
      }
      for (; i < k; i += W)
        for (int m = 0; m < M; ++m) acc[m][0] = GemvStep<T>::fma(wr + i, xp + m * k + i, acc[m][0]);
      for (int m = 0; m < M; ++m) {
        __m512 sum = acc[m][0];
        for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[m][u]);
        op[m * n + row] = static_cast<T>(_mm512_reduce_add_ps(sum));
      }
    }
  });
}

template <typename T>
bool gemv_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  switch (m) {
    case 1: gemv_rows<T, 1, 4>(xp, wp, op, k, n); return true;
    case 2: gemv_rows<T, 2, 4>(xp, wp, op, k, n); return true;
    case 3: gemv_rows<T, 3, 2>(xp, wp, op, k, n); return true;
    case 4: gemv_rows<T, 4, 2>(xp, wp, op, k, n); return true;
    case 5: gemv_rows<T, 5, 2>(xp, wp, op, k, n); return true;
    case 6: gemv_rows<T, 6, 2>(xp, wp, op, k, n); return true;
    case 7: gemv_rows<T, 7, 1>(xp, wp, op, k, n); return true;
    case 8: gemv_rows<T, 8, 1>(xp, wp, op, k, n); return true;
    default: return false;
  }
}
constexpr bool kHasGemv = true;
#if defined(__AVX512BF16__)
constexpr bool kHasBf16Gemv = true;
#else
constexpr bool kHasBf16Gemv = false;
#endif
#else
constexpr bool kHasGemv = false;
constexpr bool kHasBf16Gemv = false;
#endif

// silu(gate) * up for a fused [N, 2F] (gate | up) projection in one pass. silu is rounded to the
// activation dtype before the product, as the two-op PyTorch path does.
template <typename T>
void silu_and_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t n = gate_up.size(0), f = gate_up.size(1) / 2;
  const T* src = gate_up.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = src + t * 2 * f;
      const T* up = gate + f;
      T* o = dst + t * f;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= f; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = round_to<T>(_mm512_div_ps(g, _mm512_add_ps(one, e)));
        store16(o + i, _mm512_mul_ps(silu, load16(up + i)));
      }
#endif
      for (; i < f; ++i) {
        const float g = to_float(gate[i]);
        const float silu = to_float(static_cast<T>(g / (1.f + std::exp(-g))));
        store(o + i, silu * to_float(up[i]));
      }
    }
  });
}

void check_cache(const at::Tensor& cache, const at::Tensor& like) {
  TORCH_CHECK(cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(cache.scalar_type() == like.scalar_type(), "KV cache dtype must match activations");
  TORCH_CHECK(cache.dim() == 4, "KV cache must be [num_blocks, block_size, kv_heads, head_dim]");
}

}  // namespace

// Rotates q and k of a fused qkv projection by their positions, writes k and v
// into their cache slots, and returns the rotated q as [N, hq, head_dim].
at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_table,
                          const at::Tensor& sin_table, at::Tensor k_cache, at::Tensor v_cache,
                          const at::Tensor& slot_mapping, int64_t hq, int64_t hk) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [N, (hq + 2 hk) * head_dim], row-major");
  check_cache(k_cache, qkv);
  check_cache(v_cache, qkv);
  const int64_t d = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hk) * d, "qkv width does not match head counts");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && cos_table.size(1) * 2 == d, "cos table shape");
  auto q_out = at::empty({qkv.size(0), hq, d}, qkv.options());
  auto pos = positions.contiguous();
  auto slots = slot_mapping.contiguous();
  if (qkv.scalar_type() == at::kFloat) {
    rope_and_cache_impl<float>(qkv, pos, cos_table, sin_table, k_cache, v_cache, slots, q_out, hq, hk);
  } else if (qkv.scalar_type() == at::kBFloat16) {
    rope_and_cache_impl<c10::BFloat16>(qkv, pos, cos_table, sin_table, k_cache, v_cache, slots, q_out, hq, hk);
  } else {
    TORCH_CHECK(false, "rope_and_cache supports float32 and bfloat16");
  }
  return q_out;
}

// One query token per sequence; K/V read from the sequence's blocks in place.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [B, hq, head_dim]");
  check_cache(k_cache, q);
  check_cache(v_cache, q);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  auto out = at::empty_like(q);
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  if (q.scalar_type() == at::kFloat) {
    decode_attention<float>(q, k_cache, v_cache, tables, lens, out, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_attention<c10::BFloat16>(q, k_cache, v_cache, tables, lens, out, scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
  return out;
}

// residual += delta (when given), then returns rms_norm(residual) * weight. Updates residual in place.
at::Tensor add_rms_norm(at::Tensor residual, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "residual must be contiguous [N, hidden]");
  TORCH_CHECK(weight.scalar_type() == residual.scalar_type(), "weight dtype must match activations");
  at::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == residual.sizes() && d.scalar_type() == residual.scalar_type(), "delta mismatch");
  }
  auto out = at::empty_like(residual);
  auto w = weight.contiguous();
  if (residual.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(residual, d, w, out, eps, delta.has_value());
  } else if (residual.scalar_type() == at::kBFloat16) {
    add_rms_norm_impl<c10::BFloat16>(residual, d, w, out, eps, delta.has_value());
  } else {
    TORCH_CHECK(false, "add_rms_norm supports float32 and bfloat16");
  }
  return out;
}

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

// [M, K] x [N, K]^T for M <= 8 rows (decode batches), float32 or bfloat16 (K a multiple of 16 / 32).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(kHasGemv, "gemv was built without AVX-512");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "gemv: x and w dtypes differ");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv needs x [M, K], w [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "gemv handles 1 to 8 rows");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  bool done = false;
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(x.size(1) % 16 == 0, "float32 gemv needs K % 16 == 0");
    done = gemv_impl<float>(xc, wc, out);
  }
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(x.size(1) % 32 == 0, "bfloat16 gemv needs K % 32 == 0");
    done = gemv_impl<c10::BFloat16>(xc, wc, out);
  }
#endif
#endif
  TORCH_CHECK(done, "gemv: unsupported dtype ", x.scalar_type());
  return out;
}

// silu(gate) * up of a fused [N, 2F] gate/up projection.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul needs [N, 2F]");
  auto src = gate_up.contiguous();
  auto out = at::empty({src.size(0), src.size(1) / 2}, src.options());
  if (src.scalar_type() == at::kFloat) {
    silu_and_mul_impl<float>(src, out);
  } else if (src.scalar_type() == at::kBFloat16) {
    silu_and_mul_impl<c10::BFloat16>(src, out);
  } else {
    TORCH_CHECK(false, "silu_and_mul supports float32 and bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_and_cache", &rope_and_cache, "rotary embedding + KV cache write");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged KV blocks");
  m.def("paged_prefill_attention", &paged_prefill_attention, "causal attention of a prefill chunk over paged KV");
  m.def("prefill_attention_supports", [](int64_t head_dim) {
#if defined(__AVX512F__)
    return head_dim == 64 || head_dim == 128;
#else
    return false;
#endif
  });
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU over a fused gate/up projection");
  m.def("gemv", &gemv, "decode-size (<= 8 rows) matrix-vector product");
  m.attr("has_gemv") = kHasGemv;
  m.attr("has_bf16_gemv") = kHasBf16Gemv;
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm", py::arg("residual"), py::arg("delta"),
        py::arg("weight"), py::arg("eps"));
}

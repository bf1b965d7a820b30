// Reading quantized records: dequantization of whole blocks (prefill chunks attend over them) and
// the scalar decode-attention kernel for head dims other than 64 / 128, which dequantizes each head
// vector into a small float buffer; the row kernel (kvquant_decode_fast.cpp) takes head_dim 64 / 128
// on every ISA level, over the same dequantized values as the blocks (kvquant_rows.h).
#include "kvquant/kvquant_format.h"
#include "kvquant/kvquant_rows.h"

namespace kvquant {
namespace {

// One head vector of a record into dst[0, d).
template <int64_t D = 0>  // D > 0: the head dimension as a compile-time constant (loops unroll)
inline void decode_head(const uint8_t* rec, int64_t h, const Format& f, const Thresholds& t, float* __restrict dst) {
  const int64_t half = (D > 0 ? D : f.d) / 2;
  if (f.mode == kBf16) {
    const auto* p = reinterpret_cast<const vec::bf16*>(rec) + h * 2 * half;
    for (int64_t i = 0; i < 2 * half; ++i) dst[i] = static_cast<float>(p[i]);
    return;
  }
  if (f.mode == kInt8 || f.mode == kInt4) {
    const uint8_t* p = rec + h * (kIntHeader + f.code_bytes);
    const float lo = read_half(p), s = read_half(p + 2);
    const uint8_t* __restrict codes = p + kIntHeader;
    if (f.mode == kInt8) {
#pragma omp simd
      for (int64_t i = 0; i < 2 * half; ++i) dst[i] = lo + static_cast<float>(codes[i]) * s;
    } else {
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        dst[2 * j] = lo + static_cast<float>(codes[j] & 15) * s;
        dst[2 * j + 1] = lo + static_cast<float>(codes[j] >> 4) * s;
      }
    }
    return;
  }
  const OakenScales sc = read_scales(rec + h * kOakenHeader);
  const float inner_hi = t.inner_hi, inner_lo = t.inner_lo;
  const uint8_t* __restrict dense = rec + kOakenHeader * f.hk + h * f.code_bytes;
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    const float y0 = sc.mid_lo + static_cast<float>(dense[j] & 15) * sc.mid_s;
    const float y1 = sc.mid_lo + static_cast<float>(dense[j] >> 4) * sc.mid_s;
    dst[2 * j] = y0 + (y0 >= 0.f ? inner_hi : inner_lo);
    dst[2 * j + 1] = y1 + (y1 >= 0.f ? inner_hi : inner_lo);
  }
  patch_sparse(rec, h, f, t, sc, dense, dst);
}

constexpr int64_t kTile = 16;

// Online-softmax decode attention of one (sequence, KV head): tiles of 16 keys are dequantized
// into a small float buffer and scored against the group's query rows; the softmax runs over the
// tile's 16 scores at once; then the tile's values are dequantized and each query row's
// accumulator (D floats, kept in registers when D is a compile-time constant) takes them in.
template <typename T, int64_t D>
void decode_one(const T* q, const uint8_t* kp, const uint8_t* vp, const int64_t* table, int64_t ctx,
                int64_t block_size, int64_t h, int64_t group, const Format& f, const Thresholds& kt,
                const Thresholds& vt, float scale, T* out, std::vector<float>& work, const PartialOut* partial,
                int64_t row0) {
  const int64_t d = D > 0 ? D : f.d;
  float* qf = work.data();                 // [group, d]
  float* acc = qf + group * d;             // [group, d]
  float* tile = acc + group * d;           // [kTile, d]
  float* probs = tile + kTile * d;         // [group, kTile]
  float* run = probs + group * kTile;      // [2, group]: max, sum
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < d; ++i) qf[g * d + i] = to_float(q[g * d + i]) * scale;
    run[g] = -std::numeric_limits<float>::infinity(), run[group + g] = 0.f;
  }
  std::fill(acc, acc + group * d, 0.f);
  int64_t offsets[kTile];
  for (int64_t t0 = 0; t0 < ctx; t0 += kTile) {
    const int64_t n = std::min(kTile, ctx - t0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = t0 + j;
      offsets[j] = kvops::slot_of(table, t, block_size) * f.record;
      decode_head<D>(kp + offsets[j], h, f, kt, tile + j * d);
    }
    for (int64_t g = 0; g < group; ++g) {
      float sc[kTile];
      const float* qv = qf + g * d;
      for (int64_t j = 0; j < kTile; ++j) {
        float dot = 0.f;
        const float* kv = tile + j * d;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += qv[i] * kv[i];
        sc[j] = j < n ? dot : -std::numeric_limits<float>::infinity();
      }
      float tile_max = sc[0];
      for (int64_t j = 1; j < n; ++j) tile_max = std::max(tile_max, sc[j]);
      const float new_max = std::max(run[g], tile_max);
      const float corr = exp_nonpositive(run[g] - new_max);
      float* pr = probs + g * kTile;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < kTile; ++j) {
        pr[j] = exp_nonpositive(sc[j] - new_max);
        sum += pr[j];
      }
      for (int64_t j = n; j < kTile; ++j) sum -= pr[j], pr[j] = 0.f;  // exp(-inf) clamps to tiny, not 0
      run[g] = new_max, run[group + g] = run[group + g] * corr + sum;
      float* a = acc + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] *= corr;
    }
    for (int64_t j = 0; j < n; ++j) decode_head<D>(vp + offsets[j], h, f, vt, tile + j * d);
    for (int64_t g = 0; g < group; ++g) {
      float a[D > 0 ? D : 1];
      float* ag = D > 0 ? a : acc + g * d;
      if (D > 0) std::memcpy(a, acc + g * d, sizeof(float) * d);
      const float* pr = probs + g * kTile;
      for (int64_t j = 0; j < n; ++j) {
        const float p = pr[j];
        const float* vrow = tile + j * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ag[i] += p * vrow[i];
      }
      if (D > 0) std::memcpy(acc + g * d, a, sizeof(float) * d);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float total = run[group + g];
    if (partial != nullptr) {
      const int64_t row = row0 + g;
      partial->ref[row] = run[g], partial->sum[row] = total;
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int64_t i = 0; i < d; ++i) partial->out[row * d + i] = acc[g * d + i] * inv;
      continue;
    }
    const float inv = 1.f / total;
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = static_cast<T>(acc[g * d + i] * inv);
  }
}

template <typename T>
void dequant_impl(const uint8_t* src, int64_t bs, const int64_t* id, int64_t nb, const Format& f, const Thresholds& t,
                  T* dst) {
  const int64_t rows = nb * bs;
  const Format f8 = row0_format(f);
  kvops::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(f.d);
    std::vector<uint8_t> row0(f.tail * bs);
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* rec = src + kvops::slot_of(id, r, bs) * f.record;
      const bool from_tails = f.tail != 0 && r % bs == 0;  // row 0 of a block: its int8 record
      if (from_tails) gather_row0(src, id[r / bs], f, row0.data()), rec = row0.data();
      const Format& fr = from_tails ? f8 : f;
      for (int64_t h = 0; h < f.hk; ++h) {
        T* row = dst + (r * f.hk + h) * f.d;
        if (f.d == 64 || f.d == 128) {  // the decode kernel's values (kvquant_rows.h)
          if (f.d == 64) dequantize_head_any<4>(rec, h, fr, t, row, buf.data());
          else dequantize_head_any<8>(rec, h, fr, t, row, buf.data());
          continue;
        }
        decode_head(rec, h, f, t, buf.data());
        for (int64_t i = 0; i < f.d; ++i) row[i] = static_cast<T>(buf[i]);
      }
    }
  });
}

template <typename T>
void decode_attention_impl(const DecodeCall& call, const Format& f, const Thresholds& kt, const Thresholds& vt,
                           void* out, const PartialOut* partial) {
  const DecodeBatch<T> batch_of = decode_batch<T>(call, f, out);
  if (decode_attention_fast<T>(batch_of, f, kt, vt, call.scale, partial)) return;
  const auto [batch, hq, group, width, bs, qp, op, kp, vp, tb, ln] = batch_of;
  const float sc = static_cast<float>(call.scale);
  kvops::parallel_for(0, batch * f.hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work(2 * group * f.d + kTile * f.d + group * kTile + 2 * group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / f.hk, h = item % f.hk;
      const int64_t offset = (b * hq + h * group) * f.d;
      T* o = op == nullptr ? nullptr : op + offset;  // a partial writes no output
      if (f.d == 64) {
        decode_one<T, 64>(qp + offset, kp, vp, tb + b * width, ln[b], bs, h, group, f, kt, vt, sc, o, work, partial,
                          b * hq + h * group);
      } else if (f.d == 128) {
        decode_one<T, 128>(qp + offset, kp, vp, tb + b * width, ln[b], bs, h, group, f, kt, vt, sc, o, work, partial,
                           b * hq + h * group);
      } else {
        decode_one<T, 0>(qp + offset, kp, vp, tb + b * width, ln[b], bs, h, group, f, kt, vt, sc, o, work, partial,
                         b * hq + h * group);
      }
    }
  });
}

}  // namespace

void dequantize(const uint8_t* pool, int64_t block_size, const int64_t* block_ids, int64_t n, const Format& f,
                const Thresholds& t, void* out, Rows type) {
  if (type == Rows::kFloat32)
    dequant_impl(pool, block_size, block_ids, n, f, t, static_cast<float*>(out));
  else
    dequant_impl(pool, block_size, block_ids, n, f, t, static_cast<vec::bf16*>(out));
}

void decode_attention(const DecodeCall& call, const Format& f, const Thresholds& kt, const Thresholds& vt, void* out,
                      const PartialOut* partial) {
  if (call.type == Rows::kFloat32)
    decode_attention_impl<float>(call, f, kt, vt, out, partial);
  else
    decode_attention_impl<vec::bf16>(call, f, kt, vt, out, partial);
}

}  // namespace kvquant

// Per-layer kernels around attention: rotary + KV-cache write, residual add + RMSNorm,
// SiLU-and-mul. Float32 and bfloat16; arithmetic in float32.
#include "common/ops_common.h"
#include "common/parallel.h"
#include "isa/vec.h"
#include "layer/layer.h"
#include "layer/stack_kernels.h"

namespace {

using namespace kvops;
namespace vec = kvmosaic_vec;
using vec::bf16;
using vec::F16;

constexpr int64_t kSiluChunk = 256;  // columns per SiLU work item

// Rotate one head vector (HF "rotate half" layout) into dst.
template <typename T>
inline void rotate_head(const T* src, T* dst, const float* cos, const float* sin, int64_t half) {
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const F16 x1 = F16::load(src + i), x2 = F16::load(src + i + half);
    const F16 c = F16::load(cos + i), s = F16::load(sin + i);
    (x1 * c - x2 * s).store(dst + i);
    (x2 * c + x1 * s).store(dst + i + half);
  }
  for (; i < half; ++i) {
    const float x1 = to_float(src[i]);
    const float x2 = to_float(src[i + half]);
    store(dst + i, x1 * cos[i] - x2 * sin[i]);
    store(dst + i + half, x2 * cos[i] + x1 * sin[i]);
  }
}

}  // namespace

namespace kvops {

template <typename T>
const char* RopeStep<T>::slot_line(int64_t item, int64_t offset) const {
  const int64_t heads = hq + 2 * hk, t = item / heads, h = item % heads;
  if (h >= hk && h < hk + hq) return nullptr;
  const T* cache = h < hk ? v_cache : k_cache;
  const int64_t kv = h < hk ? h : h - hk - hq;
  return reinterpret_cast<const char*>(cache + (slots[t] * hk + kv) * head_dim) + offset;
}

template <typename T>
void rope_items(const RopeStep<T>& r, int64_t i0, int64_t i1) {
  const int64_t d = r.head_dim, half = d / 2, heads = r.hq + 2 * r.hk;
  const int64_t slot_stride = r.hk * d;  // cache viewed as [slots, hk, d]
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t t = item / heads, h = item % heads;
    const T* row = r.qkv + t * r.row_stride;
    if (h < r.hk) {  // a V head, copied to its slot
      std::memcpy(r.v_cache + r.slots[t] * slot_stride + h * d, row + (r.hq + r.hk + h) * d, sizeof(T) * d);
      continue;
    }
    const float* c = r.cos + r.positions[t] * half;
    const float* s = r.sin + r.positions[t] * half;
    if (h < r.hk + r.hq) {
      rotate_head(row + (h - r.hk) * d, r.q_out + (t * r.hq + h - r.hk) * d, c, s, half);
      continue;
    }
    const int64_t kh = h - r.hk - r.hq;  // a K head, rotated into its slot
    rotate_head(row + (r.hq + kh) * d, r.k_cache + r.slots[t] * slot_stride + kh * d, c, s, half);
  }
}

template <typename T>
void norm_rows(T* residual, const T* delta, const T* weight, T* out, int64_t h, float eps, int64_t r0, int64_t r1) {
  std::vector<float> row(h);
  for (int64_t t = r0; t < r1; ++t) {
    T* r = residual + t * h;
    const T* dl = delta != nullptr ? delta + t * h : nullptr;
    T* o = out + t * h;
    if (h % 16 == 0) {  // the same roundings as below, 16 lanes at a time
      F16 sq16 = F16::zero();
      for (int64_t i = 0; i < h; i += 16) {
        F16 x = F16::load(r + i);
        if (dl) {
          x = vec::round_to<T>(x + F16::load(dl + i));
          x.store(r + i);
        }
        x.store(row.data() + i);
        sq16 = vec::fma(x, x, sq16);
      }
      const float inv = 1.f / std::sqrt(sq16.reduce_add() / static_cast<float>(h) + eps);
      const F16 vinv = F16::set1(inv);
      for (int64_t i = 0; i < h; i += 16) {
        const F16 normed = vec::round_to<T>(F16::load(row.data() + i) * vinv);
        (F16::load(weight + i) * normed).store(o + i);
      }
      continue;
    }
    float sq = 0.f;
    for (int64_t i = 0; i < h; ++i) {
      float x = to_float(r[i]);
      if (dl) {
        // round the sum to the activation dtype first, as the unfused residual add would
        x = to_float(static_cast<T>(x + to_float(dl[i])));
        r[i] = static_cast<T>(x);
      }
      row[i] = x;
      sq += x * x;
    }
    const float inv = 1.f / std::sqrt(sq / static_cast<float>(h) + eps);
    for (int64_t i = 0; i < h; ++i) {
      // normalize in float, round to the activation dtype, then scale (HF order)
      const float normed = to_float(static_cast<T>(row[i] * inv));
      store(o + i, to_float(weight[i]) * normed);
    }
  }
}

}  // namespace kvops

namespace {

// silu(gate) * up of columns [c0, c1) of one row
template <typename T>
void silu_span(const T* gate, const T* up, T* o, int64_t c0, int64_t c1) {
  int64_t i = c0;
  for (; i + 16 <= c1; i += 16) {
    const F16 g = F16::load(gate + i);
    const F16 silu = vec::round_to<T>(g / (F16::set1(1.f) + vec::exp(F16::zero() - g)));
    (silu * F16::load(up + i)).store(o + i);
  }
  for (; i < c1; ++i) {
    const float g = to_float(gate[i]);
    const float silu = to_float(static_cast<T>(g / (1.f + std::exp(-g))));
    store(o + i, silu * to_float(up[i]));
  }
}

}  // namespace

namespace kvops {

template <typename T>
void silu_items(const T* gate_up, int64_t f, T* out, int64_t i0, int64_t i1) {
  const int64_t chunks = (f + kSiluChunk - 1) / kSiluChunk;
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t t = item / chunks, c0 = item % chunks * kSiluChunk;
    silu_span(gate_up + t * 2 * f, gate_up + t * 2 * f + f, out + t * f, c0, std::min(f, c0 + kSiluChunk));
  }
}

template <typename T>
void silu_columns(const T* gate_up, int64_t f, T* out, int64_t rows, int64_t c0, int64_t c1) {
  for (int64_t t = 0; t < rows; ++t) silu_span(gate_up + t * 2 * f, gate_up + t * 2 * f + f, out + t * f, c0, c1);
}

int64_t silu_work(int64_t rows, int64_t f) { return rows * ((f + kSiluChunk - 1) / kSiluChunk); }

template struct RopeStep<float>;
template struct RopeStep<bf16>;
template void rope_items<float>(const RopeStep<float>&, int64_t, int64_t);
template void rope_items<bf16>(const RopeStep<bf16>&, int64_t, int64_t);
template void norm_rows<float>(float*, const float*, const float*, float*, int64_t, float, int64_t, int64_t);
template void norm_rows<bf16>(bf16*, const bf16*, const bf16*, bf16*, int64_t, float, int64_t, int64_t);
template void silu_items<float>(const float*, int64_t, float*, int64_t, int64_t);
template void silu_items<bf16>(const bf16*, int64_t, bf16*, int64_t, int64_t);
template void silu_columns<float>(const float*, int64_t, float*, int64_t, int64_t, int64_t);
template void silu_columns<bf16>(const bf16*, int64_t, bf16*, int64_t, int64_t, int64_t);

}  // namespace kvops

namespace kvops {

template <typename T>
void rope_rows(const RopeStep<T>& step, int64_t rows) {
  parallel_for(0, step.items(rows), step.items(16), [&](int64_t i0, int64_t i1) { rope_items(step, i0, i1); });
}

template <typename T>
void add_rms_norm_rows(T* residual, const T* delta, const T* weight, T* out, int64_t rows, int64_t h, float eps) {
  parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) { norm_rows(residual, delta, weight, out, h, eps, r0, r1); });
}

template <typename T>
void silu_and_mul_rows(const T* gate_up, int64_t rows, int64_t f, T* out) {
  parallel_for(0, silu_work(rows, f), silu_work(4, f), [&](int64_t i0, int64_t i1) { silu_items(gate_up, f, out, i0, i1); });
}

template void rope_rows<float>(const RopeStep<float>&, int64_t);
template void rope_rows<bf16>(const RopeStep<bf16>&, int64_t);
template void add_rms_norm_rows<float>(float*, const float*, const float*, float*, int64_t, int64_t, float);
template void add_rms_norm_rows<bf16>(bf16*, const bf16*, const bf16*, bf16*, int64_t, int64_t, float);
template void silu_and_mul_rows<float>(const float*, int64_t, int64_t, float*);
template void silu_and_mul_rows<bf16>(const bf16*, int64_t, int64_t, bf16*);

}  // namespace kvops

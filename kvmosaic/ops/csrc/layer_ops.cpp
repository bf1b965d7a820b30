// Per-layer kernels around attention: rotary + KV-cache write, residual add + RMSNorm,
// SiLU-and-mul. Float32 and bfloat16; arithmetic in float32.
#include "ops_common.h"
#include "vec.h"

namespace {

using namespace kvops;
namespace vec = kvmosaic_vec;
using vec::F16;

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
      if (h % 16 == 0) {  // the same roundings as below, 16 lanes at a time
        F16 sq16 = F16::zero();
        for (int64_t i = 0; i < h; i += 16) {
          F16 x = F16::load(r + i);
          if (dl) {
            x = vec::round_to<T>(x + F16::load(dl + t * h + i));
            x.store(r + i);
          }
          x.store(row.data() + i);
          sq16 = vec::fma(x, x, sq16);
        }
        const float inv = 1.f / std::sqrt(sq16.reduce_add() / static_cast<float>(h) + static_cast<float>(eps));
        const F16 vinv = F16::set1(inv);
        for (int64_t i = 0; i < h; i += 16) {
          const F16 normed = vec::round_to<T>(F16::load(row.data() + i) * vinv);
          (F16::load(w + i) * normed).store(o + t * h + i);
        }
        continue;
      }
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
      for (; i + 16 <= f; i += 16) {
        const F16 g = F16::load(gate + i);
        const F16 silu = vec::round_to<T>(g / (F16::set1(1.f) + vec::exp(F16::zero() - g)));
        (silu * F16::load(up + i)).store(o + i);
      }
      for (; i < f; ++i) {
        const float g = to_float(gate[i]);
        const float silu = to_float(static_cast<T>(g / (1.f + std::exp(-g))));
        store(o + i, silu * to_float(up[i]));
      }
    }
  });
}

}  // namespace

using namespace kvops;


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

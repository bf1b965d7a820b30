// Oaken's key rotation (kvmosaic/quant/rotation.py, the reference this matches bit for bit): each
// head vector has a per-channel center subtracted (optional), is multiplied by a per-channel weight
// (signs, scales and 1/sqrt(d) folded together), and goes through an in-place Walsh-Hadamard
// butterfly, stride 1 first. Every row is computed alone with the same float32 operations in the
// same order, so a row's result does not depend on the rows beside it (batch invariance).
#include "kvquant/kvquant_format.h"

namespace kvquant {
namespace {

template <typename In, typename Out>
void rotate_impl(const RotateCall& call, const In* x, Out* out) {
  const int64_t d = call.d, per_group = call.heads / call.groups;
  kvops::parallel_for(0, call.rows * call.heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> y(d);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t group = (r % call.heads) / per_group;
      const float* w = call.weight + group * d;
      const In* src = x + r * d;
      if (call.center != nullptr) {
        const float* c = call.center + group * d;
        for (int64_t i = 0; i < d; ++i) y[i] = (to_float(src[i]) - c[i]) * w[i];
      } else {
        for (int64_t i = 0; i < d; ++i) y[i] = to_float(src[i]) * w[i];
      }
      for (int64_t stride = 1; stride < d; stride *= 2)
        for (int64_t block = 0; block < d; block += 2 * stride)
          for (int64_t j = block; j < block + stride; ++j) {
            const float a = y[j], b = y[j + stride];
            y[j] = a + b;
            y[j + stride] = a - b;
          }
      Out* dst = out + r * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = Out(y[i]);
    }
  });
}

template <typename In>
void rotate_to(const RotateCall& call, const In* x, void* out, Rows out_type) {
  if (out_type == Rows::kFloat32) rotate_impl(call, x, static_cast<float*>(out));
  else rotate_impl(call, x, static_cast<vec::bf16*>(out));
}

}  // namespace

void rotate_heads(const RotateCall& call, const void* x, Rows in_type, void* out, Rows out_type) {
  KV_CHECK(call.d > 0 && (call.d & (call.d - 1)) == 0, "rotate_heads needs a power-of-two head size, got ", call.d);
  KV_CHECK(call.groups > 0 && call.heads % call.groups == 0, "heads must be a multiple of the weight's groups");
  if (in_type == Rows::kFloat32) rotate_to(call, static_cast<const float*>(x), out, out_type);
  else rotate_to(call, static_cast<const vec::bf16*>(x), out, out_type);
}

void widen_rows(const void* x, Rows type, int64_t n, float* out) {
  if (type == Rows::kFloat32) {
    std::memcpy(out, x, sizeof(float) * n);
    return;
  }
  const auto* src = static_cast<const vec::bf16*>(x);
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(src[i]);
}

}  // namespace kvquant

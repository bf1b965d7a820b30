// The per-layer kernels' entry points (layer/layer.h) on tensors: checks, allocation and dtype
// dispatch. Included by bind/kvmosaic_ops.cpp only.
#pragma once

#include "bind/float_ops.h"
#include "layer/layer.h"

// Rotates q and k of a fused qkv projection by their positions, writes k and v
// into their cache slots, and returns the rotated q as [N, hq, head_dim].
at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_table,
                          const at::Tensor& sin_table, at::Tensor k_cache, at::Tensor v_cache,
                          const at::Tensor& slot_mapping, int64_t hq, int64_t hk) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [N, (hq + 2 hk) * head_dim], row-major");
  kvops::check_cache(k_cache, qkv);
  kvops::check_cache(v_cache, qkv);
  const int64_t d = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hk) * d, "qkv width does not match head counts");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && cos_table.size(1) * 2 == d, "cos table shape");
  auto q_out = at::empty({qkv.size(0), hq, d}, qkv.options());
  auto pos = positions.contiguous();
  auto slots = slot_mapping.contiguous();
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "rope_and_cache supports float32 and bfloat16");
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const kvops::RopeStep<T> step{kvops::data_of<T>(qkv), qkv.stride(0), pos.data_ptr<int64_t>(),
                                  slots.data_ptr<int64_t>(), cos_table.data_ptr<float>(), sin_table.data_ptr<float>(),
                                  kvops::data_of<T>(k_cache), kvops::data_of<T>(v_cache), kvops::data_of<T>(q_out),
                                  hq, hk, d};
    kvops::rope_rows(step, qkv.size(0));
  };
  if (qkv.scalar_type() == at::kFloat) run(static_cast<float*>(nullptr));
  else run(static_cast<kvmosaic_vec::bf16*>(nullptr));
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
  TORCH_CHECK(residual.scalar_type() == at::kFloat || residual.scalar_type() == at::kBFloat16,
              "add_rms_norm supports float32 and bfloat16");
  auto out = at::empty_like(residual);
  auto w = weight.contiguous();
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    kvops::add_rms_norm_rows(kvops::data_of<T>(residual), delta.has_value() ? kvops::data_of<T>(d) : nullptr,
                             kvops::data_of<T>(w), kvops::data_of<T>(out), residual.size(0), residual.size(1),
                             static_cast<float>(eps));
  };
  if (residual.scalar_type() == at::kFloat) run(static_cast<float*>(nullptr));
  else run(static_cast<kvmosaic_vec::bf16*>(nullptr));
  return out;
}

// silu(gate) * up of a fused [N, 2F] gate/up projection.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul needs [N, 2F]");
  auto src = gate_up.contiguous();
  TORCH_CHECK(src.scalar_type() == at::kFloat || src.scalar_type() == at::kBFloat16,
              "silu_and_mul supports float32 and bfloat16");
  const int64_t f = src.size(1) / 2;
  auto out = at::empty({src.size(0), f}, src.options());
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    kvops::silu_and_mul_rows(kvops::data_of<T>(src), src.size(0), f, kvops::data_of<T>(out));
  };
  if (src.scalar_type() == at::kFloat) run(static_cast<float*>(nullptr));
  else run(static_cast<kvmosaic_vec::bf16*>(nullptr));
  return out;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows takes float32 [rows, n] with n > 0");
  const at::Tensor x = logits.contiguous();
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  kvops::argmax_of_rows(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
  return out;
}

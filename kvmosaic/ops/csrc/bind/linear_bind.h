// The linear layers' entry points (linear/linear.h) on tensors: checks, packing (tensor reshapes),
// allocation and dtype dispatch. Included by bind/kvmosaic_ops.cpp only.
#pragma once

#include "bind/float_ops.h"
#include "linear/linear.h"

namespace kvops {

PackedWeight packed_weight(const at::Tensor& packed, bool swiglu, const float* bias) {
  return {packed.data_ptr(), packed.size(0), packed.size(1) / kPackedBlock, swiglu, bias};
}

QuantizedWeight quantized_weight(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor* extra,
                                 const float* bias, const char* who) {
  constexpr int64_t kCols = kQuantCols;
  TORCH_CHECK(scale.dim() == 3 && scale.size(2) == kCols && scale.is_contiguous() && codes.is_contiguous(), who,
              ": the weight is not in the interleaved layout");
  const int64_t groups = scale.size(0);
  if (scale.scalar_type() == at::kChar) {  // q6
    const int64_t k = scale.size(1) * kQ6Sub;
    TORCH_CHECK(codes.scalar_type() == at::kByte && k % kQ6Super == 0 && codes.numel() == groups * kCols * k * 3 / 4,
                who, ": q6 codes do not match the scales");
    TORCH_CHECK(extra != nullptr && extra->scalar_type() == at::kFloat && extra->is_contiguous() &&
                    extra->sizes() == at::IntArrayRef({groups, k / kQ6Super, kCols}),
                who, ": q6 weights come with float32 super-block scales [N/16, K/256, 16]");
    return {codes.data_ptr<uint8_t>(), scale.data_ptr(), nullptr, extra->data_ptr<float>(), false, k, groups, bias};
  }
  if (scale.scalar_type() == at::kByte) {  // q4k: sc and m per 32 k side by side
    const int64_t k = scale.size(1) * kQ6Sub;
    TORCH_CHECK(codes.scalar_type() == at::kByte && k % kQ6Super == 0 && codes.numel() == groups * kCols * k / 2,
                who, ": q4k codes do not match the scales");
    TORCH_CHECK(extra != nullptr && extra->scalar_type() == at::kHalf && extra->is_contiguous() &&
                    extra->sizes() == at::IntArrayRef({groups, 2 * k / kQ6Super, kCols}),
                who, ": q4k weights come with float16 super-block (d, -dmin) pairs [N/16, K/128, 16]");
    return {codes.data_ptr<uint8_t>(), scale.data_ptr(), nullptr, nullptr, false, k, groups, bias,
            reinterpret_cast<const kvmosaic_vec::half*>(extra->data_ptr())};
  }
  const bool q4 = codes.scalar_type() == at::kByte;
  TORCH_CHECK(q4 == (extra != nullptr), who, ": q4 (uint8) codes come with mins, q8 (int8) without");
  TORCH_CHECK(q4 || codes.scalar_type() == at::kChar, who, ": codes must be int8 or uint8");
  TORCH_CHECK(scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kFloat, who,
              ": scales must be float16 or float32 (int8 for q6, uint8 for q4k)");
  const int64_t k = scale.size(1) * kQuantBlock;
  TORCH_CHECK(codes.numel() == groups * kCols * k / (q4 ? 2 : 1), who, ": codes do not match the scales");
  if (q4)
    TORCH_CHECK(extra->sizes() == scale.sizes() && extra->scalar_type() == scale.scalar_type() &&
                    extra->is_contiguous(), who, ": mins do not match the scales");
  return {reinterpret_cast<const uint8_t*>(codes.data_ptr()), scale.data_ptr(), q4 ? extra->data_ptr() : nullptr,
          nullptr, scale.scalar_type() == at::kHalf, k, groups, bias};
}

// A composite weight from its parts' (codes, scales, extra) back to back (extra empty for q8): each
// part checked as quantized_weight checks a weight, in_features alike, its bias the bias's slice of its
// columns; parts (kept alive by the caller as long as the weight) receives them.
QuantizedWeight composite_weight(const std::vector<at::Tensor>& tensors, const float* bias, const char* who,
                                 std::vector<QuantizedWeight>& parts) {
  TORCH_CHECK(tensors.size() >= 6 && tensors.size() % 3 == 0, who,
              ": a composite weight is two or more parts of (codes, scales, extra)");
  parts.clear();
  int64_t groups = 0;
  for (size_t i = 0; i < tensors.size(); i += 3) {
    const at::Tensor* t = tensors.data() + i;
    parts.push_back(quantized_weight(t[0], t[1], t[2].numel() > 0 ? &t[2] : nullptr,
                                     bias != nullptr ? bias + groups * kQuantCols : nullptr, who));
    TORCH_CHECK(parts.back().k == parts[0].k, who, ": the parts of a composite weight differ in in_features");
    groups += parts.back().groups;
  }
  QuantizedWeight w{};
  w.k = parts[0].k;
  w.groups = groups;
  w.bias = bias;
  w.parts = parts.data();
  w.part_count = static_cast<int64_t>(parts.size());
  return w;
}

namespace linear_bind {

// x [M, K] times a quantized weight (checked against x and bias) into a new [M, N].
inline at::Tensor run_quantized(const at::Tensor& x, const QuantizedWeight& w, const at::Tensor* bias) {
  const int64_t k = x.size(1), n = w.groups * kQuantCols;
  TORCH_CHECK(w.k == k, "quantized_linear: x has ", k, " features, the weight ", w.k);
  if (bias != nullptr) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "quantized_linear: bias must be [N]");
  auto xc = x.contiguous();
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat)
    quantized_product(w, data_of<float>(xc), x.size(0), data_of<float>(out));
  else if (x.scalar_type() == at::kBFloat16)
    quantized_product(w, data_of<kvmosaic_vec::bf16>(xc), x.size(0), data_of<kvmosaic_vec::bf16>(out));
  else TORCH_CHECK(false, "quantized_linear: activations must be float32 or bfloat16");
  return out;
}

inline bool gemm_supported(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16; }

inline int64_t pack_of(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

// Checks x against a packed weight and runs the product into [M, width].
inline at::Tensor run_packed(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t width,
                             bool swiglu) {
  TORCH_CHECK(x.dim() == 2, "packed_linear needs x [M, K]");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "packed_linear: x and weight dtypes differ");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous(), "packed_linear: weight is not packed");
  const int64_t k = x.size(1);
  TORCH_CHECK(packed.size(1) == k * kPackedBlock, "packed_linear: x has ", k, " features, the weight ",
              packed.size(1) / kPackedBlock);
  TORCH_CHECK(gemm_supported(x.scalar_type()), "packed_linear: unsupported dtype ", x.scalar_type());
  auto xc = x.contiguous();
  auto out = at::empty({x.size(0), width}, x.options());
  if (x.size(0) == 0) return out;
  const PackedWeight w = packed_weight(packed, swiglu, bias);
  if (x.scalar_type() == at::kFloat) packed_product(w, data_of<float>(xc), x.size(0), data_of<float>(out));
  else packed_product(w, data_of<kvmosaic_vec::bf16>(xc), x.size(0), data_of<kvmosaic_vec::bf16>(out));
  return out;
}

}  // namespace linear_bind

}  // namespace kvops

bool packed_linear_supports(at::ScalarType dtype, int64_t out_features, int64_t in_features) {
  return kvops::linear_bind::gemm_supported(dtype) && out_features % kvops::kPackedBlock == 0 &&
         in_features % kvops::linear_bind::pack_of(dtype) == 0;
}

// [N, K] -> the packed layout of gemm_kernel.h, stored as [N / 16, K * 16] (same dtype).
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  constexpr int64_t kBlock = kvops::kPackedBlock;
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight needs a [N, K] weight");
  const int64_t n = weight.size(0), k = weight.size(1), pack = kvops::linear_bind::pack_of(weight.scalar_type());
  TORCH_CHECK(packed_linear_supports(weight.scalar_type(), n, k), "packed linear: unsupported weight ",
              weight.scalar_type(), " [", n, ", ", k, "] (needs N % 16 == 0 and float32 or bfloat16)");
  // [N/16, 16, K/pack, pack] -> [N/16, K/pack, 16, pack]
  return weight.contiguous().view({n / kBlock, kBlock, k / pack, pack}).permute({0, 2, 1, 3}).contiguous()
      .view({n / kBlock, k * kBlock});
}

bool packed_swiglu_supports(at::ScalarType dtype, int64_t intermediate, int64_t in_features) {
  return packed_linear_supports(dtype, 2 * intermediate, in_features) && intermediate % (2 * kvops::kPackedBlock) == 0;
}

// Fused [2F, K] gate/up weight (gate rows first) -> rows reordered as 32 gate rows, the same 32 up
// rows, the next 32 gate rows, ..., then packed as pack_linear_weight does.
at::Tensor pack_swiglu_weight(const at::Tensor& gate_up) {
  constexpr int64_t kBlock = kvops::kPackedBlock;
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(0) % 2 == 0, "pack_swiglu_weight needs a [2F, K] weight");
  const int64_t f = gate_up.size(0) / 2, k = gate_up.size(1);
  TORCH_CHECK(packed_swiglu_supports(gate_up.scalar_type(), f, k), "packed SwiGLU: unsupported weight ",
              gate_up.scalar_type(), " [", 2 * f, ", ", k, "] (needs F % 32 == 0 and float32 or bfloat16)");
  // [2, F/32, 32, K] -> [F/32, 2, 32, K]
  const auto interleaved = gate_up.contiguous().view({2, f / (2 * kBlock), 2 * kBlock, k}).transpose(0, 1);
  return pack_linear_weight(interleaved.reshape({2 * f, k}));
}

// x [M, K] times a packed weight of N = packed.size(0) * 16 outputs; bias (float32 [N]) optional.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const int64_t n = packed.size(0) * kvops::kPackedBlock;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == n, "packed_linear: bias must be [N]");
  }
  return kvops::linear_bind::run_packed(x, packed, bias.has_value() ? b.data_ptr<float>() : nullptr, n, false);
}

// silu(x G^T) * (x U^T), [M, F], from the weight of pack_swiglu_weight.
at::Tensor packed_swiglu(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) % 4 == 0, "packed_swiglu: weight is not a packed gate/up pair");
  return kvops::linear_bind::run_packed(x, packed, nullptr, packed.size(0) * kvops::kPackedBlock / 2, true);
}

// x [M, K] (float32 or bfloat16) times a quantized weight: q8 (int8 codes), q4 (uint8 codes, extra = its
// mins), q6 (uint8 codes, int8 scales, extra = its float32 super-block scales) or q4k (uint8 codes, uint8
// scales and mins, extra = its float16 super-block (d, -dmin) pairs).
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& extra, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "quantized_linear needs x [M, K]");
  at::Tensor b;
  if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
  const kvops::QuantizedWeight w = kvops::quantized_weight(codes, scale, extra.has_value() ? &*extra : nullptr,
                                                           bias.has_value() ? b.data_ptr<float>() : nullptr,
                                                           "quantized_linear");
  return kvops::linear_bind::run_quantized(x, w, bias.has_value() ? &b : nullptr);
}

// x [M, K] times a composite weight: parts (codes, scales, extra) back to back, extra empty for q8, each
// part's columns after the previous part's. One call: the rows are quantized once for all the parts.
at::Tensor quantized_linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& parts,
                                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "quantized_linear needs x [M, K]");
  at::Tensor b;
  if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
  std::vector<kvops::QuantizedWeight> held;
  const kvops::QuantizedWeight w = kvops::composite_weight(parts, bias.has_value() ? b.data_ptr<float>() : nullptr,
                                                           "quantized_linear_parts", held);
  return kvops::linear_bind::run_quantized(x, w, bias.has_value() ? &b : nullptr);
}

// Rows `index` of a q8 / q4 / q6 weight in the interleaved layout, dequantized: an embedding lookup
// through a tied quantized LM head, without a float copy of the table.
at::Tensor quantized_rows(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& extra,
                          const at::Tensor& index, at::ScalarType dtype) {
  const kvops::QuantizedWeight w = kvops::quantized_weight(codes, scale, extra.has_value() ? &*extra : nullptr,
                                                           nullptr, "quantized_rows");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quantized_rows: rows are float32 or bfloat16");
  const int64_t n = w.groups * kvops::kQuantCols;
  const at::Tensor idx = index.to(at::kLong).contiguous().view({-1});
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < idx.numel(); ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < n, "quantized_rows: index ", ip[r], " out of range for ", n, " rows");
  at::Tensor out = at::empty({idx.numel(), w.k}, scale.options().dtype(dtype));
  if (dtype == at::kFloat) kvops::dequantize_rows(w, ip, idx.numel(), kvops::data_of<float>(out));
  else kvops::dequantize_rows(w, ip, idx.numel(), kvops::data_of<kvmosaic_vec::bf16>(out));
  return out;
}

// Kernels for the quantized KV cache (int8, int4, Oaken): quantize-and-write of new K/V rows,
// dequantization of whole blocks (prefill), and decode attention that reads the blocks in place
// (head_dim 64 / 128: each 16-token tile dequantized as the prefill's blocks are and attended with the
// float kernels' per-row arithmetic, so a decode row equals the prefill path's; else a scalar kernel
// that dequantizes each head vector into a small buffer). The byte layout is the one documented in
// kvmosaic/quant/format.py and kvmosaic/quant/oaken.py; encoding matches the PyTorch reference bit
// for bit (same float32 operation order, fp16 rounding to nearest even, ties-to-even codes).
// This file is the extension's only one with the PyTorch headers: it checks the tensors, allocates
// the outputs and calls the kernels (kvquant_encode.cpp, kvquant_decode.cpp, kvquant_decode_fast.cpp,
// through kvquant/kvquant.h) with their pointers.
#include "bind/bindings.h"
#include "bind/kvquant_tensors.h"
#include "bind/lane_bind.h"
#include "bind/parallel_impl.h"

using kvops::no_gil;
using namespace kvquant;

namespace {

// Quantize K/V rows [N, hk, d] and write their records into the pools' slots; K rows are encoded
// with k_center [hk, d] subtracted (empty: none). Returns the number of Oaken outliers folded into
// the middle group (0 for int8/int4).
int64_t quant_write(const at::Tensor& k, const at::Tensor& v, at::Tensor k_pool, at::Tensor v_pool,
                    const at::Tensor& slot_mapping, int64_t mode, int64_t hk, int64_t d, int64_t capacity,
                    const at::Tensor& k_thresholds, const at::Tensor& v_thresholds, const at::Tensor& k_center) {
  const Format f = make_format(mode, hk, d, capacity, k_pool.size(-1), k_pool.size(1));
  check_pool(k_pool, f);
  check_pool(v_pool, f);
  auto kc = k.contiguous(), vc = v.contiguous();
  TORCH_CHECK(kc.numel() == kc.size(0) * hk * d && vc.sizes() == kc.sizes(), "K/V rows must be [N, hk, d]");
  auto slots = slot_mapping.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == kc.size(0), "slot_mapping must be int64 [N]");
  const Thresholds kt = read_thresholds(k_thresholds), vt = read_thresholds(v_thresholds);
  TORCH_CHECK(k_center.numel() == 0 || k_center.numel() == hk * d, "k_center must be empty or [hk, d]");
  const auto center = k_center.to(at::kFloat).contiguous();
  TORCH_CHECK(is_row_dtype(kc.scalar_type()) && vc.scalar_type() == kc.scalar_type(),
              "quant_write supports float32 and bfloat16");
  const NewRows rows{kc.data_ptr(), vc.data_ptr(), rows_of(kc.scalar_type()), kc.size(0), slots.data_ptr<int64_t>()};
  return write_rows(rows, k_pool.data_ptr<uint8_t>(), v_pool.data_ptr<uint8_t>(), f, kt, vt, floats_or_null(center));
}

// Dequantize whole blocks: pool [NB, bs, R] -> [len(block_ids), bs, hk, d] in `dtype`.
at::Tensor dequantize_blocks(const at::Tensor& pool, const at::Tensor& block_ids, int64_t mode, int64_t hk,
                             int64_t d, int64_t capacity, const at::Tensor& thresholds, at::ScalarType dtype) {
  const Format f = make_format(mode, hk, d, capacity, pool.size(-1), pool.size(1));
  check_pool(pool, f);
  auto ids = block_ids.contiguous();
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "block ids must be int64 [n]");
  auto out = at::empty({ids.size(0), pool.size(1), hk, d}, pool.options().dtype(dtype));
  const Thresholds t = read_thresholds(thresholds);
  TORCH_CHECK(is_row_dtype(dtype), "dequantize_blocks supports float32 and bfloat16");
  dequantize(pool.data_ptr<uint8_t>(), pool.size(1), ids.data_ptr<int64_t>(), ids.size(0), f, t, out.data_ptr(),
             rows_of(dtype));
  return out;
}

void check_decode(const at::Tensor& q, const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t hk) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(1) % hk == 0, "q must be contiguous [B, hq, d]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "tables and lengths: int64");
  TORCH_CHECK(is_row_dtype(q.scalar_type()), "quant_decode_attention supports float32 and bfloat16");
}

void run_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t mode, int64_t hk,
                int64_t capacity, const at::Tensor& k_thresholds, const at::Tensor& v_thresholds, double scale,
                void* out, const PartialOut* partial) {
  check_decode(q, block_tables, context_lens, hk);
  const Format f = make_format(mode, hk, q.size(2), capacity, k_pool.size(-1), k_pool.size(1));
  check_pool(k_pool, f);
  check_pool(v_pool, f);
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  const Thresholds kt = read_thresholds(k_thresholds), vt = read_thresholds(v_thresholds);
  const DecodeCall call{q.data_ptr(),           rows_of(q.scalar_type()),    q.size(0),
                        q.size(1),              tables.size(1),              k_pool.size(1),
                        k_pool.data_ptr<uint8_t>(), v_pool.data_ptr<uint8_t>(), tables.data_ptr<int64_t>(),
                        lens.data_ptr<int64_t>(), scale};
  decode_attention(call, f, kt, vt, out, partial);
}

// One query token per sequence over quantized paged K/V, read in place.
at::Tensor quant_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t mode,
                                  int64_t hk, int64_t capacity, const at::Tensor& k_thresholds,
                                  const at::Tensor& v_thresholds, double scale) {
  auto out = at::empty_like(q);
  run_decode(q, k_pool, v_pool, block_tables, context_lens, mode, hk, capacity, k_thresholds, v_thresholds, scale,
             out.data_ptr(), nullptr);
  return out;
}

// The same over one holder's keys, as a partial to merge with the other holders' (DistAttention):
// (out [B, hq, d] float32 normalised over these keys, softmax reference [B, hq], sum of exps [B, hq]).
std::vector<at::Tensor> quant_decode_attention_partial(const at::Tensor& q, const at::Tensor& k_pool,
                                                       const at::Tensor& v_pool, const at::Tensor& block_tables,
                                                       const at::Tensor& context_lens, int64_t mode, int64_t hk,
                                                       int64_t capacity, const at::Tensor& k_thresholds,
                                                       const at::Tensor& v_thresholds, double scale) {
  check_decode(q, block_tables, context_lens, hk);
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor part = at::empty(q.sizes(), f32), ref = at::empty({q.size(0), q.size(1)}, f32);
  at::Tensor sum = at::empty({q.size(0), q.size(1)}, f32);
  const PartialOut partial{part.data_ptr<float>(), ref.data_ptr<float>(), sum.data_ptr<float>()};
  run_decode(q, k_pool, v_pool, block_tables, context_lens, mode, hk, capacity, k_thresholds, v_thresholds, scale,
             nullptr, &partial);
  return {part, ref, sum};
}

// Oaken's key rotation: x [N, heads, d] -> [N, heads, d] in out_dtype, each head's vector centered
// (center [groups, d], or empty), weighted (weight [groups, d]) and put through the Walsh-Hadamard
// butterfly (kvmosaic/quant/rotation.py).
at::Tensor rotate_head_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& center,
                        at::ScalarType out_dtype) {
  auto xc = x.contiguous();
  TORCH_CHECK(xc.dim() == 3 && is_row_dtype(xc.scalar_type()) && is_row_dtype(out_dtype),
              "rotate_heads takes float32 / bfloat16 rows [N, heads, d]");
  auto w = weight.to(at::kFloat).contiguous();
  TORCH_CHECK(w.dim() == 2 && w.size(1) == xc.size(2), "weight must be [groups, d]");
  auto c = center.to(at::kFloat).contiguous();
  TORCH_CHECK(c.numel() == 0 || c.sizes() == w.sizes(), "center must be empty or [groups, d]");
  auto out = at::empty(xc.sizes(), xc.options().dtype(out_dtype));
  const RotateCall call{xc.size(0), xc.size(1), xc.size(2), w.size(0), w.data_ptr<float>(), floats_or_null(c)};
  rotate_heads(call, xc.data_ptr(), rows_of(xc.scalar_type()), out.data_ptr(), rows_of(out_dtype));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotate_heads", &rotate_head_rows, no_gil, "Oaken's key rotation of head vectors");
  m.def("quant_write", &quant_write, "quantize K/V rows into their cache slots");
  m.def("dequantize_blocks", &dequantize_blocks, no_gil, "dequantize whole KV blocks");
  m.def("quant_decode_attention", &quant_decode_attention, no_gil, "decode attention over quantized paged KV");
  m.def("quant_decode_attention_partial", &quant_decode_attention_partial, no_gil,
        "decode attention over quantized paged KV as a partial (out, reference, sum of exps) to merge");
  kvops::bind_quant_lane(m);
}

// CPU kernels for the decode path: rotary + KV-cache write, decode attention that
// reads K/V blocks in place (no gather copy), residual add + RMSNorm.
// Float32 and bfloat16; all arithmetic in float32.
// This file binds the entry points; the kernels live in layer_ops.cpp, decode_attention.cpp and
// prefill_attention.cpp.
#include "ops_common.h"

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

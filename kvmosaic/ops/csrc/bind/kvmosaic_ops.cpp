// CPU kernels of the model: linear layers on packed weights, rotary + KV-cache write, decode attention that
// reads K/V blocks in place (no gather copy), residual add + RMSNorm.
// Float32 and bfloat16; all arithmetic in float32.
// The float extension's one translation unit with the PyTorch headers: it binds the entry points,
// whose tensor wrappers are in bind/*_bind.h; the kernels (linear/, attention/, layer/) take pointers
// and sizes, and bind/team_bind.h chains them for a decode step.
#include "bind/attention_bind.h"
#include "bind/bindings.h"
#include "bind/float_ops.h"
#include "bind/lane_bind.h"
#include "bind/layer_bind.h"
#include "bind/linear_bind.h"
#include "bind/parallel_impl.h"
#include "bind/team_bind.h"
#include "common/batch_invariance.h"
#include "isa/amx.h"

using kvops::no_gil;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_and_cache", &rope_and_cache, "rotary embedding + KV cache write");
  m.def("paged_decode_attention", &paged_decode_attention, no_gil, "decode attention over paged KV blocks");
  m.def("paged_decode_attention_partial", &paged_decode_attention_partial, no_gil,
        "decode attention over paged KV blocks as a partial (out, row max, sum of exp) to merge");
  m.def("merge_attention_partials", &merge_attention_partials,
        "partial attentions of the same queries over disjoint keys, combined exactly");
  m.def("paged_prefill_attention", &paged_prefill_attention, no_gil, "causal attention of a prefill chunk over paged KV",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("context_len"),
        py::arg("scale"), py::arg("out") = py::none());
  m.def("prefill_attention_supports", [](int64_t head_dim) { return head_dim == 64 || head_dim == 128; });
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU over a fused gate/up projection");
  m.def("packed_linear_supports", [](py::object dtype, int64_t out_features, int64_t in_features) {
    return packed_linear_supports(torch::python::detail::py_object_to_dtype(dtype), out_features, in_features);
  }, "whether a weight of this dtype and shape can be packed");
  m.def("amx_supported", &kvops::amx::supported,
        "whether this build and CPU run bfloat16 products on AMX tiles (avx512_bf16 kernels, AMX-BF16 CPU)");
  m.def("amx_enabled", &kvops::amx::enabled,
        "whether bfloat16 and q8/q4 products of AMX_MIN_ROWS rows or more use the AMX tiles");
  m.def("set_amx", &kvops::amx::set_enabled, py::arg("on"),
        "switch the AMX tiles on (where supported) or off for the products they take; returns the new state");
  m.attr("AMX_MIN_ROWS") = kvops::amx::kMinRows;
  m.def("batch_invariant", &kvops::batch_invariant,
        "whether every kernel computes a row the same way whatever rows share the call (the default)");
  m.def("set_batch_invariant", &kvops::set_batch_invariant, py::arg("on"),
        "batch invariance on, or off to let products and prefill attention take row-count-dependent faster "
        "paths (the AMX tiles, the register-tiled prefill attention); one switch for the process");
  m.def("pack_linear_weight", &pack_linear_weight, "[N, K] weight -> the packed layout of packed_linear");
  m.def("packed_linear", &packed_linear, no_gil, "x [M, K] times a packed weight (+ float32 bias)", py::arg("x"),
        py::arg("packed"), py::arg("bias") = py::none());
  m.def("packed_swiglu_supports", [](py::object dtype, int64_t intermediate, int64_t in_features) {
    return packed_swiglu_supports(torch::python::detail::py_object_to_dtype(dtype), intermediate, in_features);
  }, "whether a gate/up pair of this dtype and shape can be packed for packed_swiglu");
  m.def("pack_swiglu_weight", &pack_swiglu_weight, "[2F, K] gate/up weight -> the packed layout of packed_swiglu");
  m.def("packed_swiglu", &packed_swiglu, no_gil, "silu(x G^T) * (x U^T) on a packed gate/up weight");
  m.def("quantized_linear", &quantized_linear, no_gil,
        "x [M, K] times a q8 / q4 / q4k / q6 weight in the interleaved layout (extra: q4's mins, q6's and "
        "q4k's super-block scales)",
        py::arg("x"), py::arg("codes"), py::arg("scale"), py::arg("extra") = py::none(), py::arg("bias") = py::none());
  m.def("quantized_linear_parts", &quantized_linear_parts, no_gil,
        "x [M, K] times a composite weight: its parts (codes, scale, extra; extra empty for q8) back to back, "
        "each of its own kind, their columns side by side",
        py::arg("x"), py::arg("parts"), py::arg("bias") = py::none());
  m.def("quantized_rows", [](const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& extra,
                             const at::Tensor& index, py::object dtype) {
    return quantized_rows(codes, scale, extra, index, torch::python::detail::py_object_to_dtype(dtype));
  }, "rows of a q8 / q4 / q4k / q6 weight in the interleaved layout, dequantized (an embedding lookup)",
        py::arg("codes"),
        py::arg("scale"), py::arg("extra"), py::arg("index"), py::arg("dtype"));
  kvops::bind_team(m);
  kvops::bind_float_lane(m, &paged_decode_attention_partial);
  m.def("argmax_rows", &argmax_rows, "the first index of each row's largest value (torch.argmax(dim=-1))");
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm", py::arg("residual"), py::arg("delta"),
        py::arg("weight"), py::arg("eps"));
}

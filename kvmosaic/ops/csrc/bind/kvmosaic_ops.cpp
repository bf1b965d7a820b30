// CPU kernels of the model: linear layers on packed weights, rotary + KV-cache write, decode attention that
// reads K/V blocks in place (no gather copy), residual add + RMSNorm.
// Float32 and bfloat16; all arithmetic in float32.
// This file binds the entry points; the kernels live in layer_ops.cpp, gemm.cpp,
// decode_attention.cpp and prefill_attention.cpp, and bind/team_bind.h chains them for a decode step.
#include "isa/amx.h"
#include "bind/bindings.h"
#include "hmac_sha256.h"
#include "lane_client.h"
#include "lane_server.h"
#include "bind/team_bind.h"

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
  m.def("pack_linear_weight", &pack_linear_weight, "[N, K] weight -> the packed layout of packed_linear");
  m.def("packed_linear", &packed_linear, no_gil, "x [M, K] times a packed weight (+ float32 bias)", py::arg("x"),
        py::arg("packed"), py::arg("bias") = py::none());
  m.def("packed_swiglu_supports", [](py::object dtype, int64_t intermediate, int64_t in_features) {
    return packed_swiglu_supports(torch::python::detail::py_object_to_dtype(dtype), intermediate, in_features);
  }, "whether a gate/up pair of this dtype and shape can be packed for packed_swiglu");
  m.def("pack_swiglu_weight", &pack_swiglu_weight, "[2F, K] gate/up weight -> the packed layout of packed_swiglu");
  m.def("packed_swiglu", &packed_swiglu, no_gil, "silu(x G^T) * (x U^T) on a packed gate/up weight");
  m.def("quantized_linear", &quantized_linear, no_gil,
        "x [M, K] times a q8 / q4 / q6 weight in the interleaved layout (extra: q4's mins, q6's super-block scales)",
        py::arg("x"), py::arg("codes"), py::arg("scale"), py::arg("extra") = py::none(), py::arg("bias") = py::none());
  m.def("quantized_rows", [](const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& extra,
                             const at::Tensor& index, py::object dtype) {
    return quantized_rows(codes, scale, extra, index, torch::python::detail::py_object_to_dtype(dtype));
  }, "rows of a q8 / q4 / q6 weight in the interleaved layout, dequantized (an embedding lookup)", py::arg("codes"),
        py::arg("scale"), py::arg("extra"), py::arg("index"), py::arg("dtype"));
  kvops::bind_team(m);
  py::class_<kvops::LaneServer, std::shared_ptr<kvops::LaneServer>>(
      m, "AttentionServer", "a creditor's micro-attention server for decode rows (kvmosaic.distributed)",
      py::module_local())
      .def(py::init([](std::vector<at::Tensor> caches, int64_t num_heads, const std::string& host, int64_t spin_us,
                       const py::bytes& secret, double handshake_timeout, int64_t max_message_bytes) {
             return kvops::float_lane_server(std::move(caches), num_heads, host, spin_us,
                                             kvops::lane_access(secret, handshake_timeout, max_message_bytes));
           }),
           py::arg("caches"), py::arg("num_heads"), py::arg("host"), py::arg("spin_us"), py::arg("secret"),
           py::arg("handshake_timeout"), py::arg("max_message_bytes"))
      .def_property_readonly("refused_connections", &kvops::LaneServer::refused_connections)
      .def_property_readonly("port", &kvops::LaneServer::port)
      .def_property_readonly("local_name", &kvops::LaneServer::local_name)
      .def_property_readonly("folded_outliers", &kvops::LaneServer::folded_outliers)
      .def("close", &kvops::LaneServer::close, no_gil);
  py::class_<kvops::LaneClient, std::shared_ptr<kvops::LaneClient>>(
      m, "AttentionClient", "a debtor's connection to a creditor's AttentionServer (kvmosaic.distributed)",
      py::module_local())
      .def(py::init([](const std::string& host, int64_t port, const std::string& local_name, double timeout,
                       int64_t spin_us, bool shared_memory, const py::bytes& secret) {
             std::string key = secret;
             py::gil_scoped_release released;  // the connection and its handshake wait on the network
             return std::make_shared<kvops::LaneClient>(host, port, local_name, timeout, spin_us, shared_memory, key);
           }),
           py::arg("host"), py::arg("port"), py::arg("local_name"), py::arg("timeout"), py::arg("spin_us"),
           py::arg("shared_memory"), py::arg("secret"))
      .def_property_readonly("local", &kvops::LaneClient::local)
      .def_property_readonly("transport", &kvops::LaneClient::transport)
      .def("send", &kvops::LaneClient::send, no_gil, py::arg("layer"), py::arg("scale"), py::arg("ints"),
           py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::arg("kv_heads"))
      .def("receive", [](kvops::LaneClient& client, int64_t items, int64_t num_heads, int64_t head_dim) -> py::tuple {
             kvops::LaneAnswer answer;
             {
               py::gil_scoped_release released;
               answer = client.receive(items, num_heads, head_dim);
             }
             if (!answer.error.empty()) return py::make_tuple(answer.seconds, answer.error);
             return py::make_tuple(answer.seconds, py::none(), answer.out, answer.reference, answer.sum_exp);
           }, py::arg("items"), py::arg("num_heads"), py::arg("head_dim"),
           "(creditor seconds, None, out, reference, sum of exps), or (creditor seconds, error message)")
      .def("close", &kvops::LaneClient::close);
  m.def("hmac_sha256", [](const py::bytes& key, const py::bytes& message) {
    const std::string k = key, text = message;
    const kvops::Digest digest = kvops::hmac_sha256(k.data(), k.size(), {{text.data(), text.size()}});
    return py::bytes(reinterpret_cast<const char*>(digest.data()), digest.size());
  }, py::arg("key"), py::arg("message"), "HMAC-SHA256 as the decode lane's handshake computes it (tests: against hmac)");
  m.def("argmax_rows", &argmax_rows, "the first index of each row's largest value (torch.argmax(dim=-1))");
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm", py::arg("residual"), py::arg("delta"),
        py::arg("weight"), py::arg("eps"));
}

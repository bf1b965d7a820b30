// Kernels for the quantized KV cache (int8, int4, Oaken): quantize-and-write of new K/V rows,
// dequantization of whole blocks (prefill), and decode attention that reads the blocks in place
// (head_dim 64 / 128: 16-token tiles, codes widened in registers, on every ISA level; else a
// scalar kernel that dequantizes each head vector into a small buffer). The byte layout is the one documented in
// kvmosaic/quant/format.py and kvmosaic/quant/oaken.py; encoding matches the PyTorch reference bit
// for bit (same float32 operation order, fp16 rounding to nearest even, ties-to-even codes).
// This file binds the entry points; the kernels live in kvquant_encode.cpp, kvquant_decode.cpp and
// kvquant_decode_fast.cpp, the record format in kvquant_format.h.
#include "bind/bindings.h"
#include "kvquant/kvquant_format.h"
#include "lane_server.h"

using kvops::no_gil;

// kvquant_lane.cpp: a decode lane server over the layers' (k_pool, v_pool, k_thresholds, v_thresholds, k_center)
std::shared_ptr<kvops::LaneServer> quant_lane_server(const std::vector<std::vector<at::Tensor>>& layers, int64_t mode,
                                                     int64_t hk, int64_t d, int64_t capacity, at::ScalarType dtype,
                                                     int64_t num_heads, const std::string& host, int64_t spin_us,
                                                     kvops::LaneAccess access);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_write", &quant_write, "quantize K/V rows into their cache slots");
  m.def("dequantize_blocks", &dequantize_blocks, no_gil, "dequantize whole KV blocks");
  m.def("quant_decode_attention", &quant_decode_attention, no_gil, "decode attention over quantized paged KV");
  m.def("quant_decode_attention_partial", &quant_decode_attention_partial, no_gil,
        "decode attention over quantized paged KV as a partial (out, reference, sum of exps) to merge");
  py::class_<kvops::LaneServer, std::shared_ptr<kvops::LaneServer>>(
      m, "AttentionServer", "a creditor's micro-attention server for decode rows over quantized records",
      py::module_local())
      .def(py::init([](const std::vector<std::vector<at::Tensor>>& layers, int64_t mode, int64_t hk, int64_t d,
                       int64_t capacity, const py::object& dtype, int64_t num_heads, const std::string& host,
                       int64_t spin_us, const py::bytes& secret, double handshake_timeout, int64_t max_message_bytes) {
             return quant_lane_server(layers, mode, hk, d, capacity, torch::python::detail::py_object_to_dtype(dtype),
                                      num_heads, host, spin_us,
                                      kvops::lane_access(secret, handshake_timeout, max_message_bytes));
           }),
           py::arg("layers"), py::arg("mode"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("capacity"),
           py::arg("dtype"), py::arg("num_heads"), py::arg("host"), py::arg("spin_us"), py::arg("secret"),
           py::arg("handshake_timeout"), py::arg("max_message_bytes"))
      .def_property_readonly("refused_connections", &kvops::LaneServer::refused_connections)
      .def_property_readonly("port", &kvops::LaneServer::port)
      .def_property_readonly("local_name", &kvops::LaneServer::local_name)
      .def_property_readonly("folded_outliers", &kvops::LaneServer::folded_outliers)
      .def("close", &kvops::LaneServer::close, no_gil);
}

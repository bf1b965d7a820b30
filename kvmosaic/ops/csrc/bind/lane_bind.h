// The decode lane's Python classes (kvmosaic/distributed/decode_lane.py) over its torch-free server
// and client (distributed/native): the tensor checks, the pools' memory and the answers' tensors.
// The float extension's binding file calls bind_float_lane, the quantized one's bind_quant_lane.
#pragma once

#include <torch/extension.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bind/bindings.h"
#include "bind/kvquant_tensors.h"
#include "hmac_sha256.h"
#include "lane_client.h"
#include "lane_pool.h"
#include "lane_server.h"

namespace kvops {

namespace lane_bind {

inline LaneDtype lane_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat ? LaneDtype::kFloat32 : LaneDtype::kBFloat16;
}

// Keeps the tensors a pool points into alive as long as the pool.
inline std::shared_ptr<const void> hold(std::vector<at::Tensor> tensors) {
  return std::make_shared<const std::vector<at::Tensor>>(std::move(tensors));
}

inline py::class_<LaneServer, std::shared_ptr<LaneServer>> server_class(py::module_& m, const char* doc) {
  py::class_<LaneServer, std::shared_ptr<LaneServer>> server(m, "AttentionServer", doc, py::module_local());
  server.def_property_readonly("refused_connections", &LaneServer::refused_connections)
      .def_property_readonly("port", &LaneServer::port)
      .def_property_readonly("local_name", &LaneServer::local_name)
      .def_property_readonly("folded_outliers", &LaneServer::folded_outliers)
      .def("close", &LaneServer::close, no_gil);
  return server;
}

// The float caches (one [2, blocks, block_size, kv_heads, head_dim] tensor a layer) as a lane pool
// whose partials come from decode_partial (the float extension's paged_decode_attention_partial).
template <typename DecodePartial>
std::unique_ptr<LanePool> float_pool(std::vector<at::Tensor> caches, DecodePartial decode_partial) {
  TORCH_CHECK(!caches.empty(), "AttentionServer needs the layers' KV caches");
  for (const at::Tensor& cache : caches)
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() &&
                    cache.sizes() == caches[0].sizes() && cache.scalar_type() == caches[0].scalar_type() &&
                    kvquant::is_row_dtype(cache.scalar_type()) && (cache.size(4) == 64 || cache.size(4) == 128),
                "AttentionServer: KV caches must be contiguous float32 / bfloat16 [2, blocks, block_size, "
                "kv_heads, 64 or 128], all alike");
  const at::Tensor& first = caches[0];
  const FloatLaneShape shape{first.size(1), first.size(2), first.size(3), first.size(4),
                             lane_dtype(first.scalar_type())};
  std::vector<void*> memory;
  for (const at::Tensor& cache : caches) memory.push_back(cache.data_ptr());
  // runs on a connection's thread, without the GIL
  auto partial = [caches, decode_partial](int64_t layer, const LaneQuery& query, const LanePartial& into) {
    const at::Tensor& cache = caches[layer];
    const auto longs = at::TensorOptions().dtype(at::kLong);
    const at::Tensor q = at::from_blob(const_cast<void*>(query.q), {query.items, query.heads, cache.size(4)},
                                       at::TensorOptions().dtype(cache.scalar_type()));
    const at::Tensor tables = at::from_blob(const_cast<int64_t*>(query.tables), {query.items, query.width}, longs);
    const at::Tensor lens = at::from_blob(const_cast<int64_t*>(query.lens), {query.items}, longs);
    const std::vector<at::Tensor> parts =
        decode_partial(q, cache.select(0, 0), cache.select(0, 1), tables, lens, query.scale);
    float* into_parts[3] = {into.out, into.reference, into.sum_exp};
    for (size_t i = 0; i < 3; ++i) {
      const at::Tensor part = parts[i].contiguous();
      std::memcpy(into_parts[i], part.data_ptr<float>(), part.nbytes());
    }
  };
  return float_lane_pool(std::move(memory), shape, std::move(partial), hold(std::move(caches)));
}

// The layers' record pools, each (k_pool, v_pool, k_thresholds, v_thresholds, k_center, key_weight,
// query_weight), as a lane pool; the weights are empty when keys are stored unrotated.
inline std::unique_ptr<LanePool> quant_pool(const std::vector<std::vector<at::Tensor>>& layers, int64_t mode,
                                            int64_t hk, int64_t d, int64_t capacity, at::ScalarType dtype) {
  std::vector<at::Tensor> kept;
  std::vector<QuantLaneLayer> pools;
  for (const std::vector<at::Tensor>& t : layers) {
    TORCH_CHECK(t.size() == 7, "AttentionServer: a layer is (k_pool, v_pool, k_thresholds, v_thresholds, k_center, "
                "key_weight, query_weight)");
    for (int i = 4; i < 7; ++i) TORCH_CHECK(t[i].numel() == 0 || t[i].numel() == hk * d, "AttentionServer: k_center "
                                            "and the rotation's weights must be empty or [hk, d]");
    TORCH_CHECK((t[5].numel() == 0) == (t[6].numel() == 0), "AttentionServer: a rotation needs both weights");
    TORCH_CHECK(t[5].numel() == 0 || (d & (d - 1)) == 0, "AttentionServer: a rotation needs a power-of-two head_dim");
    const at::Tensor kt = kvquant::threshold_floats(t[2]), vt = kvquant::threshold_floats(t[3]);
    const at::Tensor center = t[4].to(at::kFloat).contiguous();
    const at::Tensor kw = t[5].to(at::kFloat).contiguous(), qw = t[6].to(at::kFloat).contiguous();
    pools.push_back({nullptr, nullptr, kvquant::floats_or_null(kt), kvquant::floats_or_null(vt),
                     kvquant::floats_or_null(center), kvquant::floats_or_null(kw), kvquant::floats_or_null(qw)});
    kept.insert(kept.end(), {t[0], t[1], kt, vt, center, kw, qw});
  }
  TORCH_CHECK(!pools.empty(), "AttentionServer needs the layers' record pools");
  TORCH_CHECK(kvquant::is_row_dtype(dtype), "AttentionServer: rows are float32 or bfloat16");
  const at::Tensor& first = layers[0][0];
  const kvquant::Format f = kvquant::make_format(mode, hk, d, capacity, first.size(-1), first.size(1));
  for (size_t i = 0; i < layers.size(); ++i) {
    const at::Tensor &k_pool = layers[i][0], &v_pool = layers[i][1];
    kvquant::check_pool(k_pool, f);
    kvquant::check_pool(v_pool, f);
    TORCH_CHECK(k_pool.sizes() == first.sizes() && v_pool.sizes() == first.sizes(),
                "AttentionServer: every layer's record pools must be alike");
    pools[i].k_pool = k_pool.data_ptr<uint8_t>(), pools[i].v_pool = v_pool.data_ptr<uint8_t>();
  }
  const QuantLaneShape shape{mode, hk, d, capacity, first.size(0), first.size(1), first.size(2), lane_dtype(dtype)};
  return quant_lane_pool(std::move(pools), shape, hold(std::move(kept)));
}

}  // namespace lane_bind

// AttentionServer over the float caches, AttentionClient and hmac_sha256, into the float extension's
// module; decode_partial is its paged_decode_attention_partial.
template <typename DecodePartial>
void bind_float_lane(py::module_& m, DecodePartial decode_partial) {
  lane_bind::server_class(m, "a creditor's micro-attention server for decode rows (kvmosaic.distributed)")
      .def(py::init([decode_partial](std::vector<at::Tensor> caches, int64_t num_heads, const std::string& host,
                                     int64_t spin_us, const py::bytes& secret, double handshake_timeout,
                                     int64_t max_message_bytes) {
             return std::make_shared<LaneServer>(lane_bind::float_pool(std::move(caches), decode_partial), num_heads,
                                                 host, spin_us,
                                                 lane_access(secret, handshake_timeout, max_message_bytes));
           }),
           py::arg("caches"), py::arg("num_heads"), py::arg("host"), py::arg("spin_us"), py::arg("secret"),
           py::arg("handshake_timeout"), py::arg("max_message_bytes"));
  py::class_<LaneClient, std::shared_ptr<LaneClient>>(
      m, "AttentionClient", "a debtor's connection to a creditor's AttentionServer (kvmosaic.distributed)",
      py::module_local())
      .def(py::init([](const std::string& host, int64_t port, const std::string& local_name, double timeout,
                       int64_t spin_us, bool shared_memory, const py::bytes& secret) {
             std::string key = secret;
             py::gil_scoped_release released;  // the connection and its handshake wait on the network
             return std::make_shared<LaneClient>(host, port, local_name, timeout, spin_us, shared_memory, key);
           }),
           py::arg("host"), py::arg("port"), py::arg("local_name"), py::arg("timeout"), py::arg("spin_us"),
           py::arg("shared_memory"), py::arg("secret"))
      .def_property_readonly("local", &LaneClient::local)
      .def_property_readonly("transport", &LaneClient::transport)
      .def("send", [](LaneClient& client, int64_t layer, double scale, const std::vector<int64_t>& ints,
                      const at::Tensor& q, const c10::optional<at::Tensor>& k_new,
                      const c10::optional<at::Tensor>& v_new, int64_t kv_heads) {
             TORCH_CHECK(!client.closed(), "LaneClient: closed");
             TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(0) > 0,
                         "LaneClient: q is contiguous [items, heads, head_dim]");
             TORCH_CHECK(k_new.has_value() == v_new.has_value(), "LaneClient: k_new and v_new come together");
             const size_t row_bytes = static_cast<size_t>(q.size(0) * kv_heads * q.size(2)) * q.element_size();
             if (k_new.has_value())
               for (const at::Tensor& t : {*k_new, *v_new})
                 TORCH_CHECK(t.is_contiguous() && t.scalar_type() == q.scalar_type() &&
                                 static_cast<size_t>(t.nbytes()) == row_bytes,
                             "LaneClient: k_new, v_new are contiguous [items, kv_heads, head_dim] in q's dtype");
             client.send(layer, scale, ints, q.size(0), q.data_ptr(), q.nbytes(),
                         k_new ? k_new->data_ptr() : nullptr, v_new ? v_new->data_ptr() : nullptr, row_bytes);
           }, no_gil, py::arg("layer"), py::arg("scale"), py::arg("ints"), py::arg("q"), py::arg("k_new"),
           py::arg("v_new"), py::arg("kv_heads"))
      .def("receive", [](LaneClient& client, int64_t items, int64_t num_heads, int64_t head_dim) -> py::tuple {
             const int64_t rows = items * num_heads;
             at::Tensor floats = at::empty({rows * (head_dim + 2)}, at::TensorOptions().dtype(at::kFloat));
             LaneAnswer answer;
             {
               py::gil_scoped_release released;
               answer = client.receive(items, num_heads, head_dim, floats.data_ptr<float>());
             }
             if (!answer.error.empty()) return py::make_tuple(answer.seconds, answer.error);
             return py::make_tuple(answer.seconds, py::none(),
                                   floats.narrow(0, 0, rows * head_dim).view({items, num_heads, head_dim}),
                                   floats.narrow(0, rows * head_dim, rows).view({items, num_heads}),
                                   floats.narrow(0, rows * (head_dim + 1), rows).view({items, num_heads}));
           }, py::arg("items"), py::arg("num_heads"), py::arg("head_dim"),
           "(creditor seconds, None, out, reference, sum of exps), or (creditor seconds, error message)")
      .def("close", &LaneClient::close);
  m.def("hmac_sha256", [](const py::bytes& key, const py::bytes& message) {
    const std::string k = key, text = message;
    const Digest digest = hmac_sha256(k.data(), k.size(), {{text.data(), text.size()}});
    return py::bytes(reinterpret_cast<const char*>(digest.data()), digest.size());
  }, py::arg("key"), py::arg("message"), "HMAC-SHA256 as the decode lane's handshake computes it (tests: against hmac)");
}

// AttentionServer over the quantized records, into the quantized extension's module.
inline void bind_quant_lane(py::module_& m) {
  lane_bind::server_class(m, "a creditor's micro-attention server for decode rows over quantized records")
      .def(py::init([](const std::vector<std::vector<at::Tensor>>& layers, int64_t mode, int64_t hk, int64_t d,
                       int64_t capacity, const py::object& dtype, int64_t num_heads, const std::string& host,
                       int64_t spin_us, const py::bytes& secret, double handshake_timeout, int64_t max_message_bytes) {
             auto pool = lane_bind::quant_pool(layers, mode, hk, d, capacity,
                                               torch::python::detail::py_object_to_dtype(dtype));
             return std::make_shared<LaneServer>(std::move(pool), num_heads, host, spin_us,
                                                 lane_access(secret, handshake_timeout, max_message_bytes));
           }),
           py::arg("layers"), py::arg("mode"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("capacity"),
           py::arg("dtype"), py::arg("num_heads"), py::arg("host"), py::arg("spin_us"), py::arg("secret"),
           py::arg("handshake_timeout"), py::arg("max_message_bytes"));
}

}  // namespace kvops

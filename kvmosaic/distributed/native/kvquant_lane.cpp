// The decode lane's quantized pool (int8, int4, Oaken records): new rows quantized into the layers'
// records by quant_write, partials read from the lent records in place by the quantized decode
// kernel (quant_decode_attention_partial), both as the instance's own steps run them.
#include <atomic>

#include "kvquant/kvquant_format.h"
#include "lane_server.h"

namespace kvquant {
namespace {

struct LaneLayer {
  at::Tensor k_pool, v_pool, k_thresholds, v_thresholds, k_center;
};

class QuantLanePool final : public kvops::LanePool {
 public:
  QuantLanePool(std::vector<LaneLayer> layers, int64_t mode, int64_t hk, int64_t d, int64_t capacity,
                at::ScalarType dtype)
      : layers_(std::move(layers)), mode_(mode), hk_(hk), d_(d), capacity_(capacity), dtype_(dtype) {
    TORCH_CHECK(!layers_.empty(), "AttentionServer needs the layers' record pools");
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "AttentionServer: rows are float32 or bfloat16");
    const at::Tensor& first = layers_[0].k_pool;
    for (const LaneLayer& layer : layers_) {
      const Format f = make_format(mode, hk, d, capacity, first.size(-1));
      check_pool(layer.k_pool, f);
      check_pool(layer.v_pool, f);
      TORCH_CHECK(layer.k_pool.sizes() == first.sizes() && layer.v_pool.sizes() == first.sizes(),
                  "AttentionServer: every layer's record pools must be alike");
    }
  }
  int64_t layers() const override { return static_cast<int64_t>(layers_.size()); }
  int64_t blocks() const override { return layers_[0].k_pool.size(0); }
  int64_t block_size() const override { return layers_[0].k_pool.size(1); }
  int64_t kv_heads() const override { return hk_; }
  int64_t head_dim() const override { return d_; }
  at::ScalarType dtype() const override { return dtype_; }

  void write(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) override {
    const LaneLayer& l = layers_[layer];
    folded_ += quant_write(k, v, l.k_pool, l.v_pool, slots, mode_, hk_, d_, capacity_, l.k_thresholds,
                           l.v_thresholds, l.k_center);
  }

  int64_t folded_outliers() const override { return folded_; }

  std::vector<at::Tensor> partial(int64_t layer, const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens,
                                  double scale) override {
    const LaneLayer& l = layers_[layer];
    return quant_decode_attention_partial(q, l.k_pool, l.v_pool, tables, lens, mode_, hk_, capacity_, l.k_thresholds,
                                          l.v_thresholds, scale);
  }

 private:
  std::vector<LaneLayer> layers_;
  int64_t mode_, hk_, d_, capacity_;
  at::ScalarType dtype_;
  std::atomic<int64_t> folded_{0};  // Oaken outliers of lent rows that did not fit a sparse list
};

}  // namespace
}  // namespace kvquant

std::shared_ptr<kvops::LaneServer> quant_lane_server(const std::vector<std::vector<at::Tensor>>& layers, int64_t mode,
                                                     int64_t hk, int64_t d, int64_t capacity, at::ScalarType dtype,
                                                     int64_t num_heads, const std::string& host, int64_t spin_us,
                                                     kvops::LaneAccess access) {
  std::vector<kvquant::LaneLayer> pools;
  for (const std::vector<at::Tensor>& t : layers) {
    TORCH_CHECK(t.size() == 5, "AttentionServer: a layer is (k_pool, v_pool, k_thresholds, v_thresholds, k_center)");
    pools.push_back({t[0], t[1], t[2], t[3], t[4]});
  }
  return std::make_shared<kvops::LaneServer>(
      std::make_unique<kvquant::QuantLanePool>(std::move(pools), mode, hk, d, capacity, dtype), num_heads, host,
      spin_us, std::move(access));
}

// The decode lane's quantized pool (int8, int4, Oaken records): new rows quantized into the layers'
// records, partials read from the lent records in place by the quantized decode kernel, both as the
// instance's own steps run them (kvquant/kvquant.h).
#include <atomic>
#include <utility>
#include <vector>

#include "kvquant/kvquant.h"
#include "lane_pool.h"

namespace kvops {

namespace {

kvquant::Rows rows_of(LaneDtype dtype) {
  return dtype == LaneDtype::kFloat32 ? kvquant::Rows::kFloat32 : kvquant::Rows::kBFloat16;
}

class QuantLanePool final : public LanePool {
 public:
  QuantLanePool(std::vector<QuantLaneLayer> layers, const QuantLaneShape& shape, std::shared_ptr<const void> owner)
      : layers_(std::move(layers)),
        shape_(shape),
        format_(kvquant::make_format(shape.mode, shape.kv_heads, shape.head_dim, shape.capacity, shape.record,
                                     shape.block_size)),
        owner_(std::move(owner)) {
    KV_CHECK(!layers_.empty(), "AttentionServer needs the layers' record pools");
  }
  int64_t layers() const override { return static_cast<int64_t>(layers_.size()); }
  int64_t blocks() const override { return shape_.blocks; }
  int64_t block_size() const override { return shape_.block_size; }
  int64_t kv_heads() const override { return shape_.kv_heads; }
  int64_t head_dim() const override { return shape_.head_dim; }
  LaneDtype dtype() const override { return shape_.dtype; }

  void write(int64_t layer, const void* k, const void* v, const int64_t* slots, int64_t rows) override {
    const QuantLaneLayer& l = layers_[layer];
    const kvquant::Thresholds kt = kvquant::thresholds_of(l.k_thresholds), vt = kvquant::thresholds_of(l.v_thresholds);
    if (l.key_weight == nullptr) {
      folded_ += kvquant::write_rows({k, v, rows_of(dtype()), rows, slots}, l.k_pool, l.v_pool, format_, kt, vt,
                                     l.k_center);
      return;
    }
    // as the instance's own write: keys rotated (with the center) into float32, values widened to it
    const int64_t width = rows * kv_heads() * head_dim();
    std::vector<float> k_rows(width), v_rows(width);
    kvquant::rotate_heads({rows, kv_heads(), head_dim(), kv_heads(), l.key_weight, l.k_center}, k, rows_of(dtype()),
                          k_rows.data(), kvquant::Rows::kFloat32);
    kvquant::widen_rows(v, rows_of(dtype()), width, v_rows.data());
    folded_ += kvquant::write_rows({k_rows.data(), v_rows.data(), kvquant::Rows::kFloat32, rows, slots}, l.k_pool,
                                   l.v_pool, format_, kt, vt, nullptr);
  }

  int64_t folded_outliers() const override { return folded_; }

  void partial(int64_t layer, const LaneQuery& query, const LanePartial& into) override {
    const QuantLaneLayer& l = layers_[layer];
    const void* q = query.q;
    std::vector<float> rotated;  // room for the queries in float32 or bfloat16
    if (l.query_weight != nullptr) {  // into the basis the keys are stored in
      rotated.resize(query.items * query.heads * head_dim());
      kvquant::rotate_heads({query.items, query.heads, head_dim(), kv_heads(), l.query_weight, nullptr}, query.q,
                            rows_of(dtype()), rotated.data(), rows_of(dtype()));
      q = rotated.data();
    }
    const kvquant::DecodeCall call{q,            rows_of(dtype()), query.items, query.heads, query.width,
                                   block_size(), l.k_pool,         l.v_pool,    query.tables, query.lens,
                                   query.scale};
    const kvquant::PartialOut out{into.out, into.reference, into.sum_exp};
    kvquant::decode_attention(call, format_, kvquant::thresholds_of(l.k_thresholds),
                              kvquant::thresholds_of(l.v_thresholds), nullptr, &out);
  }

 private:
  std::vector<QuantLaneLayer> layers_;
  QuantLaneShape shape_;
  kvquant::Format format_;
  std::shared_ptr<const void> owner_;  // the tensors behind the layers' pointers
  std::atomic<int64_t> folded_{0};  // Oaken outliers of lent rows that did not fit a sparse list
};

}  // namespace

std::unique_ptr<LanePool> quant_lane_pool(std::vector<QuantLaneLayer> layers, QuantLaneShape shape,
                                          std::shared_ptr<const void> owner) {
  return std::make_unique<QuantLanePool>(std::move(layers), shape, std::move(owner));
}

}  // namespace kvops

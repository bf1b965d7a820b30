// The decode lane's float pool: new rows copied into the layers' caches, partials from the float
// extension's decode attention over the lent blocks in place (the binding hands it in, lane_bind.h).
#include <cstring>
#include <utility>

#include "common/check.h"
#include "lane_pool.h"

namespace kvops {

namespace {

class FloatLanePool final : public LanePool {
 public:
  FloatLanePool(std::vector<void*> caches, FloatLaneShape shape, LanePartialFn partial,
                std::shared_ptr<const void> owner)
      : caches_(std::move(caches)), shape_(shape), partial_(std::move(partial)), owner_(std::move(owner)) {
    KV_CHECK(!caches_.empty(), "AttentionServer needs the layers' KV caches");
  }
  int64_t layers() const override { return static_cast<int64_t>(caches_.size()); }
  int64_t blocks() const override { return shape_.blocks; }
  int64_t block_size() const override { return shape_.block_size; }
  int64_t kv_heads() const override { return shape_.kv_heads; }
  int64_t head_dim() const override { return shape_.head_dim; }
  LaneDtype dtype() const override { return shape_.dtype; }

  void write(int64_t layer, const void* k, const void* v, const int64_t* slots, int64_t rows) override {
    const int64_t row = kv_heads() * head_dim() * element_size(dtype());
    char* k_rows = static_cast<char*>(caches_[layer]);
    char* v_rows = k_rows + blocks() * block_size() * row;
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(k_rows + slots[i] * row, static_cast<const char*>(k) + i * row, row);
      std::memcpy(v_rows + slots[i] * row, static_cast<const char*>(v) + i * row, row);
    }
  }

  void partial(int64_t layer, const LaneQuery& query, const LanePartial& into) override {
    partial_(layer, query, into);
  }

 private:
  std::vector<void*> caches_;
  FloatLaneShape shape_;
  LanePartialFn partial_;
  std::shared_ptr<const void> owner_;
};

}  // namespace

std::unique_ptr<LanePool> float_lane_pool(std::vector<void*> caches, FloatLaneShape shape, LanePartialFn partial,
                                          std::shared_ptr<const void> owner) {
  return std::make_unique<FloatLanePool>(std::move(caches), shape, std::move(partial), std::move(owner));
}

}  // namespace kvops

// The decode lane's float pool: new rows copied into the layers' caches, partials from the decode
// attention kernel over the lent blocks in place (paged_decode_attention_partial).
#include <cstring>

#include "lane_server.h"
#include "common/ops_common.h"

namespace kvops {

namespace {

class FloatLanePool final : public LanePool {
 public:
  explicit FloatLanePool(std::vector<at::Tensor> caches) : caches_(std::move(caches)) {
    TORCH_CHECK(!caches_.empty(), "AttentionServer needs the layers' KV caches");
    for (const at::Tensor& cache : caches_)
      TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() &&
                      cache.sizes() == caches_[0].sizes() && cache.scalar_type() == caches_[0].scalar_type() &&
                      (cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16) &&
                      (cache.size(4) == 64 || cache.size(4) == 128),
                  "AttentionServer: KV caches must be contiguous float32 / bfloat16 [2, blocks, block_size, "
                  "kv_heads, 64 or 128], all alike");
  }
  int64_t layers() const override { return static_cast<int64_t>(caches_.size()); }
  int64_t blocks() const override { return caches_[0].size(1); }
  int64_t block_size() const override { return caches_[0].size(2); }
  int64_t kv_heads() const override { return caches_[0].size(3); }
  int64_t head_dim() const override { return caches_[0].size(4); }
  at::ScalarType dtype() const override { return caches_[0].scalar_type(); }

  void write(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) override {
    const int64_t row = kv_heads() * head_dim() * caches_[0].element_size();
    char* k_rows = static_cast<char*>(caches_[layer].data_ptr());
    char* v_rows = k_rows + blocks() * block_size() * row;
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < slots.numel(); ++i) {
      std::memcpy(k_rows + slot[i] * row, static_cast<const char*>(k.data_ptr()) + i * row, row);
      std::memcpy(v_rows + slot[i] * row, static_cast<const char*>(v.data_ptr()) + i * row, row);
    }
  }

  std::vector<at::Tensor> partial(int64_t layer, const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens,
                                  double scale) override {
    const at::Tensor& cache = caches_[layer];
    return paged_decode_attention_partial(q, cache.select(0, 0), cache.select(0, 1), tables, lens, scale);
  }

 private:
  std::vector<at::Tensor> caches_;
};

}  // namespace

std::shared_ptr<LaneServer> float_lane_server(std::vector<at::Tensor> caches, int64_t num_heads,
                                              const std::string& host, int64_t spin_us, LaneAccess access) {
  return std::make_shared<LaneServer>(std::make_unique<FloatLanePool>(std::move(caches)), num_heads, host, spin_us,
                                      std::move(access));
}

}  // namespace kvops

// One instance's KV pool as the decode lane's server reads and writes it (lane_server.cpp), without
// the PyTorch headers: the float caches (float_lane_pool.cpp) or the quantized records
// (kvquant_lane.cpp). The binding files check the tensors and hand the adapters their memory.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace kvops {

// The element type of the rows that cross the lane (the instance's compute dtype).
enum class LaneDtype : int32_t { kFloat32 = 0, kBFloat16 = 1 };

inline int64_t element_size(LaneDtype dtype) { return dtype == LaneDtype::kFloat32 ? 4 : 2; }

// A call's decode rows: queries q [items, heads, head_dim] in the pool's dtype over block tables
// [items, width] up to lens [items] keys.
struct LaneQuery {
  const void* q;
  int64_t items, heads, width;
  const int64_t* tables;
  const int64_t* lens;
  double scale;
};

// Where a call's partial goes, float32: out [items, heads, head_dim], the softmax reference and the
// sum of exps [items, heads].
struct LanePartial {
  float* out;
  float* reference;
  float* sum_exp;
};

class LanePool {
 public:
  virtual ~LanePool() = default;
  virtual int64_t layers() const = 0;
  virtual int64_t blocks() const = 0;
  virtual int64_t block_size() const = 0;
  virtual int64_t kv_heads() const = 0;
  virtual int64_t head_dim() const = 0;
  virtual LaneDtype dtype() const = 0;
  // new rows k, v [rows, kv_heads, head_dim] into slots [rows] of `layer` (checked in range by the server)
  virtual void write(int64_t layer, const void* k, const void* v, const int64_t* slots, int64_t rows) = 0;
  virtual void partial(int64_t layer, const LaneQuery& query, const LanePartial& into) = 0;
  // Oaken outliers of written rows folded into the middle group because a sparse list was full
  virtual int64_t folded_outliers() const { return 0; }
};

// The float caches: layer l's [2, blocks, block_size, kv_heads, head_dim] (K then V) at caches[l],
// contiguous. The partials come from `partial` (the float extension's decode attention over the
// lent blocks in place); `owner` keeps the caches' memory alive as long as the pool.
struct FloatLaneShape {
  int64_t blocks, block_size, kv_heads, head_dim;
  LaneDtype dtype;
};
using LanePartialFn = std::function<void(int64_t layer, const LaneQuery& query, const LanePartial& into)>;
std::unique_ptr<LanePool> float_lane_pool(std::vector<void*> caches, FloatLaneShape shape, LanePartialFn partial,
                                          std::shared_ptr<const void> owner);

// The quantized records (int8, int4, Oaken) of one layer: its pools [blocks, block_size, record],
// contiguous uint8, its thresholds (4 floats; nullptr: none) and k_center [kv_heads, head_dim]
// (nullptr: none), read at each call.
struct QuantLaneLayer {
  uint8_t* k_pool;
  uint8_t* v_pool;
  const float* k_thresholds;
  const float* v_thresholds;
  const float* k_center;
  const float* key_weight;    // Oaken's key rotation (kvmosaic/quant/rotation.py), or null: keys are
  const float* query_weight;  // then rotated with k_center before encoding, queries before attending
};
struct QuantLaneShape {
  int64_t mode, kv_heads, head_dim, capacity, blocks, block_size, record;
  LaneDtype dtype;
};
std::unique_ptr<LanePool> quant_lane_pool(std::vector<QuantLaneLayer> layers, QuantLaneShape shape,
                                          std::shared_ptr<const void> owner);

}  // namespace kvops

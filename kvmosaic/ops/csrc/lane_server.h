// The creditor's C++ micro-attention server for decode rows (lane_server.cpp), over any pool that
// can take new K/V rows and answer a decode row's partial: the float caches (attention_pool.cpp) or
// the quantized records (kvquant_lane.cpp). Compiled into both extensions.
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kvops {

// One instance's KV pool as the server reads and writes it. Rows cross in dtype() (the compute dtype).
class LanePool {
 public:
  virtual ~LanePool() = default;
  virtual int64_t layers() const = 0;
  virtual int64_t blocks() const = 0;
  virtual int64_t block_size() const = 0;
  virtual int64_t kv_heads() const = 0;
  virtual int64_t head_dim() const = 0;
  virtual at::ScalarType dtype() const = 0;
  // new rows k, v [m, kv_heads, head_dim] into slots [m] of `layer` (checked in range by the server)
  virtual void write(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) = 0;
  // queries [n, hq, head_dim] over tables [n, width] up to lens [n]: {out, reference, sum of exps}, float32
  virtual std::vector<at::Tensor> partial(int64_t layer, const at::Tensor& q, const at::Tensor& tables,
                                          const at::Tensor& lens, double scale) = 0;
};

class LaneServer {
 public:
  // listens on host, any port; serves `pool` to debtors for queries of num_heads heads
  LaneServer(std::unique_ptr<LanePool> pool, int64_t num_heads, const std::string& host);
  ~LaneServer();
  LaneServer(const LaneServer&) = delete;
  LaneServer& operator=(const LaneServer&) = delete;
  int64_t port() const { return port_; }
  // stops accepting and ends every connection (a debtor's next call fails); idempotent
  void close();

 private:
  void accept_loop();
  void serve(int fd);
  bool serve_one(int fd);

  std::unique_ptr<LanePool> pool_;
  int64_t num_heads_;
  int listener_ = -1;
  int64_t port_ = 0;
  std::atomic<bool> closed_{false};
  std::mutex mutex_;
  std::vector<int> connections_;
  std::vector<std::thread> workers_;
  std::thread accept_thread_;
};

// A server over the float KV caches, one [2, blocks, block_size, kv_heads, head_dim] tensor a layer
// (float_lane_pool.cpp, in the float extension).
std::shared_ptr<LaneServer> float_lane_server(std::vector<at::Tensor> caches, int64_t num_heads,
                                              const std::string& host);

}  // namespace kvops

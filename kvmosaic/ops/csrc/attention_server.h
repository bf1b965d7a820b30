// The creditor's C++ micro-attention server (attention_server.cpp).
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kvops {

class AttentionServer {
 public:
  // caches: every layer's KV cache [2, blocks, block_size, kv_heads, head_dim]; listens on host, any port
  AttentionServer(std::vector<at::Tensor> caches, int64_t num_heads, const std::string& host);
  ~AttentionServer();
  AttentionServer(const AttentionServer&) = delete;
  AttentionServer& operator=(const AttentionServer&) = delete;
  int64_t port() const { return port_; }
  // stops accepting and ends every connection (a debtor's next call fails); idempotent
  void close();

 private:
  void accept_loop();
  void serve(int fd);
  bool serve_one(int fd);

  std::vector<at::Tensor> caches_;
  int64_t num_heads_;
  int listener_ = -1;
  int64_t port_ = 0;
  std::atomic<bool> closed_{false};
  std::mutex mutex_;
  std::vector<int> connections_;
  std::vector<std::thread> workers_;
  std::thread accept_thread_;
};

}  // namespace kvops

// The creditor's C++ micro-attention server for decode rows (lane_server.cpp), over any pool that
// can take new K/V rows and answer a decode row's partial: the float caches (attention_pool.cpp) or
// the quantized records (kvquant_lane.cpp). Compiled into both extensions.
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/socket.h>
#include <sys/uio.h>

#include "lane_auth.h"
#include "lane_transport.h"

namespace kvops {

// The wire format's headers (lane_server.cpp documents the whole message).
constexpr uint32_t kLaneMagic = 0x414d564b;  // "KVMA"
struct LaneRequestHeader {
  uint32_t magic;
  int32_t layer, items, width;
  double scale;
};
struct LaneAnswerHeader {
  uint32_t magic;
  int32_t status;
  double seconds;
};

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
  // Oaken outliers of written rows folded into the middle group because a sparse list was full
  virtual int64_t folded_outliers() const { return 0; }
};

class LaneServer {
 public:
  // listens on host, any port; serves `pool` to debtors for queries of num_heads heads, to peers that
  // pass `access` (the handshake, then calls no larger than its limit). After each answer a
  // connection's thread polls for the next call for up to spin_us microseconds before it sleeps in
  // the kernel (a polling thread skips the wake-up), as long as the previous call came within
  // spin_us of its answer.
  LaneServer(std::unique_ptr<LanePool> pool, int64_t num_heads, const std::string& host, int64_t spin_us,
             LaneAccess access);
  ~LaneServer();
  LaneServer(const LaneServer&) = delete;
  LaneServer& operator=(const LaneServer&) = delete;
  int64_t port() const { return port_; }
  // the abstract Unix socket debtors on this machine connect to ("" where there is none)
  const std::string& local_name() const { return local_name_; }
  int64_t folded_outliers() const { return pool_->folded_outliers(); }  // of the rows debtors wrote here
  int64_t refused_connections() const { return refused_; }  // failed handshakes, and connections over the cap
  // stops accepting and ends every connection (a debtor's next call fails); idempotent
  void close();

 private:
  void listen_local();
  void close_fds();
  void accept_loop();
  void serve(int fd, uint64_t id);
  void reap_finished();  // joins the threads of connections that ended (the caller holds mutex_)
  bool serve_one(LaneTransport& link, const LaneRequestHeader& head, std::vector<int64_t>& body);

  std::unique_ptr<LanePool> pool_;
  int64_t num_heads_;
  int64_t spin_us_;
  LaneAccess access_;
  std::atomic<int64_t> refused_{0};
  int listener_ = -1;
  int local_listener_ = -1;
  int wake_[2] = {-1, -1};  // a pipe: close() writes to it to end the accept loop
  int64_t port_ = 0;
  std::string local_name_;
  std::atomic<bool> closed_{false};
  std::mutex mutex_;
  std::vector<int> connections_;
  std::map<uint64_t, std::thread> workers_;  // by connection id
  std::vector<uint64_t> finished_;  // connections whose thread is done: joined by the accept loop
  uint64_t next_id_ = 0;
  std::thread accept_thread_;
};

// A server over the float KV caches, one [2, blocks, block_size, kv_heads, head_dim] tensor a layer
// (float_lane_pool.cpp, in the float extension).
std::shared_ptr<LaneServer> float_lane_server(std::vector<at::Tensor> caches, int64_t num_heads,
                                              const std::string& host, int64_t spin_us, LaneAccess access);

// Reads what has arrived on fd into parts, at least one byte: polls without sleeping for up to
// spin_us microseconds, then sleeps in poll() for up to timeout_ms (-1: no limit). Returns the bytes
// read, 0 when the peer closed, -1 on an error, -2 on a timeout.
ssize_t receive_some(int fd, iovec* parts, int count, int64_t spin_us, int timeout_ms);
// Sends every byte of parts (a closed peer is an error, not SIGPIPE); false on an error.
bool send_all(int fd, iovec* parts, size_t count);

}  // namespace kvops

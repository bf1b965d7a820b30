// The creditor's C++ micro-attention server for decode rows (lane_server.cpp), over any pool that
// can take new K/V rows and answer a decode row's partial (lane_pool.h): the float caches
// (float_lane_pool.cpp) or the quantized records (kvquant_lane.cpp). Compiled into both extensions;
// no PyTorch and no socket header here, so the binding files include it as they are.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "lane_auth.h"
#include "lane_pool.h"

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

class LaneTransport;  // lane_transport.h

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
  // one call; body and answer are the connection's buffers, kept for the next call
  bool serve_one(LaneTransport& link, const LaneRequestHeader& head, std::vector<int64_t>& body,
                 std::vector<float>& answer);

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

}  // namespace kvops

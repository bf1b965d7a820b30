// A debtor's connection to a creditor's decode lane (lane_client.cpp). Compiled into both extensions
// with the server; the float one binds it (bind/lane_bind.h). No PyTorch and no socket header here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvops {

class LaneTransport;  // lane_transport.h

struct LaneAnswer {
  double seconds;  // the creditor's compute time
  std::string error;  // the creditor's message when it failed the call (else the partial is in the buffer)
};

class LaneClient {
 public:
  // connects to a lane server: through its abstract Unix socket local_name when that is reachable (the
  // server is on this machine), else over TCP; waits up to timeout seconds for an answer, the first
  // spin_us of them polling. On this machine the calls then go through rings in shared memory
  // (lane_transport.h) unless shared_memory is false. Either way it first proves it holds secret, and
  // checks the server does, before it sends anything else (lane_auth.h).
  LaneClient(const std::string& host, int64_t port, const std::string& local_name, double timeout, int64_t spin_us,
             bool shared_memory, const std::string& secret);
  bool local() const { return local_; }  // connected through the Unix socket
  // "shared memory", "unix socket" or "tcp"
  std::string transport() const;
  bool closed() const { return fd_ < 0; }
  ~LaneClient();
  LaneClient(const LaneClient&) = delete;
  LaneClient& operator=(const LaneClient&) = delete;
  // one call of `items` rows: ints are [context[items], slot[items], table[items * width]]; q is
  // q_bytes of [items, hq, head_dim] and k_new, v_new row_bytes each of [items, hk, head_dim], in the
  // lane's dtype, or null when no item has a new row (every slot -1; the server then reads zeros it ignores)
  void send(int64_t layer, double scale, const std::vector<int64_t>& ints, int64_t items, const void* q,
            size_t q_bytes, const void* k_new, const void* v_new, size_t row_bytes);
  // the answer to the oldest call sent and not yet received; on success its partial is in
  // floats [items * num_heads * (head_dim + 2)]: out [items, num_heads, head_dim], then the
  // references and the sums of exps [items, num_heads]
  LaneAnswer receive(int64_t items, int64_t num_heads, int64_t head_dim, float* floats);
  void close();

 private:
  void read_exactly(void* buffer, size_t bytes);

  int fd_ = -1;
  bool local_ = true;
  std::unique_ptr<LaneTransport> link_;  // over fd_, or the shared rings beside it
  int64_t outstanding_ = 0;  // calls sent and not yet answered
  std::vector<char> zeros_;  // the new rows of calls that bring none
  int timeout_ms_;
  int64_t spin_us_;
};

}  // namespace kvops

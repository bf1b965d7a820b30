// A creditor's micro-attention server for decode rows (kvmosaic.distributed): a debtor's one-row
// queries over the blocks it borrowed here, answered in C++ with no Python and no GIL, over a float
// or a quantized pool (a LanePool).
//
// The Python data plane (channel.py) cost ~1 ms a call end to end, ~0.35 ms of it in the creditor's
// Python (unpickling, the handler, pickling the answer) on the core that runs the creditor's own
// steps; a decode row's attention over a few hundred lent keys is ~20 us of kernel. Here a call is
// one binary message each way over a connection (TCP, a Unix socket, or rings in shared memory),
// served by a thread of its own.
//
// Request (native byte order: both ends are kvmosaic on one architecture):
//   u32 magic, i32 layer, i32 items, i32 width, f64 scale,
//   i64 context[items]           keys visible to each item's query (a prefix of its blocks' slots)
//   i64 slot[items]              where its new K/V row goes (-1: none)
//   i64 table[items * width]     block ids, padded with any valid id
//   q[items, hq, d], k_new[items, hk, d], v_new[items, hk, d] in the pool's dtype
// Answer: u32 magic, i32 status, f64 seconds, then on success out[items, hq, d], reference[items, hq]
// and sum of exponentials[items, hq] as float32 (the pool's decode partials); on failure i32 length
// and a message. A malformed request closes the connection.
// A debtor on this machine may open with a hello instead (lane_transport.cpp): a request header of
// magic "KVMS" whose scale is the size of each of two shared byte rings, with the rings' memfd riding
// along; the answer header's status says whether the server took them. The calls then go through the
// rings in the same format, and the socket only tells either end that the other has gone.
//
// Every connection, TCP or Unix socket, first runs the cluster's handshake (lane_auth.cpp) within
// the access's timeout: a peer without the secret is closed before the server reads a call or maps
// any memory. Every count and size in a call is checked against the pool's shapes and the access's
// message limit before anything is allocated; at most kMaxConnections are open at once.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <omp.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/check.h"
#include "lane_server.h"
#include "lane_transport.h"

namespace kvops {

namespace {

constexpr int32_t kMaxItems = 1 << 12;
constexpr size_t kMaxConnections = 256;  // beyond it a new connection is closed at once

void warn_refused(int fd, const std::string& why) {
  // no Python logger on this thread (no GIL): the instance's stderr, as the engine's log goes there too
  std::fprintf(stderr, "kvmosaic decode lane: closed a connection from %s: %s\n", peer_name(fd).c_str(), why.c_str());
}

}  // namespace

ssize_t receive_some(int fd, iovec* parts, int count, int64_t spin_us, int timeout_ms) {
  msghdr message{};
  message.msg_iov = parts;
  message.msg_iovlen = count;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  bool spinning = spin_us > 0;
  while (true) {
    const ssize_t got = ::recvmsg(fd, &message, MSG_DONTWAIT);
    if (got >= 0) return got;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    if (spinning) {
      if (std::chrono::steady_clock::now() < until) {
        ::sched_yield();  // a thread waiting for this core (the other end, on a busy host) runs first
        continue;
      }
      spinning = false;
    }
    pollfd ready{fd, POLLIN, 0};
    if (::poll(&ready, 1, timeout_ms) == 0) return -2;  // else readable, closed, failed or EINTR: recvmsg tells
  }
}

bool send_all(int fd, iovec* parts, size_t count) {
  size_t first = 0;
  while (first < count) {
    msghdr message{};
    message.msg_iov = parts + first;
    message.msg_iovlen = std::min<size_t>(count - first, 512);
    const ssize_t sent = ::sendmsg(fd, &message, MSG_NOSIGNAL);  // a closed peer is an error, not SIGPIPE
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0) return false;
    size_t left = static_cast<size_t>(sent);
    while (first < count && left >= parts[first].iov_len) left -= parts[first++].iov_len;
    if (first < count && left > 0) {
      parts[first].iov_base = static_cast<char*>(parts[first].iov_base) + left;
      parts[first].iov_len -= left;
    }
  }
  return true;
}

LaneServer::LaneServer(std::unique_ptr<LanePool> pool, int64_t num_heads, const std::string& host, int64_t spin_us,
                       LaneAccess access)
    : pool_(std::move(pool)), num_heads_(num_heads), spin_us_(spin_us), access_(std::move(access)) {
  KV_CHECK(pool_ != nullptr && pool_->layers() > 0, "LaneServer needs a pool of at least one layer");
  KV_CHECK(access_.secret.size() >= 16 && access_.handshake_timeout_ms > 0 && access_.max_message_bytes > 0,
              "LaneServer needs a secret of 16+ bytes, a handshake timeout and a message limit");
  KV_CHECK(spin_us >= 0 && spin_us <= 100000, "LaneServer: spin_us must be in [0, 1e5]");
  KV_CHECK(num_heads > 0 && num_heads % pool_->kv_heads() == 0, "LaneServer: bad number of query heads");
  KV_CHECK(::pipe(wake_) == 0, "LaneServer: cannot open a pipe");
  listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
  if (listener_ < 0) {
    close_fds();
    KV_CHECK(false, "LaneServer: cannot open a socket");
  }
  const int one = 1;
  ::setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    close_fds();
    KV_CHECK(false, "LaneServer: not an IPv4 address: ", host);
  }
  socklen_t len = sizeof(addr);
  if (::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(listener_, 16) != 0 ||
      ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close_fds();
    KV_CHECK(false, "LaneServer: cannot listen on ", host);
  }
  port_ = ntohs(addr.sin_port);
  listen_local();
  accept_thread_ = std::thread([this] { accept_loop(); });
}

void LaneServer::listen_local() {
#ifdef __linux__
  // an abstract Unix socket (no file; gone with the process) for debtors on this machine: cheaper per
  // message than TCP over loopback. Without one, every debtor connects over TCP.
  local_name_ = "kvmosaic-lane-" + std::to_string(::getpid()) + "-" + std::to_string(port_);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, local_name_.data(), local_name_.size());
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + local_name_.size());
  local_listener_ = ::socket(AF_UNIX, SOCK_STREAM, 0);
  if (local_listener_ < 0 || ::bind(local_listener_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::listen(local_listener_, 16) != 0) {
    if (local_listener_ >= 0) ::close(local_listener_);
    local_listener_ = -1;
    local_name_.clear();
  }
#endif
}

LaneServer::~LaneServer() { close(); }

void LaneServer::close() {
  if (closed_.exchange(true)) return;
  const char byte = 0;
  if (::write(wake_[1], &byte, 1) < 0) {  // the accept loop polls the pipe too: this ends it
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  close_fds();
  {
    std::lock_guard<std::mutex> guard(mutex_);
    for (int fd : connections_) ::shutdown(fd, SHUT_RDWR);  // wakes their threads; each closes its own
  }
  for (auto& worker : workers_) worker.second.join();  // the accept loop is gone: nobody adds more
  workers_.clear();
  finished_.clear();
}

void LaneServer::close_fds() {
  for (int* fd : {&listener_, &local_listener_, &wake_[0], &wake_[1]}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

void LaneServer::accept_loop() {
  pollfd ready[3] = {{wake_[0], POLLIN, 0}, {listener_, POLLIN, 0}, {local_listener_, POLLIN, 0}};
  const nfds_t count = local_listener_ >= 0 ? 3 : 2;
  while (!closed_) {
    if (::poll(ready, count, -1) < 0 || ready[0].revents != 0) continue;  // EINTR, or closing
    for (nfds_t i = 1; i < count; ++i) {
      if (!(ready[i].revents & POLLIN)) continue;
      const int fd = ::accept(ready[i].fd, nullptr, nullptr);
      if (fd < 0) continue;
      if (i == 1) {
        const int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      }
      std::lock_guard<std::mutex> guard(mutex_);
      reap_finished();
      if (connections_.size() >= kMaxConnections) {
        ++refused_;
        warn_refused(fd, "too many open connections");
        ::close(fd);
        continue;
      }
      connections_.push_back(fd);
      const uint64_t id = next_id_++;
      workers_.emplace(id, std::thread([this, fd, id] { serve(fd, id); }));
    }
  }
}

void LaneServer::reap_finished() {
  for (const uint64_t id : finished_) {
    const auto worker = workers_.find(id);
    worker->second.join();  // it is past its last use of this object's state
    workers_.erase(worker);
  }
  finished_.clear();
}

void LaneServer::serve(int fd, uint64_t id) {
  omp_set_num_threads(1);  // a call is one row's attention: this thread alone, beside the instance's own team
  std::vector<int64_t> body;  // a call's block tables and rows, kept for the next one
  std::vector<float> answer;  // a call's partial, likewise
  LaneRequestHeader head{};
  std::string why;
  const bool trusted = accept_handshake(fd, access_.secret, access_.handshake_timeout_ms, &why);
  if (!trusted && !closed_) {
    ++refused_;
    warn_refused(fd, why);
  }
  // the socket, or the shared rings a debtor on this machine brought in its hello
  const std::unique_ptr<LaneTransport> link = trusted ? accept_transport(fd, &head, spin_us_) : nullptr;
  int64_t spin_us = spin_us_;
  while (link != nullptr && !closed_ && serve_one(*link, head, body, answer)) {
    iovec part{&head, sizeof(head)};
    const auto answered = std::chrono::steady_clock::now();
    const ssize_t got = link->receive_some(&part, 1, spin_us, -1);
    // Poll for the next call only while calls come within spin_us of the last answer: a debtor's
    // step computes between its layers' calls for longer than that, and a thread polling through
    // the gap takes a core from the instance's own steps on a busy host.
    const auto gap = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - answered);
    spin_us = gap.count() <= spin_us_ ? spin_us_ : 0;
    if (got <= 0 || (static_cast<size_t>(got) < sizeof(head) &&
                     receive_exactly(*link, reinterpret_cast<char*>(&head) + got, sizeof(head) - got, 0, -1) <= 0))
      break;
  }
  std::lock_guard<std::mutex> guard(mutex_);
  connections_.erase(std::find(connections_.begin(), connections_.end(), fd));
  ::close(fd);
  finished_.push_back(id);
}

bool LaneServer::serve_one(LaneTransport& link, const LaneRequestHeader& head, std::vector<int64_t>& body,
                           std::vector<float>& answer) {
  if (head.magic != kLaneMagic) return false;
  LanePool& pool = *pool_;
  const int64_t hk = pool.kv_heads(), d = pool.head_dim(), bs = pool.block_size(), slots = pool.blocks() * bs;
  if (head.items < 1 || head.items > kMaxItems || head.width < 1 || head.width > pool.blocks()) return false;
  const int64_t n = head.items, width = head.width, elem = element_size(pool.dtype());
  const int64_t num_ints = n * (2 + width), row_bytes = n * (num_heads_ + 2 * hk) * d * elem;
  if (num_ints * static_cast<int64_t>(sizeof(int64_t)) + row_bytes > access_.max_message_bytes) return false;
  body.resize(num_ints + (row_bytes + 7) / 8);  // int64 words: the rows start 8-byte aligned
  if (receive_exactly(link, body.data(), num_ints * sizeof(int64_t) + row_bytes, 0, -1) <= 0) return false;
  const int64_t* ints = body.data();
  char* rows = reinterpret_cast<char*>(body.data() + num_ints);
  const int64_t partial_rows = n * num_heads_;
  answer.resize(partial_rows * (d + 2));  // out [n, heads, d], reference [n, heads], sum of exps [n, heads]

  const auto started = std::chrono::steady_clock::now();
  std::string error;
  try {
    KV_CHECK(head.layer >= 0 && head.layer < pool.layers(), "layer ", head.layer, " out of range");
    KV_CHECK(std::isfinite(head.scale), "the scale is not a finite number");
    const int64_t* context = ints;
    const int64_t* slot = ints + n;
    const int64_t* table = ints + 2 * n;
    std::vector<int64_t> written;  // the items that bring a new row
    for (int64_t i = 0; i < n; ++i) {  // all of a call is checked before any of it is written
      KV_CHECK(slot[i] >= -1 && slot[i] < slots, "slot ", slot[i], " out of range");
      KV_CHECK(context[i] >= 0 && context[i] <= width * bs, "a context exceeds its blocks");
      for (int64_t j = 0; j < (context[i] + bs - 1) / bs; ++j)
        KV_CHECK(table[i * width + j] >= 0 && table[i * width + j] < pool.blocks(), "block id out of range");
      if (slot[i] >= 0) written.push_back(i);
    }
    const int64_t row = hk * d * elem;
    const char* k_new = rows + n * num_heads_ * d * elem;
    const char* v_new = k_new + n * row;
    if (static_cast<int64_t>(written.size()) == n) {
      pool.write(head.layer, k_new, v_new, slot, n);
    } else if (!written.empty()) {  // the items with a new row, gathered
      const int64_t m = static_cast<int64_t>(written.size());
      std::vector<char> k(m * row), v(m * row);
      std::vector<int64_t> at(m);
      for (int64_t j = 0; j < m; ++j) {
        std::memcpy(k.data() + j * row, k_new + written[j] * row, row);
        std::memcpy(v.data() + j * row, v_new + written[j] * row, row);
        at[j] = slot[written[j]];
      }
      pool.write(head.layer, k.data(), v.data(), at.data(), m);
    }
    float* out = answer.data();
    pool.partial(head.layer, {rows, n, num_heads_, width, table, context, head.scale},
                 {out, out + partial_rows * d, out + partial_rows * (d + 1)});
  } catch (const std::exception& e) {
    error = e.what();
    error = error.substr(0, error.find('\n'));  // the first line: c10 appends a C++ backtrace
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  LaneAnswerHeader reply{kLaneMagic, error.empty() ? 0 : 1, seconds};
  std::vector<iovec> parts{{&reply, sizeof(reply)}};
  int32_t length = static_cast<int32_t>(error.size());
  if (error.empty()) {
    parts.push_back({answer.data(), answer.size() * sizeof(float)});
  } else {
    parts.push_back({&length, sizeof(length)});
    parts.push_back({error.data(), error.size()});
  }
  return link.send_all(parts.data(), parts.size());
}

}  // namespace kvops

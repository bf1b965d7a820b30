// A creditor's micro-attention server for decode rows (kvmosaic.distributed): a debtor's one-row
// queries over the blocks it borrowed here, answered in C++ with no Python and no GIL, over a float
// or a quantized pool (a LanePool).
//
// The Python data plane (channel.py) cost ~1 ms a call end to end, ~0.35 ms of it in the creditor's
// Python (unpickling, the handler, pickling the answer) on the core that runs the creditor's own
// steps; a decode row's attention over a few hundred lent keys is ~20 us of kernel. Here a call is
// one binary message each way over a TCP connection, served by a thread of its own.
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
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <omp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "lane_server.h"

namespace kvops {

namespace {

constexpr uint32_t kMagic = 0x414d564b;  // "KVMA"
constexpr int32_t kMaxItems = 1 << 12;

struct RequestHeader {
  uint32_t magic;
  int32_t layer, items, width;
  double scale;
};
struct AnswerHeader {
  uint32_t magic;
  int32_t status;
  double seconds;
};

bool read_all(int fd, void* buffer, size_t bytes) {
  char* p = static_cast<char*>(buffer);
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

bool write_all(int fd, std::vector<iovec> parts) {
  size_t first = 0;
  while (first < parts.size()) {
    const ssize_t n = ::writev(fd, parts.data() + first, static_cast<int>(std::min<size_t>(parts.size() - first, 512)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    size_t sent = static_cast<size_t>(n);
    while (first < parts.size() && sent >= parts[first].iov_len) sent -= parts[first++].iov_len;
    if (first < parts.size() && sent > 0) {
      parts[first].iov_base = static_cast<char*>(parts[first].iov_base) + sent;
      parts[first].iov_len -= sent;
    }
  }
  return true;
}

}  // namespace

LaneServer::LaneServer(std::unique_ptr<LanePool> pool, int64_t num_heads, const std::string& host)
    : pool_(std::move(pool)), num_heads_(num_heads) {
  TORCH_CHECK(pool_ != nullptr && pool_->layers() > 0, "LaneServer needs a pool of at least one layer");
  TORCH_CHECK(num_heads > 0 && num_heads % pool_->kv_heads() == 0, "LaneServer: bad number of query heads");
  listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(listener_ >= 0, "LaneServer: cannot open a socket");
  const int one = 1;
  ::setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    ::close(listener_);
    TORCH_CHECK(false, "LaneServer: not an IPv4 address: ", host);
  }
  socklen_t len = sizeof(addr);
  if (::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(listener_, 16) != 0 ||
      ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(listener_);
    TORCH_CHECK(false, "LaneServer: cannot listen on ", host);
  }
  port_ = ntohs(addr.sin_port);
  accept_thread_ = std::thread([this] { accept_loop(); });
}

LaneServer::~LaneServer() { close(); }

void LaneServer::close() {
  if (closed_.exchange(true)) return;
  ::shutdown(listener_, SHUT_RDWR);
  ::close(listener_);
  {
    std::lock_guard<std::mutex> guard(mutex_);
    for (int fd : connections_) ::shutdown(fd, SHUT_RDWR);  // wakes their threads; each closes its own
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

void LaneServer::accept_loop() {
  while (!closed_) {
    const int fd = ::accept(listener_, nullptr, nullptr);
    if (fd < 0) {
      if (closed_) return;
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::lock_guard<std::mutex> guard(mutex_);
    if (closed_) {
      ::close(fd);
      return;
    }
    connections_.push_back(fd);
    workers_.emplace_back([this, fd] { serve(fd); });
  }
}

void LaneServer::serve(int fd) {
  omp_set_num_threads(1);  // a call is one row's attention: this thread alone, beside the instance's own team
  while (!closed_ && serve_one(fd)) {
  }
  std::lock_guard<std::mutex> guard(mutex_);
  connections_.erase(std::find(connections_.begin(), connections_.end(), fd));
  ::close(fd);
}

bool LaneServer::serve_one(int fd) {
  RequestHeader head{};
  if (!read_all(fd, &head, sizeof(head)) || head.magic != kMagic) return false;
  const LanePool& pool = *pool_;
  const int64_t hk = pool.kv_heads(), d = pool.head_dim(), bs = pool.block_size(), slots = pool.blocks() * bs;
  if (head.items < 1 || head.items > kMaxItems || head.width < 1 || head.width > pool.blocks()) return false;
  const int64_t n = head.items, width = head.width, elem = c10::elementSize(pool.dtype());
  std::vector<int64_t> ints(n * (2 + width));
  std::vector<char> rows(n * (num_heads_ + 2 * hk) * d * elem);
  if (!read_all(fd, ints.data(), ints.size() * sizeof(int64_t)) || !read_all(fd, rows.data(), rows.size())) return false;

  const auto started = std::chrono::steady_clock::now();
  std::string error;
  std::vector<at::Tensor> partial;
  try {
    TORCH_CHECK(head.layer >= 0 && head.layer < pool.layers(), "layer ", head.layer, " out of range");
    const int64_t* context = ints.data();
    const int64_t* slot = ints.data() + n;
    const int64_t* table = ints.data() + 2 * n;
    std::vector<int64_t> written;  // the items that bring a new row
    for (int64_t i = 0; i < n; ++i) {  // all of a call is checked before any of it is written
      TORCH_CHECK(slot[i] >= -1 && slot[i] < slots, "slot ", slot[i], " out of range");
      TORCH_CHECK(context[i] >= 0 && context[i] <= width * bs, "a context exceeds its blocks");
      for (int64_t j = 0; j < (context[i] + bs - 1) / bs; ++j)
        TORCH_CHECK(table[i * width + j] >= 0 && table[i * width + j] < pool.blocks(), "block id out of range");
      if (slot[i] >= 0) written.push_back(i);
    }
    const auto longs = at::TensorOptions().dtype(at::kLong);
    const auto wire = at::TensorOptions().dtype(pool.dtype());
    char* k_new = rows.data() + n * num_heads_ * d * elem;
    char* v_new = k_new + n * hk * d * elem;
    if (!written.empty()) {
      at::Tensor k = at::from_blob(k_new, {n, hk, d}, wire), v = at::from_blob(v_new, {n, hk, d}, wire);
      at::Tensor at_slots = at::from_blob(const_cast<int64_t*>(slot), {n}, longs);
      if (static_cast<int64_t>(written.size()) < n) {
        const at::Tensor index = at::tensor(written, longs);
        k = k.index_select(0, index), v = v.index_select(0, index), at_slots = at_slots.index_select(0, index);
      }
      pool_->write(head.layer, k, v, at_slots);
    }
    const at::Tensor q = at::from_blob(rows.data(), {n, num_heads_, d}, wire);
    partial = pool_->partial(head.layer, q, at::from_blob(ints.data() + 2 * n, {n, width}, longs),
                             at::from_blob(ints.data(), {n}, longs), head.scale);
  } catch (const std::exception& e) {
    error = e.what();
    error = error.substr(0, error.find('\n'));  // the first line: c10 appends a C++ backtrace
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  AnswerHeader answer{kMagic, error.empty() ? 0 : 1, seconds};
  std::vector<iovec> parts{{&answer, sizeof(answer)}};
  int32_t length = static_cast<int32_t>(error.size());
  if (error.empty()) {
    for (const at::Tensor& t : partial) parts.push_back({t.data_ptr(), static_cast<size_t>(t.nbytes())});
  } else {
    parts.push_back({&length, sizeof(length)});
    parts.push_back({error.data(), error.size()});
  }
  return write_all(fd, std::move(parts));
}

}  // namespace kvops

// A debtor's end of a creditor's decode lane (lane_server.cpp): writes a call straight from the
// rows' memory and reads the answer into one float32 buffer, without the GIL. Waiting for the
// answer polls without sleeping for up to spin_us microseconds first, as the server does for calls:
// an answer is a few tens of microseconds away, less than putting a thread to sleep and waking it.
// The wire format is the server's (lane_server.cpp).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "common/check.h"
#include "lane_client.h"
#include "lane_server.h"
#include "lane_transport.h"

namespace kvops {

namespace {

constexpr size_t kRingBytes = size_t{1} << 20;  // each way: larger than a socket's buffer

// Connects fd within timeout_ms: 0, or the errno of a failed connect. A non-blocking connect waited
// for in poll(): a host that drops the handshake fails after the timeout rather than the system's (minutes).
int connect_within(int fd, const sockaddr* addr, socklen_t len, int timeout_ms) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) return errno;
  if (::connect(fd, addr, len) != 0) {
    if (errno != EINPROGRESS) return errno;
    pollfd ready{fd, POLLOUT, 0};
    int polled;
    do {
      polled = ::poll(&ready, 1, timeout_ms);
    } while (polled < 0 && errno == EINTR);
    if (polled == 0) return ETIMEDOUT;
    int error = 0;
    socklen_t size = sizeof(error);
    if (polled < 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size) != 0) return errno;
    if (error != 0) return error;
  }
  return ::fcntl(fd, F_SETFL, flags) == 0 ? 0 : errno;  // blocking again: sends block, reads poll
}

}  // namespace

LaneClient::LaneClient(const std::string& host, int64_t port, const std::string& local_name, double timeout,
                       int64_t spin_us, bool shared_memory, const std::string& secret)
    : timeout_ms_(static_cast<int>(timeout * 1000)), spin_us_(spin_us) {
  KV_CHECK(timeout > 0 && spin_us >= 0 && spin_us <= 100000, "LaneClient: bad timeout or spin_us");
  KV_CHECK(secret.size() >= 16, "LaneClient: the cluster secret holds 16 bytes or more");
#ifdef __linux__
  if (!local_name.empty() && local_name.size() < sizeof(sockaddr_un::sun_path) - 1) {  // the server's abstract socket
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path + 1, local_name.data(), local_name.size());
    fd_ = ::socket(AF_UNIX, SOCK_STREAM, 0);
    const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + local_name.size());
    if (fd_ >= 0 && ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), len) == 0) {
      try {
        connect_handshake(fd_, secret, timeout_ms_);  // before the shared memory goes anywhere
        if (shared_memory) link_ = offer_shared_rings(fd_, kRingBytes, timeout_ms_);
      } catch (...) {
        close();
        throw;
      }
      if (link_ == nullptr) link_ = socket_transport(fd_);
      return;
    }
    close();  // another machine's name, or gone: TCP below
  }
#endif
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  KV_CHECK(port > 0 && port < 65536 && ::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) == 1,
              "LaneClient: not an IPv4 address and port: ", host, ":", port);
  fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  KV_CHECK(fd_ >= 0, "LaneClient: cannot open a socket");
  const int reason = connect_within(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr), timeout_ms_);
  if (reason != 0) {
    close();
    KV_CHECK(false, "LaneClient: cannot reach ", host, ":", port, ": ",
                reason == ETIMEDOUT ? "no answer within the timeout" : std::strerror(reason));
  }
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  try {
    connect_handshake(fd_, secret, timeout_ms_);
  } catch (...) {
    close();
    throw;
  }
  local_ = false;
  link_ = socket_transport(fd_);
}

std::string LaneClient::transport() const {
  return !local_ ? "tcp" : (link_ != nullptr && link_->shared_memory() ? "shared memory" : "unix socket");
}

LaneClient::~LaneClient() { close(); }

void LaneClient::close() {
  link_.reset();
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void LaneClient::send(int64_t layer, double scale, const std::vector<int64_t>& ints, int64_t items, const void* q,
                      size_t q_bytes, const void* k_new, const void* v_new, size_t row_bytes) {
  KV_CHECK(fd_ >= 0, "LaneClient: closed");
  const int64_t n = items, nints = static_cast<int64_t>(ints.size());
  KV_CHECK(n > 0, "LaneClient: q is contiguous [items, heads, head_dim]");
  KV_CHECK(nints > 2 * n && (nints - 2 * n) % n == 0, "LaneClient: ints are [contexts, slots, tables] of the items");
  KV_CHECK((k_new == nullptr) == (v_new == nullptr), "LaneClient: k_new and v_new come together");
  if (k_new == nullptr && zeros_.size() < row_bytes) zeros_.resize(row_bytes, 0);
  LaneRequestHeader head{kLaneMagic, static_cast<int32_t>(layer), static_cast<int32_t>(n),
                         static_cast<int32_t>((nints - 2 * n) / n), scale};
  iovec parts[5] = {{&head, sizeof(head)},
                    {const_cast<int64_t*>(ints.data()), ints.size() * sizeof(int64_t)},
                    {const_cast<void*>(q), q_bytes},
                    {k_new != nullptr ? const_cast<void*>(k_new) : zeros_.data(), row_bytes},
                    {v_new != nullptr ? const_cast<void*>(v_new) : zeros_.data(), row_bytes}};
  KV_CHECK(link_->send_all(parts, 5), "LaneClient: sending failed: ", std::strerror(errno));
  ++outstanding_;
}

void LaneClient::read_exactly(void* buffer, size_t bytes) {
  const ssize_t got = receive_exactly(*link_, buffer, bytes, spin_us_, timeout_ms_);
  KV_CHECK(got != -2, "LaneClient: no answer within the timeout");
  KV_CHECK(got > 0, "LaneClient: the creditor closed the connection");
}

LaneAnswer LaneClient::receive(int64_t items, int64_t num_heads, int64_t head_dim, float* floats) {
  KV_CHECK(fd_ >= 0 && outstanding_ > 0, "LaneClient: no call is waiting for an answer");
  char* payload = reinterpret_cast<char*>(floats);
  const size_t size = static_cast<size_t>(items * num_heads * (head_dim + 2)) * sizeof(float);
  // The header and, when this is the only call in flight (nothing of a later answer can follow it),
  // as much of a successful answer's payload as has arrived: usually the whole answer in one read.
  LaneAnswerHeader head{};
  iovec parts[2] = {{&head, sizeof(head)}, {payload, outstanding_ == 1 ? size : 0}};
  --outstanding_;
  const ssize_t got = link_->receive_some(parts, 2, spin_us_, timeout_ms_);
  KV_CHECK(got != -2, "LaneClient: no answer within the timeout");
  KV_CHECK(got > 0, "LaneClient: the creditor closed the connection");
  size_t have = static_cast<size_t>(got);
  if (have < sizeof(head)) {
    read_exactly(reinterpret_cast<char*>(&head) + have, sizeof(head) - have);
    have = sizeof(head);
  }
  have -= sizeof(head);  // payload bytes already read
  KV_CHECK(head.magic == kLaneMagic, "LaneClient: the answer is malformed");
  if (head.status != 0) {  // int32 length, then the message; part of it may be in the payload buffer
    std::string bytes(payload, have);
    if (bytes.size() < sizeof(int32_t)) {
      bytes.resize(sizeof(int32_t));
      read_exactly(bytes.data() + have, sizeof(int32_t) - have);
    }
    int32_t length = 0;
    std::memcpy(&length, bytes.data(), sizeof(length));
    KV_CHECK(length >= 0 && length < (1 << 20) && bytes.size() <= sizeof(length) + length,
                "LaneClient: the answer is malformed");
    std::string message = bytes.substr(sizeof(length));
    const size_t known = message.size();
    message.resize(static_cast<size_t>(length));
    read_exactly(message.data() + known, message.size() - known);
    if (message.empty()) message = "the creditor failed the call";
    return {head.seconds, message};
  }
  read_exactly(payload + have, size - have);
  return {head.seconds, std::string()};
}

}  // namespace kvops

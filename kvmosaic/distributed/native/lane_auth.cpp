// The decode lane's handshake (lane_auth.h): the wire format of kvmosaic/distributed/auth.py with the
// lane's label, so either end may be Python (the tests' fake creditors are).
//   server -> client  "KVMAUTH1", nonce_s (32 bytes)
//   client -> server  nonce_c (32), HMAC(secret, label | "client" | nonce_s | nonce_c)
//   server -> client  HMAC(secret, label | "server" | nonce_s | nonce_c)
#include "lane_auth.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "hmac_sha256.h"

namespace kvops {

namespace {

constexpr char kMagic[8] = {'K', 'V', 'M', 'A', 'U', 'T', 'H', '1'};
constexpr char kLabel[] = "kvmosaic-lane";
constexpr size_t kNonce = 32, kMac = 32;
using Clock = std::chrono::steady_clock;

void random_bytes(uint8_t* out, size_t size) {
  while (size > 0) {
    const ssize_t got = ::getrandom(out, size, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw std::runtime_error("no random bytes for the handshake");
    out += got, size -= static_cast<size_t>(got);
  }
}

Digest proof(const std::string& secret, const char* role, const uint8_t* nonce_s, const uint8_t* nonce_c) {
  return hmac_sha256(secret.data(), secret.size(),
                     {{kLabel, sizeof(kLabel) - 1}, {role, std::strlen(role)}, {nonce_s, kNonce}, {nonce_c, kNonce}});
}

// Fills buffer before the deadline: "" on success, else why not.
std::string read_until(int fd, void* buffer, size_t size, Clock::time_point deadline) {
  char* p = static_cast<char*>(buffer);
  while (size > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return "no handshake within the timeout";
    pollfd ready{fd, POLLIN, 0};
    const int polled = ::poll(&ready, 1, static_cast<int>(left));
    if (polled < 0 && errno == EINTR) continue;
    if (polled == 0) return "no handshake within the timeout";
    const ssize_t got = polled < 0 ? -1 : ::recv(fd, p, size, MSG_DONTWAIT);
    if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (got == 0) return "the peer closed the connection during the handshake";
    if (got < 0) return std::string("the handshake failed: ") + std::strerror(errno);
    p += got, size -= static_cast<size_t>(got);
  }
  return "";
}

bool write_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t sent = ::send(fd, p, size, MSG_NOSIGNAL);  // a closed peer is an error, not SIGPIPE
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    p += sent, size -= static_cast<size_t>(sent);
  }
  return true;
}

}  // namespace

bool accept_handshake(int fd, const std::string& secret, int timeout_ms, std::string* why) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  uint8_t challenge[sizeof(kMagic) + kNonce];
  std::memcpy(challenge, kMagic, sizeof(kMagic));
  uint8_t* nonce_s = challenge + sizeof(kMagic);
  try {
    random_bytes(nonce_s, kNonce);
  } catch (const std::exception& e) {
    *why = e.what();
    return false;
  }
  if (!write_all(fd, challenge, sizeof(challenge))) {
    *why = "the peer closed the connection during the handshake";
    return false;
  }
  uint8_t answer[kNonce + kMac];
  *why = read_until(fd, answer, sizeof(answer), deadline);
  if (!why->empty()) return false;
  const Digest expected = proof(secret, "client", nonce_s, answer);
  if (!constant_time_equal(expected.data(), answer + kNonce, kMac)) {
    *why = "the peer does not hold the cluster secret";
    return false;
  }
  const Digest mine = proof(secret, "server", nonce_s, answer);
  if (!write_all(fd, mine.data(), mine.size())) {
    *why = "the peer closed the connection during the handshake";
    return false;
  }
  return true;
}

void connect_handshake(int fd, const std::string& secret, int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  uint8_t challenge[sizeof(kMagic) + kNonce];
  std::string why = read_until(fd, challenge, sizeof(challenge), deadline);
  if (!why.empty()) throw std::runtime_error("LaneClient: " + why);
  if (std::memcmp(challenge, kMagic, sizeof(kMagic)) != 0)
    throw std::runtime_error("LaneClient: the peer is not a kvmosaic data-plane server");
  const uint8_t* nonce_s = challenge + sizeof(kMagic);
  uint8_t answer[kNonce + kMac];
  random_bytes(answer, kNonce);
  const Digest mine = proof(secret, "client", nonce_s, answer);
  std::memcpy(answer + kNonce, mine.data(), kMac);
  if (!write_all(fd, answer, sizeof(answer)))
    throw std::runtime_error("LaneClient: the creditor closed the connection during the handshake");
  uint8_t theirs[kMac];
  why = read_until(fd, theirs, sizeof(theirs), deadline);
  if (!why.empty()) throw std::runtime_error("LaneClient: " + why);
  const Digest expected = proof(secret, "server", nonce_s, answer);
  if (!constant_time_equal(expected.data(), theirs, kMac))
    throw std::runtime_error("LaneClient: the creditor does not hold the cluster secret");
}

std::string peer_name(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "an unknown peer";
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
    return std::string(text) + ":" + std::to_string(ntohs(in->sin_port));
  }
#ifdef __linux__
  if (addr.ss_family == AF_UNIX) {
    ucred cred{};
    socklen_t size = sizeof(cred);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &size) == 0)
      return "the Unix socket's peer pid " + std::to_string(cred.pid) + " uid " + std::to_string(cred.uid);
  }
#endif
  return "a Unix socket peer";
}

}  // namespace kvops

// The cluster handshake on the decode lane's connections (lane_auth.cpp), TCP and Unix socket alike:
// the same HMAC-SHA256 challenge and response as kvmosaic/distributed/auth.py, run before the
// shared memory is offered or any call is read. Compiled into both extensions with the server.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace kvops {

// What a lane server admits: peers holding secret (16+ bytes) that finish the handshake within
// handshake_timeout_ms, sending calls of at most max_message_bytes.
struct LaneAccess {
  std::string secret;
  int handshake_timeout_ms;
  int64_t max_message_bytes;
};

// From the bindings' arguments (seconds); a timeout outside (0, 1 hour] gives 0, which the server refuses.
inline LaneAccess lane_access(std::string secret, double handshake_timeout, int64_t max_message_bytes) {
  const bool ok = handshake_timeout > 0 && handshake_timeout <= 3600;
  return {std::move(secret), ok ? static_cast<int>(handshake_timeout * 1000) : 0, max_message_bytes};
}

// The listening end on a new connection: challenges the peer, checks its proof, proves itself.
// false (and *why) when the peer fails or does not finish in time; the caller closes the connection.
bool accept_handshake(int fd, const std::string& secret, int timeout_ms, std::string* why);

// The connecting end: answers the challenge and checks the server's proof before anything else is
// sent. Throws std::runtime_error when the server is not one of the cluster's or does not answer in time.
void connect_handshake(int fd, const std::string& secret, int timeout_ms);

// "address:port" of a TCP peer, "pid N uid M" of a Unix socket's, for a log line.
std::string peer_name(int fd);

}  // namespace kvops

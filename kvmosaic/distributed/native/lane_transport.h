// How the decode lane's two ends move bytes (lane_transport.cpp): over the connection's socket, or,
// between two processes of one machine, through a pair of one-way byte rings in memory they share.
//
// Over the Unix socket a decode call's round trip cost ~9 us of system calls and hand-overs (two
// sends, two receives) against ~12 us for the row's attention itself (AVX-512 host, 256 keys). Through
// the rings a call is a copy in, a copy out and two cache-line hand-overs. The debtor creates the
// shared memory (a memfd) and passes it to the creditor over the Unix socket they connected through;
// the socket then stays open and idle, and its hang-up is how each end learns the other has gone.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace kvops {

class LaneTransport {
 public:
  virtual ~LaneTransport() = default;
  // At least one byte into parts: polls for up to spin_us microseconds, then sleeps for up to timeout_ms
  // (-1: no limit). The bytes read, 0 when the peer has gone, -1 on an error, -2 on a timeout.
  virtual ssize_t receive_some(iovec* parts, int count, int64_t spin_us, int timeout_ms) = 0;
  // Every byte of parts (may rewrite parts); false when the peer has gone or on an error.
  virtual bool send_all(iovec* parts, size_t count) = 0;
  virtual bool shared_memory() const = 0;
};

// The connection's socket itself (over the two functions below).
std::unique_ptr<LaneTransport> socket_transport(int fd);

// Reads what has arrived on fd into parts, at least one byte: polls without sleeping for up to
// spin_us microseconds, then sleeps in poll() for up to timeout_ms (-1: no limit). Returns the bytes
// read, 0 when the peer closed, -1 on an error, -2 on a timeout.
ssize_t receive_some(int fd, iovec* parts, int count, int64_t spin_us, int timeout_ms);
// Sends every byte of parts (a closed peer is an error, not SIGPIPE); false on an error.
bool send_all(int fd, iovec* parts, size_t count);

// Fills buffer from transport, waiting for each piece as receive_some does: 1, or receive_some's
// 0 / -1 / -2.
ssize_t receive_exactly(LaneTransport& transport, void* buffer, size_t bytes, int64_t spin_us, int timeout_ms);

// The debtor's side: creates the rings (ring_bytes each way, a power of two), passes them to the
// server over the Unix socket fd in a hello message and waits up to timeout_ms for its consent. nullptr
// when there is no shared memory here or the server declined; the socket then carries the calls.
// Throws when the socket failed (the connection is unusable).
std::unique_ptr<LaneTransport> offer_shared_rings(int fd, size_t ring_bytes, int timeout_ms);

// The server's side of a connection: reads its first request header, taking the rings when it is a
// hello (and answering it). Returns the transport for the calls and, in *first, the first call's
// header, or nullptr when the connection closed or failed first.
struct LaneRequestHeader;
std::unique_ptr<LaneTransport> accept_transport(int fd, LaneRequestHeader* first, int64_t spin_us);

}  // namespace kvops

// The decode lane's transports (lane_transport.h): the socket, and the shared rings of one machine.
//
// A ring is one-way: its writer owns `head` (bytes written so far), its reader `tail` (bytes read),
// both only growing; the bytes live at their offsets modulo the ring's size. A reader with nothing
// to read (or a writer with no room) polls, then sleeps on a futex word its peer bumps after each
// move. The sleeper raises a flag before its last look, so the peer makes the wake-up system call
// only when someone sleeps; all four are sequentially consistent, so one side always sees the other.
// The headers live in memory the peer can write, so neither end trusts them: a head or tail that
// claims more than a ring holds is an error, and a copy never leaves the ring's bytes. The server
// maps only a memfd sealed against shrinking (a shrunk mapping would fault on its next access).
#include "lane_transport.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>

#ifdef __linux__
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#endif

#include "common/check.h"
#include "lane_server.h"

namespace kvops {

namespace {

class SocketTransport final : public LaneTransport {
 public:
  explicit SocketTransport(int fd) : fd_(fd) {}
  ssize_t receive_some(iovec* parts, int count, int64_t spin_us, int timeout_ms) override {
    return kvops::receive_some(fd_, parts, count, spin_us, timeout_ms);
  }
  bool send_all(iovec* parts, size_t count) override { return kvops::send_all(fd_, parts, count); }
  bool shared_memory() const override { return false; }

 private:
  int fd_;
};

}  // namespace

std::unique_ptr<LaneTransport> socket_transport(int fd) { return std::make_unique<SocketTransport>(fd); }

ssize_t receive_exactly(LaneTransport& transport, void* buffer, size_t bytes, int64_t spin_us, int timeout_ms) {
  char* p = static_cast<char*>(buffer);
  while (bytes > 0) {
    iovec part{p, bytes};
    const ssize_t got = transport.receive_some(&part, 1, spin_us, timeout_ms);
    if (got <= 0) return got;
    p += got;
    bytes -= static_cast<size_t>(got);
  }
  return 1;
}

namespace {

constexpr uint32_t kShmHelloMagic = 0x534d564b;  // "KVMS": a hello that brings shared rings
constexpr size_t kMinRing = 4096, kMaxRing = size_t{1} << 26;
constexpr size_t kRingsOffset = 4096;  // the two rings' headers fill the first page
constexpr int kSleepSliceMs = 20;      // a sleeper looks at the socket (has the peer gone?) this often

struct alignas(64) RingHeader {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
  alignas(64) std::atomic<uint32_t> data_event;  // bumped after head moves; the reader sleeps on it
  std::atomic<uint32_t> reader_sleeping;
  alignas(64) std::atomic<uint32_t> room_event;  // bumped after tail moves; the writer sleeps on it
  std::atomic<uint32_t> writer_sleeping;
};
static_assert(2 * sizeof(RingHeader) <= kRingsOffset, "the rings' headers fill one page");
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "atomics shared between processes must be lock-free");

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Whether the socket beside the rings says the peer has gone (it carries nothing else after the hello).
bool peer_gone(int fd) {
  pollfd ready{fd, POLLIN, 0};
  return ::poll(&ready, 1, 0) > 0;  // readable: the end of the stream, or an error (POLLHUP / POLLERR)
}

#ifdef __linux__

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, int ms) {
  timespec wait{ms / 1000, (ms % 1000) * 1000000L};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &wait, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void notify(std::atomic<uint32_t>& event, std::atomic<uint32_t>& sleeping) {
  event.fetch_add(1);
  if (sleeping.load()) futex_wake(&event);
}

// Waits until ready(): polls for spin_us, then sleeps in slices, looking at the socket after each.
// 1 when ready, 0 when the peer has gone, -2 after timeout_ms (-1: no limit).
template <typename Ready>
int wait_until(Ready ready, std::atomic<uint32_t>& event, std::atomic<uint32_t>& sleeping, int fd, int64_t spin_us,
               int timeout_ms) {
  if (ready()) return 1;
  const auto start = std::chrono::steady_clock::now();
  const auto spin_until = start + std::chrono::microseconds(spin_us);
  while (std::chrono::steady_clock::now() < spin_until) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return 1;
      cpu_relax();
    }
    ::sched_yield();  // a thread waiting for this core (the peer, on a busy host) runs first
  }
  while (true) {
    int slice = kSleepSliceMs;
    if (timeout_ms >= 0) {
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
      if (waited.count() >= timeout_ms) return ready() ? 1 : -2;
      slice = std::min<int>(slice, static_cast<int>(timeout_ms - waited.count()));
    }
    const uint32_t seen = event.load();
    sleeping.store(1);
    if (ready()) {
      sleeping.store(0);
      return 1;
    }
    futex_wait(&event, seen, slice);
    sleeping.store(0);
    if (ready()) return 1;
    if (peer_gone(fd)) return 0;
  }
}

class Ring {
 public:
  Ring(RingHeader* header, char* data, size_t size) : h_(header), data_(data), size_(size) {}

  // Copies what has arrived (up to the parts' size) into parts, after waiting for at least one byte.
  ssize_t read_some(iovec* parts, int count, int fd, int64_t spin_us, int timeout_ms) {
    const uint64_t tail = h_->tail.load(std::memory_order_relaxed);
    const int waited = wait_until([&] { return h_->head.load() != tail; }, h_->data_event, h_->reader_sleeping, fd,
                                  spin_us, timeout_ms);
    if (waited != 1) return waited;
    uint64_t at = tail;
    const uint64_t end = h_->head.load();
    if (end - tail > size_) return -1;  // more than the ring holds: the peer wrote garbage into the header
    for (int i = 0; i < count && at < end; ++i) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(parts[i].iov_len, end - at));
      copy_out(at, static_cast<char*>(parts[i].iov_base), n);
      at += n;
    }
    h_->tail.store(at);
    notify(h_->room_event, h_->writer_sleeping);
    return static_cast<ssize_t>(at - tail);
  }

  // Writes every byte of parts, waiting for room as the reader frees it.
  bool write_all(const iovec* parts, size_t count, int fd) {
    uint64_t head = h_->head.load(std::memory_order_relaxed);
    size_t part = 0, offset = 0;
    while (part < count) {
      const uint64_t used = head - h_->tail.load();
      if (used > size_) return false;  // the peer wrote garbage into the header
      uint64_t room = size_ - used;
      if (room == 0) {
        const int waited = wait_until([&] { return h_->tail.load() + size_ != head; }, h_->room_event,
                                      h_->writer_sleeping, fd, 50, -1);
        if (waited != 1) return false;
        continue;
      }
      while (part < count && room > 0) {  // as much as fits, then one publication
        const size_t n = std::min<size_t>(parts[part].iov_len - offset, static_cast<size_t>(room));
        copy_in(head, static_cast<const char*>(parts[part].iov_base) + offset, n);
        head += n, room -= n, offset += n;
        if (offset == parts[part].iov_len) ++part, offset = 0;
      }
      h_->head.store(head);
      notify(h_->data_event, h_->reader_sleeping);
    }
    return true;
  }

 private:
  void copy_out(uint64_t at, char* to, size_t n) const {
    const size_t start = static_cast<size_t>(at & (size_ - 1)), first = std::min(n, size_ - start);
    std::memcpy(to, data_ + start, first);
    std::memcpy(to + first, data_, n - first);
  }
  void copy_in(uint64_t at, const char* from, size_t n) {
    const size_t start = static_cast<size_t>(at & (size_ - 1)), first = std::min(n, size_ - start);
    std::memcpy(data_ + start, from, first);
    std::memcpy(data_, from + first, n - first);
  }

  RingHeader* h_;
  char* data_;
  size_t size_;
};

// Both directions of one connection in one mapping: page 0 holds the headers (the debtor's sending
// ring first), then the debtor's ring's bytes, then the server's.
class SharedRings final : public LaneTransport {
 public:
  static size_t mapping_bytes(size_t ring_bytes) { return kRingsOffset + 2 * ring_bytes; }

  SharedRings(int fd, void* mapping, size_t ring_bytes, bool debtor)
      : fd_(fd), mapping_(mapping), bytes_(mapping_bytes(ring_bytes)),
        to_server_(header(0), data(ring_bytes, 0), ring_bytes),
        to_debtor_(header(1), data(ring_bytes, 1), ring_bytes),
        in_(debtor ? &to_debtor_ : &to_server_), out_(debtor ? &to_server_ : &to_debtor_) {}
  ~SharedRings() override { ::munmap(mapping_, bytes_); }

  ssize_t receive_some(iovec* parts, int count, int64_t spin_us, int timeout_ms) override {
    return in_->read_some(parts, count, fd_, spin_us, timeout_ms);
  }
  bool send_all(iovec* parts, size_t count) override { return out_->write_all(parts, count, fd_); }
  bool shared_memory() const override { return true; }

 private:
  RingHeader* header(int i) const { return reinterpret_cast<RingHeader*>(mapping_) + i; }
  char* data(size_t ring_bytes, int i) const { return static_cast<char*>(mapping_) + kRingsOffset + i * ring_bytes; }

  int fd_;  // the connection's socket: only to learn that the peer has gone
  void* mapping_;
  size_t bytes_;
  Ring to_server_, to_debtor_;
  Ring *in_, *out_;
};

bool valid_ring_size(size_t bytes) { return bytes >= kMinRing && bytes <= kMaxRing && (bytes & (bytes - 1)) == 0; }

// A memfd that cannot shrink (its pages stay while it is mapped); any other descriptor is refused.
bool sealed_against_shrinking(int memory) {
  const int seals = ::fcntl(memory, F_GET_SEALS);
  return seals >= 0 && (seals & F_SEAL_SHRINK) != 0;
}

void* map_shared(int memory, size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memory, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// A one-part message with room for a file descriptor riding along (SCM_RIGHTS).
struct FdMessage {
  FdMessage(void* data, size_t size) : part{data, size} {
    header.msg_iov = &part;
    header.msg_iovlen = 1;
    header.msg_control = control;
    header.msg_controllen = sizeof(control);
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;

  iovec part;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr header{};
};

// data with the descriptor passed; a hello is small enough for one write
bool send_with_fd(int fd, const void* data, size_t size, int passed) {
  FdMessage message(const_cast<void*>(data), size);
  cmsghdr* c = CMSG_FIRSTHDR(&message.header);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &passed, sizeof(int));
  ssize_t sent;
  do {
    sent = ::sendmsg(fd, &message.header, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  return sent == static_cast<ssize_t>(size);
}

// Reads into data (blocking) and takes a file descriptor that rode along, if any (else *passed is -1).
ssize_t receive_with_fd(int fd, void* data, size_t size, int* passed) {
  *passed = -1;
  FdMessage message(data, size);
  ssize_t got;
  do {
    got = ::recvmsg(fd, &message.header, MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  for (cmsghdr* c = CMSG_FIRSTHDR(&message.header); c != nullptr; c = CMSG_NXTHDR(&message.header, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) std::memcpy(passed, CMSG_DATA(c), sizeof(int));
  return got;
}

#endif  // __linux__

}  // namespace

std::unique_ptr<LaneTransport> offer_shared_rings(int fd, size_t ring_bytes, int timeout_ms) {
#ifdef __linux__
  if (!valid_ring_size(ring_bytes)) return nullptr;
  const size_t bytes = SharedRings::mapping_bytes(ring_bytes);
  const int memory = static_cast<int>(::syscall(SYS_memfd_create, "kvmosaic-lane", 3u /* CLOEXEC, ALLOW_SEALING */));
  if (memory < 0) return nullptr;
  // sealed at its size: the server maps nothing it could lose pages of
  const bool sized = ::ftruncate(memory, static_cast<off_t>(bytes)) == 0 &&
                     ::fcntl(memory, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0;
  void* mapping = sized ? map_shared(memory, bytes) : nullptr;
  if (mapping == nullptr) {
    ::close(memory);
    return nullptr;
  }
  const LaneRequestHeader hello{kShmHelloMagic, 0, 0, 0, static_cast<double>(ring_bytes)};
  const bool sent = send_with_fd(fd, &hello, sizeof(hello), memory);
  ::close(memory);  // the mapping and (once received) the server's descriptor keep it
  LaneAnswerHeader consent{};
  auto socket = socket_transport(fd);
  const ssize_t got = sent ? receive_exactly(*socket, &consent, sizeof(consent), 0, timeout_ms) : -1;
  if (got != 1 || consent.magic != kLaneMagic) {
    ::munmap(mapping, bytes);
    KV_CHECK(false, "LaneClient: the creditor did not answer the hello",
                got == -2 ? " within the timeout" : "");
  }
  if (consent.status != 0) {
    ::munmap(mapping, bytes);
    return nullptr;
  }
  return std::make_unique<SharedRings>(fd, mapping, ring_bytes, true);
#else
  (void)fd, (void)ring_bytes, (void)timeout_ms;
  return nullptr;
#endif
}

std::unique_ptr<LaneTransport> accept_transport(int fd, LaneRequestHeader* first, int64_t spin_us) {
  std::unique_ptr<LaneTransport> socket = socket_transport(fd);
#ifdef __linux__
  int passed = -1;
  const ssize_t got = receive_with_fd(fd, first, sizeof(*first), &passed);
  if (got <= 0 || (static_cast<size_t>(got) < sizeof(*first) &&
                   receive_exactly(*socket, reinterpret_cast<char*>(first) + got, sizeof(*first) - got, 0, -1) != 1)) {
    if (passed >= 0) ::close(passed);
    return nullptr;
  }
  if (first->magic != kShmHelloMagic) {
    if (passed >= 0) ::close(passed);  // a descriptor nobody asked for
    return socket;
  }
  // checked as a double first: casting one out of size_t's range is undefined
  const bool in_range = first->scale >= static_cast<double>(kMinRing) && first->scale <= static_cast<double>(kMaxRing);
  const size_t ring_bytes = in_range ? static_cast<size_t>(first->scale) : 0;
  const size_t bytes = SharedRings::mapping_bytes(ring_bytes);
  struct stat info {};
  void* mapping = nullptr;
  if (passed >= 0 && valid_ring_size(ring_bytes) && sealed_against_shrinking(passed) && ::fstat(passed, &info) == 0 &&
      static_cast<size_t>(info.st_size) >= bytes)
    mapping = map_shared(passed, bytes);
  if (passed >= 0) ::close(passed);
  LaneAnswerHeader consent{kLaneMagic, mapping != nullptr ? 0 : 1, 0.0};
  iovec part{&consent, sizeof(consent)};
  if (!kvops::send_all(fd, &part, 1)) {
    if (mapping != nullptr) ::munmap(mapping, bytes);
    return nullptr;
  }
  std::unique_ptr<LaneTransport> transport = std::move(socket);
  if (mapping != nullptr) transport = std::make_unique<SharedRings>(fd, mapping, ring_bytes, false);
  if (receive_exactly(*transport, first, sizeof(*first), spin_us, -1) != 1) return nullptr;
  return transport;
#else
  if (receive_exactly(*socket, first, sizeof(*first), spin_us, -1) != 1) return nullptr;
  return socket;
#endif
}

}  // namespace kvops

// A team of threads that stays together through a whole sequence of kernels: one parallel region
// with a barrier between kernels, instead of one fork and join per kernel.
//
// A single-stream decode step of a small model is ~10 small kernels per layer between the weight
// products; with a fork and join each, and the allocations and checks of ATen calls between them,
// the second thread sat idle for ~40% of the step (perf, default model, Q4_1). Kernels that can run
// in a team take a [begin, end) share of their work items, so parallel_for and a team run the
// same code.
//
// The barrier between kernels is the team's own (Barrier below) rather than OpenMP's: a decode step
// of the default model had ~270 of them (~150 now: DecodeRun in layer_stack.h). Measured on the
// default model, Q4_1, one stream, AVX-512 host (Zen 4, 2 threads), by adding 9,000 empty barriers to
// a step: ~0.2 us each for OpenMP's, ~0.05 us for this one. End to end (benchmarks/team_barrier.py) the step's decode rate moved by
// 0.96-1.05x, own / OpenMP, over four runs of 8-12 interleaved rounds: within this shared host's
// noise. KVMOSAIC_TEAM_BARRIER=omp (or OMP_WAIT_POLICY=passive) keeps OpenMP's.
#pragma once

#include <omp.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "common/parallel.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace kvops {

// Items [begin, end) of one of `parts` workers: at::parallel_for's contiguous split.
struct Share {
  int64_t begin, end;
};

inline Share share_of(int64_t items, int part, int parts) {
  const int64_t chunk = (items + parts - 1) / parts;
  return {std::min(items, part * chunk), std::min(items, (part + 1) * chunk)};
}

// A barrier of a fixed team: each thread publishes how many barriers it has reached in a cache line of
// its own and waits until every other thread has reached as many. Nothing is shared for writing, so
// an arrival is one cache line moving to each waiter, and every thread leaves as soon as it sees the
// last one. A waiter spins with pause, then yields the CPU, then sleeps briefly between looks, so an
// oversubscribed host (more busy threads than cores) is not left spinning.
class Barrier {
 public:
  explicit Barrier(int threads) : arrivals_(new Arrival[threads]), threads_(threads) {}
  // thread `id` arrives at its `count`-th barrier (1, 2, ...) and waits for the others
  void wait(int id, uint64_t count) const {
    arrivals_[id].count.store(count, std::memory_order_release);
    for (int j = 0; j < threads_; ++j) {
      if (j == id) continue;
      for (int looks = 0; arrivals_[j].count.load(std::memory_order_acquire) < count;
           looks = std::min(looks + 1, kSpins + kYields))
        pause(looks);
    }
  }

 private:
  struct alignas(64) Arrival {
    std::atomic<uint64_t> count{0};
  };
  static void pause(int looks) {
    if (looks < kSpins) {
#if defined(__x86_64__) || defined(_M_X64)
      _mm_pause();
#endif
    } else if (looks < kSpins + kYields) {
      sched_yield();
    } else {
      const timespec nap{0, 20000};  // 20 us
      nanosleep(&nap, nullptr);
    }
  }
  static constexpr int kSpins = 4096, kYields = 64;
  std::unique_ptr<Arrival[]> arrivals_;
  int threads_;
};

// Whether a team uses Barrier (true) or OpenMP's barrier: see the top of this file.
inline bool own_barrier() {
  auto lower = [](const char* v) {
    std::string s = v == nullptr ? "" : v;
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  };
  return lower(std::getenv("KVMOSAIC_TEAM_BARRIER")) != "omp" && lower(std::getenv("OMP_WAIT_POLICY")) != "passive";
}

class Team {
 public:
  // barrier: the team's own, or null for OpenMP's
  Team(int id, int size, const Barrier* barrier) : id_(id), size_(size), barrier_(barrier) {}
  int id() const { return id_; }
  int size() const { return size_; }
  bool leader() const { return id_ == 0; }
  Share share(int64_t items) const { return share_of(items, id_, size_); }
  // Every thread of the team waits here until all have arrived (their writes are then visible).
  void sync() const {
    if (barrier_ != nullptr) {
      barrier_->wait(id_, ++passed_);
      return;
    }
#pragma omp barrier
  }

 private:
  int id_, size_;
  const Barrier* barrier_;
  mutable uint64_t passed_ = 0;  // barriers this thread has reached
};

// body(team) on every thread of a team of num_threads() threads (PyTorch's intra-op count). The body
// must not throw (an exception cannot leave a parallel region): check everything before.
template <typename Body>
void run_team(const Body& body) {
  const int threads = num_threads();
  const Barrier barrier(threads);
  const bool own = own_barrier();
#pragma omp parallel num_threads(threads)
  {
    // a region given fewer threads than asked (nested in another one) keeps OpenMP's barrier
    const int size = omp_get_num_threads();
    body(Team(omp_get_thread_num(), size, own && size == threads ? &barrier : nullptr));
  }
}

}  // namespace kvops

// A team of threads that stays together through a whole sequence of kernels: one parallel region
// with a barrier between kernels, instead of one fork and join per kernel.
//
// A single-stream decode step of a small model is ~10 small kernels per layer between the weight
// products; with a fork and join each, and the allocations and checks of ATen calls between them,
// the second thread sat idle for ~40% of the step (perf, default model, Q4_1). Kernels that can run
// in a team take a [begin, end) share of their work items, so at::parallel_for and a team run the
// same code.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace kvops {

// Items [begin, end) of one of `parts` workers: at::parallel_for's contiguous split.
struct Share {
  int64_t begin, end;
};

inline Share share_of(int64_t items, int part, int parts) {
  const int64_t chunk = (items + parts - 1) / parts;
  return {std::min(items, part * chunk), std::min(items, (part + 1) * chunk)};
}

class Team {
 public:
  Team(int id, int size) : id_(id), size_(size) {}
  int id() const { return id_; }
  int size() const { return size_; }
  bool leader() const { return id_ == 0; }
  Share share(int64_t items) const { return share_of(items, id_, size_); }
  // Every thread of the team waits here until all have arrived (their writes are then visible).
  void sync() const {
#pragma omp barrier
  }

 private:
  int id_, size_;
};

// body(team) on every thread of a team of at::get_num_threads() threads. The body must not throw
// (an exception cannot leave a parallel region): check everything before.
template <typename Body>
void run_team(const Body& body) {
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  body(Team(omp_get_thread_num(), omp_get_num_threads()));
}

}  // namespace kvops

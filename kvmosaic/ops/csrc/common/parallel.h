// Thread parallelism for kernel files, without the PyTorch headers. The kernels run on PyTorch's
// intra-op pool so that torch.set_num_threads governs them and they never oversubscribe it: the
// binding files define parallel_range and num_threads with at::parallel_for and at::get_num_threads
// (bind/parallel_impl.h), and kernel files call parallel_for below, which has at::parallel_for's
// contract: body(begin, end) over contiguous chunks of at least `grain` items, inline when the range
// is small or already inside a parallel region; an exception in a chunk reaches the caller.
#pragma once

#include <cstdint>

namespace kvops {

using RangeBody = void (*)(const void* body, int64_t begin, int64_t end);

// defined by each extension's binding file
void parallel_range(int64_t begin, int64_t end, int64_t grain, RangeBody call, const void* body);
int num_threads();
int thread_num();

template <typename Body>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const Body& body) {
  parallel_range(
      begin, end, grain, [](const void* f, int64_t b, int64_t e) { (*static_cast<const Body*>(f))(b, e); }, &body);
}

}  // namespace kvops

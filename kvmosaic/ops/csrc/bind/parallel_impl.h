// The definitions behind common/parallel.h, on PyTorch's intra-op pool. Included by exactly one
// file of each extension (its binding file), which already has the PyTorch headers.
#pragma once

#include <ATen/Parallel.h>

#include "common/parallel.h"

namespace kvops {

void parallel_range(int64_t begin, int64_t end, int64_t grain, RangeBody call, const void* body) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { call(body, b, e); });
}

int num_threads() { return at::get_num_threads(); }

int thread_num() { return at::get_thread_num(); }

}  // namespace kvops

// Shared by the float KV-cache kernels, without the PyTorch headers: dtype helpers, the prefill work
// order, and one decode-attention call's batch as sizes and raw pointers. The tensor-facing side (the
// cache layout check, DecodeBatch from tensors, the extension's entry points) is bind/float_ops.h.
#pragma once

#include "common/check.h"
#include "common/paged.h"
#include "common/parallel.h"
#include "isa/vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace kvops {

inline float to_float(float x) { return x; }
inline float to_float(kvmosaic_vec::bf16 x) { return static_cast<float>(x); }

template <typename T>
inline void store(T* dst, float x) { *dst = static_cast<T>(x); }

// Prefill attention work item -> (KV head, block of query rows). A causal row block costs in
// proportion to its position and parallel_for gives each thread one contiguous range of items, so
// consecutive items alternate between the cheapest and the dearest remaining row blocks: every range
// gets a fair share (in head-major order the thread holding the last rows did ~1.4x the other's work).
inline void balanced_item(int64_t item, int64_t hk, int64_t row_blocks, int64_t* h, int64_t* rb) {
  const int64_t i = item / hk;
  *h = item % hk;
  *rb = i % 2 == 0 ? i / 2 : row_blocks - 1 - i / 2;
}

// One decode-attention call's tensors as sizes and raw pointers (both decode kernels unpack it):
// q and out [batch, hq, head_dim], the caches [blocks, block_size, hk, head_dim], block tables
// [batch, width], context lengths [batch].
template <typename T>
struct DecodeBatch {
  int64_t batch, hq, hk, group, width, block_size;
  const T* q;
  const T* k;
  const T* v;
  const int64_t* tables;
  const int64_t* lens;
  T* out;
  int64_t head_dim;
};

}  // namespace kvops

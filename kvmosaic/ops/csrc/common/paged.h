// The paged KV cache's addressing, shared by the kernels that read or write it in place.
#pragma once

#include <cstdint>

namespace kvops {

// The cache slot of token t of a sequence whose block table is `table` (blocks of block_size slots)
inline int64_t slot_of(const int64_t* table, int64_t t, int64_t block_size) {
  return table[t / block_size] * block_size + t % block_size;
}

}  // namespace kvops

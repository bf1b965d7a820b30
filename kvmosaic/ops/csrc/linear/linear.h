// The linear layers' whole-call entry points, without the PyTorch headers: a product of m activation
// rows over every output column, split between the threads (kvops::parallel_for). Weights are the
// plain views of stack_kernels.h; the binding side checks the tensors and builds them.
#pragma once

#include "layer/stack_kernels.h"

#include <cstdint>

namespace kvops {

// Layout sizes the binding side checks weights against.
constexpr int64_t kPackedBlock = 16;  // output columns per block of a packed float weight (gemm_kernel.h)
constexpr int64_t kQuantCols = 16;    // output columns per group of an interleaved quantized weight
constexpr int64_t kQuantBlock = 32;   // weights of a column under one q8 / q4 scale (and min)
constexpr int64_t kQ6Sub = 16;        // weights per q6 sub-block scale
constexpr int64_t kQ6Super = 256;     // weights per q6 super-block scale (and per q4k d, -dmin pair)

// x [m, w.k] (contiguous) times a packed weight into out [m, w.width()] (+ its bias; SwiGLU for a
// packed gate/up pair). T: float or kvmosaic_vec::bf16, the weight's dtype.
template <typename T>
void packed_product(const PackedWeight& w, const T* x, int64_t m, T* out);

// x [m, w.k] (contiguous) times a quantized weight into out [m, w.groups * 16] (+ its bias). T: float
// or kvmosaic_vec::bf16. From amx::kMinRows rows on a CPU with AMX tiles a q8 / q4 product runs on
// them, with float32 rows rounded to bf16 first; otherwise the rows are quantized to int8.
template <typename T>
void quantized_product(const QuantizedWeight& w, const T* x, int64_t m, T* out);

}  // namespace kvops

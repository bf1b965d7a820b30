// The per-layer kernels' whole-call entry points, without the PyTorch headers: the range forms of
// stack_kernels.h split between the threads (kvops::parallel_for). T: float or kvmosaic_vec::bf16.
// Shapes and dtypes are checked by the caller (the binding side).
#pragma once

#include "layer/stack_kernels.h"

#include <cstdint>

namespace kvops {

// Rotary of q and k of `rows` rows of a fused qkv projection, k and v written to their cache slots,
// the rotated q to step.q_out.
template <typename T>
void rope_rows(const RopeStep<T>& step, int64_t rows);

// rows x h: residual += delta (when not null), out = rms_norm(residual) * weight.
template <typename T>
void add_rms_norm_rows(T* residual, const T* delta, const T* weight, T* out, int64_t rows, int64_t h, float eps);

// silu(gate) * up of gate_up [rows, 2f] into out [rows, f].
template <typename T>
void silu_and_mul_rows(const T* gate_up, int64_t rows, int64_t f, T* out);

// out[r] = the first index of the largest value of row r of x [rows, n] (n > 0), as torch.argmax
// gives it (a NaN counts as the largest).
void argmax_of_rows(const float* x, int64_t rows, int64_t n, int64_t* out);

}  // namespace kvops

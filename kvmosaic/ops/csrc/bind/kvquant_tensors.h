// The quantized KV cache's tensors as the kernels take them (kvquant/kvquant.h): the record pools'
// checks, the thresholds as floats and the rows' dtype. Shared by the quantized extension's binding
// file and its decode lane (lane_bind.h).
#pragma once

#include <torch/extension.h>

#include "kvquant/kvquant.h"

namespace kvquant {

inline void check_pool(const at::Tensor& pool, const Format& f) {
  TORCH_CHECK(pool.scalar_type() == at::kByte && pool.is_contiguous() && pool.dim() == 3,
              "quantized KV pool must be contiguous uint8 [num_blocks, block_size, record_bytes]");
  TORCH_CHECK(pool.size(2) == f.record, "pool record size does not match the format");
}

// A layer's Oaken thresholds (outer_lo, inner_lo, inner_hi, outer_hi) as four float32s, or undefined
// when t does not hold four (int8 / int4: none); the caller keeps it while the kernels read it.
inline at::Tensor threshold_floats(const at::Tensor& t) {
  return t.numel() == 4 ? t.to(at::kFloat).contiguous() : at::Tensor();
}

inline const float* floats_or_null(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.data_ptr<float>() : nullptr;
}

inline Thresholds read_thresholds(const at::Tensor& t) { return thresholds_of(floats_or_null(threshold_floats(t))); }

inline bool is_row_dtype(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16; }

inline Rows rows_of(at::ScalarType dtype) { return dtype == at::kFloat ? Rows::kFloat32 : Rows::kBFloat16; }

}  // namespace kvquant

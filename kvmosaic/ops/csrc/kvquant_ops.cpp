// Kernels for the quantized KV cache (int8, int4, Oaken): quantize-and-write of new K/V rows,
// dequantization of whole blocks (prefill), and decode attention that reads the blocks in place
// (head_dim 64 / 128: 16-token tiles, codes widened in registers, on every ISA level; else a
// scalar kernel that dequantizes each head vector into a small buffer). The byte layout is the one documented in
// kvmosaic/quant/format.py and kvmosaic/quant/oaken.py; encoding matches the PyTorch reference bit
// for bit (same float32 operation order, fp16 rounding to nearest even, ties-to-even codes).
// This file binds the entry points; the kernels live in kvquant_encode.cpp, kvquant_decode.cpp and
// kvquant_decode_fast.cpp, the record format in kvquant_format.h.
#include "bindings.h"
#include "kvquant_format.h"

using kvops::no_gil;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_write", &quant_write, "quantize K/V rows into their cache slots");
  m.def("dequantize_blocks", &dequantize_blocks, no_gil, "dequantize whole KV blocks");
  m.def("quant_decode_attention", &quant_decode_attention, no_gil, "decode attention over quantized paged KV");
  m.def("quant_decode_attention_partial", &quant_decode_attention_partial, no_gil,
        "decode attention over quantized paged KV as a partial (out, reference, sum of exps) to merge");
}

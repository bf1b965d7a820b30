// bfloat16 prefill on Intel AMX tiles (Sapphire Rapids and later): the packed linear layers and the
// causal attention. A bf16 packed weight block ([K/2][16][2], gemm_kernel.h) is already the B
// operand of TDPBF16PS, so the same packed weights serve the AVX-512 micro-kernel (decode rows) and
// the tiles (many rows); so are the K and V tiles the bf16 prefill attention packs. Compiled into
// the avx512_bf16 level only; elsewhere supported() is false.
#pragma once

#include "layer/stack_kernels.h"
#include "isa/vec.h"

#include <cstdint>

namespace kvops::amx {

// Rows from which a bf16 or quantized product goes to the tiles (fewer rows read the weights more
// than they compute on them: the vector kernels stream them as fast).
constexpr int64_t kMinRows = 16;

// Compiled in, and the CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use them.
bool supported();
// Whether bf16 products of kMinRows rows or more use the tiles: the switch is on (default: supported(),
// unless the environment sets KVMOSAIC_AMX=0) and the kernels are not keeping batch invariance
// (common/batch_invariance.h: a row's product must not change with the rows beside it).
bool enabled();
// Switches the tiles on or off (on only where supported); returns the switch's new state.
bool set_enabled(bool on);
// Whether a product of m rows on this weight runs on the tiles.
bool takes(const PackedWeight& w, int64_t m);

// packed_panels for bf16 on the tiles: rows [0, m), panels [p0, p1). Call only where takes().
void bf16_panels(const PackedWeight& w, const kvmosaic_vec::bf16* x, int64_t m, kvmosaic_vec::bf16* out,
                 int64_t p0, int64_t p1);

// A q8 or q4 weight (stack_kernels.h) times bf16 rows on the tiles, from kMinRows rows: each thread
// dequantizes its groups to bf16 in the packed layout, one L2-sized chunk at a time, and runs every
// row against the chunk, so the conversion is paid once per call. (The default model's four layer
// products against the int8 dot products of qlinear.cpp, Intel AMX host, interleaved: Q4_1 1.0x at
// 16-24 rows, 1.6x at 32, 2.2-2.4x from 512; Q8_0 1.2-1.3x at 16-24, 2.2x at 32, 2.6-3.1x from 512.)
// q6 weights stay on the int8 dot products.
// `on`: enabled(), or that state as a caller read it once for a whole team of threads.
bool quantized_takes(const QuantizedWeight& w, int64_t m, bool on = enabled());
// rows [0, m) x 16-column groups [g0, g1) into out [m, groups * 16] (bf16, or float32 for float32
// rows, which the caller rounds to bf16 first). Call only where quantized_takes().
template <typename Out>
void quantized_bf16_groups(const QuantizedWeight& w, const kvmosaic_vec::bf16* x, int64_t m, Out* out, int64_t g0,
                           int64_t g1);

// Causal attention of a prefill chunk on the tiles, head_dim kAttentionDim: n query tokens at
// positions [start, start + n), q [n][hq][64], over a context packed as prefill_attention.cpp's bf16
// kernel packs it (16-key tiles, K [tile][dim / 2][16][2], V [tile][key / 2][dim][2], zero past the
// context, one tile more than it needs; head_elems values a KV head); out [n][hq][64]. Call only
// where attention_takes().
constexpr int64_t kAttentionDim = 64;
bool attention_takes(int64_t head_dim);
void prefill_attention(const uint16_t* q, int64_t n, int64_t hq, int64_t hk, int64_t start, const uint16_t* k_tiles,
                       const uint16_t* v_tiles, int64_t head_elems, float scale, kvmosaic_vec::bf16* out);

}  // namespace kvops::amx

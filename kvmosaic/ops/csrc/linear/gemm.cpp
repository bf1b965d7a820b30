// Linear layers on weights packed once at load time: out[M, N] = x[M, K] . W[N, K]^T (+ bias).
//
// The packed layout and the micro-kernel are in gemm_kernel.h. Threads split the output columns
// into panels; each thread walks its panels once per 128-row slab of activations, so a panel stays
// in cache while all rows of the slab use it and every weight byte comes from memory once per slab.
//
// The gate/up projection of a gated MLP runs as one product with SwiGLU in the epilogue: its packed
// weight alternates 32 gate columns and the same 32 up columns, so a group of 4 blocks holds both
// halves of 32 outputs and only silu(gate) * up leaves the registers.
#include "common/parallel.h"
#include "isa/amx.h"
#include "linear/gemm_kernel.h"
#include "linear/linear.h"

#include <type_traits>

namespace {

using namespace kvops::gemm;
using kvops::PackedWeight;

static_assert(kBlock == kvops::kPackedBlock, "linear.h states the packed block width");

constexpr int64_t kSlabRows = 128;  // activation rows per pass over the weights
constexpr int64_t kSwiGLUGroup = 4;  // blocks per gate/up group of the SwiGLU packing

template <typename T, bool kSwiGLU>
void panels_of(const PackedWeight& pw, const T* xp, int64_t m, T* op, int64_t p0, int64_t p1) {
  using Tile = Tiles<T, kSwiGLU>;
  constexpr int64_t kPanel = kSwiGLU ? kSwiGLUGroup : Tile::kPanel;  // blocks per work item
  const int64_t k = pw.k, n = pw.width();
  const int64_t steps = k / Step<T>::kPack;
  const int64_t block_stride = k * kBlock;
  const int64_t blocks = pw.blocks;
  const int64_t panel_cols = kSwiGLU ? kPanel * kBlock / 2 : kPanel * kBlock;  // output columns per panel
  const T* wp = static_cast<const T*>(pw.data);
  for (int64_t r0 = 0; r0 < m; r0 += kSlabRows) {
    const int64_t r1 = std::min(m, r0 + kSlabRows);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b0 = p * kPanel;
      const int64_t nb = std::min<int64_t>(kPanel, blocks - b0);
      const T* w = wp + b0 * block_stride;
      const float* bb = pw.bias != nullptr ? pw.bias + b0 * kBlock : nullptr;
      const T* next = p + 1 < p1 ? w + kPanel * block_stride : nullptr;
      for (int64_t r = r0; r < r1; r += Tile::kRows) {
        const int64_t mr = std::min<int64_t>(Tile::kRows, r1 - r);
        const T* xr = xp + r * k;
        T* o = op + r * n + p * panel_cols;
        const T* pf = r == r0 ? next : nullptr;
        if constexpr (kSwiGLU) {  // whole groups only: packing checks the width
          swiglu_group<T>(mr, xr, k, w, block_stride, steps, o, n, pf);
        } else {
          plain_tile<T, Tile::kPanel>(nb, mr, xr, k, w, block_stride, steps, o, n, bb, pf);
        }
      }
    }
  }
}

}  // namespace

namespace kvops {

int64_t PackedWeight::blocks_per_panel() const {
  return swiglu ? kSwiGLUGroup : Tiles<float, false>::kPanel;  // the same for bf16
}

int64_t PackedWeight::panels() const { return (blocks + blocks_per_panel() - 1) / blocks_per_panel(); }

int64_t PackedWeight::width() const { return swiglu ? blocks * kBlock / 2 : blocks * kBlock; }

template <typename T>
void packed_panels(const PackedWeight& w, const T* x, int64_t m, T* out, int64_t p0, int64_t p1) {
  if constexpr (std::is_same_v<T, bf16>) {
    if (amx::takes(w, m)) return amx::bf16_panels(w, x, m, out, p0, p1);
  }
  if (w.swiglu) panels_of<T, true>(w, x, m, out, p0, p1);
  else panels_of<T, false>(w, x, m, out, p0, p1);
}

template void packed_panels<float>(const PackedWeight&, const float*, int64_t, float*, int64_t, int64_t);
template void packed_panels<bf16>(const PackedWeight&, const bf16*, int64_t, bf16*, int64_t, int64_t);

template <typename T>
void packed_product(const PackedWeight& w, const T* x, int64_t m, T* out) {
  parallel_for(0, w.panels(), 1, [&](int64_t p0, int64_t p1) { packed_panels(w, x, m, out, p0, p1); });
}

template void packed_product<float>(const PackedWeight&, const float*, int64_t, float*);
template void packed_product<bf16>(const PackedWeight&, const bf16*, int64_t, bf16*);

}  // namespace kvops

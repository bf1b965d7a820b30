// Linear layers on weights packed once at load time: out[M, N] = x[M, K] . W[N, K]^T (+ bias).
//
// The packed layout and the micro-kernel are in gemm_kernel.h. Threads split the output columns
// into panels; each thread walks its panels once per 128-row slab of activations, so a panel stays
// in cache while all rows of the slab use it and every weight byte comes from memory once per slab.
//
// The gate/up projection of a gated MLP runs as one product with SwiGLU in the epilogue: its packed
// weight alternates 32 gate columns and the same 32 up columns, so a group of 4 blocks holds both
// halves of 32 outputs and only silu(gate) * up leaves the registers.
#include "common/ops_common.h"
#include "linear/gemm_kernel.h"
#include "isa/amx.h"
#include "layer/stack_kernels.h"

namespace {

using namespace kvops::gemm;
using kvops::PackedWeight;
using kvops::data_of;

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

bool gemm_supported(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16; }

int64_t pack_of(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

}  // namespace

namespace kvops {

int64_t PackedWeight::blocks_per_panel() const {
  return swiglu ? kSwiGLUGroup : Tiles<float, false>::kPanel;  // the same for bf16
}

int64_t PackedWeight::panels() const { return (blocks + blocks_per_panel() - 1) / blocks_per_panel(); }

int64_t PackedWeight::width() const { return swiglu ? blocks * kBlock / 2 : blocks * kBlock; }

PackedWeight PackedWeight::of(const at::Tensor& packed, bool swiglu, const float* bias) {
  return {packed.data_ptr(), packed.size(0), packed.size(1) / kBlock, swiglu, bias};
}

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

}  // namespace kvops

bool packed_linear_supports(at::ScalarType dtype, int64_t out_features, int64_t in_features) {
  return gemm_supported(dtype) && out_features % kBlock == 0 && in_features % pack_of(dtype) == 0;
}

// [N, K] -> the packed layout above, stored as [N / 16, K * 16] (same dtype).
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight needs a [N, K] weight");
  const int64_t n = weight.size(0), k = weight.size(1), pack = pack_of(weight.scalar_type());
  TORCH_CHECK(packed_linear_supports(weight.scalar_type(), n, k), "packed linear: unsupported weight ",
              weight.scalar_type(), " [", n, ", ", k, "] (needs N % 16 == 0 and float32 or bfloat16)");
  // [N/16, 16, K/pack, pack] -> [N/16, K/pack, 16, pack]
  return weight.contiguous().view({n / kBlock, kBlock, k / pack, pack}).permute({0, 2, 1, 3}).contiguous()
      .view({n / kBlock, k * kBlock});
}

bool packed_swiglu_supports(at::ScalarType dtype, int64_t intermediate, int64_t in_features) {
  return packed_linear_supports(dtype, 2 * intermediate, in_features) && intermediate % (2 * kBlock) == 0;
}

// Fused [2F, K] gate/up weight (gate rows first) -> rows reordered as 32 gate rows, the same 32 up
// rows, the next 32 gate rows, ..., then packed as pack_linear_weight does.
at::Tensor pack_swiglu_weight(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(0) % 2 == 0, "pack_swiglu_weight needs a [2F, K] weight");
  const int64_t f = gate_up.size(0) / 2, k = gate_up.size(1);
  TORCH_CHECK(packed_swiglu_supports(gate_up.scalar_type(), f, k), "packed SwiGLU: unsupported weight ",
              gate_up.scalar_type(), " [", 2 * f, ", ", k, "] (needs F % 32 == 0 and float32 or bfloat16)");
  // [2, F/32, 32, K] -> [F/32, 2, 32, K]
  const auto interleaved = gate_up.contiguous().view({2, f / (2 * kBlock), 2 * kBlock, k}).transpose(0, 1);
  return pack_linear_weight(interleaved.reshape({2 * f, k}));
}

namespace {

// Checks x against a packed weight of `blocks` 16-column blocks and runs the product into [M, width].
at::Tensor run_packed(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t width, bool swiglu) {
  TORCH_CHECK(x.dim() == 2, "packed_linear needs x [M, K]");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "packed_linear: x and weight dtypes differ");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous(), "packed_linear: weight is not packed");
  const int64_t k = x.size(1);
  TORCH_CHECK(packed.size(1) == k * kBlock, "packed_linear: x has ", k, " features, the weight ",
              packed.size(1) / kBlock);
  TORCH_CHECK(gemm_supported(x.scalar_type()), "packed_linear: unsupported dtype ", x.scalar_type());
  auto xc = x.contiguous();
  auto out = at::empty({x.size(0), width}, x.options());
  if (x.size(0) == 0) return out;
  const PackedWeight w = PackedWeight::of(packed, swiglu, bias);
  const int64_t m = x.size(0);
  if (x.scalar_type() == at::kFloat) {
    const float* xp = xc.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, w.panels(), 1, [&](int64_t p0, int64_t p1) { kvops::packed_panels(w, xp, m, op, p0, p1); });
  } else {
    const bf16* xp = data_of<bf16>(xc);
    bf16* op = data_of<bf16>(out);
    at::parallel_for(0, w.panels(), 1, [&](int64_t p0, int64_t p1) { kvops::packed_panels(w, xp, m, op, p0, p1); });
  }
  return out;
}

}  // namespace

// x [M, K] times a packed weight of N = packed.size(0) * 16 outputs; bias (float32 [N]) optional.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const int64_t n = packed.size(0) * kBlock;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == n, "packed_linear: bias must be [N]");
  }
  return run_packed(x, packed, bias.has_value() ? b.data_ptr<float>() : nullptr, n, false);
}

// silu(x G^T) * (x U^T), [M, F], from the weight of pack_swiglu_weight.
at::Tensor packed_swiglu(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) % 4 == 0, "packed_swiglu: weight is not a packed gate/up pair");
  return run_packed(x, packed, nullptr, packed.size(0) * kBlock / 2, true);
}

// Linear layers on weights packed once at load time: out[M, N] = x[M, K] . W[N, K]^T (+ bias).
//
// The packed weight holds 16 output columns per block, K-major inside the block: float32 blocks are
// [K][16], bfloat16 blocks are [K/2][16][2] (pairs of consecutive k for the AVX512-BF16 dot
// product), so one 64-byte load gives all 16 columns of one k step. The micro-kernel keeps an
// MR x (NB * 16) tile of float sums in registers, broadcasting one activation (float32) or one pair
// of activations (bfloat16) per row and k step. Threads split the output columns; each thread walks
// its blocks once per 128-row slab of activations, so a block stays in cache while all rows of the
// slab use it and every weight byte comes from memory once per slab.
//
// The gate/up projection of a gated MLP runs as one product with SwiGLU in the epilogue: its packed
// weight alternates 32 gate columns and the same 32 up columns, so a panel of 4 blocks holds both
// halves of 32 outputs and only silu(gate) * up leaves the registers.
#include "ops_common.h"

namespace {

using namespace kvops;

constexpr int64_t kBlock = 16;     // output columns per packed block
constexpr int64_t kSlabRows = 128;  // activation rows per pass over the weights

#if defined(__AVX512F__)
// One k step of the micro-kernel for an element type: how many k values a step covers, the weight
// vector of a block at that step, and the broadcast activation.
template <typename T>
struct Step;

template <>
struct Step<float> {
  static constexpr int64_t kPack = 1;
  using Vec = __m512;
  static Vec weight(const float* w) { return _mm512_loadu_ps(w); }
  static Vec act(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 fma(__m512 acc, Vec a, Vec w) { return _mm512_fmadd_ps(a, w, acc); }
};

#if defined(__AVX512BF16__)
template <>
struct Step<c10::BFloat16> {
  static constexpr int64_t kPack = 2;
  using Vec = __m512bh;
  static Vec weight(const c10::BFloat16* w) { return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w)); }
  static Vec act(const c10::BFloat16* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static __m512 fma(__m512 acc, Vec a, Vec w) { return _mm512_dpbf16_ps(acc, a, w); }
};
#endif

// MR rows x NB blocks. w points at the first block's k = 0; blocks are block_stride elements apart.
// steps = K / kPack. The weights come from memory once per slab: with few rows (decode, the stream
// is the bottleneck) each block is prefetched 2 KiB ahead; with more rows, the first rows of a slab
// prefetch the same part of the next panel (next) while this panel computes.
template <typename T, int MR, int NB, bool kSwiGLU>
inline void micro_kernel(const T* x, int64_t ldx, const T* w, int64_t block_stride, int64_t steps, T* out,
                         int64_t ldo, const float* bias, const T* next) {
  using S = Step<T>;
  constexpr int64_t kStepElems = kBlock * S::kPack;
  constexpr int64_t kAhead = 2048 / sizeof(T);
  __m512 acc[MR][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    typename S::Vec wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const int64_t at = j * block_stride + s * kStepElems;
      if constexpr (MR <= 4) {
        _mm_prefetch(reinterpret_cast<const char*>(w + at + kAhead), _MM_HINT_T0);
      } else {
        if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + at), _MM_HINT_T0);
      }
      wv[j] = S::weight(w + at);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const typename S::Vec a = S::act(x + m * ldx + s * S::kPack);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[m][j] = S::fma(acc[m][j], a, wv[j]);
    }
  }
  if constexpr (kSwiGLU) {
    // blocks [0, NB/2) are gate columns, [NB/2, NB) the matching up columns; each value is rounded
    // to T where the unfused path (projection output, then silu_and_mul) rounds it
    static_assert(NB % 2 == 0, "a SwiGLU panel pairs gate and up blocks");
    const __m512 one = _mm512_set1_ps(1.f);
#pragma GCC unroll 2
    for (int j = 0; j < NB / 2; ++j)
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m512 g = round_to<T>(acc[m][j]);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = round_to<T>(_mm512_div_ps(g, _mm512_add_ps(one, e)));
        store16(out + m * ldo + j * kBlock, _mm512_mul_ps(silu, round_to<T>(acc[m][j + NB / 2])));
      }
  } else {
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + j * kBlock) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) store16(out + m * ldo + j * kBlock, _mm512_add_ps(acc[m][j], b));
    }
  }
}

// mr (1..MR) rows: the micro-kernel instantiated for exactly that many.
template <typename T, int NB, bool kSwiGLU, int MR>
inline void rows_kernel(int64_t mr, const T* x, int64_t ldx, const T* w, int64_t block_stride, int64_t steps,
                        T* out, int64_t ldo, const float* bias, const T* next) {
  if constexpr (MR > 1) {
    if (mr < MR) return rows_kernel<T, NB, kSwiGLU, MR - 1>(mr, x, ldx, w, block_stride, steps, out, ldo, bias, next);
  }
  micro_kernel<T, MR, NB, kSwiGLU>(x, ldx, w, block_stride, steps, out, ldo, bias, next);
}

// Tile shapes, both 24 accumulators: a plain product keeps 8 rows x 3 blocks (48 columns) of sums,
// a SwiGLU product 6 rows x 4 blocks (32 gate and the matching 32 up columns).
template <bool kSwiGLU>
struct Tiles {
  static constexpr int kRows = kSwiGLU ? 6 : 8;
  static constexpr int64_t kPanel = kSwiGLU ? 4 : 3;
};

template <typename T, bool kSwiGLU>
void gemm_impl(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& out) {
  using Tile = Tiles<kSwiGLU>;
  constexpr int64_t kPanel = Tile::kPanel;
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t steps = k / Step<T>::kPack;
  const int64_t block_stride = k * kBlock;
  const int64_t blocks = packed.size(0);
  const int64_t panels = (blocks + kPanel - 1) / kPanel;
  const int64_t panel_cols = kSwiGLU ? kPanel * kBlock / 2 : kPanel * kBlock;  // output columns per panel
  const T* xp = x.data_ptr<T>();
  const T* wp = packed.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kSlabRows) {
      const int64_t r1 = std::min(m, r0 + kSlabRows);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t b0 = p * kPanel;
        const int64_t nb = std::min<int64_t>(kPanel, blocks - b0);
        const T* w = wp + b0 * block_stride;
        const float* bb = bias != nullptr ? bias + b0 * kBlock : nullptr;
        const T* next = p + 1 < end ? w + kPanel * block_stride : nullptr;
        for (int64_t r = r0; r < r1; r += Tile::kRows) {
          const int64_t mr = std::min<int64_t>(Tile::kRows, r1 - r);
          const T* xr = xp + r * k;
          T* o = op + r * n + p * panel_cols;
          const T* pf = r == r0 ? next : nullptr;
          if constexpr (kSwiGLU) {  // whole panels only: packing checks the width
            rows_kernel<T, 4, true, Tile::kRows>(mr, xr, k, w, block_stride, steps, o, n, nullptr, pf);
          } else if (nb == 3) {
            rows_kernel<T, 3, false, Tile::kRows>(mr, xr, k, w, block_stride, steps, o, n, bb, pf);
          } else if (nb == 2) {
            rows_kernel<T, 2, false, Tile::kRows>(mr, xr, k, w, block_stride, steps, o, n, bb, pf);
          } else {
            rows_kernel<T, 1, false, Tile::kRows>(mr, xr, k, w, block_stride, steps, o, n, bb, pf);
          }
        }
      }
    }
  });
}
#endif

bool gemm_supported(at::ScalarType dtype) {
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#endif
  return false;
}

int64_t pack_of(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

}  // namespace

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
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) {
    if (swiglu) gemm_impl<float, true>(xc, packed, bias, out);
    else gemm_impl<float, false>(xc, packed, bias, out);
  }
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    if (swiglu) gemm_impl<c10::BFloat16, true>(xc, packed, bias, out);
    else gemm_impl<c10::BFloat16, false>(xc, packed, bias, out);
  }
#endif
#endif
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

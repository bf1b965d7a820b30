// Linear layers on weights packed once at load time: out[M, N] = x[M, K] . W[N, K]^T (+ bias).
//
// The packed weight holds 16 output columns per block, K-major inside the block: float32 blocks are
// [K][16], bfloat16 blocks are [K/2][16][2] (pairs of consecutive k for the AVX512-BF16 dot
// product), so one 64-byte load gives all 16 columns of one k step. The micro-kernel keeps an
// MR x (NB * 16) tile of float sums in registers, broadcasting one activation (float32) or one pair
// of activations (bfloat16) per row and k step. Threads split the output columns; each thread walks
// its blocks once per 128-row slab of activations, so a block stays in cache while all rows of the
// slab use it and every weight byte comes from memory once per slab.
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
template <typename T, int MR, int NB>
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
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + j * kBlock) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) store16(out + m * ldo + j * kBlock, _mm512_add_ps(acc[m][j], b));
  }
}

template <typename T, int NB>
inline void rows_kernel(int64_t mr, const T* x, int64_t ldx, const T* w, int64_t block_stride, int64_t steps,
                        T* out, int64_t ldo, const float* bias, const T* next) {
  switch (mr) {
    case 1: micro_kernel<T, 1, NB>(x, ldx, w, block_stride, steps, out, ldo, bias, next); break;
    case 2: micro_kernel<T, 2, NB>(x, ldx, w, block_stride, steps, out, ldo, bias, next); break;
    case 3: micro_kernel<T, 3, NB>(x, ldx, w, block_stride, steps, out, ldo, bias, next); break;
    case 4: micro_kernel<T, 4, NB>(x, ldx, w, block_stride, steps, out, ldo, bias, next); break;
    case 5: micro_kernel<T, 5, NB>(x, ldx, w, block_stride, steps, out, ldo, bias, next); break;
    case 6: micro_kernel<T, 6, NB>(x, ldx, w, block_stride, steps, out, ldo, bias, next); break;
    case 7: micro_kernel<T, 7, NB>(x, ldx, w, block_stride, steps, out, ldo, bias, next); break;
    default: micro_kernel<T, 8, NB>(x, ldx, w, block_stride, steps, out, ldo, bias, next); break;
  }
}

constexpr int kRows = 8;    // rows per micro-kernel call
constexpr int kPanel = 3;   // blocks per micro-kernel call (48 columns): 24 accumulators

template <typename T>
void gemm_impl(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t steps = k / Step<T>::kPack;
  const int64_t block_stride = k * kBlock;
  const int64_t blocks = n / kBlock;
  const int64_t panels = (blocks + kPanel - 1) / kPanel;
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
        for (int64_t r = r0; r < r1; r += kRows) {
          const int64_t mr = std::min<int64_t>(kRows, r1 - r);
          const T* xr = xp + r * k;
          T* o = op + r * n + b0 * kBlock;
          const T* pf = r == r0 ? next : nullptr;
          if (nb == 3) rows_kernel<T, 3>(mr, xr, k, w, block_stride, steps, o, n, bb, pf);
          else if (nb == 2) rows_kernel<T, 2>(mr, xr, k, w, block_stride, steps, o, n, bb, pf);
          else rows_kernel<T, 1>(mr, xr, k, w, block_stride, steps, o, n, bb, pf);
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

// x [M, K] times a packed weight of N = packed.size(0) * 16 outputs; bias (float32 [N]) optional.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "packed_linear needs x [M, K]");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "packed_linear: x and weight dtypes differ");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous(), "packed_linear: weight is not packed");
  const int64_t k = x.size(1), n = packed.size(0) * kBlock;
  TORCH_CHECK(packed.size(1) == k * kBlock, "packed_linear: x has ", k, " features, the weight ",
              packed.size(1) / kBlock);
  TORCH_CHECK(gemm_supported(x.scalar_type()), "packed_linear: unsupported dtype ", x.scalar_type());
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == n, "packed_linear: bias must be [N]");
  }
  auto xc = x.contiguous();
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) gemm_impl<float>(xc, packed, bp, out);
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) gemm_impl<c10::BFloat16>(xc, packed, bp, out);
#endif
#endif
  return out;
}

// Greedy sampling's argmax: the first index of each row's largest value, as torch.argmax gives it (a
// NaN counts as the largest; the first one wins). ATen's index-returning reductions run one element
// at a time: 125 us for one 49,152-wide row of logits and 3.8 ms for 64 rows on the AVX2 host, where
// amax alone takes 15 us. Here: a vector max over the row, then a vector scan for its first lane.
#include "ops_common.h"
#include "vec.h"

namespace {

namespace vec = kvmosaic_vec;
using vec::F16;
using vec::Mask;

constexpr Mask kAll = 0xFFFFu;

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

int64_t row_argmax(const float* x, int64_t n) {
  const F16 lowest = F16::set1(-std::numeric_limits<float>::infinity());
  F16 top = lowest;
  Mask nan = 0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const F16 v = F16::load(x + j);
    nan |= vec::is_nan(v);
    top = vec::max(top, v);
  }
  const Mask tail = vec::first_lanes(static_cast<int>(n - j));
  if (j < n) {
    const F16 v = vec::select(tail, F16::load(x + j, tail), lowest);
    nan |= vec::is_nan(v);
    top = vec::max(top, v);
  }
  if (nan != 0) return first_nan(x, n);
  const float best = top.reduce_max();
  const F16 b = F16::set1(best);
  for (j = 0; j + 16 <= n; j += 16) {
    const Mask below = vec::greater(b, F16::load(x + j));  // every lane below the best: not here
    if (below != kAll) return j + __builtin_ctz(~below & kAll);
  }
  for (; j < n; ++j)
    if (x[j] == best) return j;
  return 0;  // not reached: the best value is in the row
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows takes float32 [rows, n] with n > 0");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row_argmax(xp + r * n, n);
  });
  return out;
}

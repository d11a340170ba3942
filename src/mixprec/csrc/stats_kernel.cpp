// mixprec's cast statistics on the CPU, one pass (see mixprec/formats/_state.py, record_cast).
//
// record_cast folds one cast of x (to q, with amax) into a layer's window row
// [amax, saturated, underflow, nonfinite, previous amax]: the torch code (_quant.cast_stats, then a
// maximum and a copy) is about twenty small ops, each a pass and an allocation, which on the
// emulated fp8/fp4 GEMMs of a small model cost more than the GEMM (an all-NVFP4 Llama of hidden
// 64 spent 15% of its step there). This kernel computes the same values in one strided pass:
//
//   the elements sampled: every stride-th of x and q (stride = max(1, n / sample) | 1);
//   saturated: (count of |x| > the row's previous amax, compared in x's dtype as torch's type
//   promotion does: the 0-d float32 amax rounded to it) / m, times 0 where that amax is not > 0;
//   underflow: (count of q's zero codes (byte & 0x7F == 0) - count of x == 0) / m;
//   nonfinite: max(count of |x| not < inf times stride, amax not finite);
//   saturated and underflow 0 where amax is not finite (its scale flushed every finite element);
//   the row: each of the four the maximum of itself and the new value (NaN where either is NaN),
//   the previous amax the new amax (the largest of amax's elements, NaN if one is).
//
// Counts are exact integers; each division is the float32 one torch does on them (both operands
// rounded to float32 first, as torch's true division of an int64 tensor by a Python int), so the
// results are torch's bits but for a NaN's payload.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "float_types.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace mixprec_stats {

using mixprec_native::to_float;

inline float nan_max(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return a > b ? a : b;
}

struct Counts {
  int64_t above = 0, zero_x = 0, zero_q = 0, nonfinite = 0;
};

template <typename T>
Counts count(const T* x, const uint8_t* q, int64_t n, int64_t stride, float last) {  // (last: in T's values)
  Counts c;
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t k = 0; k < n; k += stride) {
    const float a = std::fabs(to_float(x[k]));
    c.above += a > last;
    c.zero_x += a == 0.0f;
    c.nonfinite += !(a < inf);
    c.zero_q += (q[k] & 0x7F) == 0;
  }
  return c;
}

template <typename T> float largest(const T* v, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    const float a = to_float(v[i]);
    if (std::isnan(a)) return a;
    best = a > best ? a : best;
  }
  return best;
}

inline bool floating(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
}

void record_cast(at::Tensor& row, const at::Tensor& x, const at::Tensor& q, const at::Tensor& amax, int64_t sample) {
  TORCH_CHECK(row.device().is_cpu() && row.scalar_type() == at::kFloat && row.dim() == 1 && row.size(0) == 5 &&
                  row.is_contiguous(),
              "mixprec record_cast: the window row must be a contiguous float32 CPU vector of 5");
  TORCH_CHECK(x.device().is_cpu() && floating(x) && x.is_contiguous(),
              "mixprec record_cast: x must be a contiguous float32, bfloat16 or float16 CPU tensor");
  TORCH_CHECK(q.device().is_cpu() && q.element_size() == 1 && q.is_contiguous() && q.numel() == x.numel(),
              "mixprec record_cast: q must be a contiguous 1-byte CPU tensor of x's size");
  TORCH_CHECK(amax.device().is_cpu() && floating(amax) && amax.is_contiguous() && amax.numel() > 0,
              "mixprec record_cast: amax must be a non-empty contiguous float CPU tensor");
  TORCH_CHECK(sample > 0, "mixprec record_cast: sample must be positive");
  const int64_t n = x.numel();
  const int64_t stride = std::max<int64_t>(1, n / sample) | 1;
  const int64_t m = std::max<int64_t>((n + stride - 1) / stride, 1);
  float* r = row.data_ptr<float>();
  const float last = r[4];
  const uint8_t* qb = static_cast<const uint8_t*>(q.const_data_ptr());
  const Counts c = MIXPREC_FLOAT_TYPE(x.scalar_type(), [&] {
    return count(x.const_data_ptr<T>(), qb, n, stride, to_float(static_cast<T>(last)));
  });
  const float top = MIXPREC_FLOAT_TYPE(amax.scalar_type(), [&] { return largest(amax.const_data_ptr<T>(), amax.numel()); });
  const float fm = static_cast<float>(m);
  const bool measured = std::isfinite(top);  // a non-finite amax's scale flushes everything: only counted
  const float saturated = measured ? static_cast<float>(c.above) / fm * (last > 0.0f ? 1.0f : 0.0f) : 0.0f;
  const float flushed = measured ? static_cast<float>(c.zero_q - c.zero_x) / fm : 0.0f;
  const int64_t bad = std::max<int64_t>(c.nonfinite * stride, std::isfinite(top) ? 0 : 1);
  const float fresh[4] = {top, saturated, flushed, static_cast<float>(bad)};
  for (int i = 0; i < 4; ++i) r[i] = nan_max(r[i], fresh[i]);
  r[4] = top;
}

// cost_fold: a Controller's step of loss-cost sums folded into the layers' windows
// (mixprec/control/_fold.py, fold): c is (layers, 2, columns >= 7) float32, per row the step's
// [sum(g * e), squares, rows] then the window's [sum, steps, sum of squares, index sum]. Per row,
// in float32 and in the torch code's order (each of its ops elementwise, so the same bits):
//   estimate = first / s + sign * (0.5 * rows * squares / s2)
//   counted = rows > 0 and estimate finite; kept = counted ? estimate : 0
//   sum += kept; index += kept * steps; steps += counted; sum_sq += kept * kept; step sums = 0
// with s the scale rounded to float32 and s2 its square: the float32 product of a scale tensor
// (scale_tensor), the double one rounded once of a Python number (torch's scalar arithmetic).
void cost_fold(at::Tensor& c, double scale, bool scale_tensor, const at::Tensor& sign) {
  TORCH_CHECK(c.device().is_cpu() && c.scalar_type() == at::kFloat && c.dim() == 3 && c.size(1) == 2 &&
                  c.size(2) >= 7 && c.is_contiguous(),
              "mixprec cost_fold: the windows must be a contiguous float32 CPU tensor (layers, 2, >= 7)");
  TORCH_CHECK(sign.device().is_cpu() && sign.scalar_type() == at::kFloat && sign.numel() == 2 && sign.is_contiguous(),
              "mixprec cost_fold: the signs must be 2 contiguous float32 CPU values");
  const float s = static_cast<float>(scale);
  const float s2 = scale_tensor ? s * s : static_cast<float>(scale * scale);
  const float* sg = sign.const_data_ptr<float>();
  float* w = c.data_ptr<float>();
  const int64_t cols = c.size(2);
  for (int64_t i = 0; i < c.size(0) * 2; ++i) {
    float* r = w + i * cols;
    const float estimate = r[0] / s + sg[i % 2] * (0.5f * r[2] * r[1] / s2);
    const bool counted = r[2] > 0.0f && std::isfinite(estimate);
    const float kept = counted ? estimate : 0.0f;
    r[3] = r[3] + kept;
    r[6] = r[6] + kept * r[4];
    r[4] = r[4] + (counted ? 1.0f : 0.0f);
    r[5] = r[5] + kept * kept;
    r[0] = r[1] = r[2] = 0.0f;
  }
}

}  // namespace mixprec_stats

TORCH_LIBRARY_FRAGMENT(mixprec_native, m) {
  m.def("record_cast(Tensor(a!) row, Tensor x, Tensor q, Tensor amax, int sample) -> ()");
  m.def("cost_fold(Tensor(a!) c, float scale, bool scale_tensor, Tensor sign) -> ()");
}

TORCH_LIBRARY_IMPL(mixprec_native, CPU, m) {
  m.impl("record_cast", &mixprec_stats::record_cast);
  m.impl("cost_fold", &mixprec_stats::cost_fold);
}

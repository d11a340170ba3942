// mixprec's tensor- and row-scaled fp8 casts on the CPU (see mixprec/formats/_quant.py, cast_to_fp8).
//
// The torch code of a cast is about ten small ops from Python (abs, max, the scale's arithmetic in
// float64, a float32 copy, a multiply, a clamp, the conversion), and the dequantization before an
// emulated GEMM two more (fp8 to float32, element by element on the CPU, and a division). Here:
//
//   fp8_cast:    each row's (or the tensor's) max |x| in one pass, in x's dtype, or the amax given
//                (a tensor-parallel or FSDP2 operand's, all-reduced); the scale as amax_to_scale
//                computes it (float64: max / clamp(amax, 1e-12) as torch's reciprocal-then-multiply,
//                rounded to float32; a power of 2 by torch's own log2, floor and exp2 ops); then the
//                codes by torch's own ops from C++ (clamp(float32(x) * scale) to e4m3fn/e5m2): their
//                bits, NaN and infinity included. A scale that is not finite (a NaN amax) is left to the
//                torch code (whose NaN payloads this would not copy).
//   fp8_dequantize: each code's float32 value (a table of c10's conversion, torch's) in one pass over
//                the codes' memory, then torch's division by the row's, column's or tensor's scale.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "float_types.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace mixprec_fp8 {

using mixprec_native::f2u;
using mixprec_native::fp8_code_values;
using mixprec_native::to_float;
using mixprec_native::u2f;

constexpr double kEps = 1e-12;  // torchao's EPS (_blocks.EPS): the smallest amax a scale is taken from

bool is_e4m3(at::ScalarType dtype) { return dtype == at::kFloat8_e4m3fn; }

// max |x| over [begin, end) of a row, as float32 (exact: an element of x), NaN where one is: on the
// bits of |x| (sign cleared), where integer order is float order with NaN above infinity.
template <typename T> inline float row_amax(const T* x, int64_t n) {
  uint32_t best = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t a = f2u(to_float(x[j])) & 0x7FFFFFFFu;
    best = a > best ? a : best;
  }
  return best > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : u2f(best);
}

// cast_to_fp8 of the contiguous 2-D x (float32, bfloat16 or float16) to dtype (float8_e4m3fn or
// float8_e5m2) with one scale per row (rows) or one for the tensor: (q, scale, amax, done), scale
// float32 and amax in x's dtype, both of shape (rows, 1) or (); done false where a scale is not
// finite (nothing else is meaningful then: Python takes the torch code).
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> fp8_cast(const at::Tensor& x, at::ScalarType dtype, bool rows,
                                                        const std::optional<at::Tensor>& amax, bool pow2) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "mixprec fp8 cast: the operand must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "mixprec fp8 cast: the operand must be float32, bfloat16 or float16");
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
              "mixprec fp8 cast: the dtype must be float8_e4m3fn or float8_e5m2");
  const int64_t n_rows = x.size(0), n_cols = x.size(1);
  const int64_t n_scales = rows ? n_rows : 1;
  std::vector<int64_t> shape = rows ? std::vector<int64_t>{n_rows, 1} : std::vector<int64_t>{};
  at::Tensor amax_x;  // in x's dtype
  if (amax.has_value()) {
    TORCH_CHECK(amax->device().is_cpu() && amax->numel() == n_scales && amax->scalar_type() == x.scalar_type(),
                "mixprec fp8 cast: the amax given must be one value (a tensor scale) or one per row, in x's dtype");
    amax_x = amax->reshape(shape).contiguous();
  } else {
    std::vector<float> found(n_scales, 0.0f);
    MIXPREC_FLOAT_TYPE(x.scalar_type(), [&] {
      const T* p = x.const_data_ptr<T>();
      if (rows) {
        for (int64_t i = 0; i < n_rows; ++i) found[i] = row_amax(p + i * n_cols, n_cols);
      } else {
        found[0] = row_amax(p, n_rows * n_cols);
      }
    });
    amax_x = at::empty(shape, x.options());
    MIXPREC_FLOAT_TYPE(x.scalar_type(), [&] {
      T* a = amax_x.data_ptr<T>();
      for (int64_t i = 0; i < n_scales; ++i) a[i] = static_cast<T>(found[i]);  // (exact: an element of x)
    });
  }
  // amax_to_scale: float64 max / clamp(amax, EPS) as torch's reciprocal times the max, to float32
  const double fmax = is_e4m3(dtype) ? 448.0 : 57344.0;
  at::Tensor scale = at::empty(shape, x.options().dtype(at::kFloat));
  at::Tensor amax_f = amax_x.to(at::kFloat);
  const float* af = amax_f.const_data_ptr<float>();
  float* s = scale.data_ptr<float>();
  for (int64_t i = 0; i < n_scales; ++i) {
    const double a = static_cast<double>(af[i]);
    const double clamped = std::isnan(a) ? a : std::max(a, kEps);
    s[i] = static_cast<float>((1.0 / clamped) * fmax);
  }
  bool finite = true;
  for (int64_t i = 0; i < n_scales; ++i) finite = finite && std::isfinite(s[i]);
  if (pow2 && finite) scale = at::exp2(at::floor(at::log2(scale)));  // (torch's own ops: their bits)
  if (!finite) return {at::empty({0}, x.options().dtype(dtype)), scale, amax_x, false};
  at::Tensor q = (x.to(at::kFloat) * scale).clamp_(-fmax, fmax).to(dtype);  // (torch's ops, as _quant's)
  return {q, scale, amax_x, true};
}

// fp8_values(q) / scale for the 2-D q (float8_e4m3fn or float8_e5m2, any strides) and a float32
// scale of one value, one per row ((rows, 1)) or one per column ((1, cols)): float32 in q's shape
// and layout (as torch's conversion keeps a dense tensor's strides: a transposed operand stays one).
at::Tensor fp8_dequantize(const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && (q.scalar_type() == at::kFloat8_e4m3fn ||
                                                      q.scalar_type() == at::kFloat8_e5m2),
              "mixprec fp8 dequantize: the codes must be a 2-D float8_e4m3fn or float8_e5m2 CPU tensor");
  const int64_t n_rows = q.size(0), n_cols = q.size(1);
  const bool per_row = scale.dim() == 2 && scale.size(0) == n_rows && scale.size(1) == 1 && n_rows > 1;
  const bool per_col = scale.dim() == 2 && scale.size(0) == 1 && scale.size(1) == n_cols && n_cols > 1;
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat &&
                  (scale.numel() == 1 || per_row || per_col),
              "mixprec fp8 dequantize: the scale must be float32: one value, one per row or one per column");
  if (!q.is_non_overlapping_and_dense()) return q.to(at::kFloat) / scale;
  const float* values = fp8_code_values(is_e4m3(q.scalar_type()));
  const uint8_t* c = reinterpret_cast<const uint8_t*>(q.const_data_ptr());
  at::Tensor out = at::empty_like(q, q.options().dtype(at::kFloat));  // (q's strides: the same memory order)
  float* o = out.data_ptr<float>();
  for (int64_t k = 0; k < q.numel(); ++k) o[k] = values[c[k]];
  out.div_(scale);  // (torch's division)
  return out;
}

}  // namespace mixprec_fp8

TORCH_LIBRARY_FRAGMENT(mixprec_native, m) {
  m.def("fp8_cast(Tensor x, ScalarType dtype, bool rows, Tensor? amax, bool pow2) -> (Tensor, Tensor, Tensor, bool)");
  m.def("fp8_dequantize(Tensor q, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mixprec_native, CPU, m) {
  m.impl("fp8_cast", &mixprec_fp8::fp8_cast);
  m.impl("fp8_dequantize", &mixprec_fp8::fp8_dequantize);
}

// mixprec's FP4 (e2m1) casts on the CPU, one pass each (see mixprec/fp8/_fp4.py).
//
// The Python path of quantize makes about twenty passes over a float32 copy of the operand (pad,
// abs, amax, multiply, clamp, seven comparisons, signbit, pack); dequantize six (unpack, stack,
// table look-up, multiply, cast, crop). These kernels compute the same bits in one pass each:
//
//   fp4_block_amax: each block's max |x| (the operand read as float32; zero padding changes no amax).
//   fp4_encode:     x * (its block's multiplier), clamped to [-6, 6], rounded to e2m1 (to nearest
//                   even, or stochastically against uniform draws Python made with the cast's
//                   generator), two codes per byte, padded to whole blocks.
//   fp4_decode:     e2m1 value times its block's float32 scale, rounded once to the output dtype.
//   fp4_magnitudes: each code's magnitude index, unpadded.
//
// Every float operation is the one the Python path does, in the same order (one multiply; the
// compiler fuses nothing: -ffp-contract=off). Python sends here only blocks whose multiplier or
// scale is finite and not NaN: a NaN's sign after a multiply of two NaNs is the hardware's
// choice of operand, which no C++ source pins down, so those casts stay in Python.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace mixprec_fp4 {

constexpr int64_t kGrain = 1 << 14;  // elements per parallel task, at least
constexpr float kMax = 6.0f;
// e2m1 values by code (sign << 3 | magnitude index), as E2M1_VALUES in _fp4.py.
constexpr float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline uint32_t f2u(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }

template <typename T> inline float to_float(T x) { return static_cast<float>(x); }

// The magnitude index rounded to nearest, ties to even: how many midpoints |v| passes (_MIDPOINTS).
inline uint8_t nearest(float a) {
  return static_cast<uint8_t>((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                              (a > 5.0f));
}

// Stochastic rounding (encode_e2m1 with a generator): lo, the largest magnitude <= a; up with
// probability (a - lo) / (hi - lo), i.e. when u * (hi - lo) < a - lo.
inline uint8_t stochastic(float a, float u) {
  const int lo = (a >= 0.5f) + (a >= 1.0f) + (a >= 1.5f) + (a >= 2.0f) + (a >= 3.0f) + (a >= 4.0f) + (a >= 6.0f);
  const float lo_value = kValues[lo];
  const float step = kValues[std::min(lo + 1, 7)] - lo_value;
  return static_cast<uint8_t>(lo + (u * step < a - lo_value));
}

// One element: its code from x (as float32) and its block's multiplier.
template <bool SR> inline uint8_t encode(float x, float mul, float u) {
  float v = x * mul;
  v = v < -kMax ? -kMax : v;  // torch.clamp_(-6, 6); v is never NaN here (see the top)
  v = v > kMax ? kMax : v;
  const float a = std::fabs(v);
  const uint8_t mag = SR ? stochastic(a, u) : nearest(a);
  return static_cast<uint8_t>(mag | ((f2u(v) >> 28) & 8u));
}

void check_operand(const at::Tensor& x, int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "mixprec fp4 ", what,
              ": the operand must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "mixprec fp4 ", what, ": the operand must be float32, bfloat16 or float16");
  TORCH_CHECK(rows > 0 && cols > 0 && cols % 2 == 0, "mixprec fp4 ", what, ": bad block ", rows, "x", cols);
}

inline int64_t blocks(int64_t n, int64_t size) { return (n + size - 1) / size; }

#define MIXPREC_FP4_INPUT(type, ...)                                           \
  [&] {                                                                        \
    switch (type) {                                                            \
      case at::kFloat: { using T = float; return __VA_ARGS__(); }              \
      case at::kBFloat16: { using T = c10::BFloat16; return __VA_ARGS__(); }   \
      default: { using T = c10::Half; return __VA_ARGS__(); }                  \
    }                                                                          \
  }()

template <typename T>
void block_amax(const T* x, float* out, int64_t n_rows, int64_t n_cols, int64_t rows, int64_t cols) {
  const int64_t nbr = blocks(n_rows, rows), nbc = blocks(n_cols, cols);
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, rows * n_cols));
  at::parallel_for(0, nbr, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> m(nbc);
    std::vector<uint8_t> nan(nbc);
    for (int64_t bi = begin; bi < end; ++bi) {
      std::fill(m.begin(), m.end(), 0.0f);
      std::fill(nan.begin(), nan.end(), 0);
      for (int64_t i = bi * rows; i < std::min(n_rows, (bi + 1) * rows); ++i) {
        const T* row = x + i * n_cols;
        for (int64_t bj = 0; bj < nbc; ++bj) {
          const int64_t j0 = bj * cols, j1 = std::min(n_cols, j0 + cols);
          float mb = m[bj];
          uint8_t nb = 0;
          for (int64_t j = j0; j < j1; ++j) {
            const float a = std::fabs(to_float(row[j]));
            mb = a > mb ? a : mb;
            nb |= a != a;
          }
          m[bj] = mb;
          nan[bj] |= nb;
        }
      }
      for (int64_t bj = 0; bj < nbc; ++bj)
        out[bi * nbc + bj] = nan[bj] ? std::numeric_limits<float>::quiet_NaN() : m[bj];
    }
  });
}

at::Tensor fp4_block_amax(const at::Tensor& x, int64_t rows, int64_t cols) {
  check_operand(x, rows, cols, "block_amax");
  const int64_t n_rows = x.size(0), n_cols = x.size(1);
  at::Tensor out = at::empty({blocks(n_rows, rows), blocks(n_cols, cols)}, x.options().dtype(at::kFloat));
  MIXPREC_FP4_INPUT(x.scalar_type(), [&] {
    block_amax<T>(x.const_data_ptr<T>(), out.data_ptr<float>(), n_rows, n_cols, rows, cols);
  });
  return out;
}

template <typename T, bool SR>
void encode_rows(const T* x, const float* mul, const float* rand, uint8_t* out, int64_t n_rows, int64_t n_cols,
                 int64_t rows, int64_t cols) {
  const int64_t nbc = blocks(n_cols, cols), padded_cols = nbc * cols, padded_rows = blocks(n_rows, rows) * rows;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, padded_cols));
  at::parallel_for(0, padded_rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> values(padded_cols, 0.0f);  // the row as float32, zero-padded
    std::vector<uint8_t> codes(padded_cols);
    for (int64_t i = begin; i < end; ++i) {
      if (i < n_rows) {
        const T* row = x + i * n_cols;
        for (int64_t j = 0; j < n_cols; ++j) values[j] = to_float(row[j]);
      } else {
        std::fill(values.begin(), values.end(), 0.0f);
      }
      const float* m = mul + (i / rows) * nbc;
      const float* u = SR ? rand + i * padded_cols : nullptr;
      for (int64_t bj = 0; bj < nbc; ++bj) {
        const float mb = m[bj];
        const int64_t j0 = bj * cols;
        for (int64_t k = 0; k < cols; ++k)
          codes[j0 + k] = encode<SR>(values[j0 + k], mb, SR ? u[j0 + k] : 0.0f);
      }
      uint8_t* o = out + i * (padded_cols / 2);
      for (int64_t k = 0; k < padded_cols / 2; ++k)
        o[k] = static_cast<uint8_t>(codes[2 * k] | (codes[2 * k + 1] << 4));
    }
  });
}

at::Tensor fp4_encode(const at::Tensor& x, const at::Tensor& mul, int64_t rows, int64_t cols,
                      const std::optional<at::Tensor>& rand) {
  check_operand(x, rows, cols, "encode");
  const int64_t n_rows = x.size(0), n_cols = x.size(1);
  const int64_t nbr = blocks(n_rows, rows), nbc = blocks(n_cols, cols);
  TORCH_CHECK(mul.device().is_cpu() && mul.scalar_type() == at::kFloat && mul.is_contiguous() && mul.dim() == 2 &&
                  mul.size(0) == nbr && mul.size(1) == nbc,
              "mixprec fp4 encode: the multipliers must be a contiguous float32 CPU tensor, one per block");
  const float* r = nullptr;
  if (rand.has_value()) {
    TORCH_CHECK(rand->device().is_cpu() && rand->scalar_type() == at::kFloat && rand->is_contiguous() &&
                    rand->numel() == nbr * rows * nbc * cols,
                "mixprec fp4 encode: the uniform draws must be a contiguous float32 CPU tensor, one per padded element");
    r = rand->const_data_ptr<float>();
  }
  at::Tensor out = at::empty({nbr * rows, nbc * cols / 2}, x.options().dtype(at::kByte));
  MIXPREC_FP4_INPUT(x.scalar_type(), [&] {
    if (r != nullptr)
      encode_rows<T, true>(x.const_data_ptr<T>(), mul.const_data_ptr<float>(), r, out.data_ptr<uint8_t>(), n_rows,
                           n_cols, rows, cols);
    else
      encode_rows<T, false>(x.const_data_ptr<T>(), mul.const_data_ptr<float>(), nullptr, out.data_ptr<uint8_t>(),
                            n_rows, n_cols, rows, cols);
  });
  return out;
}

template <typename T>
void decode_rows(const uint8_t* codes, const float* scale, T* out, int64_t n_rows, int64_t n_cols, int64_t rows,
                 int64_t cols, int64_t packed_cols) {
  const int64_t nbc = packed_cols * 2 / cols;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, n_cols));
  at::parallel_for(0, n_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* c = codes + i * packed_cols;
      const float* s = scale + (i / rows) * nbc;
      T* o = out + i * n_cols;
      for (int64_t j = 0; j < n_cols; ++j) {
        const uint8_t code = (c[j >> 1] >> ((j & 1) * 4)) & 0xF;
        o[j] = static_cast<T>(kValues[code] * s[j / cols]);  // float32 product, rounded once to T
      }
    }
  });
}

at::Tensor fp4_decode(const at::Tensor& codes, const at::Tensor& scale, int64_t rows, int64_t cols, int64_t n_rows,
                      int64_t n_cols, at::ScalarType dtype) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2,
              "mixprec fp4 decode: the codes must be a contiguous 2-D uint8 CPU tensor");
  TORCH_CHECK(rows > 0 && cols > 0 && cols % 2 == 0 && codes.size(0) % rows == 0 && (codes.size(1) * 2) % cols == 0 &&
                  n_rows >= 0 && n_cols >= 0 && n_rows <= codes.size(0) && n_cols <= codes.size(1) * 2,
              "mixprec fp4 decode: the codes do not hold whole ", rows, "x", cols, " blocks of a ", n_rows, "x", n_cols,
              " tensor");
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.dim() == 2 && scale.size(0) == codes.size(0) / rows && scale.size(1) == codes.size(1) * 2 / cols,
              "mixprec fp4 decode: the scales must be a contiguous float32 CPU tensor, one per block");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "mixprec fp4 decode: the dtype must be float32, bfloat16 or float16");
  at::Tensor out = at::empty({n_rows, n_cols}, codes.options().dtype(dtype));
  MIXPREC_FP4_INPUT(dtype, [&] {
    decode_rows<T>(codes.const_data_ptr<uint8_t>(), scale.const_data_ptr<float>(), out.data_ptr<T>(), n_rows, n_cols,
                   rows, cols, codes.size(1));
  });
  return out;
}

at::Tensor fp4_magnitudes(const at::Tensor& codes, int64_t n_rows, int64_t n_cols) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.dim() == 2 && n_rows >= 0 && n_cols >= 0 && n_rows <= codes.size(0) &&
                  n_cols <= codes.size(1) * 2,
              "mixprec fp4 magnitudes: the codes must be a contiguous 2-D uint8 CPU tensor covering ", n_rows, "x",
              n_cols);
  at::Tensor out = at::empty({n_rows, n_cols}, codes.options());
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t packed_cols = codes.size(1);
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, n_cols));
  at::parallel_for(0, n_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* ci = c + i * packed_cols;
      uint8_t* oi = o + i * n_cols;
      for (int64_t j = 0; j < n_cols; ++j) oi[j] = (ci[j >> 1] >> ((j & 1) * 4)) & 0x7;
    }
  });
  return out;
}

}  // namespace mixprec_fp4

TORCH_LIBRARY_FRAGMENT(mixprec_native, m) {
  m.def("fp4_block_amax(Tensor x, int rows, int cols) -> Tensor");
  m.def("fp4_encode(Tensor x, Tensor mul, int rows, int cols, Tensor? rand) -> Tensor");
  m.def("fp4_decode(Tensor codes, Tensor scale, int rows, int cols, int n_rows, int n_cols, ScalarType dtype) -> Tensor");
  m.def("fp4_magnitudes(Tensor codes, int n_rows, int n_cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(mixprec_native, CPU, m) {
  m.impl("fp4_block_amax", &mixprec_fp4::fp4_block_amax);
  m.impl("fp4_encode", &mixprec_fp4::fp4_encode);
  m.impl("fp4_decode", &mixprec_fp4::fp4_decode);
  m.impl("fp4_magnitudes", &mixprec_fp4::fp4_magnitudes);
}

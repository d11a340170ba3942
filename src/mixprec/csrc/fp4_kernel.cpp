// mixprec's FP4 (e2m1) casts on the CPU, one pass each (see mixprec/formats/_fp4.py).
//
// The torch code of quantize makes about twenty passes over a float32 copy of the operand (pad,
// abs, amax, multiply, clamp, seven comparisons, signbit, pack); dequantize six (unpack, stack,
// table look-up, multiply, cast, crop). These kernels compute the same bits in one pass each:
//
//   fp4_block_amax: each block's max |x| (the operand read as float32; zero padding changes no amax).
//   fp4_encode:     x * (its block's multiplier), clamped to [-6, 6], rounded to e2m1 (to nearest
//                   even, or stochastically against uniform draws), two codes per byte, padded to
//                   whole blocks.
//   fp4_decode:     e2m1 value times its block's float32 scale, rounded once to the output dtype.
//   fp4_nvfp4_scales: NVFP4's scales of the blocks' max |x| (the tensor scale, each block's e4m3
//                   scale and float32 multiplier), and whether every multiplier is finite.
//   fp4_nvfp4_decode: fp4_decode with each block's scale the tensor scale times its e4m3 scale.
//   fp4_magnitudes: each code's magnitude index, unpadded.
//   fp4_uniform:    torch.rand's draws from a CPU generator, without its per-element overhead.
//   fp4_key_draws:  a RoundingKey's draws (SplitMix64, integer arithmetic: the same bits anywhere).
//
// Every float operation is the one the torch code does, in the same order (one multiply; the
// compiler fuses nothing: -ffp-contract=off). Python sends here only casts whose block
// multipliers and scales are all finite: a NaN's sign after a multiply of two NaNs is the
// hardware's choice of operand, which no C++ source pins down, so those casts stay in torch.
// On AVX2 the encoder runs 8 lanes at a time (encode8), the same operations as the scalar
// definition (encode), which other CPUs run.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/DistributionsHelper.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "float_types.h"

#include <algorithm>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <vector>

namespace mixprec_fp4 {

constexpr int64_t kGrain = 1 << 14;  // elements per parallel task, at least
constexpr float kMax = 6.0f;
// e2m1 values by code (sign << 3 | magnitude index), as E2M1_VALUES in _fp4.py.
constexpr float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

using mixprec_native::f2u;
using mixprec_native::fp8_code_values;
using mixprec_native::to_float;
using mixprec_native::u2f;

// The code of v = x * mul: clamped to [-6, 6] as torch.clamp_ (v is never NaN here: see the top),
// rounded to nearest with ties to even (how many of _MIDPOINTS |v| passes) or stochastically
// against the uniform draw u (encode_e2m1 with a generator: lo, the largest magnitude <= |v|,
// goes up when u * (hi - lo) < |v| - lo). lo's value and hi - lo are sums of the exact steps
// between magnitudes: the same floats as the grid's look-ups in Python.
template <bool SR> inline uint8_t encode(float x, float mul, float u) {
  float v = x * mul;
  v = -kMax > v ? -kMax : v;
  v = v > kMax ? kMax : v;
  const float a = std::fabs(v);
  int32_t mag;
  if constexpr (SR) {
    const int32_t half_steps = int32_t(a >= 0.5f) + int32_t(a >= 1.0f) + int32_t(a >= 1.5f) + int32_t(a >= 2.0f);
    const int32_t whole_steps = int32_t(a >= 3.0f) + int32_t(a >= 4.0f);
    const int32_t top = int32_t(a >= 6.0f);
    const float lo_value = 0.5f * float(half_steps) + float(whole_steps) + 2.0f * float(top);
    const float step = 0.5f + 0.5f * float(int32_t(a >= 2.0f)) + float(int32_t(a >= 4.0f)) - 2.0f * float(top);
    mag = half_steps + whole_steps + top + int32_t(u * step < a - lo_value);
  } else {
    mag = int32_t(a > 0.25f) + int32_t(a >= 0.75f) + int32_t(a > 1.25f) + int32_t(a >= 1.75f) + int32_t(a > 2.5f) +
          int32_t(a >= 3.5f) + int32_t(a > 5.0f);
  }
  return static_cast<uint8_t>(mag | int32_t((f2u(v) >> 28) & 8u));
}

#if defined(__AVX2__)
// encode<SR> on 8 lanes, the same float operations: the codes as int32 lanes. maxps(a, b) is
// a > b ? a : b and minps(a, b) a < b ? a : b, the scalar clamp's selects.
template <bool SR> inline __m256i encode8(__m256 x, __m256 mul, __m256 u) {
  __m256 v = _mm256_mul_ps(x, mul);
  v = _mm256_max_ps(_mm256_set1_ps(-kMax), v);
  v = _mm256_min_ps(_mm256_set1_ps(kMax), v);
  const __m256 a = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  // a mask is -1 where true: subtracting masks counts them
  auto count = [&](__m256i n, float bound, bool inclusive) {
    const __m256 m = inclusive ? _mm256_cmp_ps(a, _mm256_set1_ps(bound), _CMP_GE_OQ)
                               : _mm256_cmp_ps(a, _mm256_set1_ps(bound), _CMP_GT_OQ);
    return _mm256_sub_epi32(n, _mm256_castps_si256(m));
  };
  __m256i mag = _mm256_setzero_si256();
  if constexpr (SR) {
    __m256i half_steps = count(count(count(count(mag, 0.5f, true), 1.0f, true), 1.5f, true), 2.0f, true);
    __m256i whole_steps = count(count(mag, 3.0f, true), 4.0f, true);
    __m256i top = count(mag, 6.0f, true);
    const __m256 lo_value = _mm256_add_ps(
        _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), _mm256_cvtepi32_ps(half_steps)), _mm256_cvtepi32_ps(whole_steps)),
        _mm256_mul_ps(_mm256_set1_ps(2.0f), _mm256_cvtepi32_ps(top)));
    const __m256 step = _mm256_sub_ps(
        _mm256_add_ps(_mm256_add_ps(_mm256_set1_ps(0.5f),
                                    _mm256_mul_ps(_mm256_set1_ps(0.5f), _mm256_cvtepi32_ps(count(mag, 2.0f, true)))),
                      _mm256_cvtepi32_ps(count(mag, 4.0f, true))),
        _mm256_mul_ps(_mm256_set1_ps(2.0f), _mm256_cvtepi32_ps(top)));
    const __m256 up = _mm256_cmp_ps(_mm256_mul_ps(u, step), _mm256_sub_ps(a, lo_value), _CMP_LT_OQ);
    mag = _mm256_sub_epi32(_mm256_add_epi32(_mm256_add_epi32(half_steps, whole_steps), top), _mm256_castps_si256(up));
  } else {
    mag = count(count(count(count(count(count(count(mag, 0.25f, false), 0.75f, true), 1.25f, false), 1.75f, true),
                                  2.5f, false), 3.5f, true), 5.0f, false);
  }
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 28), _mm256_set1_epi32(8));
  return _mm256_or_si256(mag, sign);
}

// 16 consecutive values (and draws) of one block: 8 packed bytes, code 2k in the low nibble of
// byte k. Even and odd elements go to separate vectors, so that a byte is even | odd << 4.
template <bool SR> inline void encode16(const float* x, float mul, const float* u, uint8_t* out) {
  const __m256 lo = _mm256_loadu_ps(x), hi = _mm256_loadu_ps(x + 8);
  // lanes: elements 0 2 8 10 4 6 12 14 (even), 1 3 9 11 5 7 13 15 (odd): pairs 0 1 4 5 2 3 6 7
  const __m256 even = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
  const __m256 odd = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
  __m256 u_even = _mm256_setzero_ps(), u_odd = _mm256_setzero_ps();
  if constexpr (SR) {
    const __m256 ulo = _mm256_loadu_ps(u), uhi = _mm256_loadu_ps(u + 8);
    u_even = _mm256_shuffle_ps(ulo, uhi, _MM_SHUFFLE(2, 0, 2, 0));
    u_odd = _mm256_shuffle_ps(ulo, uhi, _MM_SHUFFLE(3, 1, 3, 1));
  }
  const __m256 m = _mm256_set1_ps(mul);
  __m256i pairs = _mm256_or_si256(encode8<SR>(even, m, u_even), _mm256_slli_epi32(encode8<SR>(odd, m, u_odd), 4));
  pairs = _mm256_permutevar8x32_epi32(pairs, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));  // pairs 0..7
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
  const __m128i bytes = _mm_packus_epi16(words, words);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), bytes);
}
#endif

void check_operand(const at::Tensor& x, int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "mixprec fp4 ", what,
              ": the operand must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "mixprec fp4 ", what, ": the operand must be float32, bfloat16 or float16");
  TORCH_CHECK(rows > 0 && cols > 0 && cols % 2 == 0, "mixprec fp4 ", what, ": bad block ", rows, "x", cols);
}

inline int64_t blocks(int64_t n, int64_t size) { return (n + size - 1) / size; }

// Runs body with COLS the block width as a constant where it is one of the recipes' (16, 32),
// else 0 (read from cols at run time): fixed-length inner loops vectorize.
#define MIXPREC_FP4_COLS(cols, ...)                                            \
  [&] {                                                                        \
    if (cols == 16) { constexpr int64_t COLS = 16; return __VA_ARGS__(); }     \
    if (cols == 32) { constexpr int64_t COLS = 32; return __VA_ARGS__(); }     \
    constexpr int64_t COLS = 0; return __VA_ARGS__();                          \
  }()

// The row x[0, n) as float32 into out[0, padded), zeros after n.
template <typename T> inline void load_row(const T* __restrict x, float* __restrict out, int64_t n, int64_t padded) {
  for (int64_t j = 0; j < n; ++j) out[j] = to_float(x[j]);
  for (int64_t j = n; j < padded; ++j) out[j] = 0.0f;
}

// Each block's max |x|. On the bits of |x| (sign cleared), where integer order is float order
// (NaN above infinity): exact, and a maximum of integers vectorizes. A block holding a NaN gets
// a NaN (Python then takes the torch path).
template <typename T, int64_t COLS>
void block_amax(const T* x, float* out, int64_t n_rows, int64_t n_cols, int64_t rows, int64_t cols_) {
  const int64_t cols = COLS ? COLS : cols_;
  const int64_t nbr = blocks(n_rows, rows), nbc = blocks(n_cols, cols), padded = nbc * cols;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, rows * n_cols));
  at::parallel_for(0, nbr, grain, [&, x, out](int64_t begin, int64_t end) {
    std::vector<float> buffer(padded);
    std::vector<uint32_t> best(nbc);
    float* __restrict values = buffer.data();
    uint32_t* __restrict m = best.data();
    for (int64_t bi = begin; bi < end; ++bi) {
      std::fill(best.begin(), best.end(), 0u);
      for (int64_t i = bi * rows; i < std::min(n_rows, (bi + 1) * rows); ++i) {
        load_row(x + i * n_cols, values, n_cols, padded);
        for (int64_t bj = 0; bj < nbc; ++bj) {
          const float* __restrict v = values + bj * cols;
          uint32_t mb = m[bj];
          for (int64_t k = 0; k < cols; ++k) {
            const uint32_t a = f2u(v[k]) & 0x7FFFFFFFu;
            mb = a > mb ? a : mb;
          }
          m[bj] = mb;
        }
      }
      for (int64_t bj = 0; bj < nbc; ++bj)
        out[bi * nbc + bj] = m[bj] > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : u2f(m[bj]);
    }
  });
}

at::Tensor fp4_block_amax(const at::Tensor& x, int64_t rows, int64_t cols) {
  check_operand(x, rows, cols, "block_amax");
  const int64_t n_rows = x.size(0), n_cols = x.size(1);
  at::Tensor out = at::empty({blocks(n_rows, rows), blocks(n_cols, cols)}, x.options().dtype(at::kFloat));
  MIXPREC_FLOAT_TYPE(x.scalar_type(), [&] {
    MIXPREC_FP4_COLS(cols, [&] {
      block_amax<T, COLS>(x.const_data_ptr<T>(), out.data_ptr<float>(), n_rows, n_cols, rows, cols);
    });
  });
  return out;
}

template <typename T, bool SR, int64_t COLS>
void encode_rows(const T* x, const float* mul, const float* rand, uint8_t* out, int64_t n_rows, int64_t n_cols,
                 int64_t rows, int64_t cols_) {
  const int64_t cols = COLS ? COLS : cols_;
  const int64_t nbc = blocks(n_cols, cols), padded = nbc * cols, padded_rows = blocks(n_rows, rows) * rows;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, padded));
  at::parallel_for(0, padded_rows, grain, [&, x, mul, rand, out](int64_t begin, int64_t end) {
    std::vector<float> buffer(padded, 0.0f);  // the row as float32, zero-padded
    float* __restrict values = buffer.data();
#if !defined(__AVX2__)
    std::vector<uint8_t> code_buffer(padded);
    uint8_t* __restrict codes = code_buffer.data();
#endif
    for (int64_t i = begin; i < end; ++i) {
      if (i < n_rows) load_row(x + i * n_cols, values, n_cols, padded);
      else std::fill(buffer.begin(), buffer.end(), 0.0f);
      const float* m = mul + (i / rows) * nbc;
      const float* __restrict u = SR ? rand + i * padded : nullptr;
      uint8_t* __restrict o = out + i * (padded / 2);
#if defined(__AVX2__)
      for (int64_t j = 0; j < padded; j += 16) encode16<SR>(values + j, m[j / cols], SR ? u + j : nullptr, o + j / 2);
#else
      for (int64_t bj = 0; bj < nbc; ++bj) {
        const float mb = m[bj];
        const int64_t j0 = bj * cols;
        for (int64_t k = 0; k < cols; ++k) codes[j0 + k] = encode<SR>(values[j0 + k], mb, SR ? u[j0 + k] : 0.0f);
      }
      for (int64_t k = 0; k < padded / 2; ++k) o[k] = static_cast<uint8_t>(codes[2 * k] | (codes[2 * k + 1] << 4));
#endif
    }
  });
}

at::Tensor fp4_encode(const at::Tensor& x, const at::Tensor& mul, int64_t rows, int64_t cols,
                      const std::optional<at::Tensor>& rand) {
  check_operand(x, rows, cols, "encode");
  TORCH_CHECK(cols % 16 == 0, "mixprec fp4 encode: blocks are 16 or 32 wide, got ", cols);
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
  MIXPREC_FLOAT_TYPE(x.scalar_type(), [&] {
    MIXPREC_FP4_COLS(cols, [&] {
      if (r != nullptr)
        encode_rows<T, true, COLS>(x.const_data_ptr<T>(), mul.const_data_ptr<float>(), r, out.data_ptr<uint8_t>(),
                                   n_rows, n_cols, rows, cols);
      else
        encode_rows<T, false, COLS>(x.const_data_ptr<T>(), mul.const_data_ptr<float>(), nullptr,
                                    out.data_ptr<uint8_t>(), n_rows, n_cols, rows, cols);
    });
  });
  return out;
}

// Per block, the 16 values its codes stand for (e2m1 value times the block's scale, a float32
// product rounded once to T), then one look-up per element.
template <typename T, int64_t COLS>
void decode_rows(const uint8_t* codes, const float* scale, T* out, int64_t n_rows, int64_t n_cols, int64_t rows,
                 int64_t cols_, int64_t packed_cols) {
  const int64_t cols = COLS ? COLS : cols_;
  const int64_t nbc = packed_cols * 2 / cols;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, n_cols));
  at::parallel_for(0, n_rows, grain, [&, codes, scale, out](int64_t begin, int64_t end) {
    std::vector<T> row_buffer(nbc * cols);
    T* __restrict row = row_buffer.data();
    T table[16];
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* __restrict c = codes + i * packed_cols;
      const float* s = scale + (i / rows) * nbc;
      for (int64_t bj = 0; bj < nbc; ++bj) {
        const float sb = s[bj];
        for (int k = 0; k < 16; ++k) table[k] = static_cast<T>(kValues[k] * sb);
        const uint8_t* __restrict cb = c + bj * cols / 2;
        T* __restrict o = row + bj * cols;
        for (int64_t k = 0; k < cols / 2; ++k) {
          o[2 * k] = table[cb[k] & 0xF];
          o[2 * k + 1] = table[cb[k] >> 4];
        }
      }
      std::memcpy(out + i * n_cols, row, n_cols * sizeof(T));
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
  MIXPREC_FLOAT_TYPE(dtype, [&] {
    MIXPREC_FP4_COLS(cols, [&] {
      decode_rows<T, COLS>(codes.const_data_ptr<uint8_t>(), scale.const_data_ptr<float>(), out.data_ptr<T>(), n_rows,
                           n_cols, rows, cols, codes.size(1));
    });
  });
  return out;
}

constexpr float kE4M3Max = 448.0f;
constexpr float kE4M3Tiny = 0x1p-6f;  // torchao's E4M3_EPS: the smallest normal e4m3

void check_scales(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous(), "mixprec fp4 ", what,
              ": the block scales must be a contiguous 2-D CPU tensor");
}

// _block_scales (_fp4.py) for e4m3 block scales, each float operation torch's, in its order:
// tensor_scale = where(t > 0, t / (448 * 6), 1) of the tensor amax t (the blocks' max, NaN where
// one is; or the one given: a tensor-parallel operand's, all-reduced), each block's scale
// clamp(amax / 6 / tensor_scale, 2**-6 (0 with subnormal scales), 448) rounded to e4m3 (c10's
// conversion: torch's), its multiplier (1 / tensor_scale) / scale (capped at float32's max with
// subnormal scales); and whether every multiplier is finite (where one is not, Python takes the
// torch code, which handles NaN and infinity as torch does).
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> fp4_nvfp4_scales(const at::Tensor& amax,
                                                                     const std::optional<at::Tensor>& tensor_amax,
                                                                     bool subnormal) {
  check_scales(amax, "nvfp4_scales");
  TORCH_CHECK(amax.scalar_type() == at::kFloat, "mixprec fp4 nvfp4_scales: the block amaxes must be float32");
  const int64_t n = amax.numel();
  const float* a = amax.const_data_ptr<float>();
  float t = 0.0f;
  if (tensor_amax.has_value()) {
    TORCH_CHECK(tensor_amax->device().is_cpu() && tensor_amax->scalar_type() == at::kFloat &&
                    tensor_amax->numel() == 1,
                "mixprec fp4 nvfp4_scales: the tensor amax must be one float32 CPU value");
    t = *tensor_amax->const_data_ptr<float>();
  } else {
    for (int64_t i = 0; i < n; ++i) {  // torch.max: NaN wins
      if (std::isnan(a[i])) { t = a[i]; break; }
      t = std::max(t, a[i]);
    }
  }
  const float tensor_scale = t == 0.0f ? 1.0f : t / (kE4M3Max * kMax);  // a NaN amax: a NaN scale, as torchao
  const float inverse = 1.0f / tensor_scale;
  const float lo = subnormal ? 0.0f : kE4M3Tiny;
  at::Tensor scales = at::empty(amax.sizes(), amax.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor mul = at::empty(amax.sizes(), amax.options());
  uint8_t* s = reinterpret_cast<uint8_t*>(scales.data_ptr<c10::Float8_e4m3fn>());
  float* __restrict m = mul.data_ptr<float>();
  // three passes, so that the divisions vectorize: each block's scale before rounding (std::max and
  // std::min keep a NaN), its e4m3 bits, its multiplier from the scale's exact float32 value
  for (int64_t i = 0; i < n; ++i) m[i] = std::min(std::max(a[i] / kMax / tensor_scale, lo), kE4M3Max);
  for (int64_t i = 0; i < n; ++i) s[i] = c10::detail::fp8e4m3fn_from_fp32_value(m[i]);
  const float* values = fp8_code_values(true);
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    float v = inverse / values[s[i]];
    if (subnormal) v = std::isnan(v) ? v : std::min(v, std::numeric_limits<float>::max());
    m[i] = v;
    finite = finite && std::isfinite(v);
  }
  return {scales, at::full({}, tensor_scale, amax.options()), mul, finite};
}

// fp4_decode of NVFP4 codes with each block's scale tensor_scale * its e4m3 scale (a float32
// product, as Fp4Tensor.dequantize's torch code), and whether every such scale is finite (where
// one is not, nothing is decoded: Python takes the torch code).
std::tuple<at::Tensor, bool> fp4_nvfp4_decode(const at::Tensor& codes, const at::Tensor& scales,
                                               const at::Tensor& tensor_scale, int64_t rows, int64_t cols,
                                               int64_t n_rows, int64_t n_cols, at::ScalarType dtype) {
  check_scales(scales, "nvfp4_decode");
  TORCH_CHECK(scales.scalar_type() == at::kFloat8_e4m3fn && tensor_scale.device().is_cpu() &&
                  tensor_scale.scalar_type() == at::kFloat && tensor_scale.numel() == 1,
              "mixprec fp4 nvfp4_decode: the block scales must be float8_e4m3fn, the tensor scale one float32 value");
  const float ts = *tensor_scale.const_data_ptr<float>();
  const uint8_t* s = reinterpret_cast<const uint8_t*>(scales.const_data_ptr<c10::Float8_e4m3fn>());
  const float* values = fp8_code_values(true);
  at::Tensor scale = at::empty(scales.sizes(), scales.options().dtype(at::kFloat));
  float* __restrict out = scale.data_ptr<float>();
  bool finite = true;
  for (int64_t i = 0; i < scales.numel(); ++i) {
    out[i] = ts * values[s[i]];
    finite = finite && std::isfinite(out[i]);
  }
  if (!finite) return {at::empty({0}, codes.options().dtype(dtype)), false};
  return {fp4_decode(codes, scale, rows, cols, n_rows, n_cols, dtype), true};
}

// The generator's engine as uniform_real_distribution reads it (random()), held in a local copy
// while the draws are made: torch's CPUGeneratorImpl::random() is the same engine call, out of line.
struct LocalEngine {
  at::mt19937 engine;
  uint32_t random() { return engine(); }
};

// torch.rand(n, generator=generator) for a CPU generator: the loop of torch's uniform_kernel
// (ATen/native/cpu/DistributionTemplates.h: one number per element, in order, under the
// generator's lock) on a copy of its engine, written back after. Python checks once per process
// that both give the same numbers and leave the generator in the same state, and draws with
// torch where they do not.
at::Tensor fp4_uniform(int64_t n, const std::optional<at::Generator>& generator) {
  TORCH_CHECK(n >= 0, "mixprec fp4 uniform: n must be >= 0, got ", n);
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(generator, at::detail::getDefaultCPUGenerator());
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  std::lock_guard<std::mutex> lock(gen->mutex_);
  LocalEngine local{gen->engine()};
  at::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float value = static_cast<float>(uniform(&local));
    o[i] = value == 1.0f ? 0.0f : value;
  }
  gen->set_engine(local.engine);
  return out;
}

// SplitMix64's finalizer after its step (_mix64 in _fp4.py), on the 64 bits as unsigned.
inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// RoundingKey.draws (mixprec/formats/_fp4.py) of n elements from its state: output i of SplitMix64's
// stream from the state gives element i (its bits 8..31) and element i + ceil(n / 2) (bits
// 40..63), each k / 2**24. Wrapping int64 arithmetic there is this unsigned arithmetic.
at::Tensor fp4_key_draws(int64_t state, int64_t n) {
  TORCH_CHECK(n >= 0, "mixprec fp4 key_draws: n must be >= 0, got ", n);
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int64_t half = (n + 1) / 2;
  const uint64_t start = static_cast<uint64_t>(state);
  at::parallel_for(0, half, kGrain, [&, o](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t z = mix64(static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull + start);
      o[i] = static_cast<float>((z >> 8) & 0xFFFFFFu) * 0x1p-24f;
      if (i + half < n) o[i + half] = static_cast<float>((z >> 40) & 0xFFFFFFu) * 0x1p-24f;
    }
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
  at::parallel_for(0, n_rows, grain, [&, c, o](int64_t begin, int64_t end) {
    std::vector<uint8_t> row_buffer(packed_cols * 2);
    uint8_t* __restrict row = row_buffer.data();
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* __restrict ci = c + i * packed_cols;
      for (int64_t k = 0; k < packed_cols; ++k) {
        row[2 * k] = ci[k] & 0x7;
        row[2 * k + 1] = (ci[k] >> 4) & 0x7;
      }
      std::memcpy(o + i * n_cols, row, n_cols);
    }
  });
  return out;
}

}  // namespace mixprec_fp4

TORCH_LIBRARY_FRAGMENT(mixprec_native, m) {
  m.def("fp4_block_amax(Tensor x, int rows, int cols) -> Tensor");
  m.def("fp4_encode(Tensor x, Tensor mul, int rows, int cols, Tensor? rand) -> Tensor");
  m.def("fp4_decode(Tensor codes, Tensor scale, int rows, int cols, int n_rows, int n_cols, ScalarType dtype) -> Tensor");
  m.def("fp4_nvfp4_scales(Tensor amax, Tensor? tensor_amax, bool subnormal) -> (Tensor, Tensor, Tensor, bool)");
  m.def("fp4_nvfp4_decode(Tensor codes, Tensor scales, Tensor tensor_scale, int rows, int cols, int n_rows, int n_cols, "
        "ScalarType dtype) -> (Tensor, bool)");
  m.def("fp4_magnitudes(Tensor codes, int n_rows, int n_cols) -> Tensor");
  m.def("fp4_uniform(int n, Generator? generator) -> Tensor");
  m.def("fp4_key_draws(int state, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(mixprec_native, CPU, m) {
  m.impl("fp4_block_amax", &mixprec_fp4::fp4_block_amax);
  m.impl("fp4_encode", &mixprec_fp4::fp4_encode);
  m.impl("fp4_decode", &mixprec_fp4::fp4_decode);
  m.impl("fp4_nvfp4_scales", &mixprec_fp4::fp4_nvfp4_scales);
  m.impl("fp4_nvfp4_decode", &mixprec_fp4::fp4_nvfp4_decode);
  m.impl("fp4_magnitudes", &mixprec_fp4::fp4_magnitudes);
}

// fp4_uniform and fp4_key_draws take no tensor to dispatch on: one kernel for every key (it makes CPU tensors).
TORCH_LIBRARY_IMPL(mixprec_native, CompositeExplicitAutograd, m) {
  m.impl("fp4_uniform", &mixprec_fp4::fp4_uniform);
  m.impl("fp4_key_draws", &mixprec_fp4::fp4_key_draws);
}

// The float dtypes mixprec's CPU kernels read (float32, bfloat16, float16) as C++ types and the fp8
// codes' values, shared by fp4_kernel.cpp, fp8_kernel.cpp and stats_kernel.cpp (hashed with them into
// the build's key: mixprec/_native.py).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <array>
#include <cstdint>
#include <cstring>

namespace mixprec_native {

inline uint32_t f2u(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float u2f(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

// A value as float32, exactly (bfloat16 by its bits: the upper half of a float32).
template <typename T> inline float to_float(T x) { return static_cast<float>(x); }
template <> inline float to_float<c10::BFloat16>(c10::BFloat16 x) { return u2f(uint32_t(x.x) << 16); }

// Each fp8 code's float32 value by its bits (c10's conversion: torch's), e4m3fn or e5m2.
inline const float* fp8_code_values(bool e4m3) {
  static const auto tables = [] {
    std::array<std::array<float, 256>, 2> t{};
    for (int code = 0; code < 256; ++code) {
      t[0][code] = c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(code));
      t[1][code] = c10::detail::fp8e5m2_to_fp32_value(static_cast<uint8_t>(code));
    }
    return t;
  }();
  return tables[e4m3 ? 0 : 1].data();
}

}  // namespace mixprec_native

// Runs body with T the C++ type of dtype (float32, bfloat16 or float16: callers check it is one).
#define MIXPREC_FLOAT_TYPE(dtype, ...)                                         \
  [&] {                                                                        \
    switch (dtype) {                                                           \
      case at::kFloat: { using T = float; return __VA_ARGS__(); }              \
      case at::kBFloat16: { using T = c10::BFloat16; return __VA_ARGS__(); }   \
      default: { using T = c10::Half; return __VA_ARGS__(); }                  \
    }                                                                          \
  }()

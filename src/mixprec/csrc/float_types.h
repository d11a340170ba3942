// The float dtypes mixprec's CPU kernels read (float32, bfloat16, float16) as C++ types, shared by
// fp4_kernel.cpp and stats_kernel.cpp (hashed with them into the build's key: mixprec/_native.py).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace mixprec_native {

inline uint32_t f2u(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float u2f(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

// A value as float32, exactly (bfloat16 by its bits: the upper half of a float32).
template <typename T> inline float to_float(T x) { return static_cast<float>(x); }
template <> inline float to_float<c10::BFloat16>(c10::BFloat16 x) { return u2f(uint32_t(x.x) << 16); }

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

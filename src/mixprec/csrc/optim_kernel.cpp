// mixprec's fused optimizer steps for low-precision parameters on the CPU (see mixprec/optim/_fused.py).
//
// One pass over each parameter: read the bfloat16/float16 weight (plus its Kahan buffer or exact
// low bits) and its moments (float32, or 8-bit codes dequantized block by block) into float32,
// apply the update, and write everything back: the weight to nearest, through the Kahan buffer,
// as bfloat16 + int16 low bits, or stochastically rounded with random bits drawn from the
// optimizer's generator in the order the Python paths draw them; 8-bit moments re-quantized.
// The update is the float32 arithmetic of the vectorized body of torch's fused CPU kernels
// (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, FusedSGDKernel.cpp) as torch's build compiles
// it, fused multiply-adds included: each std::fma below is one the compiler formed there, and
// -ffp-contract=off forms no other. Every element is computed alike; torch's kernel rounds its
// scalar tail (the last numel % vector-width elements) differently. Python checks once per
// process that both agree bitwise on this machine, and uses this kernel only if they do.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace mixprec_optim {

constexpr int64_t kGrain = 1 << 15;

enum Mode : int64_t { kNearest = 0, kKahan = 1, kExact = 2, kStochastic = 3 };

// Stochastic rounding draws its random bits per chunk of this many elements, in order, from the
// optimizer's generator: the same numbers as one draw over the whole tensor (torch's CPU
// generator fills int32 tensors sequentially), without a 4-byte-per-element temporary.
constexpr int64_t kNoiseChunk = 1 << 17;

inline uint32_t f2u(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float u2f(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

template <typename T> inline float to_float(T x) { return static_cast<float>(x); }
template <> inline float to_float<c10::BFloat16>(c10::BFloat16 x) { return u2f(uint32_t(x.x) << 16); }

// float -> bfloat16 bits, rounded to nearest even as torch's conversion; NaN -> NaN
inline uint16_t bf16_bits(float x) {
  uint32_t u = f2u(x);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(x != x ? 0x7FC0u : rounded);
}

// Round x to P's precision: the bits stored (rounded) and their value (value).
template <typename P> inline void round_to(float x, P& rounded, float& value) {
  rounded = static_cast<P>(x);
  value = static_cast<float>(rounded);
}
template <> inline void round_to<c10::BFloat16>(float x, c10::BFloat16& rounded, float& value) {
  rounded.x = bf16_bits(x);
  value = u2f(uint32_t(rounded.x) << 16);
}

// The element type of a parameter's companion array: int16 low bits (exact), random bits
// (stochastic rounding), or a Kahan buffer of P.
template <typename P, int MODE>
using Comp = std::conditional_t<MODE == kExact, int16_t, std::conditional_t<MODE == kStochastic, int32_t, P>>;

// The float32 value a parameter stands for, and writing a float32 value back (see exact.py, kahan.py).
template <typename P, int MODE>
inline float load_param(const P* p, const Comp<P, MODE>* comp, int64_t i) {
  if constexpr (MODE == kExact) {
    const uint32_t hi = uint32_t(p[i].x) << 16;
    const int32_t lo = comp[i];
    // exact.drop_stale_low_bits: a finite weight whose sum is not is read alone. Only +-0.0 under
    // negative low bits (a weight zeroed from outside: the sum wraps into a NaN) is such a pair.
    const uint32_t keep = ((hi << 1) == 0u && lo < 0) ? 0u : 0xFFFFFFFFu;
    return u2f(hi + (static_cast<uint32_t>(lo) & keep));
  } else if constexpr (MODE == kKahan) {
    return to_float(p[i]) + to_float(comp[i]);
  } else {
    return to_float(p[i]);
  }
}

template <typename P, int MODE>
inline void store_param(P* p, Comp<P, MODE>* comp, int64_t i, float x) {
  if constexpr (MODE == kExact) {
    uint32_t bits = f2u(x);
    int16_t lo = static_cast<int16_t>(static_cast<uint16_t>(bits & 0xFFFFu));
    uint32_t hi = bits - static_cast<uint32_t>(static_cast<int32_t>(lo));
    p[i].x = static_cast<uint16_t>(hi >> 16);
    comp[i] = lo;
  } else if constexpr (MODE == kStochastic) {  // as mixprec.optim.rounding.stochastic_round_
    const uint32_t bits = f2u(x);
    const uint32_t rounded = (bits + (static_cast<uint32_t>(comp[i]) & 0xFFFFu)) & 0xFFFF0000u;
    p[i].x = (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : static_cast<uint16_t>(rounded >> 16);
  } else if constexpr (MODE == kKahan) {
    float value, unused;
    round_to<P>(x, p[i], value);
    round_to<P>(x - value, comp[i], unused);
  } else {
    float unused;
    round_to<P>(x, p[i], unused);
  }
}

struct AdamHyper {
  float grad_factor;  // 1 / loss scale (or 1), negated to maximize
  float decay;        // 1 - lr * weight_decay, or 1 without weight decay
  float coeff;        // the moving average's lerp: weight (1 - beta1) or weight - 1 ...
  bool small;         // ... as the weight is below 0.5 or not
  float beta2, c2;    // exp_avg_sq * beta2 + (1 - beta2) * g * g
  float bc2_sqrt, eps, neg_step_size;
};

// The gradient's factor: 1 / loss scale (a float32 scalar) or 1, negated to maximize. Negation
// is exact, so multiplying by -inv gives the bits of unscaling first and negating after.
inline float grad_factor(const std::optional<at::Tensor>& inv_scale, bool maximize) {
  float factor = 1.0f;
  if (inv_scale.has_value()) {
    TORCH_CHECK(inv_scale->device().is_cpu() && inv_scale->scalar_type() == at::kFloat && inv_scale->numel() == 1,
                "mixprec fused optimizer: inv_scale must be a float32 CPU scalar");
    factor = *inv_scale->data_ptr<float>();
  }
  return maximize ? -factor : factor;
}

// Each range is walked in blocks of kBlock elements, in three loops: read the parameters' and
// gradients' float32 values into buffers on the stack, update in float32, write back. Each loop
// touches few types, so GCC vectorizes all three (one loop doing everything is left scalar for
// some write-back rules); the buffers stay in L1, so memory is still read and written once.
// The loops read every hyper-parameter into a local first (a store through an output pointer
// could otherwise alias them) and branch only by select or at compile time (GCC does not
// vectorize a loop with an `if` on a loop-invariant flag). Multiplying by 1 is exact, so the
// gradient factor and AdamW's decay are always applied.
constexpr int64_t kBlock = 256;

#if defined(__F16C__)
// float16 <-> float32, 8 at a time with F16C (round to nearest even, as torch), the rest one by one:
// GCC does not vectorize c10::Half's scalar conversions.
inline void half_to_float(const c10::Half* __restrict__ in, float* __restrict__ out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = static_cast<float>(in[i]);
}

inline void float_to_half(const float* __restrict__ in, c10::Half* __restrict__ out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = static_cast<c10::Half>(in[i]);
}
constexpr bool kF16C = true;
#else
inline void half_to_float(const c10::Half*, float*, int64_t) {}
inline void float_to_half(const float*, c10::Half*, int64_t) {}
constexpr bool kF16C = false;
#endif

template <typename P, typename G, int MODE>
inline void load_block(const P* __restrict__ p, const Comp<P, MODE>* __restrict__ comp, const G* __restrict__ g,
                       float* __restrict__ x, float* __restrict__ gr, int64_t n) {
  if constexpr (kF16C && std::is_same_v<P, c10::Half>) {
    half_to_float(p, x, n);
    if constexpr (MODE == kKahan) {
      alignas(64) float c[kBlock];
      half_to_float(comp, c, n);
      for (int64_t i = 0; i < n; ++i) x[i] = x[i] + c[i];
    }
    if constexpr (std::is_same_v<G, c10::Half>) {
      half_to_float(g, gr, n);
    } else {
      for (int64_t i = 0; i < n; ++i) gr[i] = to_float(g[i]);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    x[i] = load_param<P, MODE>(p, comp, i);
    gr[i] = to_float(g[i]);
  }
}

template <typename P, int MODE>
inline void store_block(P* __restrict__ p, Comp<P, MODE>* __restrict__ comp, const float* __restrict__ x, int64_t n) {
  if constexpr (kF16C && std::is_same_v<P, c10::Half>) {
    float_to_half(x, p, n);
    if constexpr (MODE == kKahan) {  // what rounding lost, rounded in turn
      alignas(64) float rest[kBlock];
      half_to_float(p, rest, n);
      for (int64_t i = 0; i < n; ++i) rest[i] = x[i] - rest[i];
      float_to_half(rest, comp, n);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) store_param<P, MODE>(p, comp, i, x[i]);
}

template <bool AMSGRAD>
inline void adam_block(float* __restrict__ x, const float* __restrict__ g, float* __restrict__ m,
                       float* __restrict__ v, float* __restrict__ vmax, int64_t n, const AdamHyper& h) {
  const float grad_factor = h.grad_factor, decay = h.decay, coeff = h.coeff, beta2 = h.beta2, c2 = h.c2;
  const float bc2_sqrt = h.bc2_sqrt, eps = h.eps, neg_step_size = h.neg_step_size;
  const bool small = h.small;
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i] * decay;
    const float gr = g[i] * grad_factor;
    const float e = m[i];
    const float avg = std::fma(coeff, gr - e, small ? e : gr);  // exp_avg.lerp_(grad, 1 - beta1)
    const float sq = std::fma(c2 * gr, gr, v[i] * beta2);
    m[i] = avg;
    v[i] = sq;
    float denom;
    if constexpr (AMSGRAD) {
      const float old = vmax[i];
      float mx = old > sq ? old : sq;  // torch's maximum: NaN if either is NaN
      mx = old != old ? old : mx;
      mx = sq != sq ? sq : mx;
      vmax[i] = mx;
      denom = std::sqrt(mx) / bc2_sqrt + eps;
    } else {
      denom = std::sqrt(sq) / bc2_sqrt + eps;
    }
    x[i] = xi + neg_step_size * avg / denom;
  }
}

// `comp` holds the companion values of elements comp_start onwards.
template <typename P, typename G, int MODE, bool AMSGRAD>
void adam_range(P* p, const G* g, float* m, float* v, float* vmax, Comp<P, MODE>* comp, int64_t comp_start,
                int64_t begin, int64_t end, const AdamHyper& h) {
  alignas(64) float x[kBlock], gr[kBlock];
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = std::min(kBlock, end - b);
    Comp<P, MODE>* c = MODE == kNearest ? nullptr : comp + (b - comp_start);
    load_block<P, G, MODE>(p + b, c, g + b, x, gr, n);
    adam_block<AMSGRAD>(x, gr, m + b, v + b, AMSGRAD ? vmax + b : nullptr, n, h);
    store_block<P, MODE>(p + b, c, x, n);
  }
}

// Call fn(begin, end, comp, comp_start) over [0, n) in parallel chunks that start at multiples
// of UNIT; for stochastic rounding, chunk by chunk with freshly drawn random bits as `comp`.
template <typename P, int MODE, int64_t UNIT, typename F>
void walk(int64_t n, void* comp, const std::optional<at::Generator>& generator, const F& fn) {
  auto run = [&](int64_t start, int64_t stop, Comp<P, MODE>* c, int64_t c0) {
    const int64_t units = (stop - start + UNIT - 1) / UNIT;
    at::parallel_for(0, units, std::max<int64_t>(kGrain / UNIT, 1), [&](int64_t b, int64_t e) {
      fn(start + b * UNIT, std::min(start + e * UNIT, stop), c, c0);
    });
  };
  if constexpr (MODE == kStochastic) {
    static_assert(kNoiseChunk % UNIT == 0, "random-bit chunks must hold whole units");
    for (int64_t start = 0; start < n; start += kNoiseChunk) {
      const int64_t stop = std::min(n, start + kNoiseChunk);
      at::Tensor noise = at::empty({stop - start}, at::kInt).random_(generator);
      run(start, stop, noise.data_ptr<int32_t>(), start);
    }
  } else {
    run(0, n, static_cast<Comp<P, MODE>*>(comp), 0);
  }
}

// One 8-bit moment (mixprec/optim/quant8.py): a code per element, a float32 absmax per block of
// kBlock elements, and the map's tables (values; per top-16-bit bucket, the count of midpoints
// below it and the one midpoint inside it).
struct Q8 {
  uint8_t* codes;
  float* absmax;
  const float* values;
  const int32_t* base;  // int32, not uint8: 32-bit tables let the loop gather with vectors
  const float* mid;
};

inline void dequantize_block(const Q8& q, int64_t block, float* __restrict__ out) {
  const uint8_t* codes = q.codes + block * kBlock;
  const float scale = q.absmax[block];
  for (int64_t i = 0; i < kBlock; ++i) out[i] = q.values[codes[i]] * scale;
}

// Quantize the first n values of buf (the rest of the block is padding: zeros), as
// Quantized8.quantize_: absmax (NaN-propagating), scale = 1 / max(absmax, tiny), nearest entry.
inline void quantize_block(const Q8& q, int64_t block, float* __restrict__ buf, int64_t n) {
  for (int64_t i = n; i < kBlock; ++i) buf[i] = 0.0f;
  // The largest |x| as the largest bit pattern of |x| (for non-negative floats the two orders
  // agree, and a NaN's pattern exceeds them all, so NaN propagates): an integer max vectorizes.
  uint32_t top = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const uint32_t bits = f2u(buf[i]) & 0x7FFFFFFFu;
    top = bits > top ? bits : top;
  }
  const float amax = u2f(top);
  q.absmax[block] = amax;
  const float tiny = std::numeric_limits<float>::min();
  const float scale = 1.0f / (amax < tiny ? tiny : amax);
  alignas(64) int32_t wide[kBlock];  // 32-bit codes first: a loop of one element size gathers with vectors
  for (int64_t i = 0; i < kBlock; ++i) {
    const float normalized = buf[i] * scale;
    const int32_t bucket = static_cast<int32_t>((f2u(normalized) >> 16) & 0xFFFFu);
    wide[i] = q.base[bucket] + (q.mid[bucket] < normalized ? 1 : 0);
  }
  uint8_t* codes = q.codes + block * kBlock;
  for (int64_t i = 0; i < kBlock; ++i) codes[i] = static_cast<uint8_t>(wide[i]);
}

// adam_range for 8-bit moments: begin is a multiple of kBlock (= the quantization block).
template <typename P, typename G, int MODE, bool AMSGRAD>
void adam_range_q8(P* p, const G* g, const Q8& m, const Q8& v, const Q8& vmax, Comp<P, MODE>* comp,
                   int64_t comp_start, int64_t begin, int64_t end, const AdamHyper& h) {
  alignas(64) float x[kBlock], gr[kBlock], mb[kBlock], vb[kBlock], vmb[kBlock];
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = std::min(kBlock, end - b);
    const int64_t block = b / kBlock;
    Comp<P, MODE>* c = MODE == kNearest ? nullptr : comp + (b - comp_start);
    load_block<P, G, MODE>(p + b, c, g + b, x, gr, n);
    dequantize_block(m, block, mb);
    dequantize_block(v, block, vb);
    if constexpr (AMSGRAD) dequantize_block(vmax, block, vmb);
    adam_block<AMSGRAD>(x, gr, mb, vb, AMSGRAD ? vmb : nullptr, n, h);
    quantize_block(m, block, mb, n);
    quantize_block(v, block, vb, n);
    if constexpr (AMSGRAD) quantize_block(vmax, block, vmb, n);
    store_block<P, MODE>(p + b, c, x, n);
  }
}

template <typename P, typename G, int MODE, bool AMSGRAD>
void adam_tensor_q8(const at::Tensor& param, const at::Tensor& grad, const Q8& m, const Q8& v, const Q8& vmax,
                    void* comp, const std::optional<at::Generator>& generator, const AdamHyper& h) {
  P* p = reinterpret_cast<P*>(param.data_ptr());
  const G* g = reinterpret_cast<const G*>(grad.data_ptr());
  walk<P, MODE, kBlock>(param.numel(), comp, generator,
                        [&](int64_t begin, int64_t end, Comp<P, MODE>* c, int64_t c0) {
    adam_range_q8<P, G, MODE, AMSGRAD>(p, g, m, v, vmax, c, c0, begin, end, h);
  });
}

template <typename P, typename G, int MODE, bool AMSGRAD>
void adam_tensor(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const at::Tensor* max_sq, void* comp,
                 const std::optional<at::Generator>& generator, const AdamHyper& h) {
  P* p = reinterpret_cast<P*>(param.data_ptr());
  const G* g = reinterpret_cast<const G*>(grad.data_ptr());
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  float* vmax = AMSGRAD ? max_sq->data_ptr<float>() : nullptr;
  walk<P, MODE, 1>(param.numel(), comp, generator, [&](int64_t begin, int64_t end, Comp<P, MODE>* c, int64_t c0) {
    adam_range<P, G, MODE, AMSGRAD>(p, g, m, v, vmax, c, c0, begin, end, h);
  });
}

// Run the statement with P, G (the parameter's and the gradient's element types) and MODE bound:
// the combinations the optimizers use (bfloat16/float16 parameters with gradients of their dtype
// or float32; float32 for the self-check against torch's kernels).
#define MIXPREC_CASE(P_, G_, MODE_, ...) { using P = P_; using G = G_; constexpr int MODE = MODE_; __VA_ARGS__; }
#define MIXPREC_MODES(P_, G_, MODE, ...)                                                            \
  if (MODE == kKahan) MIXPREC_CASE(P_, G_, kKahan, __VA_ARGS__)                                      \
  else if (MODE == kNearest) MIXPREC_CASE(P_, G_, kNearest, __VA_ARGS__)                             \
  else if constexpr (!std::is_same_v<P_, c10::BFloat16>) {                                           \
    TORCH_CHECK(false, "mixprec fused optimizer: exact low bits and stochastic rounding need bfloat16 parameters"); \
  }                                                                                                \
  else if (MODE == kExact) MIXPREC_CASE(P_, G_, kExact, __VA_ARGS__)                                  \
  else MIXPREC_CASE(P_, G_, kStochastic, __VA_ARGS__)
#define MIXPREC_TYPES(PT, GT, MODE, ...)                                                            \
  if (PT == at::kBFloat16 && GT == at::kBFloat16) { MIXPREC_MODES(c10::BFloat16, c10::BFloat16, MODE, __VA_ARGS__) } \
  else if (PT == at::kBFloat16 && GT == at::kFloat) { MIXPREC_MODES(c10::BFloat16, float, MODE, __VA_ARGS__) }   \
  else if (PT == at::kHalf && GT == at::kHalf) { MIXPREC_MODES(c10::Half, c10::Half, MODE, __VA_ARGS__) }        \
  else if (PT == at::kHalf && GT == at::kFloat) { MIXPREC_MODES(c10::Half, float, MODE, __VA_ARGS__) }           \
  else if (PT == at::kFloat && GT == at::kFloat && MODE == kNearest) MIXPREC_CASE(float, float, kNearest, __VA_ARGS__) \
  else TORCH_CHECK(false, "mixprec fused optimizer: unsupported parameter/gradient dtypes ", PT, "/", GT);

// The kernel walks every tensor of a parameter in storage order: they must be dense, on the CPU,
// and laid out alike (contiguous, or channels-last as a convolution's weight and its gradient).
void check_layout(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_non_overlapping_and_dense() && t.sizes() == like.sizes() &&
              t.strides() == like.strides(),
              "mixprec fused optimizer: ", what, " must be a dense CPU tensor laid out as the parameter");
}

void* comp_ptr(const std::vector<at::Tensor>& comps, size_t i, int64_t mode, const at::Tensor& param) {
  if (mode == kNearest || mode == kStochastic) return nullptr;
  TORCH_CHECK(comps.size() > i, "mixprec fused optimizer: missing compensation buffer");
  const at::Tensor& c = comps[i];
  check_layout(c, param, "a compensation buffer");
  TORCH_CHECK(mode == kExact ? c.scalar_type() == at::kShort : c.scalar_type() == param.scalar_type(),
              "mixprec fused optimizer: compensation buffer of the wrong dtype");
  return c.data_ptr();
}

void adamw_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList comps_in,
                at::TensorList state_steps, at::TensorList absmaxes, at::TensorList maps, double lr,
                double beta1, double beta2, double eps, double weight_decay, bool amsgrad, bool maximize,
                const std::optional<at::Tensor>& inv_scale, int64_t mode,
                const std::optional<at::Generator>& generator) {
  const size_t n = params.size();
  const bool q8 = !absmaxes.empty();  // 8-bit moments: codes in exp_avgs/..., absmaxes per moment
  TORCH_CHECK(!q8 || (absmaxes.size() == n * (amsgrad ? 3 : 2) && maps.size() == 6),
              "mixprec fused AdamW: 8-bit moments need an absmax per moment and the 6 map tables");
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
              state_steps.size() == n && (!amsgrad || max_exp_avg_sqs.size() == n),
              "mixprec fused AdamW: list lengths differ");
  std::vector<at::Tensor> comps(comps_in.begin(), comps_in.end());
  const float factor = grad_factor(inv_scale, maximize);
  const double lerp_weight = 1 - beta1;  // as torch: double, then each constant rounded to float
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& param = params[i];
    check_layout(param, param, "a parameter");
    check_layout(grads[i], param, "a gradient");
    Q8 q[3] = {};
    const at::Tensor* max_sq = nullptr;
    if (q8) {
      TORCH_CHECK(param.is_contiguous(), "mixprec fused AdamW: 8-bit moments need a contiguous parameter");
      for (int k = 0; k < (amsgrad ? 3 : 2); ++k) {
        const at::Tensor& codes = k == 0 ? exp_avgs[i] : k == 1 ? exp_avg_sqs[i] : max_exp_avg_sqs[i];
        const at::Tensor& absmax = absmaxes[k * n + i];
        const int64_t blocks = (param.numel() + kBlock - 1) / kBlock;
        TORCH_CHECK(codes.is_cpu() && codes.is_contiguous() && codes.scalar_type() == at::kByte &&
                    codes.numel() == blocks * kBlock && absmax.is_cpu() && absmax.is_contiguous() &&
                    absmax.scalar_type() == at::kFloat && absmax.numel() == blocks,
                    "mixprec fused AdamW: 8-bit moments must be uint8 codes of whole blocks and float32 absmaxes");
        const int table = k == 0 ? 0 : 3;  // exp_avg: the signed map; the squares: the unsigned one
        q[k] = Q8{codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), maps[table].data_ptr<float>(),
                  maps[table + 1].data_ptr<int32_t>(), maps[table + 2].data_ptr<float>()};
      }
    } else {
      check_layout(exp_avgs[i], param, "exp_avg");
      check_layout(exp_avg_sqs[i], param, "exp_avg_sq");
      TORCH_CHECK(exp_avgs[i].scalar_type() == at::kFloat && exp_avg_sqs[i].scalar_type() == at::kFloat,
                  "mixprec fused AdamW: moments must be float32");
      if (amsgrad) {
        max_sq = &max_exp_avg_sqs[i];
        check_layout(*max_sq, param, "max_exp_avg_sq");
        TORCH_CHECK(max_sq->scalar_type() == at::kFloat, "mixprec fused AdamW: max_exp_avg_sq must be float32");
      }
    }
    const double step = state_steps[i].item<float>();  // as torch's kernel
    const double bias_correction1 = 1 - std::pow(beta1, step);
    const double bias_correction2 = 1 - std::pow(beta2, step);
    const double step_size = lr / bias_correction1;
    AdamHyper h;
    h.decay = weight_decay != 0.f ? static_cast<float>(1 - lr * weight_decay) : 1.0f;
    const float weight = static_cast<float>(lerp_weight);
    h.small = std::abs(weight) < 0.5f;
    h.coeff = h.small ? weight : weight - 1.0f;
    h.beta2 = static_cast<float>(beta2);
    h.c2 = static_cast<float>(1 - beta2);
    h.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
    h.eps = static_cast<float>(eps);
    h.neg_step_size = static_cast<float>(-step_size);
    h.grad_factor = factor;
    void* comp = comp_ptr(comps, i, mode, param);
    const at::Tensor& grad = grads[i];
    const at::Tensor& m = exp_avgs[i];
    const at::Tensor& v = exp_avg_sqs[i];
    if (q8) {
      MIXPREC_TYPES(param.scalar_type(), grad.scalar_type(), mode,
                    if (amsgrad) adam_tensor_q8<P, G, MODE, true>(param, grad, q[0], q[1], q[2], comp, generator, h);
                    else adam_tensor_q8<P, G, MODE, false>(param, grad, q[0], q[1], q[2], comp, generator, h))
    } else {
      MIXPREC_TYPES(param.scalar_type(), grad.scalar_type(), mode,
                    if (amsgrad) adam_tensor<P, G, MODE, true>(param, grad, m, v, max_sq, comp, generator, h);
                    else adam_tensor<P, G, MODE, false>(param, grad, m, v, max_sq, comp, generator, h))
    }
  }
}

struct SgdHyper {
  float grad_factor, weight_decay, momentum, dampening_keep, neg_lr;
  bool first, nesterov;
};

template <bool DECAY, bool MOMENTUM>
inline void sgd_block(float* __restrict__ x, const float* __restrict__ g, float* __restrict__ buf, int64_t n,
                      const SgdHyper& h) {
  const float grad_factor = h.grad_factor, weight_decay = h.weight_decay, momentum = h.momentum;
  const float dampening_keep = h.dampening_keep, neg_lr = h.neg_lr;
  const bool first = h.first, nesterov = h.nesterov;
  for (int64_t i = 0; i < n; ++i) {
    float gr = g[i] * grad_factor;
    if constexpr (DECAY) gr = std::fma(x[i], weight_decay, gr);
    if constexpr (MOMENTUM) {
      const float b = first ? gr : std::fma(gr, dampening_keep, buf[i] * momentum);
      buf[i] = b;
      gr = nesterov ? std::fma(b, momentum, gr) : b;
    }
    x[i] = std::fma(gr, neg_lr, x[i]);
  }
}

template <typename P, typename G, int MODE, bool DECAY, bool MOMENTUM>
void sgd_range(P* p, const G* g, float* buf, Comp<P, MODE>* comp, int64_t comp_start, int64_t begin, int64_t end,
               const SgdHyper& h) {
  alignas(64) float x[kBlock], gr[kBlock];
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = std::min(kBlock, end - b);
    Comp<P, MODE>* c = MODE == kNearest ? nullptr : comp + (b - comp_start);
    load_block<P, G, MODE>(p + b, c, g + b, x, gr, n);
    sgd_block<DECAY, MOMENTUM>(x, gr, MOMENTUM ? buf + b : nullptr, n, h);
    store_block<P, MODE>(p + b, c, x, n);
  }
}

template <typename P, typename G, int MODE>
void sgd_tensor(const at::Tensor& param, const at::Tensor& grad, float* buf, void* comp, bool decay,
                bool momentum, const std::optional<at::Generator>& generator, const SgdHyper& h) {
  P* p = reinterpret_cast<P*>(param.data_ptr());
  const G* g = reinterpret_cast<const G*>(grad.data_ptr());
  walk<P, MODE, 1>(param.numel(), comp, generator, [&](int64_t begin, int64_t end, Comp<P, MODE>* c, int64_t c0) {
    if (decay && momentum) sgd_range<P, G, MODE, true, true>(p, g, buf, c, c0, begin, end, h);
    else if (decay) sgd_range<P, G, MODE, true, false>(p, g, buf, c, c0, begin, end, h);
    else if (momentum) sgd_range<P, G, MODE, false, true>(p, g, buf, c, c0, begin, end, h);
    else sgd_range<P, G, MODE, false, false>(p, g, buf, c, c0, begin, end, h);
  });
}

void sgd_step(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
              at::TensorList comps_in, c10::List<bool> first, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, bool maximize,
              const std::optional<at::Tensor>& inv_scale, int64_t mode,
              const std::optional<at::Generator>& generator) {
  const size_t n = params.size();
  const bool has_momentum = momentum != 0.0;
  TORCH_CHECK(grads.size() == n && (!has_momentum || (momentum_buffers.size() == n && first.size() == n)),
              "mixprec fused SGD: list lengths differ");
  std::vector<at::Tensor> comps(comps_in.begin(), comps_in.end());
  const float factor = grad_factor(inv_scale, maximize);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& param = params[i];
    check_layout(param, param, "a parameter");
    check_layout(grads[i], param, "a gradient");
    float* buf = nullptr;
    if (has_momentum) {
      check_layout(momentum_buffers[i], param, "a momentum buffer");
      TORCH_CHECK(momentum_buffers[i].scalar_type() == at::kFloat, "mixprec fused SGD: momentum buffers must be float32");
      buf = momentum_buffers[i].data_ptr<float>();
    }
    SgdHyper h;
    h.weight_decay = static_cast<float>(weight_decay);
    h.momentum = static_cast<float>(momentum);
    h.dampening_keep = static_cast<float>(1 - dampening);
    h.neg_lr = static_cast<float>(-lr);
    h.nesterov = nesterov;
    h.first = has_momentum && first[i];
    h.grad_factor = factor;
    void* comp = comp_ptr(comps, i, mode, param);
    const at::Tensor& grad = grads[i];
    const bool decay = weight_decay != 0.0;
    MIXPREC_TYPES(param.scalar_type(), grad.scalar_type(), mode,
                  sgd_tensor<P, G, MODE>(param, grad, buf, comp, decay, has_momentum, generator, h))
  }
}

}  // namespace mixprec_optim

TORCH_LIBRARY_FRAGMENT(mixprec_native, m) {
  m.def("adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] comps, Tensor[] state_steps, Tensor(f!)[] absmaxes, "
        "Tensor[] maps, float lr, float beta1, "
        "float beta2, float eps, float weight_decay, bool amsgrad, bool maximize, Tensor? inv_scale, "
        "int write_back, Generator? generator) -> ()");
  m.def("sgd_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor(c!)[] comps, "
        "bool[] first, float lr, float momentum, float dampening, float weight_decay, bool nesterov, "
        "bool maximize, Tensor? inv_scale, int write_back, Generator? generator) -> ()");
}

// CPU kernels (not catch-all ones), so that torch.compile can trace the ops with fake kernels
// (mixprec/optim/_fused.py registers them) and call them from a compiled graph.
TORCH_LIBRARY_IMPL(mixprec_native, CPU, m) {
  m.impl("adamw_step", &mixprec_optim::adamw_step);
  m.impl("sgd_step", &mixprec_optim::sgd_step);
}

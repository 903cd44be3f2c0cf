// The work of attn::decode_layers between its products, with AVX2 and FMA, for CPUs without
// AVX512-BF16 (AMD before Zen 4, Intel's client cores, Xeons from Skylake-SP to Ice Lake):
// RMSNorm, RoPE, residual sums and SwiGLU (layer_steps.h, built here for 8 fp32 lanes;
// decode_layers.cpp builds it for AVX-512) and the decode attention over the cache.
// attn::decode_layers takes these (and attn::avx2_linear for its products) when told `avx2`.
//
// On such a CPU an eager decode step spent half its time outside its products: about 1,900 small
// ATen ops and the Python between them, 28 ms of a 58 ms bf16 step at batch 1 (SmolLM2-135M
// shape, 2 threads, AMD EPYC Zen 1; docs/performance.md). Here they are a few loops a layer.
//
// Attention: the query heads that share a kv head (up to 8 at a time) are one task; a task reads
// each key and value row once for its queries, widened to fp32 8 values a load, skips masked
// slots and slots past the last one a query may see, and takes its softmax with a vectorized exp
// (range reduction and a degree-7 polynomial, under 2 ulp, as attn::exp_nonpositive). A query
// that may see no slot gets zeros, as the stock kernel gives.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "kernels.h"
#include "shared_slots.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#define ATTN_AVX2 __attribute__((target("avx2,fma")))

namespace {

using attn::Slots;

constexpr int64_t kLanes = 8;
constexpr int64_t kQueries = 8;        // a task's queries at most (their sums stay in registers)
constexpr int64_t kMaxHeadDim = 512;   // a head's fp32 copy lives on the stack

ATTN_AVX2 inline float sum_lanes(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// exp(x) for x <= 0 (-inf included): attn::exp_nonpositive's steps with AVX2 (2^n from the
// exponent bits; below -87.3, where 2^n would be subnormal, 0).
ATTN_AVX2 inline __m256 exp_nonpositive(__m256 x) {
  const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.0f));  // no -inf below: -inf - (-inf) is NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 = 0.693359375 - 2.12194440e-4
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), normal);
}

// Eight fp32 lanes: what layer_steps.h asks of a vector.
struct Simd {
  using Vec = __m256;
  static constexpr int64_t kWidth = kLanes;
  ATTN_AVX2 static Vec zero() { return _mm256_setzero_ps(); }
  ATTN_AVX2 static Vec set1(float v) { return _mm256_set1_ps(v); }
  ATTN_AVX2 static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  ATTN_AVX2 static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  ATTN_AVX2 static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  ATTN_AVX2 static Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
  ATTN_AVX2 static float sum(Vec v) { return sum_lanes(v); }
  ATTN_AVX2 static Vec load_f32(const float* p) { return _mm256_loadu_ps(p); }
  ATTN_AVX2 static void store_f32(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  ATTN_AVX2 static Vec exp_nonpositive(Vec x) { return ::exp_nonpositive(x); }
  ATTN_AVX2 static Vec neg_abs(Vec x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.0f)); }
  ATTN_AVX2 static Vec if_negative(Vec x, Vec a, Vec b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
  }
};

// Eight values of a row as fp32, and back in the row's dtype.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> : Simd {
  ATTN_AVX2 static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  ATTN_AVX2 static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
  ATTN_AVX2 static __m256 round(__m256 v) { return v; }
};

template <>
struct Lanes<c10::BFloat16> : Simd {
  ATTN_AVX2 static __m256 load(const c10::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  // Nearest even, as c10::BFloat16 rounds (a NaN becomes 0x7fc0): the 8 values' bits in 32-bit
  // lanes, each under 2^16.
  ATTN_AVX2 static __m256i narrow_bits(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  }
  ATTN_AVX2 static void store(c10::BFloat16* p, __m256 v) {
    const __m256i bits = narrow_bits(v);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  ATTN_AVX2 static __m256 round(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(narrow_bits(v), 16)); }
};

// The queries [h0, h0 + G) of row m (G <= kQueries) over their kv head's keys and values.
template <typename T>
ATTN_AVX2 void attend(const T* q, const Slots<T>& keys, const Slots<T>& values, const bool* allowed,
                      int64_t allowed_step, int64_t n, int64_t d, int64_t G, float scale, T* out,
                      std::vector<float>& scores) {
  using V = Lanes<T>;
  int64_t last = n - 1;  // slots past the last allowed one are not read
  while (last >= 0 && !allowed[last * allowed_step]) --last;
  if (last < 0) {
    std::memset(static_cast<void*>(out), 0, G * d * sizeof(T));
    return;
  }
  const int64_t count = last + 1, padded = (count + kLanes - 1) / kLanes * kLanes;
  alignas(32) float query[kQueries][kMaxHeadDim];  // scaled once, fp32
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < d; i += kLanes)
      _mm256_store_ps(query[g] + i, _mm256_mul_ps(V::load(q + g * d + i), _mm256_set1_ps(scale)));
  scores.resize(static_cast<size_t>(G * padded));
  float* score = scores.data();
  const float minus_inf = -std::numeric_limits<float>::infinity();
  std::fill(score, score + G * padded, minus_inf);
  for (int64_t j = 0; j < count; ++j) {
    if (!allowed[j * allowed_step]) continue;
    const T* key = keys.row(j);
    __m256 acc[kQueries];
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += kLanes) {
      const __m256 k = V::load(key + i);
#pragma GCC unroll 8
      for (int64_t g = 0; g < kQueries; ++g)
        if (g < G) acc[g] = _mm256_fmadd_ps(_mm256_load_ps(query[g] + i), k, acc[g]);
    }
    for (int64_t g = 0; g < G; ++g) score[g * padded + j] = sum_lanes(acc[g]);
  }
  float total[kQueries];
  for (int64_t g = 0; g < G; ++g) {  // softmax numerators in place, and their sums
    float* s = score + g * padded;
    __m256 most = _mm256_set1_ps(minus_inf);
    for (int64_t j = 0; j < padded; j += kLanes) most = _mm256_max_ps(most, _mm256_loadu_ps(s + j));
    const __m128 half = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    const __m128 pair = _mm_max_ps(half, _mm_movehl_ps(half, half));
    const __m256 top = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair))));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += kLanes) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), top));
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    total[g] = sum_lanes(sum);
  }
  for (int64_t i = 0; i < d; i += kLanes) {  // the weighted sums, 8 dims of every query at a time
    __m256 acc[kQueries];
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; ++j) {
      if (!allowed[j * allowed_step]) continue;
      const __m256 v = V::load(values.row(j) + i);
#pragma GCC unroll 8
      for (int64_t g = 0; g < kQueries; ++g)
        if (g < G) acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(score[g * padded + j]), v, acc[g]);
    }
    for (int64_t g = 0; g < G; ++g) V::store(out + g * d + i, _mm256_div_ps(acc[g], _mm256_set1_ps(total[g])));
  }
}

#define ATTN_STEPS ATTN_AVX2
#include "layer_steps.h"  // rms_norm, rotate, add, swiglu
#undef ATTN_STEPS

}  // namespace

namespace attn::avx2 {

// The declarations in kernels.h carry no target attribute: each forwards to the AVX2 code above.
template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t M, int64_t e, float eps) {
  ::rms_norm<T>(x, weight, out, M, e, eps);
}

template <typename T>
void rotate(T* x, int64_t M, int64_t heads, int64_t d, const float* cos, const float* sin, int64_t row_step) {
  ::rotate<T>(x, M, heads, d, cos, sin, row_step);
}

template <typename T>
void add(const T* a, const T* b, T* out, int64_t count) {
  ::add<T>(a, b, out, count);
}

template <typename T>
void swiglu(T* gate, const T* up, int64_t count) {
  ::swiglu<T>(gate, up, count);
}


// q (M, h, 1, d) contiguous; k and v (M, h_kv, n, d) with contiguous rows; allowed (1 or M, 1, 1,
// n) bool. attn::decode_layers has checked every shape.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed,
                     double scale, int64_t group, int64_t shared) {
  const int64_t M = q.size(0), heads = q.size(1), d = q.size(3), kv_heads = k.size(1), n = k.size(2);
  const int64_t queries_per_kv = heads / kv_heads, parts = (queries_per_kv + kQueries - 1) / kQueries;
  at::Tensor out = at::empty({M, heads, 1, d}, q.options());
  const int64_t allowed_row = allowed.size(0) == 1 ? 0 : allowed.stride(0), allowed_step = allowed.stride(3);
  const auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T *queries = q.data_ptr<T>(), *keys = k.data_ptr<T>(), *vals = v.data_ptr<T>();
    T* result = out.data_ptr<T>();
    // A group's rows one kv head after another (the shared rows stay in L2), as
    // decode_attention.cpp orders them.
    at::parallel_for(0, M * kv_heads * parts, 1, [&](int64_t t0, int64_t t1) {
      thread_local std::vector<float> scores;
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t pair = task / parts, in_group = pair % (kv_heads * group), part = task % parts;
        const int64_t m = pair / (kv_heads * group) * group + in_group % group, kvh = in_group / group;
        const int64_t lead = m - m % group;
        const int64_t h0 = kvh * queries_per_kv + part * kQueries, G = std::min(kQueries, queries_per_kv - part * kQueries);
        const Slots<T> key_rows{keys + m * k.stride(0) + kvh * k.stride(1), keys + lead * k.stride(0) + kvh * k.stride(1),
                                shared, k.stride(2)};
        const Slots<T> value_rows{vals + m * v.stride(0) + kvh * v.stride(1),
                                  vals + lead * v.stride(0) + kvh * v.stride(1), shared, v.stride(2)};
        attend<T>(queries + (m * heads + h0) * d, key_rows, value_rows, allowed.data_ptr<bool>() + m * allowed_row,
                  allowed_step, n, d, G, static_cast<float>(scale), result + (m * heads + h0) * d, scores);
      }
    });
  };
  if (q.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<c10::BFloat16*>(nullptr));
  return out;
}

template void rms_norm<float>(const float*, const float*, float*, int64_t, int64_t, float);
template void rms_norm<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*, int64_t, int64_t,
                                      float);
template void rotate<float>(float*, int64_t, int64_t, int64_t, const float*, const float*, int64_t);
template void rotate<c10::BFloat16>(c10::BFloat16*, int64_t, int64_t, int64_t, const float*, const float*, int64_t);
template void add<float>(const float*, const float*, float*, int64_t);
template void add<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*, int64_t);
template void swiglu<float>(float*, const float*, int64_t);
template void swiglu<c10::BFloat16>(c10::BFloat16*, const c10::BFloat16*, int64_t);

}  // namespace attn::avx2

// attn::avx2_linear: y = x W^T (+ bias) for a few rows x (M, K) and a weight W (N, K) as it is
// stored, bf16 or fp32, with AVX2 and FMA: the few-row product for CPUs without AVX-512 (AMD
// before Zen 4, Intel's client cores), where attn::bf16_matvec and attn::fp32_linear cannot run
// and oneDNN cannot even pack a bf16 weight.
//
// AVX2 has no bf16 arithmetic: a bf16 value is the top half of an fp32 one, so a load of 16 bf16
// weights becomes two fp32 vectors with one shift (the even features) and one mask (the odd
// ones). x is widened to fp32 once a call, into that same order (for each 16 features, the 8 even
// then the 8 odd), and every FMA reads it from L1; fp32 weights are read as they are and x needs
// no copy. Each step of 16 features loads R weight rows once and multiplies them into up to 4 rows
// of x (M x R accumulators of 8 fp32 lanes, at most 6, beside 2 R weight vectors and 2 of x);
// more rows take more passes over the same weight row, read again from L1 (passes of 6 or 8 rows
// were slower). The weight rows 4 R ahead are prefetched into L2. Sums are fp32, folded 8 at a time
// with one tree of horizontal adds; a bf16 output is rounded once (nearest even).
//
// The 30 layers' products of the SmolLM2-135M shape, 2 threads, AMD EPYC (Zen 1): bf16 16.4 ms
// at one row and 85.9 at 16, against 25.0 and 124.8 for the best of torch's kernels (the
// figures in attn/native.py's docstring). Built on first use by attn/native.py, which checks the CPU.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"
#include "linear_checks.h"
#include "product_group.h"
#include "row_tiles.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#define ATTN_AVX2 __attribute__((target("avx2,fma")))

namespace {

constexpr int64_t kStep = 16;  // features a step: two vectors of 8 fp32 lanes
constexpr int kRowsAPass = 4;  // rows of x a pass multiplies each loaded weight vector into

// bf16 weights: 16 values a load, widened into the even features' vector and the odd ones'.
struct Bf16 {
  using Value = uint16_t;
  ATTN_AVX2 static void load(const Value* p, __m256& even, __m256& odd) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static float widen(Value v) { return static_cast<float>(c10::BFloat16(v, c10::BFloat16::from_bits())); }
  static Value narrow(float sum) { return c10::BFloat16(sum).x; }  // nearest even
};

// fp32 weights: 16 values a step, the first 8 and the last 8 (x is read in its own order).
struct Fp32 {
  using Value = float;
  ATTN_AVX2 static void load(const Value* p, __m256& first, __m256& second) {
    first = _mm256_loadu_ps(p);
    second = _mm256_loadu_ps(p + 8);
  }
  static float widen(Value v) { return v; }
  static Value narrow(float sum) { return sum; }
};

// R weight rows for M rows of x: one row of x takes 4, two take 3, more take one weight row a
// pass (3 and more rows with 2: 30-40% slower, AMD EPYC Zen 1, the module doc's shapes).
constexpr int rows_per_pass(int m) { return m == 1 ? 4 : m == 2 ? 3 : 1; }

// The sums of up to 8 vectors' lanes, in their order (missing ones are zero): two levels of
// horizontal adds give each vector's two 4-lane halves, then the 128-bit halves are added.
ATTN_AVX2 inline __m256 sum_each(const __m256* v, int count) {
  __m256 in[8];
  for (int i = 0; i < 8; ++i) in[i] = i < count ? v[i] : _mm256_setzero_ps();
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(in[0], in[1]), _mm256_hadd_ps(in[2], in[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(in[4], in[5]), _mm256_hadd_ps(in[6], in[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

// Rows [0, M) of X (fp32, K apart, in the weight's load order) against R weight rows from w:
// their M x R sums into sums[m * R + r]. Features past the last whole step are summed one by one
// (X in natural order there), each an explicit FMA: a `+=` of a product is contracted into one or
// not as the compiler vectorises each (M, R), and a row's bits would follow the row count. Weight rows at `ahead` (none when null) are prefetched into L2.
template <typename D, int M, int R>
ATTN_AVX2 inline void sums_of(const typename D::Value* w, const float* X, int64_t K, const typename D::Value* ahead,
                              float* sums) {
  const int64_t full = K - K % kStep;
  __m256 acc[M][R];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < full; k += kStep) {
    if (ahead != nullptr) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * K + k), _MM_HINT_T1);
    }
    __m256 first[R], second[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) D::load(w + r * K + k, first[r], second[r]);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const __m256 x0 = _mm256_loadu_ps(X + m * K + k), x1 = _mm256_loadu_ps(X + m * K + k + 8);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(second[r], x1, _mm256_fmadd_ps(first[r], x0, acc[m][r]));
    }
  }
  _mm256_storeu_ps(sums, sum_each(&acc[0][0], M * R));
  for (int64_t k = full; k < K; ++k)
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) sums[m * R + r] = std::fma(D::widen(w[r * K + k]), X[m * K + k], sums[m * R + r]);
}

// The M rows' sums for R weight rows from w (outputs n to n + R), in passes of up to 4 rows of x
// from row First on (past the first pass, the weight rows are read again from L1), into Y.
template <typename D, int M, int R, int First = 0>
ATTN_AVX2 inline void passes(const typename D::Value* w, const float* X, const typename D::Value* bias,
                             typename D::Value* Y, int64_t N, int64_t K, int64_t n, const typename D::Value* ahead) {
  constexpr int rows = std::min(kRowsAPass, M - First);
  float sums[8];
  sums_of<D, rows, R>(w, X + First * K, K, First == 0 ? ahead : nullptr, sums);
#pragma GCC unroll 4
  for (int m = 0; m < rows; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float sum = sums[m * R + r];
      if (bias != nullptr) sum += D::widen(bias[n + r]);
      Y[(First + m) * N + n + r] = D::narrow(sum);
    }
  if constexpr (First + kRowsAPass < M) passes<D, M, R, First + kRowsAPass>(w, X, bias, Y, N, K, n, nullptr);
}

// Outputs [n0, n1) of all M rows, R at a time ((n1 - n0) is a multiple of R).
template <typename D, int M, int R>
ATTN_AVX2 void outputs(const typename D::Value* W, const float* X, const typename D::Value* bias, typename D::Value* Y,
                       int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t kAhead = 4 * R;  // prefetch distance, weight rows
  for (int64_t n = n0; n < n1; n += R) {
    const typename D::Value* w = W + n * K;
    passes<D, M, R>(w, X, bias, Y, N, K, n, n + kAhead + R <= N ? w + kAhead * K : nullptr);
  }
}

// X's rows in the weight's load order, fp32: for bf16, each step's 8 even features then its 8
// odd ones (the rest in order); fp32 x as it is.
template <typename D>
const float* widened(const at::Tensor& x, int64_t M, int64_t K, std::vector<float>& buffer) {
  if constexpr (std::is_same_v<D, Fp32>) {
    return x.data_ptr<float>();
  } else {
    buffer.resize(static_cast<size_t>(M * K));
    const auto* in = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const int64_t full = K - K % kStep;
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* row = in + m * K;
      float* out = buffer.data() + m * K;
      for (int64_t k = 0; k < full; k += kStep)
        for (int64_t j = 0; j < 8; ++j) {
          out[k + j] = D::widen(row[k + 2 * j]);
          out[k + 8 + j] = D::widen(row[k + 2 * j + 1]);
        }
      for (int64_t k = full; k < K; ++k) out[k] = D::widen(row[k]);
    }
    return buffer.data();
  }
}

using attn::product_group::Target;

// The products of x (M, K) by each of a group's weights, in one parallel region
// (product_group.h), x widened once for all of them.
template <typename D, int M>
void product(const Target* group, int count, const at::Tensor& x, int64_t K) {
  using V = typename D::Value;
  constexpr int R = rows_per_pass(M);
  thread_local std::vector<float> buffer;
  const float* X = widened<D>(x, M, K, buffer);  // written before the threads start, then only read
  const auto blocks = [&](auto rows_a_pass, const Target& t, int64_t n0, int64_t n1) {
    outputs<D, M, decltype(rows_a_pass)::value>(static_cast<const V*>(t.W), X, static_cast<const V*>(t.bias),
                                                static_cast<V*>(t.Y), t.N, K, n0, n1);
  };
  attn::product_group::run<R>(group, count, /*grain=*/32 / R, blocks);
}

// D's loop as attn::row_tiles' kernel (attn::invariant_linear's products): X widened to fp32.
// Past two rows of x, two weight rows a pass (8 accumulators: 12 loads for 16 FMAs, where one
// weight row takes 10 for 8): a tile's weight rows come from the caches, so it is bound by loads
// and FMAs rather than memory. AMD EPYC (Zen 3), 2 threads, fp32, 1024 rows, ms: 576 -> 1536 22.9
// against 26.9 for one weight row, 1536 -> 576 22.5 against 33.1.
template <typename D>
struct Tiles {
  using In = float;
  using Out = typename D::Value;
  static constexpr int64_t kMaxRows = attn::kAvx2LinearMaxRows;
  static constexpr int rows_per_pass(int m) { return m <= 2 ? ::rows_per_pass(m) : 2; }
  template <int M, int R>
  static void outputs(const void* W, const In* X, Out* Y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    ::outputs<D, M, R>(static_cast<const typename D::Value*>(W), X, nullptr, Y, N, K, n0, n1);
  }
};

template <typename D>
void tiled_product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& y) {
  const int64_t N = weight.size(0), K = weight.size(1), M = x.numel() / K;
  thread_local std::vector<float> buffer;
  const float* X = widened<D>(x, M, K, buffer);  // written before the threads start, then only read
  attn::row_tiles::product<Tiles<D>>(weight.data_ptr(), X, static_cast<typename D::Value*>(y.data_ptr()), M, N, K);
}

using Product = void (*)(const Target*, int, const at::Tensor&, int64_t);

template <typename D, size_t... I>
constexpr std::array<Product, sizeof...(I)> products(std::index_sequence<I...>) {
  return {product<D, static_cast<int>(I) + 1>...};
}

}  // namespace

namespace attn {

std::vector<at::Tensor> avx2_linear_group(const at::Tensor& x, at::ArrayRef<at::Tensor> weights,
                                          at::ArrayRef<c10::optional<at::Tensor>> biases) {
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
              "attn::avx2_linear needs a CPU with AVX2 and FMA");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t M = bf16 ? product_group::check("attn::avx2_linear", at::kBFloat16, "bf16", kAvx2LinearMaxRows, 1, x,
                                                weights, biases)
                         : product_group::check("attn::avx2_linear", at::kFloat, "bf16 or fp32", kAvx2LinearMaxRows, 1,
                                                x, weights, biases);
  static constexpr auto kBf16 = products<Bf16>(std::make_index_sequence<kAvx2LinearMaxRows>());
  static constexpr auto kFp32 = products<Fp32>(std::make_index_sequence<kAvx2LinearMaxRows>());
  std::vector<at::Tensor> shifts;
  Target group[product_group::kMostProducts];
  std::vector<at::Tensor> outputs = product_group::targets(x, weights, biases, group, shifts);
  (bf16 ? kBf16 : kFp32)[M - 1](group, static_cast<int>(weights.size()), x.contiguous(), weights[0].size(1));
  return outputs;
}

at::Tensor avx2_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return avx2_linear_group(x, {weight}, {bias})[0];
}

void invariant_product_avx2(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& y) {
  (x.scalar_type() == at::kBFloat16 ? tiled_product<Bf16> : tiled_product<Fp32>)(x, weight, y);
}

}  // namespace attn

TORCH_LIBRARY_IMPL(attn, CPU, m) { m.impl("avx2_linear", &attn::avx2_linear); }

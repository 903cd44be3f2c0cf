// attn::bf16_matvec: y = x W^T (+ bias) for one to eight bf16 rows x (M, K) and a bf16 weight
// W (N, K), with AVX512-BF16 dot products (vdpbf16ps) that inductor's code cannot emit.
//
// A decode step at a small batch reads every weight once for a few rows: it is bound by memory
// reads. Each pass over 32 features loads R weight rows once and multiplies them into all M
// input rows (M x R accumulators of 16 fp32 lanes, two products a lane an instruction): R = 4
// up to 4 rows, 2 up to 8, so the accumulators fit in the registers. Each pass also prefetches
// the weight rows 16 ahead. The 30 layers' products of the SmolLM2-135M shape on 2 threads of a
// Xeon 6/167: 9.0 ms at one row, 10.0 at 2, 11.1 at 4, 14.4 at 8, against 15.5 for oneDNN's
// product on packed weights and 21-22 for F.linear at any of those. Sums are fp32, in another
// order than other kernels'; each output is rounded to bf16 once (nearest even).
// Built on first use by attn/native.py, which checks the CPU has AVX512-BF16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#define ATTN_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kPrefetchRows = 16;

ATTN_AVX512_BF16 inline __m512bh load(const uint16_t* p, __mmask32 tail) {
  return tail ? (__m512bh)_mm512_maskz_loadu_epi16(tail, p) : (__m512bh)_mm512_loadu_si512(p);
}

// One pass over 32 features (fewer under a tail mask): R weight rows, K apart from w, into the
// M rows of X.
template <int M, int R>
ATTN_AVX512_BF16 inline void pass(__m512 (&acc)[M][R], const uint16_t* w, const uint16_t* X, int64_t K, int64_t k,
                                  __mmask32 tail) {
  __m512bh weight[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) weight[r] = load(w + r * K + k, tail);
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    const __m512bh row = load(X + m * K + k, tail);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], weight[r], row);
  }
}

// Outputs [n0, n1) of every row, R at a time ((n1 - n0) is a multiple of R).
template <int M, int R>
ATTN_AVX512_BF16 void outputs(const uint16_t* W, const uint16_t* X, const uint16_t* bias, uint16_t* Y, int64_t N,
                              int64_t K, int64_t n0, int64_t n1) {
  const int64_t full = K - K % 32;
  const __mmask32 tail = K % 32 ? (__mmask32)((1ull << (K % 32)) - 1) : 0;
  for (int64_t n = n0; n < n1; n += R) {
    __m512 acc[M][R];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    const uint16_t* w = W + n * K;
    for (int64_t k = 0; k < full; k += 32) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (r + kPrefetchRows) * K + k), _MM_HINT_T0);
      pass<M, R>(acc, w, X, K, k, 0);
    }
    if (tail) pass<M, R>(acc, w, X, K, full, tail);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        float sum = _mm512_reduce_add_ps(acc[m][r]);
        if (bias != nullptr) sum += static_cast<float>(c10::BFloat16(bias[n + r], c10::BFloat16::from_bits()));
        Y[m * N + n + r] = c10::BFloat16(sum).x;  // nearest even
      }
  }
}

template <int M>
void product(const uint16_t* W, const uint16_t* X, const uint16_t* bias, uint16_t* Y, int64_t N, int64_t K) {
  constexpr int R = M <= 4 ? 4 : 2;
  const int64_t blocks = N / R;
  at::parallel_for(0, blocks, /*grain_size=*/64 / R, [&](int64_t b0, int64_t b1) {
    outputs<M, R>(W, X, bias, Y, N, K, b0 * R, b1 * R);
  });
  if (N % R != 0) outputs<M, 1>(W, X, bias, Y, N, K, blocks * R, N);  // the last N % R outputs
}

using Product = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t);
constexpr Product kProducts[kMaxRows] = {product<1>, product<2>, product<3>, product<4>,
                                         product<5>, product<6>, product<7>, product<8>};

at::Tensor bf16_matvec(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "attn::bf16_matvec needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "attn::bf16_matvec takes bf16 tensors, got x ", x.scalar_type(), " and weight ", weight.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "attn::bf16_matvec runs on the CPU, got x on ",
              x.device(), " and weight on ", weight.device());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "attn::bf16_matvec: weight must be a contiguous (n, k) "
              "matrix, got sizes ", weight.sizes(), " and strides ", weight.strides());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K > 0 && x.dim() >= 1 && x.size(-1) == K, "attn::bf16_matvec: x must end in the weight's ", K,
              " features, got sizes ", x.sizes());
  const int64_t M = x.numel() / K;
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "attn::bf16_matvec takes 1 to ", kMaxRows, " rows of x, got ", M,
              " (sizes ", x.sizes(), "): F.linear is the product for more");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == N,
                "attn::bf16_matvec: bias must be a bf16 (", N, ",) vector, got ", bias->scalar_type(), " ",
                bias->sizes());
  }
  const at::Tensor rows = x.contiguous();
  const at::Tensor shift = bias.has_value() ? bias->contiguous() : at::Tensor();
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  kProducts[M - 1](reinterpret_cast<const uint16_t*>(weight.data_ptr()),
                   reinterpret_cast<const uint16_t*>(rows.data_ptr()),
                   bias.has_value() ? reinterpret_cast<const uint16_t*>(shift.data_ptr()) : nullptr,
                   reinterpret_cast<uint16_t*>(y.data_ptr()), N, K);
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(attn, CPU, m) { m.impl("bf16_matvec", &bf16_matvec); }

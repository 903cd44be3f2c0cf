// attn::bf16_matvec: y = x W^T (+ bias) for one bf16 row x (K) and a bf16 weight W (N, K),
// with AVX512-BF16 dot products (vdpbf16ps) that inductor's code cannot emit.
//
// Decode at batch 1 reads every weight once for one row: the step is bound by memory reads.
// Four weight rows share one pass over x (four accumulators of 16 fp32 lanes, two products
// a lane an instruction), and each loop prefetches the rows 16 ahead, which keeps reads near
// the machine's bandwidth (24-25 GB/s on 2 threads of a Xeon 6/167 against 13-14 for
// inductor's reductions and 14-15 for oneDNN's matrix-vector product). Sums are fp32, in
// another order than other kernels'; each output is rounded to bf16 once (nearest even).
// Built on first use by attn/native.py; the caller checks the CPU has AVX512-BF16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kRowsPerBlock = 4;
constexpr int64_t kPrefetchRows = 16;

__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m512 dot_step(
    __m512 acc, const uint16_t* w, __m512bh x, int64_t k, __mmask32 tail) {
  __m512bh wv = tail ? (__m512bh)_mm512_maskz_loadu_epi16(tail, w + k) : (__m512bh)_mm512_loadu_si512(w + k);
  return _mm512_dpbf16_ps(acc, wv, x);
}

// y[n] = the sum, plus bias[n], rounded to bf16 once (nearest even).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void finish(
    uint16_t* y, const uint16_t* bias, int64_t n, __m512 acc) {
  float sum = _mm512_reduce_add_ps(acc);
  if (bias != nullptr) sum += static_cast<float>(c10::BFloat16(bias[n], c10::BFloat16::from_bits()));
  y[n] = c10::BFloat16(sum).x;
}

// Rows [n0, n1) of y; W is (N, K) row-major, x is (K).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void matvec_rows(
    const uint16_t* W, const uint16_t* x, const uint16_t* bias, uint16_t* y, int64_t n0, int64_t n1, int64_t K) {
  const int64_t full = K - K % 32;
  const __mmask32 tail = K % 32 ? (__mmask32)((1ull << (K % 32)) - 1) : 0;
  int64_t n = n0;
  for (; n + kRowsPerBlock <= n1; n += kRowsPerBlock) {
    const uint16_t* w0 = W + n * K;
    const uint16_t* w1 = w0 + K;
    const uint16_t* w2 = w1 + K;
    const uint16_t* w3 = w2 + K;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < full; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(w0 + k + kPrefetchRows * K), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + k + kPrefetchRows * K), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w2 + k + kPrefetchRows * K), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w3 + k + kPrefetchRows * K), _MM_HINT_T0);
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
      a0 = dot_step(a0, w0, xv, k, 0);
      a1 = dot_step(a1, w1, xv, k, 0);
      a2 = dot_step(a2, w2, xv, k, 0);
      a3 = dot_step(a3, w3, xv, k, 0);
    }
    if (tail) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + full);
      a0 = dot_step(a0, w0, xv, full, tail);
      a1 = dot_step(a1, w1, xv, full, tail);
      a2 = dot_step(a2, w2, xv, full, tail);
      a3 = dot_step(a3, w3, xv, full, tail);
    }
    finish(y, bias, n, a0);
    finish(y, bias, n + 1, a1);
    finish(y, bias, n + 2, a2);
    finish(y, bias, n + 3, a3);
  }
  for (; n < n1; ++n) {  // the last N % 4 rows
    const uint16_t* w0 = W + n * K;
    __m512 a0 = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 32) a0 = dot_step(a0, w0, (__m512bh)_mm512_loadu_si512(x + k), k, 0);
    if (tail) a0 = dot_step(a0, w0, (__m512bh)_mm512_maskz_loadu_epi16(tail, x + full), full, tail);
    finish(y, bias, n, a0);
  }
}

at::Tensor bf16_matvec(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "attn::bf16_matvec needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "attn::bf16_matvec takes bf16 tensors, got x ", x.scalar_type(), " and weight ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "attn::bf16_matvec: weight must be a contiguous (n, k) "
              "matrix, got sizes ", weight.sizes(), " and strides ", weight.strides());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K && x.numel() == K, "attn::bf16_matvec: x must be one row of ", K,
              " features, got sizes ", x.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == N,
                "attn::bf16_matvec: bias must be a bf16 (", N, ",) vector, got ", bias->scalar_type(), " ",
                bias->sizes());
  }
  const at::Tensor row = x.contiguous();
  const at::Tensor shift = bias.has_value() ? bias->contiguous() : at::Tensor();
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  const auto* W = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(row.data_ptr());
  const auto* bp = bias.has_value() ? reinterpret_cast<const uint16_t*>(shift.data_ptr()) : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  at::parallel_for(0, blocks, /*grain_size=*/16, [&](int64_t b0, int64_t b1) {
    matvec_rows(W, xp, bp, yp, b0 * kRowsPerBlock, std::min(b1 * kRowsPerBlock, N), K);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(attn, CPU, m) { m.impl("bf16_matvec", &bf16_matvec); }

// attn::first_argmax: the index of each row's largest value, the first of equal ones, a NaN counted
// the largest (so the first NaN where a row has one): torch.max(x, -1).indices on a CPU, for the
// fp32 (b, v) logits greedy decoding picks its tokens from (attn::decode_loop, and
// attn.generation's sampler where the extension is built).
//
// ATen's max over a dim compares one element at a time: 16 rows of 49,152 logits took 0.42-0.46 ms
// on 2 threads (AMD EPYC Zen 5), about 3% of a bf16 decode step of 16 rows. Here two passes of
// AVX2 a row, the largest value (and whether there is a NaN), then the first index that holds it,
// with the rows split between the threads. AVX2 is on every CPU the extension is built for.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#define ATTN_AVX2 __attribute__((target("avx2")))

namespace {

// The first index in x[0, n) that holds `value`, or a NaN where nan: 8 at a time, then one at a
// time (-0.0 and 0.0 compare equal: the first of either).
ATTN_AVX2 int64_t first_of(const float* x, int64_t n, float value, bool nan) {
  const __m256 target = _mm256_set1_ps(value);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 row = _mm256_loadu_ps(x + i);
    const __m256 hit = nan ? _mm256_cmp_ps(row, row, _CMP_UNORD_Q) : _mm256_cmp_ps(row, target, _CMP_EQ_OQ);
    const int bits = _mm256_movemask_ps(hit);
    if (bits != 0) return i + __builtin_ctz(static_cast<unsigned>(bits));
  }
  for (; i < n; ++i)
    if (nan ? std::isnan(x[i]) : x[i] == value) return i;
  return -1;  // not reached: the caller looks for a value the row holds
}

ATTN_AVX2 int64_t first_argmax_row(const float* x, int64_t n) {
  __m256 best[4], nan = _mm256_setzero_ps();  // nan: lanes that met a NaN (all bits set)
  for (auto& b : best) b = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 value = _mm256_loadu_ps(x + i + 8 * j);
      best[j] = _mm256_max_ps(best[j], value);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(value, value, _CMP_UNORD_Q));
    }
  }
  const __m256 pairs = _mm256_max_ps(_mm256_max_ps(best[0], best[1]), _mm256_max_ps(best[2], best[3]));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, pairs);
  float largest = -INFINITY;
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (float lane : lanes) largest = lane > largest ? lane : largest;
  for (; i < n; ++i) {
    has_nan = has_nan || std::isnan(x[i]);
    largest = x[i] > largest ? x[i] : largest;
  }
  return first_of(x, n, largest, has_nan);
}

}  // namespace

namespace attn {

at::Tensor first_argmax(const at::Tensor& x) {
  TORCH_CHECK(__builtin_cpu_supports("avx2"), "attn::first_argmax needs a CPU with AVX2");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "attn::first_argmax takes fp32 (b, v) CPU logits with v >= 1, got ", x.sizes(), " ", x.scalar_type(),
              " on ", x.device());
  const at::Tensor rows = x.contiguous();
  const int64_t b = rows.size(0), v = rows.size(1);
  at::Tensor tokens = at::empty({b}, x.options().dtype(at::kLong));
  const float* values = rows.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, b, /*grain_size=*/std::max<int64_t>(1, 65536 / v), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = first_argmax_row(values + r * v, v);
  });
  return tokens;
}

}  // namespace attn

TORCH_LIBRARY_IMPL(attn, CPU, m) { m.impl("first_argmax", &attn::first_argmax); }

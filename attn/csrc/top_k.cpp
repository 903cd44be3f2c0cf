// attn::keep_top_k: top-k sampling's cut, in place: each logit below its row's k-th largest
// becomes -inf, as x.masked_fill_(x < x.topk(k, -1).values[:, -1:], -inf) leaves it, for fp32
// (b, v) CPU logits (attn::decode_loop's sampler, and attn.generation's where the extension is
// built). topk ranks a NaN above every number, so a row of k NaNs or more keeps every value; a
// NaN is never below anything, so it stays.
//
// ATen's topk and the broadcast comparison took 0.65 and 0.64 ms for 16 rows of 49,152 logits at
// k = 50 on 2 threads (AMD EPYC Zen 5): a tenth of a bf16 decode step of 16 rows, for the
// sampling most users start from (transformers' default top_k is 50). Here a row's k-th largest
// comes from a min-heap of its k largest numbers so far, met 8 at a time with AVX2 and skipping
// every 8 none of which beats the heap's least (few do once the heap holds large values): 0.24,
// 0.29 and 0.84 ms at k = 20, 50 and 256 against 1.58, 1.66 and 2.32 for ATen's calls (random
// logits; the same machine). A heap's offers grow with k (about k ln(v / k)), and past 256 neither
// the heap nor a partition of a copy beat topk (2.5 and 3.4 ms at k = 1000 against 4.9, 4.5 and
// 3.3 at 257 against 2.7): kKeepTopKMost (kernels.h) is the largest k taken, and the samplers call
// topk past it. AVX2 is on every CPU the extension is built for.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#define ATTN_AVX2 __attribute__((target("avx2")))

namespace {

// NaNs in x[0, n).
ATTN_AVX2 int64_t nans_in(const float* x, int64_t n) {
  int64_t count = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    count += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))));
  }
  for (; i < n; ++i) count += std::isnan(x[i]);
  return count;
}

// The k-th largest number of x[0, n) (NaNs skipped; 1 <= k <= the numbers there): a min-heap of
// the k largest so far, in `heap`.
ATTN_AVX2 float kth_by_heap(const float* x, int64_t n, int64_t k, std::vector<float>& heap) {
  heap.clear();
  int64_t i = 0;
  for (; i < n && static_cast<int64_t>(heap.size()) < k; ++i)
    if (!std::isnan(x[i])) heap.push_back(x[i]);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());  // heap[0]: the least
  float* h = heap.data();
  const auto offer = [&](float value) {  // value > h[0]: it takes h[0]'s place, sifted down
    int64_t at = 0;
    for (int64_t child = 1; child < k; child = 2 * at + 1) {
      if (child + 1 < k && h[child + 1] < h[child]) ++child;
      if (!(h[child] < value)) break;
      h[at] = h[child];
      at = child;
    }
    h[at] = value;
  };
  for (; i + 8 <= n; i += 8) {
    int above = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(h[0]), _CMP_GT_OQ));
    while (above != 0) {  // in order: each offer raises the least
      const int lane = __builtin_ctz(static_cast<unsigned>(above));
      above &= above - 1;
      if (x[i + lane] > h[0]) offer(x[i + lane]);
    }
  }
  for (; i < n; ++i)
    if (x[i] > h[0]) offer(x[i]);
  return h[0];
}

// x[i] = -inf where x[i] < cut (never a NaN's place).
ATTN_AVX2 void cut_below(float* x, int64_t n, float cut) {
  const __m256 line = _mm256_set1_ps(cut), low = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(x + i, _mm256_blendv_ps(v, low, _mm256_cmp_ps(v, line, _CMP_LT_OQ)));
  }
  for (; i < n; ++i)
    if (x[i] < cut) x[i] = -std::numeric_limits<float>::infinity();
}

}  // namespace

namespace attn {

void keep_top_k(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(__builtin_cpu_supports("avx2"), "attn::keep_top_k needs a CPU with AVX2");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.is_contiguous(),
              "attn::keep_top_k takes contiguous fp32 (b, v) CPU logits, got ", x.sizes(), " ", x.scalar_type(),
              x.is_contiguous() ? "" : " (not contiguous)", " on ", x.device());
  const int64_t b = x.size(0), v = x.size(1);
  TORCH_CHECK(1 <= k && k <= std::min(v, kKeepTopKMost), "attn::keep_top_k: k must be in [1, ",
              std::min(v, kKeepTopKMost), "] (the logits a row, at most ", kKeepTopKMost,
              "; topk is the faster past that), got ", k);
  float* values = x.data_ptr<float>();
  at::parallel_for(0, b, /*grain_size=*/std::max<int64_t>(1, 65536 / v), [&](int64_t r0, int64_t r1) {
    std::vector<float> scratch;
    for (int64_t r = r0; r < r1; ++r) {
      float* row = values + r * v;
      const int64_t numbers_k = k - nans_in(row, v);  // rank of the cut among the numbers
      if (numbers_k <= 0) continue;                   // k NaNs or more: the cut is a NaN, below which nothing is
      cut_below(row, v, kth_by_heap(row, v, numbers_k, scratch));
    }
  });
}

}  // namespace attn

TORCH_LIBRARY_IMPL(attn, CPU, m) { m.impl("keep_top_k", &attn::keep_top_k); }

// attn::invariant_linear: y = x W^T for x (..., K) of any rows and a weight W (N, K) as it is
// stored, bf16 or fp32, each output row the same bits whatever the other rows are: parity mode's
// linear (attn/parity.py), where a prefill of 500 rows, a decode step of 16 and a training pass
// must give a token's row alike.
//
// The rows go in tiles of 16 (the last one fewer) through a few-row kernel whose row sums are the
// same instructions in the same order at every row count: bf16_matvec's and fp32_linear's loop
// on a CPU with AVX512-BF16 (few_rows_linear.cpp), avx2_linear's elsewhere (avx2_linear.cpp);
// which one is fixed by the CPU, so every pass in a process takes the same. The threads split the
// weight rows and take each chunk of them through every tile (row_tiles.h), reading the weight
// from memory once a call. BLAS products choose their kernel by shape (docs/parity.md), which is
// why parity mode cannot simply call F.linear. On an AMD EPYC (Zen 4), 2 threads, against the
// 16-row torch.mm products parity mode ran before (its fallback) and one torch.mm of all the rows,
// ms: bf16 16 x 576 -> 1536: 0.077 against 0.150 (one product 0.139); 1024 x 576 -> 1536: 4.80
// against 11.42 (4.66); the head, 1024 x 576 -> 49152: 194 against 386 (177); fp32 1024 x 576
// -> 1536: 8.4 against 16.8 (9.9). Built on first use by attn/native.py, which checks the CPU.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels.h"
#include "linear_checks.h"

#include <cstdint>
#include <limits>
#include <vector>

namespace attn {

at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight) {
  const bool avx512 = __builtin_cpu_supports("avx512bf16");
  TORCH_CHECK(avx512 || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")),
              "attn::invariant_linear needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "attn::invariant_linear takes bf16 or fp32 tensors, got x ", x.scalar_type());
  TORCH_CHECK(x.numel() > 0, "attn::invariant_linear takes one row of x or more, got sizes ", x.sizes());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  check_linear("attn::invariant_linear", x.scalar_type(), bf16 ? "bf16" : "fp32", std::numeric_limits<int64_t>::max(),
               1, x, weight, c10::nullopt);
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = weight.size(0);
  const at::Tensor y = at::empty(sizes, x.options());
  (avx512 ? invariant_product_avx512 : invariant_product_avx2)(x.contiguous(), weight, y);
  return y;
}

}  // namespace attn

TORCH_LIBRARY_IMPL(attn, CPU, m) { m.impl("invariant_linear", &attn::invariant_linear); }

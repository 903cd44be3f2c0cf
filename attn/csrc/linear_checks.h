// The input checks of attn's few-row products (attn::bf16_matvec, attn::fp32_linear,
// attn::amx_linear and attn::avx2_linear), raised before any work with the values they found.
// attn/native.py hashes this header into the build's flags, so that a change here rebuilds the
// sources.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace attn {

// x (..., K) against weight (N, K) and bias (N,): returns M, the rows of x. K must be a
// multiple of `features_step` (1: any).
inline int64_t check_linear(const char* name, at::ScalarType dtype, const char* dtype_name, int64_t max_rows,
                            int64_t features_step, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == dtype && weight.scalar_type() == dtype, name, " takes ", dtype_name,
              " tensors, got x ", x.scalar_type(), " and weight ", weight.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), name, " runs on the CPU, got x on ", x.device(),
              " and weight on ", weight.device());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), name, ": weight must be a contiguous (n, k) matrix, got "
              "sizes ", weight.sizes(), " and strides ", weight.strides());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K > 0 && x.dim() >= 1 && x.size(-1) == K, name, ": x must end in the weight's ", K,
              " features, got x ", x.sizes(), " and weight ", weight.sizes());
  TORCH_CHECK(K % features_step == 0, name, " takes features in a multiple of ", features_step, ", got ", K,
              " (weight ", weight.sizes(), ")");
  const int64_t M = x.numel() / K;
  TORCH_CHECK(M >= 1 && M <= max_rows, name, " takes 1 to ", max_rows, " rows of x, got ", M, " (sizes ", x.sizes(),
              "): F.linear is the product for more");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == N, name, ": bias must be a ",
                dtype_name, " (", N, ",) vector, got ", bias->scalar_type(), " ", bias->sizes());
  }
  return M;
}

}  // namespace attn

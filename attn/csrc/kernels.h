// The entry points of attn's native kernels, for the kernels that call each other
// (attn::decode_layers calls the products and the attention). Each checks its inputs and raises
// with the values it found; attn/native.py registers them as the attn:: operators' CPU kernels
// and hashes this header into the build's flags.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <vector>

namespace attn {

// Most rows of x each product takes (attn/native.py's *_MAX_ROWS say the same).
constexpr int64_t kBf16MatvecMaxRows = 16;
constexpr int64_t kFp32LinearMaxRows = 16;
constexpr int64_t kAmxLinearMaxRows = 32;  // two tiles of 16 rows of x
constexpr int64_t kAvx2LinearMaxRows = 16;

// y = x W^T (+ bias): x (..., K) bf16 of 1 to 16 rows (few_rows_linear.cpp).
at::Tensor bf16_matvec(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// y = x W^T (+ bias): x (..., K) fp32 of 1 to 16 rows (few_rows_linear.cpp).
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// y = x W^T (+ bias): x (..., K) bf16 of 1 to 32 rows, K a multiple of 32, with AMX (amx_linear.cpp).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// y = x W^T (+ bias): x (..., K) bf16 or fp32 of 1 to 16 rows, with AVX2 and FMA (avx2_linear.cpp).
at::Tensor avx2_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// y = x W^T: x (..., K) bf16 or fp32 of any rows, each row's bits those of the row alone
// (invariant_linear.cpp): parity mode's linear (attn/parity.py). It runs one of these two on x's
// contiguous rows (M, K) into y (M, N): tiles of 16 rows of bf16_matvec's or fp32_linear's loop
// (few_rows_linear.cpp), or of avx2_linear's (avx2_linear.cpp).
at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight);
void invariant_product_avx512(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& y);
void invariant_product_avx2(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& y);

// bf16_matvec and fp32_linear of x by up to 4 weights of one K at once: one parallel region,
// each thread's blocks running from one product into the next.
std::vector<at::Tensor> bf16_matvec_group(const at::Tensor& x, at::ArrayRef<at::Tensor> weights,
                                          at::ArrayRef<c10::optional<at::Tensor>> biases);
std::vector<at::Tensor> fp32_linear_group(const at::Tensor& x, at::ArrayRef<at::Tensor> weights,
                                          at::ArrayRef<c10::optional<at::Tensor>> biases);

// avx2_linear of x by up to 4 weights of one K at once: one parallel region, x widened once.
std::vector<at::Tensor> avx2_linear_group(const at::Tensor& x, at::ArrayRef<at::Tensor> weights,
                                          at::ArrayRef<c10::optional<at::Tensor>> biases);

// amx_linear of x by up to 4 weights of one K at once (q, k and v; gate and up): one parallel
// region, x re-laid once, each thread's blocks running from one product into the next.
std::vector<at::Tensor> amx_linear_group(const at::Tensor& x, at::ArrayRef<at::Tensor> weights,
                                         at::ArrayRef<c10::optional<at::Tensor>> biases);

// Rows that share cache slots (a GRPO group after fork_caches): rows b hold in their first
// `shared` slots the keys and values of row b - b % group, so a decode reads those from that row,
// once for the group. Raises unless group divides the rows and shared >= 0.
inline void check_shared_slots(const char* name, int64_t rows, int64_t group, int64_t shared) {
  TORCH_CHECK(group >= 1 && rows % group == 0 && shared >= 0, name, ": group must divide the ", rows,
              " rows and shared be >= 0 (rows b share their first `shared` cache slots with row b - b % group), "
              "got group ", group, " and shared ", shared);
}

// softmax(scale q k^T, masked) v: q (b, h, s, d), k and v (b, h_kv, L, d), a bool mask that
// broadcasts to (b, h, s, L); returns (b, h, s, d) contiguous (decode_attention.cpp). widen: bf16
// scores from rows widened to fp32, as on a CPU without AVX512-BF16, where one has it (tests).
// group, shared: rows that share slots (check_shared_slots), read from their group's first row.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attn_mask,
                            double scale, bool widen = false, int64_t group = 1, int64_t shared = 0);

// Each row's index of its largest value, the first of equal ones, a NaN the largest: torch.max(x,
// -1).indices for fp32 (b, v) CPU logits, with AVX2 (first_argmax.cpp); greedy decoding's tokens.
at::Tensor first_argmax(const at::Tensor& x);

// Top-k sampling's cut in place: each value of contiguous fp32 (b, v) CPU logits below its row's
// k-th largest (a NaN ranked above every number) becomes -inf, as x.masked_fill_(x < x.topk(k,
// -1).values[:, -1:], -inf) leaves it, with AVX2 (top_k.cpp); k up to kKeepTopKMost.
constexpr int64_t kKeepTopKMost = 256;
void keep_top_k(const at::Tensor& x, int64_t k);

// Each row's running sums in fp64 of contiguous fp32 (b, v) CPU probabilities into out (b, v) fp64,
// as torch.cumsum(x, -1, dtype=torch.float64, out=out) writes them, 8 rows' chains at once
// (running_sums.cpp); the samplers' cumulative distribution.
void running_sums(const at::Tensor& x, const at::Tensor& out);

// A run of decoder layers' decode step, one token a row (decode_layers.cpp: its comment says what
// it computes and checks); attn::decode_loop calls it every step. avx2: with attn::avx2_linear's
// products and the AVX2 code below, for a CPU without AVX512-BF16. group, shared: the caches'
// rows that share slots, as attn::decode_attention takes them.
at::Tensor decode_layers(const at::Tensor& x, at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots,
                         const at::Tensor& mask, const at::Tensor& rotation, double eps, double scale,
                         int64_t amx_from_rows, const c10::optional<at::Tensor>& final_norm, double final_eps,
                         bool avx2, int64_t group = 1, int64_t shared = 0);

// x (M, K) by one bias-free weight with the kernel attn::decode_layers picks for its products
// (decode_layers.cpp); attn::decode_loop's output layer.
at::Tensor layer_product(const at::Tensor& x, const at::Tensor& weight, int64_t amx_from_rows, bool avx2);

// attn::decode_layers' work between its products with AVX2 and FMA (avx2_layers.cpp), T float or
// c10::BFloat16: layer_steps.h built for AVX2 (it says what each computes), and attention.
namespace avx2 {
template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t M, int64_t e, float eps);
template <typename T>
void rotate(T* x, int64_t M, int64_t heads, int64_t d, const float* cos, const float* sin, int64_t row_step);
template <typename T>
void add(const T* a, const T* b, T* out, int64_t count);
template <typename T>
void swiglu(T* gate, const T* up, int64_t count);
// softmax(scale q k^T, masked) v for one query a head: q (b, h, 1, d) contiguous, k and v (b, h_kv,
// n, d) with contiguous rows, allowed (1 or b, 1, 1, n) bool; (b, h, 1, d). group, shared: as
// attn::decode_attention takes them.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed,
                     double scale, int64_t group, int64_t shared);
}  // namespace avx2

}  // namespace attn

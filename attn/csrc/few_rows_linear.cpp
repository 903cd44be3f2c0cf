// attn::bf16_matvec and attn::fp32_linear: y = x W^T (+ bias) for a few rows x (M, K) and a
// weight W (N, K) as it is stored, with AVX-512 dot products that keep every row's sums in
// registers: bf16 with AVX512-BF16's vdpbf16ps (two bf16 products a fp32 lane an
// instruction, which inductor's code cannot emit), fp32 with FMAs; 1 to 16 rows each.
//
// A decode step at a small batch reads every weight once: it is bound by memory reads. Each
// pass over a step of features (32 bf16, 16 fp32) loads R weight rows once and multiplies them
// into M input rows (M x R accumulators of 16 fp32 lanes, at most 24, so they fit in the
// registers with the loads), prefetching the weight rows ahead into L2 where a pass takes more
// than one (one row of x, or two in bf16, reads one weight row a pass and leaves the stream to the
// hardware: outputs() says why); where prefetched, the hardware brings them
// on into L1; prefetching into L1 itself was 1.3-1.5x slower at 1 to 8 rows on an AMD EPYC, Zen
// 4: the 30 layers and the head, bf16, 9.4 against 12.4 ms at 1 row, 10.1 against 15.5 at 8;
// fp32 17.6 against 20.0 at 1 row, 19.3 against 26.8 at 8; not re-measured on the Intel kinds;
// bf16 past 8 rows prefetches into L1, which was faster there on Zen 5: outputs() has figures);
// the M x R sums are then folded 16 at a time with one shuffle tree (attn::sum_each). Up to 8
// rows one pass takes them all.
// Past 8, passes of 6 rows each take the same 4 weight rows, read again from L1: 10 loads for 24
// products, where one weight row into all 16 rows took 17 for 16 and ran out of load ports
// before memory ran dry. Pass i prefetches the weight rows r with r % passes == i, 2 R ahead,
// into L2, so memory is read through all of them. On an AMD EPYC (Zen 4), 2 threads, the 30
// layers and the head, both builds in one process, median of the paired per-round ratios
// against the former split (rows 0-7, then the rest, 3 weight rows: 11 loads for 24 products):
// bf16 0.92-0.93 at 16 rows, 0.91 at 12, 0.98 at 9; fp32 0.96-0.97 at 16, 0.91 at 12; the
// sums are added in the same order, so the outputs are the same bits. Where x is over 32 KB
// (a down product's 16 x 1536 in bf16, any fp32 one's at 16 rows), every other block runs its
// passes last to first, so that it starts on the rows of x still in L1: AMD EPYC Zen 5, 2
// threads, 16 rows, the 30 layers and the head of the SmolLM2-135M shape from memory (builds in
// one process, run in turn, median of 20-30 paired ratios): bf16 0.946, 0.958, 0.959 of the
// time in three runs (the down product alone, warm: 0.905-0.931), fp32 0.931; the same bits.
// The 30 layers' products of the SmolLM2-135M shape on 2 threads of a Xeon 6/167: bf16 9.0 ms at
// one row, 10.0 at 2, 11.1 at 4, 14.4 at 8, against 15.5 for oneDNN's product on packed weights
// and 21-22 for F.linear at any of those. fp32 at 16 rows, the 30 layers and the head (weights
// read from memory), the former two passes against one weight row a pass, both built in one
// process and run in turn, best / median of 6 rounds: 32.5 / 43.0 ms against 41.4 / 51.8 (the
// same loops in C: 27.7-30.2 against 37-44). bf16 past 8 rows is for CPUs without AMX
// (attn::amx_linear takes 5 to 32 rows where there is AMX): on an AMD EPYC (Zen 4), 2 threads,
// the 30 layers and the head, best of 16, with the former two passes, 15.7-17.6 ms at 16 rows and
// 13.0-13.5 at 12 against 30.5-35.5 and 27.8-28.2 for F.linear (oneDNN) in the same runs; at 5 to
// 8 rows 3 weight rows a pass (15.1-16.4 ms at 8) beat 2 (16.8-17.3). Sums are fp32, in another
// order than other kernels'; a bf16 output is rounded once, as c10::BFloat16 rounds (nearest even).
// Products that share x (a layer's q, k and v; its gate and up) run in one parallel region
// (attn::decode_layers calls them so). Built on first use by attn/native.py, which checks the CPU.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"
#include "linear_checks.h"
#include "product_group.h"
#include "row_tiles.h"
#include "simd.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#define ATTN_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

namespace {

// What differs between the dtypes: the values a step, how to load and multiply-add them, how
// a row of outputs is stored, and how many weight rows a pass takes for M rows of x.
struct Bf16 {
  using Value = uint16_t;
  using Vector = __m512bh;
  using Mask = __mmask32;
  static constexpr int64_t kStep = 32;
  static constexpr int64_t kAhead = 16;
  // Past 8 rows of x: the weight rows 3 blocks ahead, into L1 (outputs() has the measurements).
  static constexpr int64_t kBlocksAhead = 3;
  static constexpr bool kAheadIntoL1 = true;
  static constexpr int64_t kMaxRows = attn::kBf16MatvecMaxRows;
  // One or two rows of x: one weight row a pass (outputs() says why). > 8: passes of 6 rows.
  static constexpr int rows_per_pass(int m) { return m <= 2 ? 1 : m <= 4 ? 4 : m <= 8 ? 3 : 4; }
  ATTN_AVX512_BF16 static Vector load(const Value* p, Mask tail) {
    return tail ? (__m512bh)_mm512_maskz_loadu_epi16(tail, p) : (__m512bh)_mm512_loadu_si512(p);
  }
  ATTN_AVX512_BF16 static __m512 madd(__m512 acc, Vector w, Vector x) { return _mm512_dpbf16_ps(acc, w, x); }
  static float widen(Value v) {  // bf16 is fp32's top half: exact
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }
  // A row's R sums (plus R fp32 shifts, where shift is not null) rounded to bf16 as
  // c10::BFloat16 rounds (nearest even, a NaN as 0x7fc0) and stored at y, in one vector: c10's
  // scalar rounding, an output at a time, took 4% of a product of 12 to 16 rows (Zen 4).
  template <int R>
  ATTN_AVX512_BF16 static void store(Value* y, const float* sums, const float* shift) {
    constexpr __mmask16 kRow = (1u << R) - 1;
    __m512 sum = _mm512_maskz_loadu_ps(kRow, sums);
    if (shift != nullptr) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(kRow, shift));
    const __m512i bits = _mm512_castps_si512(sum);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));  // ties to even
    const __m512i bump = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bump), 16);
    const __m512i value =
        _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(sum, sum, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7fc0));
    _mm512_mask_storeu_epi16(y, kRow, _mm512_castsi256_si512(_mm512_cvtepi32_epi16(value)));
  }
};

struct Fp32 {
  using Value = float;
  using Vector = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kStep = 16;
  static constexpr int64_t kAhead = 8;
  // Past 8 rows of x: the weight rows 2 blocks ahead, into L2 (into L1 3 blocks ahead gave 0.89,
  // 0.90 and 1.12 times the tokens a second in three paired 16-row runs on Zen 5: a block of fp32
  // rows is twice the bytes, and x at 16 rows takes most of L1).
  static constexpr int64_t kBlocksAhead = 2;
  static constexpr bool kAheadIntoL1 = false;
  static constexpr int64_t kMaxRows = attn::kFp32LinearMaxRows;
  // One row of x: one weight row a pass (outputs() says why). > 8: passes of 6 rows.
  static constexpr int rows_per_pass(int m) { return m == 1 ? 1 : m <= 4 ? 4 : m <= 8 ? 2 : 4; }
  ATTN_AVX512_BF16 static Vector load(const Value* p, Mask tail) {
    return tail ? _mm512_maskz_loadu_ps(tail, p) : _mm512_loadu_ps(p);
  }
  ATTN_AVX512_BF16 static __m512 madd(__m512 acc, Vector w, Vector x) { return _mm512_fmadd_ps(w, x, acc); }
  static float widen(Value v) { return v; }
  // A row's R sums (plus R shifts, where shift is not null) stored at y: scalar code, as fast as
  // masked vectors here (1.00-1.02 of their time).
  template <int R>
  static void store(Value* y, const float* sums, const float* shift) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) y[r] = shift != nullptr ? sums[r] + shift[r] : sums[r];
  }
};

// One pass over a step of features (fewer under a tail mask): R weight rows, K apart from w,
// into the M rows of X.
template <typename D, int M, int R>
ATTN_AVX512_BF16 inline void pass(__m512 (&acc)[M][R], const typename D::Value* w, const typename D::Value* X,
                                  int64_t K, int64_t k, typename D::Mask tail) {
  typename D::Vector weight[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) weight[r] = D::load(w + r * K + k, tail);
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    const typename D::Vector row = D::load(X + m * K + k, tail);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[m][r] = D::madd(acc[m][r], weight[r], row);
  }
}

// The Count sums of Count accumulators into sums (Count rounded up to 16 floats). Always
// inlined: called, it took the accumulators through memory, 24 stores and loads a pass; inlined
// they stay in registers, 0.89-0.90 of the time of a bf16 product of 12 to 16 rows, 0.91-0.92 of
// an fp32 one (Zen 4), the same at 1 and 8 rows.
template <int Count>
ATTN_AVX512_BF16 __attribute__((always_inline)) inline void sum_all(const __m512* acc, float* sums) {
  for (int i = 0; i < Count; i += 16) {
    __m512 block[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) block[j] = i + j < Count ? acc[i + j] : _mm512_setzero_ps();
    _mm512_storeu_ps(sums + i, attn::sum_each(block));
  }
}

// Rows [0, M) of X against R weight rows from w, K in steps: their M x R sums. Of the weight
// rows at `ahead` (none when null), rows first, first + every, ... < R are prefetched into L2,
// or into L1 where IntoL1.
template <typename D, int M, int R, bool IntoL1>
ATTN_AVX512_BF16 inline void sums_of(const typename D::Value* w, const typename D::Value* X, int64_t K,
                                     const typename D::Value* ahead, int first, int every, float* sums) {
  constexpr _mm_hint kHint = IntoL1 ? _MM_HINT_T0 : _MM_HINT_T1;
  const int64_t full = K - K % D::kStep;
  const auto tail = K % D::kStep ? static_cast<typename D::Mask>((1ull << (K % D::kStep)) - 1) : 0;
  __m512 acc[M][R];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < full; k += D::kStep) {
    if (ahead != nullptr) {
#pragma GCC unroll 8
      for (int r = first; r < R; r += every) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * K + k), kHint);
    }
    pass<D, M, R>(acc, w, X, K, k, 0);
  }
  if (tail) pass<D, M, R>(acc, w, X, K, full, tail);
  sum_all<M * R>(&acc[0][0], sums);
}

// Rows of x a pass takes: all of them up to 8; past 8, 6 (6 x 4 accumulators).
constexpr int rows_a_pass(int m) { return m <= 8 ? m : 6; }

// Where a pass's sums go: pass i's at i x pass_stride(M, R) floats, its rows' R sums one after
// another (a pass stores them rounded up to 16 floats, which the stride leaves room for).
constexpr int pass_stride(int m, int r) { return (rows_a_pass(m) * r + 15) / 16 * 16; }

// Rows [Start, M) of X against R weight rows from w, in passes of rows_a_pass(M) (from the last
// pass to the first where Backwards): their sums into sums (pass_stride). Pass i prefetches the
// weight rows at `ahead` r with r % passes == i (past 8 rows, into L1 where D says so).
template <typename D, int M, int R, bool Backwards, int Start = 0>
ATTN_AVX512_BF16 inline void sums_in_passes(const typename D::Value* w, const typename D::Value* X, int64_t K,
                                            const typename D::Value* ahead, float* sums) {
  constexpr int kPassRows = rows_a_pass(M);
  constexpr int kPasses = (M + kPassRows - 1) / kPassRows;
  constexpr int kRows = std::min(kPassRows, M - Start);
  constexpr int kPass = Start / kPassRows;
  constexpr bool kMore = Start + kRows < M;
  if constexpr (Backwards && kMore) sums_in_passes<D, M, R, Backwards, Start + kRows>(w, X, K, ahead, sums);
  sums_of<D, kRows, R, (M > 8 && D::kAheadIntoL1)>(w, X + Start * K, K, ahead, kPass, kPasses,
                                                   sums + kPass * pass_stride(M, R));
  if constexpr (!Backwards && kMore) sums_in_passes<D, M, R, Backwards, Start + kRows>(w, X, K, ahead, sums);
}

// Outputs [n0, n1) of every row, R at a time ((n1 - n0) is a multiple of R). Up to 8 rows, one
// pass multiplies each weight row into all of them; past 8, passes of 6 rows take the same 4
// weight rows, read again from L1, so that a step loads 4 weight vectors and 6 of x for 24
// products (0.42 loads a product, against 1.06 for one weight row into 16 rows).
// One row of x reads one weight row a pass, with no software prefetch: the weights go by as one
// sequential stream, which the hardware's stream prefetcher follows best. The 30 layers and the
// head of the SmolLM2-135M shape at one row (Zen 4, separate builds in paired processes,
// 2026-12-06), against 4 weight rows a pass (4 streams 1152 bytes apart) prefetched 16 rows ahead:
// bf16 0.89-0.90 of the time on one thread with one row a pass still prefetched, and 0.72-0.78
// without the prefetch (about 26 GB/s, llama.cpp's rate on that thread), median 0.91 on two; fp32
// 0.73-0.77 on one, about 0.95 on two. The prefetch 8 or 32 rows ahead changed nothing; with 4
// rows a pass and no prefetch the read was 12 GB/s. bf16 at two rows of x takes one stream too:
// the 30 layers (attn::decode_layers) 0.78 of the time on one thread, 0.94 on two (both builds in
// one process, run in turn, median of 12 paired ratios, 2026-12-07); not at three rows (1.19 and
// 1.05), and not fp32 at two (1.18 and 1.23: a weight row of fp32 is twice the loads a product).
// Where a pass takes more than one weight row, they are prefetched. Past 8 rows bf16 prefetches
// into L1, 3 blocks ahead: on an AMD EPYC Zen 5, 2 threads, the products of 30 layers and the
// head of that shape at 16 rows (builds in one process, run in turn, median of 25 paired ratios,
// 2026-12-07) took 0.92-0.93 of the time of L2 2 blocks ahead (L1 2 ahead 1.01, 8 ahead 0.99; L2
// 4 ahead 1.09; no prefetch 1.32); at 12 rows 0.99, at 9 0.91; the bench's 16-row bf16 decode
// ran 1.01, 1.05 and 1.14 times as many tokens a second in three paired runs. Not measured on
// Zen 4 or Intel, where L1 was the slower target at 1 to 8 rows (above).
template <typename D, int M, int R>
ATTN_AVX512_BF16 void outputs(const typename D::Value* W, const typename D::Value* X, const typename D::Value* bias,
                              typename D::Value* Y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t kAhead = M > 8 ? D::kBlocksAhead * R : D::kAhead;  // prefetch distance, weight rows
  constexpr bool kPrefetch = D::rows_per_pass(M) > 1;
  constexpr int kPassRows = rows_a_pass(M), kStride = pass_stride(M, R);
  alignas(64) float sums[(M + kPassRows - 1) / kPassRows * kStride];  // see sums_in_passes
  // Past 8 rows, where x is over 32 KB (16 rows: K over 1024 in bf16, over 512 in fp32), every
  // other block of outputs runs its passes last to first: it starts on the rows of x the block
  // before ended on, still in L1, where the next pass's would have been evicted by the others'.
  const bool turns = M > 8 && M * K * static_cast<int64_t>(sizeof(typename D::Value)) > 32 * 1024;
  for (int64_t n = n0; n < n1; n += R) {
    const typename D::Value* w = W + n * K;
    const typename D::Value* ahead = kPrefetch && n + kAhead + R <= N ? w + kAhead * K : nullptr;
    if (turns && (n - n0) / R % 2 == 1)
      sums_in_passes<D, M, R, true>(w, X, K, ahead, sums);
    else
      sums_in_passes<D, M, R, false>(w, X, K, ahead, sums);
    float shift[R];  // the block's bias in fp32, widened once for all M rows
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) shift[r] = bias != nullptr ? D::widen(bias[n + r]) : 0.0f;
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
      D::template store<R>(Y + m * N + n, sums + m / kPassRows * kStride + m % kPassRows * R,
                           bias != nullptr ? shift : nullptr);
  }
}

using attn::product_group::Target;

// The products of x (M, K) by each of a group's weights, in one parallel region
// (product_group.h).
template <typename D, int M>
void product(const Target* group, int count, const void* X, int64_t K) {
  using V = typename D::Value;
  constexpr int R = D::rows_per_pass(M);
  const auto* x = static_cast<const V*>(X);
  const auto blocks = [&](auto rows_a_pass, const Target& t, int64_t n0, int64_t n1) {
    outputs<D, M, decltype(rows_a_pass)::value>(static_cast<const V*>(t.W), x, static_cast<const V*>(t.bias),
                                                static_cast<V*>(t.Y), t.N, K, n0, n1);
  };
  attn::product_group::run<R>(group, count, /*grain=*/64 / R, blocks);
}

// D's loop as attn::row_tiles' kernel (attn::invariant_linear's products).
template <typename D>
struct Tiles {
  using In = typename D::Value;
  using Out = typename D::Value;
  static constexpr int64_t kMaxRows = D::kMaxRows;
  static constexpr int rows_per_pass(int m) { return D::rows_per_pass(m); }
  template <int M, int R>
  static void outputs(const void* W, const In* X, Out* Y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    ::outputs<D, M, R>(static_cast<const In*>(W), X, nullptr, Y, N, K, n0, n1);
  }
};

using Product = void (*)(const Target*, int, const void*, int64_t);

template <typename D, size_t... I>
constexpr std::array<Product, sizeof...(I)> products(std::index_sequence<I...>) {
  return {product<D, static_cast<int>(I) + 1>...};
}

template <typename D>
std::vector<at::Tensor> linear(const at::Tensor& x, at::ArrayRef<at::Tensor> weights,
                               at::ArrayRef<c10::optional<at::Tensor>> biases, int64_t M) {
  static constexpr auto kProducts = products<D>(std::make_index_sequence<D::kMaxRows>());
  const at::Tensor rows = x.contiguous();
  std::vector<at::Tensor> shifts;
  Target group[attn::product_group::kMostProducts];
  std::vector<at::Tensor> outputs = attn::product_group::targets(x, weights, biases, group, shifts);
  kProducts[M - 1](group, static_cast<int>(weights.size()), rows.data_ptr(), weights[0].size(1));
  return outputs;
}

}  // namespace

namespace attn {

std::vector<at::Tensor> bf16_matvec_group(const at::Tensor& x, at::ArrayRef<at::Tensor> weights,
                                          at::ArrayRef<c10::optional<at::Tensor>> biases) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "attn::bf16_matvec needs a CPU with AVX512-BF16");
  const int64_t M =
      product_group::check("attn::bf16_matvec", at::kBFloat16, "bf16", Bf16::kMaxRows, 1, x, weights, biases);
  return linear<Bf16>(x, weights, biases, M);
}

std::vector<at::Tensor> fp32_linear_group(const at::Tensor& x, at::ArrayRef<at::Tensor> weights,
                                          at::ArrayRef<c10::optional<at::Tensor>> biases) {
  // Built with the bf16 kernel's instruction set (one template for both): the same CPUs.
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "attn::fp32_linear needs a CPU with AVX512-BF16");
  const int64_t M =
      product_group::check("attn::fp32_linear", at::kFloat, "fp32", Fp32::kMaxRows, 1, x, weights, biases);
  return linear<Fp32>(x, weights, biases, M);
}

void invariant_product_avx512(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& y) {
  const int64_t N = weight.size(0), K = weight.size(1), M = x.numel() / K;
  if (x.scalar_type() == at::kBFloat16) {
    using V = Bf16::Value;
    row_tiles::product<Tiles<Bf16>>(weight.data_ptr(), static_cast<const V*>(x.data_ptr()),
                                    static_cast<V*>(y.data_ptr()), M, N, K);
  } else {
    row_tiles::product<Tiles<Fp32>>(weight.data_ptr(), x.data_ptr<float>(), y.data_ptr<float>(), M, N, K);
  }
}

at::Tensor bf16_matvec(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return bf16_matvec_group(x, {weight}, {bias})[0];
}

at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return fp32_linear_group(x, {weight}, {bias})[0];
}

}  // namespace attn

TORCH_LIBRARY_IMPL(attn, CPU, m) {
  m.impl("bf16_matvec", &attn::bf16_matvec);
  m.impl("fp32_linear", &attn::fp32_linear);
}

// attn::amx_linear: y = x W^T (+ bias) for 1 to 32 bf16 rows x (M, K) and a bf16 weight
// W (N, K), with AMX tiles reading W as it is stored (no packed copy).
//
// A decode step of a GRPO group (16 rows) reads every weight once and does 16 products with
// each element: too many for the dot-product kernel (attn::bf16_matvec keeps 8 rows in
// registers), too few for oneDNN's matrix product to pay its fixed cost and packed copy back.
// An AMX tile product C (16 x 16, fp32) += A (16 x 32, bf16) B (32 x 16, bf16) takes 16
// rows of W as A, loaded straight from the weight (a row stride of K), and x, re-laid once a
// call into pairs of features (the B layout), as B: C is then 16 outputs of W for 16 rows of
// x, transposed on the way out. Each thread walks its outputs 16 at a time, K in steps of 32,
// and prefetches the rows 8 blocks ahead into L2. The 30 layers' products of the SmolLM2-135M
// shape on 2 threads of a Xeon 6/167, 16 rows: 11.6-12.6 ms, against 15.0-15.7 for oneDNN's
// product on packed weights; at 8 rows 11.0-12.1 against 14.0-14.6 for attn::bf16_matvec (which
// stays the faster at 1 and 2 rows). Two accumulator tiles for even and odd steps (no chain of
// dependent tile products) were slower in the step: 77-79 against 72.6-72.8 us a call.
//
// The loads of W keep memory busy only while they are issued: work between blocks stalls the
// stream. Each block's sums therefore go out in the middle of the next block (even and odd blocks
// use their own tiles), transposed with shuffles, and x is re-laid with the same transpose. The
// output head alone (49,152 x 576, 16 rows): 24.5 GB/s against 20.3 with a gather per row right
// after each block; the same loops in C without any outputs read 25-26. The 30 layers and the
// head, against the kernel before, both built in one process and run in turn, best / median of
// 6 rounds: 8 rows 14.0 / 16.0 ms against 16.9 / 17.9, 16 rows 15.8 / 17.0 against 17.7 / 19.2.
//
// Sums are fp32; each output is rounded to bf16 once (nearest even). Built on first use by
// attn/native.py, which checks the CPU has AMX.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include "kernels.h"
#include "linear_checks.h"
#include "product_group.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#define ATTN_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

namespace {

constexpr int64_t kBlock = 16;       // outputs a tile
constexpr int64_t kStep = 32;        // features a tile
constexpr int64_t kAheadBlocks = 8;  // prefetch distance, in blocks of 16 weight rows

// Linux gives a process AMX's tile state on request only (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); oneDNN asks the same, and asking twice is harmless.
bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes a row
  uint8_t rows[16] = {};
};

// Blocks alternate between two sets of tiles, so that one block's products start while the last
// one's sums are stored: C 0, 1 (x's rows 0-15 and 16-31) and A 2 for even blocks; C 4, 5 and A
// 6 for odd ones; B 3 and 7 for the two halves of x. C and A have `outputs` rows (16, or fewer
// for the last block). Loading a configuration zeroes every tile.
ATTN_AMX void configure(int64_t outputs) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = t == 3 || t == 7 ? 16 : static_cast<uint8_t>(outputs);
  }
  _tile_loadconfig(&config);
}

// x (M, K2 feature pairs) as B tiles, (halves, steps, 16 pairs, 16 rows).
ATTN_AMX void repack(const uint32_t* x, int64_t M, int64_t K2, int halves, int64_t steps, uint32_t* pairs) {
  for (int half = 0; half < halves; ++half)
    for (int64_t s = 0; s < steps; ++s) {
      __m512i rows[16];
      for (int64_t i = 0; i < kBlock; ++i) {
        const int64_t m = half * kBlock + i;
        rows[i] = m < M ? _mm512_loadu_si512(x + m * K2 + s * kBlock) : _mm512_setzero_si512();
      }
      attn::transpose16(rows);
      uint32_t* tile = pairs + (half * steps + s) * kBlock * kBlock;
      for (int64_t p = 0; p < kBlock; ++p) _mm512_storeu_si512(tile + p * kBlock, rows[p]);
    }
}

// One block's sums, c[half][output][row], as rows of Y: transposed, plus the bias, rounded to
// bf16 once (nearest even).
template <int Halves>
ATTN_AMX void store(const float (&c)[Halves][kBlock * kBlock], const uint16_t* bias, uint16_t* Y, int64_t M, int64_t N,
                    int64_t n) {
  const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(kBlock, N - n)) - 1);
  __m512 shift = _mm512_setzero_ps();
  if (bias != nullptr) {
    const __m256i raw = _mm256_maskz_loadu_epi16(valid, bias + n);
    shift = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  for (int half = 0; half < Halves; ++half) {
    __m512i rows[kBlock];
    for (int64_t o = 0; o < kBlock; ++o) rows[o] = _mm512_load_si512(c[half] + o * kBlock);
    attn::transpose16(rows);  // rows[m]: row m's 16 outputs
    for (int64_t i = 0; i < kBlock && half * kBlock + i < M; ++i) {
      const __m512 sums = _mm512_add_ps(_mm512_castsi512_ps(rows[i]), shift);
      _mm256_mask_storeu_epi16(Y + (half * kBlock + i) * N + n, valid, (__m256i)_mm512_cvtneps_pbh(sums));
    }
  }
}

// One block of 16 outputs (W's rows from w) into tiles C0, C1 with A, then into c. The previous
// block's sums are stored after a few steps, once their tile store has landed; `ahead`, when not
// null, is the block kAheadBlocks on, prefetched into L2. A macro, as the tile intrinsics take
// their tiles' numbers as text: one function for each set of tiles.
#define ATTN_BLOCK(name, C0, C1, A)                                                                              \
  template <int Halves, typename Previous>                                                                      \
  ATTN_AMX inline void name(const uint16_t* w, const uint16_t* pairs, int64_t steps, int64_t stride,            \
                            const char* ahead, float(&c)[Halves][kBlock * kBlock], Previous&& previous) {      \
    const int64_t half_size = steps * kBlock * kStep; /* uint16 values in one half's B tiles */                 \
    const int64_t store_at = std::min<int64_t>(2, steps - 1);                                                   \
    _tile_zero(C0);                                                                                              \
    if (Halves == 2) _tile_zero(C1);                                                                             \
    for (int64_t s = 0; s < steps; ++s) {                                                                        \
      if (ahead != nullptr) {                                                                                    \
        _Pragma("GCC unroll 16") for (int r = 0; r < kBlock; ++r)                                               \
            _mm_prefetch(ahead + r * stride + s * kStep * 2, _MM_HINT_T1);                                      \
      }                                                                                                          \
      _tile_loadd(A, w + s * kStep, stride);                                                                     \
      _tile_loadd(3, pairs + s * kBlock * kStep, 64);                                                            \
      _tile_dpbf16ps(C0, A, 3);                                                                                  \
      if (Halves == 2) {                                                                                         \
        _tile_loadd(7, pairs + half_size + s * kBlock * kStep, 64);                                              \
        _tile_dpbf16ps(C1, A, 7);                                                                                \
      }                                                                                                          \
      if (s == store_at) previous();                                                                             \
    }                                                                                                            \
    _tile_stored(C0, c[0], 64);                                                                                  \
    if (Halves == 2) _tile_stored(C1, c[Halves - 1], 64);                                                        \
  }

ATTN_BLOCK(even_block, 0, 1, 2)
ATTN_BLOCK(odd_block, 4, 5, 6)
#undef ATTN_BLOCK

// One product of a group that shares x: W (N, K) into Y (M, N), plus bias (or null). Its blocks
// of 16 outputs are the group's blocks [first, first + ceil(N / 16)).
struct Product {
  const uint16_t* W;
  const uint16_t* bias;
  uint16_t* Y;
  int64_t N;
  int64_t first;
};

// The product that the group's block b belongs to.
inline const Product& product_of(const Product* group, int count, int64_t b) {
  int i = 0;
  while (i + 1 < count && b >= group[i + 1].first) ++i;
  return group[i];
}

// The group's blocks [b0, b1) of 16 outputs (each product's last may be short), one product's
// after another's with no pause between them. pairs: x as B tiles, (halves, K / 32, 16 feature
// pairs, 16 rows, 2).
template <int Halves>
ATTN_AMX void blocks(const Product* group, int count, const uint16_t* pairs, int64_t M, int64_t K, int64_t b0,
                     int64_t b1) {
  const int64_t steps = K / kStep, stride = K * 2;
  alignas(64) float c[2][Halves][kBlock * kBlock] = {};  // c[block % 2][half][output][row]
  int64_t configured = -1;
  for (int64_t b = b0; b < b1; ++b) {
    const Product& p = product_of(group, count, b);
    const int64_t local = b - p.first;
    const int64_t outputs = std::min<int64_t>(kBlock, p.N - local * kBlock);
    if (outputs != configured) configure(configured = outputs);
    const uint16_t* w = p.W + local * kBlock * K;
    const char* ahead = nullptr;
    if (b + kAheadBlocks < b1) {
      const Product& next = product_of(group, count, b + kAheadBlocks);
      ahead = reinterpret_cast<const char*>(next.W + (b + kAheadBlocks - next.first) * kBlock * K);
    }
    auto previous = [&] {
      if (b == b0) return;
      const Product& last = product_of(group, count, b - 1);
      store<Halves>(c[(b - 1) % 2], last.bias, last.Y, M, last.N, (b - 1 - last.first) * kBlock);
    };
    if (b % 2 == 0) {
      even_block<Halves>(w, pairs, steps, stride, ahead, c[0], previous);
    } else {
      odd_block<Halves>(w, pairs, steps, stride, ahead, c[1], previous);
    }
  }
  if (b1 > b0) {
    const Product& last = product_of(group, count, b1 - 1);
    store<Halves>(c[(b1 - 1) % 2], last.bias, last.Y, M, last.N, (b1 - 1 - last.first) * kBlock);
  }
  if (configured != -1) _tile_release();
}

}  // namespace

namespace attn {

std::vector<at::Tensor> amx_linear_group(const at::Tensor& x, at::ArrayRef<at::Tensor> weights,
                                         at::ArrayRef<c10::optional<at::Tensor>> biases) {
  TORCH_CHECK(__builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("avx512bf16"),
              "attn::amx_linear needs a CPU with AMX-BF16");
  TORCH_CHECK(tiles_permitted(), "attn::amx_linear: Linux refused this process AMX's tile state "
              "(arch_prctl ARCH_REQ_XCOMP_PERM); a kernel before 5.16 cannot grant it");
  const int64_t M = attn::product_group::check("attn::amx_linear", at::kBFloat16, "bf16", attn::kAmxLinearMaxRows,
                                               kStep, x, weights, biases);
  const int64_t K = weights[0].size(1);
  const at::Tensor rows = x.contiguous();
  // x as B tiles: feature pair p of row m (two bf16, one uint32) at (half, step, p, m % 16);
  // rows past M are zero. One 16 x 16 transpose a (half, step).
  const int halves = M > kBlock ? 2 : 1;
  const int64_t steps = K / kStep;
  thread_local std::vector<uint32_t> pairs;
  pairs.resize(std::max<size_t>(pairs.size(), halves * steps * kBlock * kBlock));
  repack(reinterpret_cast<const uint32_t*>(rows.data_ptr()), M, K / 2, halves, steps, pairs.data());
  std::vector<at::Tensor> outputs, shifts;
  Product group[attn::product_group::kMostProducts];
  int64_t count = 0;  // blocks in all
  for (size_t i = 0; i < weights.size(); ++i) {
    const int64_t N = weights[i].size(0);
    std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
    sizes.back() = N;
    outputs.push_back(at::empty(sizes, x.options()));
    shifts.push_back(biases[i].has_value() ? biases[i]->contiguous() : at::Tensor());
    group[i] = {reinterpret_cast<const uint16_t*>(weights[i].data_ptr()),
                biases[i].has_value() ? reinterpret_cast<const uint16_t*>(shifts.back().data_ptr()) : nullptr,
                reinterpret_cast<uint16_t*>(outputs.back().data_ptr()), N, count};
    count += (N + kBlock - 1) / kBlock;
  }
  const auto* B = reinterpret_cast<const uint16_t*>(pairs.data());
  const int products = static_cast<int>(weights.size());
  at::parallel_for(0, count, /*grain_size=*/4, [&](int64_t b0, int64_t b1) {
    if (halves == 2) {
      blocks<2>(group, products, B, M, K, b0, b1);
    } else {
      blocks<1>(group, products, B, M, K, b0, b1);
    }
  });
  return outputs;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return amx_linear_group(x, {weight}, {bias})[0];
}

}  // namespace attn

TORCH_LIBRARY_IMPL(attn, CPU, m) { m.impl("amx_linear", &attn::amx_linear); }

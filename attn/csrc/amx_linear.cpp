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
// dependent tile products) were slower in the step: 77-79 against 72.6-72.8 us a call. Sums
// are fp32; each output is rounded to bf16 once (nearest even). Built on first use by
// attn/native.py, which checks the CPU has AMX.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

// The input checks repeat few_rows_linear.cpp's: a header shared by both would not be seen by torch's
// extension builder, which rebuilds when a source's text changes, not an included file's.
#define ATTN_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

namespace {

constexpr int64_t kMaxRows = 32;     // two tiles of 16 rows of x
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

// Tiles 0, 1: C for rows 0-15 and 16-31 of x; 2: A (outputs rows of W); 3, 4: B for the two
// halves of x. `outputs` rows of C and A (16, or fewer for the last block).
ATTN_AMX void configure(int64_t outputs) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = t <= 2 ? static_cast<uint8_t>(outputs) : 16;
  }
  _tile_loadconfig(&config);
}

// Blocks [b0, b1) of 16 outputs (the last may be short: `last_outputs`). pairs: x as B tiles,
// (halves, K / 32, 16 feature pairs, 16 rows, 2).
template <int Halves>
ATTN_AMX void blocks(const uint16_t* W, const uint16_t* pairs, const uint16_t* bias, uint16_t* Y, int64_t M, int64_t N,
                     int64_t K, int64_t b0, int64_t b1) {
  const int64_t steps = K / kStep, stride = K * 2;
  const int64_t half_size = steps * kBlock * kStep;  // uint16 values in one half's B tiles
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(kBlock));
  alignas(64) float c[Halves][kBlock * kBlock];  // c[half][output][row]
  int64_t configured = -1;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n = b * kBlock, outputs = std::min<int64_t>(kBlock, N - n);
    if (outputs != configured) configure(configured = outputs);
    const uint16_t* w = W + n * K;
    _tile_zero(0);
    if (Halves == 2) _tile_zero(1);
    for (int64_t s = 0; s < steps; ++s) {
      if (b + kAheadBlocks < b1) {
        const char* ahead = reinterpret_cast<const char*>(w + kAheadBlocks * kBlock * K + s * kStep);
#pragma GCC unroll 16
        for (int r = 0; r < kBlock; ++r) _mm_prefetch(ahead + r * stride, _MM_HINT_T1);
      }
      _tile_loadd(2, w + s * kStep, stride);
      _tile_loadd(3, pairs + s * kBlock * kStep, 64);
      _tile_dpbf16ps(0, 2, 3);
      if (Halves == 2) {
        _tile_loadd(4, pairs + half_size + s * kBlock * kStep, 64);
        _tile_dpbf16ps(1, 2, 4);
      }
    }
    _tile_stored(0, c[0], 64);
    if (Halves == 2) _tile_stored(1, c[Halves - 1], 64);
    const __mmask16 valid = static_cast<__mmask16>((1u << outputs) - 1);
    __m512 shift = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __m256i raw = _mm256_maskz_loadu_epi16(valid, bias + n);
      shift = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int64_t m = 0; m < M; ++m) {
      const __m512 sums = _mm512_add_ps(_mm512_i32gather_ps(column, c[m / kBlock] + m % kBlock, 4), shift);
      _mm256_mask_storeu_epi16(Y + m * N + n, valid, (__m256i)_mm512_cvtneps_pbh(sums));  // nearest even
    }
  }
  if (configured != -1) _tile_release();
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(__builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("avx512bf16"),
              "attn::amx_linear needs a CPU with AMX-BF16");
  TORCH_CHECK(tiles_permitted(), "attn::amx_linear: Linux refused this process AMX's tile state "
              "(arch_prctl ARCH_REQ_XCOMP_PERM); a kernel before 5.16 cannot grant it");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "attn::amx_linear takes bf16 tensors, got x ", x.scalar_type(), " and weight ", weight.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "attn::amx_linear runs on the CPU, got x on ",
              x.device(), " and weight on ", weight.device());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "attn::amx_linear: weight must be a contiguous (n, k) "
              "matrix, got sizes ", weight.sizes(), " and strides ", weight.strides());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K > 0 && K % kStep == 0 && x.dim() >= 1 && x.size(-1) == K, "attn::amx_linear: x must end in the "
              "weight's ", K, " features, a multiple of ", kStep, "; got x ", x.sizes(), " and weight ", weight.sizes());
  const int64_t M = x.numel() / K;
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "attn::amx_linear takes 1 to ", kMaxRows, " rows of x, got ", M, " (sizes ",
              x.sizes(), "): F.linear is the product for more");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == N,
                "attn::amx_linear: bias must be a bf16 (", N, ",) vector, got ", bias->scalar_type(), " ",
                bias->sizes());
  }
  const at::Tensor rows = x.contiguous();
  const at::Tensor shift = bias.has_value() ? bias->contiguous() : at::Tensor();
  // x as B tiles: feature pair p of row m (two bf16, one uint32) at (half, step, p, m % 16);
  // rows past M stay zero.
  const int halves = M > kBlock ? 2 : 1;
  const int64_t steps = K / kStep;
  std::vector<uint32_t> pairs(halves * steps * kBlock * kBlock, 0);
  const uint32_t* X = reinterpret_cast<const uint32_t*>(rows.data_ptr());  // (M, K / 2) pairs
  for (int64_t m = 0; m < M; ++m)
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t p = 0; p < kBlock; ++p)
        pairs[((m / kBlock * steps + s) * kBlock + p) * kBlock + m % kBlock] = X[m * K / 2 + s * kBlock + p];
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  const auto* W = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const auto* B = reinterpret_cast<const uint16_t*>(pairs.data());
  const auto* b = bias.has_value() ? reinterpret_cast<const uint16_t*>(shift.data_ptr()) : nullptr;
  auto* Y = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t count = (N + kBlock - 1) / kBlock;
  at::parallel_for(0, count, /*grain_size=*/4, [&](int64_t b0, int64_t b1) {
    if (halves == 2) {
      blocks<2>(W, B, b, Y, M, N, K, b0, b1);
    } else {
      blocks<1>(W, B, b, Y, M, N, K, b0, b1);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(attn, CPU, m) { m.impl("amx_linear", &amx_linear); }

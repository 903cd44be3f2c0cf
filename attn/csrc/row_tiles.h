// The loop of attn::invariant_linear's products (few_rows_linear.cpp and avx2_linear.cpp): Y (M, N)
// = X (M, K) W^T for any M, in tiles of up to Kernel::kMaxRows rows of X, each tile run by a
// few-row kernel whose row's sums do not depend on the tile's other rows. attn/native.py hashes
// this header into the build's flags, so that a change here rebuilds the sources.
//
// A Kernel gives: In and Out (X's and Y's element types), kMaxRows, rows_per_pass(m) (weight rows
// a pass for m rows of X), and outputs<M, R>(W, X, Y, N, K, n0, n1), outputs [n0, n1) of M rows of
// X, R weight rows at a time ((n1 - n0) a multiple of R).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

namespace attn::row_tiles {

using Tile = void (*)(const void* W, const void* X, void* Y, int64_t N, int64_t K, int64_t n0, int64_t n1);

// One tile of M rows of X (K apart) against weight rows [n0, n1) into Y (N apart): blocks of
// rows_per_pass(M) weight rows, then one at a time for the rest. A row's sums are the same
// instructions in the same order whatever M and R are (one accumulator a row and weight row, the
// features in order, one fold tree), so its bits are those of the row alone.
template <typename Kernel, int M>
void tile(const void* W, const void* X, void* Y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int R = Kernel::rows_per_pass(M);
  const auto* x = static_cast<const typename Kernel::In*>(X);
  auto* y = static_cast<typename Kernel::Out*>(Y);
  const int64_t blocks_end = n0 + (n1 - n0) / R * R;
  Kernel::template outputs<M, R>(W, x, y, N, K, n0, blocks_end);
  if (blocks_end < n1) Kernel::template outputs<M, 1>(W, x, y, N, K, blocks_end, n1);
}

template <typename Kernel, size_t... I>
constexpr std::array<Tile, sizeof...(I)> tiles(std::index_sequence<I...>) {
  return {tile<Kernel, static_cast<int>(I) + 1>...};
}

// Y (M, N) = X (M, K) W^T, every row in a tile of kMaxRows rows (the last one fewer). The threads
// split the weight rows in units of kUnit (a multiple of every kernel's weight rows a pass); each
// takes its share kChunk weight rows at a time through every tile, so a chunk (kChunk x K values)
// is read from memory once and from the caches by the tiles after the first.
template <typename Kernel>
void product(const void* W, const typename Kernel::In* X, typename Kernel::Out* Y, int64_t M, int64_t N, int64_t K) {
  static constexpr auto kTiles = tiles<Kernel>(std::make_index_sequence<Kernel::kMaxRows>());
  constexpr int64_t kUnit = 48;
  constexpr int64_t kChunk = 96;
  at::parallel_for(0, (N + kUnit - 1) / kUnit, /*grain_size=*/1, [&](int64_t u0, int64_t u1) {
    const int64_t end = std::min(u1 * kUnit, N);
    for (int64_t c0 = u0 * kUnit; c0 < end; c0 += kChunk) {
      const int64_t c1 = std::min(c0 + kChunk, end);
      for (int64_t m0 = 0; m0 < M; m0 += Kernel::kMaxRows) {
        kTiles[std::min(Kernel::kMaxRows, M - m0) - 1](W, X + m0 * K, Y + m0 * N, N, K, c0, c1);
      }
    }
  });
}

}  // namespace attn::row_tiles

// Products that share x (a layer's q, k and v; its gate and up) in one parallel region: the
// group's blocks of R outputs are numbered one product after another, and each thread's run of
// them goes from one product into the next, so the threads fork and join once for the group
// rather than once a product. attn::bf16_matvec's, attn::fp32_linear's (few_rows_linear.cpp) and
// attn::avx2_linear's (avx2_linear.cpp) groups run so; attn::amx_linear numbers its blocks of 16
// the same way inside its own loop. attn/native.py hashes this header into the build's flags.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include "linear_checks.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace attn::product_group {

constexpr size_t kMostProducts = 4;

// One product of a group: W (N, K) into Y (M, N), plus bias (or null).
struct Target {
  const void* W;
  const void* bias;
  void* Y;
  int64_t N;
};

// Checks a group's weights against x (as check_linear checks each) and returns M, the rows of x.
inline int64_t check(const char* name, at::ScalarType dtype, const char* dtype_name, int64_t max_rows,
                     int64_t features_step, const at::Tensor& x, at::ArrayRef<at::Tensor> weights,
                     at::ArrayRef<c10::optional<at::Tensor>> biases) {
  TORCH_CHECK(!weights.empty() && weights.size() == biases.size() && weights.size() <= kMostProducts, name,
              " takes 1 to ", kMostProducts, " weights, each with a bias or none, got ", weights.size(), " and ",
              biases.size());
  int64_t M = 0;
  for (size_t i = 0; i < weights.size(); ++i)
    M = check_linear(name, dtype, dtype_name, max_rows, features_step, x, weights[i], biases[i]);
  return M;
}

// The group's outputs, x's shape with each weight's N last, and its targets in `group`; `shifts`
// keeps the biases' contiguous copies alive while the group runs.
inline std::vector<at::Tensor> targets(const at::Tensor& x, at::ArrayRef<at::Tensor> weights,
                                       at::ArrayRef<c10::optional<at::Tensor>> biases, Target* group,
                                       std::vector<at::Tensor>& shifts) {
  std::vector<at::Tensor> outputs;
  for (size_t i = 0; i < weights.size(); ++i) {
    std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
    sizes.back() = weights[i].size(0);
    outputs.push_back(at::empty(sizes, x.options()));
    shifts.push_back(biases[i].has_value() ? biases[i]->contiguous() : at::Tensor());
    group[i] = {weights[i].data_ptr(), biases[i].has_value() ? shifts.back().data_ptr() : nullptr,
                outputs.back().data_ptr(), weights[i].size(0)};
  }
  return outputs;
}

// Runs outputs(std::integral_constant<int, R>(), target, n0, n1) on outputs [n0, n1) of each
// product (a multiple of R), the group's blocks split between the threads (at least `grain` a
// thread), then outputs(std::integral_constant<int, 1>(), target, n0, n1) on each product's last
// N % R outputs on the calling thread: the weight rows a pass as a constant the callee's
// template takes.
template <int R, typename Outputs>
void run(const Target* group, int count, int64_t grain, const Outputs& outputs) {
  int64_t first[kMostProducts + 1] = {0};  // product i's blocks are [first[i], first[i + 1])
  for (int i = 0; i < count; ++i) first[i + 1] = first[i] + group[i].N / R;
  at::parallel_for(0, first[count], grain, [&](int64_t b0, int64_t b1) {
    for (int i = 0; i < count; ++i) {
      const int64_t lo = std::max(b0, first[i]), hi = std::min(b1, first[i + 1]);
      if (lo < hi) outputs(std::integral_constant<int, R>(), group[i], (lo - first[i]) * R, (hi - first[i]) * R);
    }
  });
  for (int i = 0; i < count; ++i)
    if (group[i].N % R != 0)
      outputs(std::integral_constant<int, 1>(), group[i], group[i].N - group[i].N % R, group[i].N);
}

}  // namespace attn::product_group

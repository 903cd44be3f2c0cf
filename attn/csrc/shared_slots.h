// Slots: where a decode row reads slot j's key or value, for the kernels that take
// attn::decode_attention's `group` and `shared` (decode_attention.cpp, avx2_layers.cpp). After
// fork_caches the first `shared` slots of a group's rows hold equal values, a copy of the group's
// first row in each; the kernels read them from that first row (`lead`), so that the rows of a
// group share one read of the prompt, and the rest from the row's own slots (`own`). Slot j is
// `step` values past the first. attn/native.py hashes this header into the build's flags.
#pragma once

#include <cstdint>

namespace attn {

template <typename T>
struct Slots {
  const T* own = nullptr;  // null: no rows (a prefetch that has none)
  const T* lead = nullptr;
  int64_t shared = 0, step = 0;

  const T* row(int64_t j) const { return (j < shared ? lead : own) + j * step; }

  // The row to prefetch for slot j, or null: none, or a shared row the task before read already.
  const T* prefetched(int64_t j, const Slots& before) const {
    if (own == nullptr || (j < shared && lead == before.lead)) return nullptr;
    return row(j);
  }
};

}  // namespace attn

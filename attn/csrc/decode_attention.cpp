// attn::decode_attention: masked attention of a few queries over a KV-cache (a decode step), for
// fp32, bf16 and fp16 tensors, with AVX-512 on torch's OpenMP threads.
//
// A decode step's attention reads each key and value slot once per query head and does a few
// FLOPs per byte: 2 x d products for the score, d for the value. Inductor's code for the same
// reductions (attn.fast_decode.decode_attention) ran at about 20 GFLOP/s in a 16-row step of the
// SmolLM2-135M shape (8.6 ms of a 35 ms step on 2 threads of a Xeon 6/167), and the stock CPU
// kernels are built for many queries. This one runs the queries of each (batch row, kv head) as
// a task: its group of query heads at each query position (split in parts only where a thread
// would have no task, or a task more than 16 queries):
// - slots past a query's last allowed one are not read for it;
// - scores 16 slots at a time: one fp32 vector of partial products a slot, the 16 vectors summed
//   lane-wise together (one shuffle tree, not 16 reductions), masked slots set to -inf by
//   selection, so a slot's NaN never reaches the softmax. bf16 on a CPU with AVX512-BF16 takes
//   vdpbf16ps on the raw rows (two exact products a lane, summed in fp32) and scales the sums;
//   otherwise the rows are widened to fp32 and multiplied by the query scaled once;
// - a vectorized softmax (exp by range reduction and a degree-7 polynomial, under 2 ulp);
// - the weighted sum of the value rows, each row widened once for up to 4 of the task's
//   queries, their sums in registers, divided once by each query's total.
// A key or value row is so read from memory once for the task's queries, not once a query
// head. bf16 rows are widened 32 values a load by interleaving with zeros (one instruction a
// vector, against two for a zero extension and a shift); the order this leaves them in is undone
// once a query. Heads of 64 and 128 dims get loops the compiler unrolls. Each task prefetches the
// next task's rows into L2: its keys while the scores run, its values while the value sums do
// (all in the scores' loop took 1.10-1.25 the time with caches from memory). A query whose mask
// is all False gets zeros, like the stock kernel. Sums are fp32 in another order than other
// kernels'.
// Measured, one layer of the 16-row SmolLM2-135M shape (9 heads on 3 kv heads, 64 dims, 160 of
// 192 slots), 2 threads of an AMD EPYC Zen 4 (AVX512-BF16), this kernel against the one before
// it (a (row, query head) a task, bf16 rows widened), both built in one process, run in turn,
// median of the paired ratios (25 rounds of 30 layers): bf16 0.68-0.71 with 30 layers' caches
// read from memory (three runs; 163-187 us a layer before, 114-128 after) and 0.61 with one
// layer's in cache; fp32 0.83 and 0.71; bf16 at batch 1 0.83 (0.79 at 2000 slots), 8 rows 0.67; a
// Llama-3.2-1B layer (32 heads on 8 kv heads, 128 dims, 4 rows) 0.68.
// An earlier variant that read each row once for up to 4 queries was no faster on a Xeon 6/167
// (206 against 196 us a layer in bf16); this one is measured on Zen 4 only.
// Rows that share slots (group, shared: a GRPO group after fork_caches, whose rows hold copies of
// their prompt's keys and values) read those slots from the group's first row, and a group's
// rows run one kv head after another, so each shared row comes from memory once for the group and
// from L2 for the rest; the values, and so every bit of the output, are those of the copies.
// 16 rows in 2 groups of 8, bf16, 512 shared slots of 576, 30 layers' caches in turn, 2 threads
// (Zen 4): 175 against 255 us a layer; the shared call then runs at the kernel's arithmetic,
// no longer at the read bandwidth.
// Built on first use by attn/native.py, which checks the CPU has AVX-512 (F, BW, VL).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"
#include "shared_slots.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#define ATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define ATTN_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace {

using attn::Slots;

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxHeadDim = 512;  // the output accumulators live on the stack
constexpr int64_t kMaxQueries = 16;  // a task's queries at most

// How a dtype's rows are read: a load takes kValues values and widens them to kVectors fp32
// vectors. bf16 takes 32 a load and widens them by interleaving with zeros (bf16 is fp32's top
// half), one instruction a vector; the fp32 vectors then hold dims 8L..8L+3 (first) and
// 8L+4..8L+7 (second) of each 128-bit lane L. q and k are widened alike, so a dot product
// does not see the order; the value sums are put back in order once a query (`unpermute`).
template <typename T>
struct Rows;

template <>
struct Rows<float> {
  static constexpr int64_t kValues = 16, kVectors = 1;
  ATTN_AVX512 static void widen(const float* p, int64_t count, __m512* out) {
    out[0] = count == kValues ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((1u << count) - 1, p);
  }
};

template <>
struct Rows<c10::Half> {
  static constexpr int64_t kValues = 16, kVectors = 1;
  ATTN_AVX512 static void widen(const c10::Half* p, int64_t count, __m512* out) {
    const __m256i raw = count == kValues ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                         : _mm256_maskz_loadu_epi16((1u << count) - 1, p);
    out[0] = _mm512_cvtph_ps(raw);
  }
};

template <>
struct Rows<c10::BFloat16> {
  static constexpr int64_t kValues = 32, kVectors = 2;
  ATTN_AVX512 static void widen(const c10::BFloat16* p, int64_t count, __m512* out) {
    const __m512i raw = count == kValues ? _mm512_loadu_si512(p)
                                         : _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << count) - 1), p);
    const __m512i zero = _mm512_setzero_si512();
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, raw));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, raw));
  }
};

// use(i, vector) for each of a row's `loads` x kVectors widened vectors (d values in all).
template <typename T, typename Use>
ATTN_AVX512 inline void widen_row(const T* row, int64_t loads, int64_t d, Use&& use) {
  using R = Rows<T>;
#pragma GCC unroll 8
  for (int64_t c = 0; c < loads; ++c) {
    __m512 widened[2];
    R::widen(row + c * R::kValues, std::min(R::kValues, d - c * R::kValues), widened);
#pragma GCC unroll 2
    for (int64_t i = 0; i < R::kVectors; ++i) use(c * R::kVectors + i, widened[i]);
  }
}

// The value sums of one load's vectors, back in the order of the dims (see Rows<BFloat16>).
template <typename T>
ATTN_AVX512 inline void unpermute(__m512* sums) {
  if constexpr (Rows<T>::kVectors == 2) {
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    const __m512 low = sums[0], high = sums[1];
    sums[0] = _mm512_permutex2var_ps(low, first, high);
    sums[1] = _mm512_permutex2var_ps(low, second, high);
  }
}

// Which of `count` slots from `allowed` (`step` bools apart) may be attended, as a bit mask.
ATTN_AVX512 inline __mmask16 allowed_slots(const bool* allowed, int64_t step, int64_t count) {
  const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
  if (step == 1) {
    const __m128i raw = _mm_maskz_loadu_epi8(valid, allowed);
    return _mm_cmpneq_epi8_mask(raw, _mm_setzero_si128());
  }
  if (step == 0) return allowed[0] ? valid : 0;
  __mmask16 slots = 0;
  for (int64_t i = 0; i < count; ++i) slots |= static_cast<__mmask16>(allowed[i * step]) << i;
  return slots;
}

// sums[c x vectors + i] = the sum over slots j < L of w[c x w_step + j] v_j (vector i of the
// widened row), for C queries: each value row is read and widened once for all of them. A zero
// weight (a masked slot, or one too small to count) leaves the sums as they are, so a masked
// slot's NaN never enters. Loads > 0: the sums stay in registers. next_v: the values the thread
// reads next, a row prefetched into L2 each slot (where it has one).
template <typename T, int Loads, int C>
ATTN_AVX512 inline void weigh_values(const Slots<T>& v, int64_t L, int64_t d, const float* w, int64_t w_step,
                                     __m512* sums, const Slots<T>& next_v) {
  using R = Rows<T>;
  const int64_t loads = Loads > 0 ? Loads : (d + R::kValues - 1) / R::kValues, vectors = loads * R::kVectors;
  constexpr int64_t kVectors = Loads > 0 ? Loads * R::kVectors : kMaxHeadDim / kLanes;
  __m512 acc[C * kVectors];
#pragma GCC unroll 32
  for (int64_t i = 0; i < C * kVectors; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    if (const T* next = next_v.prefetched(j, v))
      for (int64_t byte = 0; byte < d * static_cast<int64_t>(sizeof(T)); byte += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next) + byte, _MM_HINT_T1);
    float weight[C];
    bool all = true, any = false;
#pragma GCC unroll 4
    for (int64_t c = 0; c < C; ++c) {
      weight[c] = w[c * w_step + j];
      all &= weight[c] != 0.0f;
      any |= weight[c] != 0.0f;
    }
    if (all) {
      widen_row(v.row(j), loads, d, [&](int64_t i, __m512 value) ATTN_AVX512 {
#pragma GCC unroll 4
        for (int64_t c = 0; c < C; ++c)
          acc[c * kVectors + i] = _mm512_fmadd_ps(_mm512_set1_ps(weight[c]), value, acc[c * kVectors + i]);
      });
    } else if (any) {
      widen_row(v.row(j), loads, d, [&](int64_t i, __m512 value) ATTN_AVX512 {
#pragma GCC unroll 4
        for (int64_t c = 0; c < C; ++c)
          if (weight[c] != 0.0f)
            acc[c * kVectors + i] = _mm512_fmadd_ps(_mm512_set1_ps(weight[c]), value, acc[c * kVectors + i]);
      });
    }
  }
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < vectors; ++i) sums[c * vectors + i] = acc[c * kVectors + i];
}

// weigh_values for `chunk` queries, 1 to C: C a constant for each.
template <typename T, int Loads, int C>
ATTN_AVX512 inline void weigh_values_of(int64_t chunk, const Slots<T>& v, int64_t L, int64_t d, const float* w,
                                        int64_t w_step, __m512* sums, const Slots<T>& next_v) {
  if constexpr (C > 1) {
    if (chunk < C) return weigh_values_of<T, Loads, C - 1>(chunk, v, L, d, w, w_step, sums, next_v);
  }
  weigh_values<T, Loads, C>(v, L, d, w, w_step, sums, next_v);
}

// A task: the queries of one batch row that share a kv head (its group of query heads, each at
// every query position), or a part of them. Their key and value rows are read from memory once
// and reused from registers and L1 for each query.
template <typename T>
struct Task {
  const T* q[kMaxQueries];
  const bool* allowed[kMaxQueries];  // each query's mask row, `allowed_step` bools a slot
  T* out[kMaxQueries];
  int64_t queries;
  Slots<T> k, v;
  int64_t allowed_step, L, d;
  float scale;
  Slots<T> next_k;  // the keys and values the thread reads next, prefetched into L2 (keys while
  Slots<T> next_v;  // the scores run, values while the value sums do); own null where none
};

// A task's queries: out = softmax(scale q . k_j over allowed j) . v_j, each rounded once to T.
// `work` holds queries x (L + 16) scores, then queries x (d + 32) fp32 query values.
// Slots past a query's last allowed one are not read for it. Loads: the loads a row takes
// (d / kValues, rounded up) where the compiler should know it (unrolled loops, the query in
// registers), or 0 to count them at run time. Bf16Dots: bf16 scores by vdpbf16ps (AVX512-BF16)
// on the raw rows, two exact products a lane summed in fp32, then scaled; otherwise the rows
// are widened to fp32 and multiplied by the query scaled once. Every instantiation is built for
// AVX512-BF16; the widening ones run on CPUs without it (Ice Lake), and hold no bf16 instruction
// (tests/test_native.py reads the object code).
template <typename T, int Loads, bool Bf16Dots>
ATTN_AVX512_BF16 void attend(const Task<T>& task, float* work) {
  using R = Rows<T>;
  // Loads > 0: d is Loads x kValues, known to the compiler (64 and 128 dims).
  const int64_t n = task.queries, d = Loads > 0 ? Loads * R::kValues : task.d, allowed_step = task.allowed_step;
  const Slots<T>& k = task.k;
  const float scale = task.scale;
  const int64_t loads = Loads > 0 ? Loads : (d + R::kValues - 1) / R::kValues, vectors = loads * R::kVectors;
  const int64_t width = task.L + kLanes;  // a query's scores
  float* const scores = work;
  float* const query = work + n * width;  // the widened, scaled queries, vectors x 16 each
  int64_t span[kMaxQueries], L = 0;  // a query's span: its last allowed slot, plus one
  for (int64_t g = 0; g < n; ++g) {
    int64_t s = task.L;
    while (s > 0 && !task.allowed[g][(s - 1) * allowed_step]) --s;
    span[g] = s;
    L = std::max(L, s);
  }
  if constexpr (!Bf16Dots) {
    for (int64_t g = 0; g < n; ++g)
      widen_row(task.q[g], loads, d, [&](int64_t i, __m512 value) ATTN_AVX512 {
        _mm512_storeu_ps(query + (g * vectors + i) * kLanes, _mm512_mul_ps(value, _mm512_set1_ps(scale)));
      });
  }
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 peak[kMaxQueries];
  for (int64_t g = 0; g < n; ++g) peak[g] = minus_inf;
  // The scores of query g for `slots` slots from j0 (16 but for the last block: the branches
  // fold away): the 16 dot vectors summed lane-wise together.
  auto score = [&](int64_t g, int64_t j0, int64_t slots) __attribute__((always_inline)) ATTN_AVX512_BF16 {
    __m512 dots[kLanes];
    if constexpr (Bf16Dots) {
      const uint16_t* q = reinterpret_cast<const uint16_t*>(task.q[g]);
      __m512bh q_pairs[Loads > 0 ? Loads : kMaxHeadDim / 32];
#pragma GCC unroll 8
      for (int64_t c = 0; c < loads; ++c) {
        const int64_t count = std::min<int64_t>(32, d - c * 32);
        q_pairs[c] = (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << count) - 1), q + c * 32);
      }
#pragma GCC unroll 16
      for (int64_t j = 0; j < kLanes; ++j) {
        dots[j] = _mm512_setzero_ps();
        if (j >= slots) continue;
        const uint16_t* key = reinterpret_cast<const uint16_t*>(k.row(j0 + j));
#pragma GCC unroll 8
        for (int64_t c = 0; c < loads; ++c) {
          const int64_t count = std::min<int64_t>(32, d - c * 32);
          const __m512i k_pairs = count == 32 ? _mm512_loadu_si512(key + c * 32)
                                              : _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << count) - 1),
                                                                         key + c * 32);
          dots[j] = _mm512_dpbf16_ps(dots[j], q_pairs[c], (__m512bh)k_pairs);
        }
      }
    } else {
      const float* q = query + g * vectors * kLanes;
#pragma GCC unroll 16
      for (int64_t j = 0; j < kLanes; ++j) {
        dots[j] = _mm512_setzero_ps();
        if (j >= slots) continue;
        widen_row(k.row(j0 + j), loads, d, [&](int64_t i, __m512 key) ATTN_AVX512 {
          dots[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * kLanes), key, dots[j]);
        });
      }
    }
    __m512 block = attn::sum_each(dots);
    if constexpr (Bf16Dots) block = _mm512_mul_ps(block, _mm512_set1_ps(scale));
    // Masked slots become -inf by selection (a slot's NaN does not leak into the softmax).
    block = _mm512_mask_mov_ps(minus_inf, allowed_slots(task.allowed[g] + j0 * allowed_step, allowed_step, slots),
                               block);
    _mm512_storeu_ps(scores + g * width + j0, block);
    peak[g] = _mm512_max_ps(peak[g], block);
  };
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t j0 = 0; j0 < L; j0 += kLanes) {
    const int64_t slots = std::min(kLanes, L - j0);
    for (int64_t g = 0; g < n; ++g) {
      if (j0 >= span[g]) continue;
      if (slots == kLanes)
        score(g, j0, kLanes);
      else
        score(g, j0, slots);
    }
    for (int64_t j = j0; j < j0 + slots; ++j)
      if (const T* next = task.next_k.prefetched(j, k))
        for (int64_t byte = 0; byte < row_bytes; byte += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next) + byte, _MM_HINT_T1);
  }
  // Weights exp(score - peak): 0 past a query's span, up to the task's; their totals.
  float total[kMaxQueries];
  for (int64_t g = 0; g < n; ++g) {
    float* w_row = scores + g * width;
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(peak[g]));  // finite where the span is not empty
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < L; j0 += kLanes) {
      const int64_t valid = std::clamp<int64_t>(span[g] - j0, 0, kLanes);
      const __mmask16 in_span = static_cast<__mmask16>((1u << valid) - 1);
      const __m512 w = _mm512_maskz_mov_ps(
          in_span, attn::exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(in_span, w_row + j0), shift)));
      _mm512_mask_storeu_ps(w_row + j0, static_cast<__mmask16>((1u << std::min(kLanes, L - j0)) - 1), w);
      sum = _mm512_add_ps(sum, w);
    }
    total[g] = _mm512_reduce_add_ps(sum);  // >= 1 where the span is not empty: the peak's weight
  }
  // The weighted sums of the value rows, up to 4 queries a pass over them (as many as leave the
  // sums in registers).
  constexpr int64_t kMaxVectors = Loads > 0 ? Loads * R::kVectors : kMaxHeadDim / kLanes;
  constexpr int64_t kChunk = Loads > 0 ? std::clamp<int64_t>(24 / kMaxVectors, 1, 4) : 1;
  for (int64_t g0 = 0; g0 < n; g0 += kChunk) {
    const int64_t chunk = std::min(kChunk, n - g0);
    __m512 sums[kChunk * kMaxVectors];
    const Slots<T> next_v = g0 == 0 ? task.next_v : Slots<T>{};  // once a task
    weigh_values_of<T, Loads, kChunk>(chunk, task.v, L, d, scores + g0 * width, width, sums, next_v);
    for (int64_t c = 0; c < chunk; ++c) {
      const int64_t g = g0 + c;
      T* out = task.out[g];
      if (span[g] == 0) {  // nothing allowed: zeros, as the stock kernel gives
        for (int64_t i = 0; i < d; ++i) out[i] = T(0.0f);
        continue;
      }
      __m512* acc = sums + c * vectors;
      const __m512 total_g = _mm512_set1_ps(total[g]);
      alignas(64) float row[2 * kLanes];
      for (int64_t l = 0; l < loads; ++l) {
        unpermute<T>(acc + l * R::kVectors);
        for (int64_t i = 0; i < R::kVectors; ++i)
          _mm512_store_ps(row + i * kLanes, _mm512_div_ps(acc[l * R::kVectors + i], total_g));
        const int64_t count = std::min(R::kValues, d - l * R::kValues);
        for (int64_t i = 0; i < count; ++i) out[l * R::kValues + i] = T(row[i]);  // nearest even for bf16
      }
    }
  }
}

template <typename T, bool Bf16Dots>
auto pick(int64_t d) {
  constexpr int64_t per_load = Rows<T>::kValues;
  // Heads of 64 and 128 dims (Llama 3.x, Qwen, Mistral, SmolLM2) get loops the compiler unrolls.
  return d == 64    ? attend<T, 64 / per_load, Bf16Dots>
         : d == 128 ? attend<T, 128 / per_load, Bf16Dots>
                    : attend<T, 0, Bf16Dots>;
}

template <typename T>
void attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed, float scale,
               bool widen, int64_t group, int64_t shared, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), d = q.size(3);
  const int64_t H_kv = k.size(1), L = k.size(2), heads_per_kv = H / H_kv, per_kv = heads_per_kv * S;
  const T* q_data = q.data_ptr<T>();
  const T* k_data = k.data_ptr<T>();
  const T* v_data = v.data_ptr<T>();
  const bool* m_data = allowed.data_ptr<bool>();
  T* o_data = out.data_ptr<T>();
  bool bf16_dots = false;
  if constexpr (std::is_same_v<T, c10::BFloat16>) bf16_dots = !widen && __builtin_cpu_supports("avx512bf16");
  const auto run = bf16_dots ? pick<T, true>(d) : pick<T, false>(d);
  // Each (row, kv head)'s queries in `parts` tasks: one, unless that leaves a thread without a
  // task or a task with more than kMaxQueries queries. At batch 1 (3 tasks of the SmolLM2 shape
  // on 2 threads) one task a kv head took 0.81-0.93 the time of one a query head, for all the
  // threads' imbalance; 4 rows 0.98-0.99.
  const int64_t rows = B * H_kv;
  const int64_t fewest = (per_kv + kMaxQueries - 1) / kMaxQueries;
  const int64_t wanted = (at::get_num_threads() + rows - 1) / rows;
  const int64_t parts = std::min(per_kv, std::max(fewest, wanted)), per_part = (per_kv + parts - 1) / parts;
  // Task t's batch row and kv head: a group's rows run one kv head after another, so that the
  // rows of its shared slots, read once from memory, are in L2 for the group's next row.
  auto row_and_head = [&](int64_t t) {
    const int64_t pair = t / parts, in_group = pair % (H_kv * group);
    return std::pair<int64_t, int64_t>{pair / (H_kv * group) * group + in_group % group, in_group / group};
  };
  auto rows_of = [&](int64_t t, Slots<T>* keys, Slots<T>* values) {
    const auto [b, kv] = row_and_head(t);
    const int64_t lead = b - b % group;
    *keys = {k_data + b * k.stride(0) + kv * k.stride(1), k_data + lead * k.stride(0) + kv * k.stride(1), shared,
             k.stride(2)};
    *values = {v_data + b * v.stride(0) + kv * v.stride(1), v_data + lead * v.stride(0) + kv * v.stride(1), shared,
               v.stride(2)};
  };
  at::parallel_for(0, rows * parts, /*grain_size=*/1, [&](int64_t t0, int64_t t1) {
    std::vector<float> work(per_part * (L + kLanes) + per_part * (d + 2 * kLanes));  // see attend
    for (int64_t t = t0; t < t1; ++t) {
      const auto [b, kv] = row_and_head(t);
      const int64_t part = t % parts;
      Task<T> task;
      rows_of(t, &task.k, &task.v);
      task.allowed_step = allowed.stride(3);
      task.L = L, task.d = d, task.scale = scale;
      const int64_t first = part * per_part, last = std::min(per_kv, first + per_part);
      task.queries = std::max<int64_t>(0, last - first);
      for (int64_t g = 0; g < task.queries; ++g) {
        const int64_t h = kv * heads_per_kv + (first + g) / S, i = (first + g) % S;
        task.q[g] = q_data + b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
        task.allowed[g] = m_data + b * allowed.stride(0) + h * allowed.stride(1) + i * allowed.stride(2);
        task.out[g] = o_data + ((b * H + h) * S + i) * d;
      }
      // The next task's rows, where it reads other ones (another row or kv head).
      task.next_k = task.next_v = Slots<T>{};
      if (t + 1 < t1 && (t + 1) / parts != t / parts) rows_of(t + 1, &task.next_k, &task.next_v);
      if (task.queries > 0) run(task, work.data());
    }
  });
}

}  // namespace

namespace attn {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attn_mask,
                            double scale, bool widen, int64_t group, int64_t shared) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl"),
              "attn::decode_attention needs a CPU with AVX-512 (F, BW and VL)");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attn::decode_attention takes q (b, h, s, d) and k, v "
              "(b, h_kv, L, d), got sizes ", q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && attn_mask.device().is_cpu(),
              "attn::decode_attention runs on the CPU, got q on ", q.device(), ", k on ", k.device(), ", v on ",
              v.device(), " and the mask on ", attn_mask.device());
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "attn::decode_attention takes fp32, bf16 or fp16, got ", dtype);
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, "attn::decode_attention: q, k and v must share "
              "a dtype, got ", dtype, ", ", k.scalar_type(), " and ", v.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), d = q.size(3), H_kv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == d && H_kv > 0 && H % H_kv == 0,
              "attn::decode_attention: k and v must be (b, h_kv, L, d) with q's b and d and h a multiple of h_kv, got "
              "q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes());
  TORCH_CHECK(d > 0 && d % kLanes == 0 && d <= kMaxHeadDim, "attn::decode_attention takes a head dim that is a "
              "multiple of ", kLanes, " up to ", kMaxHeadDim, ", got ", d);
  TORCH_CHECK(L > 0, "attn::decode_attention: the cache has no slots (k ", k.sizes(), ")");
  check_shared_slots("attn::decode_attention", B, group, shared);
  TORCH_CHECK(attn_mask.scalar_type() == at::kBool, "attn::decode_attention takes a bool mask, got ",
              attn_mask.scalar_type());
  const int64_t shape[4] = {B, H, S, L};
  bool broadcasts = attn_mask.dim() <= 4;
  for (int64_t i = 0; broadcasts && i < attn_mask.dim(); ++i) {
    const int64_t got = attn_mask.size(i);
    broadcasts = got == 1 || got == shape[4 - attn_mask.dim() + i];
  }
  TORCH_CHECK(broadcasts, "attn::decode_attention: the mask must broadcast to (b, h, s, L) = (", B, ", ", H, ", ", S,
              ", ", L, "), got sizes ", attn_mask.sizes());
  // Rows of d contiguous values; the cache's own strides otherwise (a view of fewer slots).
  const at::Tensor qr = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor kr = k.stride(3) == 1 ? k : k.contiguous();
  const at::Tensor vr = v.stride(3) == 1 ? v : v.contiguous();
  const at::Tensor allowed = attn_mask.expand({B, H, S, L});  // a view: strides 0 where it broadcasts
  at::Tensor out = at::empty({B, H, S, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const float factor = static_cast<float>(scale);
  if (dtype == at::kFloat) {
    attention<float>(qr, kr, vr, allowed, factor, widen, group, shared, out);
  } else if (dtype == at::kBFloat16) {
    attention<c10::BFloat16>(qr, kr, vr, allowed, factor, widen, group, shared, out);
  } else {
    attention<c10::Half>(qr, kr, vr, allowed, factor, widen, group, shared, out);
  }
  return out;
}

}  // namespace attn

TORCH_LIBRARY_IMPL(attn, CPU, m) { m.impl("decode_attention", &attn::decode_attention); }

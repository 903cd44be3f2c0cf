// attn::decode_attention: masked attention of a few queries over a KV-cache (a decode step), for
// fp32, bf16 and fp16 tensors, with AVX-512 on torch's OpenMP threads.
//
// A decode step's attention reads each key and value slot once per query head and does a few
// FLOPs per byte: 2 x d products for the score, d for the value. Inductor's code for the same
// reductions (attn.fast_decode.decode_attention) ran at about 20 GFLOP/s in a 16-row step of the
// SmolLM2-135M shape (8.6 ms of a 35 ms step on 2 threads of a Xeon 6/167), and the stock CPU
// kernels are built for many queries. This one runs each (batch row, query head) as a task:
// - the query scaled once in fp32; slots past the last allowed one are not read;
// - scores 16 slots at a time: one fp32 vector of partial products a slot, the 16 vectors summed
//   lane-wise together (one shuffle tree, not 16 reductions), masked slots set to -inf by
//   selection, so a slot's NaN never reaches the softmax;
// - a vectorized softmax (exp by range reduction and a degree-7 polynomial, under 2 ulp);
// - the weighted sum of the value rows, divided once by the total.
// bf16 rows are widened 32 values a load by interleaving with zeros (one instruction a vector,
// against two for a zero extension and a shift); the order this leaves them in is undone once a
// query. Heads of 64 and 128 dims get loops the compiler unrolls. Query heads of one kv head are
// neighbouring tasks, so their rows come from the core's cache; the first of them prefetches the
// next kv head's rows into L2. A query whose mask is all False gets zeros, like the stock kernel.
// Sums are fp32 in another order than other kernels'. One layer of the 16-row shape (160 of 192
// slots allowed), 2 threads of a Xeon 6/167, against this kernel's first version (a reduction a
// slot, every slot read), both built in one process and run in turn: with 30 layers' caches read
// from memory, best / median of 8 rounds, bf16 108 / 132 us against 170 / 196 and fp32 220 / 269
// against 262 / 333; with one layer's in cache (best of 400) bf16 77 against 106, fp32 100-104
// against 107-108. A variant that ran each (row, kv head) as a task, loading each key and value
// row once for up to 4 of its group's queries, was no faster in the step (206 against 196 us a
// layer in bf16, 299 against 265-270 in fp32, with one reduction a slot), so it was not kept.
// Built on first use by attn/native.py, which checks the CPU has AVX-512 (F, BW, VL).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#define ATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxHeadDim = 512;  // the output accumulators live on the stack

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

// One query: out[0, d) = softmax(scale q . k_j over allowed j) . v_j. `scores` holds L + 16
// floats, `query` d + 32. Slots past the last allowed one are not read. Loads: the loads a row
// takes (d / kValues, rounded up) where the compiler should know it (unrolled loops, the query
// in registers), or 0 to count them at run time.
// next_k, next_v: the keys and values the thread reads next (another kv head), prefetched into
// L2 alongside the scores; null when there are none.
template <typename T, int Loads>
ATTN_AVX512 void attend(const T* q, const T* k, const T* v, int64_t k_step, int64_t v_step, const bool* allowed,
                        int64_t allowed_step, float scale, int64_t L, int64_t d, float* query, float* scores, T* out,
                        const T* next_k, const T* next_v) {
  using R = Rows<T>;
  while (L > 0 && !allowed[(L - 1) * allowed_step]) --L;
  if (L == 0) {  // nothing allowed: zeros, as the stock kernel gives
    for (int64_t i = 0; i < d; ++i) out[i] = T(0.0f);
    return;
  }
  const int64_t loads = Loads > 0 ? Loads : (d + R::kValues - 1) / R::kValues, vectors = loads * R::kVectors;
  widen_row(q, loads, d, [&](int64_t i, __m512 value) ATTN_AVX512 {  // scaled once in fp32: (q * scale) . k
    _mm512_storeu_ps(query + i * kLanes, _mm512_mul_ps(value, _mm512_set1_ps(scale)));
  });
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 peak = minus_inf;
  // The scores of `slots` slots from j0 (16 but for the last block: the branches fold away).
  auto score = [&](int64_t j0, int64_t slots) __attribute__((always_inline)) ATTN_AVX512 {
    __m512 dots[kLanes];
#pragma GCC unroll 16
    for (int64_t j = 0; j < kLanes; ++j) {
      dots[j] = _mm512_setzero_ps();
      if (j >= slots) continue;
      widen_row(k + (j0 + j) * k_step, loads, d, [&](int64_t i, __m512 key) ATTN_AVX512 {
        dots[j] = _mm512_fmadd_ps(_mm512_loadu_ps(query + i * kLanes), key, dots[j]);
      });
    }
    // Masked slots become -inf by selection (a slot's NaN does not leak into the softmax).
    const __m512 block = _mm512_mask_mov_ps(minus_inf, allowed_slots(allowed + j0 * allowed_step, allowed_step, slots),
                                            attn::sum_each(dots));
    _mm512_storeu_ps(scores + j0, block);
    peak = _mm512_max_ps(peak, block);
    if (next_k != nullptr) {
      const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
      for (int64_t j = j0; j < j0 + slots; ++j)
        for (int64_t byte = 0; byte < row_bytes; byte += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(next_k + j * k_step) + byte, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(next_v + j * v_step) + byte, _MM_HINT_T1);
        }
    }
  };
  const int64_t full = L - L % kLanes;
  for (int64_t j0 = 0; j0 < full; j0 += kLanes) score(j0, kLanes);
  if (full < L) score(full, L - full);
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(peak));  // finite: the last slot is allowed
  __m512 total = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < L; j0 += kLanes) {
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min(kLanes, L - j0)) - 1);
    const __m512 w = attn::exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, scores + j0), shift));
    _mm512_mask_storeu_ps(scores + j0, valid, w);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(valid, w));
  }
  __m512 acc[kMaxHeadDim / kLanes];
  for (int64_t i = 0; i < vectors; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    if (scores[j] == 0.0f) continue;  // masked, or too small to count
    const __m512 w = _mm512_set1_ps(scores[j]);
    widen_row(v + j * v_step, loads, d, [&](int64_t i, __m512 value) ATTN_AVX512 {
      acc[i] = _mm512_fmadd_ps(w, value, acc[i]);
    });
  }
  const __m512 sum = _mm512_set1_ps(_mm512_reduce_add_ps(total));  // >= 1: the peak's weight
  alignas(64) float row[2 * kLanes];
  for (int64_t c = 0; c < loads; ++c) {
    unpermute<T>(acc + c * R::kVectors);
    for (int64_t i = 0; i < R::kVectors; ++i)
      _mm512_store_ps(row + i * kLanes, _mm512_div_ps(acc[c * R::kVectors + i], sum));
    const int64_t count = std::min(R::kValues, d - c * R::kValues);
    for (int64_t i = 0; i < count; ++i) out[c * R::kValues + i] = T(row[i]);  // nearest even for bf16
  }
}

template <typename T>
void attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed, float scale,
               at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), d = q.size(3);
  const int64_t H_kv = k.size(1), L = k.size(2), group = H / H_kv;
  const T* q_data = q.data_ptr<T>();
  const T* k_data = k.data_ptr<T>();
  const T* v_data = v.data_ptr<T>();
  const bool* m_data = allowed.data_ptr<bool>();
  T* o_data = out.data_ptr<T>();
  // Heads of 64 and 128 dims (Llama 3.x, Qwen, Mistral, SmolLM2) get loops the compiler unrolls.
  constexpr int64_t per_load = Rows<T>::kValues;
  const auto run = d == 64 ? attend<T, 64 / per_load> : d == 128 ? attend<T, 128 / per_load> : attend<T, 0>;
  at::parallel_for(0, B * H, /*grain_size=*/1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buffer(d + 2 * kLanes + L + kLanes);  // the scaled query, then the scores
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H, kv = h / group;
      const T* keys = k_data + b * k.stride(0) + kv * k.stride(1);
      const T* values = v_data + b * v.stride(0) + kv * v.stride(1);
      // The first query head of a group prefetches the next group's keys and values.
      const bool ahead = h % group == 0 && t + group < t1;
      const int64_t nb = (t + group) / H, nkv = (t + group) % H / group;
      const T* next_keys = ahead ? k_data + nb * k.stride(0) + nkv * k.stride(1) : nullptr;
      const T* next_values = ahead ? v_data + nb * v.stride(0) + nkv * v.stride(1) : nullptr;
      for (int64_t i = 0; i < S; ++i) {
        run(q_data + b * q.stride(0) + h * q.stride(1) + i * q.stride(2), keys, values, k.stride(2), v.stride(2),
            m_data + b * allowed.stride(0) + h * allowed.stride(1) + i * allowed.stride(2), allowed.stride(3), scale,
            L, d, buffer.data(), buffer.data() + d + 2 * kLanes, o_data + ((b * H + h) * S + i) * d,
            i == 0 ? next_keys : nullptr, i == 0 ? next_values : nullptr);
      }
    }
  });
}

}  // namespace

namespace attn {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attn_mask,
                            double scale) {
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
    attention<float>(qr, kr, vr, allowed, factor, out);
  } else if (dtype == at::kBFloat16) {
    attention<c10::BFloat16>(qr, kr, vr, allowed, factor, out);
  } else {
    attention<c10::Half>(qr, kr, vr, allowed, factor, out);
  }
  return out;
}

}  // namespace attn

TORCH_LIBRARY_IMPL(attn, CPU, m) { m.impl("decode_attention", &attn::decode_attention); }

// attn::decode_attention: masked attention of a few queries over a KV-cache (a decode step), for
// fp32, bf16 and fp16 tensors, with AVX-512 on torch's OpenMP threads.
//
// A decode step's attention reads each key and value slot once per query head and does a few
// FLOPs per byte: 2 x d products for the score, d for the value. Inductor's code for the same
// reductions (attn.fast_decode.decode_attention) ran at about 20 GFLOP/s in a 16-row step of the
// SmolLM2-135M shape (8.6 ms of a 35 ms step on 2 threads of a Xeon 6/167), and the stock CPU
// kernels are built for many queries. This one runs each (batch row, query head) as a task: the
// query scaled in fp32, one fp32 dot product a slot, a vectorized softmax (exp by range reduction
// and a degree-7 polynomial, under 2 ulp), then the weighted sum of the value rows, divided once
// by the total. Query heads of one kv head are neighbouring tasks, so their key and value rows
// come from the cache of the core that read them first. A query whose mask is all False gets
// zeros, like the stock kernel. Sums are fp32 in another order than other kernels'. A variant
// that ran each (row, kv head) as a task, loading each key and value row once for up to 4 of
// its group's queries, was no faster in the step (206 against 196 us a layer in bf16, 299
// against 265-270 in fp32), so it was not kept.
// Built on first use by attn/native.py, which checks the CPU has AVX-512 (F, BW, VL).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#define ATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxHeadDim = 512;  // the output accumulators live on the stack

// 16 values from p, widened to fp32.
template <typename T>
ATTN_AVX512 inline __m512 load16(const T* p);

template <>
ATTN_AVX512 inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}

template <>
ATTN_AVX512 inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));  // bf16 is fp32's top half
}

template <>
ATTN_AVX512 inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp(x) for x <= 0 (softmax weights): n = round(x / ln 2), r = x - n ln 2 in two parts, e^r by
// its Taylor polynomial of degree 7 (|r| <= ln 2 / 2: error 5e-9 relative), times 2^n. Below
// -87.3 (a subnormal result, -inf included) the weight is 0.
ATTN_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));  // no -inf below: -inf - (-inf) is NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 = 0.693359375 - 2.12194440e-4
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

// One query: out[0, d) = softmax(scale q . k_j over allowed j) . v_j. `scores` holds L floats.
template <typename T>
ATTN_AVX512 void attend(const T* q, const T* k, const T* v, int64_t k_step, int64_t v_step, const bool* allowed,
                        int64_t allowed_step, float scale, int64_t L, int64_t d, float* query, float* scores, T* out) {
  const int64_t chunks = d / kLanes;
  for (int64_t c = 0; c < chunks; ++c)  // scaled once in fp32, as (q * scale) . k
    _mm512_storeu_ps(query + c * kLanes, _mm512_mul_ps(load16(q + c * kLanes), _mm512_set1_ps(scale)));
  const float minus_inf = -std::numeric_limits<float>::infinity();
  __m512 peak = _mm512_set1_ps(minus_inf);
  for (int64_t j = 0; j < L; ++j) {
    if (!allowed[j * allowed_step]) {
      scores[j] = minus_inf;
      continue;
    }
    const T* key = k + j * k_step;
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(query), load16(key));
    for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(query + c * kLanes), load16(key + c * kLanes), acc);
    scores[j] = _mm512_reduce_add_ps(acc);
  }
  const int64_t full = L - L % kLanes;
  const __mmask16 tail = static_cast<__mmask16>((1u << (L % kLanes)) - 1);
  for (int64_t j = 0; j < full; j += kLanes) peak = _mm512_max_ps(peak, _mm512_loadu_ps(scores + j));
  if (tail) peak = _mm512_mask_max_ps(peak, tail, peak, _mm512_maskz_loadu_ps(tail, scores + full));
  const float top = _mm512_reduce_max_ps(peak);
  if (top == minus_inf) {  // nothing allowed: zeros, as the stock kernel gives
    for (int64_t i = 0; i < d; ++i) out[i] = T(0.0f);
    return;
  }
  __m512 total = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(top);
  for (int64_t j = 0; j < full; j += kLanes) {
    const __m512 w = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + j), shift));
    _mm512_storeu_ps(scores + j, w);
    total = _mm512_add_ps(total, w);
  }
  if (tail) {
    const __m512 w = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + full), shift));
    _mm512_mask_storeu_ps(scores + full, tail, w);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, w));
  }
  __m512 acc[kMaxHeadDim / kLanes];
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    if (scores[j] == 0.0f) continue;  // masked, or too small to count
    const __m512 w = _mm512_set1_ps(scores[j]);
    const T* value = v + j * v_step;
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(w, load16(value + c * kLanes), acc[c]);
  }
  const __m512 sum = _mm512_set1_ps(_mm512_reduce_add_ps(total));  // >= 1: the peak's weight
  alignas(64) float row[kLanes];
  for (int64_t c = 0; c < chunks; ++c) {
    _mm512_store_ps(row, _mm512_div_ps(acc[c], sum));
    for (int64_t i = 0; i < kLanes; ++i) out[c * kLanes + i] = T(row[i]);  // nearest even for bf16
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
  at::parallel_for(0, B * H, /*grain_size=*/1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buffer(d + L);  // the scaled query, then the scores
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H, kv = h / group;
      const T* keys = k_data + b * k.stride(0) + kv * k.stride(1);
      const T* values = v_data + b * v.stride(0) + kv * v.stride(1);
      for (int64_t i = 0; i < S; ++i) {
        attend<T>(q_data + b * q.stride(0) + h * q.stride(1) + i * q.stride(2), keys, values, k.stride(2),
                  v.stride(2), m_data + b * allowed.stride(0) + h * allowed.stride(1) + i * allowed.stride(2),
                  allowed.stride(3), scale, L, d, buffer.data(), buffer.data() + d,
                  o_data + ((b * H + h) * S + i) * d);
      }
    }
  });
}

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

}  // namespace

TORCH_LIBRARY_IMPL(attn, CPU, m) { m.impl("decode_attention", &decode_attention); }

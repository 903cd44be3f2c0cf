// attn::decode_layers: a run of decoder layers' decode step (one token a row, with the KV-cache)
// in one call. Each layer: RMSNorm, the q, k and v products, each head's q and k RMSNorm where the
// model has them (Qwen3), RoPE, the cache write, attention, the output product and its residual,
// RMSNorm, the SwiGLU MLP and its residual.
//
// A compiled decode step at 16 rows spent 8-10 ms of 26-29 outside its products and attention
// (SmolLM2-135M shape, bf16, 2 threads of a Xeon 6/167): the generated wrapper's Python for each
// layer, dynamo's guards, a dozen small fused kernels, each a parallel region. Here the products
// (attn::amx_linear, attn::bf16_matvec, attn::fp32_linear) and the attention
// (attn::decode_attention) are called directly, and the work between them, a few thousand values
// a row, runs on the calling thread with AVX-512. One call a layer still cost about 14 us of
// dispatch, checks and Python around each (0.4 ms of a 12 ms step at batch 1, 30 layers, Zen 4),
// so the decoder hands every run of layers it computes to one call (attn/native_step.py).
//
// Rounding follows the eager layer step by step (layer_steps.h, the work between the products,
// says where). The products and the attention sum in fp32 in their own order, as in
// compile_for_decode's step, so an output can differ from eager's in the last bit.
//
// With final_norm, the model's last RMSNorm (before its output layer) follows the last layer, in
// place: as a module after the call it was 7 torch ops, 0.2 ms of a 10-12 ms step at batch 1
// (SmolLM2-135M shape, bf16, Zen 4), each op's objects cold after the weights streamed by.
//
// With avx2 (a CPU with AVX2 and no AVX512-BF16, as attn/native.py tells it) the products are
// attn::avx2_linear's and the work between them, attention included, is avx2_layers.cpp's: the
// same steps and roundings with 8 fp32 lanes (Steps below picks one set of the two).
//
// With group and shared (rows after fork_caches: CacheState.shared_slots) the attention reads each
// row's first `shared` slots from its group's first row (check_shared_slots, kernels.h); a call
// whose slot is one of those is refused, as each row would write its own token there.
//
// Every input of every layer is checked before any cache is written: a call that raises leaves
// the caches as they were. Built on first use by attn/native.py, which checks the CPU.

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"
#include "simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#define ATTN_LAYER __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxHeadDim = 512;  // a head's fp32 copy lives on the stack

// Sixteen fp32 lanes: what layer_steps.h asks of a vector.
struct Simd {
  using Vec = __m512;
  static constexpr int64_t kWidth = kLanes;
  ATTN_LAYER static Vec zero() { return _mm512_setzero_ps(); }
  ATTN_LAYER static Vec set1(float v) { return _mm512_set1_ps(v); }
  ATTN_LAYER static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  ATTN_LAYER static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  ATTN_LAYER static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  ATTN_LAYER static Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
  ATTN_LAYER static float sum(Vec v) { return _mm512_reduce_add_ps(v); }
  ATTN_LAYER static Vec load_f32(const float* p) { return _mm512_loadu_ps(p); }
  ATTN_LAYER static void store_f32(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  ATTN_LAYER static Vec exp_nonpositive(Vec x) { return attn::exp_nonpositive(x); }
  ATTN_LAYER static Vec neg_abs(Vec x) { return _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)); }
  ATTN_LAYER static Vec if_negative(Vec x, Vec a, Vec b) {
    return _mm512_mask_mov_ps(b, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), a);
  }
};

// Sixteen values of a row as fp32, and back in the row's dtype (bf16: nearest even).
template <typename T>
struct Lanes;

template <>
struct Lanes<float> : Simd {
  ATTN_LAYER static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  ATTN_LAYER static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
  ATTN_LAYER static __m512 round(__m512 v) { return v; }
};

template <>
struct Lanes<c10::BFloat16> : Simd {
  ATTN_LAYER static __m512 widen(__m256i raw) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  ATTN_LAYER static __m256i narrow(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
  ATTN_LAYER static __m512 load(const c10::BFloat16* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  ATTN_LAYER static void store(c10::BFloat16* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(v));
  }
  ATTN_LAYER static __m512 round(__m512 v) { return widen(narrow(v)); }
};

#define ATTN_STEPS ATTN_LAYER
#include "layer_steps.h"  // rms_norm, rotate, add, swiglu
#undef ATTN_STEPS

// Writes rows (M, h_kv, d) at `slot` of cache (M, h_kv, L, d).
template <typename T>
void write_slot(const T* rows, const at::Tensor& cache, int64_t slot) {
  const int64_t M = cache.size(0), heads = cache.size(1), d = cache.size(3);
  T* data = cache.data_ptr<T>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(data + m * cache.stride(0) + h * cache.stride(1) + slot * cache.stride(2),
                  rows + (m * heads + h) * d, d * sizeof(T));
}

// Which kernels a call takes (attn/native.py chooses): AMX products from `amx_from_rows` rows (0:
// none); `avx2`: attn::avx2_linear's products and the AVX2 work between them (avx2_layers.cpp),
// for a CPU without AVX512-BF16.
struct Kernels {
  int64_t amx_from_rows;
  bool avx2;
};

enum class Product { kFp32, kMatvec, kAmx, kAvx2 };

// The product a linear of `rows` rows and `features` input features takes (AMX where the
// features are a multiple of 32).
Product product_for(at::ScalarType dtype, int64_t rows, int64_t features, Kernels kernels) {
  if (kernels.avx2) return Product::kAvx2;
  if (dtype == at::kFloat) return Product::kFp32;
  const int64_t amx = kernels.amx_from_rows;
  return amx > 0 && rows >= amx && features % 32 == 0 ? Product::kAmx : Product::kMatvec;
}

// The products of x by each weight, with the kernel product_for chooses, in one call (one
// parallel region, each thread's blocks running from one weight into the next: product_group.h).
std::vector<at::Tensor> products(const at::Tensor& x, std::vector<at::Tensor> weights,
                                 std::vector<c10::optional<at::Tensor>> biases, Kernels kernels) {
  switch (product_for(x.scalar_type(), x.size(0), x.size(1), kernels)) {
    case Product::kFp32:
      return attn::fp32_linear_group(x, weights, biases);
    case Product::kAmx:
      return attn::amx_linear_group(x, weights, biases);
    case Product::kAvx2:
      return attn::avx2_linear_group(x, weights, biases);
    default:
      return attn::bf16_matvec_group(x, weights, biases);
  }
}

// x by one weight: a group of one, as the single products are.
at::Tensor product(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                   Kernels kernels) {
  return products(x, {weight}, {bias}, kernels)[0];
}

// The work between the products, in the instruction set of `kernels`: layer_steps.h built for
// AVX-512 here, or for AVX2 in avx2_layers.cpp.
template <typename T>
struct Steps {
  void (*rms_norm)(const T*, const T*, T*, int64_t, int64_t, float);
  void (*rotate)(T*, int64_t, int64_t, int64_t, const float*, const float*, int64_t);
  void (*add)(const T*, const T*, T*, int64_t);
  void (*swiglu)(T*, const T*, int64_t);
  at::Tensor (*attention)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                          int64_t);

  static Steps of(Kernels kernels) {
    if (kernels.avx2)
      return {attn::avx2::rms_norm<T>, attn::avx2::rotate<T>, attn::avx2::add<T>, attn::avx2::swiglu<T>,
              attn::avx2::attention};
    return {::rms_norm<T>, ::rotate<T>, ::add<T>, ::swiglu<T>,
            [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scale,
               int64_t group, int64_t shared) {
              return attn::decode_attention(q, k, v, mask, scale, /*widen=*/false, group, shared);
            }};
  }
};

const char* kWeightNames[] = {"attn_norm", "q_proj",  "k_proj", "v_proj", "o_proj", "mlp_norm",
                              "gate_proj", "up_proj", "down_proj", "q_norm", "k_norm"};
const char* kBiasNames[] = {"q_proj", "k_proj", "v_proj", "o_proj"};

// One layer's inputs: its weights (9, or 11 with q and k norms), its 4 biases, its caches.
struct Layer {
  at::TensorList w;
  c10::optional<at::Tensor> bias[4];
  at::Tensor k_cache, v_cache;
};

template <typename T>
at::Tensor run_layer(const at::Tensor& x, const Layer& layer, int64_t slot, const at::Tensor& allowed,
                     const at::Tensor& rotation, float eps, double scale, int64_t group, int64_t shared,
                     Kernels kernels) {
  const Steps<T> steps = Steps<T>::of(kernels);
  const at::TensorList w = layer.w;
  const at::Tensor &k_cache = layer.k_cache, &v_cache = layer.v_cache;
  const int64_t M = x.size(0), e = x.size(2), d = k_cache.size(3), kv_heads = k_cache.size(1);
  const int64_t heads = w[1].size(0) / d, hidden = w[6].size(0);
  const auto options = x.options();
  const at::Tensor h0 = x.contiguous();  // (M, 1, e)
  at::Tensor normed = at::empty({M, e}, options);
  steps.rms_norm(h0.data_ptr<T>(), w[0].data_ptr<T>(), normed.data_ptr<T>(), M, e, eps);
  const auto qkv = products(normed, {w[1], w[2], w[3]}, {layer.bias[0], layer.bias[1], layer.bias[2]}, kernels);
  const at::Tensor &q = qkv[0], &k = qkv[1], &v = qkv[2];  // (M, h * d), (M, h_kv * d), (M, h_kv * d)
  if (w.size() == 11) {  // each head's RMSNorm, before RoPE
    steps.rms_norm(q.data_ptr<T>(), w[9].data_ptr<T>(), q.data_ptr<T>(), M * heads, d, eps);
    steps.rms_norm(k.data_ptr<T>(), w[10].data_ptr<T>(), k.data_ptr<T>(), M * kv_heads, d, eps);
  }
  const float* cos = rotation.data_ptr<float>();
  const int64_t row_step = rotation.numel() == 2 * d ? 0 : d;
  const float* sin = cos + rotation.numel() / 2;
  steps.rotate(q.data_ptr<T>(), M, heads, d, cos, sin, row_step);
  steps.rotate(k.data_ptr<T>(), M, kv_heads, d, cos, sin, row_step);
  write_slot<T>(k.data_ptr<T>(), k_cache, slot);
  write_slot<T>(v.data_ptr<T>(), v_cache, slot);
  const int64_t span = allowed.size(-1);
  const at::Tensor attended = steps.attention(q.view({M, heads, 1, d}), k_cache.narrow(2, 0, span),
                                              v_cache.narrow(2, 0, span), allowed, scale, group,
                                              shared);  // (M, h, 1, d)
  const at::Tensor out_proj = product(attended.view({M, heads * d}), w[4], layer.bias[3], kernels);  // (M, e)
  at::Tensor h1 = at::empty({M, e}, options);
  steps.add(h0.data_ptr<T>(), out_proj.data_ptr<T>(), h1.data_ptr<T>(), M * e);
  steps.rms_norm(h1.data_ptr<T>(), w[5].data_ptr<T>(), normed.data_ptr<T>(), M, e, eps);
  const auto mlp = products(normed, {w[6], w[7]}, {c10::nullopt, c10::nullopt}, kernels);
  const at::Tensor &gate = mlp[0], &up = mlp[1];  // each (M, hidden)
  steps.swiglu(gate.data_ptr<T>(), up.data_ptr<T>(), M * hidden);
  const at::Tensor down = product(gate, w[8], c10::nullopt, kernels);  // (M, e)
  at::Tensor out = at::empty({M, 1, e}, options);
  steps.add(h1.data_ptr<T>(), down.data_ptr<T>(), out.data_ptr<T>(), M * e);
  return out;
}

// Checks layer `index`'s weights, biases and caches against x (M, 1, e) and the first layer's
// caches (every layer's are one shape), and returns them as a Layer.
Layer check_layer(size_t index, const at::Tensor& x, at::TensorList weights, const c10::optional<at::Tensor>* biases,
                  const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& first_cache,
                  Kernels kernels) {
  const auto dtype = x.scalar_type();
  const int64_t M = x.size(0), e = x.size(2);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == M,
              "attn::decode_layers: layer ", index, "'s caches must be (b, h_kv, L, d) with x's ", M, " rows, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(k_cache.sizes() == first_cache.sizes(), "attn::decode_layers: every layer's caches must be one shape, "
              "got ", first_cache.sizes(), " for the first and ", k_cache.sizes(), " for layer ", index);
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && k_cache.device().is_cpu() &&
                  v_cache.device().is_cpu(),
              "attn::decode_layers: layer ", index, "'s caches must be CPU tensors of x's dtype ", dtype, ", got ",
              k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "attn::decode_layers: layer ", index,
              "'s cache rows must be contiguous");
  const int64_t kv_heads = k_cache.size(1), d = k_cache.size(3);
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.scalar_type() == dtype && w.device().is_cpu() && w.is_contiguous(), "attn::decode_layers: layer ",
                index, "'s ", kWeightNames[i], " must be a contiguous CPU tensor of x's dtype ", dtype, ", got ",
                w.scalar_type(), " on ", w.device(), " with strides ", w.strides());
  }
  const int64_t qd = weights[1].size(0), kvd = kv_heads * d, hidden = weights[6].size(0);
  const bool shapes = weights[0].dim() == 1 && weights[0].size(0) == e && weights[5].dim() == 1 &&
                      weights[5].size(0) == e && qd % d == 0 && (qd / d) % kv_heads == 0 &&
                      weights[1].sizes() == at::IntArrayRef({qd, e}) && weights[2].sizes() == at::IntArrayRef({kvd, e}) &&
                      weights[3].sizes() == at::IntArrayRef({kvd, e}) && weights[4].sizes() == at::IntArrayRef({e, qd}) &&
                      hidden % kLanes == 0 && weights[6].sizes() == at::IntArrayRef({hidden, e}) &&
                      weights[7].sizes() == at::IntArrayRef({hidden, e}) &&
                      weights[8].sizes() == at::IntArrayRef({e, hidden}) &&
                      (weights.size() == 9 || (weights[9].sizes() == at::IntArrayRef({d}) &&
                                               weights[10].sizes() == at::IntArrayRef({d})));
  TORCH_CHECK(shapes, "attn::decode_layers: layer ", index, "'s weight shapes do not fit x (", M, ", 1, ", e,
              ") and heads of ", d, " (caches ", k_cache.sizes(), "): attn_norm ", weights[0].sizes(), ", q ",
              weights[1].sizes(), ", k ", weights[2].sizes(), ", v ", weights[3].sizes(), ", o ", weights[4].sizes(),
              ", mlp_norm ", weights[5].sizes(), ", gate ", weights[6].sizes(), ", up ", weights[7].sizes(), ", down ",
              weights[8].sizes(), weights.size() == 11 ? ", q_norm and k_norm " : "",
              weights.size() == 11 ? weights[9].sizes() : at::IntArrayRef(), weights.size() == 11 ? " and " : "",
              weights.size() == 11 ? weights[10].sizes() : at::IntArrayRef(), " (the hidden width a multiple of 16)");
  Layer layer{weights, {}, k_cache, v_cache};
  for (size_t i = 0; i < 4; ++i) {
    const c10::optional<at::Tensor>& bias = biases[i];
    const int64_t n = i == 0 ? qd : i == 3 ? e : kvd;
    TORCH_CHECK(!bias.has_value() ||
                    (bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == n && bias->device().is_cpu()),
                "attn::decode_layers: layer ", index, "'s ", kBiasNames[i], " bias must be None or a (", n,
                ",) CPU tensor of x's dtype");
    layer.bias[i] = bias;
  }
  const int64_t features[] = {e, qd, hidden};
  for (const int64_t k : features) {
    const Product kind = product_for(dtype, M, k, kernels);
    const int64_t most = kind == Product::kFp32   ? attn::kFp32LinearMaxRows
                         : kind == Product::kAmx  ? attn::kAmxLinearMaxRows
                         : kind == Product::kAvx2 ? attn::kAvx2LinearMaxRows
                                                  : attn::kBf16MatvecMaxRows;
    TORCH_CHECK(M <= most, "attn::decode_layers: ", M, " rows are more than its ", dtype, " products of ", k,
                " features take (", most, "); F.linear is the product for more");
  }
  return layer;
}

}  // namespace

namespace attn {

at::Tensor layer_product(const at::Tensor& x, const at::Tensor& weight, int64_t amx_from_rows, bool avx2) {
  return product(x, weight, c10::nullopt, Kernels{amx_from_rows, avx2});
}

at::Tensor decode_layers(const at::Tensor& x, at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots,
                         const at::Tensor& mask, const at::Tensor& rotation, double eps, double scale,
                         int64_t amx_from_rows, const c10::optional<at::Tensor>& final_norm, double final_eps,
                         bool avx2, int64_t group, int64_t shared) {
  TORCH_CHECK(avx2 || __builtin_cpu_supports("avx512bf16"), "attn::decode_layers needs a CPU with AVX512-BF16 "
              "(avx2=True runs its AVX2 build)");
  TORCH_CHECK(!avx2 || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")),
              "attn::decode_layers with avx2=True needs a CPU with AVX2 and FMA");
  const Kernels kernels{amx_from_rows, avx2};
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "attn::decode_layers takes fp32 or bf16, got x ", dtype);
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.size(0) > 0 && x.device().is_cpu(),
              "attn::decode_layers: x must be (b, 1, e) on the CPU, one token a row, got ", x.sizes(), " on ",
              x.device());
  const size_t count = k_caches.size();
  TORCH_CHECK(count > 0 && v_caches.size() == count, "attn::decode_layers takes one key and one value cache a layer, "
              "got ", k_caches.size(), " and ", v_caches.size());
  const size_t per_layer = weights.size() / count;
  TORCH_CHECK((per_layer == 9 || per_layer == 11) && weights.size() == per_layer * count, "attn::decode_layers "
              "takes 9 weights a layer (attn_norm, q, k, v, o, mlp_norm, gate, up, down) or 11 (and q_norm, k_norm), "
              "got ", weights.size(), " for ", count, " layer(s)");
  TORCH_CHECK(biases.size() == 4 * count, "attn::decode_layers takes 4 biases a layer (q, k, v, o; None for none), "
              "got ", biases.size(), " for ", count, " layer(s)");
  const int64_t M = x.size(0), e = x.size(2);
  TORCH_CHECK(e % kLanes == 0, "attn::decode_layers takes a model width that is a multiple of 16, got ", e);
  TORCH_CHECK(k_caches[0].dim() == 4, "attn::decode_layers: the caches must be (b, h_kv, L, d), got ",
              k_caches[0].sizes());
  const int64_t L = k_caches[0].size(2), d = k_caches[0].size(3);
  TORCH_CHECK(d > 0 && d % kLanes == 0 && d <= kMaxHeadDim, "attn::decode_layers takes a head dim that is a "
              "multiple of 16 up to ", kMaxHeadDim, ", got ", d);
  std::vector<c10::optional<at::Tensor>> bias_values(biases.begin(), biases.end());
  std::vector<Layer> layers;
  layers.reserve(count);
  for (size_t i = 0; i < count; ++i)
    layers.push_back(check_layer(i, x, weights.slice(i * per_layer, per_layer), bias_values.data() + 4 * i,
                                 k_caches[i], v_caches[i], k_caches[0], kernels));
  TORCH_CHECK(slots.numel() == 1 && slots.scalar_type() == at::kLong && slots.device().is_cpu(),
              "attn::decode_layers: slots must be the one cache slot this token writes, a CPU long tensor, got ",
              slots.sizes(), " ", slots.scalar_type());
  const int64_t slot = slots.data_ptr<int64_t>()[0];
  TORCH_CHECK(0 <= slot && slot < L, "attn::decode_layers: slot ", slot, " is outside the cache's ", L, " slots");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.device().is_cpu() &&
                  ((mask.dim() == 2 && mask.size(0) == 1) ||
                   (mask.dim() == 3 && (mask.size(0) == 1 || mask.size(0) == M) && mask.size(1) == 1)),
              "attn::decode_layers: the mask must be bool, (1, n) or (b, 1, n), got ", mask.scalar_type(), " ",
              mask.sizes());
  const int64_t span = mask.size(-1);
  TORCH_CHECK(slot < span && span <= L, "attn::decode_layers: the mask covers ", span, " slots; it must cover slot ",
              slot, " and at most the cache's ", L);
  check_shared_slots("attn::decode_layers", M, group, shared);
  TORCH_CHECK(slot >= shared, "attn::decode_layers writes slot ", slot, ", one of the ", shared, " slots its rows "
              "share (group ", group, "): each row writes its own token there, so they would no longer be equal");
  TORCH_CHECK(rotation.scalar_type() == at::kFloat && rotation.is_contiguous() && rotation.device().is_cpu() &&
                  (rotation.numel() == 2 * d || rotation.numel() == 2 * M * d),
              "attn::decode_layers: rotation must be contiguous fp32 cos and signed sin rows, (2, 1, ", d, ") or (2, ",
              M, ", 1, 1, ", d, "), got ", rotation.scalar_type(), " ", rotation.sizes());
  TORCH_CHECK(!final_norm.has_value() ||
                  (final_norm->scalar_type() == dtype && final_norm->dim() == 1 && final_norm->size(0) == e &&
                   final_norm->is_contiguous() && final_norm->device().is_cpu()),
              "attn::decode_layers: final_norm must be None or a contiguous (", e, ",) CPU tensor of x's dtype ",
              dtype, ", got ", final_norm.has_value() ? final_norm->sizes() : at::IntArrayRef(), " ",
              final_norm.has_value() ? final_norm->scalar_type() : dtype);
  const at::Tensor allowed = mask.dim() == 2 ? mask.unsqueeze(0).unsqueeze(0) : mask.unsqueeze(1);  // (1 or M, 1, 1, n)
  const float epsilon = static_cast<float>(eps);
  at::Tensor h = x;
  for (const Layer& layer : layers) {
    h = dtype == at::kFloat
            ? run_layer<float>(h, layer, slot, allowed, rotation, epsilon, scale, group, shared, kernels)
            : run_layer<c10::BFloat16>(h, layer, slot, allowed, rotation, epsilon, scale, group, shared, kernels);
  }
  if (final_norm.has_value()) {  // in place: h is the last layer's own output
    const float final_epsilon = static_cast<float>(final_eps);
    if (dtype == at::kFloat)
      Steps<float>::of(kernels).rms_norm(h.data_ptr<float>(), final_norm->data_ptr<float>(), h.data_ptr<float>(), M, e,
                                         final_epsilon);
    else
      Steps<c10::BFloat16>::of(kernels).rms_norm(h.data_ptr<c10::BFloat16>(), final_norm->data_ptr<c10::BFloat16>(),
                                                 h.data_ptr<c10::BFloat16>(), M, e, final_epsilon);
  }
  return h;
}

}  // namespace attn

TORCH_LIBRARY_IMPL(attn, CPU, m) { m.impl("decode_layers", &attn::decode_layers); }

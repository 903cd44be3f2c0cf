// The work of attn::decode_layers between its products, written once for any vector width:
// RMSNorm, RoPE, residual sums and SwiGLU. decode_layers.cpp includes it for AVX-512 (16 fp32
// lanes) and avx2_layers.cpp for AVX2 (8), each inside its unnamed namespace after defining
//   ATTN_STEPS   the target attribute of its instruction set, which every function here takes;
//   kMaxHeadDim  the most dims a head has (a head's fp32 copy lives on the stack);
//   Lanes<T>     for T float and c10::BFloat16, a vector of fp32 lanes and its operations:
//                Vec, kWidth, zero(), set1(f), add, mul, fmadd(a, b, c) = a b + c, div, sum(v),
//                load_f32 / store_f32 (fp32 memory), exp_nonpositive(x) (x <= 0), neg_abs(x) = -|x|,
//                if_negative(x, a, b) = x < 0 ? a : b lane by lane; and a row's values as fp32 and
//                back: load(const T*), store(T*, v) (bf16: nearest even), round(v) = load of store.
// Each includer so gets its own copy, built for its instructions: no include guard.
//
// Rounding follows the eager layer (attn/decoder.py, attn/norm.py, attn/rope.py) step by step: a
// norm's fp32 result is rounded to the dtype before it is scaled by the weight, RoPE rotates in
// fp32 and rounds once, SiLU's output is rounded before it multiplies the up product, each
// residual sum is rounded once. Sums are fp32, kWidth lanes and then across them.

// out (M, e) = weight * round(x * rsqrt(mean(x^2) + eps)), as attn.norm.RMSNorm computes it; out
// may be x (each row is read whole before it is written). e a multiple of kWidth.
template <typename T>
ATTN_STEPS void rms_norm(const T* x, const T* weight, T* out, int64_t M, int64_t e, float eps) {
  using V = Lanes<T>;
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * e;
    typename V::Vec squares = V::zero();
    for (int64_t i = 0; i < e; i += V::kWidth) {
      const auto v = V::load(row + i);
      squares = V::fmadd(v, v, squares);
    }
    const float mean = V::sum(squares) / static_cast<float>(e);
    const auto factor = V::set1(1.0f / std::sqrt(mean + eps));
    for (int64_t i = 0; i < e; i += V::kWidth) {
      const auto normed = V::round(V::mul(V::load(row + i), factor));
      V::store(out + m * e + i, V::mul(V::load(weight + i), normed));
    }
  }
}

// Rotates x (M, heads, d) in place, as attn.rope.rotate_by: x * cos + roll(x, d / 2) * signed_sin
// in fp32, rounded once. Row m's cos and signed sin start at cos + m * row_step (0: one for all).
// d a multiple of kWidth.
template <typename T>
ATTN_STEPS void rotate(T* x, int64_t M, int64_t heads, int64_t d, const float* cos, const float* sin,
                       int64_t row_step) {
  using V = Lanes<T>;
  const int64_t half = d / 2;
  float wide[kMaxHeadDim];
  for (int64_t m = 0; m < M; ++m) {
    const float *c = cos + m * row_step, *s = sin + m * row_step;
    for (int64_t h = 0; h < heads; ++h) {
      T* head = x + (m * heads + h) * d;
      for (int64_t i = 0; i < d; i += V::kWidth) V::store_f32(wide + i, V::load(head + i));
      if (half % V::kWidth == 0) {
        for (int64_t i = 0; i < d; i += V::kWidth) {
          const auto rolled = V::load_f32(wide + (i + half) % d);
          const auto straight = V::mul(V::load_f32(wide + i), V::load_f32(c + i));
          V::store(head + i, V::add(straight, V::mul(rolled, V::load_f32(s + i))));
        }
      } else {  // half a head is not a whole number of vectors (d = 48, 80, ... with 16 lanes)
        for (int64_t i = 0; i < d; ++i) head[i] = T(wide[i] * c[i] + wide[(i + half) % d] * s[i]);
      }
    }
  }
}

// out = round(a + b), `count` values (a multiple of kWidth).
template <typename T>
ATTN_STEPS void add(const T* a, const T* b, T* out, int64_t count) {
  using V = Lanes<T>;
  for (int64_t i = 0; i < count; i += V::kWidth) V::store(out + i, V::add(V::load(a + i), V::load(b + i)));
}

// gate = round(round(silu(gate)) * up), in place, `count` values (a multiple of kWidth). SiLU as
// x * sigmoid(x), the sigmoid from exp(-|x|) (never an overflow).
template <typename T>
ATTN_STEPS void swiglu(T* gate, const T* up, int64_t count) {
  using V = Lanes<T>;
  const auto one = V::set1(1.0f);
  for (int64_t i = 0; i < count; i += V::kWidth) {
    const auto g = V::load(gate + i);
    const auto small = V::exp_nonpositive(V::neg_abs(g));
    const auto sigmoid = V::div(V::if_negative(g, small, one), V::add(one, small));
    V::store(gate + i, V::mul(V::round(V::mul(g, sigmoid)), V::load(up + i)));
  }
}

// Shuffles and an exp that attn's native kernels share (AVX-512 F). attn/native.py hashes this header into
// the build's flags, so that a change here rebuilds every source that includes it.
#pragma once

#include <immintrin.h>

#define ATTN_SIMD __attribute__((target("avx512f"), always_inline))

namespace attn {

// The 16 sums of 16 vectors' lanes, in their order: pairs, then quads, then the four 128-bit
// lanes folded (45 instructions where 16 reductions take about 140).
ATTN_SIMD inline __m512 sum_each(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // lane L: (2i, 2i+1, 2i, 2i+1) partial sums
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // lane L: (4i, 4i+1, 4i+2, 4i+3) partial sums
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xdd));
}

// The 16 x 16 transpose of 32-bit values: rows[i] lane j becomes rows[j] lane i. Pairs of rows
// interleave by 32 bits, then by 64 (lane L of quads[4i + c] is column 4L + c of rows 4i to
// 4i + 3), then 128-bit lanes trade places twice.
ATTN_SIMD inline void transpose16(__m512i (&rows)[16]) {
  __m512i pairs[16], quads[16];
  for (int i = 0; i < 8; ++i) {
    pairs[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
    pairs[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    quads[4 * i] = _mm512_unpacklo_epi64(pairs[4 * i], pairs[4 * i + 2]);
    quads[4 * i + 1] = _mm512_unpackhi_epi64(pairs[4 * i], pairs[4 * i + 2]);
    quads[4 * i + 2] = _mm512_unpacklo_epi64(pairs[4 * i + 1], pairs[4 * i + 3]);
    quads[4 * i + 3] = _mm512_unpackhi_epi64(pairs[4 * i + 1], pairs[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i even0 = _mm512_shuffle_i32x4(quads[c], quads[4 + c], 0x88);  // lanes 0, 2
    const __m512i even1 = _mm512_shuffle_i32x4(quads[8 + c], quads[12 + c], 0x88);
    const __m512i odd0 = _mm512_shuffle_i32x4(quads[c], quads[4 + c], 0xdd);  // lanes 1, 3
    const __m512i odd1 = _mm512_shuffle_i32x4(quads[8 + c], quads[12 + c], 0xdd);
    rows[c] = _mm512_shuffle_i32x4(even0, even1, 0x88);
    rows[8 + c] = _mm512_shuffle_i32x4(even0, even1, 0xdd);
    rows[4 + c] = _mm512_shuffle_i32x4(odd0, odd1, 0x88);
    rows[12 + c] = _mm512_shuffle_i32x4(odd0, odd1, 0xdd);
  }
}

// exp(x) for x <= 0 (softmax weights): n = round(x / ln 2), r = x - n ln 2 in two parts, e^r by
// its Taylor polynomial of degree 7 (|r| <= ln 2 / 2: error 5e-9 relative), times 2^n. Below
// -87.3 (a subnormal result, -inf included) the weight is 0.
ATTN_SIMD inline __m512 exp_nonpositive(__m512 x) {
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

}  // namespace attn

#undef ATTN_SIMD

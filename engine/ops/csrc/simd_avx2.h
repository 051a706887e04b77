// The AVX2 set's 8-lane primitives, shared by its elementwise kernels and the attention
// algorithm (attention_item.h, written once over the Vec256 struct below): loads and stores
// of float32, bfloat16 and float16 as float32 lanes, exp and reductions. Included in the
// AVX2 set only (compiled with AVX2, FMA and F16C).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"

namespace pagedserve::PAGEDSERVE_ISA::avx2 {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// float32 -> bfloat16 bits, nearest even, in each lane's low half; NaN -> 0x7fc0 (c10's).
inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i r = bf16_bits8(v);  // values <= 0xffff: the unsigned pack keeps them
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp(x), simd_avx512.h's exp_ps in 8 lanes: the same polynomial, inputs below -87
// give ~1e-38, and above 89 (where float32 overflows) inf. AVX2 has no scalef: y * 2^n is
// two power-of-two factors, exact, so n = 128 still scales a y below 1 to a finite value.
PAGEDSERVE_INLINE __m256 exp8(__m256 x) {
  const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(89.0f), _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(89.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);  // -126..128
  const __m256i half = _mm256_srai_epi32(ni, 1), rest = _mm256_sub_epi32(ni, half);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  y = _mm256_mul_ps(_mm256_mul_ps(y, f1), f2);
  return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}

// Lanes below cnt (any int; clamped to 0..8) all ones, the others zero.
inline __m256 first_lanes(int cnt) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(std::clamp(cnt, 0, 8)), lane));
}

// The primitives the attention algorithm is written over (attention_item.h says what each
// must do). 16 vector registers: register blocks of up to 12 accumulators.
struct Vec256 {
  using F = __m256;
  static constexpr int W = 8;
  static constexpr int kAccRegs = 12;
  static constexpr bool kBf16Dot = false;
  static constexpr bool kKeysOuter = false;

  PAGEDSERVE_INLINE static F zero() { return _mm256_setzero_ps(); }
  PAGEDSERVE_INLINE static F set1(float x) { return _mm256_set1_ps(x); }
  template <typename S>
  PAGEDSERVE_INLINE static F load(const S* p) { return load8(p); }
  template <typename S>
  PAGEDSERVE_INLINE static void store(S* p, F v) { store8(p, v); }
  PAGEDSERVE_INLINE static F add(F a, F b) { return _mm256_add_ps(a, b); }
  PAGEDSERVE_INLINE static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  PAGEDSERVE_INLINE static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  PAGEDSERVE_INLINE static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  PAGEDSERVE_INLINE static F exp(F x) { return exp8(x); }
  PAGEDSERVE_INLINE static F keep_first(F x, int cnt) { return _mm256_and_ps(first_lanes(cnt), x); }
  PAGEDSERVE_INLINE static F low_first(F x, int cnt) {
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, first_lanes(cnt));
  }
  PAGEDSERVE_INLINE static F max(F a, F b) { return _mm256_max_ps(a, b); }
  PAGEDSERVE_INLINE static float reduce_max(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  PAGEDSERVE_INLINE static float reduce_add(F v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }

  // Lane j of the result is the horizontal sum of v[j].
  PAGEDSERVE_INLINE static F transpose_sum(const F (&v)[W]) {
    // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
    const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
    // [v0 v1 v2 v3 lanes 0-3 | the same, lanes 4-7], then v4..v7 likewise
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                         _mm256_permute2f128_ps(h0123, h4567, 0x31));
  }
};

}  // namespace pagedserve::PAGEDSERVE_ISA::avx2

// The AVX2 set's 8-lane helpers, shared by its elementwise and attention kernels: loads
// and stores of float32, bfloat16 and float16 as float32 lanes, and exp. Included by those
// kernels in the AVX2 set only (compiled with AVX2, FMA and F16C).
#pragma once

#include <immintrin.h>

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

// exp(x), attention_avx512.h's exp_ps in 8 lanes: the same polynomial, inputs below -87
// give ~1e-38, and above 89 (where float32 overflows) inf. AVX2 has no scalef: y * 2^n is
// two power-of-two factors, exact, so n = 128 still scales a y below 1 to a finite value.
inline __m256 exp8(__m256 x) {
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

}  // namespace pagedserve::PAGEDSERVE_ISA::avx2

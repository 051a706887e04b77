// The AVX-512 sets' 16-lane primitives: loads and stores of float32, bfloat16 and float16
// as float32 lanes, exp, reductions, and with AVX512_BF16 the bf16 dot product. Included
// only where the set is compiled with AVX-512 F/BW (kernels.h). The attention algorithm
// (attention_item.h) is written once over the Vec512 struct below; the elementwise kernels
// use the free functions.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels.h"

namespace pagedserve::PAGEDSERVE_ISA::avx512 {

inline __m512 load_f32(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_f32(const c10::BFloat16* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
inline __m512 load_f32(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store_f32(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_f32(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as c10::BFloat16 does; NaN stays NaN.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void store_f32(c10::Half* p, __m512 v) {
  const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}

// exp(x) (Cephes polynomial, ~1 ulp): overflows to inf above ~88.7, and inputs below -87
// give ~1e-38 rather than denormals or 0, so exp(-inf - m) is never NaN.
PAGEDSERVE_INLINE __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// Lanes below cnt (any int; clamped to 0..16).
inline __mmask16 first_lanes(int cnt) {
  const int c = std::clamp(cnt, 0, 16);
  return static_cast<__mmask16>((1u << c) - 1);
}

// The primitives the attention algorithm is written over (attention_item.h says what each
// must do). 32 vector registers: register blocks of up to 16 accumulators.
struct Vec512 {
  using F = __m512;
  static constexpr int W = 16;
  static constexpr int kAccRegs = 16;
  static constexpr bool kBf16Dot = false;
  static constexpr bool kKeysOuter = true;

  PAGEDSERVE_INLINE static F zero() { return _mm512_setzero_ps(); }
  PAGEDSERVE_INLINE static F set1(float x) { return _mm512_set1_ps(x); }
  template <typename S>
  PAGEDSERVE_INLINE static F load(const S* p) { return load_f32(p); }
  template <typename S>
  PAGEDSERVE_INLINE static void store(S* p, F v) { store_f32(p, v); }
  PAGEDSERVE_INLINE static F add(F a, F b) { return _mm512_add_ps(a, b); }
  PAGEDSERVE_INLINE static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  PAGEDSERVE_INLINE static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  PAGEDSERVE_INLINE static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  PAGEDSERVE_INLINE static F exp(F x) { return exp_ps(x); }
  PAGEDSERVE_INLINE static F keep_first(F x, int cnt) {
    return _mm512_maskz_mov_ps(first_lanes(cnt), x);
  }
  PAGEDSERVE_INLINE static F low_first(F x, int cnt) {
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), first_lanes(cnt), x);
  }
  PAGEDSERVE_INLINE static F max(F a, F b) { return _mm512_max_ps(a, b); }
  PAGEDSERVE_INLINE static float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  PAGEDSERVE_INLINE static float reduce_add(F v) { return _mm512_reduce_add_ps(v); }

  // Lane j of the result is the horizontal sum of v[j].
  PAGEDSERVE_INLINE static F transpose_sum(const F (&v)[W]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i) {  // each 128-bit quarter: [a0+a2, b0+b2, a1+a3, b1+b3]
      a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                           _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    }
    for (int i = 0; i < 4; ++i) {  // each quarter: [a, b, c, d] partial sums
      const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
      b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i) {  // quarters 0+1 and 2+3 of both inputs
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                         _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  }
};

#ifdef __AVX512BF16__
// Vec512 plus vdpbf16ps: a bf16 dot product whose products are exact in float32.
struct Vec512Bf16 : Vec512 {
  static constexpr bool kBf16Dot = true;

  // Lane j: q . k[j] (a ChunkRows) over `vecs` * 16 bf16 elements (vecs may be odd: the
  // last block of 32 is then half, zero-extended), as float32 partial sums then
  // transpose_sum.
  template <int DV, class Rows>
  PAGEDSERVE_INLINE static F dot_bf16(const c10::BFloat16* q, const Rows& k, int64_t vecs) {
    constexpr int kMaxBlocks = 8;  // head_dim up to 256 holds q in registers
    F acc[W];
    if constexpr (DV > 0 && (DV + 1) / 2 <= kMaxBlocks) {
      constexpr int NB = (DV + 1) / 2;
      __m512i qb[NB];
#pragma GCC unroll 16
      for (int b = 0; b < NB; ++b) qb[b] = block(q + 32 * b, 2 * b + 1 == DV);
#pragma GCC unroll 16
      for (int j = 0; j < W; ++j) {
        const c10::BFloat16* row = k[j];
        __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int b = 0; b < NB; ++b) {
          const __m512i kb = block(row + 32 * b, 2 * b + 1 == DV);
          sum = _mm512_dpbf16_ps(sum, (__m512bh)qb[b], (__m512bh)kb);
        }
        acc[j] = sum;
      }
    } else {
      const int64_t nv = DV > 0 ? DV : vecs, blocks = (nv + 1) / 2;
#pragma GCC unroll 16
      for (int j = 0; j < W; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const bool half = 2 * b + 1 == nv;
        const __m512i qb = block(q + 32 * b, half);
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) {
          acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)qb, (__m512bh)block(k[j] + 32 * b, half));
        }
      }
    }
    return transpose_sum(acc);
  }

  // acc[mm] = acc[mm] * alpha[mm] + sum_j p[mm][j] * v[j] over the 32 * NB values at d0,
  // with bf16 p and values, two keys per vdpbf16ps. Interleaving rows j and j + 1 (unpack)
  // leaves values 0-3, 8-11, 16-19, 24-27 of each block of 32 in one accumulator and 4-7,
  // 12-15, ... in the other: the accumulators are put in that order when loaded and back
  // in natural order when stored, so acc is in natural order outside this function.
  template <int MB, int NB, class Rows>
  PAGEDSERVE_INLINE static void accumulate_bf16(float* acc, int64_t D, int64_t d0,
                                                const c10::BFloat16* p, const float* alpha,
                                                const Rows& v, int n) {
    __m512 lo[MB][NB], hi[MB][NB];
#pragma GCC unroll 16
    for (int mm = 0; mm < MB; ++mm) {
      const __m512 al = _mm512_set1_ps(alpha[mm]);
#pragma GCC unroll 16
      for (int b = 0; b < NB; ++b) {
        const float* a = acc + mm * D + d0 + 32 * b;
        const __m512 first = _mm512_loadu_ps(a), second = _mm512_loadu_ps(a + 16);
        lo[mm][b] = _mm512_mul_ps(_mm512_shuffle_f32x4(first, second, 0x88), al);
        hi[mm][b] = _mm512_mul_ps(_mm512_shuffle_f32x4(first, second, 0xDD), al);
      }
    }
    for (int j = 0; j < n; j += 2) {
      const c10::BFloat16* r0 = v[j] + d0;
      const c10::BFloat16* r1 = (j + 1 < n ? v[j + 1] : v[j]) + d0;  // then its p is 0
      __m512i ul[NB], uh[NB];
#pragma GCC unroll 16
      for (int b = 0; b < NB; ++b) {
        const __m512i x = _mm512_loadu_si512(r0 + 32 * b), y = _mm512_loadu_si512(r1 + 32 * b);
        ul[b] = _mm512_unpacklo_epi16(x, y);
        uh[b] = _mm512_unpackhi_epi16(x, y);
      }
#pragma GCC unroll 16
      for (int mm = 0; mm < MB; ++mm) {
        int32_t pair;
        std::memcpy(&pair, p + mm * kChunk + j, sizeof(pair));
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 16
        for (int b = 0; b < NB; ++b) {
          lo[mm][b] = _mm512_dpbf16_ps(lo[mm][b], (__m512bh)ul[b], pp);
          hi[mm][b] = _mm512_dpbf16_ps(hi[mm][b], (__m512bh)uh[b], pp);
        }
      }
    }
#pragma GCC unroll 16
    for (int mm = 0; mm < MB; ++mm) {
#pragma GCC unroll 16
      for (int b = 0; b < NB; ++b) {
        const __m512 t0 = _mm512_shuffle_f32x4(lo[mm][b], hi[mm][b], 0x44);  // lo0 lo1 hi0 hi1
        const __m512 t1 = _mm512_shuffle_f32x4(lo[mm][b], hi[mm][b], 0xEE);  // lo2 lo3 hi2 hi3
        float* a = acc + mm * D + d0 + 32 * b;
        _mm512_storeu_ps(a, _mm512_shuffle_f32x4(t0, t0, 0xD8));  // lo0 hi0 lo1 hi1
        _mm512_storeu_ps(a + 16, _mm512_shuffle_f32x4(t1, t1, 0xD8));
      }
    }
  }

 private:
  static __m512i block(const c10::BFloat16* p, bool half) {
    if (!half) return _mm512_loadu_si512(p);
    return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};
#endif  // __AVX512BF16__

}  // namespace pagedserve::PAGEDSERVE_ISA::avx512

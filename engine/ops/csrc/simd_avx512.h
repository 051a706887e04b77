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

// v rounded to bfloat16 as c10::BFloat16 rounds (nearest, ties to even; NaN becomes
// 0x7FC0), in each lane's high 16 bits (the low 16 are not cleared).
inline __m512i round_bf16_high(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc00000));
}
// The 16 lanes as bfloat16 numbers (round_bf16_high's).
inline __m256i to_bf16(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_high(v), 16));
}
// The 16 lanes rounded to bfloat16, as float32.
inline __m512 rounded_to_bf16(__m512 v) {
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  return _mm512_castsi512_ps(_mm512_and_si512(round_bf16_high(v), high));
}

inline void store_f32(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_f32(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
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

  // Keys as lanes: kt[p * kChunk + j] = pair p (elements 2p and 2p + 1) of key row k[j],
  // for the chunk's kChunk rows and `pairs` pairs a row (a multiple of 8). One load of kt
  // then holds 16 keys' values at one pair of elements, a vdpbf16ps operand as it is, so a
  // score needs no sum across lanes. Transposed 16 x 16 pairs at a time.
  template <class Rows>
  PAGEDSERVE_INLINE static void transpose_pairs(const Rows& k, int64_t pairs, int32_t* kt) {
    for (int g = 0; g < kChunk / 16; ++g) {
      for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
        const int cnt = static_cast<int>(std::min<int64_t>(16, pairs - p0));
        const __mmask16 mask = first_lanes(cnt);
        __m512i r[16], t[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          r[i] = _mm512_maskz_loadu_epi32(mask, k[16 * g + i] + 2 * p0);
          k.request_ahead(16 * g + i, 2 * p0);
        }
        // Within each 128-bit lane (pairs 4L..4L + 3): t[2i], t[2i + 1] interleave rows 2i
        // and 2i + 1; then r[4i + e] holds pair 4L + e of rows 4i..4i + 3.
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
          t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
          r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
          r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
          r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        // Pair 4L + e of all 16 rows: lane L of r[e], r[4 + e], r[8 + e], r[12 + e].
#pragma GCC unroll 4
        for (int e = 0; e < 4; ++e) {
          const __m512i x0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44);
          const __m512i x1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
          const __m512i y0 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
          const __m512i y1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
          const __m512i lanes[4] = {
              _mm512_shuffle_i32x4(x0, y0, 0x88), _mm512_shuffle_i32x4(x0, y0, 0xDD),
              _mm512_shuffle_i32x4(x1, y1, 0x88), _mm512_shuffle_i32x4(x1, y1, 0xDD)};
#pragma GCC unroll 4
          for (int L = 0; L < 4; ++L) {
            const int p = 4 * L + e;
            if (p < cnt) _mm512_storeu_si512(kt + (p0 + p) * kChunk + 16 * g, lanes[L]);
          }
        }
      }
    }
  }

  // out[i][g], lane j: q[i] . (key 16 g + j) for MS query vectors of `pairs` bf16 pairs
  // against transpose_pairs' keys. Each lane sums the even pairs in order and the odd pairs
  // in order, then the two: the same arithmetic for a query vector whatever MS.
  template <int MS, int G>
  PAGEDSERVE_INLINE static void dot_pairs(const c10::BFloat16* const (&q)[MS],
                                          const int32_t* kt, int64_t pairs, F (&out)[MS][G]) {
    F acc[MS][G][2];
#pragma GCC unroll 4
    for (int i = 0; i < MS; ++i) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[i][g][0] = acc[i][g][1] = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < pairs; p += 2) {
#pragma GCC unroll 2
      for (int s = 0; s < 2; ++s) {
        __m512i kv[G];
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) kv[g] = _mm512_loadu_si512(kt + (p + s) * kChunk + 16 * g);
#pragma GCC unroll 4
        for (int i = 0; i < MS; ++i) {
          int32_t pair;
          std::memcpy(&pair, q[i] + 2 * (p + s), sizeof(pair));
          const __m512bh qq = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
          for (int g = 0; g < G; ++g) acc[i][g][s] = _mm512_dpbf16_ps(acc[i][g][s], qq, (__m512bh)kv[g]);
        }
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MS; ++i) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) out[i][g] = _mm512_add_ps(acc[i][g][0], acc[i][g][1]);
    }
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
        v.request_ahead(j, d0 + 32 * b);
        v.request_ahead(j + 1, d0 + 32 * b);
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

};
#endif  // __AVX512BF16__

}  // namespace pagedserve::PAGEDSERVE_ISA::avx512

// Primitives for every CPU: VecGeneric in GCC/Clang generic vectors of 4 floats (SSE2 on
// x86-64, NEON on aarch64), the portable set's vector; and VecScalar, one float, which every
// set uses for head sizes its own vector does not divide. attention_item.h says what each
// primitive must do.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels.h"

namespace pagedserve::PAGEDSERVE_ISA {

// exp(n * ln2 + r) / 2^n for |r| <= ln2 / 2, given n = round(x / ln2): simd_avx512.h's
// exp_ps polynomial, for a float or a generic vector of floats.
template <typename F>
PAGEDSERVE_INLINE F exp_reduced(F x, F n) {
  F r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F y = r * 0.0f + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  return y * (r * r) + (r + 1.0f);
}

// exp(x) of exp_ps, for one float: the same polynomial and clamp at -87.
inline float exp_poly(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  return std::ldexp(exp_reduced(x, n), static_cast<int>(n));
}

struct VecScalar {
  using F = float;
  static constexpr int W = 1;
  static constexpr int kAccRegs = 8;
  static constexpr bool kBf16Dot = false;
  static constexpr bool kKeysOuter = false;

  PAGEDSERVE_INLINE static F zero() { return 0.0f; }
  PAGEDSERVE_INLINE static F set1(float x) { return x; }
  template <typename S>
  PAGEDSERVE_INLINE static F load(const S* p) { return static_cast<float>(*p); }
  template <typename S>
  PAGEDSERVE_INLINE static void store(S* p, F v) { *p = static_cast<S>(v); }
  PAGEDSERVE_INLINE static F add(F a, F b) { return a + b; }
  PAGEDSERVE_INLINE static F sub(F a, F b) { return a - b; }
  PAGEDSERVE_INLINE static F mul(F a, F b) { return a * b; }
  PAGEDSERVE_INLINE static F fmadd(F a, F b, F c) { return a * b + c; }
  PAGEDSERVE_INLINE static F exp(F x) { return exp_poly(x); }
  PAGEDSERVE_INLINE static F keep_first(F x, int cnt) { return cnt > 0 ? x : 0.0f; }
  PAGEDSERVE_INLINE static F low_first(F x, int cnt) {
    return cnt > 0 ? x : -std::numeric_limits<float>::infinity();
  }
  PAGEDSERVE_INLINE static F max(F a, F b) { return std::max(a, b); }
  PAGEDSERVE_INLINE static float reduce_max(F v) { return v; }
  PAGEDSERVE_INLINE static float reduce_add(F v) { return v; }
  PAGEDSERVE_INLINE static F transpose_sum(const F (&v)[W]) { return v[0]; }
};

struct VecGeneric {
  static constexpr int W = 4;
  typedef float F __attribute__((vector_size(W * sizeof(float))));
  typedef int32_t I __attribute__((vector_size(W * sizeof(int32_t))));
  static constexpr int kAccRegs = 12;
  static constexpr bool kBf16Dot = false;
  // Key by key only where q fits the registers (head sizes up to 48): the portable tests
  // run this path too, which the AVX-512 sets take for every head size.
  static constexpr bool kKeysOuter = true;

  PAGEDSERVE_INLINE static F zero() { return F{}; }
  PAGEDSERVE_INLINE static F set1(float x) { return F{} + x; }
  PAGEDSERVE_INLINE static F load(const float* p) {
    F v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  template <typename S>
  PAGEDSERVE_INLINE static F load(const S* p) {
    F v;
    for (int l = 0; l < W; ++l) v[l] = static_cast<float>(p[l]);
    return v;
  }
  PAGEDSERVE_INLINE static void store(float* p, F v) { std::memcpy(p, &v, sizeof(v)); }
  template <typename S>
  PAGEDSERVE_INLINE static void store(S* p, F v) {
    for (int l = 0; l < W; ++l) p[l] = static_cast<S>(v[l]);
  }
  PAGEDSERVE_INLINE static F add(F a, F b) { return a + b; }
  PAGEDSERVE_INLINE static F sub(F a, F b) { return a - b; }
  PAGEDSERVE_INLINE static F mul(F a, F b) { return a * b; }
  PAGEDSERVE_INLINE static F fmadd(F a, F b, F c) { return a * b + c; }
  // exp_poly lane-wise, for x <= 0 only (2^n is built from n's bits, n in -126..0).
  PAGEDSERVE_INLINE static F exp(F x) {
    const I low = x < set1(-87.0f);
    x = (F)(((I)x & ~low) | ((I)set1(-87.0f) & low));
    const F n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to int
    const I two_n = (__builtin_convertvector(n, I) + 127) << 23;
    return exp_reduced(x, n) * (F)two_n;
  }
  PAGEDSERVE_INLINE static F keep_first(F x, int cnt) { return (F)((I)x & lanes_below(cnt)); }
  PAGEDSERVE_INLINE static F low_first(F x, int cnt) {
    const I keep = lanes_below(cnt);
    return (F)(((I)x & keep) | ((I)set1(-std::numeric_limits<float>::infinity()) & ~keep));
  }
  PAGEDSERVE_INLINE static F max(F a, F b) {
    const I a_larger = a > b;
    return (F)(((I)a & a_larger) | ((I)b & ~a_larger));
  }
  PAGEDSERVE_INLINE static float reduce_max(F v) {
    v = max(v, shuffle<2, 3, 0, 1>(v, v));
    return max(v, shuffle<1, 0, 3, 2>(v, v))[0];
  }
  PAGEDSERVE_INLINE static float reduce_add(F v) {
    v = v + shuffle<2, 3, 0, 1>(v, v);
    return (v + shuffle<1, 0, 3, 2>(v, v))[0];
  }
  // Lane j of the result is the sum of v[j]'s lanes, in two rounds of shuffles and adds.
  PAGEDSERVE_INLINE static F transpose_sum(const F (&v)[W]) {
    const F t0 = shuffle<0, 4, 1, 5>(v[0], v[1]) + shuffle<2, 6, 3, 7>(v[0], v[1]);
    const F t1 = shuffle<0, 4, 1, 5>(v[2], v[3]) + shuffle<2, 6, 3, 7>(v[2], v[3]);
    // t0 = [a0+a2, b0+b2, a1+a3, b1+b3], t1 likewise for c and d
    return shuffle<0, 1, 4, 5>(t0, t1) + shuffle<2, 3, 6, 7>(t0, t1);
  }

 private:
  // Lanes i0..i3 of the 8 lanes of a then b.
  template <int I0, int I1, int I2, int I3>
  PAGEDSERVE_INLINE static F shuffle(F a, F b) {
#if defined(__clang__)
    return __builtin_shufflevector(a, b, I0, I1, I2, I3);
#else
    return __builtin_shuffle(a, b, I{I0, I1, I2, I3});
#endif
  }

  PAGEDSERVE_INLINE static I lanes_below(int cnt) {
    I lane;
    for (int l = 0; l < W; ++l) lane[l] = l;
    return lane < cnt;
  }
};

}  // namespace pagedserve::PAGEDSERVE_ISA

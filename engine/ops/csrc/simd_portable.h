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

// exp(x) of simd_avx512.h's exp_ps, for one float: the same polynomial and clamp at -87.
inline float exp_poly(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + (r + 1.0f);
  return std::ldexp(y, static_cast<int>(n));
}

struct VecScalar {
  using F = float;
  static constexpr int W = 1;
  static constexpr int kAccRegs = 8;
  static constexpr bool kBf16Dot = false;

  static F zero() { return 0.0f; }
  static F set1(float x) { return x; }
  template <typename S>
  static F load(const S* p) { return static_cast<float>(*p); }
  template <typename S>
  static void store(S* p, F v) { *p = static_cast<S>(v); }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F fmadd(F a, F b, F c) { return a * b + c; }
  static F exp(F x) { return exp_poly(x); }
  static F keep_first(F x, int cnt) { return cnt > 0 ? x : 0.0f; }
  static float max_first(F x, int cnt) {
    return cnt > 0 ? x : -std::numeric_limits<float>::infinity();
  }
  static float reduce_add(F v) { return v; }
  static F transpose_sum(const F (&v)[W]) { return v[0]; }
};

struct VecGeneric {
  static constexpr int W = 4;
  typedef float F __attribute__((vector_size(W * sizeof(float))));
  typedef int32_t I __attribute__((vector_size(W * sizeof(int32_t))));
  static constexpr int kAccRegs = 12;
  static constexpr bool kBf16Dot = false;

  static F zero() { return F{}; }
  static F set1(float x) { return F{} + x; }
  static F load(const float* p) {
    F v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  template <typename S>
  static F load(const S* p) {
    F v;
    for (int l = 0; l < W; ++l) v[l] = static_cast<float>(p[l]);
    return v;
  }
  static void store(float* p, F v) { std::memcpy(p, &v, sizeof(v)); }
  template <typename S>
  static void store(S* p, F v) {
    for (int l = 0; l < W; ++l) p[l] = static_cast<S>(v[l]);
  }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F fmadd(F a, F b, F c) { return a * b + c; }
  // exp_poly lane-wise, for x <= 0 only (2^n is built from n's bits, n in -126..0).
  static F exp(F x) {
    const I low = x < set1(-87.0f);
    x = (F)(((I)x & ~low) | ((I)set1(-87.0f) & low));
    const F n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to int
    F r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    F y = set1(1.9875691500e-4f);
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + (r + 1.0f);
    const I two_n = (__builtin_convertvector(n, I) + 127) << 23;
    return y * (F)two_n;
  }
  static F keep_first(F x, int cnt) { return (F)((I)x & lanes_below(cnt)); }
  static float max_first(F x, int cnt) {
    float m = -std::numeric_limits<float>::infinity();
    for (int l = 0; l < std::min(cnt, W); ++l) m = std::max(m, x[l]);
    return m;
  }
  static float reduce_add(F v) {
    float sum = 0.0f;
    for (int l = 0; l < W; ++l) sum += v[l];
    return sum;
  }
  static F transpose_sum(const F (&v)[W]) {
    F out;
    for (int j = 0; j < W; ++j) out[j] = reduce_add(v[j]);
    return out;
  }

 private:
  static I lanes_below(int cnt) {
    I lane;
    for (int l = 0; l < W; ++l) lane[l] = l;
    return lane < cnt;
  }
};

}  // namespace pagedserve::PAGEDSERVE_ISA

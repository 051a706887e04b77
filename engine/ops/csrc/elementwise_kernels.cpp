// Fused elementwise kernels for a Llama-family decoder on the CPU: RMSNorm (optionally
// with the residual add), rotary embedding in place, and SiLU(gate) * up.
//
// Each reproduces the rounding of the torch ops it replaces (engine/models/layers.py and
// llama.py): every intermediate that torch stores in the model dtype is rounded to that
// dtype here too, and float32 products and sums are never fused into FMAs. Only the
// RMSNorm mean (summation order) and SiLU's exp (a different polynomial) may differ from
// torch, by float32 rounding.
//
// Compiled once per instruction set (kernels.h): the AVX-512 loops below exist only in
// the AVX-512 sets, the AVX2 set has the same loops in 8 lanes, and every set has the
// scalar loops, which also finish the vector loops' rows.
// elementwise_ops.cpp checks the tensors and splits the rows over torch's threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_common.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDSERVE_AVX512 1
#include "simd_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDSERVE_ELEMENTWISE_AVX2 1
#include "simd_avx2.h"
#endif

// torch rounds each product before adding it: no fused multiply-adds in this file.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace pagedserve::PAGEDSERVE_ISA {
namespace {

// Rounds a float32 value to the model dtype and back, as storing it in a tensor would.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

#ifdef PAGEDSERVE_AVX512
using avx512::load_f32;
using avx512::store_f32;

inline __m512 round_to_vec(float*, __m512 x) { return x; }
inline __m512 round_to_vec(c10::BFloat16*, __m512 x) {
  // float32 -> bf16 (nearest even) -> float32, NaN kept.
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(nan, avx512::rounded_to_bf16(x), x);
}
inline __m512 round_to_vec(c10::Half*, __m512 x) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename T>
inline __m512 round_vec(__m512 x) {
  return round_to_vec(static_cast<T*>(nullptr), x);
}

#endif

#ifdef PAGEDSERVE_ELEMENTWISE_AVX2
// The AVX2 set's 8-lane counterparts of the AVX-512 helpers above (and of exp_ps): a scalar
// std::exp per element made silu_and_mul 20 us for one token's 1536 values, and the scalar
// RMSNorm took 26 us for 16 rows of 576 (fused with the residual add) on a Zen 3 VM.
using avx2::bf16_bits8;
using avx2::exp8;
using avx2::load8;
using avx2::store8;

inline __m256 round8(float*, __m256 x) { return x; }
inline __m256 round8(c10::BFloat16*, __m256 x) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16)), x, nan);
}
inline __m256 round8(c10::Half*, __m256 x) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename T>
inline __m256 round_vec8(__m256 x) {
  return round8(static_cast<T*>(nullptr), x);
}

// round(silu(g)) in T for 8 values of g (the SiLU loop's first half).
template <typename T>
PAGEDSERVE_INLINE __m256 silu8(__m256 g) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return round_vec8<T>(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
}

// For a 16-bit T, round(silu(g)) for every one of the 65,536 values of g, by silu8 itself,
// made once (128 KB): a table lookup per value then does what some 40 vector instructions
// per 8 did, the same bits. On a Zen 3 VM SiLU had taken about 2 us for a row of 1536.
template <typename T>
const T* silu_table() {
  static_assert(sizeof(T) == 2);
  static const std::vector<T> table = [] {
    std::vector<T> t(1 << 16);
    for (uint32_t i = 0; i < t.size(); i += 8) {
      T g[8];
      for (uint32_t j = 0; j < 8; ++j) g[j] = T(static_cast<uint16_t>(i + j), T::from_bits());
      store8(&t[i], silu8<T>(load8(g)));
    }
    return t;
  }();
  return table.data();
}

#endif

// ---------------------------------------------------------------------------------------
// RMSNorm: out = weight * round(x * rsqrt(mean(x^2) + eps)), with x = round(x + residual)
// (written back to residual) when a residual is given.

template <typename T>
void rms_norm_row(T* out, T* x_row, T* residual, const T* w, int64_t H, float eps) {
  // x_row is read only when residual is null; with a residual, the sum replaces it.
  const T* x = x_row;
  if (residual != nullptr) {
    int64_t d = 0;
#ifdef PAGEDSERVE_AVX512
    for (; d + 16 <= H; d += 16) {
      store_f32(residual + d, _mm512_add_ps(load_f32(x_row + d), load_f32(residual + d)));
    }
#elif defined(PAGEDSERVE_ELEMENTWISE_AVX2)
    for (; d + 8 <= H; d += 8) {
      store8(residual + d, _mm256_add_ps(load8(x_row + d), load8(residual + d)));
    }
#endif
    for (; d < H; ++d) residual[d] = static_cast<T>(to_float(x_row[d]) + to_float(residual[d]));
    x = residual;
  }
  // torch sums in many float32 lanes; a double sum stays as close without SIMD.
  double sum = 0.0;
  int64_t d = 0;
#ifdef PAGEDSERVE_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= H; d += 16) {
    const __m512 v = load_f32(x + d);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(PAGEDSERVE_ELEMENTWISE_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= H; d += 8) {
    const __m256 v = load8(x + d);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  sum = avx2::Vec256::reduce_add(acc);
#endif
  for (; d < H; ++d) sum += to_float(x[d]) * to_float(x[d]);
  const float mean = static_cast<float>(sum) / static_cast<float>(H);
  const float inv = 1.0f / std::sqrt(mean + eps);
  d = 0;
#ifdef PAGEDSERVE_AVX512
  const __m512 inv_v = _mm512_set1_ps(inv);
  for (; d + 16 <= H; d += 16) {
    const __m512 normed = round_vec<T>(_mm512_mul_ps(load_f32(x + d), inv_v));
    store_f32(out + d, _mm512_mul_ps(load_f32(w + d), normed));
  }
#elif defined(PAGEDSERVE_ELEMENTWISE_AVX2)
  const __m256 inv_v = _mm256_set1_ps(inv);
  for (; d + 8 <= H; d += 8) {
    const __m256 normed = round_vec8<T>(_mm256_mul_ps(load8(x + d), inv_v));
    store8(out + d, _mm256_mul_ps(load8(w + d), normed));
  }
#endif
  for (; d < H; ++d) {
    out[d] = static_cast<T>(to_float(w[d]) * round_to<T>(to_float(x[d]) * inv));
  }
}

// ---------------------------------------------------------------------------------------
// Rotary embedding, rotate-half layout, in place:
//   x[:half], x[half:]  <-  round(round(x1 * c1) + round(-x2 * s1)),
//                           round(round(x2 * c2) + round(x1 * s2))

template <typename T>
void rope_head(T* x, const T* c, const T* s, int64_t half) {
  int64_t d = 0;
#ifdef PAGEDSERVE_AVX512
  for (; d + 16 <= half; d += 16) {
    const __m512 x1 = load_f32(x + d), x2 = load_f32(x + half + d);
    const __m512 c1 = load_f32(c + d), c2 = load_f32(c + half + d);
    const __m512 s1 = load_f32(s + d), s2 = load_f32(s + half + d);
    const __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
    const __m512 a = _mm512_add_ps(round_vec<T>(_mm512_mul_ps(x1, c1)),
                                   round_vec<T>(_mm512_mul_ps(neg_x2, s1)));
    const __m512 b = _mm512_add_ps(round_vec<T>(_mm512_mul_ps(x2, c2)),
                                   round_vec<T>(_mm512_mul_ps(x1, s2)));
    store_f32(x + d, a);
    store_f32(x + half + d, b);
  }
#elif defined(PAGEDSERVE_ELEMENTWISE_AVX2)
  for (; d + 8 <= half; d += 8) {
    const __m256 x1 = load8(x + d), x2 = load8(x + half + d);
    const __m256 c1 = load8(c + d), c2 = load8(c + half + d);
    const __m256 s1 = load8(s + d), s2 = load8(s + half + d);
    const __m256 neg_x2 = _mm256_sub_ps(_mm256_setzero_ps(), x2);
    const __m256 a = _mm256_add_ps(round_vec8<T>(_mm256_mul_ps(x1, c1)),
                                   round_vec8<T>(_mm256_mul_ps(neg_x2, s1)));
    const __m256 b = _mm256_add_ps(round_vec8<T>(_mm256_mul_ps(x2, c2)),
                                   round_vec8<T>(_mm256_mul_ps(x1, s2)));
    store8(x + d, a);
    store8(x + half + d, b);
  }
#endif
  for (; d < half; ++d) {
    const float x1 = to_float(x[d]), x2 = to_float(x[half + d]);
    const float a = round_to<T>(x1 * to_float(c[d])) + round_to<T>(-x2 * to_float(s[d]));
    const float b =
        round_to<T>(x2 * to_float(c[half + d])) + round_to<T>(x1 * to_float(s[half + d]));
    x[d] = static_cast<T>(a);
    x[half + d] = static_cast<T>(b);
  }
}

// ---------------------------------------------------------------------------------------
// SwiGLU: out = round(round(silu(gate)) * up), gate_up = [gate | up] per row.

template <typename T>
void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t I) {
  int64_t d = 0;
#ifdef PAGEDSERVE_AVX512
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; d + 16 <= I; d += 16) {
    const __m512 g = load_f32(gate + d);
    const __m512 e = avx512::exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = round_vec<T>(_mm512_div_ps(g, _mm512_add_ps(one, e)));
    store_f32(out + d, _mm512_mul_ps(silu, load_f32(up + d)));
  }
#elif defined(PAGEDSERVE_ELEMENTWISE_AVX2)
  if constexpr (sizeof(T) == 2) {
    // Looked up a slice at a time into `silu`, then multiplied by up 8 at a time.
    constexpr int64_t kSlice = 256;
    const T* table = silu_table<T>();
    T silu[kSlice];
    while (d + 8 <= I) {
      const int64_t n = std::min(kSlice, (I - d) / 8 * 8);
      for (int64_t j = 0; j < n; ++j) {
        uint16_t bits;
        std::memcpy(&bits, gate + d + j, sizeof(bits));
        silu[j] = table[bits];
      }
      for (int64_t j = 0; j < n; j += 8) {
        store8(out + d + j, _mm256_mul_ps(load8(silu + j), load8(up + d + j)));
      }
      d += n;
    }
  } else {
    for (; d + 8 <= I; d += 8) {
      store8(out + d, _mm256_mul_ps(silu8<T>(load8(gate + d)), load8(up + d)));
    }
  }
#endif
  for (; d < I; ++d) {
    const float g = to_float(gate[d]);
    out[d] = static_cast<T>(round_to<T>(g / (1.0f + std::exp(-g))) * to_float(up[d]));
  }
}

}  // namespace

template <typename T>
void rms_norm_rows(const RmsNormRows<T>& a, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    T* residual = a.residual == nullptr ? nullptr : a.residual + r * a.residual_stride;
    rms_norm_row(a.out + r * a.out_stride, a.x + r * a.x_stride, residual, a.weight, a.hidden,
                 a.eps);
  }
}

template <typename T>
void rope_rows(const RopeRows<T>& a, int64_t begin, int64_t end) {
  const int64_t D = a.head_dim;
  for (int64_t t = begin; t < end; ++t) {
    const T* c = a.cos + t * D;
    const T* s = a.sin + t * D;
    for (int64_t h = 0; h < a.q_heads; ++h) rope_head(a.q + t * a.q_stride + h * D, c, s, D / 2);
    for (int64_t h = 0; h < a.k_heads; ++h) rope_head(a.k + t * a.k_stride + h * D, c, s, D / 2);
  }
}

template <typename T>
void silu_and_mul_rows(const SiluAndMulRows<T>& a, int64_t begin, int64_t end) {
  const int64_t I = a.intermediate;
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = a.gate_up + r * a.gate_up_stride;
    silu_and_mul_row(a.out + r * a.out_stride, gate, gate + I, I);
  }
}

#define PAGEDSERVE_INSTANTIATE(T)                                                \
  template void rms_norm_rows<T>(const RmsNormRows<T>&, int64_t, int64_t);       \
  template void rope_rows<T>(const RopeRows<T>&, int64_t, int64_t);              \
  template void silu_and_mul_rows<T>(const SiluAndMulRows<T>&, int64_t, int64_t);
PAGEDSERVE_INSTANTIATE(float)
PAGEDSERVE_INSTANTIATE(c10::BFloat16)
PAGEDSERVE_INSTANTIATE(c10::Half)
#undef PAGEDSERVE_INSTANTIATE

}  // namespace pagedserve::PAGEDSERVE_ISA

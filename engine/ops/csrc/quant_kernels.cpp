// Weight-only quantized linear layers on the CPU: y = x W^T, W (N, K) quantized in blocks of
// 32 weights along K, as GGUF's Q4_0, Q4_1 and Q8_0 and pagedserve's int8/int4 are.
//
//   4-bit (affine): w = d[n, g] * q + m[n, g], q in 0..15
//   8-bit (scaled): w = d[n, g] * q,           q in -128..127
//
// with float16 d and m per group g of `group_size` weights (a multiple of 32). Activations
// are float32 or bfloat16; every product and sum is float32, so the result equals
// x @ dequantize(W)^T up to the order of float32 additions.
//
// Layout (made by engine/models/quantized.py's pack_tiles): 16 output rows form a tile,
// and a vector's 16 float32 lanes are a tile's 16 rows, so a tile's outputs accumulate
// lane-wise with no horizontal sums, and each unpacked weight vector serves every row of x.
//
//   8-bit  q: (N/16, K/32, 32, 16) int8    [tile][block][k in block][row in tile]
//   4-bit  q: (N/16, K/32, 4, 16, 4) uint8 [tile][block][octet][row in tile][byte]: a row's
//             8 weights of an octet (k = 8 octet + j) in one 32-bit word, whose low 16 bits
//             hold the even j and high 16 bits the odd j, a nibble each, in order:
//
//               bits 4s..4s+3 = q[8 octet + 2s],  bits 16+4s..19+4s = q[8 octet + 2s + 1]
//
//   d, m:     (N/16, K/group, 16) float16 [tile][group][row in tile]
//
// So a 4-bit octet is 64 bytes, one AVX-512 vector, lane i row i, and (word >> 4s) & 0x000F000F
// is row i's pair (q[k], q[k + 1]) at k = 8 octet + 2s as two 16-bit integers: what
// AVX512-BF16 and AVX2's vpmaddwd want, with a shift and a mask and no shuffle. For
// AVX512-BF16, OR-ing 0x4300 into each 16-bit half makes the bfloat16 numbers 128 + q
// (exact: bfloat16's spacing at 128 is 1), and lane i of vdpbf16ps with the broadcast
// activation pair (x[k], x[k+1]) adds row i's two products, each exact in float32. Then
//
//   sum_{k in g} w x = d * sum_{k in g} (128 + q) x + (m - 128 d) * xsum[g]
//
// still exact up to float32 rounding of the sums, though the 128 offset spends about seven
// of float32's 24 bits on cancellation: far below a bfloat16 output's 8. float32 activations
// take the plain float32 path (the nibbles widened to float32), which has no offset.
//
// Compiled once per instruction set (kernels.h): the bfloat16 dot-product path exists in
// the AVX512_BF16 set, the float32 vector path in both AVX-512 sets, an integer and a float32
// path in the AVX2 set (quant_avx2.h), and every set has the portable loops (the reference
// for the others' arithmetic). quant_ops.cpp checks the tensors, prepares the rows and
// splits the tiles over torch's threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>

#include "simd_avx512.h"
#define PAGEDSERVE_QUANT_AVX512 1
#if defined(__AVX512BF16__)
#define PAGEDSERVE_QUANT_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDSERVE_QUANT_AVX2 1
#endif

namespace pagedserve::PAGEDSERVE_ISA {
namespace {

using TileKernel = void (*)(const QuantWeight&, int64_t t, const QuantRows& a, QuantOut out);

// Stores one row's tile of outputs, rounding to bfloat16 (nearest even) when the output is,
// or is float32 holding bfloat16 numbers.
void store_tile(const QuantWeight& w, int64_t t, const float* lanes, QuantOut out, int64_t r) {
  const int64_t n0 = t * QuantWeight::kTile, count = std::min(QuantWeight::kTile, w.N - n0);
  if (out.bf16) {
    c10::BFloat16* dst = static_cast<c10::BFloat16*>(out.data) + r * w.N + n0;
    for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<c10::BFloat16>(lanes[i]);
  } else if (out.rounded) {
    float* dst = static_cast<float*>(out.data) + r * w.N + n0;
    for (int64_t i = 0; i < count; ++i) {
      dst[i] = static_cast<float>(static_cast<c10::BFloat16>(lanes[i]));
    }
  } else {
    std::memcpy(static_cast<float*>(out.data) + r * w.N + n0, lanes, count * sizeof(float));
  }
}

// ---------------------------------------------------------------------------------------
// Portable path: plain loops, the reference for the vector paths' arithmetic.

void tile_portable(const QuantWeight& w, int64_t t, const QuantRows& a, QuantOut out) {
  const int64_t groups = w.groups();
  for (int64_t r = 0; r < a.count; ++r) {
    const float* x = a.x + r * w.K;
    float lanes[QuantWeight::kTile];
    for (int64_t i = 0; i < QuantWeight::kTile; ++i) {
      const int64_t n = std::min(t * QuantWeight::kTile + i, w.N - 1);
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float acc = 0.f;
        for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) {
          acc += static_cast<float>(w.value(n, k)) * x[k];
        }
        total += w.scale(n, g) * acc;
        if (w.bits == 4) total += w.min(n, g) * a.xsum[r * groups + g];
      }
      lanes[i] = total;
    }
    store_tile(w, t, lanes, out, r);
  }
}

// Runs KERNEL<R> for the rows' count R (1..8).
#define PAGEDSERVE_ROW_SWITCH(KERNEL)                       \
  switch (a.count) {                                        \
    case 8: return KERNEL<8>(w, t, a, out);                 \
    case 7: return KERNEL<7>(w, t, a, out);                 \
    case 6: return KERNEL<6>(w, t, a, out);                 \
    case 5: return KERNEL<5>(w, t, a, out);                 \
    case 4: return KERNEL<4>(w, t, a, out);                 \
    case 3: return KERNEL<3>(w, t, a, out);                 \
    case 2: return KERNEL<2>(w, t, a, out);                 \
    default: return KERNEL<1>(w, t, a, out);                \
  }

#ifdef PAGEDSERVE_QUANT_AVX2
#include "quant_avx2.h"

void tile_rows_avx2(const QuantWeight& w, int64_t t, const QuantRows& a, QuantOut out) {
  if (a.xq != nullptr) {
    if (w.bits == 8) PAGEDSERVE_ROW_SWITCH(tile_int8_avx2)
    PAGEDSERVE_ROW_SWITCH(tile_int4_avx2)
  }
  if (w.bits == 8) PAGEDSERVE_ROW_SWITCH(tile_f32_8_avx2)
  PAGEDSERVE_ROW_SWITCH(tile_f32_4_avx2)
}
#endif  // PAGEDSERVE_QUANT_AVX2

#ifdef PAGEDSERVE_QUANT_AVX512

// How far ahead of the block being read to ask for the weights: without it, a decode step's
// weight stream ran about 15% slower (built with and without, benchmarks/quant_kernels.py's
// streamed figures).
constexpr int64_t kPrefetchAhead = 4096;

// Asks for the cache lines of the block kPrefetchAhead bytes past `blk` (reading past the end
// of the weights is harmless: a prefetch never faults).
inline void prefetch_ahead(const QuantWeight& w, const uint8_t* blk) {
  const char* ahead = reinterpret_cast<const char*>(blk) + kPrefetchAhead;
  for (int64_t line = 0; line < w.block_bytes(); line += 64) {
    _mm_prefetch(ahead + line, _MM_HINT_T0);
  }
}

inline __m512 load_f16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// store_tile's stores, 16 lanes at a time (the same bfloat16 rounding, vectorised).
inline void store_lanes(const QuantWeight& w, int64_t t, __m512 v, QuantOut out, int64_t r) {
  const int64_t n0 = t * QuantWeight::kTile, at = r * w.N + n0;
  const auto mask = static_cast<__mmask16>((1u << std::min(QuantWeight::kTile, w.N - n0)) - 1);
  if (out.bf16) {
    _mm256_mask_storeu_epi16(static_cast<c10::BFloat16*>(out.data) + at, mask, avx512::to_bf16(v));
  } else {
    float* dst = static_cast<float*>(out.data) + at;
    _mm512_mask_storeu_ps(dst, mask, out.rounded ? avx512::rounded_to_bf16(v) : v);
  }
}

// ---------------------------------------------------------------------------------------
// float32 path: per k, the tile's 16 weights as floats, times the broadcast x[k].

// With few rows of x, alternate partial sums so consecutive FMAs (or dot products) of a row
// do not wait on each other's latency.
template <int64_t R>
constexpr int64_t kPartials = R >= 4 ? 1 : (R >= 2 ? 2 : 4);

// The 64-byte octet of a 4-bit block, lane i row i (see the layout above).
inline __m512i load_octet(const uint8_t* blk, int64_t octet) {
  return _mm512_loadu_si512(blk + octet * 4 * QuantWeight::kTile);
}

template <int64_t R>
void tile_f32(const QuantWeight& w, int64_t t, const QuantRows& a,
                                       QuantOut out) {
  constexpr int64_t P = kPartials<R>;
  const int64_t groups = w.groups(), blocks_per_group = w.group / QuantWeight::kBlock;
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  __m512 acc[R], part[R][P];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t p = 0; p < P; ++p) part[r][p] = _mm512_setzero_ps();
    }
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      const uint8_t* blk = w.block(t, b);
      prefetch_ahead(w, blk);
      const int64_t k0 = b * QuantWeight::kBlock;
      if (w.bits == 8) {
        for (int64_t kk0 = 0; kk0 < QuantWeight::kBlock; kk0 += P) {
#pragma GCC unroll 4
          for (int64_t p = 0; p < P; ++p) {
            const int64_t kk = kk0 + p;
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kk * QuantWeight::kTile));
            const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
            for (int64_t r = 0; r < R; ++r) {
              part[r][p] = _mm512_fmadd_ps(wv, _mm512_set1_ps(a.x[r * w.K + k0 + kk]), part[r][p]);
            }
          }
        }
        continue;
      }
      for (int64_t octet = 0; octet < QuantWeight::kBlock / 8; ++octet) {
        const __m512i words = load_octet(blk, octet);
#pragma GCC unroll 4
        for (int64_t s = 0; s < 4; ++s) {
          const __m512i shifted = _mm512_srli_epi32(words, 4 * s);
          const __m512 we = _mm512_cvtepi32_ps(_mm512_and_si512(shifted, nibble));
          const __m512 wo = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(shifted, 16), nibble));
          for (int64_t r = 0; r < R; ++r) {
            const float* x = a.x + r * w.K + k0 + 8 * octet + 2 * s;
            __m512& sum = part[r][s % P];
            sum = _mm512_fmadd_ps(we, _mm512_set1_ps(x[0]), sum);
            sum = _mm512_fmadd_ps(wo, _mm512_set1_ps(x[1]), sum);
          }
        }
      }
    }
    const __m512 dv = load_f16(w.d + (t * groups + g) * QuantWeight::kTile);
    for (int64_t r = 0; r < R; ++r) {
      __m512 sum = part[r][0];
      for (int64_t p = 1; p < P; ++p) sum = _mm512_add_ps(sum, part[r][p]);
      acc[r] = _mm512_fmadd_ps(sum, dv, acc[r]);
    }
    if (w.bits == 4) {
      const __m512 mv = load_f16(w.m + (t * groups + g) * QuantWeight::kTile);
      for (int64_t r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.xsum[r * groups + g]), acc[r]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) store_lanes(w, t, acc[r], out, r);
}

#ifdef PAGEDSERVE_QUANT_BF16
// ---------------------------------------------------------------------------------------
// AVX512-BF16 path, 4-bit weights and bfloat16 activations (see the header comment).

template <int64_t R>
void tile_bf16(const QuantWeight& w, int64_t t, const QuantRows& a,
                                             QuantOut out) {
  constexpr int64_t P = kPartials<R>;
  const int64_t groups = w.groups(), blocks_per_group = w.group / QuantWeight::kBlock;
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  const __m512i bf16_128 = _mm512_set1_epi32(0x43004300);
  __m512 acc[R], part[R][P];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t p = 0; p < P; ++p) part[r][p] = _mm512_setzero_ps();
    }
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      const uint8_t* blk = w.block(t, b);
      prefetch_ahead(w, blk);
      const int64_t k0 = b * QuantWeight::kBlock;
      for (int64_t octet = 0; octet < QuantWeight::kBlock / 8; ++octet) {
        const __m512i words = load_octet(blk, octet);
#pragma GCC unroll 4
        for (int64_t s = 0; s < 4; ++s) {
          // (words >> 4s) & 0x000F000F | 0x43004300: row i's (128 + q[k], 128 + q[k + 1]).
          const __m512bh wv = (__m512bh)_mm512_ternarylogic_epi32(
              _mm512_srli_epi32(words, 4 * s), nibbles, bf16_128, 0xEA);
#pragma GCC unroll 8
          for (int64_t r = 0; r < R; ++r) {
            int32_t x_pair;
            std::memcpy(&x_pair, a.xb + r * w.K + k0 + 8 * octet + 2 * s, sizeof(x_pair));
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(x_pair);
            part[r][s % P] = _mm512_dpbf16_ps(part[r][s % P], wv, xv);
          }
        }
      }
    }
    const __m512 dv = load_f16(w.d + (t * groups + g) * QuantWeight::kTile);
    const __m512 mv = load_f16(w.m + (t * groups + g) * QuantWeight::kTile);
    const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), dv, mv);  // m - 128 d
    for (int64_t r = 0; r < R; ++r) {
      __m512 sum = part[r][0];
      for (int64_t p = 1; p < P; ++p) sum = _mm512_add_ps(sum, part[r][p]);
      acc[r] = _mm512_fmadd_ps(sum, dv, acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(a.xsum[r * groups + g]), acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) store_lanes(w, t, acc[r], out, r);
}

#endif  // PAGEDSERVE_QUANT_BF16

void tile_rows_f32(const QuantWeight& w, int64_t t, const QuantRows& a, QuantOut out) {
  PAGEDSERVE_ROW_SWITCH(tile_f32)
}

#ifdef PAGEDSERVE_QUANT_BF16
void tile_rows_bf16(const QuantWeight& w, int64_t t, const QuantRows& a, QuantOut out) {
  PAGEDSERVE_ROW_SWITCH(tile_bf16)
}
#endif
#endif  // PAGEDSERVE_QUANT_AVX512

TileKernel kernel_for(const QuantWeight& w, const QuantRows& rows) {
#ifdef PAGEDSERVE_QUANT_BF16
  if (rows.xb != nullptr && w.bits == 4) return tile_rows_bf16;
#endif
#ifdef PAGEDSERVE_QUANT_AVX512
  return tile_rows_f32;
#elif defined(PAGEDSERVE_QUANT_AVX2)
  return tile_rows_avx2;
#else
  (void)w;
  (void)rows;
  return tile_portable;
#endif
}

}  // namespace

void quant_tiles(const QuantWeight& w, const QuantRows& rows, QuantOut out, int64_t begin,
                 int64_t end) {
  const TileKernel kernel = kernel_for(w, rows);
  for (int64_t t = begin; t < end; ++t) kernel(w, t, rows, out);
}

// ---------------------------------------------------------------------------------------
// Rows of bfloat16 x as int16 with a power-of-two scale per block of 32, for the AVX2
// integer path (kernels.h's QuantRows, quant_avx2.h): the scale 2^(e - 15), for the block's
// largest |x| = f 2^e with f in [0.5, 1), keeps every integer under 2^15 and every value
// whose exponent is within 7 of the largest's exact (bfloat16 has 8 significant bits); a
// smaller one rounds off at most 2^-16 of the block's largest. A block with an infinity or
// NaN gets a NaN scale and zeros, so its rows' outputs are NaN as in float arithmetic; a
// zero block gets a zero scale and zeros.

namespace {

// The integers of one block whose largest |x| is amax > 0 (finite); returns the scale.
// x is multiplied by two power-of-two factors, so that neither overflows float32 for the
// tiniest blocks: each product is exact, and the conversion rounds to nearest even.
inline float int16_block(const float* v, float amax, int16_t* q) {
  int e = 0;
  std::frexp(amax, &e);
  const float high = std::ldexp(1.f, std::min(15 - e, 100));
  const float low = std::ldexp(1.f, std::max(15 - e - 100, 0));
#ifdef PAGEDSERVE_QUANT_AVX2
  const __m256i top = _mm256_set1_epi32(32767), bottom = _mm256_set1_epi32(-32767);
  __m256i words[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 scaled = _mm256_mul_ps(
        _mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), _mm256_set1_ps(high)), _mm256_set1_ps(low));
    words[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(scaled), top), bottom);
  }
  for (int i = 0; i < 2; ++i) {  // packs interleaves 128-bit halves: put them back in order
    const __m256i packed = _mm256_packs_epi32(words[2 * i], words[2 * i + 1]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * i),
                        _mm256_permute4x64_epi64(packed, 0xD8));
  }
#else
  for (int64_t i = 0; i < QuantWeight::kBlock; ++i) {
    const long r = std::lrint(v[i] * high * low);
    q[i] = static_cast<int16_t>(std::clamp(r, -32767L, 32767L));
  }
#endif
  return std::ldexp(1.f, e - 15);
}

// The largest |x| of a block, or NaN when it holds an infinity or NaN.
inline float block_amax(const float* v) {
#ifdef PAGEDSERVE_QUANT_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps(), inf_or_nan = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    const __m256 x = _mm256_loadu_ps(v + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x));
    inf_or_nan = _mm256_add_ps(inf_or_nan, _mm256_sub_ps(x, x));  // NaN unless finite
  }
  if (_mm256_movemask_ps(_mm256_cmp_ps(inf_or_nan, inf_or_nan, _CMP_UNORD_Q)) != 0) {
    return std::numeric_limits<float>::quiet_NaN();
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#else
  float amax = 0.f;
  for (int64_t i = 0; i < QuantWeight::kBlock; ++i) {
    if (!std::isfinite(v[i])) return std::numeric_limits<float>::quiet_NaN();
    amax = std::max(amax, std::abs(v[i]));
  }
  return amax;
#endif
}

}  // namespace

void quant_rows_int16(const float* x, int64_t M, int64_t K, int16_t* xq, float* scale) {
  constexpr int64_t kBlock = QuantWeight::kBlock;
  for (int64_t blk = 0; blk < M * (K / kBlock); ++blk) {
    const float* v = x + blk * kBlock;
    int16_t* q = xq + blk * kBlock;
    const float amax = block_amax(v);
    if (!(amax > 0.f)) {  // zeros, or an infinity or NaN
      std::fill_n(q, kBlock, int16_t{0});
      scale[blk] = amax;
      continue;
    }
    scale[blk] = int16_block(v, amax, q);
  }
}

}  // namespace pagedserve::PAGEDSERVE_ISA

// bfloat16 linear layers on the CPU, y = x W^T. Built for decode-sized steps (a few rows of
// x against a weight read once per step, so the speed is the memory's), and blocked so
// that prefill-sized steps keep pace with oneDNN's GEMM too.
//
// Layout (made by engine/models/layers.py's tile_bf16_weight): 16 output rows form a tile,
// and within a tile, for each pair of k, the 16 rows' weights at k and k + 1 lie side by
// side: (tiles, K/2, 16, 2). One 64-byte load is then one vdpbf16ps operand whose lane i is
// row i's pair, and the broadcast activation pair (x[k], x[k+1]) is the other: lane i adds
// row i's two products. A tile's outputs accumulate lane-wise, with no horizontal sums, and
// each weight vector loaded serves every row of x in the pass.
//
//   sum_k w[n, k] x[k]: each product of two bfloat16 numbers is exact in float32, and the
//   sums are float32, as in oneDNN's bfloat16 matmul; only the order of additions differs.
//
// At one row of x the loop is a load and a dot product per 64 bytes, so it runs at the
// memory's speed: 1.4-1.75x oneDNN's packed bfloat16 GEMM on this layout's test machine
// (benchmarks/bf16_linear.py), and within 6% of it at 512 rows.
//
// Compiled once per instruction set (kernels.h): the dot-product path exists in the
// AVX512_BF16 set, a float32 FMA path on the same layout in the AVX2 set
// (bf16_linear_avx2.h); every set has the portable loop, the reference for their arithmetic
// in the tests. The model tiles its weights only where one of the two runs
// (layers.bf16_tileable); other CPUs keep oneDNN.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "simd_avx512.h"
#define PAGEDSERVE_BF16_DOT 1
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#include <vector>
#define PAGEDSERVE_BF16_AVX2 1
#endif

namespace pagedserve::PAGEDSERVE_ISA {
namespace {

// Steps of up to kOnePassRows rows read each tile once, in one pass of all their rows, one
// tile at a time: a single stream of weights a thread, each line of it used by every row
// as it arrives. Larger steps, whose arithmetic outweighs the weights' reading, make
// passes of kRows rows over a pair of tiles: each broadcast activation pair then serves two
// weight vectors, and the later passes read the pair from the cache.
//
// The pairs had run every step of 4 rows or more. Streamed from memory (a whole model's
// weights, benchmarks/bf16_linear.py; one process switching between the two layouts on
// every pass, on a Zen 5 VM, AVX512-BF16, 2 threads), one pass of single tiles took 4.67
// against 5.55 ms at 4 rows, 4.88 against 6.28 at 8, 5.10 against 6.75 at 12, 5.53 against
// 6.55 at 14 and 5.96 against 6.64 at 16 (1 row: 4.40); from 20 rows on the two were even,
// and single tiles in passes of 8 or 16 rows were 5-26% slower. Offline decode steps of the
// default model in bf16 (one process switching on every generate call, six rounds): 4
// streams 10.78 -> 9.50 ms, 8 12.01 -> 11.07, 12 12.96 -> 11.70, 16 14.09 -> 13.33; Q4_1
// at 16 streams, on its dense copy, 14.80 -> 13.95.
constexpr int64_t kOnePassRows = 16;
// Rows per pass over a pair of tiles: 24 accumulators, two weight vectors and a broadcast
// fit the 32 registers. Against passes of 8 (16 accumulators), the same streamed layers,
// one process switching on every pass: 20 rows 8.05 -> 7.22 ms, 24 8.41 -> 7.69, 32 10.27
// -> 9.55, 64 17.69 -> 17.10, 128 32.68 -> 30.89, 512 123.27 -> 116.88 (929 GFLOP/s);
// passes of 10 gained less.
constexpr int64_t kRows = 12;

// Rounds to bfloat16, nearest even, as c10::BFloat16's conversion does.
inline uint16_t round_bf16(float f) {
  return c10::BFloat16(f).x;
}

[[maybe_unused]] void tile_portable(const Bf16Weight& w, int64_t t, const c10::BFloat16* x,
                                    int64_t rows, Bf16Out y) {
  const int64_t n0 = t * Bf16Weight::kTile, count = std::min(Bf16Weight::kTile, w.N - n0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < count; ++i) {
      float acc = 0.f;
      for (int64_t k = 0; k < w.K; ++k) {
        acc += w.value(n0 + i, k) * static_cast<float>(x[r * w.K + k]);
      }
      y.put(r * w.N + n0 + i, round_bf16(acc));
    }
  }
}

#ifdef PAGEDSERVE_BF16_DOT

// How far ahead of the weights being read to ask for them, into L2: built each way
// (benchmarks/bf16_linear.py), 8 KB into L2 ran 10-12% faster at 1-8 rows than 4 KB into
// L1, which had itself helped at 4 rows over none. A prefetch past the end never faults.
constexpr int64_t kPrefetchAhead = 8192;

// Stores a tile's 16 float32 lanes as bfloat16 (nearest even), the first `count` of them;
// or, for a float32 output, the rounded numbers as float32. A streamed output's whole
// tiles bypass the caches (bf16_tiles fences them).
inline void store_bf16(Bf16Out dst, __m512 lanes, int64_t count) {
  if (dst.stream && count == Bf16Weight::kTile) {
    if (dst.f32) {
      _mm512_stream_ps(static_cast<float*>(dst.data), avx512::rounded_to_bf16(lanes));
    } else {
      _mm256_stream_si256(static_cast<__m256i*>(dst.data), avx512::to_bf16(lanes));
    }
    return;
  }
  const auto mask = static_cast<__mmask16>((1u << count) - 1);
  if (dst.f32) {
    _mm512_mask_storeu_ps(dst.data, mask, avx512::rounded_to_bf16(lanes));
    return;
  }
  _mm256_mask_storeu_epi16(dst.data, mask, avx512::to_bf16(lanes));
}

// Tiles t..t+T-1 (T = 1 or 2) for R rows of x. With two tiles, each broadcast activation
// pair serves both tiles' weight vectors: fewer loads per dot product, for steps of many rows.
template <int64_t R, int64_t T>
void tiles_dot(const Bf16Weight& w, int64_t t, const c10::BFloat16* x, Bf16Out y,
               int64_t ahead) {
  // With few rows, alternate partial sums so consecutive dot products do not wait on each
  // other's latency.
  constexpr int64_t P = R * T >= 4 ? 1 : (R * T >= 2 ? 2 : 4);
  const int64_t pairs = w.K / 2;
  __m512 acc[T][R][P];
  for (int64_t j = 0; j < T; ++j) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t p = 0; p < P; ++p) acc[j][r][p] = _mm512_setzero_ps();
    }
  }
  // x's pair k / 2 of row r, as the int32 that vpbroadcastd repeats.
  auto x_pair = [&](int64_t r, int64_t pair) {
    int32_t v;
    std::memcpy(&v, x + r * w.K + 2 * pair, sizeof(v));
    return (__m512bh)_mm512_set1_epi32(v);
  };
  auto step = [&](int64_t pair, int64_t p) {
    __m512bh wv[T];
    for (int64_t j = 0; j < T; ++j) {
      const c10::BFloat16* line = w.tile(t + j) + pair * 2 * Bf16Weight::kTile;
      if (ahead != 0) _mm_prefetch(reinterpret_cast<const char*>(line) + ahead, _MM_HINT_T1);
      wv[j] = (__m512bh)_mm512_loadu_si512(line);
    }
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh xv = x_pair(r, pair);
      for (int64_t j = 0; j < T; ++j) acc[j][r][p] = _mm512_dpbf16_ps(acc[j][r][p], wv[j], xv);
    }
  };
  int64_t pair = 0;
  for (; pair + P <= pairs; pair += P) {
#pragma GCC unroll 4
    for (int64_t p = 0; p < P; ++p) step(pair + p, p);
  }
  for (; pair < pairs; ++pair) step(pair, 0);
  for (int64_t j = 0; j < T; ++j) {
    const int64_t n0 = (t + j) * Bf16Weight::kTile;
    const int64_t count = std::min(Bf16Weight::kTile, w.N - n0);
    for (int64_t r = 0; r < R; ++r) {
      __m512 sum = acc[j][r][0];
      for (int64_t p = 1; p < P; ++p) sum = _mm512_add_ps(sum, acc[j][r][p]);
      store_bf16(y.at(r * w.N + n0), sum, count);
    }
  }
}

template <int64_t T>
void tiles_rows(const Bf16Weight& w, int64_t t, const c10::BFloat16* x, int64_t rows,
                Bf16Out y, int64_t ahead) {
  if constexpr (T == 1) {  // one pass of up to kOnePassRows rows
    switch (rows) {
      case 16: return tiles_dot<16, 1>(w, t, x, y, ahead);
      case 15: return tiles_dot<15, 1>(w, t, x, y, ahead);
      case 14: return tiles_dot<14, 1>(w, t, x, y, ahead);
      case 13: return tiles_dot<13, 1>(w, t, x, y, ahead);
      default: break;
    }
  }
  switch (rows) {  // up to kRows rows over a pair of tiles: 24 accumulators
    case 12: return tiles_dot<12, T>(w, t, x, y, ahead);
    case 11: return tiles_dot<11, T>(w, t, x, y, ahead);
    case 10: return tiles_dot<10, T>(w, t, x, y, ahead);
    case 9: return tiles_dot<9, T>(w, t, x, y, ahead);
    case 8: return tiles_dot<8, T>(w, t, x, y, ahead);
    case 7: return tiles_dot<7, T>(w, t, x, y, ahead);
    case 6: return tiles_dot<6, T>(w, t, x, y, ahead);
    case 5: return tiles_dot<5, T>(w, t, x, y, ahead);
    case 4: return tiles_dot<4, T>(w, t, x, y, ahead);
    case 3: return tiles_dot<3, T>(w, t, x, y, ahead);
    case 2: return tiles_dot<2, T>(w, t, x, y, ahead);
    default: return tiles_dot<1, T>(w, t, x, y, ahead);
  }
}

// Tiles t..t+count-1 (count = 1 or 2) for `rows` rows, the rows' pass `pass` over them.
// The first pass reads the weights from memory, asking kPrefetchAhead bytes ahead. The
// second (steps of over kOnePassRows rows), whose weights are in the cache already, asks
// for the next tiles' weights (at the same offsets), so that the memory keeps streaming
// while the rows compute: when 16 rows ran as two passes, the two had taken about the sum
// of their times, not the larger. Later passes ask for nothing.
void tile_rows(const Bf16Weight& w, int64_t t, int64_t count, const c10::BFloat16* x,
               int64_t rows, Bf16Out y, int64_t pass) {
  const int64_t ahead = pass == 0   ? kPrefetchAhead
                        : pass == 1 ? count * w.K * Bf16Weight::kTile * 2
                                    : 0;
  if (count == 2) return tiles_rows<2>(w, t, x, rows, y, ahead);
  tiles_rows<1>(w, t, x, rows, y, ahead);
}

#elif defined(PAGEDSERVE_BF16_AVX2)
#include "bf16_linear_avx2.h"
#else

void tile_rows(const Bf16Weight& w, int64_t t, int64_t count, const c10::BFloat16* x,
               int64_t rows, Bf16Out y, int64_t /*pass*/) {
  for (int64_t j = 0; j < count; ++j) tile_portable(w, t + j, x, rows, y);
}

#endif  // PAGEDSERVE_BF16_DOT

}  // namespace

#ifdef PAGEDSERVE_BF16_AVX2
void bf16_tiles(const Bf16Weight& w, const c10::BFloat16* x, int64_t M, Bf16Out y,
                TileClaims& claims) {
  avx2_tiles(w, x, M, y, claims);
}
#else
void bf16_tiles(const Bf16Weight& w, const c10::BFloat16* x, int64_t M, Bf16Out y,
                TileClaims& claims) {
  // Tile-major: one tile in one pass of every row, up to kOnePassRows; past that, a pair of
  // tiles' weights (K * 64 bytes) stay in the cache for every pass of kRows rows.
  const bool one_pass = M <= kOnePassRows;
  const int64_t step = one_pass ? 1 : 2, pass_rows = one_pass ? M : kRows;
  for (int64_t begin, end; claims.claim(begin, end);) {
    for (int64_t t = begin; t < end; t += step) {
      const int64_t count = std::min(step, end - t);
      for (int64_t r0 = 0; r0 < M; r0 += pass_rows) {
        tile_rows(w, t, count, x + r0 * w.K, std::min(pass_rows, M - r0), y.at(r0 * w.N),
                  r0 / pass_rows);
      }
    }
  }
#ifdef PAGEDSERVE_BF16_DOT
  if (y.stream) _mm_sfence();  // the streamed stores land before the task is counted done
#endif
}
#endif

// The LM head's screen (bf16_linear_ops.cpp): rows of int8 weights against rows of int16
// activations, in integers, so every set gives the same sums. Pairs of int16 products go
// into int32 lanes (vpmaddwd, which AVX-512BW and AVX2 both have), four weight rows at a
// time against each activation row, the weights widened once for all of those rows.
namespace {

// How far ahead to ask for the rows, into L2, a line at a time. (A prefetch per 32 bytes of
// each row, twice per line, took the loop from 91 to 65 GB/s on one Zen 5 core with the rows
// in L2; none at all left a step's screen from memory slower at 2 to 8 rows.)
constexpr int64_t kDotsAhead = 8192;

template <int64_t R>
void int8_dots_rows(const int8_t* q, int64_t K, const int16_t* x, int64_t rows,
                    int32_t* out) {
  constexpr int64_t G = 4;  // weight rows at a time
  int64_t r = 0;
#if defined(__AVX512BW__)
  for (; r + G <= rows; r += G) {
    __m512i acc[G][R];
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t m = 0; m < R; ++m) acc[g][m] = _mm512_setzero_si512();
    }
    for (int64_t k = 0; k < K; k += 32) {
      // The G rows are one run of G K bytes, read in K / 32 steps: two lines a step ask for
      // the run kDotsAhead bytes on, each line once.
      const char* ahead = reinterpret_cast<const char*>(q + r * K) + kDotsAhead + k * G;
      _mm_prefetch(ahead, _MM_HINT_T1);
      _mm_prefetch(ahead + 64, _MM_HINT_T1);
      __m512i w[G];
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* line = q + (r + g) * K + k;
        w[g] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line)));
      }
      for (int64_t m = 0; m < R; ++m) {
        const __m512i xv = _mm512_loadu_si512(x + m * K + k);
        for (int64_t g = 0; g < G; ++g) {
          acc[g][m] = _mm512_add_epi32(acc[g][m], _mm512_madd_epi16(w[g], xv));
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t m = 0; m < R; ++m) out[m * rows + r + g] = _mm512_reduce_add_epi32(acc[g][m]);
    }
  }
#elif defined(__AVX2__)
  for (; r + G <= rows; r += G) {
    __m256i acc[G][R];
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t m = 0; m < R; ++m) acc[g][m] = _mm256_setzero_si256();
    }
    for (int64_t k = 0; k < K; k += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(q + r * K) + kDotsAhead + k * G, _MM_HINT_T1);
      __m256i w[G];
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* line = q + (r + g) * K + k;
        w[g] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line)));
      }
      for (int64_t m = 0; m < R; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K + k));
        for (int64_t g = 0; g < G; ++g) {
          acc[g][m] = _mm256_add_epi32(acc[g][m], _mm256_madd_epi16(w[g], xv));
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t m = 0; m < R; ++m) {
        const __m128i v = _mm_add_epi32(_mm256_castsi256_si128(acc[g][m]),
                                        _mm256_extracti128_si256(acc[g][m], 1));
        const __m128i h = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
        out[m * rows + r + g] = _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
      }
    }
  }
#endif
  for (; r < rows; ++r) {  // the rest, and every row of the portable set
    for (int64_t m = 0; m < R; ++m) {
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += int32_t{q[r * K + k]} * x[m * K + k];
      out[m * rows + r] = sum;
    }
  }
}

}  // namespace

void int8_row_dots(const int8_t* q, int64_t K, const int16_t* x, int64_t M, int64_t rows,
                   int32_t* out) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int16_t* xm = x + m0 * K;
    int32_t* om = out + m0 * rows;
    switch (std::min<int64_t>(4, M - m0)) {
      case 4: int8_dots_rows<4>(q, K, xm, rows, om); break;
      case 3: int8_dots_rows<3>(q, K, xm, rows, om); break;
      case 2: int8_dots_rows<2>(q, K, xm, rows, om); break;
      default: int8_dots_rows<1>(q, K, xm, rows, om); break;
    }
  }
}

}  // namespace pagedserve::PAGEDSERVE_ISA

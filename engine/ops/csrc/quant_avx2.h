// The quantized linear's AVX2 tiles (quant_kernels.cpp has the layout and the arithmetic's
// contract). Included by quant_kernels.cpp inside its namespace, in the AVX2 set only: the
// AVX-512 sets have their own paths.
//
// A 256-bit vector holds 8 of a tile's 16 rows, so every tile is two halves, rows 0..7 and
// 8..15. Both block layouts unpack to the same shape, int16 pairs per row:
//
//   lane r of `lo` (32 bits) = (w[r, k], w[r, k + 1]),  lane r of `hi` = rows 8 + r
//
//   8-bit: k's 16 bytes, then k + 1's: interleaving the two gives rows 0..7 then 8..15;
//   4-bit: the octet's 64 bytes are rows 0..7's 32-bit words then rows 8..15's, and a word
//          shifted right by 4s and masked with 0x000F000F is the pair at k = 8 octet + 2s.
//
// bfloat16 input runs the integer path: x as int16 with a power-of-two scale per block
// (QuantRows::xq), one vpmaddwd per 8 rows and pair of k, and the block's int32 sums (exact:
// |q x| < 2^22, 32 of them) scaled in float32 once per block. float32 input runs the float
// path: the pairs split into float32 k and k + 1 vectors, multiplied by the broadcast x[k]
// and x[k + 1] with float32 FMAs, so its products and sums are float32's, as the portable
// loop's are.

// 8 KB into L2 streamed a whole model's int4 layers at one row in 6.7-7.9 ms on one thread,
// against 9.8-10.8 ms at 4 KB into L1 and 7.4-7.8 ms at 16 KB (benchmarks/quant_kernels.py).
constexpr int64_t kAvx2PrefetchAhead = 8192;

// The pair'th k pair of an 8-bit or 4-bit block, as int16 pairs per row (see above).
template <int Bits>
inline void unpack_pairs(const uint8_t* blk, int64_t pair, __m256i* lo, __m256i* hi) {
  constexpr int64_t kTile = QuantWeight::kTile;
  if constexpr (Bits == 8) {
    const __m128i k0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 * pair * kTile));
    const __m128i k1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (2 * pair + 1) * kTile));
    *lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(k0, k1));
    *hi = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(k0, k1));
  } else {
    const auto* octet = reinterpret_cast<const __m256i*>(blk + pair / 4 * 4 * kTile);
    const int shift = 4 * static_cast<int>(pair % 4);
    const __m256i nibbles = _mm256_set1_epi32(0x000F000F);
    *lo = _mm256_and_si256(_mm256_srli_epi32(_mm256_loadu_si256(octet), shift), nibbles);
    *hi = _mm256_and_si256(_mm256_srli_epi32(_mm256_loadu_si256(octet + 1), shift), nibbles);
  }
}

// step(pair) for a block's 16 k pairs in order. For 4 bits, four at a time per octet, so
// that each shift count (4 * (pair % 4)) is known while compiling (a plain loop left them
// in registers, 25-35% slower at one row); 8-bit blocks keep the plain loop they had.
template <int Bits, typename F>
inline void for_each_pair(const F& step) {
  if constexpr (Bits == 8) {
#pragma GCC unroll 4
    for (int64_t pair = 0; pair < QuantWeight::kBlock / 2; ++pair) step(pair);
  } else {
    for (int64_t octet = 0; octet < QuantWeight::kBlock / 8; ++octet) {
#pragma GCC unroll 4
      for (int64_t s = 0; s < 4; ++s) step(4 * octet + s);
    }
  }
}

inline void prefetch_block(const QuantWeight& w, const uint8_t* blk) {
  // A decode step streams the weights from memory once: ask for them ahead, into L2.
  const char* ahead = reinterpret_cast<const char*>(blk) + kAvx2PrefetchAhead;
  for (int64_t line = 0; line < w.block_bytes(); line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
}

// The group's float16 scales (or mins) of a tile's two halves.
inline void load_halves(const c10::Half* p, __m256* h) {
  h[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  h[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}

// Adds the group's d * part (+ m * xsum for 4 bits) to acc, for R rows and both halves.
template <int Bits, int64_t R>
inline void close_group(const QuantWeight& w, int64_t t, int64_t g, const QuantRows& a,
                        __m256 (&part)[R][2], __m256 (&acc)[R][2]) {
  const int64_t at = (t * w.groups() + g) * QuantWeight::kTile;
  __m256 d[2], m[2];
  load_halves(w.d + at, d);
  if constexpr (Bits == 4) load_halves(w.m + at, m);
  for (int64_t r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      acc[r][h] = _mm256_fmadd_ps(part[r][h], d[h], acc[r][h]);
      if constexpr (Bits == 4) {
        acc[r][h] = _mm256_fmadd_ps(m[h], _mm256_set1_ps(a.xsum[r * w.groups() + g]), acc[r][h]);
      }
    }
  }
}

template <int64_t R>
inline void store_halves(const QuantWeight& w, int64_t t, __m256 (&acc)[R][2], QuantOut out) {
  alignas(32) float lanes[QuantWeight::kTile];
  for (int64_t r = 0; r < R; ++r) {
    _mm256_store_ps(lanes, acc[r][0]);
    _mm256_store_ps(lanes + 8, acc[r][1]);
    store_tile(w, t, lanes, out, r);
  }
}

template <int Bits, int64_t R>
void tile_int_avx2(const QuantWeight& w, int64_t t, const QuantRows& a, QuantOut out) {
  const int64_t groups = w.groups(), blocks = w.blocks(), per_group = w.group / QuantWeight::kBlock;
  __m256 acc[R][2], part[R][2];
  __m256i sum[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm256_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const uint8_t* blk = w.block(t, b);
      prefetch_block(w, blk);
      const int16_t* xq = a.xq + b * QuantWeight::kBlock;
      for (int64_t r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
      for_each_pair<Bits>([&](int64_t pair) {
        __m256i lo, hi;
        unpack_pairs<Bits>(blk, pair, &lo, &hi);
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) {
          int32_t x_pair;
          std::memcpy(&x_pair, xq + r * w.K + 2 * pair, sizeof(x_pair));
          const __m256i xv = _mm256_set1_epi32(x_pair);
          sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(lo, xv));
          sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(hi, xv));
        }
      });
      for (int64_t r = 0; r < R; ++r) {
        const __m256 scale = _mm256_set1_ps(a.xq_scale[r * blocks + b]);
        for (int h = 0; h < 2; ++h) {
          part[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), scale, part[r][h]);
        }
      }
    }
    close_group<Bits, R>(w, t, g, a, part, acc);
  }
  store_halves<R>(w, t, acc, out);
}

template <int Bits, int64_t R>
void tile_f32_avx2(const QuantWeight& w, int64_t t, const QuantRows& a, QuantOut out) {
  const int64_t groups = w.groups(), per_group = w.group / QuantWeight::kBlock;
  __m256 acc[R][2], part[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm256_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const uint8_t* blk = w.block(t, b);
      prefetch_block(w, blk);
      const float* x = a.x + b * QuantWeight::kBlock;
      for_each_pair<Bits>([&](int64_t pair) {
        __m256i halves[2];
        unpack_pairs<Bits>(blk, pair, &halves[0], &halves[1]);
        for (int h = 0; h < 2; ++h) {
          // Each lane's low int16 is k's weight, its high one k + 1's.
          const __m256 even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(halves[h], 16), 16));
          const __m256 odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(halves[h], 16));
          for (int64_t r = 0; r < R; ++r) {
            const float* xr = x + r * w.K + 2 * pair;
            part[r][h] = _mm256_fmadd_ps(even, _mm256_set1_ps(xr[0]), part[r][h]);
            part[r][h] = _mm256_fmadd_ps(odd, _mm256_set1_ps(xr[1]), part[r][h]);
          }
        }
      });
    }
    close_group<Bits, R>(w, t, g, a, part, acc);
  }
  store_halves<R>(w, t, acc, out);
}

// The 4-bit integer path for one row of x (a decode), where unpacking is much of the work:
// tile_int_avx2 ran a decode at about 15 GB/s a thread whether its weights came from memory
// or from L2, bound by its instructions. Here an octet's four pairs come out of its words
// with one operation each rather than a shift and a mask:
//
//   s = 0: word & 0x000F000F      (q, q')       into sum1
//   s = 1: word & 0x00F000F0      16 (q, q')    into sum16
//   s = 2: word & 0x0F000F00      256 (q, q')   into sum256
//   s = 3: 16-bit halves >> 12    (q, q')       into sum1
//
// and the block's integer is sum1 + sum16 / 16 + sum256 / 256, each division exact (every
// term of sum16 is a multiple of 16, of sum256 of 256): the integer tile_int_avx2 gets, so
// a row's output has the same bits alone or in a batch. Within int32: sum256 adds 8
// products of at most 256 * 15 * 32767 a lane, under 2^30. (tile_int_avx2's block, as the
// compiler scheduled it, computed all 32 products first and spilled a third of them to the
// stack; here the six sums stay in registers.) A large Q4_1 weight streamed at 16-18
// against 12-15 GB/s on one AVX2 thread (Zen 3), 27-35 against 25-30 on two. Two rows
// gained nothing: their twelve sums and three masks do not fit the sixteen registers.
void tile_int4_one_row_avx2(const QuantWeight& w, int64_t t, const QuantRows& a, QuantOut out) {
  constexpr int64_t R = 1;  // close_group and store_halves take rows
  const int64_t groups = w.groups(), per_group = w.group / QuantWeight::kBlock;
  const __m256i mask1 = _mm256_set1_epi32(0x000F000F), mask16 = _mm256_set1_epi32(0x00F000F0);
  const __m256i mask256 = _mm256_set1_epi32(0x0F000F00);
  // Adds q . x to sum, where the compiler must leave it: it would otherwise regroup the
  // block's sums and spill the products.
  const auto add = [](__m256i& sum, __m256i q, __m256i x) {
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(q, x));
    asm("" : "+x"(sum));
  };
  __m256 acc[R][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}}, part[R][2];
  for (int64_t g = 0; g < groups; ++g) {
    part[0][0] = part[0][1] = _mm256_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const uint8_t* blk = w.block(t, b);
      prefetch_block(w, blk);
      const auto* xq = reinterpret_cast<const float*>(a.xq + b * QuantWeight::kBlock);
      __m256i sum1[2], sum16[2], sum256[2];
      for (int h = 0; h < 2; ++h) sum1[h] = sum16[h] = sum256[h] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int64_t octet = 0; octet < QuantWeight::kBlock / 8; ++octet) {
        const auto* words = reinterpret_cast<const __m256i*>(blk + octet * 4 * QuantWeight::kTile);
        const __m256i v[2] = {_mm256_loadu_si256(words), _mm256_loadu_si256(words + 1)};
        // (x[k], x[k + 1]) of pair s as one 32-bit lane, broadcast from memory.
        __m256i x[4];
        for (int s = 0; s < 4; ++s) {
          x[s] = _mm256_castps_si256(_mm256_broadcast_ss(xq + 4 * octet + s));
        }
        for (int h = 0; h < 2; ++h) {
          add(sum1[h], _mm256_and_si256(v[h], mask1), x[0]);
          add(sum16[h], _mm256_and_si256(v[h], mask16), x[1]);
          add(sum256[h], _mm256_and_si256(v[h], mask256), x[2]);
          add(sum1[h], _mm256_srli_epi16(v[h], 12), x[3]);
        }
      }
      const __m256 scale = _mm256_set1_ps(a.xq_scale[b]);
      for (int h = 0; h < 2; ++h) {
        const __m256i sum = _mm256_add_epi32(
            _mm256_add_epi32(sum1[h], _mm256_srai_epi32(sum16[h], 4)),
            _mm256_srai_epi32(sum256[h], 8));
        part[0][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, part[0][h]);
      }
    }
    close_group<4, R>(w, t, g, a, part, acc);
  }
  store_halves<R>(w, t, acc, out);
}

template <int64_t R>
void tile_int8_avx2(const QuantWeight& w, int64_t t, const QuantRows& a, QuantOut out) {
  tile_int_avx2<8, R>(w, t, a, out);
}
template <int64_t R>
void tile_int4_avx2(const QuantWeight& w, int64_t t, const QuantRows& a, QuantOut out) {
  if constexpr (R == 1) {
    tile_int4_one_row_avx2(w, t, a, out);
  } else {
    tile_int_avx2<4, R>(w, t, a, out);
  }
}
template <int64_t R>
void tile_f32_8_avx2(const QuantWeight& w, int64_t t, const QuantRows& a, QuantOut out) {
  tile_f32_avx2<8, R>(w, t, a, out);
}
template <int64_t R>
void tile_f32_4_avx2(const QuantWeight& w, int64_t t, const QuantRows& a, QuantOut out) {
  tile_f32_avx2<4, R>(w, t, a, out);
}
